"""Patch convolutions (kernel = stride) as convolutions of stride 1, for NPU compilers (`to_tosa(..., npu=True)`).

A vision transformer's patch embedding is a convolution whose kernel is its stride, without
padding: each output reads its own patch (ViT: 8x8 or 16x16 of RGB). Ethos-U's convolutions take
strides up to 3 (`NATIVE_STRIDE`); Arm's Vela splits a larger one into a convolution per output
position (the ViT of tests/test_models.py: 16 Conv2D ops, 63,000 of the network's 191,000
cycles). The same sums come from a convolution of stride 1: the input `[N, OH kh, OW kw, C]`
laid out as `[N, kh, OH OW, kw C]` (a reshape, a transpose of OH and kh, a reshape), a kernel
`(kh, 1)` over its kh rows, the weight OHWI `[O, kh, kw, C]` read as `[O, kh, 1, kw C]` (the
same order); 2,656 + 2,477 cycles there. (A 1x1 convolution of the patches as channels would
need (kh, kw, C) together, a 4-D transpose Vela splits into five: 20,000 cycles; the input as
batches of `kh` rows, no transpose, one convolution per batch: 12,000.) Integer convolutions
only: their i32 (int16: i48) sums are exact in any order (a float sum would round differently).
An i48 result is not reshaped (TOSA reshapes no i48): its per-channel RESCALE moves before the
reshape.
"""

from __future__ import annotations

from mlir import ir

from . import irutil
from .layout import _shape, _with_shape, reshape, rewrite_each, transpose

INTEGER = ("i8", "i16")  # int16 too (a16w8: i48 sums, exact in any order as i32 ones)
NATIVE_STRIDE = 3  # the largest stride Ethos-U's convolutions take in hardware


def patches_as_convolutions(module: ir.Module) -> int:
    """Rewrite every integer `tosa.conv2d` of `module` whose kernel equals its stride (larger than
    `NATIVE_STRIDE`), without padding or dilation, as a convolution of stride 1 over its patches'
    rows; the number rewritten."""
    return rewrite_each(module, ("tosa.conv2d",), _as_patches)  # the weights' reshapes folded into constants


def _ints(op: ir.Operation, name: str) -> list[int]:
    return list(ir.DenseI64ArrayAttr(op.attributes[name]))


def _as_patches(conv: ir.Operation) -> bool:
    x, w = conv.operands[0], conv.operands[1]
    shape, kernel = _shape(x), _shape(w)
    weight = irutil.producer(w)
    if shape is None or kernel is None or weight is None or weight.name != "tosa.const" or \
            str(ir.RankedTensorType(x.type).element_type) not in INTEGER:
        return False
    n, h, width, c = shape
    o, kh, kw, _ = kernel
    if _ints(conv, "stride") != [kh, kw] or max(kh, kw) <= NATIVE_STRIDE or any(_ints(conv, "pad")) or \
            _ints(conv, "dilation") != [1, 1] or h % kh or width % kw:
        return False
    oh, ow = h // kh, width // kw
    # an int16 convolution's i48 sums can't be reshaped (TOSA): the reshape goes after their RESCALE
    users = [u.owner for u in conv.results[0].uses]
    wide = str(ir.RankedTensorType(conv.results[0].type).element_type) == "i48"
    if wide and (len(users) != 1 or users[0].name != "tosa.rescale"):
        return False
    attrs = {name: conv.attributes[name] for name in conv.attributes}
    attrs["stride"] = ir.DenseI64ArrayAttr.get([1, 1])
    with ir.InsertionPoint(conv), conv.location:
        # [n, oh kh, ow kw, c] -> [n, kh, oh ow, kw c]: a kernel (kh, 1) of stride 1 over kh rows
        # gives each patch's sum once; the weight [o, kh, kw, c] is [o, kh, 1, kw c] in that order
        rows = transpose(reshape(x, [n, oh, kh, width * c]), (0, 2, 1, 3))
        bands = reshape(rows, [n, kh, oh * ow, kw * c])
        flat = reshape(w, [o, kh, 1, kw * c])
        new = ir.Operation.create("tosa.conv2d", results=[_with_shape(conv.results[0], [n, 1, oh * ow, o])],
                                  operands=[bands, flat, *list(conv.operands)[2:]], attributes=attrs)
        if not wide:
            conv.results[0].replace_all_uses_with(reshape(new.results[0], [n, oh, ow, o]))
            conv.erase()
            return True
        rescale = users[0].operation
        with ir.InsertionPoint(rescale), rescale.location:
            scaled = ir.Operation.create("tosa.rescale", results=[_with_shape(rescale.results[0], [n, 1, oh * ow, o])],
                                         operands=[new.results[0], *list(rescale.operands)[1:]],
                                         attributes={name: rescale.attributes[name] for name in rescale.attributes})
            rescale.results[0].replace_all_uses_with(reshape(scaled.results[0], [n, oh, ow, o]))
    rescale.erase()
    conv.erase()
    return True
