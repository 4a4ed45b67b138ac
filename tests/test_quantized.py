"""PT2E-quantized models (torchao's prepare_pt2e / convert_pt2e with the XNNPACK quantizer) run
end to end: the quantize/dequantize ops of the converted graph are lowered as float TOSA
arithmetic (opdefs/quantize.yaml) around the float ops, natively and on TOSA's reference model;
frozen (`to_tosa(freeze=True)`), each dequantize -> linear/conv2d [-> relu] -> quantize group
becomes int8 TOSA instead (opdefs/quantize_int.yaml: matmul/conv2d, i32 bias, RESCALE).

Outputs are the dequantized int8 values of the last quantize, so they take values on a grid of
step `scale`: native code and the reference model must agree with PyTorch's run of the converted
model within one quantum per element (a float op computed in another order may move a value
that sits on a rounding boundary by one step; the fraction of elements that moved is checked
to be small as well).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from mlir import ir
from torch import nn

import torchtosa
from torchtosa._generated import catalogue
from torchtosa.capture.freeze import freeze
from torchtosa.capture.trace import capture_exported
from torchtosa.execute.native import NativeFunction, TensorSpec
from torchtosa.importer import rules, target
from torchtosa.importer.graph import build_function
from torchtosa.importer.target import Target
from torchtosa.importer.tosa import Builder
from torchtosa.lower.zero_points import separate_zero_points
from torchtosa.quant.passes.patterns import rewrite_groups

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


class BiaslessMLP(nn.Module):
    """Linear layers without bias: capture makes them mm, not addmm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32, bias=False), nn.Linear(32, 8, bias=False)

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


def check_quanta(got: torch.Tensor, want: torch.Tensor, scale: float, allowed: float = OFF_BY_ONE) -> float:
    """Every element within one quantum (plus float slack); the fraction that is off returned."""
    steps = ((got - want) / scale).abs()
    assert steps.max().item() <= 1.0 + 1e-3, f"max difference {steps.max().item():.3f} quanta"
    off = (steps > 0.5).float().mean().item()
    assert off <= allowed, f"{off:.2%} of the elements differ by one quantum"
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


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("name", list(MODELS))
def test_pt2e_model_native(name: str, fold: bool) -> None:
    """fold=False: convert_pt2e leaves quantize_per_channel of the float weights in the graph."""
    cls, shape = MODELS[name]
    ep, x = quantized(cls(), shape, fold=fold)
    assert any(n.target == QD.quantize_per_channel.default for n in ep.graph.nodes) == (not fold)
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


# ---- the integer path: DQ -> linear/conv2d [-> relu] -> Q groups as int8 TOSA (opdefs/quantize_int.yaml)

# Fraction of outputs the integer path may put one quantum away from PyTorch's float run: the
# accumulator's bias is rounded to int32 and RESCALE rounds with a 31-bit multiplier, so values
# within a hair of a rounding boundary may land on the other side (measured: 33 of 10240 MLP
# and 32 of 11520 conv-net outputs, 0.3%).
INT_OFF_BY_ONE = 0.02
INT_MODELS = {"mlp": (MLP, (64, 16), "torchtosa.qlinear.default"),
              "mlp_3d": (MLP, (4, 16, 16), "torchtosa.qlinear.default"),  # views around addmm
              "mlp_no_bias": (BiaslessMLP, (64, 16), "torchtosa.qlinear.default"),  # mm
              "convnet": (ConvNet, (4, 3, 8, 8), "torchtosa.qconv2d.default")}


def int8_edges(ep: torch.export.ExportedProgram, x: torch.Tensor) -> tuple[torch.export.ExportedProgram, torch.Tensor]:
    """The quantized model without its first quantize and last dequantize: int8 in, int8 out;
    and the int8 input of `x` (quantized as the model's first quantize does)."""
    gm = ep.module()
    graph = gm.graph
    first = next(n for n in graph.nodes if n.target == QD.quantize_per_tensor.default)
    qx = first.target(x, *first.args[1:])
    first.replace_all_uses_with(first.args[0])
    graph.erase_node(first)
    out = graph.output_node()
    (last,) = out.args[0]
    out.args = ((last.args[0],),)
    graph.eliminate_dead_code()
    gm.recompile()
    return torch.export.export(gm, (qx,)), qx


