"""The progress line of a compile that takes longer than progress.DELAY seconds."""

from __future__ import annotations

import pytest
import torch

import torchtosa
from torchtosa import api, progress


def _compile(monkeypatch: pytest.MonkeyPatch, delay: float) -> None:
    monkeypatch.setattr(progress, "DELAY", delay)
    api.CACHE.clear()
    fn = torchtosa.compile(lambda x: torch.tanh(x) * 2 + 1, torch.randn(3, 5))
    x = torch.randn(3, 5)
    torch.testing.assert_close(fn(x), torch.tanh(x) * 2 + 1)


def test_a_slow_compile_reports_its_stages(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    _compile(monkeypatch, 0.0)  # every compile counts as slow
    lines = capsys.readouterr().err.splitlines()
    stages = [line.split(": ")[2].rsplit(" (", 1)[0] for line in lines if line.startswith("torchtosa: compiling")]
    assert "capture (TorchDynamo + AOTAutograd)" in stages and "bufferize" in stages
    assert stages[-1] == "LLVM code generation"
    assert lines[-1].startswith("torchtosa: compiled <lambda> in ")  # capture included


def test_a_quick_compile_is_silent(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    _compile(monkeypatch, 600.0)
    assert "torchtosa:" not in capsys.readouterr().err


def test_progress_can_be_turned_off(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("TORCHTOSA_PROGRESS", "0")
    _compile(monkeypatch, 0.0)
    assert "torchtosa:" not in capsys.readouterr().err
