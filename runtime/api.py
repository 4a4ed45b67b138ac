"""The user-facing API: `to_tosa`, `compile`, and the `torchtosa` torch.compile backend."""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import has_free_symbols

from . import debug, garbage, progress
from .capture.freeze import fold_constants
from .capture.freeze import freeze as freeze_graph
from .capture.symbolic import evaluator, shape_env_of
from .capture.trace import (
    Captured,
    capture,
    capture_exported,
    make_backend,
    mha_fastpath_disabled,
    translated_dynamo_errors,
)
from .cpu import Cpu, runnable, select
from .delegate import Delegation, delegate
from .errors import InputMismatch, InternalError, NotConformant, NotInPlace, TorchTosaError, Unsupported
from .execute.native import NativeFunction
from .execute.state import WRITES
from .importer.graph import Program, import_graph
from .importer.target import Target
from .internal import blame, internal_error, is_internal
from .lower.channel_max import maxima_off_channels
from .lower.layout import optimize_layout
from .lower.linear_conv import linears_as_convolutions
from .lower.pad_conv import pads_into_convolutions
from .lower.patch_conv import patches_as_convolutions
from .options import MIN_REGION_OPS, Options
from .quant.passes.edges import integer_edges
from .quant.passes.patterns import rewrite_groups
from .quant.passes.uint8 import normalize_uint8
from .regions import Explanation, NativeRegion, all_eager, all_native, split, warn_fallbacks

Signature = tuple[Any, ...]


class GraphFunction:
    """Native code called with a graph's arguments: the tensors go to native code, the sizes
    (symbolic ints torch.compile passes) are read from the tensors' shapes instead. Graph
    outputs that are sizes are computed from the input shapes."""

    def __init__(self, native: NativeFunction, program: Program, count: int,
                 writes: dict[int, int] | None = None) -> None:
        self.native = native
        self.writes = writes or {}  # graph output -> placeholder it is written into (`state.native_writes`)
        self.arguments = None if program.arguments == list(range(count)) else program.arguments
        self.scalars = list(program.scalars)
        self.sizes = [(i, evaluator(e)) for i, e in program.sizes]

    @property
    def static(self) -> bool:
        """Static native code taking the graph's arguments as they are (`_FastCall`)."""
        return not (self.native.dynamic or self.sizes or self.scalars or self.arguments is not None)

    def __call__(self, *args: Any, known: int = 0) -> list[Any]:
        """The graph's outputs for `args`, the last `known` of which match the native code's
        inputs (a caller keyed them: `_FastCall`)."""
        tensors = args if self.arguments is None else [args[i] for i in self.arguments]
        if self.scalars:
            tensors = list(tensors)
            for i in self.scalars:
                tensors[i] = torch.tensor(tensors[i], dtype=torch.int64)
        results = self.native(*tensors, known=known if self.arguments is None and not self.scalars else 0)
        if self.sizes:
            values = self.native.size_values(tensors)
            for i, fn in self.sizes:
                results.insert(i, fn(values))
        return results