@pytest.mark.parametrize("fold", [True, False])
@pytest.mark.parametrize("name", list(INT_MODELS))
def test_integer_path_native_and_reference(name: str, fold: bool) -> None:
    """Both DQ-op-Q groups lower to int8 TOSA (only the float input's quantize and the
    output's dequantize stay float: TOSA-1.0+FP+INT); native code is within one quantum of
    PyTorch's float run, and the reference model gives native code's bits. With
    fold_quantize=False the weight's quantize_per_channel is folded to int8 after matching."""
    cls, shape, op = INT_MODELS[name]
    ep, x = quantized(cls(), shape, fold=fold)
    program = torchtosa.to_tosa(ep, target="TOSA-1.0+FP+INT", freeze=True)
    assert [g.path for g in program.groups] == ["integer", "integer"]
    assert {k: n for k, n in program.served.items()} == {
        (op, "tosa"): 2, ("quantized_decomposed.quantize_per_tensor.default", "tosa"): 1,
        ("quantized_decomposed.dequantize_per_tensor.default", "tosa"): 1}
    native = NativeFunction(program.module, program.inputs, program.outputs, name=program.name)
    for _ in range(2):
        x = torch.randn(shape)
        (got,) = native(x)
        off = check_quanta(got, ep.module()(x), last_scale(ep), INT_OFF_BY_ONE)
        (ref,) = program.reference(x)
        assert torch.equal(ref, got)
    print(f"{name}: {off:.2%} of {got.numel()} outputs one quantum off")


@pytest.mark.parametrize("name", list(INT_MODELS))
def test_integer_path_int8_module_is_int_profile(name: str) -> None:
    """For TOSA-1.0+INT, to_tosa leaves the float input's quantize and the output's dequantize
    to the caller: int8 in, int8 out, each edge's quantization in the program. Native code and
    the reference model give equal int8 outputs, within one of PyTorch's run of the model
    without its edges, and the edges' quantization is the model's own."""
    cls, shape, op = INT_MODELS[name]
    ep, x = quantized(cls(), shape)
    program = torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True)
    assert str(program.target) == "TOSA-1.0+INT"
    assert set(program.served) == {(op, "tosa")}
    assert [s.dtype for s in program.inputs + program.outputs] == [torch.int8, torch.int8]
    (qin,), (qout,) = program.input_quantization, program.output_quantization
    ep8, qx = int8_edges(ep, x)
    assert torch.equal(qin.quantize(x), qx) and qout.scale == last_scale(ep)
    native = NativeFunction(program.module, program.inputs, program.outputs, name=program.name)
    (got,) = native(qx)
    (ref,) = program.reference(qx)
    want = ep8.module()(qx)
    assert got.dtype == ref.dtype == want.dtype == torch.int8
    assert torch.equal(got, ref)
    steps = (got.int() - want.int()).abs()
    assert steps.max().item() <= 1 and (steps > 0).float().mean().item() <= INT_OFF_BY_ONE
    check_quanta(qout.dequantize(got), ep.module()(x), qout.scale, INT_OFF_BY_ONE)
    assert f"{program.input_names[0]}: int8 (scale" in program.report()


def test_integer_path_declined_keeps_float_path() -> None:
    """Without freezing, the weight scales are no constants: the groups keep the float path
    (and the report says why); the integer lowering's limits decline asymmetric weights."""
    ep, _ = quantized(MLP(), (8, 16))
    program = torchtosa.to_tosa(ep, target="TOSA-1.0+FP+INT", freeze=False)
    assert program.groups == []  # the pattern pass runs on frozen graphs only
    gm = capture_exported(ep).gm  # parameters and buffers as placeholders
    groups = rewrite_groups(gm)
    assert [g.path for g in groups] == ["float", "float"]
    assert "not a constant" in groups[0].reason
    assert not any(str(n.target).startswith("torchtosa.") for n in gm.graph.nodes)
    gm = freeze(capture_exported(ep))
    for n in gm.graph.nodes:  # asymmetric weights: the entry's limits decline them
        if n.target == QD.dequantize_per_channel.default:
            getattr(gm, n.args[2].target)[0] = 1
    groups = rewrite_groups(gm)
    assert [g.path for g in groups] == ["float", "float"]
    assert all("asymmetric" in g.reason for g in groups), groups
    assert not any(str(n.target).startswith("torchtosa.") for n in gm.graph.nodes)


def test_fp_only_target_keeps_float_path() -> None:
    """TOSA-1.0+FP has no integer matmul or conv: a frozen quantized model keeps the float
    path there and conforms to it."""
    ep, x = quantized(MLP(), (8, 16))
    program = torchtosa.to_tosa(ep, target="TOSA-1.0+FP", freeze=True)
    assert str(program.target) == "TOSA-1.0+FP" and program.groups == []
    assert ("torchtosa.qlinear.default", "tosa") not in program.served
    (got,) = program.reference(x)
    check_quanta(got, ep.module()(x), last_scale(ep))


def apply_scale_32(value: int, multiplier: int, shift: int) -> int:
    """The TOSA specification's apply_scale_32 with SINGLE_ROUND, in Python integers."""
    return (value * multiplier + (1 << (shift - 1))) >> shift


@pytest.mark.parametrize("scale", [0.75, 1.0, 2.0 ** -20, 0.3, 1e-5, 0.999999999999, 3.5])
def test_rescale_scale32_rule(scale: float) -> None:
    """rescale_scale32: multiplier in [2^30, 2^31), shift in [2, 62], m * 2^-shift within half a
    unit of the multiplier's last place of the scale."""
    m, shift = rules.rescale_scale32(scale)
    assert (1 << 30) <= m < (1 << 31) and 2 <= shift <= 62
    assert abs(m * 2.0 ** -shift - scale) <= 2.0 ** (-shift - 1) * (1 + 1e-12)


