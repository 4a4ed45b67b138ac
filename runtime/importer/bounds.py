"""Integer value ranges of emitted TOSA values: when an int64 value may live in i32.

TOSA 1.0 has no int64. Under such a target torch's int64 values (indices, positions,
counts) are held in i32, which is exact only if every value fits. `of(value)` bounds the
values of an integer SSA value from the IR that makes it: constants by their data, function
arguments by their type (an int64 input must fit int32 when it is passed), and each op by a
transfer rule over its operands' bounds, in unbounded Python integers. A value that no rule
bounds is None: the builder then refuses to narrow it.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from mlir import ir

Bounds = tuple[int, int]
INT32: Bounds = (-(2**31), 2**31 - 1)


def fits(b: Bounds | None, within: Bounds = INT32) -> bool:
    return b is not None and within[0] <= b[0] and b[1] <= within[1]


def of(value: ir.Value, memo: dict[ir.Value, Bounds | None]) -> Bounds | None:
    """The least and greatest value `value` may hold, or None if unknown or not integer."""
    if value in memo:
        return memo[value]
    elem = getattr(value.type, "element_type", None)
    if not isinstance(elem, ir.IntegerType):
        return None
    owner = value.owner
    if isinstance(owner, ir.Block):
        result = _type_range(elem)
    else:
        op = owner.operation
        rule = _RULES.get(op.name)
        result = rule(op, memo) if rule else None
    memo[value] = result
    return result


def _type_range(elem: ir.IntegerType) -> Bounds:
    if elem.width == 1:
        return (0, 1)
    return (-(2 ** (elem.width - 1)), 2 ** (elem.width - 1) - 1)


def _tensors(op: ir.Operation, memo: dict, *positions: int) -> list[Bounds | None]:
    operands = list(op.operands)
    picked = [operands[i] for i in positions if i < len(operands)] if positions else operands
    return [of(v, memo) for v in picked if isinstance(v.type, ir.RankedTensorType)]


def _hull(bs: list[Bounds | None]) -> Bounds | None:
    if not bs or any(b is None for b in bs):
        return None
    return min(b[0] for b in bs), max(b[1] for b in bs)


def _same(*positions: int) -> Callable[[ir.Operation, dict], Bounds | None]:
    """Ops that only move or pick values of these operands."""
    return lambda op, memo: _hull(_tensors(op, memo, *positions))


def _const(op: ir.Operation, memo: dict) -> Bounds | None:
    attr = ir.DenseIntElementsAttr(op.attributes["values"])
    if attr.is_splat:
        v = ir.IntegerAttr(attr.get_splat_value()).value
        return v, v
    data = np.array(attr)
    return int(data.min()), int(data.max())


def _binary(f: Callable[[int, int], int]) -> Callable[[ir.Operation, dict], Bounds | None]:
    def rule(op: ir.Operation, memo: dict) -> Bounds | None:
        a, b = _tensors(op, memo, 0, 1)
        if a is None or b is None:
            return None
        corners = [f(x, y) for x in a for y in b]
        return min(corners), max(corners)
    return rule


def _negate(op: ir.Operation, memo: dict) -> Bounds | None:
    (a,) = _tensors(op, memo, 0)
    return None if a is None else (-a[1], -a[0])


def _abs(op: ir.Operation, memo: dict) -> Bounds | None:
    (a,) = _tensors(op, memo, 0)
    if a is None:
        return None
    top = max(abs(a[0]), abs(a[1]))
    return (0 if a[0] <= 0 <= a[1] else min(abs(a[0]), abs(a[1]))), top


def _axis_size(op: ir.Operation) -> int:
    shape = ir.RankedTensorType(op.operands[0].type).shape
    return shape[ir.IntegerAttr(op.attributes["axis"]).value]


def _reduce_sum(op: ir.Operation, memo: dict) -> Bounds | None:
    (a,) = _tensors(op, memo, 0)
    n = _axis_size(op)
    return None if a is None else (a[0] * n, a[1] * n)


def _argmax(op: ir.Operation, memo: dict) -> Bounds | None:
    return 0, _axis_size(op) - 1


def _cast(op: ir.Operation, memo: dict) -> Bounds | None:
    (a,) = _tensors(op, memo, 0)  # None for a float source: its values are not bounded here
    result = _type_range(ir.RankedTensorType(op.result.type).element_type)
    return a if fits(a, result) else None


def _int_div(op: ir.Operation, memo: dict) -> Bounds | None:
    (a,) = _tensors(op, memo, 0)
    if a is None:
        return None
    top = max(abs(a[0]), abs(a[1]))
    return -top, top


def _clamp(op: ir.Operation, memo: dict) -> Bounds | None:
    (a,) = _tensors(op, memo, 0)
    low, high = (ir.IntegerAttr(op.attributes[k]).value for k in ("min_val", "max_val"))
    if a is None:
        return low, high
    return max(a[0], low), min(a[1], high)


_RULES: dict[str, Callable[[ir.Operation, dict], Bounds | None]] = {
    "tosa.const": _const,
    **dict.fromkeys(["tosa.reshape", "tosa.transpose", "tosa.slice", "tosa.tile", "tosa.identity",
                     "tosa.reverse", "tosa.concat", "tosa.maximum", "tosa.minimum",
                     "tosa.reduce_max", "tosa.reduce_min"], _same()),
    "tosa.gather": _same(0),
    "tosa.scatter": _same(0, 2),
    "tosa.select": _same(1, 2),
    "tosa.pad": _same(0, 2),
    "tosa.add": _binary(lambda x, y: x + y),
    "tosa.sub": _binary(lambda x, y: x - y),
    "tosa.mul": _binary(lambda x, y: x * y),
    "tosa.negate": _negate,
    "tosa.abs": _abs,
    "tosa.reduce_sum": _reduce_sum,
    "tosa.argmax": _argmax,
    "tosa.cast": _cast,
    "tosa.intdiv": _int_div,
    "tosa.clamp": _clamp,
}
