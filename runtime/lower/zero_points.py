"""Zero points out of int8 contractions, for the optimizing pipeline.

TOSA's integer `matmul`, `conv2d` and `depthwise_conv2d` subtract zero points from their int8
operands inside the contraction; tosa-to-linalg makes them linalg's `quantized_*` ops, which
the schedule does not vectorize (they would run as scalar loops). Since

    sum_k (a[k] - za) * b[k] = sum_k a[k] * b[k] - za * sum_k b[k]      (zb = 0)

the contraction with zero points is the plain one (i8 x i8 -> i32, which the schedule tiles
and vectorizes like f32) minus `za` times a sum over the other operand, in exact modular i32
arithmetic, as TOSA's accumulator is. For a matmul that sum is a [B, 1, N] row subtracted from
the result (and `zb` the same way with the first operand's row sums, plus K * za * zb); for a
convolution it is one number per output channel, folded into the bias, with the input padded
by `za` beforehand (the padded border must contribute a - za = 0, as in TOSA). The module
keeps its meaning exactly; opt="none" (the reference lowering) does not run this.
"""

from __future__ import annotations

import numpy as np
from mlir import ir

from .irutil import find_ops

_OPS = ("tosa.matmul", "tosa.conv2d", "tosa.depthwise_conv2d")


