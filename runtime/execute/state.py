"""Updates of the caller's tensors, written in place where eager would write them.

AOTAutograd (with `keep_inference_input_mutations`) leaves an update of an input as
`copy_(x, f(x, ...))` at the end of the functional graph: a whole-tensor copy. When `f` is
a functional scatter (`index_copy`, `index_put`, `scatter`, `slice_scatter`, ...) that is
the last reader of the old `x`, `update_in_place` turns the pair back into the in-place op
eager would run (`x.index_copy_(...)`, `x.slice(...).copy_(src)`), so a KV cache that
gains one token per step is written one token at a time. The in-place form is found by
torch's naming convention (`aten.f_` beside `aten.f`; `aten.v` for `aten.v_scatter`), not
by a table. Those ops then run eagerly, between native regions. A pointwise update
(`x.add_(1)`: batch norm's step counter) writes every element either way: it stays a native
op followed by the copy.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch._ops import OpOverload

aten = torch.ops.aten


def _in_place_variant(op: OpOverload) -> OpOverload | None:
    packet = getattr(aten, op._schema.name.split("::")[-1] + "_", None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def _view_of_scatter(op: OpOverload) -> OpOverload | None:
    name = op._schema.name.split("::")[-1]
    if not name.endswith("_scatter"):
        return None
    packet = getattr(aten, name.removesuffix("_scatter"), None)
    if packet is None:
        return None
    return next((getattr(packet, o) for o in packet.overloads() if o in ("default", "Tensor", "int")), None)


def in_place_writes(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """`f(x, ...)` -> `copy_(x, f(x, ...))` for every write-back into an input that
    `update_in_place` can make an in-place op."""
    writes = {}
    for copy in gm.graph.find_nodes(op="call_function", target=aten.copy_.default):
        dst, src = copy.args[:2]
        if (dst.op == "placeholder" and isinstance(src, fx.Node) and isinstance(src.target, OpOverload)
                and src.args and src.args[0] is dst and torch.Tag.pointwise not in src.target.tags
                and (_in_place_variant(src.target) or _view_of_scatter(src.target))):
            writes[src] = copy
    return writes


def update_in_place(gm: fx.GraphModule) -> set[str]:
    """Rewrite each write-back that is the last reader of its input in place; the names of
    the copies that are gone."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = set()
    for src, copy in in_place_writes(gm).items():
        dst = copy.args[0]
        if any(order[u] > order[src] for u in dst.users if u not in (src, copy)):
            continue  # a later op reads the old value: keep the functional op and the copy
        view = _view_of_scatter(src.target)
        if view is not None:  # v_scatter(x, value, *args) -> v(x, *args).copy_(value)
            with gm.graph.inserting_before(src):
                window = gm.graph.call_function(view, (dst, *src.args[2:]), src.kwargs)
                gm.graph.call_function(aten.copy_.default, (window, src.args[1]))
            src.replace_all_uses_with(dst)
            gm.graph.erase_node(src)
        else:  # f(x, ...) -> f_(x, ...), which returns x
            src.target = _in_place_variant(src.target)
        copy.replace_all_uses_with(dst)
        done.add(copy.name)
        gm.graph.erase_node(copy)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
