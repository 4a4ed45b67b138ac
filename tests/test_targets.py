"""TOSA targets: `to_tosa(..., target=..., freeze=...)` emits modules that MLIR's tosa-validate
accepts for the target, or says which op does not conform and why."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from mlir import ir
from test_models import MODELS, instantiate
from test_ops import CASES, check_results, entry_for, make_args

import torchtosa
from torchtosa import NotConformant, Target, Unsupported
from torchtosa.testing import _tensors, lower_op

# models whose inputs are token ids or masks: TOSA 1.0's FP profile moves no integers or bools
# (reshape, tile, gather of i32/bool need PRO-INT), so they conform to FP+INT
INTEGER_INPUTS = {"bert", "gpt2", "llama", "llama_no_mask"}


def signature(program: torchtosa.Program) -> tuple[list[str], list[str]]:
    fn = program.module.body.operations[0]
    kind = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
    return [str(t) for t in kind.inputs], [str(t) for t in kind.results]


def test_parse_and_print() -> None:
    t = Target.parse("TOSA-1.0+FP+INT+bf16")
    assert (t.version, t.profiles, t.extensions, str(t)) == ("1.0", ("FP", "INT"), ("bf16",), "TOSA-1.0+FP+INT+bf16")
    assert Target.parse("TOSA-1.1+INT+int64").narrows_int64 is False
    for bad, why in [("TOSA-2.0+FP", "version"), ("TOSA-1.0", "expected"), ("TOSA-1.0+bf16", "profile"),
                     ("TOSA-1.0+INT+int64", "TOSA 1.1")]:
        with pytest.raises(ValueError, match=why):
            Target.parse(bad)
    with pytest.raises(ValueError, match="level"):
        Target.parse("TOSA-1.0+FP", level="4k")


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()


def test_frozen_module_is_the_whole_model() -> None:
    program = torchtosa.to_tosa(mlp(), torch.randn(2, 8), target="TOSA-1.0+FP", freeze=True)
    assert str(program.target) == "TOSA-1.0+FP"
    assert "tosa.target_env" in str(program.module)
    assert signature(program) == (["tensor<2x8xf32>"], ["tensor<2x4xf32>"])
    text = program.module.operation.get_asm(enable_debug_info=True)
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):  # constants named by module path
        assert f'loc("{name}"' in text or f'"{name}"' in text, name


def test_unfrozen_parameters_are_arguments() -> None:
    program = torchtosa.to_tosa(mlp(), torch.randn(2, 8), target="TOSA-1.0+FP")
    assert len(signature(program)[0]) == 5  # 4 parameters, then x


def test_int64_held_in_int32_where_it_fits() -> None:
    table = torch.randn(10, 4)

    def fn(ids: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.embedding(ids, table), x.argmax(-1) + 1

    program = torchtosa.to_tosa(fn, torch.randint(0, 10, (2, 3)), torch.randn(2, 5), target="TOSA-1.0+FP+INT",
                                 freeze=True)
    inputs, outputs = signature(program)
    assert inputs == ["tensor<2x3xi32>", "tensor<2x5xf32>"] and outputs == ["tensor<2x3x4xf32>", "tensor<2xi32>"]
    assert "i64" not in str(program.module)
    assert [s.dtype for s in program.inputs] == [torch.int64, torch.float32]  # what torch passes


def test_int64_arithmetic_that_may_overflow_int32() -> None:
    def fn(ids: torch.Tensor) -> torch.Tensor:
        return ids * 3

    ids = torch.randint(0, 10, (4,))
    with pytest.raises(Unsupported, match=r"may not fit int32.*TOSA-1.1"):
        torchtosa.to_tosa(fn, ids, target="TOSA-1.0+FP+INT")
    program = torchtosa.to_tosa(fn, ids, target="TOSA-1.1+FP+INT+int64")
    assert signature(program) == (["tensor<4xi64>"], ["tensor<4xi64>"])
    assert str(torchtosa.to_tosa(fn, ids).target) == "TOSA-1.1+FP+INT+int64"  # auto


def test_int64_constant_that_does_not_fit() -> None:
    with pytest.raises(Unsupported, match="does not fit"):
        torchtosa.to_tosa(lambda ids: ids + 2**40, torch.arange(4), target="TOSA-1.0+INT")


def test_int64_clamps_within_int32() -> None:
    """relu's bound int64-max is left out for an int64 held in i32; a bound that fits is kept."""
    ids = torch.randint(-5, 5, (6,))
    for fn in (torch.relu, lambda t: t.clamp(-3, 3)):
        program = torchtosa.to_tosa(fn, ids, target="TOSA-1.0+INT")
        assert "i64" not in str(program.module)
        assert program.reference(ids)[0].equal(fn(ids))


