"""Node groups replaced by one op: the `match` tables of opdefs entries, applied to an FX graph.

`rewrite_groups(gm)` tries every pattern (registry.patterns(), rendered from the `match` of
torchtosa entries such as opdefs/quantize_int.yaml) at every node. A pattern names a small tree
of nodes by their overloads; each argument of a node is a producer in the tree, an argument
of the replacing op (`$name`), anything (`_`), a literal, or a list whose every element is a
producer matching one subtree (`[name, ...]`: its `$name`s bind lists, one value per element).
A fit becomes one call of the op, with its arguments converted by the op's schema: a
`float[]`/`int[]` argument bound to a node takes that node's constant value (a frozen graph's
`get_attr`), so the lowering's rules compute with the numbers. The call replaces the root only
if the entry's own rules accept it (check-only, as support.py asks); otherwise the next pattern
that fits the node is tried (a `$name` may bind a node where the op wants a number), and if
none is accepted the group stays and its nodes are lowered one by one (the float path, with
the first declining entry's reason). Nodes of the group that other nodes still use stay in
the graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from ...importer.registry import Pattern, patterns
from ...importer.support import schema_arguments, unsupported_reason

_DTYPES = {"i8": torch.int8, "i16": torch.int16, "i32": torch.int32, "u8": torch.uint8}


@dataclass
class Group:
    """What happened to one group a pattern fits: `path` is "integer" (the group is now one
    call of `op`) or "float" (the entry declined it: `reason`)."""

    op: str
    root: str  # the replaced node's name
    path: str
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.root}: {self.op} ({self.path} path{': ' + self.reason if self.reason else ''})"


class _NoMatch(Exception):
    pass


def rewrite_groups(gm: fx.GraphModule) -> list[Group]:
    """Replace each group a pattern fits by its op's call where the op's rules accept it;
    the groups found, with the path each takes."""
    table = patterns()
    groups: list[Group] = []
    if not table:
        return groups
    for node in list(gm.graph.nodes):
        declined: Group | None = None  # a fit whose op declined it: a later pattern may still take the node
        for pattern in table:
            try:
                binds = _bind(pattern, pattern.root, node, {})
            except _NoMatch:
                continue
            group = _replace(gm, pattern, node, binds)
            if group.path == "integer":
                groups.append(group)
                break
            declined = declined or group
        else:
            if declined is not None:
                groups.append(declined)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return groups


def _bind(pattern: Pattern, name: str, node: Any, binds: dict[str, Any]) -> dict[str, Any]:
    """`binds` extended by matching the pattern's node `name` at `node` (raises _NoMatch)."""
    target, args = pattern.nodes[name]
    if not isinstance(node, fx.Node) or node.op != "call_function":
        raise _NoMatch
    if target == "getitem":  # an element of a multi-output op's result
        if node.target is not operator.getitem:
            raise _NoMatch
        values = list(node.args)
    elif str(node.target) != target:
        raise _NoMatch
    else:
        values = [v for v, _ in schema_arguments(node)]
    for want, value in zip(args, values, strict=False):
        kind = want[0]
        if kind == "node":
            binds = _bind(pattern, want[1], value, binds)
        elif kind == "each":
            binds = _bind_each(pattern, want[1], value, binds)
        elif kind == "bind":
            if want[1] in binds and not _same(binds[want[1]], value):
                raise _NoMatch
            binds = {**binds, want[1]: value}
        elif kind == "dtype":
            if value != _DTYPES[want[1]]:
                raise _NoMatch
        elif kind == "lit" and not _same(value, want[1]):
            raise _NoMatch
    return binds


def _bind_each(pattern: Pattern, name: str, values: Any, binds: dict[str, Any]) -> dict[str, Any]:
    """`binds` extended by matching the node `name` at every element of the list `values`:
    each argument the subtree binds becomes the list of its values, one per element."""
    if not isinstance(values, (list, tuple)) or not values:
        raise _NoMatch
    each = [_bind(pattern, name, v, {}) for v in values]
    for key in each[0]:
        value = [b[key] for b in each]
        if key in binds and not _same(binds[key], value):
            raise _NoMatch
        binds = {**binds, key: value}
    return binds


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a is b if isinstance(a, fx.Node) or isinstance(b, fx.Node) else type(a) is type(b) and a == b


def _replace(gm: fx.GraphModule, pattern: Pattern, root: fx.Node, binds: dict[str, Any]) -> Group:
    ns, name, overload = pattern.op.split(".")
    op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    args = []
    for arg in op._schema.arguments:
        value = binds[arg.name] if arg.name in binds else pattern.fixed[arg.name]
        value, problem = _as_argument(gm, value, arg)
        if problem:
            return Group(pattern.op, root.name, "float", problem)
        args.append(value)
    with gm.graph.inserting_before(root):
        call = gm.graph.call_function(op, tuple(args))
    call.meta.update({k: v for k, v in root.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
    reason = unsupported_reason(call)
    if reason is not None:
        gm.graph.erase_node(call)
        return Group(pattern.op, root.name, "float", reason)
    root.replace_all_uses_with(call)
    return Group(pattern.op, root.name, "integer")


def _as_argument(gm: fx.GraphModule, value: Any, arg: Any) -> tuple[Any, str | None]:
    """A bound value as the op's schema argument `arg` takes it, or a reason it can't be."""
    kind = arg.type.str()
    if isinstance(value, fx.Node) and kind in ("float[]", "int[]", "float[]?", "int[]?"):
        if value.op != "get_attr":
            return None, f"{arg.name} ({value.name}) is not a constant (to_tosa(..., freeze=True) makes it one)"
        tensor = operator.attrgetter(value.target)(gm)
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
            return None, f"{arg.name} ({value.name}) is not a 1-D tensor"
        return [float(v) if kind.startswith("float") else int(v) for v in tensor.tolist()], None
    if isinstance(value, fx.Node) != (kind in ("Tensor", "Tensor?")) and value is not None:
        return None, f"{arg.name} is {value!r}, not a {kind}"
    return value, None
