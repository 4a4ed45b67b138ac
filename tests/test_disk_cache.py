"""The disk cache: a compile whose module is in the cache loads the library kept there instead
of lowering and compiling again (what a second process does; here the in-memory cache is
cleared in between); the key tells compiles apart; a damaged entry is compiled again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_library import run

import torchtosa
from torchtosa.api import CACHE
from torchtosa.execute import disk_cache, toolchain
from torchtosa.lower import partition, schedule


def _compile_all(model: torch.nn.Module, x: torch.Tensor) -> tuple[list[bool], list[torch.Tensor]]:
    """Compile at opt "default" and "parallel" as a new process would (no in-memory cache): whether
    each native function came from the disk cache, and the results."""
    CACHE.clear()
    results = []
    with torch.no_grad():
        for opt in ("default", "parallel"):
            results.append(torchtosa.compile(model, x, opt=opt)(x))
    cached = [run.native.cached for _, run in CACHE.entries.values()]
    CACHE.clear()
    return cached, results


def test_a_large_module_compiles_in_parts_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LLVM compiles parts of a large module at once (here every module counts as large,
    and a function is cut every few ops): the parts link into one library, for the cache and for
    export_library, that computes what eager does."""
    monkeypatch.setenv(disk_cache.ENV_SWITCH, "1")
    monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path / "cache"))
    monkeypatch.setenv(toolchain.ENV_JOBS, "3")
    monkeypatch.setattr(toolchain, "PART_LINES", 1)
    monkeypatch.setattr(partition, "PART_OPS", 4)
    for threshold in ("PARALLEL_MIN_MACS", "SPLIT_MIN_MACS", "SPLIT_MIN_ELEMENTS"):  # OpenMP regions in each part
        monkeypatch.setattr(schedule, threshold, 0)
    objects: list[int] = []
    machine_code = toolchain.machine_code
    monkeypatch.setattr(toolchain, "machine_code", lambda *a, **k: objects.append(len(out := machine_code(*a, **k)))
                        or out)
    layers = [torch.nn.Linear(32, 32) if i % 2 == 0 else torch.nn.Tanh() for i in range(12)]
    model, x = torch.nn.Sequential(*layers).eval(), torch.randn(4, 32)
    with torch.no_grad():
        want = model(x)
        CACHE.clear()
        for opt in ("default", "parallel"):  # OpenMP's unnamed globals, shared by the parts
            torch.testing.assert_close(torchtosa.compile(model, x, opt=opt)(x), want, rtol=1e-5, atol=1e-5)
        library = torchtosa.export_library(model, x, path=tmp_path / "libparts.so")
    assert objects == [3, 3, 3]
    torch.testing.assert_close(run(library, x)[0], want, rtol=1e-5, atol=1e-5)
    CACHE.clear()


def test_a_compile_in_the_cache_loads_the_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(disk_cache.ENV_SWITCH, "1")
    monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128),
                                torch.nn.Linear(128, 10)).eval()
    x = torch.randn(8, 64)
    with torch.no_grad():
        want = model(x)
    first, results = _compile_all(model, x)
    second, again = _compile_all(model, x)
    assert first == [False, False] and second == [True, True]  # each opt level its own entry
    for got in (*results, *again):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(list(tmp_path.glob("*.so"))) == len(list(tmp_path.glob("*.json"))) == 2
    assert all(json.loads(p.read_text())["scratch"] for p in tmp_path.glob("*.json"))  # the arena each call needs
    for library in tmp_path.glob("*.so"):
        library.unlink()
    rebuilt, results = _compile_all(model, x)
    assert rebuilt == [False, False]
    for got in results:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_off_means_the_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(disk_cache.ENV_SWITCH, "0")
    monkeypatch.delenv("TORCHTOSA_CPU", raising=False)  # the host's entry: the JIT's (another is llc's)
    assert disk_cache.folder() is None
    x = torch.randn(4, 8)
    CACHE.clear()
    torch.testing.assert_close(torchtosa.compile(torch.tanh, x)(x), torch.tanh(x))
    assert [run.native.cached for _, run in CACHE.entries.values()] == [False]
    assert all(hasattr(run.native, "_engine") for _, run in CACHE.entries.values())


def test_the_body_is_compiled_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packed wrapper holds the body, inlined from the C-interface wrapper, which is internal
    and so gone: public, it was a second copy of the body (twice opt's and llc's time)."""
    monkeypatch.setenv(disk_cache.ENV_SWITCH, "1")
    monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 10)).eval()
    x = torch.randn(8, 64)
    CACHE.clear()
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(model, x)(x), model(x), rtol=1e-5, atol=1e-5)
    CACHE.clear()
    (library,) = tmp_path.glob("*.so")
    sizes = {}
    for line in toolchain.run([toolchain.llvm_tool("llvm-nm"), "-S", "--defined-only", str(library)]).splitlines():
        fields = line.split()
        if len(fields) == 4:
            sizes[fields[3]] = int(fields[1], 16)
    assert "_mlir_ciface_forward" not in sizes and sizes["torchtosa_packed_forward"] > 1000, sizes


def test_the_folder_keeps_to_its_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store removes the entries used least recently until the folder fits in
    TORCHTOSA_CACHE_SIZE; a load marks its entry used."""
    monkeypatch.setenv(disk_cache.ENV_SWITCH, "1")
    monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path))
    x = torch.randn(4, 8)
    functions = [torch.tanh, torch.sigmoid, torch.exp]
    with torch.no_grad():
        CACHE.clear()
        torchtosa.compile(functions[0], x)(x)
        entry = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
        monkeypatch.setenv(disk_cache.ENV_SIZE, str(int(2.5 * entry)))  # room for two such entries
        for fn in functions[1:]:
            CACHE.clear()
            torch.testing.assert_close(torchtosa.compile(fn, x)(x), fn(x))
        CACHE.clear()
        torchtosa.compile(functions[2], x)(x)  # the newest, loaded: used now
        assert [run.native.cached for _, run in CACHE.entries.values()] == [True]
    assert sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file()) <= 2.5 * entry
    assert len(list(tmp_path.glob("*.so"))) == len(list(tmp_path.glob("*.json"))) == 2
    CACHE.clear()
    with torch.no_grad():
        torchtosa.compile(functions[0], x)(x)  # the oldest was removed
    assert [run.native.cached for _, run in CACHE.entries.values()] == [False]
    CACHE.clear()


def test_a_size_that_is_not_one_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(disk_cache.ENV_SIZE, "lots")
    with pytest.raises(ValueError, match="TORCHTOSA_CACHE_SIZE='lots'"):
        disk_cache.limit()
    for text, size in (("500M", 500 << 20), ("4G", 4 << 30), ("1.5k", 1536), ("123", 123)):
        monkeypatch.setenv(disk_cache.ENV_SIZE, text)
        assert disk_cache.limit() == size
