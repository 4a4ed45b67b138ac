"""Capture a PyTorch callable as a core-ATen FX graph.

`capture` traces an inference graph with TorchDynamo (fullgraph) and AOTAutograd
(decompositions.py) under `torch.no_grad()`; `capture_exported` starts from a
`torch.export.ExportedProgram`; `make_backend` builds a `torch.compile` backend, which
compiles AOTAutograd's inference graphs, or with autograd its forward and backward graphs.
`capture` and `capture_exported` hand over a graph whose placeholders are the
lifted parameters/buffers/constants first, then the user's tensor inputs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import operator
import re
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._dynamo import exc as dynamo_exc
from torch._functorch.aot_autograd import aot_module_simplified
from torch._guards import TracingContext, detect_fake_mode
from torch._ops import HigherOrderOperator
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx.experimental.symbolic_shapes import has_free_symbols

from .. import garbage
from ..errors import InvalidInput, TorchTosaError, Unsupported
from ..options import Options
from . import aot_cache, captures, frames, layouts, resizes
from .decompositions import DECOMPOSITIONS
from .outline import inline_subgraphs, outlined, repeated_layers

__all__ = ["Captured", "capture", "capture_exported", "make_backend"]


@dataclass
class Captured:
    """An aten graph and the values to call it with.

    `gm(*params, *example_inputs)` returns a flat tuple of tensors and
    `pytree.tree_unflatten(list(result), out_spec)` rebuilds the user's output.
    A later call is flattened with `pytree.tree_flatten((args, kwargs))`: its
    spec must equal `in_spec`, its tensor leaves are the graph's user inputs and
    its other leaves were specialised as constants while tracing.
    """

    gm: fx.GraphModule
    params: list[torch.Tensor]
    example_inputs: list[torch.Tensor]
    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    # where each of `params` comes from: its module path ("encoder.layer.0.weight"), or the
    # placeholder's name for a tensor the function closes over
    param_names: list[str] = field(default_factory=list)
    # the layers traced once (outline.py): how many calls each traced subgraph had
    outlined: dict[str, int] = field(default_factory=dict)
    # which graph of a torch.compile graph it is ("forward graph 0"), if it came from one
    graph: str = ""
    # what the disk cache did for it (captures.py): taken from it, or why it was traced
    origin: str = ""


class _Constant:
    """A non-tensor output leaf, kept in an out_spec so that unflattening restores it."""

    def __init__(self, value: Any) -> None:
        self.value = value


pytree.register_pytree_node(
    _Constant,
    lambda c: ([], c.value),
    lambda _children, value: value,
    serialized_type_name="torchtosa.capture.trace._Constant",
)


# Ops that only check facts at run time: they carry no data and are dropped.
_DATALESS = {
    torch.ops.aten._assert_async.default,
    torch.ops.aten._assert_async.msg,
    torch.ops.aten._assert_scalar.default,
    torch.ops.aten._assert_tensor_metadata.default,
    torch.ops.aten._functional_assert_async.msg,
    torch.ops.aten._functional_assert_scalar.default,
    torch.ops.aten._functional_sym_constrain_range.default,
    torch.ops.aten._functional_sym_constrain_range_for_size.default,
    torch.ops.aten.sym_constrain_range.default,
    torch.ops.aten.sym_constrain_range_for_size.default,
}

# Ops that return their input unchanged in a functional graph: folded away.
_IDENTITY = {torch.ops.aten.alias.default, torch.ops.aten.lift_fresh_copy.default}


def capture(
    fn: Callable[..., Any] | torch.nn.Module,
    args: tuple[Any, ...],
    kwargs: dict[str, Any] | None = None,
    outline: bool = True,
) -> Captured:
    """Trace `fn(*args, **kwargs)` with TorchDynamo (fullgraph) and AOTAutograd.

    Runs `fn` once, without autograd, on the given inputs. A graph break raises
    `Unsupported` with Dynamo's reason and the user's source line; an error
    PyTorch itself raises while tracing (e.g. a shape mismatch) raises
    `InvalidInput`. Input, parameter and buffer mutations raise `Unsupported`.

    With `outline`, a module's repeated layers (outline.py) are traced once each: if Dynamo
    refuses that (a graph break or side effect inside a block), every layer is traced as usual.

    torch's random generator is left as it was (Dynamo saves and restores it around tracing;
    the recorded run draws from it too): after `torch.manual_seed(s)`, the compiled function's
    random ops, which run eagerly, draw what `fn`'s would.

    With the disk cache on, a capture whose assumptions can be kept is kept (captures.py), and a
    later call (another process) whose guards hold takes it instead of tracing.
    """
    kwargs = dict(kwargs or {})
    entry = captures.key(fn, args, kwargs, outline)  # None: the disk cache is off
    why = ""
    if entry is not None:
        kept, why = _kept(entry, fn, args, kwargs)
        if kept is not None:
            return kept
    with torch.random.fork_rng(devices=[]):
        if outline and isinstance(fn, torch.nn.Module) and repeated_layers(fn):
            try:
                with outlined(fn):
                    captured, guards, bound = _traced(fn, args, kwargs, entry is not None)
            except Exception:  # any refusal of the regions (Dynamo, AOTAutograd): trace without them
                captured, guards, bound = _traced(fn, args, kwargs, entry is not None)
        else:
            captured, guards, bound = _traced(fn, args, kwargs, entry is not None)
    if entry is not None:
        stored = guards is not None and bound is not None and captures.store(entry, captured, guards, bound)
        captured.origin = ", ".join(filter(None, [
            why, "kept on disk" if stored else "not kept on disk (it assumed what another process can't check)"]))
    return captured


def _kept(entry_key: str, fn: Callable[..., Any] | torch.nn.Module, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> tuple[Captured | None, str]:
    """The capture kept on disk under `entry_key` if its guards hold for this call, checked as
    Dynamo would on the frame it traced (`_trampoline(fn, *args, **kwargs)`, without autograd,
    the repeated layers marked if they were); else None and why not ("" if there is none)."""
    entry = captures.load(entry_key)
    if entry is None:
        return None, ""
    marked = outlined(fn) if entry["outlined"] else contextlib.nullcontext()
    with torch.no_grad(), mha_fastpath_disabled(), marked:
        if (why := entry["guards"].check(_trampoline, (fn, *args), kwargs)) is not None:
            return None, f"traced: the capture kept on disk no longer holds ({why})"
    try:
        gm, params = captures.bind(entry, fn)
    except Exception as err:  # a state tensor no longer there: the guards should have said so
        return None, f"traced: the capture kept on disk doesn't bind ({err})"
    inputs = [x for x in pytree.tree_leaves((tuple(args), kwargs)) if isinstance(x, torch.Tensor)]
    return Captured(gm, params, inputs, entry["in_spec"], entry["out_spec"], entry["names"], entry["outlined"],
                    origin="taken from the disk cache (no trace)"), ""


def _traced(fn: Callable[..., Any] | torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
            guards: bool) -> tuple[Captured, frames.Guards | None, list[tuple[str, Any]] | None]:
    """`capture` of `fn` as it is; if `guards`, what the trace assumed (frames.trace) and where
    each lifted tensor comes from (captures.binding), else None for both."""
    leaves, in_spec = pytree.tree_flatten((tuple(args), kwargs))
    inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
    rec = _Recorder()
    with torch.no_grad(), mha_fastpath_disabled(), resizes.kept(), translated_dynamo_errors():
        run, kept = frames.trace(_trampoline, (fn, *args), kwargs, rec.backend, guards=guards)
        result = run(fn, *args, **kwargs)
    out_leaves, out_spec = pytree.tree_flatten(_wrap_constants(result))
    paths = _state_paths(fn)
    # p_fc_weight; a module path is not always made of identifiers (regnet's `block1-0`)
    placeholders = {i: kind + re.sub(r"\W", "_", path) for i, (kind, path) in paths.items()}
    constants = rec.constant_ids() if kept is not None else set()  # before rebuild replaces them
    gm, params = rec.rebuild(_state_order(fn), inputs, out_leaves, placeholders, _input_names(fn, args, kwargs))
    nodes = gm.graph.find_nodes(op="placeholder")
    names = [paths[id(t)][1] if id(t) in paths else node.name for t, node in zip(params, nodes, strict=False)]
    bound = captures.binding(params, paths, constants) if kept is not None else None
    return Captured(gm, params, inputs, in_spec, out_spec, names, rec.outlined), kept, bound


def capture_exported(ep: torch.export.ExportedProgram) -> Captured:
    """Decompose `ep` to core ATen and bind its lifted values to the placeholders.

    `example_inputs` are the tensors of `ep.example_inputs` (empty if unknown).
    A program that mutates a buffer or an input raises `Unsupported`, and so
    does a failure of PyTorch's own re-tracing in `run_decompositions`.
    """
    try:
        ep = ep.run_decompositions(DECOMPOSITIONS)
    except Exception as e:  # e.g. a view whose strides changed under decomposition
        raise Unsupported(f"ExportedProgram.run_decompositions failed (capture the module instead): {e}") from e
    sig = ep.graph_signature
    for out in sig.output_specs:
        if out.kind != OutputKind.USER_OUTPUT:
            raise Unsupported(f"the exported program updates {out.target!r} in place ({out.kind.name})")
    gm = ep.graph_module
    inline_subgraphs(gm)  # nested compile regions the user marked
    specs = dict(zip(gm.graph.find_nodes(op="placeholder"), sig.input_specs, strict=True))
    params = [_lifted_value(ep, s) for s in specs.values() if s.kind != InputKind.USER_INPUT]
    names = [s.target or n.name for n, s in specs.items() if s.kind != InputKind.USER_INPUT]
    for node, spec in specs.items():
        if spec.kind == InputKind.USER_INPUT and not isinstance(node.meta.get("val"), torch.Tensor):
            gm.graph.erase_node(node)  # a specialised non-tensor input, unused
    _check_graph(gm, static=False)  # torch.export's Dims: symbolic sizes within their ranges
    out_spec = _tensor_outputs_only(gm, ep.call_spec.out_spec)
    _simplify(gm.graph)
    gm.recompile()
    example = ep.example_inputs or ((), {})
    inputs = [x for x in pytree.tree_leaves(example) if isinstance(x, torch.Tensor)]
    return Captured(gm, params, inputs, ep.call_spec.in_spec, out_spec, names)


def make_backend(compile_graph: Callable[[Captured, Options], Callable[..., Any]],
                 cache: bool = False) -> Callable[..., Any]:
    """A `torch.compile` backend that hands each graph AOTAutograd makes to `compile_graph`.

    Under no_grad that is one inference graph per Dynamo graph; with autograd, the forward and
    the backward graph of the partitioned joint graph (the forward also returns what backward
    saves), which AOTAutograd's runtime wraps in an autograd.Function. `Captured.graph` says
    which: "forward graph 0" (the Dynamo graphs a backend compiles are numbered from 0).
    `compile_graph` gets the backend's `Options` (torch.compile's `options=`; with
    fallback="eager" updates of inputs stay in the graph as `copy_` nodes). Every placeholder
    is a runtime argument (`params == []`). `compile_graph` runs on the graph's first call (a
    backward graph's: on the first backward), so `example_inputs` are that call's real
    arguments (ints where sizes are symbolic). Its result takes the arguments positionally and
    returns the graph's flat tensor outputs; outputs that are not tensors (a backward graph's
    None for an input that needs no gradient) are put back around them. With `cache` (and
    the disk cache on), AOTAutograd's results are kept across processes (aot_cache.py):
    `compile_graph` must then be picklable (a module-level function).
    """
    graphs = itertools.count()  # the Dynamo graphs this backend compiled: each one's number

    def backend(gm: fx.GraphModule, example_inputs: list[Any],
                options: dict[str, Any] | None = None) -> Callable[..., Any]:
        chosen = Options.of(options)
        index = next(graphs)
        # the inputs of AOTAutograd's forward graph are Dynamo's, in order (parameters and buffers included)
        inputs = [n.name for n in gm.graph.find_nodes(op="placeholder")]
        kept = cache and aot_cache.enabled(gm)
        frames.specialize_module_floats(gm)

        def compiler(kind: str) -> Callable[..., Any]:
            build = functools.partial(_graph_compiler, compile_graph, options=chosen, name=f"{kind} graph {index}",
                                      inputs=inputs)
            return aot_cache.compiler(build) if kept else lambda gm, _args: build(gm)

        with (garbage.compile_objects_only(), resizes.kept(),
              aot_cache.tagged(chosen) if kept else contextlib.nullcontext()):
            return aot_module_simplified(
                gm,
                example_inputs,
                fw_compiler=compiler("forward"),
                bw_compiler=compiler("backward"),
                inference_compiler=compiler("inference"),
                decompositions=DECOMPOSITIONS,
                # updates of inputs stay in the graph as copy_ nodes, to be written in place
                # by the eager fallback (state.py) rather than copied whole by AOTAutograd
                keep_inference_input_mutations=chosen.fallback == "eager",
            )

    return backend


def _graph_compiler(compile_graph: Callable[[Captured, Options], Callable[..., Any]], gm: fx.GraphModule,
                    options: Options, name: str, inputs: list[str]) -> Callable[..., Any]:
    """The boxed callable running one graph AOTAutograd made (`make_backend`), compiled on its
    first call."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    if not name.startswith("backward") and len(placeholders) == len(inputs):
        for node, user_name in zip(placeholders, inputs, strict=True):
            node.meta["user_input"] = user_name  # Dynamo's name, for explain(): l_self_buffers_running_mean_
    inline_subgraphs(gm)  # nested compile regions the user marked
    if options.fallback == "error":
        _check_graph(gm, static=False)
    _simplify(gm.graph)
    constants = _constant_outputs(gm)
    aliases = layouts.split_alias_outputs(gm)
    gm.recompile()
    compiled: Callable[..., Any] | None = None
    orders: list[tuple[int, ...] | None] | None = None

    def run(args: list[Any]) -> Any:
        nonlocal compiled, orders
        if compiled is None:
            orders = layouts.permute_inputs(gm, args)
            example = list(layouts.permuted(args, orders))
            out_spec = pytree.tree_flatten(tuple(gm.graph.output_node().args[0]))[1]
            in_spec = pytree.tree_flatten((tuple(example), {}))[1]
            compiled = _compile_or_nothing(compile_graph, Captured(gm, [], example, in_spec, out_spec, graph=name),
                                           options)
        outputs = compiled(*layouts.permuted(args, orders))
        if aliases is not None:
            outputs = aliases.rebuild(args, list(outputs))
        if not constants:
            return outputs
        outputs = list(outputs)
        for i, value in constants:
            outputs.insert(i, value)
        return outputs

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def _compile_or_nothing(compile_graph: Callable[[Captured, Options], Callable[..., Any]], captured: Captured,
                        options: Options) -> Callable[..., Any]:
    """`compile_graph(captured, options)`, unless the graph has no outputs left to compute (every
    one an input, a view of one or a constant)."""
    if not captured.gm.graph.output_node().args[0]:
        return lambda *args: []
    return compile_graph(captured, options)


