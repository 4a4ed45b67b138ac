"""Frozen graphs: parameters and buffers become constants, and what only reads constants is
computed once.

`freeze(captured)` turns the lifted parameter and buffer placeholders of a captured graph into
`get_attr` nodes holding the tensors (their module paths in `node.meta["source_name"]`, which
the importer gives their `tosa.const` as location), so that one TOSA file is the whole model.
`fold_constants(gm)` (which `to_tosa` runs once after it) runs, with PyTorch itself, every
deterministic aten node whose inputs are all constants (a transposed weight, position ids sliced
from a buffer, a causal mask built from `arange`), replacing it by its value: index arithmetic
torch does in int64 on constants never reaches the TOSA module.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .symbolic import is_static
from .trace import Captured

# A folded value may be larger than the constants it is computed from (an expanded bias, a
# mask): up to this many elements.
MAX_FOLDED_ELEMENTS = 1 << 22


def freeze(captured: Captured) -> fx.GraphModule:
    """The captured graph with its parameters and buffers as constants (not folded yet)."""
    gm = captured.gm
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    lifted = placeholders[:len(captured.params)]
    names = captured.param_names or [n.name for n in lifted]
    for i, (node, value, name) in enumerate(zip(lifted, captured.params, names, strict=True)):
        _to_constant(gm, node, value, f"_frozen{i}", name, after=placeholders[-1])
    gm.graph.lint()
    return gm


def fold_constants(gm: fx.GraphModule) -> None:
    """Replace every deterministic aten node whose inputs are all constants by its value."""
    count = 0
    for node in list(gm.graph.nodes):
        if not _foldable(node):
            continue
        args, kwargs = pytree.tree_map_only(fx.Node, lambda n: _value(gm, n), (node.args, node.kwargs))
        with torch.no_grad():
            value = node.target(*args, **kwargs)
        inputs = sum(_value(gm, n).numel() for n in node.all_input_nodes)
        if not isinstance(value, torch.Tensor) or value.numel() > max(inputs, MAX_FOLDED_ELEMENTS):
            continue
        # named by the one parameter it is computed from (a transposed weight), else by its node
        named = {n.meta["source_name"] for n in node.all_input_nodes if "source_name" in n.meta}
        name = named.pop() if len(named) == 1 else node.name
        _to_constant(gm, node, value.contiguous(), f"_folded{count}", name, after=node)
        count += 1
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


def _foldable(node: fx.Node) -> bool:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in node.target.tags or node.target._schema.is_mutable:
        return False
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not is_static(val.shape):
        return False
    return all(n.op == "get_attr" for n in node.all_input_nodes)


def _value(gm: fx.GraphModule, node: fx.Node) -> torch.Tensor:
    return getattr(gm, node.target)


def _to_constant(gm: fx.GraphModule, node: fx.Node, value: torch.Tensor, attr: str, name: str,
                 after: fx.Node) -> None:
    gm.register_buffer(attr, value.detach())
    with gm.graph.inserting_after(after):
        const = gm.graph.get_attr(attr)
    const.meta.update(node.meta)
    const.meta["source_name"] = name
    node.replace_all_uses_with(const)
    gm.graph.erase_node(node)
