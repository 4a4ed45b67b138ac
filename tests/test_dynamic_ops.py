"""Every opdefs entry on symbolic sizes: each sample (one dtype) as a one-op graph whose tensor
dims are all symbols of a ShapeEnv, imported, compiled and run at the sample's sizes.

An entry either lowers the graph without specializing a size (no symbol fixed to a value or
bounded by a new guard; a guard relating two sizes, as broadcasting needs, is allowed) and
matches eager, or declares `static` and raises Unsupported naming it before any rule runs.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import pytest
import sympy
import torch
from test_ops import CASES, IDS, assert_matches_eager, call_torch, entry_for, make_args
from torch._dispatch.python import enable_python_dispatcher
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from generator.spec import OpDef, Sample
from torchtosa import Unsupported
from torchtosa.capture.symbolic import symbolic_part
from torchtosa.execute.native import NativeFunction
from torchtosa.importer import graph as importer


def _one_dtype() -> list[tuple[OpDef, Sample, str]]:
    """The samples that lower (no `raises`/`unsupported`), each with its first dtype only."""
    seen, out = set(), []
    for (e, s), name in zip(CASES, IDS, strict=True):
        key = (e.op, e.registry, s.where)
        if not (s.raises or s.unsupported) and key not in seen:
            seen.add(key)
            out.append((e, s, name))
    return out


SAMPLES = _one_dtype()

# Samples whose rules still guard on (or mis-simplify) symbolic sizes, to be fixed rather than made
# static (slicing and padding of symbolic dims are common): strict, so a fix must remove them.
KNOWN = {
    "aten.slice.Tensor": "normalize_slice's clamps give Min() expressions that are not provably torch's, "
                         "and a step > 1 pads by a size the rules compare",
    "aten.constant_pad_nd.default": "a negative pad (a crop) guards that the result is non-empty",
    "aten.var.correction": "1 / (N - correction) branches on N - correction > 0",
}
KNOWN_SAMPLES = {"aten.slice.Tensor": {0, 1, 2, 3, 4, 6, 7, 8, 9}, "aten.constant_pad_nd.default": {3, 4},
                 "aten.var.correction": {8}}  # positions in the entry's samples


def _known(e: OpDef, s: Sample) -> bool:
    wheres = list(dict.fromkeys(x.where for x in e.samples))
    return wheres.index(s.where) in KNOWN_SAMPLES.get(e.op, set())


def _params() -> list[Any]:
    return [pytest.param(e, s, id=name, marks=[pytest.mark.xfail(reason=KNOWN[e.op], strict=True)]
                         if _known(e, s) else []) for e, s, name in SAMPLES]


@dataclass
class Graph:
    gm: torch.fx.GraphModule
    shape_env: ShapeEnv
    tensors: list[torch.Tensor]  # the real arguments, in placeholder order
    values: list[Any]  # the entry's arguments as the graph holds them (FakeTensors for tensors)


def symbolic_graph(e: OpDef, args: list[Any]) -> Graph:
    """A graph calling the entry's overload once, every dim of every tensor argument a symbol
    (sizes 0 and 1 stay static, as torch specializes them), with torch's result as meta."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    graph = torch.fx.Graph()
    tensors: list[torch.Tensor] = []

    def placeholder(t: torch.Tensor) -> tuple[torch.fx.Node, torch.Tensor]:
        name = f"arg{len(tensors)}"
        context = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC] * t.dim())
        fake = mode.from_tensor(t, source=ConstantSource(name), symbolic_context=context)
        node = graph.placeholder(name)
        node.meta["val"] = fake
        tensors.append(t)
        return node, fake

    nodes, values = [], []
    for a in args:
        if isinstance(a, torch.Tensor):
            node, fake = placeholder(a)
        elif isinstance(a, list) and any(isinstance(x, torch.Tensor) for x in a):
            pairs = [placeholder(x) if isinstance(x, torch.Tensor) else (x, x) for x in a]
            node, fake = [n for n, _ in pairs], [f for _, f in pairs]
        else:
            node = fake = a
        nodes.append(node)
        values.append(fake)
    ns, name, overload = e.op.split(".")
    op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    schema = op._schema.arguments
    if not tensors:  # a factory: its sizes come from another tensor's shape, as in zeros(x.shape)
        ints = sorted({v for a, x in zip(schema, args, strict=True) if a.real_type.str().startswith("SymInt")
                       for v in (x if isinstance(x, list) else [x])
                       if isinstance(v, int) and not isinstance(v, bool) and 2 <= v <= 4096})
        if ints:
            node, fake = placeholder(torch.zeros(ints))
            nodes.append(node)
            values.append(fake)
    sizes = _sizes(graph, nodes, values)
    nodes, values = nodes[:len(schema)], values[:len(schema)]
    for i, a in enumerate(schema):  # a size argument equal to an input's size is that size, as traced
        if a.real_type.str().startswith("SymInt"):
            nodes[i], values[i] = _as_size(nodes[i], sizes), _as_size(values[i], sizes, meta=True)
    with mode, enable_python_dispatcher():  # torch's symbolic meta functions and decompositions
        result = op(*[v for v, a in zip(values, schema, strict=True) if not a.kwarg_only],
                    **{a.name: v for v, a in zip(values, schema, strict=True) if a.kwarg_only})
    call = graph.call_function(op, tuple(n for n, a in zip(nodes, schema, strict=True) if not a.kwarg_only),
                               {a.name: n for n, a in zip(nodes, schema, strict=True) if a.kwarg_only})
    call.meta["val"] = result
    if isinstance(result, tuple | list):
        items = []
        for i, r in enumerate(result):
            items.append(graph.call_function(operator.getitem, (call, i)))
            items[-1].meta["val"] = r
        graph.output(tuple(items))
    else:
        graph.output(call)
    return Graph(torch.fx.GraphModule(torch.nn.Module(), graph), env, tensors, values)


