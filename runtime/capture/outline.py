"""Trace each distinct layer of a deep model once.

A transformer's blocks are children of one `nn.ModuleList` (or `nn.Sequential`) with the same
type and the same parameter and buffer names, shapes and dtypes. TorchDynamo and AOTAutograd
trace every call of every block, so capture time grows with depth. `outlined(module)` marks
those blocks' forward as a nested compile region while the capture runs
(`torch.compiler.nested_compile_region`): Dynamo then traces one block and emits an
`invoke_subgraph` call per block, each with that block's weights as operands, and AOTAutograd
traces the subgraph once too. The mark is a subclass swapped in as each block's `__class__`
(one subclass per block class, whose `forward` calls the region) and swapped back on exit,
errors included, so the user's model is left as it was. (A marked bound method set on each
instance instead made Dynamo reuse the first block's weights for all of them.)

For every later block Dynamo checks that the first block's trace still holds (the guards of its
trace, re-evaluated on the block's own attributes) and stamps out a call; that check is cheap
when the region's operands are positional tensors and constants, so the region takes the
block's keyword arguments positionally too (`_positional_region`).

`inline_subgraphs(gm)` expands the `invoke_subgraph` calls of a traced graph back into its
body, node by node: a copy per call, without tracing again, so the rest of torchtosa sees one
flat aten graph (and `partition` merges the identical layers again when lowering).
"""

from __future__ import annotations

import contextlib
import functools
import operator
import re
import sys
import types
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx as fx

from ..errors import Unsupported

__all__ = ["inline_subgraphs", "outlined", "repeated_layers"]

INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def _state_signature(module: torch.nn.Module) -> tuple[object, ...]:
    """What two blocks must share to be traced as one: type and state names, shapes, dtypes."""
    state = [*module.named_parameters(), *module.named_buffers()]
    return (type(module), tuple((name, tuple(t.shape), t.dtype) for name, t in state))


