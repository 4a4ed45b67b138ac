"""Split a long function into private functions of bounded size, called in sequence.

Several MLIR passes and LLVM's code generation take time that grows faster than the size of
the one function they work on, so a deep model (BERT of 8 layers) compiled as one function
took more than linear time in its depth. `partition(module)` cuts each function of more than
1.5 x PART_OPS top-level ops into consecutive parts of PART_OPS to 1.5 x PART_OPS ops, each
cut where the fewest values cross it (between a transformer's layers, only the residual
stream), and makes each part a private function `@<name>__part<i>` that the function calls.
Constants are cloned into every part that uses them, so they stay visible to folding and
shape verification. Values crossing a cut become arguments and results; a boolean one (a
transformer's attention mask, used by every layer) crosses as i8, cast on either side: an i1
buffer is one the LLVM lowering cannot store. The caller allocates a part's results, so one of
a dynamic shape is computed into an empty tensor the caller passes (`_destinations`: sized by
dims that fold into index arithmetic on the part's operands), and a prefill over a symbolic
number of tokens is cut between its layers too; where such a result is a concatenation of the
function's arguments and values of static shapes (a layer's KV cache grown by one token,
`torch.cat` in HF's DynamicCache), the caller concatenates them again from those values
(`_sinkable`) instead.

A model of identical layers (a transformer's blocks, with their weights as arguments) repeats
one run of ops. `_repeat` finds the period and the stretch it covers; the function is cut at
the same place in every repetition, and parts whose bodies come out identical become one
function called once per layer, so the passes and LLVM's code generation see each distinct
layer once: compile time stops growing with depth. Each layer is cut in two as well, at the
same op of every layer (`_halves`), so that LLVM compiles its halves in parallel. Ops before
and after the repeats are cut by size as before. A function shorter than that is cut into its
layers too where it repeats a layer of LAYER_OPS or more ops with a convolution or a matmul
(`_heavy_layers`). Constants, and reshapes or casts of constants (which CSE leaves in the first
layer only), are cloned into every part that uses them, so the first layer's part is identical
to the others; values every layer reads that CSE left in the first (a Llama's rotary tables, an
attention mask) move before the layers (`_shared_first`).
"""

from __future__ import annotations

import itertools

import numpy as np
from mlir import ir
from mlir.dialects import arith, bufferization, func, tensor, tosa

from .irutil import find_ops, is_sub_byte, top_level

PART_OPS = 200  # top-level ops per part
# A shorter function is cut too where it repeats a layer of at least LAYER_OPS ops with a
# convolution or a matmul in it (r3d_18's blocks, 41 ops each): two blocks of 3-D convolutions
# compiled in 5.9 s instead of 12.3 (and ran in 159 ms instead of 178, Zen 4).
LAYER_OPS = 8
_HEAVY = ("tosa.conv2d", "tosa.conv3d", "tosa.depthwise_conv2d", "tosa.transpose_conv2d", "tosa.matmul")
_CONSTANTS = ("tosa.const", "tosa.const_shape", "arith.constant")
_CONSTANT_VIEWS = ("tosa.reshape", "tosa.cast")  # of constants: constants too (a batch norm's eps, reshaped once)


def _constant(op: ir.Operation) -> bool:
    """A constant, or a reshape or cast of constants: cloned into each part that uses it, never
    moved or counted (CSE leaves one for all layers, in the first)."""
    if op.name in _CONSTANTS:
        return True
    return op.name in _CONSTANT_VIEWS and all(isinstance(v, ir.OpResult) and _constant(v.owner) for v in op.operands)


def _with_operands(op: ir.Operation, found: dict[ir.Operation, None]) -> None:
    """Add constant `op` to `found` after the constants it is computed from."""
    for value in op.operands:
        _with_operands(value.owner.operation, found)
    found[op.operation] = None


