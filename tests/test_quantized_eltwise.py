"""The integer path of quantized elementwise groups (opdefs/quantize_eltwise.yaml): dequantize ->
add / sub [-> relu], mul [-> relu], relu / hardtanh / clamp, cat -> quantize, per-tensor int8.

Models quantized with the XNNPACK quantizer (it annotates add, add + relu, mul, hardtanh and cat
of quantized tensors), and graphs written by hand with quantize/dequantize nodes for what it does
not annotate (sub, standalone relu and clamp, cat of differently quantized tensors, int8 in and
out). Every group takes the integer path; native code is within one quantum of PyTorch's run of
the quantized graph (the fraction that is one quantum off is printed and bounded), and TOSA's
reference model gives native code's bits.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from test_quantized import INT_OFF_BY_ONE, check_quanta, int8_edges, last_scale, quantized
from torch import nn

import torchtosa
from generator.source import SpecError
from generator.spec import load_specs
from torchtosa.capture.freeze import freeze
from torchtosa.capture.trace import capture_exported
from torchtosa.execute.native import NativeFunction
from torchtosa.importer import rules
from torchtosa.importer.registry import ROOT, registry
from torchtosa.quant.passes.patterns import rewrite_groups
from torchtosa.testing import run_op

QD = torch.ops.quantized_decomposed
I8 = torch.int8


class Residual(nn.Module):
    """conv -> relu -> conv, plus the input (skip), -> relu: XNNPACK fuses add + relu."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.conv2(self.conv1(x).relu()) + x).relu()


class MulCat(nn.Module):
    """Two convs, their product and a hardtanh concatenated along channels (the hardtanh keeps
    its input's quantization, the cat takes its first input's: the second is rescaled), a conv,
    then an add without relu."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)
        self.conv3 = nn.Conv2d(8, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.conv1(x), self.conv2(x)
        y = self.conv3(torch.cat([a * b, nn.functional.hardtanh(b)], 1))
        return y + b


class MulRelu(nn.Module):
    """mul -> relu (fused by XNNPACK) plus relu6 of a conv (a standalone hardtanh), then a conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2, self.conv3 = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.conv1(x), self.conv2(x)
        return self.conv3((a * b).relu() + nn.functional.relu6(b))


MODELS = {"residual": (Residual, (8, 4, 8, 8), ["qconv2d", "qconv2d", "qadd"]),
          "mul_cat": (MulCat, (8, 4, 8, 8), ["qconv2d", "qconv2d", "qmul", "qclamp", "qcat", "qconv2d", "qadd"]),
          "mul_relu": (MulRelu, (8, 4, 8, 8), ["qconv2d", "qconv2d", "qmul", "qclamp", "qadd", "qconv2d"])}


def group_ops(program: torchtosa.Program) -> list[str]:
    assert all(g.path == "integer" for g in program.groups), [str(g) for g in program.groups]
    return [g.op.split(".")[1] for g in program.groups]


@pytest.mark.parametrize("name", list(MODELS))
def test_xnnpack_model_integer_path(name: str) -> None:
    """Every DQ -> op -> Q group is integer TOSA (only the float input's quantize and the
    output's dequantize stay float); native code is within one quantum of PyTorch and equals
    the reference model."""
    cls, shape, ops = MODELS[name]
    ep, _ = quantized(cls(), shape)
    program = torchtosa.to_tosa(ep, target="TOSA-1.0+FP+INT", freeze=True)
    assert group_ops(program) == ops
    assert {op for op, _ in program.served} == {f"torchtosa.{op}.default" for op in ops} | {
        "quantized_decomposed.quantize_per_tensor.default", "quantized_decomposed.dequantize_per_tensor.default"}
    native = NativeFunction(program.module, program.inputs, program.outputs, name=program.name)
    for seed in range(2):
        torch.manual_seed(100 + seed)
        x = torch.randn(shape)
        (got,) = native(x)
        off = check_quanta(got, ep.module()(x), last_scale(ep), INT_OFF_BY_ONE)
        (ref,) = program.reference(x)
        assert torch.equal(ref, got)
        print(f"{name}: {off:.3%} of {got.numel()} outputs one quantum off")


