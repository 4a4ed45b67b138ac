"""The user-facing API: `to_tosa`, `compile`, and the `torchtosa` torch.compile backend."""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import has_free_symbols

from .capture import Captured, capture, capture_exported, make_backend
from .errors import InputMismatch, Unsupported
from .execute import NativeFunction, TensorSpec
from .importer import Program, import_graph
from .pipeline import check_opt

Signature = tuple[Any, ...]


def _signature(tensors: list[torch.Tensor]) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensors)


class _Cache:
    """Native code keyed by graph and input signature: compiling a model twice reuses it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.entries: dict[tuple[str, tuple[TensorSpec, ...], str], tuple[Program, NativeFunction]] = {}

    def get(self, gm: torch.fx.GraphModule, opt: str) -> tuple[Program, NativeFunction]:
        program = import_graph(gm)
        key = (str(program.module), tuple(program.inputs), opt)
        with self.lock:
            hit = self.entries.get(key)
        if hit is not None:
            return hit
        native = NativeFunction(program.module, program.inputs, program.outputs, opt=opt)
        with self.lock:
            return self.entries.setdefault(key, (program, native))

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()


CACHE = _Cache()


def to_tosa(fn: Callable | torch.nn.Module | torch.export.ExportedProgram, *args: Any, **kwargs: Any) -> Program:
    """The TOSA module of a function, module or ExportedProgram for these example inputs.

    `print(prog)` shows the MLIR; `prog.module` is the `mlir.ir.Module`.
    """
    return import_graph(_capture(fn, args, kwargs).gm)


def _capture(fn: Any, args: tuple, kwargs: dict) -> Captured:
    if isinstance(fn, torch.export.ExportedProgram):
        if args or kwargs:
            raise TypeError("an ExportedProgram carries its own example inputs; pass no arguments")
        return capture_exported(fn)
    return capture(fn, args, kwargs)


class CompiledFunction:
    """Native code for a function or module; recompiles when the input signature changes."""

    def __init__(self, fn: Callable | torch.nn.Module | torch.export.ExportedProgram, opt: str = "default"):
        self.fn = fn
        self.opt = check_opt(opt)
        self.lock = threading.Lock()
        self.compiled: dict[Signature, tuple[Captured, Program, NativeFunction]] = {}

    def prepare(self, *args: Any, **kwargs: Any) -> tuple[Captured, Program, NativeFunction]:
        """Capture and compile for these inputs (or reuse what was compiled for their signature)."""
        key = self._key(args, kwargs)
        with self.lock:
            hit = self.compiled.get(key)
        if hit is None:
            if not isinstance(self.fn, torch.export.ExportedProgram):
                _check_call(self.fn, args, kwargs)
            captured = _capture(self.fn, args, kwargs)
            program, native = CACHE.get(captured.gm, self.opt)
            hit = (captured, program, native)
            with self.lock:
                self.compiled[key] = hit
        return hit

    @property
    def program(self) -> Program:
        """The TOSA program of the most recent compilation."""
        if not self.compiled:
            raise InputMismatch("nothing compiled yet: call the function once")
        return next(reversed(self.compiled.values()))[1]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        captured, _, native = self.prepare(*args, **kwargs)
        flat = self._flat_tensors(args, kwargs, captured)
        outputs = native(*captured.params, *flat)
        return pytree.tree_unflatten(outputs, captured.out_spec)

    def _key(self, args: tuple, kwargs: dict) -> Signature:
        if isinstance(self.fn, torch.export.ExportedProgram):
            return ()  # one graph, its inputs' signature fixed at export time
        leaves, spec = pytree.tree_flatten((args, kwargs))
        # The same tensor passed twice is traced as one input: which leaf each tensor first
        # appeared as is part of the signature, so f(a, b) never reuses the graph of f(a, a).
        first: dict[int, int] = {}
        sig = tuple((tuple(x.shape), x.dtype, x.device.type, first.setdefault(id(x), i))
                    if isinstance(x, torch.Tensor) else (type(x), x) for i, x in enumerate(leaves))
        return (spec, sig)

    def _flat_tensors(self, args: tuple, kwargs: dict, captured: Captured) -> list[torch.Tensor]:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != captured.in_spec:
            raise InputMismatch(f"arguments are structured as {spec}, compiled for {captured.in_spec}")
        return [x for x in leaves if isinstance(x, torch.Tensor)]


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
            opt: str = "default", **kwargs: Any) -> CompiledFunction:
    """Compile to native code through TOSA. With example inputs, compiles now; else on the first call.

    `opt` picks the lowering (see `torchtosa.pipeline.OPT_LEVELS`): "default" tiles and vectorizes
    (one thread), "parallel" also splits large matmuls' column panels across one OpenMP thread per
    core (OMP_NUM_THREADS sets how many), "none" is the plain reference lowering to loops, kept for debugging.
    """
    compiled = CompiledFunction(fn, opt)
    if args or kwargs or isinstance(fn, torch.export.ExportedProgram):
        compiled.prepare(*args, **kwargs)
    return compiled


def _compile_graph(captured: Captured, opt: str) -> Callable[..., list[torch.Tensor]]:
    placeholders = [n.meta.get("val") for n in captured.gm.graph.find_nodes(op="placeholder")]
    if any(not isinstance(v, torch.Tensor) or has_free_symbols(v) for v in placeholders):
        return _Specializing(captured.gm, opt)  # torch.compile made sizes dynamic: compile per concrete shape
    _, native = CACHE.get(captured.gm, opt)
    return native


class _Specializing:
    """A graph with symbolic sizes, run as native code specialised to each call's concrete shapes.

    torch.compile passes such graphs after a shape change (automatic dynamic shapes) or with
    `dynamic=True`; the graph's int arguments are the sizes and are not passed to native code.
    """

    def __init__(self, gm: torch.fx.GraphModule, opt: str) -> None:
        self.gm = gm
        self.opt = opt
        self.natives: dict[tuple[Any, ...], NativeFunction] = {}

    def __call__(self, *args: Any) -> list[torch.Tensor]:
        key = tuple((tuple(a.shape), a.dtype, a.device.type) if isinstance(a, torch.Tensor) else a for a in args)
        native = self.natives.get(key)
        if native is None:
            native = self.natives.setdefault(key, CACHE.get(_static_graph(self.gm, args), self.opt)[1])
        return native(*[a for a in args if isinstance(a, torch.Tensor)])


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


torchtosa_backend = make_backend(_compile_graph)
torchtosa_backend.__doc__ = """The torch.compile backend: `torch.compile(model, backend="torchtosa")`.

Options: `torch.compile(model, backend="torchtosa", options={"opt": "parallel"})` picks the lowering
("default", "parallel" or "none"; see `torchtosa.compile`).
"""
