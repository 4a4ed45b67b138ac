"""Explicit pads of integer convolutions as the convolutions' own padding, for NPU compilers.

A model that pads TensorFlow's way (transformers' MobileNetV2: `F.pad` before each 3x3 conv)
has a `tosa.pad` of H and W, with the input's zero point, before each convolution (between
reshapes to rank 3 and back, as MLIR's tosa-validate holds a pad's amounts to 6 values), and
where the quantization changes a per-tensor RESCALE after it. Arm's Vela copies each such pad
into a new buffer (its MemoryCopy ops: 81 of MobileNetV2's 173 NPU ops). A convolution's `pad`
attribute pads its input with its zero point itself: an integer conv reads a padded element as
`x - input_zp = 0`, exactly what the explicit pad's zero point gives, so the pad's amounts move
into the attribute. Through the RESCALE too: the pad value at the RESCALE's input zero point
becomes exactly its output zero point (`(zp_in - zp_in) * m` rounds to 0), the conv's input
zero point. Float convolutions keep their pads (a padded 0.0 * w may be -0.0 or NaN).
"""

from __future__ import annotations

from mlir import ir

from . import irutil
from .layout import _shape, _shape_values, _with_shape, reshape, rewrite_each

CONVOLUTIONS = ("tosa.conv2d", "tosa.depthwise_conv2d")
INTEGER = ("i8", "i16")  # int16 too (a16w8: its zero point is 0, so the padding is the same)


def pads_into_convolutions(module: ir.Module) -> int:
    """Move every explicit zero-point pad of H and W before an integer convolution of `module`
    into the convolution's padding; the number moved."""
    return rewrite_each(module, CONVOLUTIONS, _fold)


def _only(value: ir.Value, name: str) -> ir.Operation | None:
    """The producer of `value` if it is a `name` op whose result nothing else reads."""
    producer = irutil.producer(value)
    if producer is None or producer.name != name or len(list(producer.results[0].uses)) != 1:
        return None
    return producer


def _scalar(value: ir.Value) -> int | None:
    """The one integer of a constant (a zero point, a pad value)."""
    producer = irutil.producer(value)
    if producer is None or producer.name != "tosa.const":
        return None
    values = ir.DenseIntElementsAttr(producer.attributes["values"])
    return int(values[0]) if len(values) == 1 else None


def _fold(conv: ir.Operation) -> bool:
    source = conv.operands[0]
    shape = _shape(source)
    if shape is None or len(shape) != 4 or str(ir.RankedTensorType(source.type).element_type) not in INTEGER:
        return False
    chain, value = [], source  # reshapes and at most one per-tensor RESCALE between the pad and the conv
    while (step := _only(value, "tosa.reshape") or _only(value, "tosa.rescale")) is not None and len(chain) < 3:
        chain.append(step)
        value = step.operands[0]
    rescales = [op for op in chain if op.name == "tosa.rescale"]
    rescale = rescales[0] if len(rescales) == 1 else None
    pad = _only(value, "tosa.pad")
    if pad is None or len(rescales) > 1 or (rescale is not None and (
            ir.BoolAttr(rescale.attributes["per_channel"]).value
            or _scalar(rescale.operands[4]) != _scalar(conv.operands[3]))):
        return False
    zero = _scalar(rescale.operands[3]) if rescale is not None else _scalar(conv.operands[3])
    amounts, padded = _shape_values(pad.operands[1]), _shape(pad.results[0])
    if zero is None or amounts is None or padded is None or _scalar(pad.operands[2]) != zero:
        return False
    # each padded axis of the pad is the conv input's H or W (the reshape keeps the axes longer than 1)
    big_padded, big_input = [i for i, n in enumerate(padded) if n != 1], [i for i, n in enumerate(shape) if n != 1]
    if [padded[i] for i in big_padded] != [shape[i] for i in big_input]:
        return False
    axis_of = dict(zip(big_padded, big_input, strict=True))
    extra = [0, 0, 0, 0]  # top, bottom, left, right
    unpadded = list(shape)
    for d in range(len(padded)):
        lo, hi = amounts[2 * d], amounts[2 * d + 1]
        if lo == hi == 0:
            continue
        axis = axis_of.get(d)
        if axis not in (1, 2):
            return False
        extra[2 * (axis - 1)], extra[2 * (axis - 1) + 1] = lo, hi
        unpadded[axis] -= lo + hi
    attrs = {name: conv.attributes[name] for name in conv.attributes}
    attrs["pad"] = ir.DenseI64ArrayAttr.get([p + e for p, e in zip(ir.DenseI64ArrayAttr(attrs["pad"]), extra,
                                                                       strict=True)])
    with ir.InsertionPoint(conv), conv.location:
        new = reshape(pad.operands[0], unpadded)
        if rescale is not None:
            new = ir.Operation.create("tosa.rescale", results=[_with_shape(rescale.results[0], unpadded)],
                                      operands=[new, *list(rescale.operands)[1:]],
                                      attributes={n: rescale.attributes[n] for n in rescale.attributes}).results[0]
        moved = ir.Operation.create(conv.name, results=[conv.results[0].type],
                                    operands=[new, *list(conv.operands)[1:]], attributes=attrs)
    conv.results[0].replace_all_uses_with(moved.results[0])
    conv.erase()
    for op in (*chain, pad):
        if not list(op.results[0].uses):
            op.erase()
    return True