class _Cache:
    """Native code keyed by graph and input signature: compiling a model twice reuses it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[tuple[Any, ...], tuple[Program, GraphFunction]] = {}
        self.compiles = 0  # native functions built (a cache miss each)

    def get(self, gm: torch.fx.GraphModule, opt: str, cpu: Cpu) -> tuple[Program, GraphFunction]:
        """The program and native code of `gm`; torchtosa's own failure is an InternalError
        naming the op and step (`internal.py`)."""
        ops = sum(n.op == "call_function" for n in gm.graph.nodes)
        with progress.reporting(f"a graph of {ops} ops"):
            try:
                return self._get(gm, opt, cpu)
            except Exception as err:
                if not is_internal(err):
                    raise
                raise internal_error(err, gm) from err

    def _get(self, gm: torch.fx.GraphModule, opt: str, cpu: Cpu) -> tuple[Program, GraphFunction]:
        progress.stage("import to TOSA")
        try:
            program = import_graph(gm)
        except Exception as err:
            blame(err, stage="import to TOSA")
            raise
        written = _written(gm, program)
        key = (str(program.module), tuple(program.inputs), tuple(program.outputs), tuple(program.arguments),
               tuple(program.ranges.items()), tuple(program.scalars.items()), tuple(program.sizes),
               tuple(written.items()), opt, cpu.name)
        with self.lock:
            hit = self.entries.get(key)
        if hit is not None:
            return hit
        artifacts = debug.artifacts(program, opt, cpu)
        if artifacts is not None:
            artifacts.write("graph.py", gm.code)
            artifacts.write("tosa.mlir", str(program.module))
            artifacts.note(f"opt={opt!r}, cpu={cpu.describe()}")
            artifacts.note(f"inputs {debug.signature(program.inputs)}; outputs {debug.signature(program.outputs)}")
        def build(written: dict[int, int]) -> NativeFunction:
            return NativeFunction(program.module, program.inputs, program.outputs, opt=opt, ranges=program.ranges,
                                  scalars=program.scalars, cpu=cpu, artifacts=artifacts, written=written)

        try:
            native = build(written)
        except NotInPlace:  # returns the new values instead: the caller's copies write them
            native = build({})
        self.compiles += 1
        run = GraphFunction(native, program, len(gm.graph.find_nodes(op="placeholder")),
                            gm.meta.get(WRITES, {}) if native.written else {})
        with self.lock:
            return self.entries.setdefault(key, (program, run))

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()


CACHE = _Cache()


def _written(gm: torch.fx.GraphModule, program: Program) -> dict[int, int]:
    """The outputs of a region that its native function writes into one of its inputs
    (`state.native_writes`): native output position -> native input position."""
    sizes = sorted(i for i, _ in program.sizes)
    written = {}
    for output, placeholder in sorted(gm.meta.get(WRITES, {}).items()):
        argument = program.arguments.index(placeholder) if placeholder in program.arguments else None
        if output in sizes or argument is None or argument in program.scalars:
            raise ValueError(f"output {output} of the region can't be written into its input {placeholder}")
        written[output - sum(i < output for i in sizes)] = argument
    return written


def to_tosa(fn: Callable | torch.nn.Module | torch.export.ExportedProgram, *args: Any,
            target: str | Target | None = "auto", freeze: bool = False, npu: bool = False, partition: bool = False,
            **kwargs: Any) -> Program | Delegation:
    """The TOSA module of a function, module or ExportedProgram for these example inputs.

    `print(prog)` shows the MLIR; `prog.module` is the `mlir.ir.Module`. Strict: an op that
    can't be lowered raises `Unsupported` naming it (no eager fallback in one TOSA module).

    `target` ("TOSA-1.0+FP", "TOSA-1.0+FP+INT+bf16", "TOSA-1.1+FP+INT+int64", a `Target`): the
    module conforms to it (`tosa.target_env`, checked by MLIR's tosa-validate), or the error
    names the op that doesn't. "auto" picks the most conformant target that covers the model
    (`prog.target`), and falls back to torchtosa's native flavour of TOSA (target None: what
    `compile` lowers; bools as i8, int64, MLIR math ops) if none does. Shapes must be static.
    `freeze=True` makes parameters and buffers constants (named by their module path) so the
    module alone is the model; otherwise they are the function's leading arguments.

    A PT2E-quantized model (torchao's convert_pt2e) frozen for a target with the INT profile
    runs its dequantize -> op -> quantize groups in integer TOSA where their entries allow
    (`prog.groups`). For a target without FP ("TOSA-1.0+INT") its float input quantizes and
    output dequantizes are left to the caller: the program takes and returns the int8 values,
    and `prog.input_quantization` / `prog.output_quantization` say how they encode floats.

    For a target, the layout is decided for the whole graph (a CNN runs NHWC from its input's
    transpose to its end: `lower/layout.py`). `npu=True` shapes the TOSA for an NPU compiler such
    as Arm's Vela (which `torchtosa.vela.compile` and `torchtosa export --vela` ask for): integer
    linear layers (a matmul of a constant weight, plus its bias) become 1x1 CONV2Ds, whose weights
    Vela encodes and streams (`lower/linear_conv.py`), and explicit zero-point pads before integer
    convolutions the convolutions' own padding (`lower/pad_conv.py`). Either way the results are
    the same bits.

    `partition=True` (a target named) delegates what the target can run instead of failing on
    what it can't: a `Delegation` holds the TOSA program of the largest part the target runs,
    its inputs and outputs named by the boundary tensors, and the host graph that runs the rest
    around it with PyTorch; its `explain()` says what stays on the host and why (`delegate.py`).
    A quantized model's float edges (its input quantize, its output dequantize) are host ops then.
    """
    if partition and target in (None, "auto"):
        raise ValueError("to_tosa(partition=True) needs a target to partition for, e.g. target='TOSA-1.0+INT'")
    captured = _capture(fn, args, kwargs)
    gm = freeze_graph(captured) if freeze else captured.gm
    # node groups with a lowering of their own (quantized DQ -> op -> Q groups as integer
    # TOSA): their patterns need the frozen constants, before folding computes them away; a
    # target without the INT profile keeps the float path
    aim = None if target in (None, "auto") else Target.parse(target)
    groups = rewrite_groups(gm) if freeze and (aim is None or "INT" in aim.profiles) else []
    # a target without FP has no float tensors: a quantized model takes and returns its int8 values
    edges = integer_edges(gm) if aim is not None and "FP" not in aim.profiles and not partition else None
    if freeze or target is not None:
        fold_constants(gm)
    if partition:
        delegation = delegate(gm, aim)
        if npu:
            for_npu(delegation.program)
        delegation.program.groups = groups
        return delegation
    program = import_graph(gm, aim=aim) if target != "auto" else _most_conformant(gm)
    if npu:
        for_npu(program)
    program.groups = groups
    if edges is not None:
        program.input_quantization = [edges[0][i] for i in program.arguments]
        program.output_quantization = edges[1]
    return program


def for_npu(program: Program) -> None:
    """Rewrite `program` in place for an NPU compiler: its integer linear layers as 1x1
    convolutions, patch convolutions (kernel = stride) as ones of stride 1, the explicit pads of
    its integer convolutions as their padding, the layout decided again around them, then its
    integer maxima over channels taken over the axis before; validated again for its target."""
    module = program.module
    changed = pads_into_convolutions(module) + linears_as_convolutions(module) + patches_as_convolutions(module)
    if changed:
        optimize_layout(module)
    changed += maxima_off_channels(module)  # after the layout optimizer, which would cancel its transposes
    if changed and program.target is not None:
        program.target.validate(module)


def _most_conformant(gm: torch.fx.GraphModule) -> Program:
    """The module for the first target it conforms to, most restrictive first."""
    extensions = sorted({_EXTENSIONS[v.dtype] for n in gm.graph.nodes
                         for v in pytree.tree_leaves(n.meta.get("val"))
                         if isinstance(v, torch.Tensor) and v.dtype in _EXTENSIONS})
    for version, choices in (("1.0", ["FP", "INT", "FP+INT"]), ("1.1", ["FP+INT+int64"])):
        *narrower, widest = (Target.parse(f"TOSA-{version}+" + "+".join([c, *extensions])) for c in choices)
        try:
            program = import_graph(gm, aim=widest)  # validated for `widest`
        except Unsupported:
            continue
        for aim in narrower:  # the same module: only the profiles differ
            try:
                aim.validate(program.module)
            except NotConformant:
                continue
            program.target = aim
            return program
        widest.attach(program.module)  # a failed narrower validation attached its own target
        return program
    return import_graph(gm)


_EXTENSIONS = {torch.bfloat16: "bf16", torch.int16: "int16"}


@garbage.compile_objects_only()
def _capture(fn: Any, args: tuple, kwargs: dict, outline: bool = True) -> Captured:
    if isinstance(fn, torch.export.ExportedProgram):
        if args or kwargs:
            raise TypeError("an ExportedProgram carries its own example inputs; pass no arguments")
        captured = capture_exported(fn)
    else:
        captured = capture(fn, args, kwargs, outline=outline)
    normalize_uint8(captured.gm)  # uint8 Q/DQ pairs (X86InductorQuantizer) as the int8 pairs they equal
    return captured


@garbage.compile_objects_only()
def compile_graph(gm: torch.fx.GraphModule, options: Options, respecialize: bool = False,
                  graph: str = "") -> tuple[Callable[..., Any], Explanation]:
    """A callable running `gm` natively (with eager regions if `options.fallback == "eager"`),
    returning its flat outputs, and what runs where (labelled `graph`: "backward graph 0").
    Assumptions the lowering made about symbolic sizes (guards it added to the graph's
    ShapeEnv) are checked at every call: a call that breaks one raises InputMismatch, or, if
    `respecialize` (a torch.compile graph, whose guards Dynamo fixed before this lowering ran),
    is compiled for its concrete sizes."""
    shape_env = shape_env_of(n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder"))
    before = len(shape_env.guards) if shape_env is not None else 0
    sources = Guarded.sources_of(gm)  # before lowering: a guard may replace a symbol by its value
    cpu = runnable(select(options.cpu))
    if options.fallback == "error":
        program, runner = CACHE.get(gm, options.opt, cpu)
        explanation = all_native(gm, program).label(graph)
    else:
        try:
            runner, explanation = split(gm, lambda g: CACHE.get(g, options.opt, cpu), options.min_region_ops)
        except Exception as err:  # the partitioner's own failure: the graph runs eagerly as it is
            if not (is_internal(err) or isinstance(err, InternalError)):
                raise
            failure = err if isinstance(err, InternalError) else internal_error(err, gm, stage="partitioning")
            runner, explanation = gm, all_eager(gm, failure)
        warn_fallbacks(explanation.label(graph))
    explanation.cpu = cpu.describe()
    debug.write_graph(gm, explanation, options.opt, cpu, graph)
    if shape_env is not None and len(shape_env.guards) > before:
        otherwise = _Specializing(gm, options, graph=graph) if respecialize else None
        runner = Guarded(runner, [g.expr for g in shape_env.guards[before:]], sources, otherwise)
    return runner, explanation


class Guarded:
    """A compiled graph that checks, before each call, the guards its lowering added."""

    def __init__(self, run: Callable[..., Any], guards: list[Any], sources: dict[Any, tuple[int, int | None]],
                 otherwise: Callable[..., Any] | None = None) -> None:
        self.run, self.otherwise = run, otherwise
        self.sources = list(sources.items())
        # a guard on sizes no argument carries (Dynamo checks those) is not checked here
        self.guards = [(g, evaluator(g)) for g in guards if g.free_symbols <= set(sources)]

    @staticmethod
    def sources_of(gm: torch.fx.GraphModule) -> dict[Any, tuple[int, int | None]]:
        """Where each size symbol of `gm`'s placeholders is: (argument, dim, or None for an int)."""
        sources: dict[Any, tuple[int, int | None]] = {}
        for i, node in enumerate(gm.graph.find_nodes(op="placeholder")):
            val = node.meta.get("val")
            dims = list(enumerate(val.shape)) if isinstance(val, torch.Tensor) else [(None, val)]
            for d, size in dims:
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    sources.setdefault(size.node.expr, (i, d))
        return sources

    def __call__(self, *args: Any) -> Any:
        values = {sym: args[i] if d is None else args[i].shape[d] for sym, (i, d) in self.sources}
        for guard, check in self.guards:
            if not check(values):
                if self.otherwise is not None:
                    return self.otherwise(*args)
                raise InputMismatch(f"the input sizes {dict(values)} break the assumption {guard} the "
                                    "native code was compiled under; compile again for these sizes")
        return self.run(*args)


@dataclass
class _Captured:
    """One signature compiled from one whole-graph capture."""

    captured: Captured
    run: Callable[..., Any]
    explanation: Explanation


class _FastCall:
    """One compiled signature called without the general path: a static, wholly native graph
    whose arguments are tensors only, none passed twice, found by `_fast_key` (sizes, strides,
    dtype, device and layout: what `CompiledFunction._key` keys them by and the native code
    checks). So the native code checks the closed-over tensors only (a module's parameters,
    which may be reassigned). A call with grad mode on takes it where the general path would
    find no gradient to track (`takes`); a module's calls with grad mode on don't (its
    parameters that the graph does not read count there). A small function's call: 19 -> 10 us
    (docs/performance.md)."""

    def __init__(self, hit: _Captured, grad_checked: bool) -> None:
        self.run: GraphFunction = hit.run
        self.params = hit.captured.params
        self.spec = None if hit.captured.out_spec.is_leaf() else hit.captured.out_spec
        self.grad_checked = grad_checked  # with grad mode on, whether `takes` may answer

    @staticmethod
    def serves(hit: _Captured | _Eager | None, args: tuple) -> bool:
        """Whether a call of `hit` with `args` (no keyword arguments) can be made this way."""
        return (isinstance(hit, _Captured) and isinstance(hit.run, GraphFunction) and hit.run.static
                and all(isinstance(x, torch.Tensor) and x.layout is torch.strided for x in args)
                and len(set(map(id, args))) == len(args))

    def takes(self, args: tuple, no_grad: bool) -> bool:
        """Whether this call of the signature can be made this way: no argument passed twice and,
        with grad mode on, no gradient to track."""
        if len(set(map(id, args))) != len(args):
            return False
        if no_grad:
            return True
        return self.grad_checked and not any(x.requires_grad for x in args) \
            and not any(p.requires_grad for p in self.params)

    def __call__(self, args: tuple) -> Any:
        outputs = self.run(*self.params, *args, known=len(args))
        return outputs[0] if self.spec is None else pytree.tree_unflatten(list(outputs), self.spec)


def _fast_key(args: tuple) -> tuple | None:
    """The signature of strided tensor arguments for `CompiledFunction._fast`; None for others."""
    try:
        return tuple([(x.shape, x.stride(), x.dtype, x.is_cpu, x.layout, x.storage_offset()) for x in args])
    except (AttributeError, RuntimeError, TypeError):  # not a tensor, or a tensor without strides
        return None


@dataclass
class _Eager:
    """One signature run with PyTorch as it is (inputs native code can't take)."""

    explanation: Explanation


class CompiledFunction:
    """Native code for a function or module; recompiles when the input signature changes.

    A function TorchDynamo can't capture as one graph (graph breaks, in-place updates of its
    inputs, `.item()`, data-dependent shapes) runs with `fallback="eager"` as `torch.compile`
    runs it: each graph compiled, Python between them. A call with autograd (grad mode on and
    a parameter or input that requires grad) is compiled as torch.compile compiles it:
    AOTAutograd's forward and backward graphs, both native, in its autograd.Function."""

    def __init__(self, fn: Callable | torch.nn.Module | torch.export.ExportedProgram, opt: str = "default",
                 fallback: str = "eager", min_region_ops: int = MIN_REGION_OPS, dynamic: bool | None = None,
                 outline: bool = True, cpu: str | None = None):
        self.fn = fn
        self.options = Options(opt, fallback, min_region_ops, outline, cpu)
        self.dynamic = dynamic
        self.lock = threading.Lock()
        self.compiled: dict[Signature, _Captured | _Eager | None] = {}  # None: runs through self._dynamo
        self._fast: dict[tuple, _FastCall] = {}  # `_fast_key` -> a call made without `prepare` (`_FastCall`)
        self._dynamo: Callable[..., Any] | None = None
        self._dynamo_explanation = Explanation()
        self._autograd: Callable[..., Any] | None = None  # calls with autograd, through torch.compile
        self._autograd_explanation = Explanation()
        self._last_autograd = False  # whether the most recent compile was for autograd

    @property
    def opt(self) -> str:
        return self.options.opt

    def prepare(self, *args: Any, **kwargs: Any) -> _Captured | _Eager | None:
        """Capture and compile for these inputs (or reuse what was compiled for their signature),
        for calls without autograd (a call with autograd compiles through torch.compile when made).

        None when the function has graph breaks: then it compiles graph by graph on its first call."""
        key = self._key(args, kwargs)
        with self.lock:
            if key in self.compiled:
                return self.compiled[key]
        if not isinstance(self.fn, torch.export.ExportedProgram):
            try:
                _check_call(self.fn, args, kwargs)
            except InputMismatch as err:
                if self.options.fallback == "error" or "strided CPU tensors" not in str(err):
                    raise
                return self._eagerly(key, str(err))
        exported = isinstance(self.fn, torch.export.ExportedProgram)
        resized = self._resized(key) if not exported and self.dynamic is None else []
        if not exported and (self.dynamic or resized):
            self._through_dynamo("sizes vary: one compile with symbolic sizes serves them", warn=False,
                                 resized=resized)
            with self.lock:
                self.compiled[key] = None
            return None
        with progress.reporting(_label(self.fn)):  # capture included: it grows with depth too
            progress.stage("capture (TorchDynamo + AOTAutograd)")
            try:
                captured = _capture(self.fn, args, kwargs, self.options.outline)
            except Unsupported as err:
                if self.options.fallback == "error" or exported:
                    raise
                self._through_dynamo(f"not one graph ({str(err).splitlines()[0]}): compiled graph by graph, "
                                     "as torch.compile")
                hit = None
            else:
                hit = _Captured(captured, *compile_graph(captured.gm, self.options))
                if captured.origin:
                    hit.explanation.notes.append(f"capture: {captured.origin}")
        with self.lock:
            self.compiled[key] = hit
        return hit

    def _eagerly(self, key: Signature, reason: str) -> _Eager:
        """Inputs native code can't take (sparse, not on the CPU): the function runs with PyTorch."""
        hit = _Eager(Explanation(notes=[f"runs eagerly: {reason}"]))
        warn_fallbacks(hit.explanation)
        with self.lock:
            self.compiled[key] = hit
        return hit

    def _resized(self, key: Signature) -> list[tuple[int, int]]:
        """The (input leaf, dim) pairs whose size differs from a compiled signature that has
        the same structure as `key` (none if there is no such signature)."""
        structure = _structure(key)
        with self.lock:
            same = [k for k in self.compiled if _structure(k) == structure]
        if not same:
            return []
        entries, old = key[1], same[0][1]
        return [(i, d) for i, (new, was) in enumerate(zip(entries, old, strict=True)) if len(new) > 2
                for d, (a, b) in enumerate(zip(new[0], was[0], strict=True)) if a != b]

    def _through_dynamo(self, note: str, warn: bool = True, resized: list[tuple[int, int]] = ()) -> None:
        """Compile through torch.compile with this function's options from now on: graph by
        graph, with symbolic sizes if `dynamic`, or, if it is None, for the `resized` dims of the
        input leaves (then as torch.compile's automatic dynamic shapes). Sizes 0 and 1 follow
        Dynamo's rules: a graph with symbolic sizes serves sizes of at least 2."""
        if self._dynamo is not None:
            return
        self._dynamo_explanation.notes.append(note)
        if warn:
            warn_fallbacks(self._dynamo_explanation)
        backend = make_backend(functools.partial(_compile_captured, sink=self._dynamo_explanation.extend))
        compiled = torch.compile(self.fn, backend=functools.partial(backend, options=vars(self.options).copy()),
                                 dynamic=self.dynamic)
        pending = list(resized)

        def run(*args: Any, **kwargs: Any) -> Any:
            if pending:  # the first call compiles: these dims are symbolic
                leaves = pytree.tree_leaves((args, kwargs))
                for i, d in pending:
                    torch._dynamo.maybe_mark_dynamic(leaves[i], d)
                pending.clear()
            with torch.no_grad(), mha_fastpath_disabled(), translated_dynamo_errors():
                return compiled(*args, **kwargs)

        self._dynamo = run

    def _wants_grad(self, args: tuple, kwargs: dict) -> bool:
        """Whether a call builds an autograd graph in eager: grad mode on and a module parameter or
        a tensor argument that requires grad (an ExportedProgram is an inference graph)."""
        if not torch.is_grad_enabled() or isinstance(self.fn, torch.export.ExportedProgram):
            return False
        if isinstance(self.fn, torch.nn.Module) and any(p.requires_grad for p in self.fn.parameters()):
            return True
        if not kwargs and all(isinstance(x, torch.Tensor) for x in args):  # the common case, without pytree
            return any(x.requires_grad for x in args)
        return any(isinstance(x, torch.Tensor) and x.requires_grad for x in pytree.tree_leaves((args, kwargs)))

    def _with_autograd(self) -> Callable[..., Any]:
        """The function compiled for calls with autograd: torch.compile with the torchtosa backend
        and this function's options. AOTAutograd partitions the joint graph, the backend compiles
        its forward and (at the first backward) its backward graph natively, and AOTAutograd's
        runtime wraps them in an autograd.Function: gradients flow as in eager."""
        with self.lock:
            if self._autograd is None:
                self._autograd_explanation.notes.append(
                    "with autograd: AOTAutograd's forward graph, and its backward graph from the first backward")
                backend = make_backend(functools.partial(_compile_captured, sink=self._autograd_explanation.extend))
                self._autograd = torch.compile(
                    self.fn, backend=functools.partial(backend, options=vars(self.options).copy()),
                    dynamic=self.dynamic)
            return self._autograd

    def _call_with_autograd(self, args: tuple, kwargs: dict) -> Any:
        try:
            _check_call(self.fn, args, kwargs)
        except InputMismatch as err:
            if self.options.fallback == "error" or "strided CPU tensors" not in str(err):
                raise
            warn_fallbacks(Explanation(notes=[f"runs eagerly: {err}"]))
            return self.fn(*args, **kwargs)  # PyTorch runs it, autograd included
        run = self._with_autograd()
        self._last_autograd = True
        with mha_fastpath_disabled(), translated_dynamo_errors():
            return run(*args, **kwargs)

    def explain(self) -> Explanation:
        """What runs where for the most recent compilation: native regions and eager ops with reasons."""
        if self._last_autograd:
            return self._autograd_explanation
        if not self.compiled:
            raise InputMismatch("nothing compiled yet: call the function once")
        last = next(reversed(self.compiled.values()))
        return self._dynamo_explanation if last is None else last.explanation

    @property
    def program(self) -> Program:
        """The TOSA program of the most recent compilation, if it is one native region."""
        regions = [p for p in self.explain().parts if isinstance(p, NativeRegion)]
        if len(regions) != 1:
            raise TorchTosaError(f"the function runs as {len(regions)} native regions; see explain()")
        return regions[0].program

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fast and not kwargs:
            fast = self._fast.get(_fast_key(args))
            if fast is not None and fast.takes(args, not torch.is_grad_enabled()):
                self._last_autograd = False
                return fast(args)
        if self._wants_grad(args, kwargs):
            return self._call_with_autograd(args, kwargs)
        hit = self.prepare(*args, **kwargs)
        if (isinstance(hit, _Captured) and torch.is_grad_enabled() and not isinstance(self.fn, _STATEFUL)
                and any(p.requires_grad for p in hit.captured.params)):  # a closed-over tensor needs grad
            return self._call_with_autograd(args, kwargs)
        self._last_autograd = False
        if hit is None:
            assert self._dynamo is not None
            return self._dynamo(*args, **kwargs)
        if isinstance(hit, _Eager):
            return self.fn(*args, **kwargs)
        flat = self._flat_tensors(args, kwargs, hit.captured)
        if torch.is_grad_enabled():
            with torch.no_grad():
                outputs = hit.run(*hit.captured.params, *flat)
        else:
            outputs = hit.run(*hit.captured.params, *flat)
        if not kwargs and _FastCall.serves(hit, args):
            self._fast[_fast_key(args)] = _FastCall(hit, grad_checked=not isinstance(self.fn, _STATEFUL))
        if hit.captured.out_spec.is_leaf():  # one tensor
            return outputs[0]
        return pytree.tree_unflatten(list(outputs), hit.captured.out_spec)

    def _key(self, args: tuple, kwargs: dict) -> Signature:
        if isinstance(self.fn, torch.export.ExportedProgram):
            return ()  # one graph, its inputs' signature fixed at export time
        # The same tensor passed twice is traced as one input: which leaf each tensor first
        # appeared as is part of the signature, so f(a, b) never reuses the graph of f(a, a).
        # Strides and storage offset too: as_strided reads the storage beneath an input.
        first: dict[int, int] = {}
        if not kwargs and all(isinstance(x, torch.Tensor) for x in args):  # the common case, without pytree
            return ("tensors", tuple((x.shape, x.dtype, x.device.type, first.setdefault(id(x), i), *_layout(x))
                                     for i, x in enumerate(args)))
        leaves, spec = pytree.tree_flatten((args, kwargs))
        sig = tuple((tuple(x.shape), x.dtype, x.device.type, first.setdefault(id(x), i), *_layout(x))
                    if isinstance(x, torch.Tensor) else (type(x), x) for i, x in enumerate(leaves))
        return (spec, sig)

    def _flat_tensors(self, args: tuple, kwargs: dict, captured: Captured) -> list[torch.Tensor] | tuple:
        if not kwargs and all(isinstance(x, torch.Tensor) for x in args):
            return args  # prepare() keyed these by count, so the spec is the compiled one
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != captured.in_spec:
            raise InputMismatch(f"arguments are structured as {spec}, compiled for {captured.in_spec}")
        return [x for x in leaves if isinstance(x, torch.Tensor)]


# callables whose own parameters `_wants_grad` checks (a module), or that are inference graphs
_STATEFUL = (torch.nn.Module, torch.export.ExportedProgram)


def _label(fn: Any) -> str:
    """What a progress line calls the compiled function or module."""
    if isinstance(fn, torch.nn.Module):
        return type(fn).__name__
    return getattr(fn, "__name__", None) or type(fn).__name__


def _structure(key: Signature) -> Signature:
    """A signature without its sizes: what a compile with symbolic sizes can serve."""
    if not key:
        return key
    kind, entries = key
    return kind, tuple((len(e[0]), *e[1:4]) if len(e) > 2 else e for e in entries)


def _layout(x: torch.Tensor) -> tuple[Any, ...]:
    """Strides and storage offset of a strided tensor (as_strided reads the storage beneath an
    input), the layout of another."""
    return (x.stride(), x.storage_offset()) if x.layout is torch.strided else (x.layout,)


def _check_call(fn: Callable | torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """InputMismatch for calls Python or the native code would reject: arity, non-CPU tensors."""
    target = fn.forward if isinstance(fn, torch.nn.Module) else fn
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):  # a builtin or C function: let tracing tell
        signature = None
    if signature is not None:
        try:
            signature.bind(*args, **kwargs)
        except TypeError as err:
            raise InputMismatch(f"{getattr(target, '__qualname__', target)}: {err}") from None
    tensors = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    for i, x in enumerate(tensors):
        if x.device.type != "cpu" or x.layout is not torch.strided:
            raise InputMismatch(f"tensor input {i} is on {x.device} with layout {x.layout}; "
                                "torchtosa runs strided CPU tensors")


def compile(fn: Callable | torch.nn.Module | torch.export.ExportedProgram, *args: Any,
            opt: str = "default", fallback: str = "eager", min_region_ops: int = MIN_REGION_OPS,
            dynamic: bool | None = None, outline: bool = True, cpu: str | None = None,
            **kwargs: Any) -> CompiledFunction:
    """Compile to native code through TOSA. With example inputs, compiles now; else on the first call.

    A call with autograd (grad mode on and a parameter or tensor input that requires grad, as in
    training) returns outputs that require grad, as eager does: it runs through torch.compile with
    the torchtosa backend, AOTAutograd's forward graph compiled at the first such call and its
    backward graph at the first backward, both native. Example inputs compile the graph of calls
    without autograd (under `torch.no_grad()` or `torch.inference_mode()`).

    `dynamic` chooses what a new input size costs, as in torch.compile: None (the default)
    compiles the first signature for its exact sizes and, once a call's sizes differ, once more
    with symbolic sizes for the dims that changed, serving every size after it; True compiles
    with symbolic sizes from the first call; False compiles each signature for its sizes.
    Sizes 0 and 1 follow TorchDynamo's rules (a symbolic size is at least 2; a call with a
    size of 1 there compiles a graph of its own).

    `opt` picks the lowering (see `torchtosa.lower.pipeline.OPT_LEVELS`): "default" tiles and vectorizes
    (one thread), "parallel" also splits every large op (matmuls, convolutions, reductions,
    elementwise ops) across one OpenMP thread per core (OMP_NUM_THREADS, read when compiling, sets
    how many), "none" is the plain reference lowering to loops, kept for debugging.
    `fallback="eager"` runs ops TOSA can't lower with PyTorch between native regions of at least
    `min_region_ops` ops (and a function with graph breaks graph by graph), and so a region
    torchtosa itself fails to compile (a bug it warns about); `fallback="error"` raises
    `Unsupported`, or `InternalError` for torchtosa's own failure, instead. `explain()` on the
    result says what runs where.
    `outline=True` traces a module's repeated layers (the blocks of a transformer: children of
    one ModuleList with the same type and state shapes) once each, so capture time stays nearly
    flat in depth; False traces every layer (the fallback whenever TorchDynamo refuses that).
    `cpu` names the entry of the CPU table (opdefs/cpus.yaml) whose schedule and instructions the
    code uses: by default $TORCHTOSA_CPU, else this machine's (`torchtosa.cpu.host()`); another
    entry must be one this machine runs ("x86-64-v3" on an AVX-512 host: what an AVX2 host gets).
    """
    compiled = CompiledFunction(fn, opt, fallback, min_region_ops, dynamic, outline, cpu)
    if args or kwargs or isinstance(fn, torch.export.ExportedProgram):
        compiled.prepare(*args, **kwargs)
    return compiled


def explain(fn: Callable | torch.nn.Module | torch.export.ExportedProgram, *args: Any, **kwargs: Any) -> Explanation:
    """What `torchtosa.compile(fn)` runs where for these inputs, in a call without autograd (after
    a call with autograd, `CompiledFunction.explain()` shows its forward and backward graphs). A
    function with graph breaks is called once (with its side effects) so that torch.compile sees
    its graphs."""
    compiled = CompiledFunction(fn)
    if compiled.prepare(*args, **kwargs) is None:
        compiled(*args, **kwargs)
    return compiled.explain()


def _compile_captured(captured: Captured, options: Options,
                      sink: Callable[[Explanation], None] | None = None) -> Callable[..., Any]:
    """Compile a torch.compile graph once, symbolic sizes included (they stay `?` in the TOSA
    and are read from the tensors at run time). With fallback="error", a graph some op of which
    can't take a symbolic size is compiled per concrete shape instead (and says so)."""
    try:
        run, explanation = compile_graph(captured.gm, options, respecialize=True, graph=captured.graph)
    except Unsupported as err:
        if options.fallback != "error" or not _symbolic(captured.gm):
            raise
        note = f"sizes specialised per call: {str(err).splitlines()[0]}"
        if sink is not None:
            sink(Explanation(notes=[note]))
        return _Specializing(captured.gm, options, sink, captured.graph)
    if sink is not None:
        sink(explanation)
    return run


def _symbolic(gm: torch.fx.GraphModule) -> bool:
    """Whether a graph has symbolic sizes (torch.compile's dynamic shapes)."""
    placeholders = [n.meta.get("val") for n in gm.graph.find_nodes(op="placeholder")]
    return any(not isinstance(v, torch.Tensor) or has_free_symbols(v) for v in placeholders)


class _Specializing:
    """A graph with symbolic sizes, run as native code specialised to each call's concrete shapes.

    torch.compile passes such graphs after a shape change (automatic dynamic shapes) or with
    `dynamic=True`; the graph's int arguments are the sizes and are not passed to native code.
    """

    def __init__(self, gm: torch.fx.GraphModule, options: Options,
                 sink: Callable[[Explanation], None] | None = None, graph: str = "") -> None:
        self.gm = gm
        self.options = options
        self.sink = sink
        self.graph = graph
        self.natives: dict[tuple[Any, ...], Callable[..., Any]] = {}

    def __call__(self, *args: Any) -> list[torch.Tensor]:
        key = tuple((tuple(a.shape), a.dtype, a.device.type, a.stride(), a.storage_offset())
                    if isinstance(a, torch.Tensor) else a for a in args)
        run = self.natives.get(key)
        if run is None:
            static = _static_graph(self.gm, args)
            compiled, explanation = compile_graph(static, self.options, graph=self.graph)
            if self.sink is not None:
                self.sink(explanation)
            run = self.natives.setdefault(key, compiled)
        return run(*[a for a in args if isinstance(a, torch.Tensor)])


def _static_graph(gm: torch.fx.GraphModule, args: tuple[Any, ...]) -> torch.fx.GraphModule:
    """`gm` retraced for these concrete arguments: static shapes, only tensor placeholders."""
    with fx_traceback.preserve_node_meta():  # keep each node's user stack trace for messages
        static = make_fx(torch.fx.Interpreter(gm).run, tracing_mode="fake")(*args)
    for node in static.graph.find_nodes(op="placeholder"):
        if not isinstance(node.meta.get("val"), torch.Tensor):
            if node.users:
                raise Unsupported(f"graph input {node.name} ({type(node.meta.get('val')).__name__}) "
                                  "is used as a value; only static-shape tensor programs are supported")
            static.graph.erase_node(node)
    static.recompile()
    return static


torchtosa_backend = make_backend(_compile_captured, cache=True)
torchtosa_backend.__doc__ = """The torch.compile backend: `torch.compile(model, backend="torchtosa")`.

Options: `torch.compile(model, backend="torchtosa", options={"opt": "parallel", "fallback": "error"})`
picks the lowering ("default", "parallel" or "none") and what happens to ops TOSA can't lower
("eager", the default, or "error"); also "min_region_ops" and "cpu". See `torchtosa.compile`.
"""
