"""Views instead of copies at a graph's edges.

AOTAutograd's graphs return views of their inputs and take views as inputs: a training forward
graph saves the transposed weight `permute(w)` for backward and returns its input `x` and
`relu(h)` twice; the backward graph then takes that transposed weight. Native code returns
contiguous outputs it writes and takes contiguous inputs, so each such view cost a copy: the
forward wrote a transposed copy of every weight, the backward copied it back to row-major.

- `split_alias_outputs`: the outputs that are an input, a chain of views of one, or another
  output again leave the graph; `Aliases.rebuild` makes them from the arguments (PyTorch's own
  views: no data moves) and the native outputs.
- `permute_inputs`: an input that arrives as a permutation of contiguous memory (the transposed
  weight) is taken in that memory's order, and the graph permutes it back at its start, where the
  schedule folds the transpose into its consumer (a matmul reads either order).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

aten = torch.ops.aten

# ops whose result is a view of their first argument, data untouched
VIEWS = {aten.permute.default, aten.t.default, aten.transpose.int, aten.view.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default, aten.expand.default, aten.alias.default}


@dataclass(frozen=True)
class Aliases:
    """How to rebuild a graph's outputs from the outputs native code returns: per position,
    ("native", k), ("again", earlier position) or ("view", (argument index, view nodes))."""

    recipe: tuple[tuple[str, Any], ...]

    def rebuild(self, args: list[Any], native: list[Any]) -> list[Any]:
        """The graph's outputs from its arguments and the native outputs."""
        outputs: list[Any] = []
        for kind, what in self.recipe:
            if kind == "native":
                outputs.append(native[what])
            elif kind == "again":
                outputs.append(outputs[what])
            else:
                index, views = what
                outputs.append(_run_views(views, args[index]))
        return outputs


def split_alias_outputs(gm: fx.GraphModule) -> Aliases | None:
    """Remove the outputs of `gm` (all of them nodes) that are an input, views of one, or an
    output again, and the view nodes only they used; None if there are none."""
    output = gm.graph.output_node()
    outs = list(output.args[0])
    inputs = tuple(gm.graph.find_nodes(op="placeholder"))
    recipe: list[tuple[str, Any]] = []
    kept: list[fx.Node] = []
    first: dict[fx.Node, int] = {}
    for i, node in enumerate(outs):
        chain = _view_chain(node)
        if node in first:
            recipe.append(("again", first[node]))
        elif chain is not None:
            recipe.append(("view", (inputs.index(chain[0]), chain[1:])))
        else:
            recipe.append(("native", len(kept)))
            kept.append(node)
        first.setdefault(node, i)
    if len(kept) == len(outs):
        return None
    output.args = (tuple(kept),)
    for kind, what in recipe:
        if kind == "view":
            for node in reversed(what[1]):
                if not node.users:
                    gm.graph.erase_node(node)
    gm.graph.lint()
    return Aliases(tuple(recipe))


def _view_chain(node: fx.Node) -> tuple[fx.Node, ...] | None:
    """(placeholder, view nodes...) if `node` is a placeholder or views of one, else None."""
    chain = [node]
    while chain[-1].op == "call_function" and chain[-1].target in VIEWS:
        chain.append(chain[-1].args[0])
    return tuple(reversed(chain)) if chain[-1].op == "placeholder" else None


def _run_views(views: tuple[fx.Node, ...], value: Any) -> Any:
    for node in views:
        value = node.target(value, *node.args[1:], **node.kwargs)
    return value


def permute_inputs(gm: fx.GraphModule, args: list[Any]) -> list[tuple[int, ...] | None] | None:
    """For each argument: the order of its dims that makes it contiguous, where it is a
    non-contiguous permutation of contiguous memory and not written in place (else None); None
    if no argument is. The graph then takes it in that order: its placeholder is given that shape
    and permuted back where it is used."""
    orders: list[tuple[int, ...] | None] = []
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node, arg in zip(placeholders, args, strict=True):
        order = None if any(_writes(user, node) for user in node.users) else _contiguous_order(arg)
        orders.append(order)
        if order is None:
            continue
        val = node.meta.get("val")
        inverse = [order.index(d) for d in range(len(order))]
        with gm.graph.inserting_after(node):
            back = gm.graph.call_function(aten.permute.default, (node, inverse))
        node.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
        if isinstance(val, torch.Tensor):
            node.meta["val"] = val.permute(order)
            back.meta["val"] = val
    if not any(orders):
        return None
    gm.graph.lint()
    gm.recompile()
    return orders


def _writes(user: fx.Node, node: fx.Node) -> bool:
    """Whether `user` writes into `node` (an input updated in place: `copy_` into it)."""
    schema = getattr(user.target, "_schema", None)
    if schema is None:
        return False
    return any(a.alias_info is not None and a.alias_info.is_write and i < len(user.args) and user.args[i] is node
               for i, a in enumerate(schema.arguments))


def _contiguous_order(arg: Any) -> tuple[int, ...] | None:
    """The permutation `p` with `arg.permute(p)` contiguous, for a non-contiguous tensor of two or
    more dims (None for any other argument)."""
    if not isinstance(arg, torch.Tensor) or arg.dim() < 2 or arg.is_contiguous():
        return None
    order = tuple(sorted(range(arg.dim()), key=lambda d: (-arg.stride(d), -arg.size(d))))
    return order if arg.permute(order).is_contiguous() else None


def permuted(args: list[Any], orders: list[tuple[int, ...] | None] | None) -> list[Any]:
    """`args`, each with an order taken in it (a contiguous view where it arrives as traced)."""
    if orders is None:
        return args
    return [a if order is None else a.permute(order) for a, order in zip(args, orders, strict=True)]
