"""Contractions in the form the schedule packs: named matmuls of 2-D (or 3-D batched) operands.

The schedule packs the second operand of a named `linalg.matmul`/`batch_matmul` into column
panels, transposing nn.Linear's weight panel by panel (`schedule.pack_panels`). Two things
between TOSA and the schedule hide that form:

- Elementwise fusion moves reshapes through a matmul: nn.Linear on a `[1, 7, 7, C]` input (a
  ConvNeXt block) is `tosa.matmul` of the input reshaped to rows, and
  fusion turns it into a generic over the rows' own dimensions (7, 7, n, k) that reads the
  weight through a whole transpose. Packed as a matmul, ConvNeXt's stage-3 MLP ran 2.6x faster.
- The weight's transpose picks up unit dimensions from the reshapes around it
  (`[O, 1, K] -> [1, K, O]`), so the matmul's operand is a reshape of a transpose.

`normalize(module)` rewrites each plain generic contraction of matmul form (`out + x * y`, x
read along (batch..., rows..., k), y along (batch..., k, n) or (batch..., n, k)) as a named
matmul of collapsed operands, y transposed by a `linalg.transpose` where it is read along k;
drops unit dimensions from transposes; and makes batch matmuls of one matrix plain matmuls.
Reshapes of contiguous tensors are free (views), and canonicalization cancels the pairs the
rewrites leave.
"""

from __future__ import annotations

import math

from mlir import ir
from mlir.dialects import linalg, tensor

from ..internal import blaming
from .half import is_half
from .irutil import collapse, dims_map, expand, find_ops, map_dims, run_passes
from .irutil import tensor_dim as _dim
from .irutil import tensor_shape as _shape


def normalize(module: ir.Module) -> None:
    """Rewrite `module`'s contractions and transposes as the module docstring says."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name == "linalg.generic"):
            with blaming(op):
                _named_contraction(op)
        for op in find_ops(module, lambda op: op.name == "linalg.transpose"):
            _squeeze_transpose(op)
        for op in find_ops(module, lambda op: op.name == "linalg.batch_matmul"):
            _single_batch(op)
    run_passes(module, "builtin.module(canonicalize,cse)")


def fold_transposes(module: ir.Module) -> None:
    """Let each vector-matrix product (`_fold_transpose`) and each other generic reduction
    (`_fold_reduction_transposes`) of `module` read through the transposes that produce its
    inputs, after dropping the unit dimensions of every transpose."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name == "linalg.transpose"):
            _squeeze_transpose(op)
        run_passes(module, "builtin.module(canonicalize)")
        for op in find_ops(module, lambda op: op.name == "linalg.generic"
                           and "reduction" in str(op.attributes["iterator_types"])):
            with blaming(op):
                if sum_of_products(op) is not None:
                    _fold_transpose(op)
                else:
                    _fold_reduction_transposes(op)
    run_passes(module, "builtin.module(canonicalize,cse)")


def _producing_transpose(value: ir.Value) -> ir.Operation | None:
    """The linalg.transpose whose result `value` is, else None."""
    owner = value.owner if isinstance(value, ir.OpResult) else None
    return owner if owner is not None and owner.name == "linalg.transpose" else None


def _source_loops(transpose: ir.Operation, dims: list[int]) -> list[int]:
    """The loop each dimension of `transpose`'s input is read along, its result being read along
    the loops `dims`."""
    perm = list(ir.DenseI64ArrayAttr(transpose.attributes["permutation"]))
    return [dims[perm.index(d)] for d in range(len(perm))]


def _read_through(op: ir.Operation, y: int, transpose: ir.Operation, read: list[int]) -> None:
    """Make generic `op` read input `y` from `transpose`'s input, along the loops `read`."""
    maps = list(ir.ArrayAttr(op.attributes["indexing_maps"]))
    maps[y] = dims_map(len(ir.ArrayAttr(op.attributes["iterator_types"])), read)
    op.operands[y] = transpose.operands[0]
    op.attributes["indexing_maps"] = ir.ArrayAttr.get(maps)