def test_bools_are_i1() -> None:
    def fn(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(mask, 0.0)

    program = torchtosa.to_tosa(fn, torch.randn(3, 4), torch.rand(3, 4) > 0.5, target="TOSA-1.0+FP")
    assert signature(program)[0] == ["tensor<3x4xf32>", "tensor<3x4xi1>"]


def test_float64_is_not_tosa() -> None:
    x = torch.randn(3, dtype=torch.float64)
    with pytest.raises(Unsupported, match="float64"):
        torchtosa.to_tosa(torch.sin, x, target="TOSA-1.0+FP")
    assert torchtosa.to_tosa(torch.sin, x).target is None  # auto: torchtosa's native flavour


def test_bf16_needs_its_extension() -> None:
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    with pytest.raises(Unsupported, match=r"\+bf16"):
        torchtosa.to_tosa(torch.tanh, x, target="TOSA-1.0+FP")
    assert str(torchtosa.to_tosa(torch.tanh, x).target) == "TOSA-1.0+FP+bf16"


def test_not_conformant_names_the_op_and_source_line() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.int32) & 3  # bitwise ops: PRO-INT (int32 add and mul are in PRO-FP too)

    with pytest.raises(NotConformant, match=r"TOSA-1.0\+FP:\n.*bitwise_and.*test_targets.py:\d+.*pro_int"):
        torchtosa.to_tosa(fn, torch.randn(4), target="TOSA-1.0+FP")


def test_rank4_pad_within_level_8k() -> None:
    program = torchtosa.to_tosa(lambda x: F.pad(x, (1, 2, 0, 1)), torch.randn(1, 3, 5, 5), target="TOSA-1.0+FP")
    assert str(program.target) == "TOSA-1.0+FP"


def test_targets_need_static_shapes() -> None:
    ep = torch.export.export(torch.nn.ReLU(), (torch.randn(4, 3),), dynamic_shapes=({0: torch.export.Dim("b")},))
    with pytest.raises(Unsupported, match="static shapes"):
        torchtosa.to_tosa(ep, target="TOSA-1.0+FP")


@pytest.mark.parametrize("name", list(MODELS))
def test_models_conform(name: str) -> None:
    """Every test model, frozen, conforms to TOSA-1.0+FP (token models: +INT)."""
    model, inputs = instantiate(name)
    aim = "TOSA-1.0+FP+INT" if name in INTEGER_INPUTS else "TOSA-1.0+FP"
    with torch.no_grad():
        program = torchtosa.to_tosa(model, *inputs, target=aim, freeze=True)
    assert str(program.target) == aim
    assert len(program.inputs) == sum(isinstance(x, torch.Tensor) for x in pytree.tree_leaves(inputs))


# ops whose lowering for a target once disagreed with eager on TOSA's reference model: a gather
# of index -1, exp2 through tosa.pow, f32 batch-norm means, a bool constant tosa-opt could not
# read, f16/bf16 convolution biases added after rounding
REFERENCE_OPS = ["aten.masked_scatter.default", "aten.exp2.default", "aten._native_batch_norm_legit.no_stats",
                 "aten.logcumsumexp.default", "aten.convolution.default"]


@pytest.mark.parametrize("op", REFERENCE_OPS)
def test_reference_model_agrees_with_eager(op: str) -> None:
    """Every sample of the op that TOSA-1.0+FP+INT+bf16 takes, run on the reference model."""
    aim, checked = Target.parse("TOSA-1.0+FP+INT+bf16"), 0
    for e, s in CASES:
        if e.op != op or s.raises or s.unsupported:
            continue
        torch.manual_seed(0)
        args = make_args(e, s)
        if any(t.dtype == torch.float64 for t in _tensors(args)):
            continue
        try:
            program = lower_op(entry_for(e), args, aim)
        except (Unsupported, NotConformant):
            continue
        check_results(e, s, program.reference(*_tensors(args)), args)
        checked += 1
    assert checked > 0
