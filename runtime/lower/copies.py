"""Buffer copies between strided views as loops of contiguous row copies.

MLIR lowers a `memref.copy` to LLVM's memcpy only where both sides are contiguous; any other
(a convolution's input copied into the interior of its padded buffer, a part's argument
into a slice of a larger buffer) becomes a call of the C runner library's `memrefCopy`, which
walks the elements one at a time with index arithmetic per element: ~5% of ConvNeXt-T's run
time, and a third of a dynamic attention layer's, whose heads are copied out of the projection's
rows. `row_copies` rewrites such a copy as a loop nest over its outer dimensions (of static or
run-time sizes) around a copy of the innermost dimensions of static sizes that are contiguous on
both sides: memcpy's.
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
            memref_type = ir.MemRefType(source.type)
            if inner == 0 or (inner == memref_type.rank and memref_type.has_static_shape):
                continue  # element-wise strided, or contiguous already (memcpy)
            _split(op, memref_type.rank - inner)


def _contiguous_suffix(*types: ir.Type) -> int:
    """How many innermost dimensions, each of a static size, are row-major contiguous in every
    memref of `types`."""
    counts = []
    for t in types:
        memref_type = ir.MemRefType(t)
        strides, _ = memref_type.get_strides_and_offset()
        count, expected = 0, 1
        for size, stride in zip(reversed(memref_type.shape), reversed(strides), strict=True):
            if ir.ShapedType.is_dynamic_size(size) or (size != 1 and stride != expected):
                break
            count, expected = count + 1, expected * size
        counts.append(count)
    return min(counts)


def _split(op: ir.Operation, outer: int) -> None:
    """Replace copy `op` by loops over its `outer` leading dimensions, each step one copy of the
    innermost ones."""
    source, target = op.operands
    shape = ir.MemRefType(source.type).shape
    with ir.InsertionPoint(op):
        bounds = [memref.dim(source, _index(i)) if ir.ShapedType.is_dynamic_size(size) else _index(size)
                  for i, size in enumerate(shape[:outer])]
    point, ivs = ir.InsertionPoint(op), []
    for bound in bounds:
        with point:
            loop = scf.ForOp(_index(0), bound, _index(1))
        with ir.InsertionPoint(loop.body):
            scf.YieldOp([])
        point = ir.InsertionPoint(loop.body.operations[0])
        ivs.append(loop.induction_variable)
    with point:
        offsets = [*ivs, *[0] * (len(shape) - outer)]
        sizes = [*[1] * outer, *shape[outer:]]
        memref.CopyOp(*(memref.subview(v, offsets, sizes, [1] * len(shape), result_type=_row_type(v.type, sizes))
                        for v in (source, target)))
    op.erase()


def _row_type(source: ir.Type, sizes: list[int]) -> ir.MemRefType:
    """The type of a subview of `sizes` at offsets known at run time, with unit steps."""
    memref_type = ir.MemRefType(source)
    strides, _ = memref_type.get_strides_and_offset()
    layout = ir.StridedLayoutAttr.get(ir.ShapedType.get_dynamic_stride_or_offset(), strides)
    return ir.MemRefType.get(sizes, memref_type.element_type, layout, memref_type.memory_space)


def _index(value: int) -> ir.Value:
    return arith.constant(ir.IndexType.get(), value)
