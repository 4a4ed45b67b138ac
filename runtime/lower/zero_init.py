"""Contractions (and depthwise convolutions) that start from zero in registers, not from a
zeroed output in memory.

A contraction's output starts as a `linalg.fill` of 0: the fill writes the whole output, then
each register tile reads its accumulators back from it, and writes them once k is done. Where k
is short (a weight gradient's k is the batch) those two passes over the output cost as much as
the multiply-adds: a [512 x 64] x [64 x 2048] product's 4 MiB output, one thread, 1.57 ms
against MKL's 0.90. Every register tile of a scheduled contraction is visited once, so its
accumulators are read before anything is written there: `drop_zero_fills` gives such a
contraction a tensor of undefined values instead of its fill (a bufferization.alloc_tensor), and
once the tiles are vectorized, `zero_accumulators` starts each tile's reduction loop from a zero
vector instead of that read.
"""

from __future__ import annotations

from collections.abc import Iterable

from mlir import ir
from mlir.dialects import arith, bufferization, linalg, tensor

from .irutil import defined_in, find_ops, positive_zero

ROOT = "bufferization.alloc_tensor"  # what a dropped fill's tensor becomes, marked DROPPED
DROPPED = "torchtosa.dropped_fill"  # other alloc_tensors (a padded input's, `convolutions`) are not ours
ACCUMULATES = "torchtosa.accumulates"  # a loop whose carried tensor holds partial sums (`schedule._k_chunks`)


def drop_zero_fills(contractions: Iterable[ir.Operation]) -> None:
    """Give each contraction whose output is a static zero `linalg.fill` used by it alone
    (directly, or as the initial value of the loops `schedule.pack_panels` built around it), and
    that nothing adds to afterwards, a tensor of undefined values instead: a
    bufferization.alloc_tensor marked DROPPED, which tiling and canonicalization leave as it is (a
    tensor.empty they fold and replace), so `zero_accumulators` finds it. The fill is erased."""
    for op in contractions:
        fill = _root(op.operands[len(op.operands) - 1], "linalg.fill")
        if fill is None or not positive_zero(fill.operands[0]) or not _single_use(fill.results[0]) \
                or _accumulated(_final(fill.results[0])):
            continue
        filled = ir.RankedTensorType(fill.results[0].type)
        with ir.InsertionPoint(fill), fill.location:
            sizes = [tensor.dim(fill.operands[1], arith.constant(ir.IndexType.get(), i))
                     for i in range(filled.rank) if filled.is_dynamic_dim(i)]  # a run-time size's
            alloc = bufferization.AllocTensorOp(filled, sizes)
            alloc.operation.attributes[DROPPED] = ir.UnitAttr.get()
        fill.results[0].replace_all_uses_with(alloc.result)
        fill.erase()


def zero_accumulators(module: ir.Module) -> None:
    """After tiling and vectorizing: replace each vector.transfer_read that starts a reduction
    loop's accumulators (an scf.for initial value) from a slice of a ROOT tensor by a zero
    vector, and each ROOT by a tensor.empty. A tile read anywhere else, which nothing here
    expects, gets its fill back: a linalg.fill of the tensor (plain loops, slower, as exact)."""
    with module.context, ir.Location.unknown():
        for read in find_ops(module, lambda op: op.name == "vector.transfer_read"):
            result = read.results[0]
            root = _root(read.operands[0], ROOT, list(read.operands)[1:])
            if root is None or DROPPED not in root.attributes \
                    or not all(use.owner.name == "scf.for" for use in result.uses):
                continue
            vector = ir.VectorType(result.type)
            with ir.InsertionPoint(read):
                zero = arith.ConstantOp(vector, ir.DenseElementsAttr.get_splat(
                    vector, ir.FloatAttr.get(vector.element_type, 0.0))).result
            result.replace_all_uses_with(zero)
            read.erase()
        for alloc in find_ops(module, lambda op: op.name == ROOT and DROPPED in op.attributes):
            t = ir.RankedTensorType(alloc.results[0].type)
            dynamic = iter(alloc.operands)  # the run-time sizes, in order
            with ir.InsertionPoint(alloc), alloc.location:
                empty = tensor.EmptyOp([next(dynamic) if t.is_dynamic_dim(i) else size
                                        for i, size in enumerate(t.shape)], t.element_type)
            alloc.results[0].replace_all_uses_with(empty.result)
            alloc.erase()
            if _read(empty.result):
                _refill(empty)


def _refill(empty: ir.Operation) -> None:
    """Fill `empty` with zeros again, for every user."""
    result = empty.results[0]
    element = ir.RankedTensorType(result.type).element_type
    with ir.InsertionPoint.after(empty):
        zero = arith.ConstantOp(element, ir.FloatAttr.get(element, 0.0)).result
        filled = linalg.fill(zero, outs=[result])
    for use in list(result.uses):
        if use.owner != filled.owner:
            use.owner.operands[use.operand_number] = filled


_WRITES = ("vector.transfer_write", "tensor.insert_slice")  # operand 1: the tensor written into


