"""Shared test setup: every test starts from the same random seed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tests compile in memory (the JIT) unless they ask for the disk cache (tests/test_disk_cache.py);
# subprocesses inherit it.
os.environ.setdefault("TORCHTOSA_CACHE", "0")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """os.environ with PYTHONPATH made absolute, for subprocesses run in another directory."""
    env = dict(os.environ)
    paths = [str(Path(p).resolve()) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


# Eager's kernels can be limited to an ISA (PyTorch, oneDNN, MKL), as an AVX2 host runs them.
_ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "asimd", "asimddp", "sve")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say which CPU the suite ran on: what a result means depends on it."""
    from torchtosa import cpu

    flags = " ".join(f for f in _FLAGS if f in cpu.host_flags())
    selected = cpu.select()
    limits = " ".join(f"{k}={os.environ[k]}" for k in _ISA_LIMITS if k in os.environ)
    terminalreporter.write_sep("-", "CPU")
    terminalreporter.write_line(f"host: {cpu.host_model()} [{flags}]")
    terminalreporter.write_line(f"native code for: {selected.describe()}")
    if limits:
        terminalreporter.write_line(f"eager limited to: {limits}")