def _constant_outputs(gm: fx.GraphModule) -> list[tuple[int, Any]]:
    """Remove the outputs of `gm` that are not nodes (None); return (position, value) of each."""
    output = gm.graph.output_node()
    outs = list(output.args[0])
    constants = [(i, o) for i, o in enumerate(outs) if not isinstance(o, fx.Node)]
    if constants:
        output.args = (tuple(o for o in outs if isinstance(o, fx.Node)),)
    return constants


def _trampoline(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The frame Dynamo compiles, so its cache entries are torchtosa's own to drop."""
    return fn(*args, **kwargs)


class _Recorder:
    """A Dynamo backend recording the AOT forward graph and one real call of it."""

    def __init__(self) -> None:
        empty = fx.Graph()
        empty.output(())
        self.gm = fx.GraphModule(torch.nn.Module(), empty)  # kept if Dynamo finds no graph
        self.args: list[Any] = []
        self.outputs: Sequence[Any] = ()
        self.outlined: dict[str, int] = {}

    def backend(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        """Run AOTAutograd and remember what the compiled graph returns."""
        try:
            inner = aot_module_simplified(
                gm, example_inputs, fw_compiler=self._fw_compiler, decompositions=DECOMPOSITIONS
            )
        except (TorchTosaError, dynamo_exc.RestartAnalysis):  # a restart: Dynamo traces again
            raise
        except Exception as e:
            raise Unsupported(f"AOTAutograd failed: {e}") from e

        def run(*args: Any) -> Any:
            self.outputs = inner(*args)
            return self.outputs

        return run

    def _fw_compiler(self, gm: fx.GraphModule, _fake_args: Sequence[Any]) -> Callable[..., Any]:
        _check_functional(TracingContext.get().fw_metadata, gm)
        self.outlined = inline_subgraphs(gm)  # each layer traced once (outline.py), now one flat graph
        _check_graph(gm, static=True)
        self.gm = gm

        def run(args: list[Any]) -> Any:
            self.args = list(args)
            return gm(*args)

        run._boxed_call = True  # type: ignore[attr-defined]
        return run

    def constant_ids(self) -> set[int]:
        """The ids of the tensors the recorded graph holds as attributes (made by the trace)."""
        return {id(v) for n, v in _bound_values(self.gm, self.args).items() if n.op == "get_attr"}

    def rebuild(
        self, state_order: dict[int, int], inputs: list[torch.Tensor], out_leaves: list[Any],
        state_names: dict[int, str], input_names: list[str],
    ) -> tuple[fx.GraphModule, list[torch.Tensor]]:
        """The recorded graph with placeholders (params, user inputs) and the user's output leaves;
        placeholders are named by `state_names` (by tensor identity) and `input_names`. The graph
        is changed in place (a copy node by node cost as much as the trace's own bookkeeping)."""
        old = self.gm
        graph = old.graph
        bound = _bound_values(old, self.args)
        user_ids = {id(x) for x in inputs}
        lifted = {id(v): v for v in bound.values() if id(v) not in user_ids}
        params = sorted(lifted.values(), key=lambda v: state_order.get(id(v), len(state_order)))
        fw_outs = graph.output_node().args[0]
        outputs = tuple(self._output_node(leaf, fw_outs, bound) for leaf in out_leaves)
        names = _unique([state_names.get(id(p), "") for p in params] + input_names)
        env = _bind_new_placeholders(graph, bound, params, inputs, names)
        graph.output_node().args = (tuple(env.get(node, node) for node in outputs),)
        _simplify(graph)
        return fx.GraphModule(torch.nn.Module(), graph), params

    def _output_node(self, leaf: Any, fw_outs: Sequence[fx.Node], bound: dict[fx.Node, Any]) -> fx.Node:
        """The recorded graph's node computing the user's output `leaf`."""
        for out, node in zip(self.outputs, fw_outs, strict=False):
            if out is leaf:
                return node
        for node, value in bound.items():
            if value is leaf:
                return node
        raise Unsupported("an output tensor is neither computed by the graph nor one of its inputs")


def _unique(names: list[str]) -> list[str]:
    """`names` with a suffix on each repeat (`block1-0` and `block1_0` both give `p_block1_0_w`);
    empty names stay empty."""
    seen: set[str] = set()
    out = []
    for name in names:
        unique, i = name, 0
        while unique and unique in seen:
            i += 1
            unique = f"{name}_{i}"
        seen.add(unique)
        out.append(unique)
    return out


def _bound_values(gm: fx.GraphModule, args: list[Any]) -> dict[fx.Node, Any]:
    """The real value behind each placeholder and tensor get_attr node of `gm`."""
    bound: dict[fx.Node, Any] = dict(zip(gm.graph.find_nodes(op="placeholder"), args, strict=True))
    for node in gm.graph.find_nodes(op="get_attr"):
        value = operator.attrgetter(node.target)(gm)
        if isinstance(value, torch.Tensor):
            bound[node] = value
    for node, value in bound.items():
        if not isinstance(value, torch.Tensor):
            raise Unsupported(f"graph input {node.name} is a {type(value).__name__}, not a tensor")
    return bound


def _bind_new_placeholders(
    graph: fx.Graph,
    bound: dict[fx.Node, Any],
    params: list[torch.Tensor],
    inputs: list[torch.Tensor],
    names: list[str],
) -> dict[fx.Node, fx.Node]:
    """Make the placeholders of `graph` one per param then per user input, in that order and
    called by `names` (where not empty), in place of the nodes of `bound`; returns each one's
    replacement."""
    nodes_of: dict[int, list[fx.Node]] = {}
    for node, value in bound.items():
        nodes_of.setdefault(id(value), []).append(node)
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes]) or FakeTensorMode()
    env: dict[fx.Node, fx.Node] = {}
    order: list[fx.Node] = []
    for i, (value, given) in enumerate(zip([*params, *inputs], names, strict=True)):
        olds = nodes_of.pop(id(value), [])
        # an unnamed value keeps its placeholder; a named one, a tensor the graph holds as an
        # attribute and an input it does not use get a new one
        kept = None if given else next((n for n in olds if n.op == "placeholder"), None)
        if kept is None:
            with graph.inserting_before(next(iter(graph.nodes))):
                kept = graph.placeholder(given or (olds[0].name if olds else f"arg{i}"))
            kept.meta.update(olds[0].meta if olds else {})
            if "val" not in kept.meta:
                kept.meta["val"] = fake_mode.from_tensor(value, static_shapes=True)
        order.append(kept)
        env.update(dict.fromkeys(olds, kept))
    for old, new in env.items():
        if old is not new:
            old.replace_all_uses_with(new)
            graph.erase_node(old)
    for node in reversed(order):  # each to the front in turn
        first = next(iter(graph.nodes))
        if first is not node:
            first.prepend(node)
    return env



