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

Better still, a native region writes such an update into the caller's tensor itself
(`native_writes`): the region's function takes the input as a writable argument and computes
the new value in it (`NativeFunction`'s `written`; `pipeline._written_in_place` checks where
bufferization put it), so a scatter into a KV cache runs in place inside native code and the
step is one native call, not a call per layer around eager scatters; the in-place ops above
are what is left where it can't. `writes_natively` says which scatters can stay in a region.
"""

from __future__ import annotations

import operator

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


# The placeholder each output of a fused region writes into: GraphModule.meta key of the
# region's submodule, {output position: placeholder position}.
WRITES = "torchtosa_writes"


def _reads_after(dst: fx.Node, node: fx.Node, order: dict[fx.Node, int], allowed: tuple[fx.Node, ...]) -> bool:
    """Whether an op other than `allowed` reads `dst` after `node`, or through a view (which
    would see the new value where the graph means the old one)."""
    return any(u not in allowed and (order[u] > order[node] or _aliases(u)) for u in dst.users)


def _aliases(node: fx.Node) -> bool:
    """Whether `node`'s result may share storage with an input (a view, an in-place op, a
    function of unknown semantics); a native region's results are its own."""
    if node.op == "call_module" or node.target is operator.getitem:
        return False
    schema = getattr(node.target, "_schema", None)
    return schema is None or any(a.alias_info is not None for a in schema.arguments)


def writes_natively(gm: fx.GraphModule) -> set[fx.Node]:
    """The scatters of `in_place_writes` a native region may compute and write into the caller's
    tensor: no op but the scatter and its copy reads the input after the scatter or views it."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return {src for src, copy in in_place_writes(gm).items()
            if not _reads_after(copy.args[0], src, order, (src, copy))}


def native_writes(fused: fx.GraphModule) -> dict[fx.Node, list[tuple[fx.Node, int, int]]]:
    """Per call of a fused region: the write-backs `copy_(x, region output)` it can do itself,
    as (copy, output position, argument position of x): `x` is an argument of the region, of
    the output's shape and dtype, and no other op reads it after the call or views it. Marks
    each region's submodule (`WRITES`) for its compile."""
    order = {n: i for i, n in enumerate(fused.graph.nodes)}
    planned: dict[fx.Node, list[tuple[fx.Node, int, int]]] = {}
    for copy in fused.graph.find_nodes(op="call_function", target=aten.copy_.default):
        dst, value = copy.args[:2]
        if dst.op != "placeholder" or not isinstance(value, fx.Node) or len(copy.args) > 2 or copy.kwargs:
            continue
        call, position = (value.args[0], value.args[1]) if value.target is operator.getitem else (value, 0)
        if not (isinstance(call, fx.Node) and call.op == "call_module" and dst in call.args):
            continue
        old, new = dst.meta.get("val"), value.meta.get("val")
        if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor) and old.dtype == new.dtype
                and old.shape == new.shape):
            continue
        if _reads_after(dst, call, order, (call, copy)) or any(u.op == "output" for u in value.users):
            continue
        taken = planned.setdefault(call, [])
        if any(p == position or c.args[0] is dst for c, p, _ in taken):
            continue
        taken.append((copy, position, call.args.index(dst)))
    for call, writes in planned.items():
        getattr(fused, call.target).meta[WRITES] = {position: argument for _, position, argument in writes}
    return planned


def drop_copies(fused: fx.GraphModule, writes: list[tuple[fx.Node, int, int]]) -> set[str]:
    """Erase the write-backs a compiled region does itself; their names."""
    names = {copy.name for copy, _, _ in writes}
    for copy, _, _ in writes:
        copy.replace_all_uses_with(copy.args[0])
        fused.graph.erase_node(copy)
    fused.recompile()
    return names
