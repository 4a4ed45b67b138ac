"""The optimizing lowering (opt="default") against the reference (opt="none") and eager.

Every other test file compiles with the default, so the whole suite runs through the schedule;
these tests pin down what the schedule does and that the optimization levels are selectable.
"""

from __future__ import annotations

import concurrent.futures
import importlib.metadata
import itertools
import math
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from mlir import ir
from test_cpu import _llc, _lowered
from torch import nn

import torchtosa
from torchtosa.cpu import Cpu, select, table
from torchtosa.errors import CompileError
from torchtosa.execute import native as execute
from torchtosa.execute.native import _prepare
from torchtosa.lower import amx, contractions, pipeline, schedule, vecmath
from torchtosa.lower.contractions import fold_transposes, sum_of_products
from torchtosa.lower.irutil import context, find_ops
from torchtosa.lower.schedule import _column_divisor, _divisor, _peel_rows, collapse_reductions, plan
from torchtosa.lower.tiles import DOT_MAX_ROWS, derive
from torchtosa.lower.zero_init import zero_accumulators


def _linalg(fn: Any, *args: torch.Tensor, opt: str = "default", stop_before: str | None = "bufferize") -> ir.Module:
    """The module of `fn` lowered up to the stage `stop_before`."""
    program = torchtosa.to_tosa(fn, *args, target=None)
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


def _planned(module: ir.Module, cpu: Cpu | None = None) -> list[tuple[str, tuple[int, ...]]]:
    return [(op.name, tiling[0]) for op, tiling in schedule.plans(module, derive(cpu or select()))]


def test_divisor() -> None:
    assert [_divisor(n, 8) for n in (1, 7, 8, 12, 64, 197)] == [1, 7, 8, 6, 8, 1]


def test_column_tiles_are_powers_of_two() -> None:
    """24 or 48 columns are tiled by 8 or 16 (tiles of 24 or 48 ran 10x slower), 12 by itself."""
    assert [_column_divisor(n, 32) for n in (24, 144, 48, 96, 40, 12, 7)] == [8, 16, 16, 32, 8, 12, 7]


def test_matmul_becomes_outer_products() -> None:
    ops = _ops(_linalg(torch.mm, torch.randn(16, 24), torch.randn(24, 64)))
    assert "linalg.batch_matmul" not in ops and "linalg.matmul" not in ops
    assert "vector.fma" in ops  # the outer products of the register tile
    reference = _ops(_linalg(torch.mm, torch.randn(16, 24), torch.randn(24, 64), opt="none"))
    assert "linalg.batch_matmul" in reference and not any(n.startswith("vector.") for n in reference)


@pytest.mark.parametrize("cpu", sorted(table()))
def test_tile_sizes_divide_loops(cpu: str) -> None:
    tiles = derive(table()[cpu])
    module = _linalg(lambda a, b: torch.relu(a @ b).sum(-1), torch.randn(2, 12, 10), torch.randn(2, 10, 40),
                     stop_before="schedule")
    seen = _planned(module, table()[cpu])
    # a batch matmul (generalized by elementwise fusion): 12 rows -> tile 6 of 8 rows (AVX-512),
    # 4 of 4 (AVX2); 40 columns -> 8 (a power of two: `_column_divisor`)
    rows, columns = tiles.matmul
    assert ("linalg.generic", (1, _divisor(12, rows), _column_divisor(40, columns), 1)) in seen
    assert all(s[-1] <= max(tiles.vector, columns) for _, s in seen)


