"""Shared test setup: every test starts from the same random seed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


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
