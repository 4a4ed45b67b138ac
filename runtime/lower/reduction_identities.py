"""A float maximum starts from -inf, a minimum from +inf.

tosa-to-linalg fills the output of a float `reduce_max` with the lowest finite value of its type
(and of `reduce_min` with the highest), not -inf: the maximum of a row of -inf was -3.4e38 where
PyTorch (and TOSA's reference model) give -inf, as an `amax` over a fully masked row. The
identity of the IEEE maximum is -inf: max(-inf, x) is x for every x, NaN included.
`infinite_identities(module)` replaces such a fill's value where every op it initializes
combines with that maximum (minimum).
"""

from __future__ import annotations

import math

import torch
from mlir import ir
from mlir.dialects import arith

from .irutil import find_ops, producer

_DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32, "f64": torch.float64}
_COMBINERS = {"arith.maximumf": -1.0, "arith.minimumf": 1.0}  # the sign of its identity's infinity


def infinite_identities(module: ir.Module) -> None:
    """Fill with -inf (+inf) what a maximum (minimum) starts from where that is the lowest
    (highest) finite value of its type (see the module docstring)."""
    with module.context, ir.Location.unknown():
        for fill in find_ops(module, lambda op: op.name == "linalg.fill"):
            value = fill.operands[0]
            constant = producer(value)
            if constant is None or constant.name != "arith.constant" or not isinstance(value.type, ir.FloatType):
                continue
            dtype = _DTYPES.get(str(value.type))
            extreme = ir.FloatAttr(constant.attributes["value"]).value
            if dtype is None or abs(extreme) != torch.finfo(dtype).max:
                continue
            sign = math.copysign(1.0, extreme)
            if all(_combiner(use.owner.operation, fill.results[0]) == sign for use in fill.results[0].uses):
                with ir.InsertionPoint(fill):
                    fill.operands[0] = arith.ConstantOp(value.type, sign * math.inf).result


def _combiner(op: ir.Operation, init: ir.Value) -> float | None:
    """The sign of the infinity that is the identity of what linalg op `op` combines its output
    `init` with (the body's yield is a maximum or minimum of its output's block argument), or None."""
    if not op.name.startswith("linalg.") or not op.regions or init not in list(op.operands)[-len(op.results):]:
        return None
    block = op.regions[0].blocks[0]
    out = block.arguments[len(block.arguments) - 1]
    body = list(block.operations)
    if len(body) < 2 or body[-1].name != "linalg.yield" or len(body[-1].operands) != 1:
        return None
    last = body[-2]
    if body[-1].operands[0] != last.results[0] or last.name not in _COMBINERS or out not in list(last.operands):
        return None
    return _COMBINERS[last.name]