def test_rescale_scale32_rule_edges() -> None:
    assert rules.rescale_scale32(1.0 - 2.0 ** -40) == [1 << 30, 30]  # rounds up to 2^31: halved
    assert rules.rescale_scale32(2.0 ** 40) is None  # shift -10
    assert rules.rescale_scale32(2.0 ** -40) is None  # shift 71
    assert rules.rescale_scale32(0.0) is None
    assert rules.quantize_bias([0.5, -1.0], 0.5, [0.5, 0.25]) == [2, -8]
    assert rules.quantize_bias(None, 0.5, [0.5, 0.25]) == [0, 0]


@pytest.mark.parametrize("to", [torch.int32, torch.int8])
def test_rescale_native_matches_reference_model(to: torch.dtype) -> None:
    """An emitted tosa.rescale (per channel, scale32, SINGLE_ROUND, output zero point) of random
    i32 values: native code (tosa-to-linalg), TOSA's reference model and the specification's
    formula agree exactly, for multipliers and shifts from rescale_scale32 of several scales."""
    scales = [0.75, 1.0, 0.3, 2.0 ** -20, 1e-5, 0.999999999999, 0.0123, 3.5e-3]
    params = [rules.rescale_scale32(s) for s in scales]
    mults, shifts = [p[0] for p in params], [p[1] for p in params]
    zp = -7 if to == torch.int8 else 0
    torch.manual_seed(0)
    # values RESCALE accepts for every channel: |v| < 2^(shift - 1), results within int32
    limit = min(1 << (s - 1) for s in shifts)
    x = torch.randint(-(1 << 31), (1 << 31) - 1, (64, len(scales)), dtype=torch.int64)
    x = torch.cat([x.clamp(-limit, limit - 1), torch.randint(-3000, 3000, (64, len(scales)))]).to(torch.int32)
    spec = TensorSpec(tuple(x.shape), torch.int32)

    def body(args: list) -> list:
        b = Builder("test rescale")
        m = b.constant(mults, torch.int32, (len(scales),))
        s = b.constant(shifts, torch.int8, (len(scales),))
        return [catalogue.tosa_rescale(b, args[0], m, s, to=to, out_zero=zp, per_channel=True)]

    aim = Target.parse("TOSA-1.0+INT")
    with target.using(aim):
        program = build_function("forward", [spec], body)
    aim.validate(program.module)
    program.target = aim
    assert "tosa.rescale" in str(program)
    (got,) = NativeFunction(program.module, program.inputs, program.outputs)(x)
    (ref,) = program.reference(x)
    lo, hi = (-128, 127) if to == torch.int8 else (-(1 << 31), (1 << 31) - 1)
    want = torch.tensor([[min(max(apply_scale_32(int(v), m, s) + zp, lo), hi)
                          for v, m, s in zip(row.tolist(), mults, shifts, strict=True)] for row in x], dtype=to)
    assert got.dtype == ref.dtype == to
    assert torch.equal(got, want) and torch.equal(ref, want)


@pytest.mark.parametrize("name", ["mlp", "convnet"])
def test_zero_points_apart_is_exact(name: str) -> None:
    """The optimizing pipeline takes the zero points out of int8 matmul/conv2d (runtime/
    zero_points.py: a plain i8 contraction, the zero point times a sum of the other operand
    subtracted, the conv input padded with its zero point): its int8 outputs equal the
    reference lowering's (opt="none", which keeps TOSA's quantized contractions) bit for bit."""
    cls, shape, _ = INT_MODELS[name]
    ep, x = quantized(cls(), shape)
    program = torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True)
    zero_points = [int(op.split("dense<")[1].split(">")[0]) for op in str(program).splitlines()
                   if "tosa.const" in op and "tensor<1xi8>" in op]
    assert any(zero_points), "the model's input zero points are all 0: nothing to take apart"
    qx = program.input_quantization[0].quantize(x * 3)  # large values: the clamps are reached too
    outs = [NativeFunction(program.module, program.inputs, program.outputs, opt=opt)(qx)[0]
            for opt in ("none", "default")]
    assert torch.equal(*outs)
    native = torchtosa.to_tosa(ep, target=None, freeze=True)  # (a module printed without a target parses)
    module = ir.Module.parse(str(native), native.context)
    separate_zero_points(module)
    lowered = str(module)
    assert "tosa.reduce_sum" not in lowered  # the sums of the other operand, a frozen weight: constants
    zeros = {line.split("=")[0].strip(): int(line.split("dense<")[1].split(">")[0]) for line in lowered.splitlines()
             if "tosa.const" in line and ": () -> tensor<1xi8>" in line}
    for line in lowered.splitlines():  # every contraction's zero points are now constants 0
        if "tosa.matmul" in line or "tosa.conv2d" in line:
            *_, zp1, zp2 = re.findall(r"%\w+", line.split("{")[0].split(":")[0])
            assert zeros[zp1] == zeros[zp2] == 0, line