def _fold_reduction_transposes(op: ir.Operation) -> None:
    """Read each input of a generic reduction through the transpose that produces it where the
    innermost loop then reads the transpose's input along its innermost dimension: TOSA folds a
    sum over (0, 2, 3) of [N, C, H, W] as a sum over rows of its transpose to [C, N, H, W],
    which copied the whole tensor first (3x eager's time)."""
    *inputs, _ = map_dims(op)
    last = len(ir.ArrayAttr(op.attributes["iterator_types"])) - 1
    for y, dims in enumerate(inputs):
        transpose = _producing_transpose(op.operands[y])
        if transpose is None:
            continue
        read = _source_loops(transpose, dims)
        if read[-1] == last:  # else the innermost loop would stride through the source
            _read_through(op, y, transpose, read)


def _fold_transpose(op: ir.Operation) -> None:
    """Read the matrix of a plain generic vector-matrix product (`out + x * y`, x read along the
    reduction loops alone) from the input of the transpose producing it, through a permuted
    indexing map, where that reads it along those loops last, in x's order: nn.Linear on one
    token whose output fusion reshaped to attention heads (q = x @ W.t() viewed [heads,
    head_dim]; the output projection reads them back) read a whole transpose of W, made at every
    call; read along k (`collapse_reductions` merges several loops into one), it is dot products
    (`schedule._dot_loops`). The factors may be extended first (bf16 inputs, f32 sums)."""
    if any(inner.name != "arith.extf" for inner in list(op.regions[0].blocks[0].operations)[:-3]):
        return
    kinds = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    reductions = {d for d, kind in enumerate(kinds) if "reduction" in kind}
    *inputs, _ = map_dims(op)
    if len(inputs) != 2:
        return
    for x, y in ((0, 1), (1, 0)):
        transpose = _producing_transpose(op.operands[y])
        ks = inputs[x]
        if set(ks) != reductions or transpose is None or inputs[y][-len(ks):] == ks:
            continue
        read = _source_loops(transpose, inputs[y])
        if read[-len(ks):] != ks:
            continue
        _read_through(op, y, transpose, read)
        return


def sum_of_products(op: ir.Operation) -> ir.Operation | None:
    """The multiplication of a generic reduction whose body ends in `out + x * y`, with the
    output read nowhere else, else None."""
    if op.name != "linalg.generic" or "reduction" not in str(op.attributes["iterator_types"]):
        return None
    block = op.regions[0].blocks[0]
    body = list(block.operations)
    if len(body) < 3:
        return None
    mul, add, end = body[-3:]
    if (mul.name, add.name) not in (("arith.mulf", "arith.addf"), ("arith.muli", "arith.addi")):
        return None
    out = block.arguments[len(block.arguments) - 1]
    if end.operands[0] != add.results[0] or {add.operands[0], add.operands[1]} != {mul.results[0], out}:
        return None
    if any(out in list(inner.operands) for inner in body[:-2]):
        return None
    return mul


def _factor(value: ir.Value, block: ir.Block) -> int | None:
    """The input a product's factor is: block argument i itself (f32), or its extension from
    bf16/f16 to f32 (`arith.extf`); else None."""
    owner = value.owner if isinstance(value, ir.OpResult) else None
    if owner is not None and owner.name == "arith.extf" and is_half(owner.operands[0].type):
        value = owner.operands[0]
    elif not isinstance(value.type, ir.F32Type):
        return None
    args = list(block.arguments)
    return args.index(value) if value in args else None


