"""NPU-grade TOSA: the layout decided for the whole graph, and linear layers as 1x1 convolutions.

`to_tosa` for a target runs a CNN NHWC from its input's transpose to its end (lower/layout.py,
driven by opdefs/tosa.yaml's `layout` table), on the integer path (tests/test_int8_models.py
counts the int8 models' transposes) and the float path (here). `npu=True` makes integer linear
layers 1x1 CONV2Ds (lower/linear_conv.py) and explicit pads the convolutions' padding
(lower/pad_conv.py) and patch embeddings convolutions of stride 1 (lower/patch_conv.py), as
`torchtosa.vela.compile` and `--vela` do: the same bits on TOSA's reference model and natively,
and no transpose left in LeNet.
"""

from __future__ import annotations

import torch
from test_int8_models import EXAMPLE, transposes
from test_quantized_cnn import randomize
from test_quantizer import MLP
from torch import nn

import torchtosa
from torchtosa.execute.native import NativeFunction
from torchtosa.quantizer import quantize


def ops(program: torchtosa.Program, name: str) -> int:
    return str(program.module).count(f"{name} ")


def test_linear_layers_become_convolutions() -> None:
    """The MLP's three linears and LeNet's (after its two convs) are CONV2Ds under npu=True, no
    MATMUL left; LeNet's flatten transpose is folded into its first linear's weight; the
    reference model gives the matmul program's bits, and native code the reference model's."""
    for build, shape, convs, flatten in ((MLP, (8, 16), 3, 0), (EXAMPLE.LeNet, (1, 1, 28, 28), 5, 1)):
        model = randomize(build())
        torch.manual_seed(0)
        ep = quantize(model, (torch.randn(shape),), [(torch.randn(shape),) for _ in range(4)])
        plain = torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True)
        npu = torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True, npu=True)
        assert ops(plain, "tosa.matmul") == 3 and transposes(plain) == flatten
        assert ops(npu, "tosa.matmul") == 0 and ops(npu, "tosa.conv2d") == convs and transposes(npu) == 0
        assert str(npu.target) == "TOSA-1.0+INT"
        _assert_same_bits(plain, npu, shape)


def _assert_same_bits(plain: torchtosa.Program, npu: torchtosa.Program, shape: tuple[int, ...]) -> None:
    """The npu=True program gives the plain one's bits on the reference model, and native code
    gives them too, for a random input of `shape`."""
    (qin,) = npu.input_quantization
    native = NativeFunction(npu.module, npu.inputs, npu.outputs, name=npu.name)
    torch.manual_seed(1)
    x = qin.quantize(torch.randn(shape))
    (want,), (got,), (fast,) = plain.reference(x), npu.reference(x), native(x)
    assert torch.equal(got, want) and torch.equal(fast, got)


class TfPadded(nn.Module):
    """Pads TensorFlow's way, as transformers' MobileNetV2: F.pad before the 3x3 convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.BatchNorm2d(8), nn.ReLU6())
        self.down = nn.Conv2d(8, 16, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(nn.functional.pad(x, (0, 1, 0, 1)))
        y = self.dw(nn.functional.pad(y, (1, 1, 1, 1)))
        return self.down(nn.functional.pad(y, (0, 1, 0, 1)))


def test_pads_become_convolution_padding() -> None:
    """Under npu=True the explicit pads (zero points, between reshapes, some with a RESCALE
    after them) are the convolutions' padding: no PAD left, the same bits on the reference
    model, and native code gives them too."""
    model = randomize(TfPadded())
    shape = (1, 3, 16, 16)
    torch.manual_seed(0)
    ep = quantize(model, (torch.randn(shape),), [(torch.randn(shape),) for _ in range(4)])
    plain = torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True)
    npu = torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True, npu=True)
    assert ops(plain, "tosa.pad") == 3 and ops(npu, "tosa.pad") == 0 and transposes(npu) == 2
    _assert_same_bits(plain, npu, shape)


class Patches(nn.Module):
    """A patch embedding (kernel = stride, larger than Ethos-U's 3) and a 2x2 conv of stride 2."""

    def __init__(self, kernel: tuple[int, int]) -> None:
        super().__init__()
        self.embed, self.down = nn.Conv2d(3, 16, kernel, stride=kernel), nn.Conv2d(16, 8, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.embed(x).relu())


def test_patch_convolutions_run_at_stride_one() -> None:
    """Under npu=True a convolution whose kernel is its stride (8x8, 4x6; batches of 1 and 2) is
    one of stride 1 over its patches' rows (lower/patch_conv.py); the 2x2 conv of stride 2, which
    Ethos-U runs as it is, stays. The same bits on the reference model, and natively."""
    for kernel, shape in (((8, 8), (1, 3, 32, 32)), ((4, 6), (2, 3, 16, 24))):
        model = randomize(Patches(kernel))
        torch.manual_seed(0)
        ep = quantize(model, (torch.randn(shape),), [(torch.randn(shape),) for _ in range(4)])
        plain = torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True)
        npu = torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True, npu=True)
        stride = f"stride = array<i64: {kernel[0]}, {kernel[1]}>"
        assert stride in str(plain.module) and stride not in str(npu.module)
        assert "stride = array<i64: 2, 2>" in str(npu.module) and ops(npu, "tosa.conv2d") == 2
        _assert_same_bits(plain, npu, shape)


class Residual(nn.Module):
    """A float CNN: conv-BN-ReLU6, an explicit pad, a depthwise conv, a residual add, pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU6())
        self.dw = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.BatchNorm2d(8), nn.ReLU())
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.stem(x)
        y = y + self.dw(nn.functional.pad(y, (1, 1, 1, 1)))
        y = self.pool(y).mean((2, 3))
        return self.head(y)


def test_float_cnn_runs_nhwc() -> None:
    """The float path too: one transpose (the input's) where the NCHW module had one pair per
    convolution and pooling; the reference model and native code agree with eager."""
    model = randomize(Residual())
    x = torch.randn(1, 3, 17, 17)  # an explicit pad of a batch > 1 stays NCHW (merged N and C: rank 3)
    before = transposes(torchtosa.to_tosa(model, x, target=None, freeze=True))
    program = torchtosa.to_tosa(model, x, target="TOSA-1.0+FP", freeze=True)
    assert before >= 6 and transposes(program) == 1, program
    with torch.no_grad():
        want = model(x)
    (ref,) = program.reference(x)
    (got,) = NativeFunction(program.module, program.inputs, program.outputs, name=program.name)(x)
    torch.testing.assert_close(ref, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