def partition(module: ir.Module, part_ops: int | None = None) -> None:
    """Split every function of `module` longer than 1.5 x `part_ops` (default PART_OPS), or
    repeating a layer with a convolution or a matmul (`_heavy_layers`)."""
    size = part_ops or PART_OPS
    for op in list(module.body.operations):
        if op.operation.name == "func.func" and len(op.regions[0].blocks) == 1:
            body = [o.operation for o in list(op.regions[0].blocks[0].operations)[:-1]]  # without the return
            long = len(body) > size * 3 // 2
            shortest = size // 4 if long else LAYER_OPS
            order = _shared_first(op.operation, body, shortest)
            if long or _heavy_layers(order):
                _reorder(op.operation, body, order)
                with module.context, ir.Location.unknown():
                    _split(op.operation, order, size, shortest)


def _shared_first(function: ir.Operation, body: list[ir.Operation], shortest: int) -> list[ir.Operation]:
    """`body` in an order where the values its layers share come first.

    CSE leaves a value every layer computes alike (a transformer's rotary tables, its attention
    mask) in the first layer, so that layer is longer than the others and no cut repeats. An op
    that reads only the function's arguments and constants (or such ops' results) and whose
    users lie a layer apart or more (the most frequent period of the ops, `_likely_period`) moves
    to the front, with the ops it reads, constants first; the rest keep their order."""
    core = [op for op in body if not _constant(op)]
    period = _likely_period(core, shortest)
    if period is None:
        return body
    position = {op: i for i, op in enumerate(core)}
    invariant: set[ir.Operation] = set()
    for op in core:
        if all((d := _defining_op(v)) == function or _constant(d) or d in invariant for v in _free_operands(op)):
            invariant.add(op)

    def spread(op: ir.Operation) -> bool:
        users = [position[user] for r in op.results for use in r.uses
                 if (user := top_level(use.owner, function)) in position]
        return bool(users) and max(users) - min(users) >= period

    shared = _slice([op for op in invariant if spread(op)], invariant)
    if not shared:
        return body
    return [*(op for op in body if _constant(op)), *(op for op in core if op in shared),
            *(op for op in core if op not in shared)]


