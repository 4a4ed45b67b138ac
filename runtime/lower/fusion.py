"""Elementwise loops fused into the loops that read them, once unit dimensions are gone.

MLIR's `linalg-fuse-elementwise-ops` runs while the module still has the unit dimensions of
TOSA's keep-dim reductions: a batch norm's squared deviations [N, C, HW] and their sum, which
reads them as [N, 1, C, 1, HW], stay two loops and a buffer between them. Dropping unit
dimensions ("unit-dims") puts such pairs in one shape. This fuses them then, as that pass would,
but without its reshape propagation, which would also move the reshapes that dropping the unit
dimensions left around named ops into them (turning batch matmuls into generic contractions).

A producer is fused when it is an elementwise linalg.generic (parallel loops, identity output
map, one result read once, no linalg.index, no region in its body) and its reader is a
linalg.generic reading it as an input element for element (a permutation: nothing computed
more than once). A conversion read by several such loops is first cloned for each
(`_split_conversions`: a batch norm's input widened to f64 for two sums), and a producer read
through a reshape is rebuilt in the reshaped shape (`_move_reshapes_up`).
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import linalg, tensor

from .irutil import clone_into, copy_body, dims_map, expand, find_ops, iterator_types

_CONVERSIONS = frozenset({"arith.extf", "arith.truncf", "arith.extsi", "arith.extui", "arith.trunci",
                          "arith.sitofp", "arith.uitofp"})
_RESHAPES = ("tensor.collapse_shape", "tensor.expand_shape")
_OWN_ATTRIBUTES = frozenset({"indexing_maps", "iterator_types", "operandSegmentSizes"})


def fuse_elementwise(module: ir.Module) -> None:
    """Fuse each fusable producer into the linalg.generic reading it (module docstring)."""
    with module.context:
        _split_conversions(module)
        _move_reshapes_up(module)
        for op in find_ops(module, lambda op: op.name == "linalg.generic"):
            op = op.opview
            while (i := next((i for i in range(len(op.inputs)) if _fusable(op, i)), None)) is not None:
                op = _fuse(op, i)


def _split_conversions(module: ir.Module) -> None:
    """Give each loop but the first that reads a conversion (a linalg.generic only converting the
    elements of its one input, such as f32 -> f64) element for element, directly or through a
    reshape, its own clone of it, to fuse: the converted tensor, twice the size of its source
    for f32 -> f64, is then neither written nor read back."""
    for op in find_ops(module, _conversion):
        for use in list(op.results[0].uses)[1:]:
            owner, number = use.owner, use.operand_number
            reader, read = owner, number
            if owner.name in _RESHAPES:
                uses = list(owner.results[0].uses)
                if len(uses) != 1:
                    continue
                reader, read = uses[0].owner, uses[0].operand_number
            if _reads_elementwise(reader, read):
                owner.operands[number] = op.clone(ip=ir.InsertionPoint(op)).results[0]


def _move_reshapes_up(module: ir.Module) -> None:
    """An elementwise loop read only through a reshape by a loop reading the reshaped tensor
    element for element becomes that loop over the reshaped shape, its operands reshaped
    instead: the two loops then have one shape, to fuse (a batch norm's normalization over
    [N, C, HW] and its scale and shift over [N, C, H, W])."""
    for reshape in find_ops(module, lambda op: op.name in _RESHAPES):
        source, result = reshape.operands[0], reshape.results[0]
        uses = list(result.uses)
        if (not _produced(source) or len(list(source.uses)) != 1 or len(uses) != 1
                or not _reads_elementwise(uses[0].owner, uses[0].operand_number)
                or not ir.RankedTensorType(result.type).has_static_shape or not _plain(source.owner.opview)):
            continue
        moved = _reshaped(source.owner.opview, reshape)
        if moved is not None:
            result.replace_all_uses_with(moved)
            reshape.erase()
            source.owner.erase()


def _reshaped(producer: linalg.GenericOp, reshape: ir.Operation) -> ir.Value | None:
    """`producer` computing `reshape` of its result, built before `reshape`: a collapse of a loop
    whose operands all have its shape, or an expansion of one whose operands are read through
    projected permutations (broadcasts). None for other cases."""
    groups = [[ir.IntegerAttr(i).value for i in ir.ArrayAttr(g)]
              for g in ir.ArrayAttr(reshape.attributes["reassociation"])]
    shape = ir.RankedTensorType(reshape.results[0].type)
    maps = _maps(producer)[:-1]
    expanding = reshape.name == "tensor.expand_shape"
    identity = ir.AffineMap.get_identity(_maps(producer)[-1].n_dims)
    if not all(m.is_projected_permutation if expanding else m == identity for m in maps):
        return None
    every = dims_map(shape.rank, list(range(shape.rank)))
    with reshape.location, ir.InsertionPoint(reshape):
        operands, new_maps = [], []
        for operand, m in zip(producer.inputs, maps, strict=True):
            if not expanding:
                operands.append(_reshape(reshape, operand, shape.shape))
                new_maps.append(every)
                continue
            dims = [e.position for e in m.results]  # a projected permutation's results are dimensions
            new_dims = [n for d in dims for n in groups[d]]
            new_maps.append(dims_map(shape.rank, new_dims))
            operand_groups, at = [], 0
            for d in dims:
                operand_groups.append(list(range(at, at + len(groups[d]))))
                at += len(groups[d])
            operands.append(expand(operand, operand_groups, [shape.shape[n] for n in new_dims]))
        element = ir.RankedTensorType(producer.results[0].type).element_type
        empty = tensor.empty(shape.shape, element)
        moved = linalg.GenericOp([ir.RankedTensorType.get(shape.shape, element)], operands, [empty],
                                 ir.ArrayAttr.get([*new_maps, every]), iterator_types(shape.rank))
        copy_body(producer, moved)
    return moved.results[0]


def _reshape(like: ir.Operation, operand: ir.Value, shape: list[int]) -> ir.Value:
    """`operand` reshaped as `like` reshapes its source (a clone of `like`, of `operand`'s elements)."""
    clone = like.clone()
    clone.operands[0] = operand
    clone.results[0].set_type(ir.RankedTensorType.get(shape, ir.ShapedType(operand.type).element_type))
    return clone.results[0]


def _elementwise(op: ir.Operation) -> bool:
    """A linalg.generic with parallel loops only."""
    return op.name == "linalg.generic" and "reduction" not in str(op.attributes["iterator_types"])


def _conversion(op: ir.Operation) -> bool:
    """An elementwise linalg.generic converting the elements of its one input."""
    if not _elementwise(op) or len(op.operands) != 2 or len(op.results) != 1:
        return False
    identity = ir.AffineMap.get_identity(_maps(op)[0].n_dims)
    if any(m != identity for m in _maps(op)):
        return False
    block = op.regions[0].blocks[0]
    body = list(block.operations)
    return len(body) == 2 and body[0].name in _CONVERSIONS and body[0].operands[0] == block.arguments[0]


def _produced(value: ir.Value) -> bool:
    """Whether `value` is an op's result (not a block argument)."""
    return not isinstance(value.owner, ir.Block)


def _maps(op: ir.Operation) -> list[ir.AffineMap]:
    return [ir.AffineMapAttr(m).value for m in ir.ArrayAttr(op.attributes["indexing_maps"])]


def _reads_elementwise(reader: ir.Operation, operand: int) -> bool:
    """Whether operand `operand` of `reader` is an input of a linalg.generic read through a permutation."""
    return (reader.name == "linalg.generic" and operand < len(reader.opview.inputs)
            and _maps(reader)[operand].is_permutation)


def _plain(op: ir.Operation) -> bool:
    """An elementwise linalg.generic of one result, written in order (identity output map), whose
    body neither reads the output, nor asks for loop indices, nor has regions."""
    if not _elementwise(op) or len(op.results) != 1:
        return False
    if _maps(op)[-1] != ir.AffineMap.get_identity(_maps(op)[-1].n_dims):
        return False
    block = op.regions[0].blocks[0]
    return not list(block.arguments[-1].uses) and not any(
        o.name == "linalg.index" or len(o.regions) for o in block.operations)


def _fusable(consumer: ir.Operation, i: int) -> bool:
    """Whether input `i` of `consumer` is the result of a producer to fuse into it."""
    value = consumer.inputs[i]
    if not _produced(value) or not _reads_elementwise(consumer, i):
        return False
    producer = value.owner.opview
    if not _plain(producer) or len(list(value.uses)) != 1:
        return False
    consumer_maps = _maps(consumer)
    n_inputs = len(consumer.inputs)
    inputs = [m for j, m in enumerate(consumer_maps[:n_inputs]) if j != i]
    inputs += [_compose(m, consumer_maps[i]) for m in _maps(producer)[:-1]]
    # a reduction keeps an input read element for element: a product of broadcasts summed
    # (a contraction of three operands, _trilinear's) is not one the schedule tiles
    if not _elementwise(consumer) and not any(m.is_permutation for m in inputs):
        return False
    # every loop must still be bounded by an operand (a reduction's loops by an input)
    bounded = {e.position for m in [*inputs, *consumer_maps[n_inputs:]] for e in m.results
               if isinstance(e, ir.AffineDimExpr)}
    return len(bounded) == consumer_maps[0].n_dims


def _compose(inner: ir.AffineMap, outer: ir.AffineMap) -> ir.AffineMap:
    """`inner` of the producer's loops as a map of the consumer's loops, which `outer` maps to them."""
    results = [e.compose(outer) for e in inner.results]
    return ir.AffineMap.get(outer.n_dims, 0, results)


def _fuse(consumer: ir.Operation, i: int) -> ir.Operation:
    """The consumer with its input `i`'s producer computed in its body, replacing both."""
    producer = consumer.inputs[i].owner.opview
    maps = _maps(consumer)
    producer_maps = [_compose(m, maps[i]) for m in _maps(producer)[:-1]]
    inputs = list(consumer.inputs)
    new_inputs = inputs[:i] + list(producer.inputs) + inputs[i + 1:]
    new_maps = maps[:i] + producer_maps + maps[i + 1:]
    with consumer.location, ir.InsertionPoint(consumer):
        fused = linalg.GenericOp([r.type for r in consumer.results], new_inputs, list(consumer.outputs),
                                 ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in new_maps]),
                                 consumer.attributes["iterator_types"])
    for name in consumer.attributes:
        if name not in _OWN_ATTRIBUTES:
            fused.attributes[name] = consumer.attributes[name]
    old = consumer.regions[0].blocks[0]
    inner = producer.regions[0].blocks[0]
    n_in = len(producer.inputs)
    arg_types = ([a.type for a in list(old.arguments)[:i]] + [a.type for a in list(inner.arguments)[:n_in]]
                 + [a.type for a in list(old.arguments)[i + 1:]])
    block = fused.regions[0].blocks.append(*arg_types, arg_locs=[consumer.location] * len(arg_types))
    args = list(block.arguments)
    mapping: dict[ir.Value, ir.Value] = dict(zip(list(inner.arguments)[:n_in], args[i:i + n_in], strict=True))
    ip = ir.InsertionPoint(block)
    *body, yielded = list(inner.operations)
    for op in body:
        clone_into(op, mapping, ip)
    mapping = {old.arguments[i]: mapping.get(yielded.operands[0], yielded.operands[0]),
               **dict(zip(list(old.arguments)[:i], args[:i], strict=True)),
               **dict(zip(list(old.arguments)[i + 1:], args[i + n_in:], strict=True))}
    for op in old.operations:
        clone_into(op, mapping, ip)
    for old_result, new_result in zip(consumer.results, fused.results, strict=True):
        old_result.replace_all_uses_with(new_result)
    consumer.erase()
    producer.erase()
    return fused
