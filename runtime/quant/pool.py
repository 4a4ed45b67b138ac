"""Quantized pooling and shape ops: one call for a dequantize -> op -> quantize group of a PT2E
graph whose op moves, picks or averages values without weights (max_pool2d, avg_pool2d, mean
over H and W, view, permute, squeeze, unsqueeze, slice, select, constant_pad_nd).

Each op computes what its group computes in PyTorch: dequantize the integer input (per tensor),
the float op, quantize (per tensor). Their lowerings (opdefs/quantize_pool.yaml) run the op on
the int8 or int16 values themselves (tosa.max_pool2d, tosa.avg_pool2d with zero points, reshape,
transpose, slice, pad) and RESCALE only where the input and output quantizations differ.
"""

from __future__ import annotations

import torch

from .library import dequantize, group_op, quantize

_IN = "Tensor input, float input_scale, int input_zero_point"
_OUT = "float output_scale, int output_zero_point, int quant_min, int quant_max, ScalarType dtype"
A = torch.ops.aten


@group_op(f"qmax_pool2d({_IN}, int[] kernel_size, int[] stride, int[] padding, int[] dilation, bool ceil_mode, "
          f"float? min_val, float? max_val, {_OUT}) -> Tensor")
def qmax_pool2d(input: torch.Tensor, input_scale: float, input_zero_point: int, kernel_size: list[int],
                stride: list[int], padding: list[int], dilation: list[int], ceil_mode: bool, min_val: float | None,
                max_val: float | None, output_scale: float, output_zero_point: int, quant_min: int,
                quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    """max_pool2d of the dequantized input, after relu/hardtanh/clamp to [min_val, max_val] if given."""
    x = dequantize(input, input_scale, input_zero_point)
    if min_val is not None or max_val is not None:
        x = torch.clamp(x, min_val, max_val)
    y = A.max_pool2d_with_indices.default(x, kernel_size, stride, padding, dilation, ceil_mode)[0]
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(f"qavg_pool2d({_IN}, int[] kernel_size, int[] stride, int[] padding, bool ceil_mode, "
          f"bool count_include_pad, int? divisor_override, {_OUT}) -> Tensor")
def qavg_pool2d(input: torch.Tensor, input_scale: float, input_zero_point: int, kernel_size: list[int],
                stride: list[int], padding: list[int], ceil_mode: bool, count_include_pad: bool,
                divisor_override: int | None, output_scale: float, output_zero_point: int, quant_min: int,
                quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    x = dequantize(input, input_scale, input_zero_point)
    y = A.avg_pool2d.default(x, kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(f"qmean({_IN}, int[]? dim, bool keepdim, {_OUT}) -> Tensor")
def qmean(input: torch.Tensor, input_scale: float, input_zero_point: int, dim: list[int] | None, keepdim: bool,
          output_scale: float, output_zero_point: int, quant_min: int, quant_max: int,
          dtype: torch.dtype) -> torch.Tensor:
    y = A.mean.dim(dequantize(input, input_scale, input_zero_point), dim, keepdim)
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(f"qview({_IN}, int[] size, {_OUT}) -> Tensor")
def qview(input: torch.Tensor, input_scale: float, input_zero_point: int, size: list[int], output_scale: float,
          output_zero_point: int, quant_min: int, quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    y = dequantize(input, input_scale, input_zero_point).reshape(size)
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(f"qpermute({_IN}, int[] dims, {_OUT}) -> Tensor")
def qpermute(input: torch.Tensor, input_scale: float, input_zero_point: int, dims: list[int], output_scale: float,
             output_zero_point: int, quant_min: int, quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    y = dequantize(input, input_scale, input_zero_point).permute(dims).contiguous()
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(f"qsqueeze({_IN}, int[] dim, {_OUT}) -> Tensor")
def qsqueeze(input: torch.Tensor, input_scale: float, input_zero_point: int, dim: list[int], output_scale: float,
             output_zero_point: int, quant_min: int, quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    y = A.squeeze.dims(dequantize(input, input_scale, input_zero_point), dim).contiguous()
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(f"qunsqueeze({_IN}, int dim, {_OUT}) -> Tensor")
def qunsqueeze(input: torch.Tensor, input_scale: float, input_zero_point: int, dim: int, output_scale: float,
               output_zero_point: int, quant_min: int, quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    y = A.unsqueeze.default(dequantize(input, input_scale, input_zero_point), dim).contiguous()
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(f"qslice({_IN}, int dim, int? start, int? end, int step, {_OUT}) -> Tensor")
def qslice(input: torch.Tensor, input_scale: float, input_zero_point: int, dim: int, start: int | None,
           end: int | None, step: int, output_scale: float, output_zero_point: int, quant_min: int,
           quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    y = A.slice.Tensor(dequantize(input, input_scale, input_zero_point), dim, start, end, step).contiguous()
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(f"qselect({_IN}, int dim, int index, {_OUT}) -> Tensor")
def qselect(input: torch.Tensor, input_scale: float, input_zero_point: int, dim: int, index: int,
            output_scale: float, output_zero_point: int, quant_min: int, quant_max: int,
            dtype: torch.dtype) -> torch.Tensor:
    y = A.select.int(dequantize(input, input_scale, input_zero_point), dim, index).contiguous()
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)


@group_op(f"qpad({_IN}, int[] pad, float value, {_OUT}) -> Tensor")
def qpad(input: torch.Tensor, input_scale: float, input_zero_point: int, pad: list[int], value: float,
         output_scale: float, output_zero_point: int, quant_min: int, quant_max: int,
         dtype: torch.dtype) -> torch.Tensor:
    y = A.constant_pad_nd.default(dequantize(input, input_scale, input_zero_point), pad, value)
    return quantize(y, output_scale, output_zero_point, quant_min, quant_max, dtype)
