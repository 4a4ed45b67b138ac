"""Buffer copies between strided views as loops of contiguous row copies.

MLIR lowers a `memref.copy` to LLVM's memcpy only where both sides are contiguous; any other
(a convolution's input copied into the interior of its padded buffer, a part's argument
into a slice of a larger buffer) becomes a call of the C runner library's `memrefCopy`, which
walks the elements one at a time with index arithmetic per element: ~5% of ConvNeXt-T's run
time. `row_copies` rewrites such a copy of a static shape as a loop nest over its outer
dimensions around a copy of the innermost dimensions contiguous on both sides: memcpy's.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, memref, scf

from .irutil import find_ops


def row_copies(module: ir.Module) -> None:
    """Rewrite every copy between strided memrefs of `module` as loops of contiguous copies."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name == "memref.copy"):
            source, target = op.operands
            inner = _contiguous_suffix(source.type, target.type)
            rank = ir.MemRefType(source.type).rank
            if inner is None or inner in (0, rank):
                continue  # dynamic, element-wise strided, or contiguous already (memcpy)
            _split(op, rank - inner)


def _contiguous_suffix(*types: ir.Type) -> int | None:
    """How many innermost dimensions are row-major contiguous in every memref of `types` (a
    static shape each); None for a dynamic shape or stride."""
    counts = []
    for t in types:
        memref_type = ir.MemRefType(t)
        if not memref_type.has_static_shape:
            return None
        strides, _ = memref_type.get_strides_and_offset()
        if not all(memref_type.is_static_stride_or_offset(s) for s in strides):
            return None
        count, expected = 0, 1
        for size, stride in zip(reversed(memref_type.shape), reversed(strides), strict=True):
            if size != 1 and stride != expected:
                break
            count, expected = count + 1, expected * size
        counts.append(count)
    return min(counts)


def _split(op: ir.Operation, outer: int) -> None:
    """Replace copy `op` by loops over its `outer` leading dimensions, each step one copy of the
    innermost ones."""
    source, target = op.operands
    shape = ir.MemRefType(source.type).shape
    point, ivs = ir.InsertionPoint(op), []
    for size in shape[:outer]:
        with point:
            loop = scf.ForOp(_index(0), _index(size), _index(1))
        with ir.InsertionPoint(loop.body):
            scf.YieldOp([])
        point = ir.InsertionPoint(loop.body.operations[0])
        ivs.append(loop.induction_variable)
    with point:
        offsets = [*ivs, *[0] * (len(shape) - outer)]
        sizes = [*[1] * outer, *shape[outer:]]
        memref.CopyOp(*(memref.subview(v, offsets, sizes, [1] * len(shape)) for v in (source, target)))
    op.erase()


def _index(value: int) -> ir.Value:
    return arith.constant(ir.IndexType.get(), value)
