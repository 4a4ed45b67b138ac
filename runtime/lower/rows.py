"""Row-wise chains fused per row: a normalization's statistics and its output computed row by row.

TOSA spells a softmax or a layer norm as passes over the whole tensor: a reduction along the last
dimension (the row maximum, the mean), an elementwise op reading it (x - mean), another reduction
(the variance), the output. Each pass streams the whole tensor, from memory once it exceeds the
caches; PyTorch's kernels walk it row by row, every pass over a row in L1. `fuse_rows(module)`
does the same: for each elementwise generic (the chain's last op) that reads the result of a
reduction along its last loop, it tiles the op by rows (every loop but the last: one row, or a
few short ones of up to ROW_ELEMENTS elements in all) and fuses into that loop the row-wise ops
that produce its inputs, transitively: generics over the same rows (elementwise, or reducing the
last loop only) and their fills. Other producers (a matmul
computing the rows) stay whole. The schedule then tiles and vectorizes the ops of a tile of rows
as it does any op (`schedule.plans`). The row count or the row's length may be known at run
time only (a dynamic batch or sequence, attention over a run-time count of keys): then a chain
takes one row per iteration, on the calling thread.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from mlir import ir
from mlir.dialects import tensor

from .irutil import find_ops, map_dims, producer, run_passes, run_transform
from .irutil import tensor_shape as _shape

_ATTR = "torchtosa.rows"  # marks a chain's last op ("<i>") and the producers fused into its rows ("<i>p")
MIN_ROW = 16  # shorter rows are left alone: a loop per row costs more than the passes it saves
ROW_ELEMENTS = 256  # shorter rows go a few at a time, this many elements


def fuse_rows(module: ir.Module, split_from: int | None = None) -> None:
    """Fuse each row-wise chain of `module` per row (see the module docstring). With
    `split_from`, the loop over the rows of a static chain of at least that many elements is an
    scf.forall (which the "openmp" stage shares among threads). A chain of a run-time size stays
    on the calling thread: a forall of one row per iteration allocated each row's buffers in
    every iteration (a dynamic encoder layer on two threads ran 1.8x slower than on one)."""
    chains = []
    with module.context, ir.Location.unknown():
        for op in find_ops(module, _chain_end):
            producers = _row_producers(op)
            if any(p.name == "linalg.generic" and _reduces_rows(p) for p in producers):
                chains.append((op.operation, producers))
        inner = {p for _, producers in chains for p in producers}
        chains = [(op, producers) for op, producers in chains if op not in inner]  # the longest chains
        if not chains:
            return
        fused: set[ir.Operation] = set()
        position = {op.operation: i for i, op in enumerate(find_ops(module, lambda op: True))}
        lines: list[str] = []
        for i, (op, producers) in enumerate(chains):
            producers = [p for p in producers if p not in fused]  # fused into an earlier chain already
            fused.update(producers)
            op.attributes[_ATTR] = ir.StringAttr.get(str(i))
            shape = _shape(op.results[0])
            tiles = ", ".join(["1"] * (len(shape) - 2) + [str(_rows_per_tile(shape)), "0"])
            lines.append(f"  %end{i} = {match(_ATTR, str(i))}")
            if split_from is not None and None not in shape and math.prod(shape) >= split_from:
                lines.append(f"  %tiled{i}, %loop{i} = transform.structured.tile_using_forall %end{i}"
                             f" tile_sizes [{tiles}] : (!transform.any_op) -> (!transform.any_op, !transform.any_op)")
                loop = f"%loop{i}"
            else:
                lines.append(f"  %tiled{i}, %loops{i}:{len(shape) - 1} = transform.structured.tile_using_for %end{i}"
                             f" tile_sizes [{tiles}] : (!transform.any_op) -> (!transform.any_op"
                             + ", !transform.any_op" * (len(shape) - 1) + ")")
                loop = f"%loops{i}#{len(shape) - 2}"
            lines += fuse_into(loop, producers, str(i), _ATTR, position, _own_init)[0]
    run_fusion(module, lines, _ATTR)


def fuse_into(loop: str, producers: list[ir.Operation], mark: str, attr: str, position: dict[ir.Operation, int],
              prepare: Callable[[ir.Operation], None]) -> tuple[list[str], str]:
    """Transform lines fusing `producers` into the loop handle `loop`, each marked `attr =
    "<mark>.<j>"` and given to `prepare` first, consumers first (`position`: the ops' order, read
    before any `prepare`; a producer fused before its users would be cloned, its original kept
    for them); and the handle of the loop they end in."""
    lines = []
    for j, p in enumerate(sorted(producers, key=position.__getitem__, reverse=True)):
        p.attributes[attr] = ir.StringAttr.get(f"{mark}.{j}")
        prepare(p)
        lines += [f"  %p{mark}_{j} = {match(attr, f'{mark}.{j}')}",
                  f"  %f{mark}_{j}, %in{mark}_{j} = transform.structured.fuse_into_containing_op %p{mark}_{j} into"
                  f" {loop} : (!transform.any_op, !transform.any_op) -> (!transform.any_op, !transform.any_op)"]
        loop = f"%in{mark}_{j}"
    return lines, loop


def run_fusion(module: ir.Module, lines: list[str], attr: str) -> None:
    """Run the transform `lines` of tiles and fusions on `module` (the slices of a fused op's
    tensor.empty become empties of the slice's shape), drop the `attr` marks, canonicalize."""
    lines = [*lines, '  %funcs = transform.structured.match ops{["func.func"]} in %root'
             " : (!transform.any_op) -> !transform.any_op",
             "  transform.apply_patterns to %funcs {",
             "    transform.apply_patterns.tensor.fold_tensor_empty", "  } : !transform.any_op"]
    try:
        run_transform(module, lines)
    finally:
        for op in find_ops(module, lambda op: attr in op.attributes):
            del op.attributes[attr]
    run_passes(module, "builtin.module(canonicalize,cse)")


def _rows_per_tile(shape: list[int]) -> int:
    """Rows of a chain per iteration: short rows a few at a time, up to ROW_ELEMENTS elements
    (the largest divisor of the row count that fits; one row of a run-time count or length)."""
    if shape[-2] is None or shape[-1] is None:
        return 1
    fits = max(1, ROW_ELEMENTS // shape[-1])
    return max(d for d in range(1, min(fits, shape[-2]) + 1) if shape[-2] % d == 0)


def _own_init(op: ir.Operation) -> None:
    """Give `op` a tensor.empty of its own as its output, if its output is one: CSE shares one
    empty between the ops of a chain (and the chain's end), and slices of one tensor in a row's
    loop made bufferization copy a row of the end's output into each fused op's buffer first."""
    init = op.operands[len(op.operands) - 1]
    empty = producer(init)
    if empty is not None and empty.name == "tensor.empty":
        element = ir.RankedTensorType(init.type).element_type
        dynamic = iter(empty.operands)  # the sizes of its dynamic dimensions, in order
        sizes = [next(dynamic) if size is None else size for size in _shape(init)]
        with ir.InsertionPoint(op), op.location:
            op.operands[len(op.operands) - 1] = tensor.EmptyOp(sizes, element).result


def match(attr: str, mark: str) -> str:
    """A transform line's right-hand side: the ops marked `attr = "<mark>"`."""
    return (f'transform.structured.match attributes{{{attr} = "{mark}"}} in %root'
            " : (!transform.any_op) -> !transform.any_op")


def _ranked(value: ir.Value) -> bool:
    return isinstance(value.type, ir.RankedTensorType)


def _chain_end(op: ir.Operation) -> bool:
    """An elementwise generic over rows of at least MIN_ROW elements (or a run-time count of
    them), of rank 2 or more."""
    if op.name != "linalg.generic" or len(op.results) != 1 or not _ranked(op.results[0]):
        return False
    kinds = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    shape = _shape(op.results[0])
    return (len(shape) >= 2 and "reduction" not in str(kinds) and (shape[-1] is None or shape[-1] >= MIN_ROW)
            and map_dims(op)[-1] == list(range(len(shape))))


def _row_local(op: ir.Operation, rows: int) -> bool:
    """A generic whose loops are the `rows` row loops (in order, read so by its output) then at
    most one more (the row's elements), every operand ranked and read along some of the loops in
    order (a row's statistic drops the last loop; a mask over [queries, keys] is broadcast over
    the heads), or a fill of such a result."""
    if op.name == "linalg.fill":
        return len(op.results) == 1 and _ranked(op.results[0]) and len(_shape(op.results[0])) in (rows, rows + 1)
    if op.name != "linalg.generic" or len(op.results) != 1:
        return False
    n_loops = len(ir.ArrayAttr(op.attributes["iterator_types"]))
    if n_loops not in (rows, rows + 1) or not all(_ranked(v) for v in op.operands):
        return False
    head = list(range(rows))
    kinds = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    if any("reduction" in kinds[d] for d in head):
        return False
    return all(dims == sorted(set(dims)) for dims in map_dims(op)[:-1]) and map_dims(op)[-1][:rows] == head


def _reduces_rows(op: ir.Operation) -> bool:
    kinds = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    return "reduction" in kinds[-1] and sum("reduction" in k for k in kinds) == 1


def _row_producers(end: ir.Operation) -> list[ir.Operation]:
    """The row-local ops (`_row_local`) that `end`'s inputs come from, transitively through
    row-local ops, whose every use is in the chain (others would compute their rows twice) and
    which the chain reads along its rows (a mask broadcast over the heads stays whole: fused,
    it would be computed again for every head)."""
    rows = len(_shape(end.results[0])) - 1
    found: list[ir.Operation] = []
    pending = _read_by_rows(end, rows)
    while pending:
        op = producer(pending.pop())
        if op is not None and op not in found and _row_local(op, rows):
            found.append(op)
            pending += _read_by_rows(op, rows)
    while True:
        chain = {end.operation, *found}
        kept = [op for op in found if all(u.owner.operation in chain for r in op.results for u in r.uses)]
        if len(kept) == len(found):
            return kept
        found = kept


def _read_by_rows(op: ir.Operation, rows: int) -> list[ir.Value]:
    """The operands of `op` (a generic or a fill) that it reads along the `rows` row loops in order."""
    if op.name != "linalg.generic":
        return list(op.operands)
    return [v for v, dims in zip(op.operands, map_dims(op), strict=True) if dims[:rows] == list(range(rows))]
