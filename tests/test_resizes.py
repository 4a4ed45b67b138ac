"""F.interpolate captured as one op (capture/resizes.py): one tosa.resize, TOSA-1.0+FP conformant,
agreeing with eager on TOSA's reference model and natively; what RESIZE can't reproduce, and
training, decompose as PyTorch does."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchtosa
from torchtosa.capture.trace import capture

CASES = {
    "bilinear-x2": {"scale_factor": 2, "mode": "bilinear", "align_corners": False},
    "bilinear-size": {"size": (13, 17), "mode": "bilinear", "align_corners": False},
    "bilinear-corners": {"size": (16, 11), "mode": "bilinear", "align_corners": True},
    "nearest-x2": {"scale_factor": 2, "mode": "nearest"},
    "nearest-size": {"size": (12, 20), "mode": "nearest"},
}


class Up(nn.Module):
    """A convolution, then an interpolation (a segmentation head's upsampling)."""

    def __init__(self, **how: Any) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.interpolate(self.conv(x), **self.how)


def _targets(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


@pytest.mark.parametrize("name", sorted(CASES))
def test_interpolation_is_one_conformant_resize(name: str) -> None:
    torch.manual_seed(0)
    model, x = Up(**CASES[name]).eval(), torch.randn(1, 3, 8, 10)
    targets = _targets(capture(model, (x,), {}).gm)
    assert any(t.startswith("aten.upsample_") for t in targets) and "aten.index.Tensor" not in targets
    program = torchtosa.to_tosa(model, x, target="TOSA-1.0+FP", freeze=True)  # raises NotConformant if not
    text = str(program.module)
    assert text.count("tosa.resize") == 1 and "tosa.gather" not in text
    with torch.no_grad():
        want = model(x)
        (got,) = program.reference(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torchtosa.compile(model, x)(x), want, rtol=1e-5, atol=1e-5)
        compiled = torch.compile(model, backend="torchtosa", options={"fallback": "error"})
        torch.testing.assert_close(compiled(x), want, rtol=1e-5, atol=1e-5)


def test_a_scale_resize_cannot_reproduce_is_decomposed() -> None:
    """A scale factor that is no ratio of small integers: PyTorch's index arithmetic, native."""
    model, x = Up(scale_factor=1.2345678, mode="bilinear", align_corners=False).eval(), torch.randn(1, 3, 8, 10)
    targets = _targets(capture(model, (x,), {}).gm)
    assert not any(t.startswith("aten.upsample_") for t in targets)
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(model, x, fallback="error")(x), model(x), rtol=1e-5, atol=1e-5)


def test_training_through_an_interpolation_matches_eager() -> None:
    """With gradients the interpolation decomposes as before (its backward has no entry)."""
    torch.manual_seed(0)
    model = Up(scale_factor=2, mode="bilinear", align_corners=False)
    x = torch.randn(2, 3, 8, 10)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="torchtosa", dynamic=False)
    compiled(x).square().mean().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().mean().backward()
    for g, want in zip(got, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5)


def test_pytorch_kernels_are_back_after_capture() -> None:
    """Capture swaps the interpolations' Python kernels only while it traces."""
    x = torch.randn(1, 3, 8, 10)
    before = {k: v for k, v in torch.ops.aten.upsample_bilinear2d.vec.py_kernels.items()}
    capture(Up(scale_factor=2, mode="bilinear", align_corners=False).eval(), (x,), {})
    assert torch.ops.aten.upsample_bilinear2d.vec.py_kernels == before
