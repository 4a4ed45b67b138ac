"""opt="parallel" splits every op with enough work across threads (`schedule.thread_split`):
convolutions, batch matmuls, reductions and elementwise ops, each an scf.forall of one chunk per
thread (an OpenMP region once lowered), the register tiles inside each chunk; small ops stay on
the calling thread. Results match eager."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_schedule import _linalg
from test_schedule import _ops as op_names
from torch import nn

import torchtosa
from torchtosa.execute.native import _prepare
from torchtosa.lower import schedule
from torchtosa.lower.pipeline import lower


class _Bmm(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.bmm(a, b)


class _Attention(nn.Module):
    """softmax(q k^T / 8) v over 8 heads: batch contractions around a row reduction."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.softmax(q @ k.transpose(-1, -2) / 8.0, dim=-1) @ v


def _cases() -> dict[str, tuple[Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]]:
    """Each kind of op at a size above the split threshold."""
    return {
        "conv": (nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU()).eval(), (torch.randn(1, 16, 32, 32),)),
        "pool": (nn.MaxPool2d(2).eval(), (torch.randn(1, 32, 64, 64),)),
        "depthwise": (nn.Conv2d(32, 32, 3, padding=1, groups=32).eval(), (torch.randn(1, 32, 48, 48),)),
        "bmm": (_Bmm(), (torch.randn(8, 64, 96), torch.randn(8, 96, 64))),
        "attention": (_Attention(), tuple(torch.randn(2, 8, 64, 64) for _ in range(3))),
        "softmax": (lambda x: torch.softmax(x, dim=-1), (torch.randn(256, 512),)),
        "layer_norm": (nn.LayerNorm(512).eval(), (torch.randn(4, 64, 512),)),
        "elementwise": (lambda x, y: torch.tanh(x) * y + 1.0, (torch.randn(256, 512), torch.randn(256, 512))),
        "sum": (lambda x: x.sum(dim=-1), (torch.randn(512, 256),)),
    }


def _lowered(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...], stop_before: str) -> list[str]:
    """The names of the ops of `fn`'s module lowered with opt="parallel" up to `stop_before`."""
    return op_names(_linalg(fn, *args, opt="parallel", stop_before=stop_before))


# the op of each case that runs on threads (a convolution's filter is HWCF where the CPU entry's
# L2 cannot hold its FHWC panels, as x86-64-v3's 256 KiB)
_SPLIT_OPS = {"conv": {"linalg.conv_2d_nhwc_fhwc", "linalg.conv_2d_nhwc_hwcf"}, "pool": {"linalg.pooling_nhwc_max"},
              "bmm": {"linalg.batch_matmul"},
              "depthwise": {"linalg.depthwise_conv_2d_nhwc_hwc", "linalg.depthwise_conv_2d_nhwc_hwcm"}}


def _split_ops(fn: Callable[..., torch.Tensor], args: tuple[torch.Tensor, ...],
               monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the ops the schedule runs on threads: split by `thread_split` or
    `_window_split`, or in a packed contraction's parallel panel loop."""
    found: set[str] = set()
    script = schedule._script

    def recording(groups: dict, *rest: Any) -> str:
        for key, ops in groups.items():
            found.update(op.name for op in ops if key[-1] or op.parent.name == "scf.forall")
        return script(groups, *rest)

    monkeypatch.setattr(schedule, "_script", recording)
    _lowered(fn, args, "bufferize")
    monkeypatch.setattr(schedule, "_script", script)
    return found


@pytest.mark.parametrize("name", list(_cases()))
def test_large_ops_run_on_threads(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    fn, args = _cases()[name]
    split = _split_ops(fn, args, monkeypatch)
    assert _SPLIT_OPS.get(name, {"linalg.generic"}) & split, split
    assert "scf.forall" in _lowered(fn, args, "bufferize")
    assert {"omp.parallel", "omp.wsloop"} <= set(_lowered(fn, args, "llvm"))
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(fn, *args, opt="parallel")(*args), fn(*args),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["conv", "pool", "depthwise", "bmm", "softmax", "elementwise"])
def test_small_ops_stay_on_the_calling_thread(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    fn, args = _cases()[name]
    small = tuple(a[..., :8, :8] for a in args)  # far below the split thresholds
    assert "omp.parallel" not in _lowered(fn, small, "llvm")
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(fn, *small, opt="parallel")(*small), fn(*small),
                                   rtol=1e-5, atol=1e-5)


def test_one_thread_splits_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    fn, args = _cases()["elementwise"]
    assert "scf.forall" not in _lowered(fn, args, "bufferize")


def test_threads_follow_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3,2")  # nested levels: the first is the outer region's
    assert schedule.threads() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert schedule.threads() >= 1


def test_split_loop_divides_into_whole_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """For 3 threads, an elementwise op over [6, 24576] splits its rows; over [5, 24576] its
    columns, in chunks of whole vector tiles; over [5, 26000] (tiles of 52) nothing divides into 3
    equal chunks of whole tiles, so it stays on the calling thread."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    for shape, split in (((6, 24576), (0, 2)), ((5, 24576), (1, 8192)), ((5, 26000), ())):
        program = torchtosa.to_tosa(lambda x: torch.exp(x) * 2.0, torch.randn(shape), target=None)
        module = _prepare(program.module, "forward", tuple(program.inputs), tuple(program.outputs))
        lower(module, "parallel", stop_before="schedule")
        found = [schedule.thread_split(op, tiling, schedule.threads()) for op, tiling in schedule.plans(module)]
        assert found == [split], (shape, found)


def test_models_on_threads_match_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bench's conv block (convolutions, batch norm, pooling) and a transformer encoder layer
    (linears, attention's batch contractions, softmax, layer norms), every large op of them on
    threads."""
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    conv = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 32, 3, padding=1, groups=4), nn.ReLU()).eval()
    with torch.no_grad():
        conv[1].running_mean.uniform_(-0.5, 0.5)
        conv[1].running_var.uniform_(0.5, 1.5)
    encoder = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True).eval()
    for model, x in ((conv, torch.randn(1, 16, 56, 56)), (encoder, torch.randn(4, 64, 256))):
        assert len(_split_ops(model, (x,), monkeypatch)) >= 2
        with torch.no_grad():
            torch.testing.assert_close(torchtosa.compile(model, x, opt="parallel")(x), model(x), rtol=1e-5, atol=1e-5)
