"""Quantized transformer ops: unary activations as one int8 TABLE, and the matmul of two int8
activations (attention's q @ k^T and p @ v).

`torch.ops.torchtosa.qunary(input, ..., function, alpha, ...)` is dequantize -> f -> quantize for
an elementwise f named by a string (`UNARY`): an int8 input takes only 256 values, so the whole
group is a 256-entry table, which the lowering (opdefs/quantize_table.yaml) computes at compile
time by running this same function on every int8 value (`unary_table`), so it gives PyTorch's
bits. `torch.ops.torchtosa.qsoftmax` is dequantize -> softmax -> quantize, lowered as integer
arithmetic (exponentials of x - max(x) from two int8 tables, an i32 sum and its reciprocal by
Newton's iteration in fixed point), and `torchtosa.qlayernorm` (layer norm over the last dim) as
integer arithmetic too (i32 sums of the centred values and their squares, the reciprocal square
root by Newton's iteration, a per-channel RESCALE that applies the weight and bias).
`torch.ops.torchtosa.qmatmul` is dequantize(a), dequantize(b) -> (permutes: attention's heads and
k^T) -> matmul -> quantize: an int8 tosa.matmul with both zero points, i32 accumulation, a RESCALE
by a_scale * b_scale / output_scale.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .library import dequantize, group_op, quantize

# The functions of qunary: each takes the float input and the op's `alpha` (elu's alpha,
# leaky_relu's negative slope; unused by the others), as the aten op of the model computes it.
UNARY: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "sigmoid": lambda x, a: torch.sigmoid(x),
    "tanh": lambda x, a: torch.tanh(x),
    "exp": lambda x, a: torch.exp(x),
    "erf": lambda x, a: torch.erf(x),
    "gelu": lambda x, a: F.gelu(x),
    "gelu_tanh": lambda x, a: F.gelu(x, approximate="tanh"),
    "silu": lambda x, a: F.silu(x),
    "hardswish": lambda x, a: F.hardswish(x),
    "hardsigmoid": lambda x, a: F.hardsigmoid(x),
    "elu": lambda x, a: F.elu(x, a),
    "leaky_relu": lambda x, a: F.leaky_relu(x, a),
}

_QUNARY = ("qunary(Tensor input, float input_scale, int input_zero_point, str function, float alpha, "
           "float output_scale, int output_zero_point, int quant_min, int quant_max) -> Tensor")
_QSOFTMAX = ("qsoftmax(Tensor input, float input_scale, int input_zero_point, int dim, float output_scale, "
             "int output_zero_point, int quant_min, int quant_max) -> Tensor")
_QLAYERNORM = ("qlayernorm(Tensor input, float input_scale, int input_zero_point, int[] normalized_shape, "
               "float[]? weight, float[]? bias, float eps, float output_scale, int output_zero_point, int quant_min, "
               "int quant_max) -> Tensor")
_QMATMUL = ("qmatmul(Tensor a, float a_scale, int a_zero_point, Tensor b, float b_scale, int b_zero_point, "
            "float output_scale, int output_zero_point, int quant_min, int quant_max, int[] a_perm, "
            "int[] b_perm, ScalarType dtype) -> Tensor")


@group_op(_QUNARY)
def qunary(input: torch.Tensor, input_scale: float, input_zero_point: int, function: str, alpha: float,
           output_scale: float, output_zero_point: int, quant_min: int, quant_max: int) -> torch.Tensor:
    if function not in UNARY:
        raise ValueError(f"qunary: unknown function {function!r}; known: {', '.join(UNARY)}")
    y = UNARY[function](dequantize(input, input_scale, input_zero_point), alpha)
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max)


def unary_table(function: str, alpha: float, input_scale: float, input_zero_point: int, output_scale: float,
                output_zero_point: int, quant_min: int, quant_max: int) -> list[int] | None:
    """qunary's 256 results for the int8 inputs -128..127, in that order (TABLE's entries); None
    if the function is unknown or gives NaN for one of them (quantizing NaN has no defined int8)."""
    if function not in UNARY:
        return None
    q = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    y = UNARY[function](dequantize(q, input_scale, input_zero_point), alpha)
    if bool(torch.isnan(y).any()):
        return None
    return [int(v) for v in quantize(y, output_scale, output_zero_point, quant_min, quant_max).tolist()]


@group_op(_QMATMUL)
def qmatmul(a: torch.Tensor, a_scale: float, a_zero_point: int, b: torch.Tensor, b_scale: float,
            b_zero_point: int, output_scale: float, output_zero_point: int, quant_min: int,
            quant_max: int, a_perm: list[int], b_perm: list[int], dtype: torch.dtype) -> torch.Tensor:
    af, bf = dequantize(a, a_scale, a_zero_point), dequantize(b, b_scale, b_zero_point)
    y = torch.matmul(af.permute(a_perm) if a_perm else af, bf.permute(b_perm) if b_perm else bf)
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(_QSOFTMAX)
def qsoftmax(input: torch.Tensor, input_scale: float, input_zero_point: int, dim: int, output_scale: float,
             output_zero_point: int, quant_min: int, quant_max: int) -> torch.Tensor:
    y = torch.ops.aten._softmax.default(dequantize(input, input_scale, input_zero_point), dim, False)
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max)


@group_op(_QLAYERNORM)
def qlayernorm(input: torch.Tensor, input_scale: float, input_zero_point: int, normalized_shape: list[int],
               weight: list[float] | None, bias: list[float] | None, eps: float, output_scale: float,
               output_zero_point: int, quant_min: int, quant_max: int) -> torch.Tensor:
    w = None if weight is None else torch.tensor(weight, dtype=torch.float32, device=input.device)
    b = None if bias is None else torch.tensor(bias, dtype=torch.float32, device=input.device)
    x = dequantize(input, input_scale, input_zero_point)
    y = torch.ops.aten.native_layer_norm.default(x, normalized_shape, w, b, eps)[0]
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max)