def _likely_period(core: list[ir.Operation], shortest: int) -> int | None:
    """The distance of at least `shortest` ops at which the most ops are alike (`_signature`),
    or None if fewer than `shortest` are at any distance."""
    ids = _signature_ids(core)
    best, period = 0, None
    for distance in range(max(shortest, 1), len(core) // 2 + 1):
        alike = int(np.count_nonzero(ids[:-distance] == ids[distance:]))
        if alike > best:
            best, period = alike, distance
    return period if best >= shortest else None


def _reorder(function: ir.Operation, body: list[ir.Operation], order: list[ir.Operation]) -> None:
    """Put the ops of `body` (`function`'s, without its return) in `order`."""
    if order == body:
        return
    operations = function.regions[0].blocks[0].operations
    end = operations[len(operations) - 1]  # the return
    for op in order:
        op.move_before(end)


def _heavy_layers(body: list[ir.Operation]) -> bool:
    """Whether `body` repeats a layer of LAYER_OPS ops or more with a convolution or a matmul."""
    core = [op.operation for op in body if not _constant(op.operation)]
    found = _repeat(core, LAYER_OPS)
    return found is not None and any(op.name in _HEAVY for op in core[found[0]:found[0] + found[1]])


def _split(function: ir.Operation, body: list[ir.Operation], size: int, shortest: int) -> None:
    name = ir.StringAttr(function.attributes["sym_name"]).value
    body = [op.operation for op in body]
    position = {op: i for i, op in enumerate(body)}
    crossing, blocked = _crossings(body, position, function)
    layers = _layer_cuts(body, crossing, blocked, shortest)  # [] or the bounds of each repetition
    repeated = set(itertools.pairwise(layers))
    spans = [(0, layers[0]), *itertools.pairwise(layers), (layers[-1], len(body))] if layers else [(0, len(body))]
    halves = _halves(body, crossing, blocked, sorted(repeated))
    parts: list[tuple[int, int]] = []
    layered: set[tuple[int, int]] = set()  # parts alike in every layer
    for start, end in spans:
        if (start, end) in repeated:
            middle = halves.get(start)
            layer = [(start, middle), (middle, end)] if middle else [(start, end)]
            parts += layer
            layered.update(layer)
        elif end > start:
            parts.extend(itertools.pairwise([start, *_cuts(crossing, blocked, start, end, size), end]))
    if len(parts) < 2:
        return
    outlined = [(_outline(function, body[a:b], f"{name}__part{i}"), (a, b) in layered)
                for i, (a, b) in enumerate(parts)]
    _merge_identical(function, [callee for callee, layer in outlined if layer and callee is not None])


def _layer_cuts(body: list[ir.Operation], crossing: list[int], blocked: list[int], shortest: int) -> list[int]:
    """Cut positions that bound each repetition of the longest repeated run of ops (a layer
    of `shortest` ops or more, repeated at least twice), at the same place in each, where the
    fewest values cross; [] if there is none."""
    core = [i for i, op in enumerate(body) if not _constant(op)]  # constants are CSE'd: not periodic
    found = _repeat([body[i] for i in core], shortest)
    if found is None:
        return []
    start, period, span = found  # core ops start + i and start + i + period match for i < span
    at = [*core, len(body)]  # the body position of each core op, and the end
    best: tuple[tuple[int, int], list[int]] | None = None
    for phase in range(period):
        count = (span + period - phase) // period  # repetitions that fit after the phase
        cuts = [at[start + phase + j * period] for j in range(count + 1) if start + phase + j * period < len(at)]
        if len(cuts) < 3 or any(blocked[c] for c in cuts):
            continue
        score = (-len(cuts), max(crossing[c] for c in cuts))
        if best is None or score < best[0]:
            best = (score, cuts)
    return best[1] if best is not None else []


def _halves(body: list[ir.Operation], crossing: list[int], blocked: list[int],
            layers: list[tuple[int, int]]) -> dict[int, int]:
    """Where to cut each of the repeated `layers` (body spans) in two, at the same op of each:
    LLVM compiles the two halves of a layer in parallel (`toolchain.machine_code`), and a layer
    of a few heavy ops (a transformer's attention and MLP, a residual block's convolutions) was
    the largest function of a model, compiled by one process while the other cores idled.

    A cut has a heavy op (`_HEAVY`) on either side, and at least a third of the layer's ops on
    either side if any cut can; among those, the one where the fewest values cross in the worst
    layer (a transformer's residual stream, a convolution's input and output), then the one
    that halves the layer most evenly. Returns {layer start: cut}; {} where no cut qualifies."""
    if not layers:
        return {}
    cores = [[i for i in range(a, b) if not _constant(body[i])] for a, b in layers]
    length = min(len(core) for core in cores)
    heavy = [j for j in range(length) if body[cores[0][j]].name in _HEAVY]
    if len(heavy) < 2:
        return {}
    allowed = [j for j in range(heavy[0] + 1, heavy[-1] + 1) if not any(blocked[core[j]] for core in cores)]
    if not allowed:
        return {}
    even = [j for j in allowed if length // 3 <= j <= length - length // 3]
    cut = min(even or allowed, key=lambda j: (max(crossing[core[j]] for core in cores), abs(length - 2 * j), j))
    return {a: core[cut] for (a, _), core in zip(layers, cores, strict=True)}


def _repeat(body: list[ir.Operation], shortest: int) -> tuple[int, int, int] | None:
    """(start, period, span) of the repetition covering the most ops: the op at start + i has
    the same name, attributes and result types as the one at start + i + period for every
    i < span; None if no period of at least `shortest` ops repeats at least twice."""
    ids = _signature_ids(body)
    best: tuple[int, int, int] | None = None
    for period in range(max(shortest, 1), len(body) // 2 + 1):
        same = np.concatenate([[False], ids[:-period] == ids[period:], [False]])
        edges = np.flatnonzero(np.diff(same.astype(np.int8)))
        if not len(edges):
            continue
        runs = edges[1::2] - edges[::2]
        i = int(np.argmax(runs))
        span = int(runs[i])
        covered = (span + period) // period * period
        if span >= period and (best is None or covered > (best[2] + best[1]) // best[1] * best[1]):
            best = (int(edges[2 * i]), period, span)
    return best


def _signature_ids(ops: list[ir.Operation]) -> np.ndarray:
    """A number per op, equal for ops of equal `_signature`."""
    keys: dict[str, int] = {}
    return np.array([keys.setdefault(_signature(op), len(keys)) for op in ops])


def _signature(op: ir.Operation) -> str:
    """What an op is apart from its operands: name, attributes (not a constant's data, which
    can be large), result types."""
    named = [op.attributes[i] for i in range(len(op.attributes))] if op.name not in _CONSTANTS else []
    attributes = ",".join(f"{a.name}={a.attr}" for a in named)
    return f"{op.name}|{attributes}|{','.join(str(r.type) for r in op.results)}"


def _merge_identical(caller: ir.Operation, callees: list[func.FuncOp]) -> None:
    """Make every call in `caller` of a callee whose body equals an earlier one's call that one
    instead, and erase the copies."""
    calls = find_ops(caller, lambda op: op.name == "func.call")
    first: dict[str, str] = {}
    for callee in callees:
        name = ir.StringAttr(callee.attributes["sym_name"]).value
        text = str(callee.operation).replace(f"@{name}(", "@_(", 1)
        kept = first.setdefault(text, name)
        if kept == name:
            # one body for every layer: LLVM's inliner would copy it back into each call
            callee.attributes["passthrough"] = ir.ArrayAttr.get([ir.StringAttr.get("noinline")])
            continue
        for call in calls:
            if ir.FlatSymbolRefAttr(call.attributes["callee"]).value == name:
                call.attributes["callee"] = ir.FlatSymbolRefAttr.get(kept)
        callee.operation.erase()


def _crossings(body: list[ir.Operation], position: dict[ir.Operation, int],
               function: ir.Operation) -> tuple[list[int], list[int]]:
    """For each position c of `body`: the values defined before c and used at or after it, and
    how many of them a cut must not cross (`_blocked`)."""
    crossing, blocked = [0] * (len(body) + 2), [0] * (len(body) + 2)  # as differences first
    for i, op in enumerate(body):
        if _constant(op):
            continue
        for result in op.results:
            last = max((position.get(top_level(use.owner, function), len(body)) for use in result.uses), default=i)
            for count in (crossing, blocked) if _blocked(result, function) else (crossing,):
                count[i + 1] += 1
                count[last + 1] -= 1
    return list(itertools.accumulate(crossing)), list(itertools.accumulate(blocked))


def _cuts(crossing: list[int], blocked: list[int], begin: int, end: int, size: int) -> list[int]:
    """Positions in (begin, end) to cut before: each part has `size` to 1.5 x `size` ops, cut
    where the fewest values cross, never where one that can't (`_crossings`) does."""
    cuts, start = [], begin
    while end - start > size * 3 // 2:
        allowed = [c for c in range(start + size, end - size // 2) if not blocked[c]]
        if not allowed:
            break
        window = [c for c in allowed if c <= start + size * 3 // 2] or allowed[:1]
        start = min(window, key=lambda c: (crossing[c], c))
        cuts.append(start)
    return cuts


def _outline(function: ir.Operation, ops: list[ir.Operation], name: str) -> func.FuncOp | None:
    """Move the consecutive top-level `ops` of `function` into a new private function @name,
    called in their place, and return it. Constants stay (cloned into @name where used)."""
    ops = [op for op in ops if not _constant(op)]
    inside = set(ops)
    inputs: dict[ir.Value, None] = {}  # dicts as ordered sets
    constants: dict[ir.Operation, None] = {}
    for op in ops:
        for value in _free_operands(op):
            owner = value.owner if isinstance(value, ir.OpResult) else None
            if owner is not None and _constant(owner.operation):
                _with_operands(owner.operation, constants)
            elif owner is None or owner.operation not in inside:
                inputs[value] = None
    outputs = [r for op in ops for r in op.results
               if any(top_level(use.owner, function) not in inside for use in r.uses)]
    if any(_blocked(v, function) for v in outputs):
        return None  # a function's result computed after its last cut: the ops stay in the caller
    sunk = [v for v in outputs if _dynamic(v) and _sinkable(v.owner, function)]  # the caller computes them again
    destined = [v for v in outputs if _dynamic(v) and v not in sunk]  # computed into the caller's buffer
    outputs = [v for v in outputs if not _dynamic(v)]
    for value in sunk:
        outputs += [v for v in value.owner.operands
                    if isinstance(v, ir.OpResult) and v.owner.operation in inside and v not in outputs]
    if not outputs and not sunk and not destined:
        return None  # nothing of it is used (folding removes it later)
    results = [*outputs, *destined]
    callee = func.FuncOp(name, ([_carried(v.type) for v in [*inputs, *destined]], [_carried(v.type) for v in results]),
                         visibility="private", ip=ir.InsertionPoint(function))
    entry = callee.add_entry_block()
    with ir.InsertionPoint(ops[0]):
        destinations = _destinations(destined, ops)
        call = func.CallOp([_carried(v.type) for v in results], ir.FlatSymbolRefAttr.get(name),
                           [*(_cast(v, _carried(v.type)) for v in inputs), *destinations])
    returned: dict[ir.Value, ir.Value] = {}
    for value, result in zip(results, call.results, strict=True):
        returned[value] = result = _cast(result, value.type)
        for use in list(value.uses):
            if top_level(use.owner, function) not in inside:
                use.owner.operands[use.operand_number] = result
    for value in sunk:
        again = value.owner.operation.clone(ip=ir.InsertionPoint(ops[0]))
        for i, operand in enumerate(value.owner.operands):
            again.operands[i] = returned.get(operand, operand)
        for use in list(value.uses):
            if top_level(use.owner, function) not in inside:
                use.owner.operands[use.operand_number] = again.results[0]
    with ir.InsertionPoint(entry):
        clones = {c: c.clone() for c in constants}
        arguments = [_cast(a, v.type) for a, v in zip(list(entry.arguments)[:len(inputs)], inputs, strict=True)]
        for op in ops:
            op.detach_from_parent()
            ir.InsertionPoint(entry).insert(op)
        written = [bufferization.MaterializeInDestinationOp(_carried(v.type), _cast(v, _carried(v.type)), dest).result
                   for v, dest in zip(destined, list(entry.arguments)[len(inputs):], strict=True)]
        func.ReturnOp([*(_cast(v, _carried(v.type)) for v in outputs), *written])
    replacements = [*zip(inputs, arguments, strict=True),
                    *((const.results[0], clone.results[0]) for const, clone in clones.items())]
    for old, new in replacements:
        for use in list(old.uses):
            if _within(use.owner.operation, callee.operation):
                use.owner.operands[use.operand_number] = new
    for const in reversed(constants):  # users before what they use
        if not list(const.results[0].uses):
            const.erase()
    return callee


def _destinations(values: list[ir.Value], ops: list[ir.Operation]) -> list[ir.Value]:
    """An empty tensor for each of `values` (results of `ops`, of dynamic shapes) to be computed
    into, created before `ops`: a part can't return a buffer of a size its caller doesn't know.

    Its sizes are `tensor.dim`s of a shadow: a copy, before `ops`, of the ops computing the value.
    Lowered to linalg, a dim of an op's result folds into the sizes of its destination, computed
    from its operands' dims (`tensor.dim` of a destination-style op, of `tensor.empty`, of a
    reshape), so the shadow's dims become index arithmetic on the part's operands and the shadow,
    unused, is erased. (A dim that did not fold would keep its shadow: right, but computed twice;
    test_partition checks that none is left of layers like a transformer's.)"""
    if not values:
        return []
    needed = _slice([v.owner.operation for v in values], set(ops))
    constants: dict[ir.Operation, None] = {}
    for op in needed:
        for value in _free_operands(op):
            if isinstance(value, ir.OpResult) and _constant(value.owner.operation):
                _with_operands(value.owner.operation, constants)
    shadow: dict[ir.Value, ir.Value] = {}
    for op in [*constants, *(op for op in ops if op in needed)]:  # constants may be defined after ops[0]
        copy = op.clone()
        _remap(copy, shadow)
        shadow.update(zip(op.results, copy.results, strict=True))
    destinations = []
    for value in values:
        t = ir.RankedTensorType(value.type)
        sizes = [tensor.DimOp(shadow[value], arith.ConstantOp(ir.IndexType.get(), i).result).result
                 if t.is_dynamic_dim(i) else size for i, size in enumerate(t.shape)]
        destinations.append(tensor.EmptyOp(sizes, ir.RankedTensorType(_carried(t)).element_type).result)
    return destinations


def _slice(roots: list[ir.Operation], within: set[ir.Operation]) -> set[ir.Operation]:
    """The ops of `within` that `roots` (ops of `within`) are computed from, `roots` included
    (a worklist: a chain of thousands of ops is no recursion)."""
    found: set[ir.Operation] = set()
    pending = list(roots)
    while pending:
        op = pending.pop()
        if op in within and op not in found:
            found.add(op)
            pending += [_defining_op(v) for v in _free_operands(op)]
    return found


def _remap(op: ir.Operation, values: dict[ir.Value, ir.Value]) -> None:
    """Replace the operands of `op` and of the ops nested in it found in `values`."""
    def visit(inner: ir.Operation) -> ir.WalkResult:
        for i, operand in enumerate(inner.operands):
            if operand in values:
                inner.operands[i] = values[operand]
        return ir.WalkResult.ADVANCE

    op.walk(visit, ir.WalkOrder.PRE_ORDER)


def _blocked(value: ir.Value, function: ir.Operation) -> bool:
    """Whether `value` can't be a part's result: of sub-byte integers other than booleans (which
    cross as i8). One of a dynamic shape is computed into a buffer of the caller's
    (`_destinations`), or concatenated again by the caller (`_sinkable`)."""
    t = value.type
    element = ir.ShapedType(t).element_type if isinstance(t, ir.ShapedType) else t
    return is_sub_byte(element) and not _is_bool(element)


def _dynamic(value: ir.Value) -> bool:
    return isinstance(value.type, ir.ShapedType) and not ir.ShapedType(value.type).has_static_shape


def _sinkable(op: ir.Operation, function: ir.Operation) -> bool:
    """Whether the caller can compute `op` (of a dynamic result) again, after the call of the part
    holding it: a concatenation of `function`'s arguments, constants and values of static shapes
    (which the part returns)."""
    def available(value: ir.Value) -> bool:
        if isinstance(value, ir.BlockArgument):
            return value.owner.owner.operation == function
        return not _dynamic(value) or value.owner.name in _CONSTANTS

    return op.name == "tosa.concat" and all(available(v) for v in op.operands)


def _is_bool(element: ir.Type) -> bool:
    return isinstance(element, ir.IntegerType) and element.width == 1


def _carried(t: ir.Type) -> ir.Type:
    """The type a value of type `t` crosses a call boundary as: a boolean tensor as i8."""
    if isinstance(t, ir.RankedTensorType) and _is_bool(t.element_type):
        return ir.RankedTensorType.get(t.shape, ir.IntegerType.get_signless(8))
    return t


def _cast(value: ir.Value, to: ir.Type) -> ir.Value:
    """`value` as type `to` (a `tosa.cast` after its definition), or itself if it has that type."""
    if value.type == to:
        return value
    owner = value.owner
    at = ir.InsertionPoint.at_block_begin(owner) if isinstance(owner, ir.Block) else ir.InsertionPoint.after(owner)
    return tosa.CastOp(to, value, ip=at).result


def _free_operands(op: ir.Operation) -> list[ir.Value]:
    """Operands of `op` and of the ops nested in it that are defined outside `op`."""
    found: list[ir.Value] = []

    def visit(inner: ir.Operation) -> ir.WalkResult:
        for value in inner.operands:
            if not _within(_defining_op(value), op):
                found.append(value)
        return ir.WalkResult.ADVANCE

    op.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _defining_op(value: ir.Value) -> ir.Operation | None:
    if isinstance(value, ir.OpResult):
        return value.owner.operation
    return ir.BlockArgument(value).owner.owner.operation


def _within(op: ir.Operation | None, ancestor: ir.Operation) -> bool:
    while op is not None:
        if op == ancestor:
            return True
        op = op.parent.operation if op.parent is not None else None
    return False
