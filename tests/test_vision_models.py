"""Vision models that issue 30 found not TOSA-1.0+FP conformant: each, frozen, is TOSA-1.0+FP and
TOSA's reference model gives eager's results.

torchvision's LRASPP and DeepLabV3 (MobileNetV3 backbone), FCN (ResNet-50) and Swin-T, timm's
HRNet-W18-small, random weights, one 64x64 image. What had kept them from TOSA-1.0+FP: their
interpolation (`upsample_bilinear2d.vec`, which core ATen decomposes into integer index math;
`capture/resizes.py` keeps the op, a tosa.resize) and Swin's cyclic shift (`torch.roll`, which
core ATen decomposes into an integer gather; `capture/decompositions.py` makes it slices and a
cat). Swin's relative position bias indexes a parameter with a constant: folded when frozen.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from vision_models import import_timm, import_torchvision

import torchtosa


def _segmentation(name: str) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        ctor = getattr(import_torchvision().models.segmentation, name)
        return ctor(weights=None, weights_backbone=None, aux_loss=False) if "lraspp" not in name else \
            ctor(weights=None, weights_backbone=None)
    return build


MODELS: dict[str, Callable[[], nn.Module]] = {
    "lraspp_mobilenet_v3_large": _segmentation("lraspp_mobilenet_v3_large"),
    "deeplabv3_mobilenet_v3_large": _segmentation("deeplabv3_mobilenet_v3_large"),
    "fcn_resnet50": _segmentation("fcn_resnet50"),
    "swin_t": lambda: import_torchvision().models.swin_t(),
    "hrnet_w18_small": lambda: import_timm().create_model("hrnet_w18_small", pretrained=False),
}


class Output(nn.Module):
    """The model's tensor output (segmentation models return {"out": ...})."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.model(x)
        return y["out"] if isinstance(y, dict) else y


@pytest.mark.parametrize("name", list(MODELS))
def test_float_vision_model_is_tosa_fp(name: str) -> None:
    torch.manual_seed(0)
    model = Output(MODELS[name]()).eval()
    x = torch.randn(1, 3, 64, 64)
    program = torchtosa.to_tosa(model, x, target="TOSA-1.0+FP", freeze=True)
    assert str(program.target) == "TOSA-1.0+FP"
    text = str(program.module)
    assert "tosa.gather" not in text and "tosa.tile" not in text
    with torch.no_grad():
        want = model(x)
    (got,) = program.reference(x)
    assert want.abs().max().item() > 1e-3  # not an all-zero output
    # float32 sums over many convolutions in another order: a few ulps per layer
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
