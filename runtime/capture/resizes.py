"""Interpolations captured as one op where TOSA's RESIZE reproduces them.

PyTorch decomposes `F.interpolate`'s nearest and bilinear 2-D modes (`upsample_*2d.vec`) into
index arithmetic at the autograd key (torch._decomp's Python kernels), before AOTAutograd's
decomposition table is consulted. The captured graph then gathers with computed integer
indices: TOSA's FP profile cannot express that (the indices' tiles and reshapes need PRO-INT),
so segmentation models (FCN, DeepLabV3, LRASPP) were not TOSA-1.0+FP conformant, and native code
ran gathers where one resize does.

Under `kept()` (capture and the torch.compile backend trace under it) the two `.vec` overloads
call their `.default` overloads instead, which opdefs/resize_pad.yaml lowers to one tosa.resize,
where `resizable` says the importer's entry takes them: static sizes, a float type the entry
supports, both axes reproducible (`upsample_axis`), no gradient needed (their backward ops have
no entry). Elsewhere they decompose as before. `keep_nearest` is the decomposition table's entry
for `upsample_nearest2d.default` (core ATen decomposes it): kept where resizable.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._C import DispatchKey
from torch._decomp import core_aten_decompositions
from torch._decomp.decompositions import upsample_compute_output_size
from torch.utils._python_dispatch import _disable_current_modes

from ..importer.rules import upsample_axis

aten = torch.ops.aten
_KEYS = (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd)
_TYPES = (torch.float32, torch.float16, torch.bfloat16)  # what both entries interpolate


def resizable(input: torch.Tensor, size: list[Any], scales: list[float | None], align_corners: bool,
              nearest: bool) -> bool:
    """Whether opdefs' `upsample_*2d.default` entry lowers this interpolation to one tosa.resize."""
    sizes = [*input.shape, *size]
    if input.dim() != 4 or input.dtype not in _TYPES or not all(type(s) is int for s in sizes):
        return False
    if (torch.is_grad_enabled() and input.requires_grad) or min(sizes) < 1:  # min: no empty tensor
        return False
    return all(_axis(i, o, s, align_corners, nearest) for i, o, s in zip(input.shape[2:], size, scales, strict=True))


@functools.lru_cache(maxsize=256)
def _axis(in_size: int, out_size: int, scale: float | None, align_corners: bool, nearest: bool) -> bool:
    """Whether `upsample_axis` reproduces this axis. It computes torch's float32 coordinates with
    tensors: out of the tracer's sight (its modes off), or they would join the captured graph."""
    with _disable_current_modes():
        return bool(upsample_axis(in_size, out_size, scale, align_corners, nearest))


def _to_default(default: torch._ops.OpOverload, nearest: bool) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A `.vec` overload's kernel calling `default` (its `.default` overload) where `resizable`,
    else `original` (PyTorch's decomposition). The `.vec` arguments: input, output_size, then
    align_corners for bilinear, and scale_factors."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        def kernel(input: torch.Tensor, output_size: list[Any] | None, *rest: Any) -> Any:
            *corners, scale_factors = rest
            size = upsample_compute_output_size(input.size(), output_size, scale_factors)
            scales = list(scale_factors) if scale_factors else [None, None]
            if len(size) == 2 and resizable(input, size, scales, bool(corners and corners[0]), nearest):
                with torch._C._AutoDispatchBelowAutograd():  # past .default's own decomposition too
                    return default(input, size, *corners, *scales)
            return original(input, output_size, *rest)

        return kernel

    return wrap


_KERNELS = {aten.upsample_nearest2d.vec: _to_default(aten.upsample_nearest2d.default, True),
            aten.upsample_bilinear2d.vec: _to_default(aten.upsample_bilinear2d.default, False)}
# Python kernels set aside while kept: below autograd (where the kernels above call the .default
# overloads) nearest's composite kernel would decompose it before the tracer sees it
_SET_ASIDE = ((aten.upsample_nearest2d.default, DispatchKey.CompositeImplicitAutograd),)


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """Trace `upsample_*2d.vec` as their `.default` overloads where `resizable` (see the module
    docstring); PyTorch's own kernels are back on exit."""
    saved = {(op, key): op.py_kernels[key] for op in _KERNELS for key in _KEYS}
    aside = {(op, key): op.py_kernels.pop(key) for op, key in _SET_ASIDE if key in op.py_kernels}
    for (op, key), original in saved.items():
        op.py_kernels[key] = _KERNELS[op](original)
    for op in {op for op, _ in (*saved, *aside)}:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for (op, key), original in (*saved.items(), *aside.items()):
            op.py_kernels[key] = original
            op._dispatch_cache.clear()


_NEAREST = core_aten_decompositions()[aten.upsample_nearest2d.default]


def keep_nearest(input: torch.Tensor, output_size: list[Any], scales_h: float | None = None,
                 scales_w: float | None = None) -> Any:
    """The decomposition table's `upsample_nearest2d.default`: left as it is where `resizable`
    (NotImplemented: the tracer records the op), else core ATen's decomposition."""
    if resizable(input, list(output_size), [scales_h, scales_w], False, True):
        return NotImplemented
    return _NEAREST(input, output_size, scales_h, scales_w)
