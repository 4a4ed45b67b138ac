"""Captures kept on disk (torchtosa.capture.captures): a second compile of the same module for the
same inputs, in another process, takes the kept capture instead of tracing with TorchDynamo and
AOTAutograd, and computes what eager does; any change the trace assumed away (an attribute, a
global, a function's source, which function an attribute holds, the inputs' sizes) traces again."""

from __future__ import annotations

import importlib
import itertools
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import torchtosa
from torchtosa.api import CACHE
from torchtosa.capture import frames
from torchtosa.execute import disk_cache

SOURCE = '''
import torch
import torch.nn.functional as F
from torch import nn

SCALE = 2.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.act = F.gelu

    def forward(self, x):
        return self.act(self.norm(self.fc(x))) * SCALE


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x) + x
        return x
'''


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str], ModuleType]]:
    """Write a module of models to a folder on sys.path and import it (again, after each edit);
    the disk cache on, in a folder of its own."""
    monkeypatch.setenv(disk_cache.ENV_SWITCH, "1")
    monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(tmp_path))

    name = f"kept_models_{next(_MODULES)}"  # a module of its own: Dynamo caches the imports it makes

    def write(source: str) -> ModuleType:
        (tmp_path / f"{name}.py").write_text(source)
        importlib.invalidate_caches()
        if name in sys.modules:
            return importlib.reload(sys.modules[name])
        return importlib.import_module(name)

    yield write
    CACHE.clear()


_MODULES = itertools.count()


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the traces Dynamo makes (frames.trace calls)."""
    count: list[int] = []
    trace = frames.trace

    def counted(*args: Any, **kwargs: Any) -> Any:
        count.append(1)
        return trace(*args, **kwargs)

    monkeypatch.setattr(frames, "trace", counted)
    return count


def _compiled(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Compile and run as a new process would: nothing compiled in memory."""
    CACHE.clear()
    with torch.no_grad():
        return torchtosa.compile(model, x)(x)


