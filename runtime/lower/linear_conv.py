"""Linear layers as 1x1 convolutions, for NPU compilers (`to_tosa(..., npu=True)`, `torchtosa.vela`).

An integer linear layer is a `tosa.matmul` of the activation `[1, N, K]` and the constant weight
`[1, K, O]`, plus the i32 bias (`tosa.add` of a `[1, 1, O]` constant). Arm's Vela runs a matmul
as a product of two feature maps: the weight is not encoded or streamed, each matmul gets a
transpose, and the bias add and the RESCALE stay separate ops. As a `tosa.conv2d` of the
activation reshaped to NHWC `[1, N, 1, K]` with the weight as OHWI `[O, 1, 1, K]` and the bias as
the conv's, Vela encodes the weights and fuses bias, RESCALE and clamp into the convolution
(docs/vela.md). The sum is the same: sum_k (x[n, k] - zp_x) * (w[k, o] - zp_w) + bias[o] in i32,
exact in any order, so only integer matmuls are rewritten (a float sum would round differently).
A classifier's first linear layer reading a CNN's NHWC features flattened in NCHW order (a
transpose, then a reshape to one row) reads the NHWC features instead, the weight's columns
moved: LeNet's last transpose goes.
"""

from __future__ import annotations

import math

import numpy as np
from mlir import ir

from . import irutil
from .layout import _foldable, _moved, _perm, _shape, reshape, rewrite_each

INTEGER = ("i8",)  # element types of the matmuls rewritten (i32 accumulators: exact)


def linears_as_convolutions(module: ir.Module) -> int:
    """Rewrite every integer matmul of a constant weight (and its constant bias add) in
    `module`'s functions as a 1x1 tosa.conv2d; the number rewritten."""
    # folded first: the weight's transpose and reshape into one constant
    return rewrite_each(module, ("tosa.matmul",), _as_convolution, fold_first=True)


def _constant(value: ir.Value) -> ir.Operation | None:
    producer = irutil.producer(value)
    return producer if producer is not None and producer.name == "tosa.const" and _foldable(producer) else None


def _flattened_transpose(value: ir.Value) -> tuple[ir.Value, np.ndarray] | None:
    """For a row `[1, 1, K]` that is a transpose of `y`, flattened (a CNN's NHWC features
    flattened in NCHW order before its classifier): `y` and, for each element of the row, its
    index in `y` flattened; the convolution then reads `y` and the weight's columns move."""
    producer = irutil.producer(value)
    if producer is None or producer.name != "tosa.reshape":
        return None
    inner = irutil.producer(producer.operands[0])
    if inner is None or inner.name != "tosa.transpose" or _shape(inner.operands[0]) is None:
        return None
    y = inner.operands[0]
    order = np.arange(math.prod(_shape(y))).reshape(_shape(y)).transpose(_perm(inner)).reshape(-1)
    return y, order


def _as_convolution(matmul: ir.Operation) -> bool:
    a, b = matmul.operands[0], matmul.operands[1]
    a_shape, b_shape, out = _shape(a), _shape(b), matmul.results[0]
    weight = _constant(b)
    if a_shape is None or b_shape is None or weight is None or a_shape[0] != 1 or \
            str(ir.RankedTensorType(a.type).element_type) not in INTEGER:
        return False
    _, n, k = a_shape
    o = b_shape[2]
    i32 = ir.IntegerType.get_signless(32)
    uses = list(out.uses)
    bias, add = None, None
    if len(uses) == 1 and uses[0].owner.name == "tosa.add":
        add = irutil.user(uses[0])
        other = _constant(add.operands[1 - uses[0].operand_number])
        if other is not None and _shape(add.results[0]) == [1, n, o] and _shape(other.results[0]) == [1, 1, o]:
            bias = _moved(other.attributes["values"], ir.RankedTensorType.get([o], i32), None)
        else:
            add = None
    if bias is None:
        bias = ir.DenseElementsAttr.get_splat(ir.RankedTensorType.get([o], i32), ir.IntegerAttr.get(i32, 0))
    kernel = ir.RankedTensorType.get([o, 1, 1, k], ir.RankedTensorType(b.type).element_type)
    transposed = _moved(weight.attributes["values"], ir.RankedTensorType.get([1, o, k], kernel.element_type), (0, 2, 1))
    ohwi = _moved(transposed, kernel, None)
    flattened = _flattened_transpose(a) if n == 1 else None
    if flattened is not None and ohwi is not None:  # read the transpose's input, the weight's columns moved
        a, order = flattened
        columns = np.array(ohwi, copy=False).reshape(o, k)
        moved = np.empty_like(columns)
        moved[:, order] = columns
        ohwi = ir.DenseElementsAttr.get(moved.reshape(o, 1, 1, k), type=kernel.element_type)
    replaced = add if add is not None else matmul
    with ir.InsertionPoint(replaced), matmul.location:
        w = ir.Operation.create("tosa.const", results=[kernel], attributes={"values": ohwi})
        c = ir.Operation.create("tosa.const", results=[ir.RankedTensorType.get([o], i32)], attributes={"values": bias})
        conv = ir.Operation.create(
            "tosa.conv2d", results=[ir.RankedTensorType.get([1, n, 1, o], i32)],
            operands=[reshape(a, [1, n, 1, k]), w.results[0], c.results[0], matmul.operands[2], matmul.operands[3]],
            attributes={"pad": ir.DenseI64ArrayAttr.get([0, 0, 0, 0]), "stride": ir.DenseI64ArrayAttr.get([1, 1]),
                        "dilation": ir.DenseI64ArrayAttr.get([1, 1]), "acc_type": ir.TypeAttr.get(i32)})
        replaced.results[0].replace_all_uses_with(reshape(conv.results[0], [1, n, o]))
    if add is not None:
        add.erase()
    matmul.erase()
    return True