@pytest.mark.parametrize("name", list(MODELS))
def test_xnnpack_model_int8_edges_is_int_profile(name: str) -> None:
    """Without the float edges the model is int8 in, int8 out and conforms to TOSA-1.0+INT."""
    cls, shape, ops = MODELS[name]
    ep, x = quantized(cls(), shape)
    ep8, qx = int8_edges(ep, x)
    program = torchtosa.to_tosa(ep8, target="TOSA-1.0+INT", freeze=True)
    assert str(program.target) == "TOSA-1.0+INT"
    assert group_ops(program) == ops
    assert {op for op, _ in program.served} == {f"torchtosa.{op}.default" for op in ops}
    native = NativeFunction(program.module, program.inputs, program.outputs, name=program.name)
    (got,) = native(qx)
    (ref,) = program.reference(qx)
    want = ep8.module()(qx)
    assert got.dtype == ref.dtype == want.dtype == I8
    assert torch.equal(got, ref)
    steps = (got.int() - want.int()).abs()
    assert steps.max().item() <= 1 and (steps > 0).float().mean().item() <= INT_OFF_BY_ONE


def q(x: torch.Tensor, scale: float, zp: int, lo: int = -128, hi: int = 127) -> torch.Tensor:
    return QD.quantize_per_tensor.default(x, scale, zp, lo, hi, I8)


def dq(x: torch.Tensor, scale: float, zp: int) -> torch.Tensor:
    return QD.dequantize_per_tensor.default(x, scale, zp, -128, 127, I8)


class HandWritten(nn.Module):
    """int8 in, int8 out: the groups XNNPACK does not make (scales as calibration gives them,
    not round numbers, whose ratios would put many results exactly half way between two
    quanta, where RESCALE rounds up and PyTorch to even). sub + relu, sub, a standalone relu
    and relu6 (same quantization in and out: a clamp only), a clamp to other quantization (a
    RESCALE, then the clamp) with a narrower output range, and a cat along the last dim of
    three differently quantized tensors (two rescaled, one passed as is)."""

    def forward(self, qa: torch.Tensor, qb: torch.Tensor) -> torch.Tensor:
        a, b = dq(qa, 0.0213, 3), dq(qb, 0.0457, -7)
        d = dq(q((a - b).relu(), 0.0519, -128), 0.0519, -128)
        e = dq(q(b - a, 0.0613, 4), 0.0613, 4)
        r = dq(q(nn.functional.relu(b), 0.0457, -7), 0.0457, -7)
        r6 = dq(q(nn.functional.relu6(a), 0.0213, 3), 0.0213, 3)
        c = dq(q(torch.clamp(a, -0.9, 1.3), 0.0121, -20, -100, 100), 0.0121, -20)
        return q(torch.cat([d, e, r, r6, c], -1), 0.0613, 4)


HAND_OPS = ["qsub", "qsub", "qclamp", "qclamp", "qclamp", "qcat"]


def hand_inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-128, 128, (4, 8, 16), dtype=I8, generator=g),
            torch.randint(-128, 128, (4, 8, 16), dtype=I8, generator=g))


def test_hand_written_groups_native_and_reference() -> None:
    """sub, relu, relu6, clamp and cat groups: integer TOSA-1.0+INT, native code within one
    quantum of PyTorch's run of the graph and equal to the reference model."""
    ep = torch.export.export(HandWritten(), hand_inputs(0))
    program = torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True)
    assert str(program.target) == "TOSA-1.0+INT"
    assert group_ops(program) == HAND_OPS
    assert {op for op, _ in program.served} == {f"torchtosa.{op}.default" for op in HAND_OPS}
    native = NativeFunction(program.module, program.inputs, program.outputs, name=program.name)
    offs = []
    for seed in range(3):
        qa, qb = hand_inputs(seed)
        (got,) = native(qa, qb)
        (ref,) = program.reference(qa, qb)
        want = ep.module()(qa, qb)
        assert got.dtype == want.dtype == I8 and torch.equal(got, ref)
        steps = (got.int() - want.int()).abs()
        assert steps.max().item() <= 1
        offs.append((steps > 0).float().mean().item())
    assert max(offs) <= INT_OFF_BY_ONE
    print(f"hand-written: {max(offs):.3%} of {got.numel()} outputs one quantum off")