def _eager(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def test_a_second_compile_takes_the_kept_capture(models: Callable[[str], ModuleType], traces: list[int],
                                                 tmp_path: Path) -> None:
    model, x = models(SOURCE).Block().eval(), torch.randn(4, 16)
    torch.testing.assert_close(_compiled(model, x), _eager(model, x), rtol=1e-5, atol=1e-5)
    assert len(traces) == 1 and len(list((tmp_path / "cache" / "captures").glob("*.pkl"))) == 1
    torch.testing.assert_close(_compiled(model, x), _eager(model, x), rtol=1e-5, atol=1e-5)
    assert len(traces) == 1
    with torch.no_grad():  # new weights: the kept capture binds the module's own tensors
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    torch.testing.assert_close(_compiled(model, x), _eager(model, x), rtol=1e-5, atol=1e-5)
    assert len(traces) == 1


def test_repeated_blocks_traced_once_are_kept(models: Callable[[str], ModuleType], traces: list[int]) -> None:
    """A capture that traced repeated blocks once (outline.py's nested regions: a subclass of the
    block's class, found by pickle under its own module while it exists) is kept and taken."""
    model, x = models(SOURCE).Stack().eval(), torch.randn(4, 16)
    assert type(model.blocks[0]) is torch.nn.Sequential  # the marks are gone after each compile
    for _ in range(2):
        torch.testing.assert_close(_compiled(model, x), _eager(model, x), rtol=1e-5, atol=1e-5)
        assert type(model.blocks[0]) is torch.nn.Sequential
    assert len(traces) == 1


def test_explain_says_what_the_cache_did(models: Callable[[str], ModuleType]) -> None:
    model, x = models(SOURCE).Block().eval(), torch.randn(4, 16)

    def note() -> str:
        CACHE.clear()
        with torch.no_grad():
            compiled = torchtosa.compile(model, x)
            compiled(x)
        return next(n for n in compiled.explain().notes if n.startswith("capture:"))

    assert note() == "capture: kept on disk"
    assert note() == "capture: taken from the disk cache (no trace)"
    model.norm.eps = 0.5
    changed = note()
    assert changed.startswith("capture: traced: the capture kept on disk no longer holds (guard failed: "), changed
    assert "eps" in changed and changed.endswith(", kept on disk"), changed


def _attribute(module: ModuleType, model: torch.nn.Module) -> torch.nn.Module:
    model.norm.eps = 0.5
    return model


def _function(module: ModuleType, model: torch.nn.Module) -> torch.nn.Module:
    model.act = torch.nn.functional.relu  # what the attribute is, not a value Dynamo can compare
    return model


def _global(module: ModuleType, model: torch.nn.Module) -> torch.nn.Module:
    module.SCALE = 3.0
    return model


@pytest.mark.parametrize("change", [_attribute, _function, _global])
def test_a_changed_object_traces_again(models: Callable[[str], ModuleType], traces: list[int],
                                       change: Callable[..., torch.nn.Module]) -> None:
    module = models(SOURCE)
    model, x = module.Block().eval(), torch.randn(4, 16)
    _compiled(model, x)
    model = change(module, model)
    torch.testing.assert_close(_compiled(model, x), _eager(model, x), rtol=1e-5, atol=1e-5)
    assert len(traces) == 2
    _compiled(model, x)  # the entry now is the changed model's
    assert len(traces) == 2


@pytest.mark.parametrize("edit", [("SCALE = 2.0", "SCALE = 0.5"), ("* SCALE", "+ SCALE")])
def test_a_changed_source_traces_again(models: Callable[[str], ModuleType], traces: list[int],
                                       edit: tuple[str, str]) -> None:
    x = torch.randn(4, 16)
    _compiled(models(SOURCE).Block().eval(), x)
    model = models(SOURCE.replace(*edit)).Block().eval()
    torch.testing.assert_close(_compiled(model, x), _eager(model, x), rtol=1e-5, atol=1e-5)
    assert len(traces) == 2


def test_a_module_imported_anew_keeps_no_facts_of_the_old_one(models: Callable[[str], ModuleType]) -> None:
    """Dynamo reads a module's globals through an import it caches: after the module is imported
    anew (a new object), a trace of its code would record the old module's values as its facts,
    and a later call matching those would take a graph of the new values. Such a trace is not kept."""
    module = models(SOURCE)
    x = torch.randn(4, 16)
    _compiled(module.Block().eval(), x)
    del sys.modules[module.__name__]
    fresh = importlib.import_module(module.__name__)
    fresh.SCALE = 3.0
    model = fresh.Block().eval()
    torch.testing.assert_close(_compiled(model, x), _eager(model, x), rtol=1e-5, atol=1e-5)
    fresh.SCALE = 2.0
    torch.testing.assert_close(_compiled(model, x), _eager(model, x), rtol=1e-5, atol=1e-5)


def test_a_damaged_entry_traces_again(models: Callable[[str], ModuleType], traces: list[int],
                                      tmp_path: Path) -> None:
    model, x = models(SOURCE).Block().eval(), torch.randn(4, 16)
    _compiled(model, x)
    (entry,) = (tmp_path / "cache" / "captures").glob("*.pkl")
    entry.write_bytes(entry.read_bytes()[:100])  # cut short, as by a full disk
    torch.testing.assert_close(_compiled(model, x), _eager(model, x), rtol=1e-5, atol=1e-5)
    assert len(traces) == 2 and entry.stat().st_size > 100  # traced again and kept whole
    _compiled(model, x)
    assert len(traces) == 2


def test_other_sizes_trace_again(models: Callable[[str], ModuleType], traces: list[int]) -> None:
    model = models(SOURCE).Block().eval()
    for rows in (4, 6, 4):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(_compiled(model, x), _eager(model, x), rtol=1e-5, atol=1e-5)
    assert len(traces) == 2


def test_a_tensor_the_function_closes_over_is_not_kept(models: Callable[[str], ModuleType],
                                                       tmp_path: Path) -> None:
    weight = torch.randn(16, 8)

    def project(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight)

    x = torch.randn(4, 16)
    torch.testing.assert_close(_compiled(project, x), project(x), rtol=1e-5, atol=1e-5)
    assert not list((tmp_path / "cache" / "captures").glob("*.pkl"))
    compiled = torchtosa.compile(project, x)
    assert "capture: not kept on disk (it assumed what another process can't check)" in compiled.explain().notes


SCRIPT = '''
import sys
import torch
import torchtosa
from torchtosa.capture import frames
import kept_models

traced = []
trace = frames.trace
frames.trace = lambda *a, **k: traced.append(1) or trace(*a, **k)
torch.manual_seed(0)
model, x = kept_models.Block().eval(), torch.randn(4, 16)
with torch.no_grad():
    got = torchtosa.compile(model, x)(x)
    print("traced", len(traced), "diff", float((got - model(x)).abs().max()))
'''


def test_a_second_process_does_not_trace(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    (tmp_path / "kept_models.py").write_text(SOURCE)
    (tmp_path / "run.py").write_text(textwrap.dedent(SCRIPT))
    env = dict(subprocess_env, TORCHTOSA_CACHE="1", TORCHTOSA_CACHE_DIR=str(tmp_path / "cache"))
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(tmp_path)
    outputs = [subprocess.run([sys.executable, str(tmp_path / "run.py")], capture_output=True, text=True, env=env,
                              check=True, cwd=tmp_path).stdout.split() for _ in range(2)]
    assert [out[1] for out in outputs] == ["1", "0"], outputs
    assert all(float(out[3]) < 1e-5 for out in outputs), outputs