def contraction_of_inputs(op: ir.Operation) -> bool:
    """Whether generic `op` is `out + x * y` into f32 sums of its two inputs as they are (f32),
    or extended from bf16/f16 (the same type both), and nothing else."""
    mul = sum_of_products(op)
    block = op.regions[0].blocks[0] if mul is not None else None
    if mul is None or mul.name != "arith.mulf" or len(block.arguments) != 3:
        return False
    factors = [_factor(v, block) for v in mul.operands]
    if sorted(f for f in factors if f is not None) != [0, 1] or not isinstance(block.arguments[2].type, ir.F32Type):
        return False
    body = list(block.operations)
    return (block.arguments[0].type == block.arguments[1].type
            and len(body) == 3 + sum(o.name == "arith.extf" for o in body))  # nothing but the extensions


def _named_contraction(op: ir.Operation) -> None:
    """Replace a plain generic contraction of matmul form (`contraction_of_inputs`) by a named
    matmul of the same operands (see the module docstring); leave any other generic as it is.

    Matmul form: the output's loops are (batch..., rows..., columns...), x is read along (batch...,
    rows..., k...) and y along (batch..., k..., columns...) or (batch..., columns..., k...). Several
    column loops are a linear's output viewed as attention heads ([heads, head_dim]), several k
    loops the heads a linear reads back: y is then the weight viewed so and transposed, which
    `_collapsed` reads as the transpose of the weight."""
    if not contraction_of_inputs(op):
        return
    kinds = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    reductions = {d for d, kind in enumerate(kinds) if "reduction" in kind}
    *inputs, out = map_dims(op)
    r = len(reductions)
    x = next((i for i, dims in enumerate(inputs) if len(dims) > r and set(dims[len(dims) - r:]) == reductions
              and dims[:len(dims) - r] == out[:len(dims) - r]), None)  # read along (out's first loops, k...)
    rows_end = 0 if x is None else len(inputs[x]) - r  # out[:rows_end]: batch and rows; the rest columns
    if not 0 < rows_end < len(out):
        return
    y = 1 - x
    ks, columns = inputs[x][rows_end:], out[rows_end:]
    batch = len(inputs[y]) - len(ks) - len(columns)
    if batch < 0 or batch >= rows_end or inputs[y][:batch] != out[:batch]:
        return
    if inputs[y][batch:] not in ([*ks, *columns], [*columns, *ks]):
        return
    k_first = inputs[y][batch:batch + len(ks)] == ks
    operands = list(op.operands)
    lhs, rhs, init = operands[x], operands[y], operands[2]
    shape = _shape(init)
    batch_sizes = shape[:batch]
    b = None if None in batch_sizes else math.prod(batch_sizes)
    rank, y_rank = len(out), len(inputs[y])
    head = list(range(batch, batch + len(ks if k_first else columns)))  # y's first matrix dimension
    tail = list(range(head[-1] + 1, y_rank))
    reduced = list(range(rows_end, rows_end + len(ks)))  # x's
    if b == 1:  # unit batch dimensions join the rows (and y's first matrix dimension)
        groups = [list(range(rows_end)), list(range(rows_end, rank))]
        lhs_groups = [list(range(rows_end)), reduced]
        rhs_groups = [list(range(head[-1] + 1)), tail]
    else:
        lead = [list(range(batch))] if batch else []
        groups = [*lead, list(range(batch, rows_end)), list(range(rows_end, rank))]
        lhs_groups = [*lead, list(range(batch, rows_end)), reduced]
        rhs_groups = [*lead, head, tail]
    with ir.InsertionPoint(op), op.location:
        sizes = [_dim(init, d) for d in range(rank)]
        lhs = _collapsed(lhs, lhs_groups)
        rhs = _collapsed(rhs, rhs_groups)
        if not k_first:
            rhs = transposed(rhs, [1, 0] if len(rhs_groups) == 2 else [0, 2, 1])
        named = linalg.matmul if len(groups) == 2 else linalg.batch_matmul
        result = expand(_value(named(lhs, rhs, outs=[collapse(init, groups)])), groups, sizes)
    op.results[0].replace_all_uses_with(result)
    op.erase()


