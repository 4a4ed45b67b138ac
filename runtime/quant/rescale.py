"""Quantized groups that are one RESCALE of the integer values: dropout's clone between a
dequantize and a quantize (an identity), a multiplication by a float constant (a ViT's
attention score scaling under the TosaQuantizer), and a dequantize read straight by a quantize
of other parameters or dtype (where int16 and int8 annotations meet).

Each op computes what its group computes in PyTorch: dequantize the integer input (per tensor),
the float op, quantize (per tensor). Their lowerings (opdefs/quantize_rescale.yaml) keep the integer
values and RESCALE only by the ratio of the scales (times the constant).
"""

from __future__ import annotations

import torch

from .library import dequantize, group_op, quantize

_IN = "Tensor input, float input_scale, int input_zero_point"
_OUT = "float output_scale, int output_zero_point, int quant_min, int quant_max, ScalarType dtype"


@group_op(f"qclone({_IN}, {_OUT}) -> Tensor")
def qclone(input: torch.Tensor, input_scale: float, input_zero_point: int, output_scale: float,
           output_zero_point: int, quant_min: int, quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized input requantized (clone, dropout in eval mode)."""
    y = dequantize(input, input_scale, input_zero_point).clone()
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(f"qmul_scalar({_IN}, float other, {_OUT}) -> Tensor")
def qmul_scalar(input: torch.Tensor, input_scale: float, input_zero_point: int, other: float, output_scale: float,
                output_zero_point: int, quant_min: int, quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized input times the float constant `other`, quantized."""
    y = dequantize(input, input_scale, input_zero_point) * other
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(f"qrequantize({_IN}, {_OUT}) -> Tensor")
def qrequantize(input: torch.Tensor, input_scale: float, input_zero_point: int, output_scale: float,
                output_zero_point: int, quant_min: int, quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    """The dequantized input quantized again, with other parameters or to another dtype."""
    y = dequantize(input, input_scale, input_zero_point)
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)
