"""The optimizing lowering (opt="default") against the reference (opt="none") and eager.

Every other test file compiles with the default, so the whole suite runs through the schedule;
these tests pin down what the schedule does and that the optimization levels are selectable.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mlir import ir
from torch import nn

import torchtosa
from torchtosa import pipeline
from torchtosa.execute import _prepare
from torchtosa.schedule import MATMUL_TILE, VECTOR_WIDTH, _divisor, plan


def _linalg(fn: Any, *args: torch.Tensor, opt: str = "default", stop_before: str = "bufferize") -> ir.Module:
    """The module of `fn` lowered up to the stage `stop_before`."""
    program = torchtosa.to_tosa(fn, *args)
    module = _prepare(program.module, "forward", tuple(program.inputs), tuple(program.outputs))
    pipeline.lower(module, opt, stop_before=stop_before)
    return module


def _ops(module: ir.Module) -> list[str]:
    names: list[str] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        names.append(op.name)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return names


def test_divisor() -> None:
    assert [_divisor(n, 8) for n in (1, 7, 8, 12, 64, 197)] == [1, 7, 8, 6, 8, 1]


def test_matmul_becomes_outer_products() -> None:
    ops = _ops(_linalg(torch.mm, torch.randn(16, 24), torch.randn(24, 64)))
    assert "linalg.batch_matmul" not in ops and "linalg.matmul" not in ops
    assert "vector.fma" in ops  # the outer products of the register tile
    reference = _ops(_linalg(torch.mm, torch.randn(16, 24), torch.randn(24, 64), opt="none"))
    assert "linalg.batch_matmul" in reference and not any(n.startswith("vector.") for n in reference)


def test_tile_sizes_divide_loops() -> None:
    seen: list[tuple[str, tuple[int, ...]]] = []
    module = _linalg(lambda a, b: torch.relu(a @ b).sum(-1), torch.randn(2, 12, 10), torch.randn(2, 10, 40),
                     stop_before="schedule")

    def visit(op: ir.Operation) -> ir.WalkResult:
        tiling = plan(op)
        if tiling is not None:
            seen.append((op.name, tiling[0]))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    # a batch matmul (generalized by elementwise fusion): 12 rows -> tile 6, 40 columns -> 20
    assert ("linalg.generic", (1, 6, 20, 1)) in seen
    assert all(s[-1] <= max(VECTOR_WIDTH, MATMUL_TILE[1]) for _, s in seen)


def test_unscheduled_ops_stay_loops() -> None:
    """bf16 vectors crash LLVM's x86 backend: such ops keep the reference lowering."""
    x = torch.randn(4, 80, dtype=torch.bfloat16)
    assert not any(n.startswith("vector.") for n in _ops(_linalg(torch.tanh, x)))
    torch.testing.assert_close(torchtosa.compile(torch.tanh, x)(x), torch.tanh(x))


MODELS = {
    "mlp": lambda: (nn.Sequential(nn.Linear(40, 96), nn.GELU(), nn.Linear(96, 24)), (torch.randn(10, 40),)),
    "conv": lambda: (
        nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                      nn.Conv2d(16, 8, 3, stride=2), nn.ReLU()),
        (torch.randn(2, 3, 20, 20),),
    ),
    "encoder": lambda: (nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0),
                        (torch.randn(2, 9, 32),)),
    "softmax_layernorm": lambda: (nn.Sequential(nn.LayerNorm(70), nn.Softmax(-1)), (torch.randn(3, 5, 70),)),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_levels_agree_with_eager(name: str) -> None:
    torch.manual_seed(0)
    model, inputs = MODELS[name]()
    model.eval()
    with torch.no_grad():
        expected = model(*inputs)
        for opt in pipeline.OPT_LEVELS:
            torch.testing.assert_close(torchtosa.compile(model, *inputs, opt=opt)(*inputs), expected,
                                       rtol=1e-5, atol=1e-5)


def test_opt_is_checked() -> None:
    with pytest.raises(ValueError, match="unknown optimization level 'fast'"):
        torchtosa.compile(torch.relu, torch.randn(3), opt="fast")
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown torchtosa backend options"):
        torch.compile(torch.relu, backend="torchtosa", options={"tile": 4})(torch.randn(3))
    torch._dynamo.reset()
    x = torch.randn(5, 7)
    got = torch.compile(lambda t: t.exp() @ t.T, backend="torchtosa", options={"opt": "none"})(x)
    torch.testing.assert_close(got, x.exp() @ x.T)
    torch._dynamo.reset()


def test_cache_is_per_level() -> None:
    f = nn.Linear(8, 8).eval()
    x = torch.randn(2, 8)
    a = torchtosa.compile(f, x, opt="none")
    b = torchtosa.compile(f, x, opt="default")
    assert a.prepare(x)[2] is not b.prepare(x)[2]
    assert torchtosa.compile(f, x, opt="none").prepare(x)[2] is a.prepare(x)[2]
