"""TorchDynamo's trace of one frame, and the guards that say when a later call may reuse it.

`trace` is what `torch.compile(fullgraph=True)` does on a first call, taken apart as torch's
ahead-of-time compile does it (`convert_frame.fullgraph_capture`): Dynamo traces the frame,
`backend` compiles its graph, and the frame's rewritten bytecode runs with the result. Asked to,
it also keeps what the trace assumed (`Guards`), so that another process can tell whether the
trace holds for its call without tracing:

- Dynamo's guards, serialized (tensor metadata, module attributes, grad mode...). Loaded in
  another process, a guard compares with the value its state kept: a copy of the traced frame's
  locals (the module and its attributes as they were), but a global module as it is *now*;
- so each guard on a global, and each guard Dynamo can't serialize (on what an object *is*: a
  module attribute holding F.gelu, a global class), is kept as a fact of our own: the place
  Dynamo read it from and what it found there, in words another process can compare: a
  constant's value, a length, an object's lasting name (a module's or class's qualified name, a
  function's name and bytecode);
- the source lines of every function traced, by checksum (a function made by `exec`, such as a
  dataclass's `__init__`, by its bytecode, found on its class: one a guard named or one in the
  namespace of a traced function's module).

A trace that assumed something none of these can name keeps no guards: it can't be reused.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import importlib
import inspect
import pickle
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._dynamo import convert_frame
from torch._dynamo import guards as dynamo_guards
from torch._dynamo.eval_frame import set_enable_dynamic
from torch._dynamo.exc import TensorifyScalarRestartAnalysis
from torch._dynamo.guards import SKIP_GUARD, CheckFunctionManager, GuardBuilder, GuardCheckSpec, _get_closure_vars
from torch._dynamo.hooks import Hooks
from torch._dynamo.output_graph import get_builtins_dict
from torch._dynamo.package import load_guard_manager
from torch._dynamo.symbolic_convert import TensorifyState
from torch._dynamo.utils import dynamo_timed, get_metrics_context
from torch._guards import TracingContext, tracing

__all__ = ["Guards", "specialize_module_floats", "trace"]

Backend = Callable[[torch.fx.GraphModule, list[Any]], Callable[..., Any]]
_RESTARTS = 8  # traces of a frame whose graph asks for floats to be specialized (Dynamo allows 100)
_UNSERIALIZABLE = frozenset(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)
# guards on what an object is: a fact names it (`_identity`); Dynamo's own check compares ids
_IDENTITIES = frozenset({"ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH", "CLOSURE_MATCH",
                         "BUILTIN_MATCH"})

Fact = tuple[str, Any]  # ("type" | "is", a lasting name), or (a guard type, its check's metadata)


@dataclass(frozen=True)
class Guards:
    """What a trace of the function `code` assumed: Dynamo's serializable guards (`state`,
    pickled) and the module each global name they use stands for (`imports`); (place, `Fact`)
    for each guard on a global or on an identity (`facts`); (module, first line, line after the
    last, sha256) of the source of each function traced; (class, attribute, bytecode hash) of
    each traced function made by exec."""

    code: str
    state: bytes
    imports: tuple[tuple[str, str], ...]
    facts: tuple[tuple[Any, Fact], ...]
    sources: tuple[tuple[str, int, int, str], ...]
    generated: tuple[tuple[str, str, str], ...]

    def check(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        """None if the trace holds for a call of `fn` (the traced function), else why not."""
        frame_locals = _locals(fn, args, kwargs)
        if _qualified(fn) != self.code:
            return f"another function ({_qualified(fn)}, not {self.code})"
        for module, first, end, checksum in self.sources:
            try:
                if _checksum(importlib.import_module(module), first, end) != checksum:
                    return f"the source of {module} changed (lines {first}-{end - 1})"
            except (ImportError, OSError, TypeError):
                return f"the source of {module} can't be read"
        scope = dict(fn.__globals__)
        try:
            for owner, attr, digest in self.generated:
                if _code_hash(_unwrapped(getattr(_named(owner), attr)).__code__) != digest:
                    return f"{owner}.{attr} changed"
            with get_metrics_context(), dynamo_timed("torchtosa_load_guards"):
                state = pickle.loads(self.state)  # torchtosa's own cache
                if why := self.check_facts(frame_locals, state.output_graph, scope):
                    return why
                manager = load_guard_manager(state, fn.__code__, scope)
        except Exception as err:  # a module gone, a class renamed, a place no longer there
            return f"its guards don't load ({type(err).__name__}: {err})"
        if manager.check(frame_locals):
            return None
        return "guard failed: " + "; ".join(manager.check_verbose(frame_locals).verbose_code_parts)

    def check_facts(self, frame_locals: dict[str, Any], graph: Any, scope: dict[str, Any]) -> str | None:
        """None if every fact holds, else why not. `scope` (the traced function's globals) gets
        the modules the guards' global names stand for, imported now, and what Dynamo put there
        (`graph`: its OutputGraph's state)."""
        scope.update((alias, importlib.import_module(name)) for alias, name in self.imports)
        if name := graph.name_of_builtins_dict_key_in_fglobals:
            scope[name] = get_builtins_dict(scope)
        for name, value in graph.global_scope.items():
            scope.setdefault(name, value)
        for source, fact in self.facts:
            if not _holds(fact, source.get_value({"L": frame_locals, "G": scope}, _get_closure_vars(), {})):
                return f"{source.name} no longer passes {fact[0]} {fact[1]!r}"
        return None


def trace(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], backend: Backend,
          guards: bool = False) -> tuple[Callable[..., Any], Guards | None]:
    """Trace `fn(*args, **kwargs)` as one graph with static sizes, compile the graph with
    `backend`; the frame's rewritten code (call it as `fn`) and, if `guards`, what the trace
    assumed (None if it can't all be kept). Dynamo's own errors propagate."""
    facts: list[tuple[Any, Fact | None]] = []

    def serializable(entries: Sequence[Any]) -> list[bool]:
        """Dynamo's guard filter: keep what serializes; make facts of the rest and of globals."""
        keep = [g.guard_type not in _UNSERIALIZABLE and not _UNSERIALIZABLE.intersection(g.derived_guard_types)
                for g in entries]
        for g, kept in zip(entries, keep, strict=True):
            if not kept or g.is_global:
                facts.append((g.orig_guard.originating_source, _fact(g) if g.has_value else None))
        return keep

    with get_metrics_context(), dynamo_timed("torchtosa_capture"), set_enable_dynamic(False), _unprofiled_guards():
        try:
            found = _captured(fn, args, kwargs, backend)
        finally:
            TensorifyState.clear()  # the floats a restart specialized: for this frame only
        if found is None:  # no graph: the frame computes nothing with tensors
            return fn, None
        captured, frame, compiled = found
        output = captured.graph_capture_output
        kept = None
        if guards:
            try:
                check = output.build_guards(frame.__code__, hooks=Hooks(guard_filter_fn=serializable), save=True,
                                            strict_error=True)
                kept = _kept(fn, output, check, facts)
                # Dynamo reads a module's globals through an import it caches: a module imported
                # again since (a new object) has the facts of the old one
                if kept is not None and kept.check_facts(_locals(fn, args, kwargs), output.output_graph,
                                                         dict(fn.__globals__)):
                    kept = None
            except Exception:  # a guard that can't be serialized (PackageError, a local class...)
                kept = None
        run = output.get_runtime_env().forward_callable(captured.backend_input.backend_id, compiled,
                                                        extra_globals=frame.__globals__)
    return run, kept


@contextlib.contextmanager
def _unprofiled_guards() -> Iterator[None]:
    """Dynamo without its measure of a new set of guards' latency, which flushes the CPU's
    caches first: ~22 ms of every capture on a 2-core Zen 4 host (a third of a linear layer's),
    for a number that only goes to Dynamo's metrics and debug log."""
    profile = dynamo_guards.profile_guard_manager
    dynamo_guards.profile_guard_manager = lambda *args: 0.0
    try:
        yield
    finally:
        dynamo_guards.profile_guard_manager = profile


def specialize_module_floats(gm: torch.fx.GraphModule) -> None:
    """Have Dynamo trace again with the floats of nn.Modules as constants (raise
    TensorifyScalarRestartAnalysis) when AOTAutograd would ask for a restart anyway.

    With dynamic=True, Dynamo makes each float it reads a graph input (a float64 scalar read by
    `.item()`), a module's `eps` or `scaling` too. AOTAutograd's tensorify pass turns into tensor
    math what it can, and asks for another trace with the rest as constants, after Dynamo and
    AOTAutograd traced the whole graph: on HF Llama (an SDPA `scale`, which Dynamo already had
    to guard on) a second of a two-second trace, and in a second process a lookup of
    AOTAutograd's cache that never hits. A float Dynamo already specialized (a guard made it a
    constant) is such a restart, known before AOTAutograd runs; it then specializes the floats
    of nn.Modules as well: a model's constants, folded into the native code, a changed one
    (Dynamo guards their values) compiling again. Floats the user passes stay inputs."""
    restart, names = False, []
    for node in gm.graph.find_nodes(op="placeholder"):
        memo = getattr(node.meta.get("example_value"), "item_memo", None)
        arg = node.meta.get("grapharg")
        if not isinstance(memo, torch.SymFloat) or arg is None:
            continue
        symbol = memo.node._expr
        fixed = memo.node.shape_env.replacements.get(symbol)
        if fixed is not None and fixed.is_number:
            restart = True
        elif not (arg.source.guard_source.is_unspecialized_nn_module()
                  or arg.source.guard_source.is_specialized_nn_module()):
            continue
        if not TensorifyState.should_specialize(symbol.name):
            names.append(symbol.name)
    if restart and names:
        for name in names:
            TensorifyState.specialize(name)
        raise TensorifyScalarRestartAnalysis


def _captured(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              backend: Backend) -> tuple[Any, types.FunctionType, Callable[..., Any]] | None:
    """Dynamo's capture of `fn`'s frame (convert_frame.CaptureOutput), the frame traced and
    `backend`'s compile of its graph (None if there is no graph). A compile can ask Dynamo to
    trace again with some floats as constants (TensorifyScalarRestartAnalysis), as
    torch.compile's loop does."""
    for _ in range(_RESTARTS):
        # Dynamo installs globals of its own (modules by alias, constants) in the frame's
        # globals: a copy of them, dropped with the trace
        frame = types.FunctionType(fn.__code__, dict(fn.__globals__), fn.__name__, fn.__defaults__, fn.__closure__)
        frame.__qualname__, frame.__kwdefaults__ = fn.__qualname__, fn.__kwdefaults__
        captured = convert_frame.fullgraph_capture(frame, args, kwargs)
        given = captured.backend_input
        if given is None:
            return None
        context = TracingContext(given.fake_mode)
        context.tensor_to_context = given.tensor_to_context
        try:
            with tracing(context):
                return captured, frame, backend(given.graph_module, given.example_inputs)
        except TensorifyScalarRestartAnalysis:  # TensorifyState holds the floats to specialize
            continue
    raise AssertionError(f"Dynamo restarted its trace {_RESTARTS} times")


def _kept(fn: Callable[..., Any], output: Any, check: Any, facts: list[tuple[Any, Fact | None]]) -> Guards | None:
    """The `Guards` of a trace, or None if one of its assumptions can't be named."""
    if check.guards_state is None or any(fact is None for _, fact in facts):
        return None
    codes = list(dict.fromkeys(output.traced_code))  # a repeated layer's code is there each time
    modules = {inspect.getmodule(code) for code in codes} - {None}
    # an identity's name is "<kind> module:qualname ...": the classes among them
    classes = [cls for _, (kind, name) in facts
               if kind in ("type", "is") and isinstance(cls := _named(name.split(" ")[1]), type)]
    classes += [value for module in modules for value in vars(module).values() if isinstance(value, type)]
    sources, generated = set(), set()
    for code in codes:
        if (found := _source(code)) is not None:
            sources.add(found)
        elif (owner := _owner(code, classes)) is not None:
            generated.add(owner)
        else:
            return None
    kept = tuple({(source.name, fact[0], repr(fact[1])): (source, fact) for source, fact in facts}.values())
    try:
        pickle.dumps(kept)
    except Exception:  # a place Dynamo describes with something that doesn't pickle
        return None
    return Guards(_qualified(fn), check.guards_state, tuple(sorted(output.output_graph.import_sources.items())),
                  kept, tuple(sorted(sources)), tuple(sorted(generated)))


def _locals(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The locals of `fn`'s frame when called with `args` and `kwargs`, before it runs."""
    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def _source(code: types.CodeType) -> tuple[str, int, int, str] | None:
    """(module, first line, line after the last, sha256) of `code`'s source, or None if it has
    none to check (made by exec, or its file changed since it was imported)."""
    module = inspect.getmodule(code)
    try:
        lines, first = inspect.getsourcelines(code)
    except (OSError, TypeError):
        return None
    if module is None or first < 1:
        return None
    end = first + len(lines)
    checksum = hashlib.sha256("".join(lines).encode()).hexdigest()
    return (module.__name__, first, end, checksum) if _checksum(module, first, end) == checksum else None


def _owner(code: types.CodeType, classes: list[type]) -> tuple[str, str, str] | None:
    """("module:Class", attribute, bytecode hash) of the method of one of `classes` (or of a
    base) whose code is `code` (a dataclass's generated __init__, maybe under a decorator), or None."""
    for cls in classes:
        for klass in cls.__mro__:
            for attr, value in vars(klass).items():
                if getattr(_unwrapped(value), "__code__", None) is code and _named(_qualified(klass)) is klass:
                    return _qualified(klass), attr, _code_hash(code)
    return None


def _fact(guard: Any) -> Fact | None:
    """What a guard (a GuardFilterEntry) found, so that another process can check it: the
    lasting name of the type or object an identity guard compared (`_identity`), else the
    metadata of Dynamo's own check of the guard (GuardCheckSpec: the constant, the length, the
    keys, the attribute...), if it pickles; None if neither can be kept."""
    kind, value = guard.guard_type, guard.value
    if kind != "TYPE_MATCH" and _IDENTITIES.intersection(guard.derived_guard_types):
        kind = "ID_MATCH"  # a constant compared by id (a code object)
    if kind in ("TYPE_MATCH", *_IDENTITIES):
        name = _identity(type(value) if kind == "TYPE_MATCH" else value)
        return None if name is None else ("type" if kind == "TYPE_MATCH" else "is", name)
    if kind == "NN_MODULE":  # a module instance, by id: nothing to name it by
        return None
    spec = getattr(getattr(GuardBuilder, kind, None), "guard_check_spec", None)
    if spec is SKIP_GUARD:  # global state (grad mode...): the loaded guards compare with the trace's
        return ("skip", None)
    if not isinstance(spec, GuardCheckSpec):
        return None
    try:
        metadata = spec.get_metadata_fn(guard.orig_guard, value)
        pickle.dumps(metadata)
    except Exception:
        return None
    return kind, metadata


def _holds(fact: Fact, value: Any) -> bool:
    """Whether `value`, found where the fact's guard looked, passes it."""
    kind, metadata = fact
    if kind == "skip":
        return True
    if kind in ("type", "is"):
        return _identity(type(value) if kind == "type" else value) == metadata
    return bool(getattr(GuardBuilder, kind).guard_check_spec.eval_fn(value, metadata))


def _identity(value: Any) -> str | None:
    """A name for `value` that another process gives the same object, or None."""
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    if isinstance(value, types.CodeType):
        return f"code {_code_hash(value)}"
    if isinstance(value, enum.Enum):
        return f"enum {_qualified(type(value))}.{value.name}"
    if isinstance(value, types.FunctionType):
        return f"function {_qualified(value)} {_code_hash(value.__code__)}"
    if isinstance(value, (type, types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                          types.ClassMethodDescriptorType)):
        name = _qualified(value)
        return f"{type(value).__name__} {name}" if name is not None else None
    return None


def _qualified(obj: Any) -> str | None:
    """"module:qualname" of a function, class or builtin, or None."""
    module = getattr(obj, "__module__", None)
    if module is None and isinstance(getattr(obj, "__self__", None), types.ModuleType):
        module = obj.__self__.__name__
    if module is None and isinstance(obj, (types.MethodDescriptorType, types.WrapperDescriptorType)):
        module = _qualified(obj.__objclass__)
    qualname = getattr(obj, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else None


def _named(name: str | None) -> Any:
    """The object a "module:qualname" names in this process, or None."""
    module, _, qualname = (name or "").partition(":")
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError, ValueError):
        return None
    return found


def _unwrapped(value: Any) -> Any:
    """A function under its decorators (functools.wraps' `__wrapped__`)."""
    try:
        return inspect.unwrap(value)
    except ValueError:  # a cycle
        return value


def _code_hash(code: types.CodeType) -> str:
    """A digest of what `code` does: its bytecode, names and constants (nested code included)."""
    h = hashlib.sha256()
    for part in (code.co_code, code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars,
                 code.co_qualname):
        h.update(repr(part).encode())
    for const in code.co_consts:
        h.update((_code_hash(const) if isinstance(const, types.CodeType) else repr(const)).encode())
    return h.hexdigest()


def _checksum(module: types.ModuleType, first: int, end: int) -> str:
    """The sha256 of lines `first` up to `end` (excluded) of `module`'s source file."""
    lines, _ = inspect.getsourcelines(module)
    return hashlib.sha256("".join(lines[first - 1:end - 1]).encode()).hexdigest()
