"""PT2E-quantized models (torchao's prepare_pt2e / convert_pt2e with the XNNPACK quantizer) run
end to end: the quantize/dequantize ops of the converted graph are lowered as float TOSA
arithmetic (opdefs/quantize.yaml) around the float ops, natively and on TOSA's reference model.

Outputs are the dequantized int8 values of the last quantize, so they take values on a grid of
step `scale`: native code and the reference model must agree with PyTorch's run of the converted
model within one quantum per element (a float op computed in another order may move a value
that sits on a rounding boundary by one step; the fraction of elements that moved is checked
to be small as well).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchtosa

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torchao's optional CUDA extensions warn on import
    pt2e = pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")
    xnnpack = pytest.importorskip("torchao.testing.pt2e._xnnpack_quantizer")

QD = torch.ops.quantized_decomposed
# Fraction of elements allowed to differ (by at most one quantum) from PyTorch's run.
OFF_BY_ONE = 0.02


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x).relu())


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Conv2d(8, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.bn(self.conv1(x)).relu())


def quantized(model: nn.Module, shape: tuple[int, ...],
              fold: bool = True) -> tuple[torch.export.ExportedProgram, torch.Tensor]:
    """The model quantized with PT2E (int8 activations per tensor, int8 weights per channel),
    calibrated on random data, and exported again; and an input. `fold=False` keeps the
    weights float, quantized per channel in the graph."""
    torch.manual_seed(0)
    model = model.eval()
    if isinstance(model, ConvNet):  # statistics for batch norm to fold
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    x = torch.randn(shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "XNNPACKQuantizer is deprecated!" (it lives in torchao.testing)
        quantizer = xnnpack.XNNPACKQuantizer().set_global(
            xnnpack.get_symmetric_quantization_config(is_per_channel=True))
    prepared = pt2e.prepare_pt2e(torch.export.export(model, (x,)).module(), quantizer)
    for _ in range(8):
        prepared(torch.randn(shape))
    converted = pt2e.convert_pt2e(prepared, fold_quantize=fold)
    return torch.export.export(converted, (x,)), torch.randn(shape)


def last_scale(ep: torch.export.ExportedProgram) -> float:
    """The scale of the output's quantization: one quantum of the result."""
    (out,) = next(n for n in ep.graph.nodes if n.op == "output").args[0]
    assert out.target == QD.dequantize_per_tensor.default
    return out.args[1]


def check_quanta(got: torch.Tensor, want: torch.Tensor, scale: float) -> float:
    """Every element within one quantum (plus float slack); the fraction that is off returned."""
    steps = ((got - want) / scale).abs()
    assert steps.max().item() <= 1.0 + 1e-3, f"max difference {steps.max().item():.3f} quanta"
    off = (steps > 0.5).float().mean().item()
    assert off <= OFF_BY_ONE, f"{off:.2%} of the elements differ by one quantum"
    return off


MODELS = {"mlp": (MLP, (4, 16)), "convnet": (ConvNet, (2, 3, 8, 8))}


@pytest.mark.parametrize("name", list(MODELS))
def test_pt2e_graph_has_qdq_ops(name: str) -> None:
    cls, shape = MODELS[name]
    ep, _ = quantized(cls(), shape)
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"quantized_decomposed.quantize_per_tensor.default", "quantized_decomposed.dequantize_per_tensor.default",
            "quantized_decomposed.dequantize_per_channel.default"} <= ops
    assert not any("batch_norm" in op for op in ops)  # folded into the conv by convert_pt2e


@pytest.mark.parametrize("name", list(MODELS))
def test_pt2e_model_native(name: str) -> None:
    cls, shape = MODELS[name]
    ep, x = quantized(cls(), shape)
    want = ep.module()(x)
    got = torchtosa.compile(ep, fallback="error")(x)
    check_quanta(got, want, last_scale(ep))


@pytest.mark.parametrize("name", list(MODELS))
def test_pt2e_model_unfolded_weights_native(name: str) -> None:
    """convert_pt2e(fold_quantize=False): quantize_per_channel of the float weights in the graph."""
    cls, shape = MODELS[name]
    ep, x = quantized(cls(), shape, fold=False)
    assert any(n.target == QD.quantize_per_channel.default for n in ep.graph.nodes)
    want = ep.module()(x)
    got = torchtosa.compile(ep, fallback="error")(x)
    check_quanta(got, want, last_scale(ep))


@pytest.mark.parametrize("name", list(MODELS))
def test_pt2e_model_on_reference_model(name: str) -> None:
    cls, shape = MODELS[name]
    ep, x = quantized(cls(), shape)
    want = ep.module()(x)
    program = torchtosa.to_tosa(ep, target="TOSA-1.0+FP+INT", freeze=True)
    assert str(program.target) == "TOSA-1.0+FP+INT"
    (got,) = program.reference(x)
    check_quanta(got, want, last_scale(ep))


@pytest.mark.parametrize("scale", [0.25, 0.1, 0.0123, 0.025755826383829117])
@pytest.mark.parametrize("zero_point", [0, 7, -128])
def test_quantize_dequantize_bit_for_bit(scale: float, zero_point: int) -> None:
    """quantize and dequantize give torch's bits, at the inputs where it matters: points half
    way between two quanta (ties round half to even; with a scale that is not a power of two,
    multiplying by the inverse scale, as torch does, and dividing by the scale disagree on
    about a third of them), values past both clamp bounds, and a per-channel weight."""
    half = ((torch.arange(-140, 140, dtype=torch.float64) + 0.5) * scale).float()
    x = torch.cat([half, half.nextafter(torch.tensor(torch.inf)), torch.randn(200) * 100 * scale])
    w = torch.randint(-127, 128, (6, 5), dtype=torch.int8)
    scales, zps = torch.rand(6) * 0.05 + 0.001, torch.randint(-3, 4, (6,))

    def qdq(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, zps: torch.Tensor):
        q = QD.quantize_per_tensor.default(x, scale, zero_point, -128, 127, torch.int8)
        d = QD.dequantize_per_tensor.default(q, scale, zero_point, -128, 127, torch.int8)
        return q, d, QD.dequantize_per_channel.default(w, scales, zps, 0, -127, 127, torch.int8)

    want = qdq(x, w, scales, zps)
    got = torchtosa.compile(qdq, x, w, scales, zps, fallback="error")(x, w, scales, zps)
    for g, e in zip(got, want, strict=True):
        assert g.dtype == e.dtype and torch.equal(g, e)
