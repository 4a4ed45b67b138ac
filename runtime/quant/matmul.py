"""Quantized linear and conv2d: one call for a dequantize -> linear/conv2d [-> relu | hardtanh |
clamp] -> quantize group of a PT2E graph, on the integer values themselves (int8, or int16
activations with int8 weights: the group's `dtype`).

`torch.ops.torchtosa.qlinear` and `qconv2d` compute exactly what the group they replace computes
in PyTorch (dequantize the integer input and the int8 per-channel weight, the float op with the float bias,
the optional clamp to [min_val, max_val] (relu is min_val 0, relu6 0 and 6), quantize). Their
lowerings (opdefs/quantize_int.yaml) are integer TOSA. Weight scales,
weight zero points and the bias are lists of numbers (compile-time constants of a frozen
graph): the lowering's rules compute the int32 bias and the rescale multipliers from them.
"""

from __future__ import annotations

import torch

from .library import QD, dequantize, group_op, quantize

_QLINEAR = ("qlinear(Tensor input, float input_scale, int input_zero_point, Tensor weight, float[] weight_scales, "
            "int[] weight_zero_points, float[]? bias, float output_scale, int output_zero_point, int quant_min, "
            "int quant_max, float? min_val, float? max_val, ScalarType dtype) -> Tensor")
_QCONV2D = ("qconv2d(Tensor input, float input_scale, int input_zero_point, Tensor weight, float[] weight_scales, "
            "int[] weight_zero_points, float[]? bias, int[] stride, int[] padding, int[] dilation, int groups, "
            "float output_scale, int output_zero_point, int quant_min, int quant_max, float? min_val, "
            "float? max_val, ScalarType dtype) -> Tensor")


def _dequantized(input: torch.Tensor, input_scale: float, input_zero_point: int, weight: torch.Tensor,
                 weight_scales: list[float], weight_zero_points: list[int],
                 bias: list[float] | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    if not len(weight_scales) == len(weight_zero_points) == weight.shape[0]:
        raise ValueError(f"one weight scale and zero point per output channel ({weight.shape[0]}): got "
                         f"{len(weight_scales)} and {len(weight_zero_points)}")
    x = dequantize(input, input_scale, input_zero_point)
    scales = torch.tensor(weight_scales, dtype=torch.float32, device=weight.device)
    zps = torch.tensor(weight_zero_points, dtype=torch.int64, device=weight.device)
    w = QD.dequantize_per_channel.default(weight, scales, zps, 0, -128, 127, torch.int8)
    b = None if bias is None else torch.tensor(bias, dtype=torch.float32, device=weight.device)
    return x, w, b


def _quantized(y: torch.Tensor, min_val: float | None, max_val: float | None, output_scale: float,
               output_zero_point: int, quant_min: int, quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    if min_val is not None or max_val is not None:  # relu, hardtanh and clamp compute this
        y = torch.clamp(y, min_val, max_val)
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(_QLINEAR)
def qlinear(input: torch.Tensor, input_scale: float, input_zero_point: int, weight: torch.Tensor,
            weight_scales: list[float], weight_zero_points: list[int], bias: list[float] | None,
            output_scale: float, output_zero_point: int, quant_min: int, quant_max: int,
            min_val: float | None, max_val: float | None, dtype: torch.dtype) -> torch.Tensor:
    x, w, b = _dequantized(input, input_scale, input_zero_point, weight, weight_scales, weight_zero_points, bias)
    if b is not None and x.dim() == 2:
        y = torch.ops.aten.addmm.default(b, x, w.t())  # as the captured graph computes it
    else:
        y = torch.nn.functional.linear(x, w, b)
    return _quantized(y, min_val, max_val, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(_QCONV2D)
def qconv2d(input: torch.Tensor, input_scale: float, input_zero_point: int, weight: torch.Tensor,
            weight_scales: list[float], weight_zero_points: list[int], bias: list[float] | None,
            stride: list[int], padding: list[int], dilation: list[int], groups: int,
            output_scale: float, output_zero_point: int, quant_min: int, quant_max: int,
            min_val: float | None, max_val: float | None, dtype: torch.dtype) -> torch.Tensor:
    x, w, b = _dequantized(input, input_scale, input_zero_point, weight, weight_scales, weight_zero_points, bias)
    y = torch.ops.aten.convolution.default(x, w, b, stride, padding, dilation, False, [0, 0], groups)
    return _quantized(y, min_val, max_val, output_scale, output_zero_point, quant_min, quant_max, dtype)