def _read(value: ir.Value, written: bool = False) -> bool:
    """Whether anything reads `value`'s undefined contents: a use, through slices, writes into
    it and loop-carried values, other than a write or a yield. Once a slice has been written
    (`written`: after a write's result, outside the loops that write tiles), a vector read that
    starts no loop's accumulators is a consumer's read of what was written (an epilogue reading
    a row of 24 columns after a panel of 16 and the 8 beside it were inserted, AVX2)."""
    for use in value.uses:
        owner = use.owner
        if owner.name in ("tensor.extract_slice", "tensor.cast"):
            if _read(owner.results[0], written):
                return True
        elif (owner.name in _WRITES and use.operand_number == 1) or owner.name == "tensor.insert_slice":
            if _read(owner.results[0], True):  # written into, or (a slice's tiles) inserted back
                return True
        elif owner.name == "scf.for" and use.operand_number >= 3:
            index = use.operand_number - 3
            if _read(owner.regions[0].blocks[0].arguments[index + 1], written) or _read_after(owner.results[index]):
                return True
        elif owner.name == "vector.transfer_read" and written \
                and not any(u.owner.name == "scf.for" for u in owner.results[0].uses):
            continue
        elif owner.name != "scf.yield":
            return True
    return False


def _read_after(result: ir.Value) -> bool:
    """Whether a loop that starts from a loop's result (a remainder of the same tiles) reads
    what it has not written, or a tile is read from a slice of the result (the columns after
    whole panels, `schedule._column_panels`, which the panels' loop does not write); the
    result's other users see the whole output written."""
    return any(_read(use.owner.regions[0].blocks[0].arguments[use.operand_number - 2])
               or _read_after(use.owner.results[use.operand_number - 3])
               for use in result.uses if use.owner.name == "scf.for" and use.operand_number >= 3) \
        or any(_tile_read(use.owner.results[0]) for use in result.uses
               if use.owner.name in ("tensor.extract_slice", "tensor.cast"))


def _tile_read(value: ir.Value, seeded: bool = False) -> bool:
    """Whether tiles read `value` as their accumulators: it (through slices and casts) starts an
    scf.for's loop-carried tensor (`seeded`), and a vector.transfer_read reads that, or a slice
    of it, or of the loop's result. (A consumer reading slices of `value` directly reads what
    was written.)"""
    for use in value.uses:
        owner = use.owner
        if owner.name == "vector.transfer_read" and seeded:
            return True
        if owner.name in ("tensor.extract_slice", "tensor.cast") and _tile_read(owner.results[0], seeded):
            return True
        if owner.name == "scf.for" and use.operand_number >= 3 and (
                _tile_read(owner.regions[0].blocks[0].arguments[use.operand_number - 2], True)
                or _tile_read(owner.results[use.operand_number - 3], True)):
            return True
    return False


def _final(filled: ir.Value) -> ir.Value:
    """What a fill's value (used once) becomes: the result of the loop it starts, else of the
    contraction."""
    use = next(iter(filled.uses))
    return use.owner.results[use.operand_number - 3 if use.owner.name == "scf.for" else 0]


def _accumulated(value: ir.Value) -> bool:
    """Whether another loop or op adds to `value` (a filter tap's matmul to the previous tap's):
    its tiles would read sums, not zeros, where `_root` leads them to the dropped fill."""
    for use in value.uses:
        owner = use.owner
        outs = len(owner.operands) - len(owner.results)  # a linalg op's first output operand
        if owner.name in ("scf.for", "scf.forall") or (owner.name.startswith("linalg.") and use.operand_number >= outs):
            return True
        if owner.name in _WRITES and use.operand_number == 1 and _accumulated(owner.results[0]):
            return True  # the value with a slice written into it (`schedule._rest_columns`) is added to
    return False


def _root(value: ir.Value, name: str, indices: list[ir.Value] | None = None) -> ir.Operation | None:
    """The op named `name` that `value` is (a slice of), through tensor.extract_slice, tensor.cast and the
    initial values of scf.for loop-carried tensors, loop results and writes (a remainder's
    tiles, disjoint from the whole ones, start from their result); None if it comes from
    anything else.

    With `indices` (a tile read's: its own, to which the slices' offsets on the way are added),
    a loop-carried tensor leads on only where the slice read moves with the loop: a tile that
    every iteration reads at the same place reads what the iteration before wrote (a reduction
    loop whose accumulators were not hoisted into registers), not the fill."""
    while True:
        if isinstance(value, ir.OpResult) and value.owner.name == "scf.for":
            value = value.owner.operands[3 + value.result_number]
            continue
        if isinstance(value, ir.BlockArgument):
            loop = value.owner.owner
            if loop.name != "scf.for" or value.arg_number == 0 or ACCUMULATES in loop.attributes:
                return None  # a chunk of k's tiles start from the sums of the chunks before it
            if indices is not None and not any(_varies(v, loop) for v in indices):
                return None
            value = loop.operands[2 + value.arg_number]  # lower, upper, step, then the initial values
            continue
        op = value.owner
        if op.name == name:
            return op
        if op.name not in ("tensor.extract_slice", "tensor.cast", *_WRITES):
            return None
        if indices is not None and op.name == "tensor.extract_slice":
            indices = [*indices, *list(op.operands)[1:]]
        # a cast: a peeled remainder's tiles, of static sizes, typed as of run-time ones
        value = op.operands[0 if op.name in ("tensor.extract_slice", "tensor.cast") else 1]


def _varies(value: ir.Value, loop: ir.Operation) -> bool:
    """Whether `value` is computed from `loop`'s induction variable (within its body)."""
    if isinstance(value, ir.BlockArgument):
        return value.owner.owner.operation == loop.operation and value.arg_number == 0
    return defined_in(value, loop) and any(_varies(v, loop) for v in value.owner.operands)


def _single_use(value: ir.Value) -> bool:
    return sum(1 for _ in value.uses) == 1
