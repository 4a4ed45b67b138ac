"""Fewer layout transposes between convolutions in native code (opt="default"/"parallel", on
TOSA, before partitioning). TOSA files for a target get the whole-graph layout of `layout.py`
instead; the native pipeline keeps this narrower pass until that one handles every program the
suite compiles (it left i1 values in memory between ops and an empty shape operand).

TOSA convolutions are NHWC and PyTorch's tensors NCHW, so each convolution's result is
transposed to NCHW and, for the next convolution, back to NHWC: a conv + BatchNorm + ReLU
layer reads and writes its whole activation twice more than the convolution does.
`sink_transposes` moves each NHWC -> NCHW transpose below the elementwise ops it feeds (the
epilogue; other transposes, such as attention's, are left alone),
computing them in the layout before the transpose; their other operands are transposed the other
way, which is cheap only for small ones (a BatchNorm's per-channel [1, C, 1, 1] parameters:
at most SMALL elements) or free for another transpose of the same permutation (a residual add).
A transpose meeting its inverse then cancels, and consecutive layers stay NHWC, as Inductor's
channels-last code does. A constant padding (tosa.pad: the explicit `F.pad` of models that pad
TensorFlow's way, such as transformers' MobileNetV2 before each 3x3 convolution) is sunk
through as well, its amounts permuted: otherwise the activation went back to NCHW to be padded
and to NHWC again, two copies of every depthwise convolution's input. A pad whose only user is
a transpose (the network's input, padded before the first convolution) is moved after it, so
that the transpose writes the padded buffer in place. Exact: the same
elementwise ops (and pads) on the same values, in another order in memory.
"""

from __future__ import annotations

import math

from mlir import ir

from .irutil import function_bodies

SMALL = 1 << 16  # elements of an operand transposed along with a sunk transpose
TO_NCHW = [0, 3, 1, 2]  # the transposes sunk: a convolution's NHWC result to PyTorch's layout
_ELEMENTWISE = frozenset({
    "tosa.add", "tosa.sub", "tosa.mul", "tosa.maximum", "tosa.minimum", "tosa.clamp", "tosa.sigmoid",
    "tosa.tanh", "tosa.exp", "tosa.negate", "tosa.abs", "tosa.erf", "tosa.reciprocal", "tosa.rsqrt",
    "tosa.pow", "tosa.log",
})
_OPERANDS = {"tosa.mul": 2, "tosa.negate": 1}  # tensor operands; the rest (mul's shift, zero points) stay


def sink_transposes(module: ir.Module) -> None:
    """Move tosa.transpose ops below the elementwise ops they feed, then cancel inverse pairs."""
    with module.context, ir.Location.unknown():
        for block in function_bodies(module):
            for op in list(block.operations):
                perm = _sinkable(op.operation)
                if perm is not None:
                    _sink(op.operation, perm)
                elif _sinkable_pad(op.operation):
                    _sink_pad(op.operation)
                elif (user := _hoistable_pad(op.operation)) is not None:
                    _hoist_pad(op.operation, user)
            for op in list(block.operations):
                if op.operation.name == "tosa.transpose":
                    _cancel(op.operation)
            for op in reversed(list(block.operations)):
                if op.operation.name == "tosa.transpose" and not list(op.results[0].uses):
                    op.operation.erase()


def _perm(op: ir.Operation) -> list[int]:
    return list(ir.DenseI32ArrayAttr(op.attributes["perms"]))


def _transpose_of(value: ir.Value) -> ir.Operation | None:
    owner = value.owner if isinstance(value, ir.OpResult) else None
    return owner.operation if owner is not None and owner.name == "tosa.transpose" else None


def _ranked(value: ir.Value) -> ir.RankedTensorType | None:
    t = value.type
    if not isinstance(t, ir.RankedTensorType) or not ir.RankedTensorType(t).has_static_shape:
        return None
    return ir.RankedTensorType(t)


def _sinkable(op: ir.Operation) -> list[int] | None:
    """The permutation (TO_NCHW) of the transpose(s) feeding elementwise `op` if it can be computed
    before them: every other tensor operand is such a transpose too, or small."""
    if op.name not in _ELEMENTWISE or len(op.results) != 1 or _ranked(op.results[0]) is None:
        return None
    operands = list(op.operands)[:_OPERANDS.get(op.name, len(op.operands))]
    perms = [_perm(t) for t in map(_transpose_of, operands) if t is not None]
    if not perms or any(p != TO_NCHW for p in perms):
        return None
    for value in operands:
        t = _ranked(value)
        if t is None or t.rank != len(perms[0]):
            return None
        if _transpose_of(value) is None and math.prod(t.shape) > SMALL:
            return None
    return perms[0]


def _padding(value: ir.Value) -> list[int] | None:
    """The amounts of a tosa.pad's `!tosa.shape` operand if it is a tosa.const_shape."""
    owner = value.owner if isinstance(value, ir.OpResult) else None
    if owner is None or owner.name != "tosa.const_shape":
        return None
    return [int(v) for v in ir.DenseIntElementsAttr(owner.attributes["values"])]