def repeated_layers(module: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """The groups of at least two interchangeable blocks (children with children of their own)
    of a ModuleList or Sequential within `module`, outermost first; nothing inside a block of
    a group is grouped again."""
    groups: list[list[torch.nn.Module]] = []

    def visit(m: torch.nn.Module) -> None:
        taken: set[int] = set()
        if isinstance(m, (torch.nn.ModuleList, torch.nn.Sequential)):
            by_signature: dict[tuple[object, ...], list[torch.nn.Module]] = {}
            for child in m.children():
                if _markable(child):
                    by_signature.setdefault(_state_signature(child), []).append(child)
            for group in by_signature.values():
                if len(group) >= 2 and any(True for _ in group[0].parameters()):
                    groups.append(group)
                    taken.update(id(c) for c in group)
        for child in m.children():
            if id(child) not in taken:
                visit(child)

    visit(module)
    return groups


def _markable(child: torch.nn.Module) -> bool:
    """A block of layers (a lone Linear gains nothing from a region) whose forward is its
    class's, not one set on the instance."""
    return (any(True for _ in child.children()) and "forward" not in vars(child)
            and type(child).forward is not torch.nn.Module.forward)


@contextlib.contextmanager
def outlined(module: torch.nn.Module) -> Iterator[int]:
    """Mark the repeated layers of `module` as nested compile regions until exit; yields how
    many blocks were marked (0: nothing to outline, the model is untouched)."""
    swapped: list[tuple[torch.nn.Module, type]] = []
    marked: dict[type, type] = {}
    try:
        for group in repeated_layers(module):
            for block in group:
                cls = type(block)
                if cls not in marked:
                    marked[cls] = _marked(cls)
                block.__class__ = marked[cls]
                swapped.append((block, cls))
        yield len(swapped)
    finally:
        for block, cls in swapped:
            block.__class__ = cls
        for cls in marked.values():
            module = sys.modules[cls.__module__]
            if vars(module).get(cls.__qualname__) is cls:
                delattr(module, cls.__qualname__)


def _marked(cls: type) -> type:
    """The subclass of `cls` whose forward is a nested compile region. It has `cls`'s name, in a
    module of its own named after `cls`'s (`torchtosa.capture.outline.marked.<module>`), where
    pickle finds it while it exists: a capture's guards keep the types they saw (frames.py)."""
    name = cls.__qualname__.replace(".", "_")  # a top-level name: Dynamo keeps no nested class
    module_name = f"{__name__}.marked.{cls.__module__}"
    module = sys.modules.setdefault(module_name, types.ModuleType(module_name))
    subclass = type(name, (cls,), {"forward": _positional_region(cls.forward), "__module__": module_name,
                                   "__qualname__": name})
    setattr(module, name, subclass)
    return subclass


def _positional_region(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` as a nested compile region called with positional operands only.

    Dynamo matches a call against the region's earlier traces cheaply when every operand is a
    tensor or constant passed positionally; keyword operands (a transformer block gets its masks
    and caches as keywords) make it trace a pytree flatten of them on every call. So the region
    takes `(self, n, *args, *names, *values)`, with `n` the number of positional arguments and
    the keywords' names as constants, and calls `forward(self, *args, **dict(zip(names, values)))`.
    """

    @torch.compiler.nested_compile_region
    def region(self: torch.nn.Module, positional: int, *operands: Any) -> Any:
        keywords = (len(operands) - positional) // 2
        args, names = operands[:positional], operands[positional:positional + keywords]
        return forward(self, *args, **dict(zip(names, operands[positional + keywords:], strict=True)))

    @functools.wraps(forward, updated=())
    def call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return region(self, len(args), *args, *kwargs, *kwargs.values())

    return call


def inline_subgraphs(gm: fx.GraphModule) -> dict[str, int]:
    """Replace every `invoke_subgraph` call of `gm` (nested ones too) by a copy of its body;
    returns how many calls each subgraph (by its identifier) had."""
    graph = gm.graph
    inlined: Counter[str] = Counter()
    while calls := graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH):
        for call in calls:
            inlined[str(call.args[1])] += 1
            _inline(gm, call)
    if not inlined:
        return {}
    dropped = set()
    for node in graph.find_nodes(op="get_attr"):
        if not node.users and isinstance(getattr(gm, str(node.target), None), fx.GraphModule):
            dropped.add(str(node.target))
            graph.erase_node(node)
    for target in dropped - {str(n.target) for n in graph.find_nodes(op="get_attr")}:
        delattr(gm, target)
    graph.lint()
    gm.recompile()
    return dict(inlined)


def _inline(gm: fx.GraphModule, call: fx.Node) -> None:
    """Copy the body of one `invoke_subgraph(subgraph, identifier, *operands)` before it."""
    graph = gm.graph
    holder, _identifier, *operands = call.args
    body = getattr(gm, str(holder.target)) if isinstance(holder, fx.Node) else holder
    env: dict[fx.Node, object] = dict(zip(body.graph.find_nodes(op="placeholder"), operands, strict=True))
    with graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                results = list(node.args[0])
                break
            if node.op == "get_attr":  # a nested subgraph or constant of the body: kept on `gm`
                value = getattr(body, str(node.target))
                name = _attribute_for(gm, str(node.target), value)
                setattr(gm, name, value)
                env[node] = graph.get_attr(name)
                env[node].meta.update(node.meta)
                continue
            env[node] = graph.node_copy(node, lambda n: env[n])
        else:
            raise Unsupported(f"the subgraph {holder} has no output")
    for user in list(call.users):
        if user.target is not operator.getitem:
            raise Unsupported(f"invoke_subgraph result used by {user.format_node()}, not by getitem")
        result = results[user.args[1]]
        if isinstance(result, fx.Node):
            user.replace_all_uses_with(env[result])
        else:
            raise Unsupported(f"invoke_subgraph result {user.args[1]} is not a graph value")
        graph.erase_node(user)
    graph.erase_node(call)


def _attribute_for(gm: fx.GraphModule, base: str, value: object) -> str:
    """An attribute name of `gm` for `value`: the one already holding it, or a free one."""
    stem = re.sub(r"\W", "_", base)  # a module path may hold any character (`block1-0`)
    name, i = stem, 0
    while hasattr(gm, name) and getattr(gm, name) is not value:
        i += 1
        name = f"{stem}_{i}"
    return name