class BadAdd(nn.Module):
    """An add whose output scale is so much finer than its inputs' that the output RESCALE's
    shift would exceed 62, and a cat of a dequantized tensor with a float one."""

    def forward(self, qa: torch.Tensor, qb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = dq(qa, 0.0213, 3), dq(qb, 0.0457, -7)
        return q(a + b, 1e-12, 0), q(torch.cat([a, b * 2], 0), 0.05, 0)


def test_declined_groups_keep_float_path() -> None:
    """A group whose RESCALE leaves TOSA's ranges keeps the float path, with the reason; a cat
    with an element that is no dequantize is no group at all. The float path still computes
    PyTorch's result."""
    ep = torch.export.export(BadAdd(), hand_inputs(0))
    groups = rewrite_groups(freeze(capture_exported(ep)))
    assert [(g.op, g.path) for g in groups] == [("torchtosa.qadd.default", "float")]
    assert "outside TOSA's ranges" in groups[0].reason
    program = torchtosa.to_tosa(ep, target="TOSA-1.0+FP+INT", freeze=True)
    assert [g.path for g in program.groups] == ["float"]
    assert not any(op.startswith("torchtosa.") for op, _ in program.served)
    qa, qb = hand_inputs(1)
    for got, want in zip(program.reference(qa, qb), ep.module()(qa, qb), strict=True):
        assert got.dtype == I8 and (got.int() - want.int()).abs().max().item() <= 1


@pytest.mark.parametrize(("scale", "bound", "fits"), [
    (0.25 * 2 ** 20, 255, True),  # an add's operand: shift 12, |value| < 2^11
    (2.0 ** 21, 255, True),  # shift 9: |value| < 2^8 holds 255
    (2.0 ** 22, 255, False),  # shift 8: 255 may exceed 2^7
    (1e-3, 255 * 2 ** 20 + 2, True),
    (2.0 ** 3, 255 * 2 ** 20 + 2, False),  # shift 27: the sum may reach 2^28
    (1e-30, 255, False),  # shift beyond 62
])
def test_rescale_bounded(scale: float, bound: int, fits: bool) -> None:
    """rescale_bounded is rescale_scale32 where every input up to `bound` satisfies
    apply_scale_32's requirement |value| < 2^(shift - 1), else None."""
    ms = rules.rescale_bounded(scale, bound)
    if not fits:
        plain = rules.rescale_scale32(scale)
        assert ms is None and (plain is None or bound >= 1 << (plain[1] - 1))
        return
    assert ms == rules.rescale_scale32(scale) and bound < 1 << (ms[1] - 1)


@pytest.mark.parametrize("scale", [0.0457, 0.05, 0.0121, 0.025755826383829117])
@pytest.mark.parametrize("zero_point", [0, 4, -128])
def test_quantize_scalar_is_pytorchs(scale: float, zero_point: int) -> None:
    """The clamp bounds are quantized as PyTorch quantizes a float: values half way between two
    quanta, just beside them, and beyond both ends of the range."""
    half = ((torch.arange(-140, 140, dtype=torch.float64) + 0.5) * scale).float()
    xs = torch.cat([half, half.nextafter(torch.tensor(torch.inf)), torch.randn(100) * 200 * scale])
    want = q(xs, scale, zero_point, -100, 120)
    got = [rules.quantize_scalar(v, scale, zero_point, -100, 120) for v in xs.tolist()]
    assert got == want.tolist()


QCAT = "torchtosa.qcat.default:" + (ROOT / "opdefs" / "quantize_eltwise.yaml").read_text().split(
    "\ntorchtosa.qcat.default:")[1]


def test_list_pattern_loads_and_checks_list_arguments(tmp_path: Path) -> None:
    """`[x, ...]` in a match is ("each", "x"); the arguments bound under it must be lists."""
    opdefs = tmp_path / "opdefs"
    opdefs.mkdir()
    shutil.copy(ROOT / "opdefs" / "tosa.yaml", opdefs / "tosa.yaml")
    (opdefs / "fam.yaml").write_text(QCAT)
    _, entries = load_specs(opdefs)
    (pattern,) = entries[0].patterns
    assert pattern.nodes["c"] == ("aten.cat.default", [("each", "x"), ("bind", "dim")])
    bad = QCAT.replace("$output_scale, $output_zero_point, $quant_min", "$output_scale, $output_zero_point, _", 1)
    bad = bad.replace("$scales, $zero_points, _, _, _]", "$scales, $zero_points, $quant_min, _, _]", 1)
    (opdefs / "fam.yaml").write_text(bad)
    with pytest.raises(SpecError, match=r"\$quant_min is bound once per element of \[x, \.\.\.\]: it must be a list"):
        load_specs(opdefs)
    (opdefs / "fam.yaml").write_text(QCAT.replace("[x, ...]", "[y, ...]", 1))
    with pytest.raises(SpecError, match=r"a list pattern is \[node, \.\.\.\] with one node of this match"):
        load_specs(opdefs)


class _GroupByGroup(torch.fx.Interpreter):
    """Runs a rewritten graph, each torchtosa call both natively (integer TOSA, whose result
    flows on) and in PyTorch on the same int8 inputs; records each call's largest difference
    and how many elements differ."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.diffs: list[tuple[str, int, int, int]] = []  # (op, max difference, differing, elements)

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if not str(target).startswith("torchtosa."):
            return super().call_function(target, args, kwargs)
        (entry,) = [e for e in registry()[str(target)] if e.registry == "tosa"]
        want = target(*args)
        (got,) = run_op(entry, list(args))
        steps = (got.int() - want.int()).abs()
        self.diffs.append((str(target).split(".")[1], steps.max().item(), (steps > 0).sum().item(), steps.numel()))
        return got


@pytest.mark.parametrize("name", list(MODELS))
def test_each_group_within_one_quantum_of_pytorch(name: str) -> None:
    """Group by group on the same int8 inputs, native integer TOSA is within one quantum of the
    group's PyTorch computation (through a chain of groups, a one-quantum difference in one
    group's output can move a later group's output by more)."""
    cls, shape, ops = MODELS[name]
    ep, x = quantized(cls(), shape)
    gm = freeze(capture_exported(ep))
    assert [g.path for g in rewrite_groups(gm)] == ["integer"] * len(ops)
    run = _GroupByGroup(gm)
    run.run(x)
    assert [d[0] for d in run.diffs] == ops
    for op, most, off, n in run.diffs:
        assert most <= 1 and off / n <= INT_OFF_BY_ONE, (op, most, off, n)
    print(name, ", ".join(f"{op} {off}/{n}" for op, _, off, n in run.diffs))


class Clamps(nn.Module):
    """torch.clamp with int bounds, with only a lower bound (to another quantization: a
    RESCALE first) and with only an upper one."""

    def forward(self, qa: torch.Tensor, qb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = dq(qa, 0.0213, 3)
        return (q(torch.clamp(a, -1, 1), 0.0213, 3), q(torch.clamp(a, min=0.3), 0.0177, 9),
                q(torch.clamp(a, max=-0.2), 0.0213, 3))


def test_clamp_bounds() -> None:
    """Each clamp is one qclamp group; its int8 results are PyTorch's (the bounds are quantized
    exactly as PyTorch quantizes them; the RESCALE to other quantization is within one)."""
    ep = torch.export.export(Clamps(), hand_inputs(0))
    program = torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True)
    assert group_ops(program) == ["qclamp"] * 3
    native = NativeFunction(program.module, program.inputs, program.outputs, name=program.name)
    qa, qb = hand_inputs(5)
    got, ref, want = native(qa, qb), program.reference(qa, qb), ep.module()(qa, qb)
    for g, r, w in zip(got, ref, want, strict=True):
        assert torch.equal(g, r) and (g.int() - w.int()).abs().max().item() <= 1
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2])  # same quantization: exact
    assert got[0].min().item() == 3 - 47 and got[2].max().item() == 3 - 9  # -1 / 0.0213 and -0.2 / 0.0213, rounded
