"""Can a graph node run as native code? The registry's own generated rules answer.

`unsupported_reason(node)` calls each lowering of the node's aten overload in check-only
mode (`entry.fn(None, ...)`: the entry's `requires`, `limits`, shape and dtype rules on the
node's meta values, no IR), so the partitioner and the importer read the same table and
the reason an op runs eagerly is the entry's own message.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx

from ..capture.symbolic import same_shape, show, static
from ..errors import TorchTosaError
from .registry import eager_reasons, registry
from .tosa import Tensor, element_dtypes, storage_layout, wrapped_dtype


def schema_arguments(node: fx.Node) -> Iterator[tuple[Any, Any]]:
    """(value, schema argument) for each argument of an aten call, in schema order, defaults filled.

    A value is what the node holds: an `fx.Node`, a list of them, or a constant. Raises
    KeyError naming the argument if a required one is missing."""
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            yield node.args[i], arg
        elif arg.name in node.kwargs:
            yield node.kwargs[arg.name], arg
        elif arg.has_default_value():
            yield arg.default_value, arg
        else:
            raise KeyError(arg.name)


def describe(value: Any, schema_arg: Any) -> Any:
    """An argument as a check-only lowering takes it: nodes as value-less Tensors
    (`_NotNative` with the reason if a node's value cannot cross into native code)."""
    if isinstance(value, fx.Node):
        val = value.meta.get("val")
        if isinstance(val, torch.SymInt | int) and not isinstance(val, bool):
            if schema_arg.type.str() in ("Tensor", "Tensor?"):  # a size as an operand: wrapped
                return Tensor(None, (), torch.int64, wrapped=True)  # type: ignore[arg-type]
            return val  # a size: the rules compute with it
        if (reason := tensor_reason(val, f"argument {schema_arg.name}")) is not None:
            raise _NotNative(reason)
        return Tensor(None, tuple(val.shape), val.dtype, layout=storage_layout(val))  # type: ignore[arg-type]
    if isinstance(value, (list, tuple)):
        return [describe(v, schema_arg) for v in value]
    if isinstance(value, torch.SymFloat | torch.SymBool):
        raise _NotNative(f"argument {schema_arg.name} is symbolic")
    if schema_arg.type.str() in ("Tensor", "Tensor?") and isinstance(value, bool | int | float):
        return Tensor(None, (), wrapped_dtype(value), wrapped=True)  # type: ignore[arg-type]
    return value


class _NotNative(Exception):
    """A reason, raised while describing a node."""


def tensor_reason(val: Any, what: str) -> str | None:
    """Why a tensor value cannot cross into native code, or None if it can."""
    if isinstance(val, (list, tuple)):
        return next((r for v in val if (r := tensor_reason(v, what)) is not None), None)
    if not isinstance(val, torch.Tensor):
        return f"{what} is a {type(val).__name__} (a Python scalar or symbolic value)"
    if val.dtype not in element_dtypes():
        return f"{what} is {str(val.dtype).removeprefix('torch.')}, which has no TOSA element type"
    if any(static(d) == 0 for d in val.shape):
        return f"{what} is a zero-size tensor {list(val.shape)} (TOSA has no empty tensors)"
    return None


def used_results(node: fx.Node) -> list[Any]:
    """The meta values of the results of `node` that a later node reads (an unused empty
    output, like eval batch norm's saved statistics, is fine)."""
    val = node.meta.get("val")
    if not isinstance(val, (list, tuple)):
        return [val] if node.users else []
    used = {u.args[1] for u in node.users if u.target is operator.getitem and u.users}
    return [v for i, v in enumerate(val) if i in used]


def is_size(node: fx.Node) -> bool:
    """Whether a node computes a size (sym_size, arithmetic on SymInts), not a tensor: the
    importer emits nothing for it, the rules compute with its symbolic value."""
    return isinstance(node.meta.get("val"), torch.SymInt | torch.SymBool | torch.SymFloat)


def unsupported_reason(node: fx.Node) -> str | None:
    """Why `node` cannot be lowered to TOSA, or None if some registry entry lowers it."""
    if node.op != "call_function":
        return f"{node.op} node"
    if node.target is operator.getitem or is_size(node):
        return None  # goes where its producer goes; size arithmetic is computed by the rules
    if not isinstance(node.target, torch._ops.OpOverload):
        return f"{getattr(node.target, '__name__', node.target)} is not an aten op"
    op = str(node.target)
    if (reason := tensor_reason(used_results(node), "its result")) is not None:
        return reason
    entries = registry().get(op)
    if not entries:
        known = eager_reasons().get(op)
        return f"no mapping: {known.reason} ({known.where})" if known else "no mapping in any registry"
    try:
        args = [describe(value, arg) for value, arg in schema_arguments(node)]
    except _NotNative as err:
        return str(err)
    reasons = []
    for entry in entries:
        try:
            types = entry.fn(None, *args)
        except TorchTosaError as err:
            reasons.append(f"{err} ({entry.where})" if len(entries) == 1 else f"{entry.registry}: {err}")
            continue
        if (mismatch := _mismatch(types, node.meta.get("val"))) is None:
            return None
        reasons.append(f"{entry.where} computes {mismatch}")
    return "; ".join(reasons)


def _mismatch(types: list[tuple[tuple[int, ...], torch.dtype]], val: Any) -> str | None:
    vals = list(val) if isinstance(val, (list, tuple)) else [val]
    for (shape, dtype), v in zip(types, vals, strict=False):
        if isinstance(v, torch.Tensor) and (not same_shape(shape, v.shape, guard=True) or dtype != v.dtype):
            return f"{dtype}{show(shape)} where PyTorch has {v.dtype}{show(v.shape)}"
    return None
