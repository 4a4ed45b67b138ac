"""Captures kept on disk, so that a second process skips TorchDynamo and AOTAutograd.

Capturing a module (trace.capture) costs most of what a second process still pays once its
compiled code comes from the disk cache (execute/disk_cache.py): Dynamo traces the Python,
AOTAutograd the aten graph. An entry here keeps a capture's result: the aten graph (torch.fx's
GraphPickler), where each lifted tensor comes from (a module path: the live tensor is bound on
load, so the weights are the module's own; or the value of a tensor the trace itself made), the
pytree specs of inputs and outputs, and what the trace assumed (frames.Guards: Dynamo's guards,
the identity of the objects it read, the source of every function it traced).

The key is what is known before tracing: torchtosa's fingerprint (its sources, torch's and
LLVM's versions), the function's qualified name, the structure of the arguments and each
tensor's dtype, sizes, strides and device. An entry is used only if its guards hold for the
call, which a trace would have checked; otherwise the call is traced and the entry replaced.
A trace whose assumptions can't all be kept (a tensor it closes over, code without source)
makes no entry. Entries live in the disk cache's folder, under `captures/`, written atomically,
within its size (disk_cache.prune).
"""

from __future__ import annotations

import hashlib
import pickle
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._graph_pickler import GraphPickler, Options
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from ..execute import disk_cache
from .frames import Guards

__all__ = ["bind", "binding", "key", "load", "store"]

FORMAT = 1  # the layout of an entry


def key(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], outline: bool) -> str | None:
    """The key of capturing `fn(*args, **kwargs)`, or None where the cache is off."""
    if disk_cache.folder() is None:
        return None
    leaves, spec = pytree.tree_flatten((args, kwargs))
    kind = type(fn) if isinstance(fn, torch.nn.Module) else fn
    name = (getattr(kind, "__module__", None), getattr(kind, "__qualname__", None))
    h = hashlib.sha256()
    for part in (disk_cache.fingerprint(), FORMAT, name, outline, torch.is_grad_enabled(), spec,
                 *map(_describe, leaves)):
        h.update(repr(part).encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def _describe(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return (type(leaf).__name__, leaf.dtype, tuple(leaf.shape), leaf.stride(), leaf.device, leaf.layout,
                leaf.requires_grad)
    return (type(leaf).__qualname__, leaf)


def _path(entry_key: str) -> Path:
    root = disk_cache.folder()
    assert root is not None
    return root / "captures" / f"{entry_key}.pkl"


def binding(params: list[torch.Tensor], state: dict[int, tuple[str, str]],
            constants: set[int]) -> list[tuple[str, Any]] | None:
    """Where each of a capture's lifted tensors comes from: its kind and path in the module's
    `state` (by id), or ("value", a copy) for one of the `constants` the trace made; None if one
    is neither (a tensor the function closes over: its value may differ next time)."""
    found: list[tuple[str, Any]] = []
    for tensor in params:
        if id(tensor) in state:
            found.append(state[id(tensor)])
        elif id(tensor) in constants:
            found.append(("value", tensor.detach().clone()))
        else:
            return None
    return found


def store(entry_key: str, captured: Any, guards: Guards, bound: list[tuple[str, Any]]) -> bool:
    """Keep `captured` (a trace.Captured) under `entry_key`, its lifted tensors `bound` as
    `binding` found them; False if the entry can't be written."""
    try:
        entry = pickle.dumps({
            "graph": GraphPickler.dumps(captured.gm, Options(ops_filter=None)), "binding": bound,
            "in_spec": captured.in_spec, "out_spec": captured.out_spec, "names": captured.param_names,
            "outlined": captured.outlined, "guards": guards,
        })
        disk_cache.write(_path(entry_key), entry)
    except Exception:  # a graph or spec that doesn't pickle, a read-only or full disk
        return False
    disk_cache.prune(_path(entry_key).parent.parent)
    return True


def load(entry_key: str) -> dict[str, Any] | None:
    """The entry under `entry_key` (graph, binding, in_spec, out_spec, names, outlined, guards),
    or None if there is none (or it is damaged, or names a class that is gone). Its guards are
    not checked here: that is the caller's part."""
    path = _path(entry_key)
    try:
        with warnings.catch_warnings():  # pytree's own deprecations, raised by unpickling its specs
            warnings.simplefilter("ignore", FutureWarning)
            entry = pickle.loads(path.read_bytes())  # torchtosa's own cache
    except Exception:
        return None
    disk_cache.used(path)
    return entry if isinstance(entry, dict) and entry.keys() >= _FIELDS else None


_FIELDS = {"graph", "binding", "in_spec", "out_spec", "names", "outlined", "guards"}


def bind(entry: dict[str, Any], module: Any) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """The graph of `entry` and the tensors its lifted placeholders take: `module`'s own where
    they are its state, else the values kept."""
    graph = GraphPickler.loads(entry["graph"], FakeTensorMode(shape_env=ShapeEnv()))
    return graph, [value if kind == "value" else _state_tensor(module, kind, value) for kind, value in entry["binding"]]


def _state_tensor(module: Any, kind: str, path: str) -> torch.Tensor:
    return module.get_parameter(path) if kind == "p_" else module.get_buffer(path)