def test_half_precision_is_vectorized_in_f32() -> None:
    """bf16 arithmetic on vectors crashes LLVM's x86 backend: the schedule vectorizes bf16 values
    only as loaded and extended to f32 or truncated and stored, and computes bf16 arithmetic in
    f32, rounded after each op (`half.widen_arithmetic`: as LLVM computes a scalar bf16 op and
    PyTorch a bf16 kernel, so fused ops equal eager's bit for bit); bf16 products into f32 sums
    run as dot products (up to DOT_MAX_ROWS rows) or over panels extended to f32 as they are packed."""
    x, y = torch.randn(4, 80, dtype=torch.bfloat16), torch.randn(4, 80, dtype=torch.bfloat16)
    w = torch.randn(48, 80, dtype=torch.bfloat16)

    def chain(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.maximum((a + b) * 3 - a / b, a)

    ops = _ops(_linalg(chain, x, y))
    assert "vector.transfer_read" in ops and "linalg.generic" not in ops  # vectorized: no generic left as loops
    assert torch.equal(torchtosa.compile(chain, x, y)(x, y), chain(x, y))
    assert "vector.transfer_read" in _ops(_linalg(torch.tanh, x))
    torch.testing.assert_close(torchtosa.compile(torch.tanh, x)(x), torch.tanh(x))
    many = torch.randn(DOT_MAX_ROWS + 4, 80, dtype=torch.bfloat16)
    for rows, vectorized in ((x[:1], "vector.reduction"), (x, "vector.reduction"), (many, "vector.fma")):
        ops = _ops(_linalg(lambda a, b: a @ b.t(), rows, w))
        assert vectorized in ops and not any(n.endswith("matmul") for n in ops)
        torch.testing.assert_close(torchtosa.compile(lambda a, b: a @ b.t(), rows, w)(rows, w), rows @ w.t())


def test_half_precision_linear_over_channels_last_maps() -> None:
    """ConvNeXt's MLP in bf16: nn.Linear over [1, 56, 56, C] maps, its weight widened to f32 and
    broadcast along the batch of the contraction fusion makes (an IndexError in the schedule,
    which sent a whole bf16 ConvNeXt to PyTorch)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(96, 384), nn.GELU(), nn.Linear(384, 96)).eval().to(torch.bfloat16)
    x = torch.randn(1, 56, 56, 96, dtype=torch.bfloat16)
    with torch.no_grad():
        got = torchtosa.compile(mlp, x, fallback="error")(x).float()
        expected = mlp.float()(x.float())
    torch.testing.assert_close(got, expected, rtol=2**-6, atol=2**-6 * expected.abs().max().item())


@pytest.mark.parametrize("bias", [False, True])
def test_half_precision_convolutions_run_as_f32_convolutions(bias: bool) -> None:
    """A bf16 convolution is widened to f32, convolved and rounded once (as torch's kernel sums
    in f32): the schedule tiles f32 convolutions, where a bf16 one ran as scalar loops (ResNet-50
    in bf16 48x eager's time)."""
    torch.manual_seed(0)
    conv = nn.Conv2d(16, 32, 3, padding=1, bias=bias).eval().to(torch.bfloat16)
    x = torch.randn(1, 16, 12, 12, dtype=torch.bfloat16)
    assert "vector.fma" in _ops(_linalg(conv, x, stop_before="llvm"))
    with torch.no_grad():
        got = torchtosa.compile(conv, x)(x)
        wide = conv.float()
        expected = wide(x.float()).to(torch.bfloat16)  # f32 sums, rounded once
    torch.testing.assert_close(got, expected, rtol=2**-7, atol=1e-3)


def test_half_precision_attention_over_an_odd_number_of_keys_is_vectorized() -> None:
    """A bf16 decoding step's attention over a static KV cache of 31 positions, the query's rotary
    embedding and the scale fused into the scores: the scores' factors are widened to f32 like
    elementwise ops (their sum stays f32), and a tile of 31 becomes 16 with the remainder peeled
    by halves (odd bf16 vectors abort LLVM). Left as loops, these ops took a sixth of a 0.25B
    Llama's bf16 decoding step."""
    torch.manual_seed(0)
    q = torch.randn(1, 16, 1, 64, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 16, 31, 64, dtype=torch.bfloat16) for _ in range(2))
    cos, sin = torch.randn(1, 1, 1, 64, dtype=torch.bfloat16), torch.randn(1, 1, 1, 64, dtype=torch.bfloat16)
    mask = torch.rand(1, 1, 1, 31) > 0.2

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        rotated = torch.cat([-q[..., 32:], q[..., :32]], dim=-1)
        return nn.functional.scaled_dot_product_attention(q * cos + rotated * sin, k, v, attn_mask=mask)

    args = (q, k, v, cos, sin, mask)
    ops = _ops(_linalg(attend, *args))
    assert "linalg.generic" not in ops and "vector.transfer_read" in ops
    torch.testing.assert_close(torchtosa.compile(attend, *args)(*args), attend(*args), atol=2e-2, rtol=2e-2)


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
    with pytest.raises(Exception, match="unknown torchtosa options"):
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
    assert a.prepare(x).run is not b.prepare(x).run
    assert torchtosa.compile(f, x, opt="none").prepare(x).run is a.prepare(x).run


def test_attention_contractions_get_register_tiles() -> None:
    """Elementwise fusion moves attention's scaling (q and k times the scale's root) into
    q @ k^T and the softmax normalization, computed from an input broadcast along k, into
    softmax @ v. The schedule splits both prologues off (each factor computed once, not once per
    register tile: the scaled q was gathered and multiplied at every step of k), leaving plain
    contractions of two inputs, tiled like matmuls. Both agree with eager."""
    q, k, v = (torch.randn(1, 4, 64, 64) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    module = _linalg(sdpa, q, k, v, stop_before="schedule")
    rows, columns = derive(select()).matmul
    tile = (rows, schedule._column_divisor(64, columns), 1)  # (8, 32, 1) with AVX-512
    before = [s for name, s in _planned(module) if name == "linalg.generic" and s[-3:] == tile]
    schedule.split_prologues(module)
    after = [s for name, s in _planned(module) if name == "linalg.generic" and s[-3:] == tile]
    assert (len(before), len(after)) == (1, 2)
    products = find_ops(module, lambda op: sum_of_products(op) is not None)
    assert len(products) == 2 and all(contractions.contraction_of_inputs(op) for op in products)
    torch.testing.assert_close(torchtosa.compile(sdpa, q, k, v)(q, k, v), sdpa(q, k, v), rtol=1e-5, atol=1e-5)


def test_attention_probabilities_are_normalized_row_by_row() -> None:
    """Attention's probabilities (`_safe_softmax` @ v): the normalization that fusion moved into
    the contraction is split off before the row-wise chains are fused, so the chain's last op
    writes the probabilities in the loop over rows that computes their exponentials (a row's
    maximum, sum and quotients while it is in L1), not in a pass over all the scores after it."""
    q, k, v = (torch.randn(1, 2, 96, 64) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    module = _linalg(sdpa, q, k, v)

    def loops_around(op: ir.Operation) -> list[ir.Operation]:
        found, parent = [], op.operation.parent
        while parent is not None and parent.name != "func.func":
            if parent.name in ("scf.for", "scf.forall"):
                found.append(parent)
            parent = parent.parent
        return found

    exps = find_ops(module, lambda op: op.name == "math.exp" or (op.name == "func.call" and "expf" in str(op)))
    quotients = find_ops(module, lambda op: op.name == "arith.divf")
    assert exps and quotients
    rows = loops_around(exps[0])
    assert all(any(a == b for a in rows for b in loops_around(q)) for q in quotients)
    torch.testing.assert_close(torchtosa.compile(sdpa, q, k, v)(q, k, v), sdpa(q, k, v), rtol=1e-5, atol=1e-5)


def _sdpa(mask: str) -> Any:
    """Attention with no mask, a causal one or a boolean [queries, keys] mask (its last argument)."""
    def plain(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v)

    def causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)

    return {"none": plain, "causal": causal, "bool": masked}[mask]


@pytest.mark.parametrize("mask", ["none", "causal", "bool"])
@pytest.mark.parametrize("shape", [(1, 4, 640, 32), (2, 2, 512, 64)])
def test_attention_runs_by_blocks_of_query_rows(shape: tuple[int, ...], mask: str) -> None:
    """Attention whose scores exceed the L2 (`attention.block_attention`) computes them, the
    softmax and the product with v by blocks of query rows, a mask's select in the row chain: no
    op of the scheduled function has the whole [batch x heads, queries, keys] scores any more
    (640 queries leave a last, peeled block on every entry); results equal eager's. Scores that
    fit in the L2 stay whole."""
    torch.manual_seed(0)
    n = shape[2]
    sdpa = _sdpa(mask)
    args = tuple(torch.randn(shape) for _ in range(3)) + ((torch.rand(n, n) > 0.2,) if mask == "bool" else ())
    assert f"x{n}x{n}xf32>" in str(_linalg(sdpa, *args, stop_before="schedule"))
    assert f"x{n}x{n}xf32>" not in str(_linalg(sdpa, *args))
    torch.testing.assert_close(torchtosa.compile(sdpa, *args)(*args), sdpa(*args), rtol=1e-5, atol=1e-5)
    small = tuple(t[:, :, :64] for t in args[:3]) + ((args[3][:64, :64],) if mask == "bool" else ())
    assert "x64x64xf32>" in str(_linalg(sdpa, *small))


def test_blocks_of_attention_agree_with_eager() -> None:
    """Multi-head attention over 700 tokens, attention with a boolean mask with fully masked
    rows (the safe softmax's zeros) and causal attention, all blocked, agree with eager."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(128, 4, batch_first=True).eval()
    x = torch.randn(1, 700, 128)
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(mha, x, x, x)(x, x, x)[0], mha(x, x, x)[0],
                                   rtol=1e-4, atol=1e-5)
    q, k, v = (torch.randn(1, 4, 700, 32) for _ in range(3))
    mask = torch.rand(700, 700) > 0.2
    mask[::97] = False
    masked, causal = _sdpa("bool"), _sdpa("causal")
    want = masked(q, k, v, mask)
    assert (want[:, :, ::97] == 0).all()
    torch.testing.assert_close(torchtosa.compile(masked, q, k, v, mask)(q, k, v, mask), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torchtosa.compile(causal, q, k, v)(q, k, v), causal(q, k, v), rtol=1e-5, atol=1e-5)


class _MergeHeads(nn.Module):
    """Attention's output projection: heads (B, H, S, D) -> (B, S, H * D) -> nn.Linear."""

    def __init__(self, heads: int, dim: int, out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(heads * dim, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, s, d = x.shape
        return self.proj(x.transpose(1, 2).reshape(b, s, h * d))


@pytest.mark.parametrize("shape", [(1, 4, 64, 64), (1, 3, 16, 8)])
def test_reduction_loops_read_as_one_run_are_merged(shape: tuple[int, ...]) -> None:
    """Fusion moves the head merge into the projection, a contraction over (head, head dim):
    the schedule merges the two reduction loops so that it tiles as a matmul, whose one
    reduction loop the register tile needs."""
    model = _MergeHeads(shape[1], shape[3], 40).eval()
    x = torch.randn(*shape)
    module = _linalg(model, x, stop_before="schedule")

    def generic_contractions() -> list[ir.Operation]:
        return find_ops(module, lambda op: sum_of_products(op) is not None)

    def reductions() -> list[int]:
        return [str(op.attributes["iterator_types"]).count("reduction") for op in generic_contractions()]

    assert reductions() == [2]
    schedule.collapse_reductions(module)
    assert reductions() == [1]
    (contraction,) = generic_contractions()
    rows, columns = derive(select()).matmul
    m = shape[0] * shape[2]
    row_tile = rows if _peel_rows(m, rows) else _divisor(m, rows)
    assert plan(contraction)[0][:2] == (row_tile, _column_divisor(40, columns))
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(model, x)(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shapes", [((5, 6, 3), [5, 6, 3], (5, 6, 3), 0.7), ((1, 2, 3, 4), [2, 3, 4], (2, 3, 4), 0.8)],
                         ids=["all-dims", "inner-dims"])
def test_sum_of_squares_over_several_dims_is_merged(shapes: tuple) -> None:
    """rms_norm over several dims sums x * x, one input read twice: the merged contraction reads
    it twice too (it indexed a body argument that did not exist: IndexError, issue 31)."""
    x_shape, normalized, w_shape, eps = shapes
    x, w = torch.rand(x_shape), torch.rand(w_shape)

    def rms(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.rms_norm(a, normalized, b, eps=eps)

    module = _linalg(rms, x, w, stop_before="schedule")
    squares = find_ops(module, lambda op: sum_of_products(op) is not None)
    assert [str(op.attributes["iterator_types"]).count("reduction") for op in squares] == [len(normalized)]
    schedule.collapse_reductions(module)
    squares = find_ops(module, lambda op: sum_of_products(op) is not None)
    assert [str(op.attributes["iterator_types"]).count("reduction") for op in squares] == [1]
    for opt in pipeline.OPT_LEVELS:
        torch.testing.assert_close(torchtosa.compile(rms, x, w, opt=opt, fallback="error")(x, w), rms(x, w))


def test_linear_weight_is_transposed_panel_by_panel() -> None:
    """nn.Linear's weight is never transposed whole: each column panel is, into a buffer
    reused for every panel."""
    linear = nn.Linear(48, 96).eval()
    x = torch.randn(32, 48)
    shapes = _allocated(_linalg(linear, x, stop_before="llvm"))
    assert not {"memref<48x96xf32>", "memref<1x48x96xf32>"} & set(shapes)  # the whole transposed weight
    assert f"memref<48x{derive(select()).matmul[1]}xf32>" in shapes  # one panel (32 columns with AVX-512)
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(linear, x)(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind,rest", [("linear", False), ("mm", False), ("bmm", False), ("linear", True),
                                       ("mm", True)])
def test_rows_beyond_the_l2_pass_in_blocks_over_a_resident_packed_operand(kind: str, rest: bool) -> None:
    """A contraction whose first operand exceeds half of the L2 and whose second, packed, fits
    in it (`Tiles.resident_operand_bytes`) packs the second whole, once per batch element
    (nn.Linear's weight transposed into its panels), then walks the rows in blocks of
    `Tiles.row_block_bytes`, each block passing over every panel: a [n/tn, k, tn] buffer, never
    the whole transposed weight. A vector of columns beyond the whole panels (`rest`: a ResNet
    1x1 convolution's 256 = 5 x 48 + 16) is packed too, and each block passes over it last."""
    t = derive(select())
    k, columns = 128, t.matmul[1]
    n, m = 4 * columns + (t.lanes if rest else 0), 2 * t.resident_operand_bytes // (4 * k)
    assert schedule._panel_columns(n, t) in (None, columns)
    assert 4 * k * n <= t.resident_operand_bytes < 4 * m * k
    if kind == "linear":
        fn, args = nn.Linear(k, n, bias=False).eval(), (torch.randn(m, k),)
    elif kind == "mm":
        fn, args = torch.mm, (torch.randn(m, k), torch.randn(k, n))
    else:
        fn, args = torch.bmm, (torch.randn(2, m, k), torch.randn(2, k, n))
    shapes = _allocated(_linalg(fn, *args, stop_before="llvm"))
    assert f"memref<{n // columns}x{k}x{columns}xf32>" in shapes
    assert not rest or f"memref<{k}x{t.lanes}xf32>" in shapes  # the rest, packed once
    assert kind != "linear" or f"memref<{k}x{n}xf32>" not in shapes  # the whole transposed weight
    with torch.no_grad():  # sums of 128 products of unit normals (about 11), in another order than eager's
        got = torchtosa.compile(fn, *args, fallback="error")(*args)
        torch.testing.assert_close(got, fn(*args), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", ["linear", "mm", "bmm"])
def test_columns_beyond_whole_panels_are_a_contraction_of_their_own(kind: str) -> None:
    """1000 columns (not a multiple of the register tile's columns) are two contractions: the
    whole panels, packed as any, and the remaining columns. Before, the column tile was their
    largest power-of-two divisor, 8, a fraction of a vector, and a 64 x 512 x 1000 matmul ran at
    half of eager's speed (1040 columns, tiles of 16 peeled, unpacked: 0.65x)."""
    t = derive(select())
    m, k, n = 64, 96, 1000
    columns = schedule._panel_columns(n, t)  # 32 with AVX-512: 48 would leave 40, not whole vectors
    assert columns in (t.matmul[1], t.convolution[1]) and n % columns and n > columns
    if kind == "linear":
        fn, args = nn.Linear(k, n).eval(), (torch.randn(m, k),)
    elif kind == "mm":
        fn, args = torch.mm, (torch.randn(m, k), torch.randn(k, n))
    else:
        fn, args = torch.bmm, (torch.randn(2, m, k), torch.randn(2, k, n))
    shapes = _allocated(_linalg(fn, *args, stop_before="llvm"))
    panel = f"{k}x{columns}xf32" if kind != "bmm" else f"1x{k}x{columns}xf32"
    assert f"memref<{panel}>" in shapes  # a whole panel
    assert f"memref<{k}x{n}xf32>" not in shapes and f"memref<1x{k}x{n}xf32>" not in shapes  # nn.Linear's weight^T
    with torch.no_grad():
        got = torchtosa.compile(fn, *args, fallback="error")(*args)
        torch.testing.assert_close(got, fn(*args), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
def test_few_rows_by_a_large_operand_add_chunks_of_k(bias: bool) -> None:
    """A product of few rows whose second operand is larger than the L2's half and whose output
    fits its quarter (a training step's input gradient, grad @ W) is a loop over chunks of k, each
    chunk's rows of the operand packed from rows read whole, added to the output (with a bias as
    its initial value too). Before, each column panel was copied from rows 4 KiB and more apart,
    from memory, for few row tiles: 32 x 1024 x 1024 at 84 GF/s, 97 now (eager 112)."""
    t = derive(select())
    rows, tn = t.matmul
    n = 4 * tn
    k = 256
    while 4 * k * n <= t.resident_operand_bytes or 4 * k * tn <= t.chunk_panel_bytes:
        k *= 2
    m = 2 * rows
    assert 4 * m * n <= t.row_block_bytes
    chunk = schedule.k_chunk(m, n, k, tn, t)
    assert chunk is not None and k % chunk == 0 and chunk < k
    a, b, c = torch.randn(m, k), torch.randn(k, n), torch.randn(n)
    fn, args = (torch.addmm, (c, a, b)) if bias else (torch.mm, (a, b))
    module = _linalg(fn, *args, stop_before="llvm")
    assert f"memref<{n // tn}x{chunk}x{tn}xf32>" in _allocated(module)  # a chunk's rows, packed
    assert f"memref<{k}x{tn}xf32>" not in _allocated(module)  # no panel of all of k
    got = torchtosa.compile(fn, *args, fallback="error")(*args)
    torch.testing.assert_close(got, fn(*args), rtol=1e-5, atol=1e-3)


def _allocated(module: ir.Module) -> list[str]:
    """The types of the buffers `module` (bufferized) allocates."""
    shapes: list[str] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in ("memref.alloc", "memref.view"):
            shapes.append(str(op.results[0].type))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return shapes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 4, 6, 48), (1, 2, 3, 4, 48)])
def test_linear_on_feature_map_is_a_packed_matmul(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """nn.Linear on a [1, H, W, C] feature map (ConvNeXt's pointwise MLP): fusion moves the
    reshape to rows through the matmul, leaving a generic over the rows' own dims that read the
    whole transposed weight; `contractions.normalize` makes it a named matmul again, whose
    weight is transposed panel by panel (stage-3 ConvNeXt MLP: 2.6x faster). A bf16 one's
    factors are extended to f32 in the generic: the named matmul takes the bf16 operands, and
    its panels are extended as they are packed."""
    linear = nn.Linear(48, 96).eval().to(dtype)
    x = torch.randn(*shape, dtype=dtype)
    module = _linalg(linear, x, stop_before="schedule")
    assert any(sum_of_products(op) is not None for op in find_ops(module, lambda op: op.name == "linalg.generic"))
    contractions.normalize(module)
    assert "linalg.matmul" in _ops(module)
    assert not any(sum_of_products(op) is not None for op in find_ops(module, lambda op: op.name == "linalg.generic"))
    shapes = _allocated(_linalg(linear, x, stop_before="llvm"))
    assert not [s for s in shapes if "48x96" in s or "96x1x48" in s or "96x48" in s]  # the whole weight
    assert f"memref<48x{derive(select()).matmul[1]}xf32>" in shapes  # one panel
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(linear, x)(x), linear(x),
                                   **({"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}))


class _Heads(nn.Module):
    """A prefill's query projection viewed as attention heads and rotated (as Llama's rotary
    embedding mixes each head's halves), the heads then read back by an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(*x.shape[:2], 4, 64).transpose(1, 2)
        rotated = q + torch.cat([-q[..., 32:], q[..., :32]], dim=-1)
        return self.o(rotated.transpose(1, 2).reshape(x.shape))


@pytest.mark.parametrize("tokens", [DOT_MAX_ROWS, 2 * DOT_MAX_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_projections_of_several_rows_read_the_weight_by_panels_or_as_stored(dtype: torch.dtype,
                                                                                 tokens: int) -> None:
    """Projections of several tokens to and from attention heads: fusion leaves generic
    contractions whose columns (or k) are (heads, head_dim), reading the weight viewed so and
    transposed (the heads merged again by `collapse_outputs`). `contractions.normalize` reads that
    as the weight's transpose, which packing takes panel by panel, or, for a few rows, dot
    products read as stored; before, each whole weight was transposed at every call (a 4-layer
    Llama of hidden size 1024, 8-token prefill, one thread: f32 0.81x -> 0.52x eager's time, bf16
    1.6x -> 1.16x)."""
    model = _Heads().eval().to(dtype)
    x = torch.randn(1, tokens, 256, dtype=dtype)
    shapes = _allocated(_linalg(model, x, stop_before="llvm"))
    assert not [s for s in shapes if re.search(r"<(256x256|256x4x64|4x64x256)x", s)]  # the whole weight
    panel = f"memref<256x{derive(select()).matmul[1]}xf32>"
    # AMX and vdpbf16ps read a bf16 weight as stored
    pairs = dtype == torch.bfloat16 and (select().bf16_matmul == "amx" or select().bf16_dot == "avx512_bf16")
    assert (panel in shapes) == (tokens > DOT_MAX_ROWS and not pairs)  # one panel, or none
    with torch.no_grad():
        got = torchtosa.compile(model, x)(x)
        if dtype == torch.float32:
            torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
        else:  # rounded to bf16 three times (q, its rotation, the output): within 4 ulps of the exact result
            exact = model.double()(x.double())
            torch.testing.assert_close(got.double(), exact, rtol=2**-6, atol=2**-6 * exact.abs().max().item())


class _ProjectionAndScores(nn.Module):
    """A projection of 132 rows (6-row tiles) and attention scores of 33 queries (peeled)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.proj(x)
        z = y.view(4, 33, 64)
        return y, z @ z.transpose(1, 2)


def test_matmul_tiles_are_fmas_beside_peeled_ones() -> None:
    """A function with peeled tiles is canonicalized before the others are lowered; a 6-row
    matmul tile vectorized before that must still become a contraction (FMAs), not multiplies
    and adds of shuffled 2-D vectors (an encoder layer on 33 tokens ran 1.6x slower than eager)."""
    model = _ProjectionAndScores().eval()
    x = torch.randn(132, 64)
    module = _linalg(model, x, stop_before="bufferize")
    products: list[ir.Type] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "arith.mulf":
            products.append(op.results[0].type)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    assert not [t for t in products if isinstance(t, ir.VectorType) and ir.VectorType(t).rank > 1]
    assert "vector.fma" in _ops(module)
    with torch.no_grad():
        for got, want in zip(torchtosa.compile(model, x)(x), model(x), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class _Scores(nn.Module):
    """Attention's scores over 100 keys: q k^T of 16 heads."""

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-1, -2)


def test_columns_without_a_power_of_two_divisor_are_peeled() -> None:
    """100 columns (no power-of-two divisor from 8 up) are tiled by the register tile's columns
    (panels of them, `pack_panels`), the remainder in powers of two, not by their divisor 25
    (vector<25xf32>: attention's scores over 100 keys ran 19x slower than eager): every product
    is on vectors of a power of two of lanes; the result is eager's."""
    q, k = torch.randn(16, 100, 64), torch.randn(16, 100, 64)
    widths = _fma_widths(str(_linalg(_Scores(), q, k, stop_before="bufferize")))
    assert widths and all(w & (w - 1) == 0 for w in widths)
    torch.testing.assert_close(torchtosa.compile(_Scores(), q, k)(q, k), _Scores()(q, k), rtol=1e-5, atol=1e-5)


def _fma_widths(text: str) -> set[int]:
    """The widths of the vectors the register tiles' products (vector.fma) of scheduled IR are on."""
    fmas = [line for line in text.splitlines() if "vector.fma" in line]
    return {int(w) for line in fmas for w in re.findall(r"vector<(?:\d+x)*(\d+)xf32>", line)}


@pytest.mark.parametrize("cpu", ["x86-64-v4", "zen4"])
def test_three_vector_tiles_are_vectorized_a_vector_at_a_time_row_by_row(cpu: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A register tile of three vectors of columns (AVX-512's 8 x 48) is vectorized
    one vector of columns at a time: every product is on one vector (vectorized whole, LLVM
    legalized its loop-carried vector<8x48xf32> element by element, 2 GF/s), and each step of k
    is ordered row by row, a broadcast and then its row's three FMAs (piece after piece, the 8
    broadcasts stayed live, a spill per step). The result is eager's where this machine runs it."""
    monkeypatch.setenv("TORCHTOSA_CPU", cpu)
    t = derive(table()[cpu])
    rows, columns = t.matmul
    assert columns == 3 * t.lanes
    a, b = torch.randn(5 * rows, 64), torch.randn(64, 3 * columns)
    text = str(_linalg(torch.mm, a, b, stop_before="bufferize"))
    assert _fma_widths(text) == {t.lanes}
    steps = [line for line in text.splitlines() if "vector.broadcast" in line or "vector.fma" in line]
    broadcasts = [i for i, line in enumerate(steps) if "vector.broadcast" in line]
    assert len(broadcasts) == rows
    for i in broadcasts:
        name = steps[i].split("=")[0].strip()
        assert all("vector.fma" in line and f"{name}," in line for line in steps[i + 1:i + 4])
    if table()[cpu].runs_here:
        torch.testing.assert_close(torchtosa.compile(torch.mm, a, b)(a, b), a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cpu", [name for name in ("x86-64-v3", "x86-64-v4") if table()[name].runs_here])
@pytest.mark.parametrize("n,rows", [(61, 37), (61, 13), (29, 37), (12, 37), (5, 13)])
def test_column_remainders_are_tiles_of_powers_of_two(n: int, rows: int, cpu: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Columns without a power-of-two divisor from 8 up, and not a power of two, end in tiles of
    the powers of two below the register tile's (61 = 32 + 16 + 8 + 4 + 1; nn.Linear(300, 61)
    packs 32 and multiplies the other 29 apart): a tile of 29 columns kept its loop-carried
    vector<8x29xf32> accumulators in scalars, and RexNet's 1x1 convolution to 61 channels ran 8.8x
    slower than eager's (2.7 ms -> 0.34 ms for its 784 x 300 x 61 product, Zen 4). Eager's values:
    the remainder's tiles start from zero (zero_init.py sees through the casts peeling makes; it
    didn't at first, and AVX2's 61 x 13 read 12 columns of garbage)."""
    monkeypatch.setenv("TORCHTOSA_CPU", cpu)
    model = nn.Linear(300, n, bias=False).eval()
    x = torch.randn(rows, 300)
    text = str(_linalg(model, x, stop_before="bufferize"))
    widths = _fma_widths(text)
    assert widths and all(w & (w - 1) == 0 for w in widths), sorted(widths)
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(model, x)(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [100, 80])
def test_rows_of_odd_length_are_vectorized_by_whole_registers(n: int) -> None:
    """A softmax over rows of 100 is tiled by one vector register, the remainder peeled, not by
    the divisor 50 (vector<50xf32>: 5x slower than eager); rows of 80 by whole registers with
    nothing to peel (a peel of an exact multiple fails in the transform). Eager's values."""
    lanes = derive(select()).lanes
    x = torch.randn(64, n)
    text = str(_linalg(lambda t: t.softmax(-1), x, stop_before="bufferize"))
    assert f"vector<{lanes}xf32>" in text and not re.search(rf"vector<{n // 2}xf32>", text)
    torch.testing.assert_close(torchtosa.compile(lambda t: t.softmax(-1), x)(x), x.softmax(-1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", [(1, 6, 5, 16), (1, 40), (4096,), (96, 64)])
@pytest.mark.parametrize("fn", [lambda a: a * 2 + 1, lambda a: a.relu(),
                                lambda a: a.reshape(-1, 8) @ a.reshape(-1, 8).mT], ids=["add", "relu", "mm"])
def test_results_are_computed_in_the_output(shape: tuple[int, ...], fn: Callable) -> None:
    """Dropping unit dims makes a [1, H, W, C] result a view of an [H, W, C] buffer, and a tiled
    result is a loop's (whose initial value buffer-results-to-out-params does not replace), both
    computed in a buffer of their own and copied into the output argument (`x + 1` on 4.8 MB ran
    at half eager's speed, a 4 MiB relu at 0.4x): the output argument, reshaped, is that buffer,
    and nothing is copied."""
    x = torch.randn(*shape)
    module = _linalg(fn, x, stop_before=None)
    text = str(module)
    assert "memcpy" not in text and "memrefCopy" not in text  # what a memref.copy lowers to
    torch.testing.assert_close(torchtosa.compile(fn, x)(x), fn(x), rtol=1e-5, atol=1e-5)


def test_intermediate_buffers_share_one_arena() -> None:
    """opt="default" passes all intermediate buffers as one byte buffer (one argument)."""
    model, inputs = MODELS["encoder"]()
    program = torchtosa.to_tosa(model.eval(), *inputs, target=None)
    module = _prepare(program.module, "forward", tuple(program.inputs), tuple(program.outputs))
    assert len(pipeline.lower(module, "default")) == 1
    func = next(op for op in module.body.operations if ir.StringAttr(op.attributes["sym_name"]).value == "forward")
    # each memref argument is 3 + 2 * rank scalars in the LLVM function
    memref_args = [*program.inputs, *program.outputs, *[None]]
    scalars = sum(3 + 2 * (len(spec.shape) if spec else 1) for spec in memref_args)
    assert len(func.regions[0].blocks[0].arguments) == scalars


@pytest.mark.parametrize("seed", range(20))
def test_arena_offsets_never_overlap_live_buffers(seed: int) -> None:
    rng = random.Random(seed)
    buffers = []
    for _ in range(rng.randint(1, 30)):
        first = rng.randint(0, 40)
        buffers.append((first, first + rng.randint(0, 15), rng.choice([1, 4, 64, 100, 4096, 5000])))
    offsets, total = pipeline._assign_offsets(buffers)
    for (_, _, size), offset in zip(buffers, offsets, strict=True):
        assert offset % 64 == 0 and offset + size <= total
    for i, (fi, li, si) in enumerate(buffers):
        for j, (fj, lj, sj) in enumerate(buffers[:i]):
            if fi <= lj and fj <= li:  # live at the same time
                assert offsets[i] + si <= offsets[j] or offsets[j] + sj <= offsets[i], (i, j)
    # disjoint lifetimes share memory
    assert pipeline._assign_offsets([(0, 1, 4096), (2, 3, 4096)]) == ([0, 0], 4096)


VECTOR_MATH = {"exp": torch.exp, "erf": torch.erf, "tanh": torch.tanh, "log": torch.log, "sin": torch.sin,
               "expm1": torch.expm1, "log1p": torch.log1p, "atan": torch.atan}


@pytest.mark.parametrize("name", sorted(VECTOR_MATH))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vector_math_calls_libmvec(name: str, dtype: torch.dtype) -> None:
    """Where libmvec is usable, vectorized math calls it a register at a time; either way the
    results match eager, special values included."""
    fn = VECTOR_MATH[name]
    x = torch.randn(4, 64, dtype=dtype) * 3
    x[0, :8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 100.0, -100.0, 1e-30])
    if name in ("log", "log1p"):
        x[1:] = x[1:].abs()
    calls = [n for n in _ops(_linalg(fn, x, stop_before="bufferize")) if n == "func.call"]
    assert bool(calls) == (vecmath.library(select()) is not None)
    torch.testing.assert_close(torchtosa.compile(fn, x)(x), fn(x), equal_nan=True)


@pytest.mark.parametrize("cpu", [name for name in ("x86-64-v3", "x86-64-v4") if table()[name].runs_here])
@pytest.mark.parametrize("channels,out,stride", [(300, 300, 1), (366, 366, 2), (30, 30, 1), (16, 61, 1), (16, 29, 2)])
def test_convolution_channels_without_whole_registers_are_tiles_of_powers_of_two(
        channels: int, out: int, stride: int, cpu: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A depthwise convolution over a channel count with no divisor of whole registers (RexNet's
    300, 366) is tiled by a power of two and peeled in the powers below, not by its divisor 30
    (vector<8x30xf32> sums in scalars: 300 channels on 28 x 28, 3x3, 1.8x eager's time -> 0.4-0.7x,
    Zen 4); so are a dense convolution's output channels (61: a panel of 32 and 29 in one tile,
    3x3 64 -> 61 -> 64 on 28 x 28 4.8x eager's time -> 1.5x; 29: 8x -> 0.64x). Eager's values."""
    monkeypatch.setenv("TORCHTOSA_CPU", cpu)
    torch.manual_seed(0)
    groups = channels if channels == out else 1
    conv = nn.Conv2d(channels, out, 3, stride=stride, padding=1, groups=groups, bias=groups == 1).eval()
    x = torch.randn(1, channels, 13, 13)
    text = str(_linalg(conv, x, stop_before="bufferize"))
    widths = _fma_widths(text)
    assert widths and all(w & (w - 1) == 0 for w in widths), sorted(widths)
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(conv, x)(x), conv(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vector_math_of_partial_registers_calls_libmvec(dtype: torch.dtype) -> None:
    """Rows of 28 (a 28 x 28 feature map's, 1 AVX-512 register of f32 and 12 lanes) call libmvec
    on whole registers, the last one padded with zeros: LLVM made 28 scalar expf calls of each
    vector<28xf32>, and a SiLU over [1, 300, 28, 28] ran 6.6x slower than eager (664 -> 150 us).
    Special values in the padded register's lanes come out as eager's."""
    x = torch.randn(1, 30, 28, 28, dtype=dtype) * 3
    x[0, 0, 0, 16:28] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 100.0, -100.0,
                                      1e-30, 88.0, -88.0, 1.0, -1.0], dtype=dtype)
    fn = nn.SiLU()
    ops = _ops(_linalg(fn, x, stop_before="bufferize"))
    assert ("math.exp" not in ops) == (vecmath.library(select()) is not None)
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(fn, x)(x), fn(x), equal_nan=True)


def test_parallel_level_runs_column_panels_as_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    """opt="parallel": column panels of large matmuls are an scf.forall (each with its own panel
    buffer), an OpenMP worksharing loop once bufferized; results match eager, also when called
    from several threads. Small matmuls stay on the calling thread."""
    model = nn.Sequential(nn.Linear(48, 96), nn.ReLU(), nn.Linear(96, 64)).eval()
    x = torch.randn(32, 48)
    assert "scf.forall" not in _ops(_linalg(model, x, opt="parallel"))  # 147k multiply-adds: small
    monkeypatch.setattr(schedule, "PARALLEL_MIN_MACS", 0)
    assert "scf.forall" in _ops(_linalg(model, x, opt="parallel"))
    assert "scf.forall" not in _ops(_linalg(model, x, opt="default"))
    assert {"omp.parallel", "omp.wsloop"} <= set(_ops(_linalg(model, x, opt="parallel", stop_before="llvm")))
    compiled = torchtosa.compile(model, x, opt="parallel")
    inputs = [torch.randn(32, 48) for _ in range(8)]
    with torch.no_grad():
        expected = [model(t) for t in inputs]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(compiled, inputs))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_parallel_level_without_openmp_runtime_is_a_compile_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the intel-openmp package, opt="parallel" says what to install instead of failing to link."""

    def missing(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(schedule, "PARALLEL_MIN_MACS", 0)
    monkeypatch.setattr(importlib.metadata, "files", missing)
    execute._load_openmp_runtime.cache_clear()
    try:
        with pytest.raises(CompileError, match="pip install intel-openmp"):
            torchtosa.compile(nn.Linear(8, 8), torch.randn(4, 8), opt="parallel")
    finally:
        execute._load_openmp_runtime.cache_clear()


@pytest.mark.parametrize("shape", [(1, 1, 8, 8, 8), (1, 1, 16, 8, 8), (1, 1, 8, 8, 16), (2, 4, 64, 64, 64)])
def test_softmax_times_values_matches_eager(shape: tuple[int, ...]) -> None:
    """softmax(s) @ v with fully masked rows zeroed (as nn.MultiheadAttention does): fusion moves
    the normalization and the row mask, inputs broadcast along k, into the matmul. Such a
    contraction vectorized as a matmul came out wrong on square 8x8 tiles; the schedule splits
    the normalization off."""
    b, h, m, n, k = shape

    def attend(s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(s, -1)
        return torch.where(torch.isinf(s).logical_not().any(-1, keepdim=True), p, 0.0) @ v

    s, v = torch.randn(b, h, m, k), torch.randn(b, h, k, n)
    torch.testing.assert_close(torchtosa.compile(attend, s, v)(s, v), attend(s, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opt", ["default", "none"])
def test_attention_of_a_query_whose_every_key_is_masked_is_zero(opt: str) -> None:
    """F.scaled_dot_product_attention with a boolean mask: a fully masked query row attends to
    nothing (zeros, as eager), found from its row's max and sum (`_safe_softmax`'s entry), not by
    comparing every score with -inf again."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 6, 8) for _ in range(3))
    mask = torch.rand(2, 1, 6, 6) > 0.4
    mask[..., 2, :], mask[..., 0, :] = False, True

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    assert "tosa.reduce_any" not in str(torchtosa.to_tosa(attend, q, k, v, mask))
    got = torchtosa.compile(attend, q, k, v, mask, opt=opt)(q, k, v, mask)
    torch.testing.assert_close(got, attend(q, k, v, mask), rtol=1e-5, atol=1e-5)
    assert torch.equal(got[:, :, 2], torch.zeros_like(got[:, :, 2]))


SCALED_SHAPES = [(1, 1, 8, 8, 8), (2, 3, 8, 8, 4), (1, 2, 16, 8, 8), (1, 1, 8, 32, 8), (2, 2, 24, 40, 12)]


@pytest.mark.parametrize("shape", SCALED_SHAPES)
def test_scaled_matmul_matches_eager(shape: tuple[int, ...]) -> None:
    """(q * c) @ (k * c)^T, as in scaled dot-product attention: the scaling is fused into the
    contraction, which is tiled as a matmul (square tiles included)."""
    b, h, m, n, k = shape

    def scores(q: torch.Tensor, kt: torch.Tensor) -> torch.Tensor:
        return (q * 0.5) @ (kt * 0.25).transpose(-1, -2)

    q, kt = torch.randn(b, h, m, k), torch.randn(b, h, n, k)
    torch.testing.assert_close(torchtosa.compile(scores, q, kt)(q, kt), scores(q, kt), rtol=1e-5, atol=1e-5)


BROADCAST_CONTRACTIONS = {
    "batched-by-shared": (lambda a, b: a @ b, (torch.randn(3, 8, 8), torch.randn(8, 8))),
    "shared-by-batched": (lambda a, b: a @ b, (torch.randn(8, 8), torch.randn(3, 8, 8))),
    "broadcast-heads": (lambda a, b: a @ b, (torch.randn(2, 3, 8, 8), torch.randn(1, 3, 8, 8))),
    "scaled-broadcast": (lambda a, b: (a * 2) @ (b * 3), (torch.randn(2, 3, 8, 8), torch.randn(1, 3, 8, 8))),
    "row-scaled": (lambda a, s, b: (a * s[..., None]) @ b,
                   (torch.randn(2, 8, 8), torch.randn(2, 8), torch.randn(2, 8, 8))),
    "rotary": (lambda q, c, s, k: ((q * c + q.flip(-1) * s) * 0.3) @ k.transpose(-1, -2),
               (torch.randn(2, 3, 8, 8), torch.randn(8, 8), torch.randn(8, 8), torch.randn(2, 3, 8, 8))),
}


@pytest.mark.parametrize("name", sorted(BROADCAST_CONTRACTIONS))
def test_contractions_with_broadcast_inputs_on_square_tiles(name: str) -> None:
    """Matmuls with broadcast operands, or with broadcast inputs to a fused prologue, on 8x8 tiles
    (where MLIR's vector patterns got a broadcast prologue input's tile transposed)."""
    fn, args = BROADCAST_CONTRACTIONS[name]
    torch.testing.assert_close(torchtosa.compile(fn, *args)(*args), fn(*args), rtol=1e-5, atol=1e-5)


def _masked_attend(s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(s, -1)
    return torch.where(torch.isinf(s).logical_not().any(-1, keepdim=True), p, 0.0) @ v


def _rotary_scores(q: torch.Tensor, c: torch.Tensor, s: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return ((q * c + q.flip(-1) * s) * 0.3) @ k.transpose(-1, -2)  # flip: linalg.index in the prologue


@pytest.mark.parametrize("seed", range(12))
def test_split_prologues_on_random_shapes(seed: int) -> None:
    """Prologues with broadcast inputs (a row scale, softmax normalization, rotary embeddings)
    split off their contraction, on random sizes (square tiles, tiles of 1, non-divisible)."""
    rng = random.Random(seed)
    b, h = rng.choice([1, 2]), rng.choice([1, 3])
    m, n, k = (rng.choice(sizes) for sizes in ([1, 4, 8, 12, 16, 24], [1, 4, 8, 16, 40], [1, 4, 8, 16]))
    fn, args = [
        (_masked_attend, (torch.randn(b, h, m, k), torch.randn(b, h, k, n))),
        (lambda a, s, w: (a * s[..., None]) @ w, (torch.randn(b, m, k), torch.randn(b, m), torch.randn(b, k, n))),
        (_rotary_scores, (torch.randn(b, h, m, k), torch.randn(m, k), torch.randn(m, k), torch.randn(b, h, n, k))),
    ][seed % 3]
    torch.testing.assert_close(torchtosa.compile(fn, *args)(*args), fn(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opt", ["default", "parallel"])
@pytest.mark.parametrize(("name", "in_features", "shape"), [("row", 256, (1, 256)), ("token", 64, (1, 1, 64)),
                                                            ("odd_k", 30, (1, 30))])
def test_vector_matrix_products_read_the_weight_as_dot_products(name: str, in_features: int, shape: tuple[int, ...],
                                                                 opt: str) -> None:
    """One row times nn.Linear's weight (a decoding step): the weight is read as stored, rows
    along k, as dot products with vector partial sums, never transposed; where k is not whole
    vectors, the packed panels stay. Both agree with eager."""
    linear = nn.Linear(in_features, 40).eval()
    x = torch.randn(*shape)
    ops = _ops(_linalg(linear, x, opt=opt, stop_before="bufferize"))
    dot = in_features % derive(select()).lanes == 0
    assert ("vector.multi_reduction" in ops or "vector.reduction" in ops) == dot  # partial sums summed across lanes
    assert "linalg.transpose" not in ops
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(linear, x, opt=opt)(x), linear(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("opt", ["default", "parallel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_vector_matrix_products_read_their_rows_as_streams(dtype: torch.dtype, opt: str) -> None:
    """A weight larger than the L2 cache (a decoding step's, from memory) is read as `Tiles.dot[0]`
    sequential streams: the columns of a register tile are rows N/streams apart (the weight
    viewed [streams, N/streams, K]; in the `bf16_dot` kernel, its column tiles' rows so apart); a
    smaller one keeps adjacent rows. Both agree with eager."""
    tiles = derive(select())
    streams, k = tiles.dot[0], 256
    big = -(-2 * tiles.streamed_matrix_bytes // (k * dtype.itemsize) // 64) * 64  # twice the threshold
    pairs = dtype == torch.bfloat16 and select().bf16_dot == "avx512_bf16"  # `schedule._bf16_dot_product`
    for n, interleaved in ((big, True), (64, False)):
        linear = nn.Linear(k, n, bias=False).to(dtype).eval()
        x = torch.randn(1, k, dtype=dtype)
        text = str(_linalg(linear, x, opt=opt, stop_before="bufferize"))
        if pairs:
            assert ("_streams_" in text) == interleaved
        else:
            assert (f"tensor<{streams}x{n // streams}x{k}x" in text) == interleaved
        with torch.no_grad():
            expected = (x.float() @ linear.weight.float().t()).to(dtype)  # f32 sums, rounded once
            torch.testing.assert_close(torchtosa.compile(linear, x, opt=opt)(x), expected,
                                       **({"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {}))


@pytest.mark.parametrize("cpu", ["zen4", "sapphirerapids"])
def test_large_bf16_products_give_each_thread_a_chunk_of_columns(cpu: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With opt="parallel", a bf16 product of SPLIT_MIN_MACS multiply-adds or more in the
    `bf16_dot` kernel gives each OpenMP thread an equal chunk of its columns (a tile of rows, then
    single rows, each chunk's weight rows from its own offset), a smaller one stays on the calling
    thread; where the entry has AMX (sapphirerapids), products of amx.MIN_ROWS rows or more run on
    its tiles on the calling thread instead. Checked for both entries (compiled only), then run on
    the host's: f32 sums of exact products rounded to bf16 once. (Entries without AVX512-BF16
    have no such kernel: `test_bf16_products_by_a_weight_stored_along_k...` checks they compile
    to f32 FMAs.)"""
    torch.manual_seed(0)
    samples = [(nn.Linear(256, n, bias=False).to(torch.bfloat16).eval(), torch.randn(rows, 256, dtype=torch.bfloat16))
               for rows, n in ((37, 512), (1, 96))]
    monkeypatch.setenv("TORCHTOSA_CPU", cpu)
    entry = select()
    for linear, x in samples:
        (rows, _), n = x.shape, linear.out_features
        on_amx = entry.bf16_matmul == "amx" and rows >= amx.MIN_ROWS and amx.fits(rows, 256, n)
        chunked = not on_amx and schedule.threads() > 1 and rows * n * 256 >= schedule.SPLIT_MIN_MACS
        module = _linalg(linear, x, opt="parallel")
        assert ("tensor.parallel_insert_slice" in _ops(module)) == chunked
        assert (f"@torchtosa_amx_{n}x256x{amx.padded_rows(rows)}" in str(module)) == on_amx
    monkeypatch.delenv("TORCHTOSA_CPU")
    if not entry.runs_here:
        return
    for linear, x in samples:
        expected = x.float() @ linear.weight.float().t()
        with torch.no_grad():
            got = torchtosa.compile(linear, x, opt="parallel", cpu=cpu)(x).float()
        torch.testing.assert_close(got, expected, rtol=2**-8, atol=2**-8 * expected.abs().max().item())


@pytest.mark.parametrize("opt", ["default", "parallel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_of_a_few_rows_read_the_weight_as_dot_products(dtype: torch.dtype, opt: str) -> None:
    """A prefill of a few tokens (up to DOT_MAX_ROWS rows) reads nn.Linear's weight as stored, as
    dot products of register tiles of rows x columns, with no panel packed (8 bf16 rows by a
    1024 x 2816 weight, one thread: 724 -> 576 us, f32 855 -> 619 us; eager 480 and 1300); more
    rows are packed (in f32; bf16 pairs multiplied by `vdpbf16ps` stay dot products, which run at
    twice the f32 FMAs' rate). A weight larger than the L2 cache is read in column tiles of adjacent rows
    (`_interleave_streams` is for one row: with several, MLIR's vectorizer broadcast the weight
    along the wrong dimension of the interleaved tile). All agree with eager."""
    tiles = derive(select())
    big = -(-2 * tiles.streamed_matrix_bytes // (256 * dtype.itemsize) // 64) * 64  # from memory
    for rows, n in ((2, 96), (DOT_MAX_ROWS, 96), (tiles.dot_rows, big), (DOT_MAX_ROWS + 1, 96)):
        linear = nn.Linear(256, n, bias=False).to(dtype).eval()
        x = torch.randn(1, rows, 256, dtype=dtype)
        module = _linalg(linear, x, opt=opt, stop_before="llvm")
        # AMX's one thread with opt="parallel" too (two threads' FMAs are slower)
        on_amx = dtype == torch.bfloat16 and select().bf16_matmul == "amx" and rows >= amx.MIN_ROWS
        pairs = dtype == torch.bfloat16 and select().bf16_dot == "avx512_bf16"  # `bf16_dot`: any number of rows
        dot = (rows <= DOT_MAX_ROWS or pairs) and not on_amx
        packed = not dot and not on_amx
        assert ("vector.reduction" in _ops(module)) == dot
        assert any(re.fullmatch(rf"memref<256x{tiles.matmul[1]}xf32>", s) for s in _allocated(module)) == packed
        with torch.no_grad():
            expected = (x.float() @ linear.weight.float().t()).to(dtype)  # f32 sums, rounded once
            torch.testing.assert_close(torchtosa.compile(linear, x, opt=opt)(x), expected,
                                       **({"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {}))


_SCALED_SCORES = """
func.func @f(%q: tensor<16x64xf32>, %s: tensor<f32>, %k: tensor<16x64x?xf32>,
             %init: tensor<16x?xf32>) -> tensor<16x?xf32> {
  %r = linalg.generic {indexing_maps = [affine_map<(d0, d1, d2) -> (d0, d2)>, affine_map<(d0, d1, d2) -> ()>,
                                        affine_map<(d0, d1, d2) -> (d0, d2, d1)>, affine_map<(d0, d1, d2) -> (d0, d1)>],
                       iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%q, %s, %k : tensor<16x64xf32>, tensor<f32>, tensor<16x64x?xf32>) outs(%init : tensor<16x?xf32>) {
  ^bb0(%a: f32, %b: f32, %c: f32, %o: f32):
    %0 = arith.mulf %a, %b : f32
    %1 = arith.mulf %0, %c : f32
    %2 = arith.addf %o, %1 : f32
    linalg.yield %2 : f32
  } -> tensor<16x?xf32>
  return %r : tensor<16x?xf32>
}
"""


def test_a_product_with_a_scalar_factor_is_scheduled() -> None:
    """One query's scores against a cache of a symbolic length, scaled by a 0-d tensor (a Llama
    decoding step with the dynamic cache): a factor read along no loop is not a dot product's
    vector (looking for its k loop raised an IndexError, and every decoding step ran eagerly)."""
    with context():
        module = ir.Module.parse(_SCALED_SCORES)
        (op,) = find_ops(module, lambda op: op.name == "linalg.generic")
        assert schedule._dot_loops(op) is None
        schedule.schedule(module)
        module.operation.verify()


def test_one_query_attention_scores_are_dot_products() -> None:
    """q @ k^T for one query reads k as stored (the KV cache), as dot products."""
    def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return q @ k.transpose(-1, -2)

    q, k = torch.randn(2, 4, 1, 64), torch.randn(2, 4, 10, 64)
    assert "linalg.transpose" not in _ops(_linalg(scores, q, k, stop_before="bufferize"))
    torch.testing.assert_close(torchtosa.compile(scores, q, k)(q, k), scores(q, k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, DOT_MAX_ROWS, DOT_MAX_ROWS + 1])
@pytest.mark.parametrize("batch", [1, 2])
def test_products_read_a_matrix_in_any_storage_order(rows: int, batch: int) -> None:
    """`q @ k.permute(...)` for every order the second factor [B, H, N, K] may be stored in,
    K innermost or not: attention over a few queries whose k comes from a projection viewed as
    [B, S, H, D] (T5's decoder; S, the columns, outside H) read k as dot products of tiles that
    MLIR's vectorizer broadcast along the wrong dimension (scores 15 off). All equal eager's."""
    torch.manual_seed(0)
    sizes = {"b": batch, "h": 3, "n": 8, "k": 16}
    q = torch.randn(batch, 3, rows, 16)
    for order in ("".join(o) for o in itertools.permutations("bhnk")):
        stored = torch.randn(*(sizes[d] for d in order))
        perm = [order.index(d) for d in "bhkn"]

        def scores(q: torch.Tensor, k: torch.Tensor, perm: list[int] = perm) -> torch.Tensor:
            return q @ k.permute(*perm)

        torch.testing.assert_close(torchtosa.compile(scores, q, stored)(q, stored), scores(q, stored),
                                   rtol=1e-5, atol=1e-5, msg=lambda m, o=order: f"k stored as {o}: {m}")


def _head_projections(x: torch.Tensor, wq: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """One token's query projection viewed as attention heads, and the output projection reading
    the heads back, as a Llama decoding step computes them (the attention between left out)."""
    q = (x @ wq.t()).view(1, 1, 8, 32).transpose(1, 2)
    return torch.tanh(q).transpose(1, 2).reshape(1, 1, 256) @ wo.t()


def test_one_token_head_projections_read_their_weights_as_dot_products() -> None:
    """Fusion moves the view to heads into the projection, which then read a whole transpose of
    its weight, made at every call (twice as slow as eager per decoding step of a 0.25B Llama);
    the transposes fold into the products' indexing maps, which read the weights as stored."""
    x, wq, wo = torch.randn(1, 1, 256), torch.randn(256, 256), torch.randn(256, 256)
    module = _linalg(_head_projections, x, wq, wo, stop_before="schedule")
    with module.context, ir.Location.unknown():
        fold_transposes(module)
        collapse_reductions(module)
    products = [op for op, _ in schedule.plans(module) if schedule._dot_loops(op) is not None]
    assert len(products) == 2
    weights = [op for op in find_ops(module, lambda op: op.name == "linalg.transpose")
               if math.prod(ir.RankedTensorType(op.operands[0].type).shape) == wq.numel()]
    assert not weights
    torch.testing.assert_close(torchtosa.compile(_head_projections, x, wq, wo)(x, wq, wo),
                               _head_projections(x, wq, wo), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_head_projections_read_their_rows_as_streams(dtype: torch.dtype) -> None:
    """One token's projection viewed as attention heads (q = x @ W.t() viewed [heads, head_dim]),
    of a weight larger than the L2: its two output loops become one (`_collapse_outputs`), so it is
    read as `Tiles.dot[0]` long streams like a plain linear layer's (it was 4-row tiles of each
    head: a bf16 Llama's q, k and v projections streamed at a third of the speed)."""
    tiles = derive(select())
    streams, k, heads = tiles.dot[0], 256, 16
    n = -(-2 * tiles.streamed_matrix_bytes // (k * dtype.itemsize) // 64) * 64

    def project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x @ w.t()).view(1, 1, heads, n // heads).transpose(1, 2)

    x, w = torch.randn(1, 1, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    assert f"tensor<{streams}x{n // streams}x{k}x" in str(_linalg(project, x, w, stop_before="bufferize"))
    expected = (x.float() @ w.float().t()).to(dtype).view(1, 1, heads, n // heads).transpose(1, 2)
    torch.testing.assert_close(torchtosa.compile(project, x, w)(x, w), expected,
                               **({"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {}))


@pytest.mark.parametrize(("m", "k", "n"), [(512, 64, 256), (37, 5, 40), (64, 300, 96)])
def test_contractions_start_from_zero_in_registers(m: int, k: int, n: int) -> None:
    """A contraction's zero fill is gone (`zero_init`): no loop writes zeros into its output
    (a [512 x 64] x [64 x 2048] weight gradient's fill and read-back of 4 MiB took 0.3 of its
    1.6 ms), its register tiles' accumulators start from zero vectors, and it equals eager's."""
    a, b = torch.randn(k, m), torch.randn(k, n)

    def weight_gradient(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.t() @ b

    module = _linalg(weight_gradient, a, b)
    writes = find_ops(module, lambda op: op.name == "vector.transfer_write")
    assert writes and not any(isinstance(w.operands[0], ir.OpResult) and w.operands[0].owner.name == "arith.constant"
                              for w in writes)
    starts = [v for loop in find_ops(module, lambda op: op.name == "scf.for") for v in list(loop.operands)[3:]
              if isinstance(v.type, ir.VectorType)]
    assert starts and all(v.owner.name == "arith.constant" for v in starts)
    assert "bufferization.alloc_tensor" not in _ops(module)
    # sums of up to 300 products in another order than eager's (MKL's AVX2 kernel's too)
    torch.testing.assert_close(torchtosa.compile(weight_gradient, a, b)(a, b), weight_gradient(a, b),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("pool", [nn.MaxPool2d(3, 2, 1), nn.AvgPool2d(3, 2, 1), nn.MaxPool2d(2)])
def test_poolings_are_tiled_and_vectorized_as_depthwise_convolutions(pool: nn.Module) -> None:
    """A pooling is tiled as a depthwise convolution (output columns x channels, one window row
    and tap at a time, decomposed to 1-D and vectorized), not left to plain loops over its window
    (a ResNet's 3 x 3 max pooling of 8 x 64 x 112 x 112 at twice eager's NHWC time); a max
    pooling pads with -inf itself, with no mask pooled alongside for windows of -inf only."""
    x = torch.randn(2, 112, 112, 64)  # channels last, as between a network's convolutions

    def channels_last(y: torch.Tensor) -> torch.Tensor:
        return pool(y.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)

    planned = [name for name, _ in _planned(_linalg(channels_last, x, stop_before="schedule"))]
    assert any(name.startswith("linalg.pooling_nhwc") for name in planned)
    lowered = _linalg(channels_last, x, stop_before="llvm")
    assert not [name for name in _ops(lowered) if name.startswith("linalg.pooling")]  # tiled and vectorized
    assert "xi8>" not in str(lowered)  # no mask
    x[0, 0, :3, :] = float("-inf")  # windows of -inf and padding
    torch.testing.assert_close(torchtosa.compile(channels_last, x)(x), channels_last(x), rtol=1e-6, atol=1e-6)


def test_depthwise_convolutions_start_from_zero_in_registers() -> None:
    """A depthwise convolution's zero fill is gone too: each register tile of output pixels keeps
    its sums in registers over every filter tap, so nothing writes zeros into its output first
    (9 of MobileNetV2's 13 depthwise outputs; the rest, with remainder tiles, keep their fill),
    and it equals eager's. (A dense convolution starts from its bias, broadcast into the output,
    which TOSA's lowering makes of a zero bias too.)"""
    torch.manual_seed(0)
    conv = nn.Conv2d(32, 32, 3, stride=2, groups=32, bias=False).eval()
    x = torch.randn(2, 32, 33, 33)
    module = _linalg(conv, x)
    writes = find_ops(module, lambda op: op.name == "vector.transfer_write")
    assert writes and not any(isinstance(w.operands[0], ir.OpResult) and w.operands[0].owner.name == "arith.constant"
                              for w in writes)
    assert "linalg.fill" not in _ops(module) and "bufferization.alloc_tensor" not in _ops(module)
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(conv, x)(x), conv(x), rtol=1e-5, atol=1e-5)


DROPPED_FILL_READS = {
    # a read that starts no loop's accumulators (none the schedule makes)
    "elsewhere": """
            %v = vector.transfer_read %acc[%c0], %pad {in_bounds = [true]} : tensor<8xf32>, vector<4xf32>
            %s = arith.addf %v, %x : vector<4xf32>""",
    # a reduction loop's accumulators read inside an outer reduction loop (a filter row's loop around
    # a filter tap's, accumulators not hoisted out of it): each iteration reads what the one before wrote
    "inside its reduction loop": """
            %v = vector.transfer_read %acc[%c0], %pad {in_bounds = [true]} : tensor<8xf32>, vector<4xf32>
            %s = scf.for %kw = %c0 to %c3 step %c1 iter_args(%a = %v) -> (vector<4xf32>) {
              %n = arith.addf %a, %x : vector<4xf32>
              scf.yield %n : vector<4xf32>
            }""",
}


@pytest.mark.parametrize("read", sorted(DROPPED_FILL_READS))
def test_a_tensor_of_a_dropped_fill_read_elsewhere_gets_its_fill_back(read: str) -> None:
    """`zero_init.zero_accumulators` replaces only the reads that start a loop's accumulators
    from zero; any other read of the undefined tensor gets a zero fill again, so a change
    elsewhere can make code slower, never wrong. A tile read at the same place in every
    iteration of a loop is no start from zero (a depthwise convolution whose accumulators were
    hoisted out of its filter-tap loop only kept its last filter row's products)."""
    with context():
        module = ir.Module.parse("""
        func.func @f(%x: vector<4xf32>) -> tensor<8xf32> {
          %c0 = arith.constant 0 : index
          %c1 = arith.constant 1 : index
          %c3 = arith.constant 3 : index
          %pad = arith.constant 0.0 : f32
          %t = bufferization.alloc_tensor() {torchtosa.dropped_fill} : tensor<8xf32>
          %r = scf.for %i = %c0 to %c3 step %c1 iter_args(%acc = %t) -> (tensor<8xf32>) {""" \
            + DROPPED_FILL_READS[read] + """
            %w = vector.transfer_write %s, %acc[%c0] {in_bounds = [true]} : vector<4xf32>, tensor<8xf32>
            scf.yield %w : tensor<8xf32>
          }
          return %r : tensor<8xf32>
        }""")
        zero_accumulators(module)
        names = _ops(module)
    assert "linalg.fill" in names and "vector.transfer_read" in names and "bufferization.alloc_tensor" not in names


def _hoisting(innermost: bool) -> Callable[[ir.Module], None]:
    """A `schedule._mark_hoistable` that marks every loop, or the innermost ones only."""
    def mark(module: ir.Module) -> None:
        with module.context:
            for loop in find_ops(module, lambda op: op.name == "scf.for"):
                if not innermost or len(find_ops(loop, lambda op: op.name == "scf.for")) == 1:
                    loop.attributes[schedule._HOIST_ATTR] = ir.UnitAttr.get()
    return mark


HOISTED = {
    "conv": lambda: (nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1)),
                     (1, 16, 30, 30)),
    "depthwise": lambda: (nn.Sequential(nn.Conv2d(300, 300, 3, padding=1, groups=300), nn.Conv2d(300, 61, 1)),
                          (1, 300, 14, 14)),
    "attention": lambda: (nn.TransformerEncoderLayer(64, 4, 128, batch_first=True, dropout=0.0), (2, 33, 64)),
    "linear": lambda: (nn.Linear(300, 61), (37, 300)),
}


@pytest.mark.parametrize("name", sorted(HOISTED))
def test_accumulators_are_hoisted_from_the_loops_that_have_them(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`schedule._mark_hoistable` asks MLIR to hoist accumulators only out of the loops that read
    a loop-carried tile at a place that does not move with them (a tiny Llama's prefill: 0.7 s of
    value-bounds analysis on hundreds of tile loops, for nothing): the code is the same as with
    every loop asked; and with the accumulators hoisted out of the innermost loops only (a
    depthwise convolution's filter taps, not its filter rows) it is slower, not wrong (`zero_init`)."""
    torch.manual_seed(0)
    model, shape = HOISTED[name]()
    model.eval()
    x = torch.randn(*shape)
    marked = str(_linalg(model, x, stop_before="bufferize"))
    monkeypatch.setattr(schedule, "_mark_hoistable", _hoisting(innermost=False))
    assert str(_linalg(model, x, stop_before="bufferize")) == marked
    monkeypatch.setattr(schedule, "_mark_hoistable", _hoisting(innermost=True))
    monkeypatch.setattr(torchtosa.api.CACHE, "entries", {})  # this graph's code, compiled by another test
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(model, x, opt="default")(x), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape, dim", [((4, 32, 56, 56), 2), ((3, 24, 40), 1), ((8, 7, 28), 1)])
def test_accumulators_carried_through_a_reduction_loop_are_powers_of_two(shape: tuple[int, ...], dim: int) -> None:
    """A sum over a loop outside the innermost one carries a vector of the innermost tile through
    that loop; LLVM kept a carried vector<56xf32> in 56 scalars (2.3x eager's time). Each tile is a
    power of two, the remainder peeled into smaller ones (56: 32, 16, 8); eager's values."""
    x = torch.randn(*shape)
    module = _linalg(lambda t: t.sum(dim), x)
    loops = find_ops(module, lambda op: op.name == "scf.for")  # (a tile smaller than the row is not carried)
    widths = {ir.VectorType(r.type).shape[0] for op in loops for r in op.results if isinstance(r.type, ir.VectorType)}
    assert all(w & (w - 1) == 0 for w in widths), widths
    torch.testing.assert_close(torchtosa.compile(lambda t: t.sum(dim), x)(x), x.sum(dim), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fn", [lambda t: t.sum(-1), lambda t: t.amax(-1), lambda t: t.softmax(-1),
                                lambda t: torch.nn.functional.layer_norm(t, t.shape[-1:]), lambda t: t.mean()],
                         ids=["sum", "amax", "softmax", "layer_norm", "mean"])
@pytest.mark.parametrize("shape", [(48, 768), (2, 6, 3136), (48, 770), (2, 6, 577)])
def test_long_rows_reduce_in_vector_partial_results(fn: Callable, shape: tuple[int, ...]) -> None:
    """A reduction along long contiguous rows keeps a vector of partial results through the whole
    row and sums across lanes once, after it (`tile_reduction_using_for`), not at every tile (a
    sum of rows of 12544 ran 5.6x slower than eager); a row of no whole number of registers too,
    its last elements reduced first (`peel_row_remainders`); eager's values."""
    x = torch.randn(*shape)
    module = _linalg(fn, x)
    lanes = derive(select()).lanes

    def carries_a_row(op: ir.Operation) -> bool:
        return op.name == "scf.for" and any(
            isinstance(r.type, ir.VectorType) and ir.VectorType(r.type).shape[0] >= lanes for r in op.results)

    loops = find_ops(module, carries_a_row)
    assert loops, "no loop carries a vector of partial results"
    for loop in loops:
        inside = find_ops(loop.operation, lambda op: op.name == "vector.reduction")
        assert not inside, "a reduction across lanes inside the row loop"
    torch.testing.assert_close(torchtosa.compile(fn, x)(x), fn(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fn", [lambda t: t.amax(-1), lambda t: t.amin(-1), lambda t: t.softmax(-1)],
                         ids=["amax", "amin", "softmax"])
def test_maxima_across_lanes_are_trees(fn: Callable) -> None:
    """A maximum (minimum) across a vector's lanes is a tree of vector maxima of its halves
    (`tree_reductions`), not LLVM's lane-by-lane expansion of an IEEE maximum; NaN rows stay
    NaN, eager's values otherwise."""
    x = torch.randn(64, 64)
    x[3, 17], x[5, 63] = float("nan"), float("nan")
    module = _linalg(fn, x, stop_before="llvm")
    kinds = [str(op.attributes["kind"]) for op in find_ops(module, lambda op: op.name == "vector.reduction")]
    assert not [k for k in kinds if "maximumf" in k or "minimumf" in k], kinds
    torch.testing.assert_close(torchtosa.compile(fn, x)(x), fn(x), rtol=1e-6, atol=1e-6, equal_nan=True)


@pytest.mark.parametrize("fn", [lambda t: t.sum(), lambda t: t.amax(), lambda t: (t * t).mean()],
                         ids=["sum", "amax", "mean_of_squares"])
@pytest.mark.parametrize("n", [1 << 20, 15 * 4096, 1_000_003, 4099])
def test_a_whole_1d_tensor_reduces_in_vector_partial_results(fn: Callable, n: int) -> None:
    """A reduction of a whole 1-D tensor to a scalar (tosa-to-linalg's `linalg.reduce`, which no
    reshape fuses into a generic there) is scheduled as any long row (a serial scalar loop before:
    x.sum() of 2^20 floats 5.4x eager's time, with 10x its error); a row whose length a vector tile
    divides sums in two stages (`_split_long_reduction`), and so does the most of a prime length
    (a short one: its whole vectors), the rest first. Eager's values."""
    x = torch.randn(n)
    module = _linalg(fn, x)
    assert not find_ops(module, lambda op: op.name == "linalg.reduce")
    vector = derive(select()).vector
    carried = find_ops(module, lambda op: op.name == "scf.for" and any(
        isinstance(r.type, ir.VectorType) and ir.VectorType(r.type).shape[:1] == [vector] for r in op.results))
    assert carried, "no loop carries a vector tile of partial results"
    torch.testing.assert_close(torchtosa.compile(fn, x)(x), fn(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1 << 22, 4_194_301])
def test_a_long_sum_to_a_scalar_rounds_as_a_two_stage_sum(n: int) -> None:
    """The two stages bound each partial result's chain of additions by SPLIT_ROW / vector of a
    row plus rows / vector of the second stage: the sum of 2^22 copies of float32(1/3) (each
    addition rounding the same way, so the error grows with the chain) is within that many
    roundings of the exact sum (one stage of vector partial sums: 1.9e-4 relative, a serial loop
    8e-3; eager's cascade 9e-8). A prime length (4194301) is cut after whole rows, and its rest
    summed so first, into the second stage's start (one stage: 7.7e-4)."""
    x = torch.full((n,), 1 / 3)
    tiles = derive(select())
    rows = n // schedule.SPLIT_ROW
    rest = schedule.SPLIT_ROW // tiles.vector if n % schedule.SPLIT_ROW else 0  # the rest's own stages
    chain = schedule.SPLIT_ROW // tiles.vector + rows // tiles.vector + tiles.vector.bit_length() + rest
    exact = x.double().sum().item()
    got = torchtosa.compile(lambda t: t.sum(), x)(x).item()
    assert abs(got - exact) <= chain * 2**-24 * exact


def test_a_sum_over_batch_and_image_reads_the_tensor_once() -> None:
    """A sum over (0, 2, 3) (a batch norm's statistics, a convolution's bias gradient) reads the
    [N, C, H, W] tensor where it is, not TOSA's transpose of it to [C, N, H, W] (a copy of the
    whole tensor: 3x eager's time), as rows of H * W whose partial results stay in vector
    registers; eager's values."""
    x = torch.randn(4, 32, 14, 16)
    fn = lambda t: t.sum((0, 2, 3))  # noqa: E731
    module = _linalg(fn, x)

    def along_a_row(op: ir.Operation) -> bool:
        return (op.name == "scf.for" and any(isinstance(r.type, ir.VectorType) for r in op.results)
                and ir.IntegerAttr(op.operands[1].owner.attributes["value"]).value == 14 * 16)

    assert find_ops(module, along_a_row), "no loop over a row of 14 * 16 carrying vector partial sums"
    assert "tensor<32x4x" not in str(module), "the tensor is transposed first"
    torch.testing.assert_close(torchtosa.compile(fn, x)(x), fn(x), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_transposes_are_vectorized(dtype: torch.dtype, tmp_path: Path) -> None:
    """A bf16 or f16 transpose moves bits: it gets the square tiles an f32 one gets, transposed in
    registers, rather than scalar loops that gather one element at a time (a bf16 Llama's
    attention-head projections transpose their weights so: 8-token prefill 2.8x eager's time
    with them as loops, 1.7x vectorized). Equal to eager bit for bit on every entry this
    machine runs; through LLVM for the others."""
    torch.manual_seed(0)
    w, heads = torch.randn(96, 64).to(dtype), torch.randn(2, 8, 16, 32).to(dtype)

    def shuffle(w: torch.Tensor, heads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w.t().contiguous(), heads.permute(0, 3, 1, 2).contiguous()

    module = _linalg(shuffle, w, heads)
    assert "linalg.transpose" not in _ops(module) and "vector.shuffle" in _ops(module)  # transposed in registers
    for name, c in sorted(table().items()):
        if c.arch == "x86_64" and c.runs_here:
            got = torchtosa.compile(shuffle, w, heads, cpu=name)(w, heads)
            assert all(torch.equal(g, e) for g, e in zip(got, shuffle(w, heads), strict=True)), name
        else:
            _, lowered = _lowered(c, shuffle, (w, heads))
            assert _llc(c, lowered, tmp_path, "obj").stat().st_size > 0


@pytest.mark.parametrize("shape", [(16, 577, 64), (577, 197)])
def test_transposes_of_sides_without_a_divisor_are_square_tiles(shape: tuple[int, ...]) -> None:
    """A transpose whose side has no divisor near the square tile (577 keys, 197 tokens: prime)
    is transposed in whole square tiles, in registers, its rest peeled; it was a loop of one
    element per side (16 loads, then 16 scalar stores per tile). Eager's values, bit for bit."""
    x = torch.randn(*shape)

    def swap(t: torch.Tensor) -> torch.Tensor:
        return t.transpose(-1, -2).contiguous()

    module = _linalg(swap, x)
    side = derive(select()).transpose
    assert "vector.shuffle" in _ops(module) and f"vector<{side}x{side}xf32>" in str(module)
    assert torch.equal(torchtosa.compile(swap, x)(x), swap(x))


def test_bf16_products_by_a_weight_stored_along_k_multiply_pairs_where_the_cpu_can(tmp_path: Path) -> None:
    """A bf16 product of rows by a weight stored along k multiplies bf16 pairs as stored
    (`vdpbf16ps`, `lower/bf16_dot.py`) for every entry with AVX512-BF16 (from amx.MIN_ROWS rows,
    an entry with AMX uses its tiles instead), and extends them to f32 for the others; results are
    f32 sums of exact products rounded to bf16 once, on every entry this machine runs (the others
    through LLVM). One row, 6 (a tile of 4, then single rows), and 1029 (more than two blocks of
    rows that stay in the L2, `Tiles.row_block_bytes`, then a tile and single rows)."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=False).to(torch.bfloat16).eval()
    for rows in (1, 6, 1029):
        x = torch.randn(1, rows, 256, dtype=torch.bfloat16)
        expected = x.float() @ linear.weight.float().t()
        for name, c in sorted(table().items()):
            if c.arch != "x86_64":
                continue
            with torch.no_grad():
                _, lowered = _lowered(c, linear, (x,))
                tiles = c.bf16_matmul == "amx" and rows >= amx.MIN_ROWS
                asm = _llc(c, lowered, tmp_path, "asm").read_text()
                assert ("vdpbf16ps" in asm) == (c.bf16_dot == "avx512_bf16" and not tiles)
                assert ("tdpbf16ps" in asm) == tiles
                if c.runs_here:
                    got = torchtosa.compile(linear, x, cpu=name)(x).float()
                    torch.testing.assert_close(got, expected, rtol=2**-8, atol=2**-8 * expected.abs().max().item())


PANEL_CASES = [  # (rows, k, columns, bias): tiles and remainder rows, every column-vector count (k whole vectors)
    (64, 96, 384, False), (67, 32, 48, True), (1029, 16, 16, False), (70, 496, 96, True), (131, 64, 32, False)]


def test_bf16_products_of_many_rows_by_a_short_k_run_in_panel_form(tmp_path: Path) -> None:
    """From bf16_dot.PANEL_MIN_ROWS rows and a short k, a bf16 product runs `bf16_dot.panel_kernel`
    (a row's pair broadcast into accumulators that are the output's columns, the weight packed per
    panel), on every entry with AVX512-BF16; from k = 1024 the dot form stays. Results: f32 sums of
    exact products, plus the bias, rounded to bf16 once."""
    torch.manual_seed(0)
    entries = {name: c for name, c in table().items() if c.arch == "x86_64" and c.bf16_dot == "avx512_bf16"
               and c.bf16_matmul != "amx"}
    assert entries  # Zen 4 and Zen 5 at least
    for (rows, k, n, bias), name in itertools.product([*PANEL_CASES, (64, 1024, 64, False)], sorted(entries)):
        linear = nn.Linear(k, n, bias=bias).to(torch.bfloat16).eval()
        x = torch.randn(1, rows, k, dtype=torch.bfloat16)
        _, lowered = _lowered(entries[name], linear, (x,))
        kernels = [op.name for op in lowered.body.operations if op.name == "llvm.func"
                   and "torchtosa_bf16_panel" in ir.StringAttr(op.attributes["sym_name"]).value]
        assert bool(kernels) == (k < 1024), (rows, k, n)
        if entries[name].runs_here:
            expected = x.float() @ linear.weight.float().t() + (linear.bias.float() if bias else 0)
            with torch.no_grad():
                got = torchtosa.compile(linear, x, cpu=name)(x).float()
            torch.testing.assert_close(got, expected.to(torch.bfloat16).float(), rtol=2**-8,
                                       atol=2**-8 * expected.abs().max().item())
        else:
            assert "vdpbf16ps" in _llc(entries[name], lowered, tmp_path, "asm").read_text()


class _Matmul(nn.Module):
    """A product by a weight stored [K, N] (not nn.Linear's [N, K])."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(256, 96).to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def test_bf16_matmuls_of_more_rows_run_on_amx_where_the_cpu_can(tmp_path: Path) -> None:
    """A bf16 product of amx.MIN_ROWS rows or more runs on AMX tiles (`lower/amx.py`) for every
    entry with AMX, as C^T = W @ A^T (the weight as stored, the rows packed in pairs of k, padded
    to whole tiles of 16); on f32 FMAs for the others. Results are f32 sums of exact products
    rounded to bf16 once, on every entry this machine runs (the others through LLVM): nn.Linear of
    12 rows (one tile, padded) and 48 (a block of two tiles and one of one), and a weight stored
    [K, N] (transposed at each call)."""
    torch.manual_seed(0)
    linear = nn.Linear(256, 96, bias=False).to(torch.bfloat16).eval()
    for model, rows in ((linear, 12), (linear, 48), (_Matmul().eval(), 48)):
        x = torch.randn(1, rows, 256, dtype=torch.bfloat16)
        weight = linear.weight.float().t() if model is linear else model.w.float()
        expected = x.float() @ weight
        for name, c in sorted(table().items()):
            if c.arch != "x86_64":
                continue
            with torch.no_grad():
                _, lowered = _lowered(c, model, (x,))
                assert ("tdpbf16ps" in _llc(c, lowered, tmp_path, "asm").read_text()) == (c.bf16_matmul == "amx")
                if c.runs_here:
                    got = torchtosa.compile(model, x, cpu=name)(x).float()
                    torch.testing.assert_close(got, expected, rtol=2**-8, atol=2**-8 * expected.abs().max().item())


ROW_CHAINS = {
    "softmax": lambda x: torch.softmax(x, -1),
    "log_softmax": lambda x: torch.log_softmax(x, -1),
    "layer_norm": lambda x: nn.functional.layer_norm(x, (96,), torch.linspace(0.5, 1.5, 96).to(x.dtype),
                                                     torch.linspace(-1, 1, 96).to(x.dtype)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(ROW_CHAINS))
def test_row_wise_chains_are_fused_per_row(name: str, dtype: torch.dtype) -> None:
    """A softmax's or layer norm's passes (a row's statistic, an elementwise op reading it, the next
    statistic, the output) run row by row, every pass over a row while it is in L1 (`rows.fuse_rows`),
    not each over the whole tensor: no intermediate the size of the whole tensor is allocated (one
    thread on a Sapphire Rapids-class host: softmax over [16, 512, 512] 2.1x -> 0.9x eager's time,
    layer norm over [8, 512, 1024] 2.75x -> 1.0x)."""
    fn = ROW_CHAINS[name]
    x = (torch.randn(4, 32, 96) * 3).to(dtype)
    shapes = _allocated(_linalg(fn, x, stop_before="llvm"))
    # one whole buffer, the output's (the caller's own once the "llvm" stage writes it in place); the rest
    # a few rows' (rows.ROW_ELEMENTS)
    assert len([s for s in shapes if "<4x32x96x" in s]) == 1 and re.search(r"<1x\d+x96x", str(shapes)), shapes
    got, want = torchtosa.compile(fn, x)(x), fn(x)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # bf16 in, f32 inside, rounded once at the end as eager's kernels: within one ulp
        torch.testing.assert_close(got.double(), want.double(), rtol=2**-7, atol=2**-7 * want.abs().max().item())


def test_row_wise_chains_of_the_parallel_level_share_their_rows_among_threads() -> None:
    """With opt="parallel", the loop over a large chain's rows is an scf.forall, which OpenMP
    shares among the threads (two threads: a layer norm over [8, 512, 1024] 2.3x -> 1.06x eager's
    time on two threads)."""
    fn = ROW_CHAINS["layer_norm"]
    x = torch.randn(8, 96, 96)  # above schedule.SPLIT_MIN_ELEMENTS
    ops = _ops(_linalg(fn, x, opt="parallel"))
    assert ("scf.forall" in ops) == (schedule.threads() > 1)
    shapes = _allocated(_linalg(fn, x, opt="parallel", stop_before="llvm"))
    assert len([s for s in shapes if "<8x96x96x" in s]) <= 1 and re.search(r"<1x\d+x96x", str(shapes)), shapes
    torch.testing.assert_close(torchtosa.compile(fn, x, opt="parallel")(x), fn(x), rtol=1e-5, atol=1e-5)