def _sinkable_pad(op: ir.Operation) -> bool:
    """Whether `op` is a tosa.pad by constant amounts of a TO_NCHW transpose."""
    if op.name != "tosa.pad" or _ranked(op.results[0]) is None:
        return False
    source = _transpose_of(op.operands[0])
    return source is not None and _perm(source) == TO_NCHW and _padding(op.operands[1]) is not None


def _sink_pad(op: ir.Operation) -> None:
    """Pad the transpose's input instead (each dimension by the amounts of the one it becomes),
    then transpose the padded tensor by TO_NCHW."""
    source = _transpose_of(op.operands[0])
    assert source is not None
    with ir.InsertionPoint(op), op.location:
        back = _transpose(_pad(op, source.operands[0], _inverse(TO_NCHW)), TO_NCHW)
    op.results[0].replace_all_uses_with(back)
    op.erase()


def _hoistable_pad(op: ir.Operation) -> ir.Operation | None:
    """The transpose using tosa.pad `op` (by constant amounts) if it is its only user: the
    network's input, padded in NCHW by a TF-padding model, before its transpose to NHWC."""
    if op.name != "tosa.pad" or _ranked(op.results[0]) is None or _padding(op.operands[1]) is None:
        return None
    uses = list(op.results[0].uses)
    if len(uses) != 1 or uses[0].owner.name != "tosa.transpose":
        return None
    return uses[0].owner.operation


def _hoist_pad(op: ir.Operation, user: ir.Operation) -> None:
    """Transpose the pad's input, then pad that: the transpose (a linalg op after tosa-to-linalg)
    then writes the padded buffer's interior in place (`convolutions.pads_in_place`), where the
    pad of a function argument was a copy."""
    with ir.InsertionPoint(user), user.location:
        padded = _pad(op, _transpose(op.operands[0], _perm(user)), _perm(user))
    user.results[0].replace_all_uses_with(padded)
    user.erase()
    op.erase()


def _pad(op: ir.Operation, value: ir.Value, dims: list[int]) -> ir.Value:
    """tosa.pad `op` applied to `value`, whose dimension i is dimension dims[i] of op's input."""
    amounts = _padding(op.operands[1])
    assert amounts is not None
    moved = [v for d in dims for v in amounts[2 * d:2 * d + 2]]
    t, element = ir.RankedTensorType(value.type), ir.RankedTensorType(op.results[0].type).element_type
    index = ir.IndexType.get()
    values = ir.DenseElementsAttr.get([ir.IntegerAttr.get(index, v) for v in moved],
                                      type=ir.RankedTensorType.get([len(moved)], index))
    shape = ir.Operation.create("tosa.const_shape", results=[op.operands[1].type],
                                attributes={"values": values}).results[0]
    padded = [n + moved[2 * i] + moved[2 * i + 1] for i, n in enumerate(t.shape)]
    return ir.Operation.create("tosa.pad", results=[ir.RankedTensorType.get(padded, element)],
                               operands=[value, shape, *list(op.operands)[2:]],
                               attributes={name: op.attributes[name] for name in op.attributes}).results[0]


def _inverse(perm: list[int]) -> list[int]:
    """The permutation that undoes `perm`."""
    return [perm.index(i) for i in range(len(perm))]


def _transpose(value: ir.Value, perm: list[int]) -> ir.Value:
    t = ir.RankedTensorType(value.type)
    shape = [t.shape[p] for p in perm]
    return ir.Operation.create("tosa.transpose", results=[ir.RankedTensorType.get(shape, t.element_type)],
                               operands=[value], attributes={"perms": ir.DenseI32ArrayAttr.get(perm)}).results[0]


def _sink(op: ir.Operation, perm: list[int]) -> None:
    """Compute `op` on the transposes' inputs (its small operands transposed back), then transpose
    its result by `perm`."""
    inverse = _inverse(perm)
    count = _OPERANDS.get(op.name, len(op.operands))
    with ir.InsertionPoint(op), op.location:
        operands = []
        for i, value in enumerate(op.operands):
            source = _transpose_of(value) if i < count else None
            if i >= count:
                operands.append(value)
            elif source is not None:
                operands.append(source.operands[0])
            else:
                operands.append(_transpose(value, inverse))
        result = ir.RankedTensorType(op.results[0].type)
        shape = [result.shape[p] for p in inverse]
        moved = ir.Operation.create(op.name, results=[ir.RankedTensorType.get(shape, result.element_type)],
                                    operands=operands,
                                    attributes={name: op.attributes[name] for name in op.attributes})
        back = _transpose(moved.results[0], perm)
    op.results[0].replace_all_uses_with(back)
    op.erase()


def _cancel(op: ir.Operation) -> None:
    """Replace transpose `op` of a transpose by the inner one's input if the two are inverse."""
    inner = _transpose_of(op.operands[0])
    if inner is None:
        return
    outer_perm, inner_perm = _perm(op), _perm(inner)
    if [inner_perm[p] for p in outer_perm] == list(range(len(outer_perm))):
        op.results[0].replace_all_uses_with(inner.operands[0])