def _state_order(fn: Callable[..., Any] | torch.nn.Module) -> dict[int, int]:
    """Position of each parameter then buffer of a module, by tensor identity."""
    if not isinstance(fn, torch.nn.Module):
        return {}
    return {id(t): i for i, t in enumerate([*fn.parameters(), *fn.buffers()])}


def _state_paths(fn: Callable[..., Any] | torch.nn.Module) -> dict[int, tuple[str, str]]:
    """The kind (`p_` parameter, `b_` buffer, as torch.export prefixes them) and module path
    (`0.weight`) of each tensor of a module's state, by tensor identity; the first name of one
    shared under several."""
    if not isinstance(fn, torch.nn.Module):
        return {}
    paths: dict[int, tuple[str, str]] = {}
    for kind, named in (("p_", fn.named_parameters()), ("b_", fn.named_buffers())):
        for name, t in named:
            paths.setdefault(id(t), (kind, name))
    return paths


def _input_names(fn: Callable[..., Any] | torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
    """A placeholder name for each tensor leaf of `(args, kwargs)`, in flattening order: the
    parameter of `fn` it is passed as (`x`, `input_ids`) and its place within it (`xs_0`)."""
    try:
        params = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn).parameters.values()
    except (TypeError, ValueError):  # no signature (a builtin)
        params = []
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p.name for p in params if p.kind in kinds]
    rest = next((p.name for p in params if p.kind is inspect.Parameter.VAR_POSITIONAL), "input")
    names = []
    for path, leaf in pytree.tree_flatten_with_path((tuple(args), kwargs))[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        group, top, *inner = (_key_text(k) for k in path)
        if group == "1":  # a keyword argument
            base = top
        elif int(top) < len(positional):
            base = positional[int(top)]
        else:
            base = f"{rest}_{int(top) - len(positional)}"
        names.append(re.sub(r"\W", "_", "_".join([base, *inner])))
    return names


def _key_text(key: Any) -> str:
    """The index, dict key or attribute name of one step of a pytree key path."""
    for attr in ("idx", "key", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def _lifted_value(ep: torch.export.ExportedProgram, spec: Any) -> torch.Tensor:
    """The tensor an exported program binds to a lifted (non-user) input."""
    if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and spec.target in ep.state_dict:
        value = ep.state_dict[spec.target]
    elif spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
        value = ep.constants[spec.target]
    else:
        raise Unsupported(f"exported program input {spec.arg.name} of kind {spec.kind.name}")
    if not isinstance(value, torch.Tensor):
        raise Unsupported(f"exported program input {spec.arg.name} is a {type(value).__name__}")
    return value


def _check_functional(meta: Any, gm: fx.GraphModule) -> None:
    """Reject graphs whose AOT metadata shows in-place updates of inputs or side effects."""
    mutated = [i for i, info in enumerate(meta.input_info) if info.mutates_data or info.mutates_metadata]
    if mutated:
        raise Unsupported(f"the function updates {len(mutated)} input/parameter/buffer tensor(s) in place")
    if meta.tokens:
        raise Unsupported("the function calls side-effectful operators")
    if len(gm.graph.output_node().args[0]) != meta.num_outputs + meta.num_intermediate_bases:
        raise Unsupported("unexpected AOTAutograd forward outputs")


def _check_graph(gm: fx.GraphModule, *, static: bool) -> None:
    """Reject higher-order operators and, if `static`, symbolic (data-dependent) shapes."""
    for node in gm.graph.nodes:
        if isinstance(node.target, HigherOrderOperator):
            raise Unsupported(f"higher-order operator {node.target.name()}{_where(node)}")
        if static and has_free_symbols(node.meta.get("val")):
            raise Unsupported(f"{node.target} has a data-dependent or symbolic shape{_where(node)}")


def _simplify(graph: fx.Graph) -> None:
    """Drop data-free assertion nodes, fold identity ops, drop the empty operands of cats and the
    constants nothing reads (a cat's empty operand was one: TOSA has no zero-size constant)."""
    for node in reversed(graph.nodes):
        if (node.target in _DATALESS or node.op == "get_attr") and not node.users:
            graph.erase_node(node)
        elif node.target in _IDENTITY:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target is torch.ops.aten.cat.default:
            _drop_empty_operands(node)
    graph.lint()


def _drop_empty_operands(cat: fx.Node) -> None:
    """Drop the operands of `cat` that add nothing (empty along its dim, or torch's legacy 1-D [0])
    where the others have the result's dtype: HF's DynamicCache starts each layer's keys and
    values as an empty tensor, and TOSA has no zero-size tensors to pass it as."""
    tensors, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    result = cat.meta.get("val")
    vals = [t.meta.get("val") if isinstance(t, fx.Node) else None for t in tensors]
    if not isinstance(result, torch.Tensor) or not all(isinstance(v, torch.Tensor) for v in vals):
        return
    d = dim % result.dim() if result.dim() else 0

    def empty(v: torch.Tensor) -> bool:
        return v.shape == (0,) or (v.dim() == result.dim() and v.shape[d] == 0)

    kept = [(t, v) for t, v in zip(tensors, vals, strict=True) if not empty(v)]
    if kept and len(kept) < len(tensors) and all(v.dtype == result.dtype for _, v in kept):
        cat.args = ([t for t, _ in kept], *cat.args[1:])


def _tensor_outputs_only(gm: fx.GraphModule, out_spec: pytree.TreeSpec) -> pytree.TreeSpec:
    """Move constant outputs (e.g. None) of `gm` into its out_spec; return the new spec."""
    output = gm.graph.output_node()
    outs = list(output.args[0])
    if all(isinstance(o, fx.Node) for o in outs):
        return out_spec
    tree = pytree.tree_unflatten([o if isinstance(o, fx.Node) else _Constant(o) for o in outs], out_spec)
    nodes, spec = pytree.tree_flatten(tree)
    output.args = (tuple(nodes),)
    return spec


def _wrap_constants(tree: Any) -> Any:
    """`tree` with each non-tensor leaf wrapped so that flattening keeps it in the spec."""
    return pytree.tree_map(lambda x: x if isinstance(x, torch.Tensor) else _Constant(x), tree,
                           is_leaf=lambda x: isinstance(x, torch.Size))  # a Size stays a Size


def _where(node: fx.Node) -> str:
    """' at file:line: code' for the innermost user frame of a node, or ''."""
    lines = (node.meta.get("stack_trace") or "").splitlines()
    for i in reversed(range(len(lines))):
        if m := re.match(r'\s*File "(.*)", line (\d+)', lines[i]):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f" at {m[1]}:{m[2]}: {code}"
    return ""


class _FastpathOff:
    """The process's MHA fast-path setting held off while any thread is inside
    `mha_fastpath_disabled`: the first to enter saves the user's setting, the last to leave
    restores it. (Each call saving and restoring it on its own, concurrent calls of a compiled
    function left it off for good: the second saved the first's False.)"""

    lock = threading.Lock()
    depth = 0
    saved = True


@contextlib.contextmanager
def mha_fastpath_disabled() -> Iterator[None]:
    """Keep nn.MultiheadAttention/TransformerEncoderLayer off their fused inference kernels."""
    with _FastpathOff.lock:
        if _FastpathOff.depth == 0:
            _FastpathOff.saved = torch.backends.mha.get_fastpath_enabled()
            torch.backends.mha.set_fastpath_enabled(False)
        _FastpathOff.depth += 1
    try:
        yield
    finally:
        with _FastpathOff.lock:
            _FastpathOff.depth -= 1
            if _FastpathOff.depth == 0:
                torch.backends.mha.set_fastpath_enabled(_FastpathOff.saved)


@contextlib.contextmanager
def translated_dynamo_errors() -> Iterator[None]:
    """Re-raise Dynamo's and AOTAutograd's exceptions as torchtosa errors."""
    try:
        yield
    except dynamo_exc.BackendCompilerFailed as e:
        if isinstance(e.inner_exception, TorchTosaError):
            raise e.inner_exception from None
        raise Unsupported(f"AOTAutograd failed: {e.inner_exception}") from e
    except dynamo_exc.TorchRuntimeError as e:
        raise InvalidInput(_dynamo_reason(e)) from e
    except dynamo_exc.TorchDynamoException as e:
        raise Unsupported(_dynamo_reason(e)) from e


def _dynamo_reason(e: Exception) -> str:
    """Dynamo's summary and explanation of `e`, then the innermost user source line."""
    reason = []
    for line in str(e).strip().splitlines():
        if line.strip().startswith(("Hint:", "Developer debug context:", "For more details", "from user code:")):
            break
        reason.append(line.rstrip())
    text = "\n".join(reason).strip()
    stack = getattr(e, "real_stack", None)
    if stack:
        frame = stack[-1]
        text += f"\n  at {frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return text
