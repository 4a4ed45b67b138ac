"""Maxima over the last axis as maxima over the one before it, for NPU compilers (`to_tosa(..., npu=True)`).

An integer softmax subtracts each row's maximum (opdefs/quantize_table.yaml's qsoftmax): a
`tosa.reduce_max` over the last axis, which NHWC puts in the channels. Ethos-U reduces over
channels one element deep: Vela 5.2.0 estimates 8,052 cycles for the row maxima of attention
scores `[1, 4, 17, 17]` of int8, against 1,152 for the same reduction over the axis before, plus
2,465 for a `tosa.transpose` that swaps the two (the transpose of the `[.., 1, n]` result back
is a reshape). Maxima are exact in any order, so the rewrite changes no value.
"""

from __future__ import annotations

from mlir import ir

from .layout import _shape, _with_shape, rewrite_each, transpose

INTEGER = ("i8",)


def maxima_off_channels(module: ir.Module) -> int:
    """Rewrite every integer `tosa.reduce_max` of `module` over the last axis (of a rank >= 2
    tensor whose last two axes are longer than 1) as a transpose of those two axes, a maximum
    over the one before last and a transpose back; the number rewritten."""
    return rewrite_each(module, ("tosa.reduce_max",), _off_channels)  # the transposes back: reshapes


def _off_channels(reduce: ir.Operation) -> bool:
    x = reduce.operands[0]
    shape = _shape(x)
    if shape is None or len(shape) < 2 or str(ir.RankedTensorType(x.type).element_type) not in INTEGER:
        return False
    last = len(shape) - 1
    if ir.IntegerAttr(reduce.attributes["axis"]).value != last or shape[-1] == 1 or shape[-2] == 1:
        return False
    swap = (*range(last - 1), last, last - 1)
    with ir.InsertionPoint(reduce), reduce.location:
        rows = transpose(x, swap)
        maxima = ir.Operation.create("tosa.reduce_max", results=[_with_shape(x, [*shape[:-2], 1, shape[-2]])],
                                     operands=[rows], attributes={
                                         "axis": ir.IntegerAttr.get(ir.IntegerType.get_signless(32), last - 1)})
        back = transpose(maxima.results[0], swap)
    reduce.results[0].replace_all_uses_with(back)
    reduce.erase()
    return True
