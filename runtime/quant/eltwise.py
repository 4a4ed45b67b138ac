"""Quantized elementwise ops: one call for a dequantize -> add/sub/mul/clamp/cat -> quantize
group of a PT2E graph (per-tensor int8 or int16 activations), on the integer values themselves.

Each op computes exactly what the group it replaces computes in PyTorch: dequantize the integer
operands, the float op, quantize the float result. Their lowerings (opdefs/quantize_eltwise.yaml)
are integer TOSA: RESCALEs to a common i32 scale, i32 add/sub/mul, a RESCALE to the group's
dtype, clamps at the quantized bounds, concat.
"""

from __future__ import annotations

import torch

from .library import dequantize, group_op, quantize

_BINARY = ("(Tensor input, float input_scale, int input_zero_point, Tensor other, float other_scale, "
           "int other_zero_point, float output_scale, int output_zero_point, int quant_min, int quant_max, "
           "bool relu, ScalarType dtype) -> Tensor")
_QCLAMP = ("qclamp(Tensor input, float input_scale, int input_zero_point, float? lower, float? upper, "
           "float output_scale, int output_zero_point, int quant_min, int quant_max, ScalarType dtype) -> Tensor")
_QCAT = ("qcat(Tensor[] tensors, float[] scales, int[] zero_points, int dim, float output_scale, "
         "int output_zero_point, int quant_min, int quant_max, ScalarType dtype) -> Tensor")


def _binary(op: str, input: torch.Tensor, input_scale: float, input_zero_point: int, other: torch.Tensor,
            other_scale: float, other_zero_point: int, output_scale: float, output_zero_point: int,
            quant_min: int, quant_max: int, relu: bool, dtype: torch.dtype) -> torch.Tensor:
    a, b = dequantize(input, input_scale, input_zero_point), dequantize(other, other_scale, other_zero_point)
    y = getattr(torch.ops.aten, op).Tensor(a, b)
    y = y.relu() if relu else y
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op("qadd" + _BINARY)
def qadd(input: torch.Tensor, input_scale: float, input_zero_point: int, other: torch.Tensor, other_scale: float,
         other_zero_point: int, output_scale: float, output_zero_point: int, quant_min: int, quant_max: int,
         relu: bool, dtype: torch.dtype) -> torch.Tensor:
    return _binary("add", input, input_scale, input_zero_point, other, other_scale, other_zero_point,
                   output_scale, output_zero_point, quant_min, quant_max, relu, dtype)


@group_op("qsub" + _BINARY)
def qsub(input: torch.Tensor, input_scale: float, input_zero_point: int, other: torch.Tensor, other_scale: float,
         other_zero_point: int, output_scale: float, output_zero_point: int, quant_min: int, quant_max: int,
         relu: bool, dtype: torch.dtype) -> torch.Tensor:
    return _binary("sub", input, input_scale, input_zero_point, other, other_scale, other_zero_point,
                   output_scale, output_zero_point, quant_min, quant_max, relu, dtype)


@group_op("qmul" + _BINARY)
def qmul(input: torch.Tensor, input_scale: float, input_zero_point: int, other: torch.Tensor, other_scale: float,
         other_zero_point: int, output_scale: float, output_zero_point: int, quant_min: int, quant_max: int,
         relu: bool, dtype: torch.dtype) -> torch.Tensor:
    return _binary("mul", input, input_scale, input_zero_point, other, other_scale, other_zero_point,
                   output_scale, output_zero_point, quant_min, quant_max, relu, dtype)


@group_op(_QCLAMP)
def qclamp(input: torch.Tensor, input_scale: float, input_zero_point: int, lower: float | None,
           upper: float | None, output_scale: float, output_zero_point: int, quant_min: int,
           quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    """relu (lower 0), hardtanh/relu6 and clamp: the float clamp between dequantize and quantize."""
    x = dequantize(input, input_scale, input_zero_point)
    y = torch.ops.aten.clamp.default(x, lower, upper)
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(_QCAT)
def qcat(tensors: list[torch.Tensor], scales: list[float], zero_points: list[int], dim: int,
         output_scale: float, output_zero_point: int, quant_min: int, quant_max: int,
         dtype: torch.dtype) -> torch.Tensor:
    if not len(tensors) == len(scales) == len(zero_points):
        raise ValueError(f"qcat: one scale and zero point per tensor ({len(tensors)}): got {len(scales)} and "
                         f"{len(zero_points)}")
    xs = [dequantize(t, s, z) for t, s, z in zip(tensors, scales, zero_points, strict=True)]
    return quantize(torch.cat(xs, dim), output_scale, output_zero_point, quant_min, quant_max, dtype)