def _collapsed(value: ir.Value, groups: list[list[int]]) -> ir.Value:
    """`collapse(value, groups)`; where `value` is a transpose that keeps each group's source
    dimensions together and in order, the transpose of its source collapsed instead (a weight
    viewed as heads and transposed is the weight transposed). A collapse of such a transpose
    (`schedule.collapse_outputs` merges the heads) is read through."""
    owner = value.owner if isinstance(value, ir.OpResult) else None
    if owner is not None and owner.name == "tensor.collapse_shape" and len(list(value.uses)) == 1:
        inner = [[ir.IntegerAttr(d).value for d in g] for g in ir.ArrayAttr(owner.attributes["reassociation"])]
        return _collapsed(owner.operands[0], [[d for j in group for d in inner[j]] for group in groups])
    transpose = _producing_transpose(value)
    if transpose is None or len(list(value.uses)) != 1:
        return collapse(value, groups)
    perm = list(ir.DenseI64ArrayAttr(transpose.attributes["permutation"]))
    sources = [[perm[d] for d in group] for group in groups]
    if any(g != list(range(g[0], g[0] + len(g))) for g in sources):
        return collapse(value, groups)
    ordered = sorted(sources)
    return transposed(collapse(transpose.operands[0], ordered), [ordered.index(g) for g in sources])


def _squeeze_transpose(op: ir.Operation) -> None:
    """Replace a static transpose with unit dimensions by the transpose of the others between
    reshapes: `[O, 1, K] -> [1, K, O]` becomes `[O, K] -> [K, O]`, so a matmul sees its operand's
    transpose once canonicalization cancels the reshapes."""
    source, shape, out_shape = op.operands[0], _shape(op.operands[0]), _shape(op.results[0])
    if None in shape or None in out_shape or 1 not in shape or all(s == 1 for s in shape):
        return
    perm = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
    kept = [d for d, s in enumerate(shape) if s != 1]
    squeezed = [kept.index(p) for p in perm if shape[p] != 1]
    with ir.InsertionPoint(op), op.location:
        value = collapse(source, _unit_groups(shape))
        if squeezed != sorted(squeezed):
            value = transposed(value, squeezed)
        result = expand(value, _unit_groups(out_shape), out_shape)
    op.results[0].replace_all_uses_with(result)
    op.erase()


def _single_batch(op: ir.Operation) -> None:
    """Replace a batch matmul of one matrix by a matmul."""
    lhs, rhs, init = list(op.operands)[:3]
    if _shape(init)[0] != 1:
        return
    groups = [[0, 1], [2]]
    with ir.InsertionPoint(op), op.location:
        sizes = [_dim(init, d) for d in range(3)]
        named = _value(linalg.matmul(*(collapse(v, groups) for v in (lhs, rhs)), outs=[collapse(init, groups)]))
        result = expand(named, groups, sizes)
    op.results[0].replace_all_uses_with(result)
    op.erase()


def _unit_groups(shape: list[int]) -> list[list[int]]:
    """The reassociation that drops `shape`'s unit dimensions: each joins the next other
    dimension (trailing ones the last)."""
    groups: list[list[int]] = []
    pending: list[int] = []
    for d, s in enumerate(shape):
        pending.append(d)
        if s != 1:
            groups.append(pending)
            pending = []
    if pending:
        groups[-1] += pending
    return groups


def transposed(value: ir.Value, perm: list[int]) -> ir.Value:
    """`value` transposed by `perm`."""
    empty = tensor.EmptyOp([_dim(value, p) for p in perm], ir.RankedTensorType(value.type).element_type).result
    return _value(linalg.transpose(value, outs=[empty], permutation=perm))


def _value(built: ir.Value | ir.OpView | ir.OpResultList) -> ir.Value:
    """The result of a linalg op built on tensors (the builders return the op, its results or
    its value)."""
    if isinstance(built, ir.Value):
        return built
    return built.results[0] if isinstance(built, ir.OpView) else built[0]
