"""The `torchtosa` operator namespace: one op per quantized node group, defined from a schema
and PyTorch's own float computation of the group.

`@group_op(schema)` registers a function as `torch.ops.torchtosa.<name>` with one composite
kernel (so eager runs, constant folding and FakeTensor shapes are the group's own). Each op
has a YAML entry (opdefs/quantize_*.yaml) whose `match` declares the groups it replaces and
whose emit lines are its integer TOSA. The helpers below are the group's float computation:
dequantize the integer operands, quantize the float result (to the group's `dtype`: int8, or
int16 where the lowering has an int16 form). This module imports only torch (the generator
loads the package to check the entries' schemas).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.ao.quantization.fx._decomposed  # registers torch.ops.quantized_decomposed

QD = torch.ops.quantized_decomposed

_LIB = torch.library.Library("torchtosa", "FRAGMENT")
_DEFINED: set[str] = set()


def group_op(schema: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as `torch.ops.torchtosa.<name>` with `schema`."""

    def register(fn: Callable) -> Callable:
        name = schema.split("(")[0]
        if name in _DEFINED or f"torchtosa::{name}" in torch._C._dispatch_get_all_op_names():
            return fn  # loaded twice (the generator and the package in one process)
        _LIB.define(schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"torchtosa::{name}", fn, lib=_LIB)
        _DEFINED.add(name)
        return fn

    return register


def dequantize(input: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """An int8 or int16 activation's float values, as PT2E's dequantize_per_tensor computes them."""
    info = torch.iinfo(input.dtype)
    return QD.dequantize_per_tensor.default(input, scale, zero_point, info.min, info.max, input.dtype)


def quantize(y: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int,
             dtype: torch.dtype = torch.int8) -> torch.Tensor:
    """A float result as int8 (or `dtype`), as PT2E's quantize_per_tensor computes it."""
    return QD.quantize_per_tensor.default(y, scale, zero_point, quant_min, quant_max, dtype)