def _sizes(graph: torch.fx.Graph, nodes: list[Any], values: list[Any]) -> dict[int, tuple[torch.fx.Node, Any]]:
    """For each value of a symbolic input dim, a `sym_size` node reading it (the first such dim)."""
    out: dict[int, tuple[torch.fx.Node, Any]] = {}
    flat = [(n, v) for n, v in zip(nodes, values, strict=True) if isinstance(v, torch.Tensor)]
    flat += [(n, v) for ns, vs in zip(nodes, values, strict=True) if isinstance(vs, list)
             for n, v in zip(ns, vs, strict=True) if isinstance(v, torch.Tensor)]
    for node, fake in flat:
        for d, size in enumerate(fake.shape):
            if isinstance(size, torch.SymInt) and size.node.hint not in out:
                with graph.inserting_after(node):
                    sym = graph.call_function(torch.ops.aten.sym_size.int, (node, d))
                sym.meta["val"] = size
                out[size.node.hint] = (sym, size)
    return out


def _as_size(v: Any, sizes: dict[int, tuple[torch.fx.Node, Any]], meta: bool = False) -> Any:
    if isinstance(v, list):
        return [_as_size(x, sizes, meta) for x in v]
    if isinstance(v, int) and not isinstance(v, bool) and v in sizes:
        return sizes[v][1 if meta else 0]
    return v


@dataclass(frozen=True)
class EnvState:
    replacements: dict[Any, Any]
    ranges: dict[Any, Any]
    guards: int


def _state(env: ShapeEnv) -> EnvState:
    return EnvState(dict(env.replacements), dict(env.var_to_range), len(env.guards))


def _relation(e: sympy.Basic) -> bool:
    """A guard relating two sizes (s0 == s1), which no value of either size decides alone."""
    return isinstance(e, sympy.Eq) and not e.lhs.is_number and not e.rhs.is_number


def specializations(env: ShapeEnv, before: EnvState) -> list[str]:
    """What lowering decided about the sizes since `before`: a symbol replaced by a number, a
    narrowed range, a guard that bounds a size."""
    out = [f"{s} := {v}" for s, v in env.replacements.items() if s not in before.replacements and v.is_number]
    out += [f"{s} in {r}" for s, r in env.var_to_range.items() if s in before.ranges and before.ranges[s] != r]
    out += [f"guard {g.expr}" for g in env.guards[before.guards:] if not _relation(g.expr)]
    return out


def _static_argument(e: OpDef, g: Graph) -> str | None:
    """The first argument the entry's `static` key names that is symbolic in the graph."""
    for name, _reason in e.static:
        for arg, value in zip(e.args, g.values, strict=True):
            if name in ("*", arg.name) and symbolic_part(value) is not None:
                return arg.name
    return None


def _empty(g: Graph) -> bool:
    vals = [n.meta["val"] for n in g.gm.graph.nodes if n.op != "output"]
    flat = [t for v in vals for t in (v if isinstance(v, tuple | list) else [v]) if isinstance(t, torch.Tensor)]
    return any(d == 0 for t in flat for d in t.shape if isinstance(d, int))


@pytest.mark.parametrize(("e", "s"), _params())
def test_symbolic_sizes(e: OpDef, s: Sample, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    args = make_args(e, s)
    g = symbolic_graph(e, args)
    before = _state(g.shape_env)  # after torch's own meta function: its guards are not ours
    monkeypatch.setattr(importer, "registry", lambda: {e.op: [entry_for(e)]})  # this entry only
    if _empty(g):  # size 0 is static; the importer leaves empty tensors to eager
        with pytest.raises(Unsupported, match="zero-size"):
            importer.import_graph(g.gm)
        return
    if (name := _static_argument(e, g)) is not None:
        with pytest.raises(Unsupported, match=f"needs static sizes .*{name} is"):
            importer.import_graph(g.gm)
        assert not (fixed := specializations(g.shape_env, before)), fixed
        return
    program = importer.import_graph(g.gm)
    assert not (fixed := specializations(g.shape_env, before)), f"{e.where} specializes sizes: {fixed}"
    native = NativeFunction(program.module, program.inputs, program.outputs, opt="none", ranges=program.ranges)
    assert_matches_eager(e, s, native(*g.tensors), call_torch(e, args))


def test_every_dynamic_entry_has_a_symbolic_sample() -> None:
    """An entry without `static` for all its arguments is tested on symbols: one of its samples has
    a tensor dim of size 2 or more (0 and 1 are static)."""
    def sized(v: Any) -> bool:  # a tensor dim, or a factory's size, of 2 or more
        if isinstance(v, tuple) and v and v[0] == "tensor":
            return any(d > 1 for d in v[2])
        if isinstance(v, list):
            return any(sized(x) for x in v)
        return isinstance(v, int) and not isinstance(v, bool) and 2 <= v <= 4096

    missing = [e.where for e in {id(e): e for e, _, _ in SAMPLES}.values()
               if not any(n == "*" for n, _ in e.static)
               and not any(sized(v) for s in e.samples if not (s.raises or s.unsupported) for v in s.args.values())]
    assert missing == []