def separate_zero_points(module: ir.Module) -> None:
    """Rewrite each int8 matmul/conv2d/depthwise_conv2d with a non-zero constant zero point."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda o: o.name in _OPS):
            if int_width(op.operands[0].type) != 8:
                continue
            if op.name == "tosa.matmul":
                _matmul(op)
            else:
                _convolution(op)


def int_width(t: ir.Type) -> int | None:
    """The bit width of a tensor of signless integers, else None."""
    element = ir.RankedTensorType(t).element_type
    return element.width if isinstance(element, ir.IntegerType) and element.is_signless else None


def _zero_point(value: ir.Value) -> int | None:
    """The value of a constant one-element zero point, else None."""
    owner = value.owner
    if not isinstance(owner, ir.Operation) and not isinstance(owner, ir.OpView):
        return None
    if owner.name != "tosa.const":
        return None
    values = ir.DenseIntElementsAttr(owner.attributes["values"])
    return int(values[0]) if len(values) == 1 else None


def constant(value: ir.Value) -> np.ndarray | None:
    """The value of an integer tosa.const, possibly reshaped or transposed, else None."""
    owner = value.owner
    if not isinstance(owner, ir.OpView | ir.Operation):
        return None
    if owner.name == "tosa.const":
        attr = owner.attributes["values"]
        if not isinstance(attr, ir.DenseIntElementsAttr):
            return None
        shape = ir.RankedTensorType(value.type).shape
        if attr.is_splat:
            return np.full(shape, ir.IntegerAttr(attr.get_splat_value()).value, dtype=np.int64)
        return np.array(attr).reshape(shape)
    if owner.name in ("tosa.reshape", "tosa.transpose"):
        source = constant(owner.operands[0])
        if source is None:
            return None
        if owner.name == "tosa.reshape":
            return source.reshape(ir.RankedTensorType(value.type).shape)
        return source.transpose(list(ir.DenseI32ArrayAttr(owner.attributes["perms"])))
    return None


class _Emit:
    """Creates TOSA ops before `anchor`."""

    def __init__(self, anchor: ir.Operation) -> None:
        self.ip = ir.InsertionPoint(anchor)
        self.i32 = ir.IntegerType.get_signless(32)

    def op(self, name: str, result: ir.Type, operands: list[ir.Value], **attributes: ir.Attribute) -> ir.Value:
        return ir.Operation.create(name, results=[result], operands=operands, attributes=attributes,
                                   ip=self.ip).result

    def const(self, values: list[int], width: int, shape: list[int]) -> ir.Value:
        t = ir.RankedTensorType.get(shape, ir.IntegerType.get_signless(width))
        return self.op("tosa.const", t, [], values=ir.DenseElementsAttr.get(_array(values, width, shape), type=t))

    def shape(self, dims: list[int]) -> ir.Value:
        index = ir.IndexType.get()
        t = ir.Type.parse(f"!tosa.shape<{len(dims)}>")
        attr = ir.DenseElementsAttr.get(_array(dims, 64, [len(dims)]), type=ir.RankedTensorType.get([len(dims)], index))
        return self.op("tosa.const_shape", t, [], values=attr)

    def cast32(self, x: ir.Value) -> ir.Value:
        return self.op("tosa.cast", ir.RankedTensorType.get(ir.RankedTensorType(x.type).shape, self.i32), [x])

    def sums(self, x: ir.Value, axes: list[int]) -> ir.Value:
        """The i32 sum of int8 `x` over `axes` (kept as dims of 1): a constant if `x` is one (a
        frozen weight, possibly reshaped or transposed), else summed per call."""
        data = constant(x)
        if data is not None:
            total = data.astype(np.int64).sum(axis=tuple(axes), keepdims=True)
            return self.const([(int(v) + 2**31) % 2**32 - 2**31 for v in total.flat], 32, list(total.shape))
        x = self.cast32(x)
        for axis in axes:
            shape = list(ir.RankedTensorType(x.type).shape)
            shape[axis] = 1
            x = self.op("tosa.reduce_sum", ir.RankedTensorType.get(shape, self.i32), [x],
                        axis=ir.IntegerAttr.get(self.i32, axis))
        return x

    def times(self, x: ir.Value, factor: int) -> ir.Value:
        """`x * factor` in i32 (wrapping, as the accumulator)."""
        rank = ir.RankedTensorType(x.type).rank
        return self.op("tosa.mul", x.type, [x, self.const([factor], 32, [1] * rank), self.const([0], 8, [1])])

    def binary(self, name: str, a: ir.Value, b: ir.Value, result: ir.Type | None = None) -> ir.Value:
        return self.op(name, result or a.type, [a, b])


def _array(values: list[int], width: int, shape: list[int]) -> np.ndarray:
    return np.asarray(values, dtype={8: np.int8, 32: np.int32, 64: np.int64}[width]).reshape(shape)


def _matmul(op: ir.Operation) -> None:
    a, b, a_zp, b_zp = op.operands
    za, zb = _zero_point(a_zp), _zero_point(b_zp)
    if za is None or zb is None or (za == 0 and zb == 0):
        return
    emit = _Emit(op)
    zero = emit.const([0], 8, [1])
    acc = emit.op("tosa.matmul", op.result.type, [a, b, zero, zero])
    k = ir.RankedTensorType(a.type).shape[2]
    if za:  # - za * sum_k b[k, n], a [B, 1, N] row
        acc = emit.binary("tosa.sub", acc, emit.times(emit.sums(b, [1]), za))
    if zb:  # - zb * sum_k a[m, k], a [B, M, 1] column
        acc = emit.binary("tosa.sub", acc, emit.times(emit.sums(a, [2]), zb))
    if za and zb:
        acc = emit.binary("tosa.add", acc, emit.const([(k * za * zb + 2**31) % 2**32 - 2**31], 32, [1, 1, 1]))
    op.result.replace_all_uses_with(acc)
    op.erase()


def _convolution(op: ir.Operation) -> None:
    x, w, bias, x_zp, w_zp = op.operands
    zx, zw = _zero_point(x_zp), _zero_point(w_zp)
    if zx is None or zw != 0 or zx == 0 or int_width(bias.type) != 32:
        return
    emit = _Emit(op)
    pad = list(ir.DenseI64ArrayAttr(op.attributes["pad"]))
    if any(pad):  # the border holds the zero point, which contributes nothing
        top, bottom, left, right = pad
        shape = list(ir.RankedTensorType(x.type).shape)
        shape[1] += top + bottom
        shape[2] += left + right
        element = ir.RankedTensorType(x.type).element_type
        x = emit.op("tosa.pad", ir.RankedTensorType.get(shape, element),
                    [x, emit.shape([0, 0, top, bottom, left, right, 0, 0]), emit.const([zx], 8, [1])])
    # sum of the weights per output channel: conv2d's weight is [O, KH, KW, I], depthwise's [KH, KW, C, M]
    per_channel = emit.sums(w, [1, 2, 3] if op.name == "tosa.conv2d" else [0, 1])
    channels = ir.RankedTensorType(op.result.type).shape[-1]
    flat = emit.op("tosa.reshape", ir.RankedTensorType.get([channels], emit.i32), [per_channel, emit.shape([channels])])
    bias = emit.binary("tosa.sub", bias, emit.times(flat, zx), flat.type)
    attributes = {name: op.attributes[name] for name in op.attributes}
    attributes["pad"] = ir.DenseI64ArrayAttr.get([0, 0, 0, 0])
    zero = emit.const([0], 8, [1])
    conv = ir.Operation.create(op.name, results=[op.result.type], operands=[x, w, bias, zero, zero],
                               attributes=attributes, ip=emit.ip).result
    op.result.replace_all_uses_with(conv)
    op.erase()
