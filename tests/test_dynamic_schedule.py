"""The optimizing schedule on dynamic sizes: tiles with remainders, vectorized, agreeing with eager.

Each case is compiled once with a dynamic dim (torch._dynamo.mark_dynamic) and run at sizes that
are not multiples of the tiles; the schedule must have tiled and vectorized every linalg op (a
regression to plain loops fails here, not only in `make bench`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import sympy
import torch
from mlir import ir
from test_schedule import _allocated
from torch import nn

import torchtosa
from torchtosa.api import CACHE
from torchtosa.capture import symbolic
from torchtosa.execute import native as execute
from torchtosa.lower import pipeline, schedule

_COMPUTE = ("linalg.generic", "linalg.matmul", "linalg.batch_matmul", "linalg.transpose", "linalg.fill",
            "linalg.copy", "linalg.conv_2d_nhwc_fhwc", "linalg.conv_2d_nhwc_hwcf", "linalg.conv_1d_nwc_wcf")


def _ops(module: ir.Module) -> list[str]:
    """The op names of `module`; a linalg op on a tensor of a dynamic size with a "?" appended."""
    names: list[str] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        types = [v.type for v in op.operands] + [r.type for r in op.results]
        dynamic = any(isinstance(t, ir.RankedTensorType) and not t.has_static_shape for t in types)
        names.append(op.name + ("?" if dynamic and op.name.startswith("linalg.") else ""))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return names


def _loop_depth(op: ir.Operation) -> int:
    """The most scf.for loops nested in `op`."""
    return max((int(child.name == "scf.for") + _loop_depth(child.operation)
                for region in op.regions for block in region.blocks for child in block.operations), default=0)


def _spy(monkeypatch: pytest.MonkeyPatch, summary: Callable[[ir.Module], Any], until: str = "bufferize") -> list[Any]:
    """`summary` of each module lowered from now on, lowered up to the stage `until` (by default
    just after the schedule; none comes from the in-memory cache)."""
    CACHE.clear()
    seen: list[Any] = []
    lower = execute.lower

    def spy(module: ir.Module, opt: str = "default", stop_before: str | None = None, **kwargs: Any) -> Any:
        copy = ir.Module.parse(str(module), context=module.context)
        pipeline.lower(copy, opt, stop_before=until, **kwargs)
        seen.append(summary(copy))
        return lower(module, opt, stop_before, **kwargs)

    monkeypatch.setattr(execute, "lower", spy)
    return seen


@pytest.fixture
def scheduled(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The op names of each module lowered from now on, after the schedule stage."""
    return _spy(monkeypatch, _ops)


def _run(fn: Callable[..., Any], make: Callable[[int], tuple[torch.Tensor, ...]], dims: list[tuple[int, int]],
         sizes: list[int], opt: str) -> None:
    """Compile `fn` with the dims `dims` ((argument, dim)) dynamic and compare it with eager at `sizes`."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="torchtosa", options={"opt": opt, "fallback": "error"})
    for n in sizes:
        args = make(n)
        for i, d in dims:
            torch._dynamo.mark_dynamic(args[i], d)
        with torch.no_grad():
            expected = fn(*args)
            tolerance = {"rtol": 1e-4, "atol": 1e-4} if expected.dtype == torch.float32 else {}  # else the dtype's
            torch.testing.assert_close(compiled(*args), expected, **tolerance)
    torch._dynamo.reset()


def _linear() -> Callable[..., Any]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(40, 96), nn.ReLU(), nn.Linear(96, 24)).eval()


def _conv() -> Callable[..., Any]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU()).eval()


CASES: dict[str, tuple[Callable[[], Callable[..., Any]], Callable[[int], tuple[torch.Tensor, ...]],
                       list[tuple[int, int]]]] = {
    # matmul rows: 8-row tiles, the rest in 4, 2 and 1 rows
    "linear-rows": (_linear, lambda n: (torch.randn(n, 40),), [(0, 0)]),
    # bf16 products into f32 sums (a bf16 model's prefill): extended to f32 as the weight is packed
    "linear-rows-bf16": (lambda: _linear().to(torch.bfloat16), lambda n: (torch.randn(n, 40, dtype=torch.bfloat16),),
                         [(0, 0)]),
    # batch and both matmul loops dynamic (attention's scores: rows and columns are the sequence)
    "bmm-batch-seq": (lambda: lambda a, b: a @ b.transpose(-1, -2),
                      lambda n: (torch.randn(n % 5 + 2, n, 24), torch.randn(n % 5 + 2, n, 24)),
                      [(0, 0), (0, 1), (1, 0), (1, 1)]),
    # reductions over a dynamic last dim, and a static one with dynamic rows
    "softmax-rows-cols": (lambda: lambda x: torch.softmax(x, -1), lambda n: (torch.randn(3, n + 1, n),),
                          [(0, 1), (0, 2)]),
    "layernorm-rows": (lambda: nn.LayerNorm(128).eval(), lambda n: (torch.randn(n, 128),), [(0, 0)]),
    # elementwise and a transpose with both dims dynamic
    "transpose": (lambda: lambda x: (x.transpose(0, 1) * 2).exp(), lambda n: (torch.randn(n, n + 3),),
                  [(0, 0), (0, 1)]),
    "conv-batch": (_conv, lambda n: (torch.randn(n, 3, 9, 9),), [(0, 0)]),
}


@pytest.mark.parametrize("opt", ["default", "parallel"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_dynamic_sizes_are_tiled_and_match_eager(name: str, opt: str, scheduled: list[list[str]],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if opt == "parallel":
        monkeypatch.setattr(schedule, "PARALLEL_MIN_MACS", 0)  # split even these small contractions
        monkeypatch.setattr(schedule, "SPLIT_MIN_MACS", 0)  # and every op with a static loop to split
        monkeypatch.setattr(schedule, "SPLIT_MIN_ELEMENTS", 0)
    build, make, dims = CASES[name]
    _run(build(), make, dims, [2, 7, 33, 100] if name != "conv-batch" else [2, 3, 7], opt)
    dynamic = [ops for ops in scheduled if "tensor.dim" in ops]
    assert dynamic, "no module with dynamic sizes was compiled"
    for ops in dynamic:
        left = sorted({n for n in ops if n.removesuffix("?") in _COMPUTE and n.endswith("?")})
        assert not left, f"not vectorized: {left}"  # (the schedule's own filter transpose of a conv is static)
        assert any(n.startswith("vector.") for n in ops)
    # a static loop to split (a layer norm's rows, fused per row, stay on the calling thread: rows.py)
    if opt == "parallel" and name in ("linear-rows", "conv-batch"):
        assert any("scf.forall" in ops for ops in dynamic)


@pytest.mark.parametrize(("name", "deepest"), [("linear-rows", 6), ("bmm-batch-seq", 10)])
def test_remainder_levels_nest_one_loop_each(name: str, deepest: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dynamic size's remainder is tiled by halves, each level inside the last; the loop over
    each level's whole remainder (one tile) is inlined, so a level adds one loop, not two:
    one-shot bufferization takes time exponential in the depth (these were 9 and 16 deep, and
    bufferizing a tiny Llama's decoding graph took 4.6 s)."""
    depths = _spy(monkeypatch, lambda module: _loop_depth(module.operation))
    build, make, dims = CASES[name]
    _run(build(), make, dims, [7, 33], "default")
    assert depths and max(depths) <= deepest


def test_one_compile_serves_every_size() -> None:
    """torch.compile(dynamic=True): one native compile for every batch size (above 1)."""
    model = _linear()
    count = 0

    def counting(gm: torch.fx.GraphModule, example: list[Any], **kwargs: Any) -> Any:
        nonlocal count
        count += 1
        return torchtosa.torchtosa_backend(gm, example, **kwargs)

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=counting, dynamic=True, options={"fallback": "error"})
    with torch.no_grad():
        for n in (3, 8, 17, 64):
            x = torch.randn(n, 40)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert count == 1
    torch._dynamo.reset()


def test_linear_of_dynamic_rows_transposes_its_weight_panel_by_panel(monkeypatch: pytest.MonkeyPatch) -> None:
    """With dynamic rows the weight transpose meets the matmul through unit-dim reshapes
    ([O, 1, K] -> [1, K, O], a batch matmul of one matrix); the schedule still packs it panel by
    panel (`contractions.normalize`), never transposing the whole weight per call (which made
    the dynamic MLP 2x slower than the static one)."""
    buffers = _spy(monkeypatch, _allocated, until="llvm")
    _run(_linear(), lambda n: (torch.randn(n, 40),), [(0, 0)], [7, 33], "default")
    assert buffers
    for found in buffers:
        assert not [t for t in found if "40x96" in t or "96x24" in t], found  # a whole transposed weight


ROW_CASES = {
    **{name: CASES[name] for name in ("layernorm-rows", "softmax-rows-cols")},
    # static rows of a run-time length (a decoding step's attention over its keys)
    "softmax-cols": (lambda: lambda x: torch.softmax(x, -1), lambda n: (torch.randn(4, 3, n),), [(0, 2)]),
    # batch and sequence: the decomposition's views to the input's own sizes are no reshapes
    "layernorm-batch-seq": (lambda: nn.LayerNorm(128).eval(), lambda n: (torch.randn(n % 3 + 2, n, 128),),
                            [(0, 0), (0, 1)]),
}


@pytest.mark.parametrize("name", sorted(ROW_CASES))
def test_row_chains_of_a_run_time_row_count_are_fused_per_row(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer norm's or softmax's passes over rows whose count is known at run time run row by
    row (`rows.fuse_rows`, one row per iteration), as static ones do: no intermediate of the
    whole tensor is allocated (a dynamic LayerNorm(256) over 4 x 100 rows made five passes over
    four whole buffers)."""
    buffers = _spy(monkeypatch, _allocated, until="llvm")
    build, make, dims = ROW_CASES[name]
    _run(build(), make, dims, [7, 33], "default")
    dynamic = [found for found in buffers if any("?" in t for t in found)]
    assert dynamic
    for found in dynamic:  # the output's whole buffer, and a row's ([1, 128], [1, 1, ?])
        rows = [t for t in found if re.match(r"memref<(1x)+", t)]
        assert rows and len(found) - len(rows) == 1, found


def _zero_writes(module: ir.Module) -> int:
    """vector.transfer_writes of a zero constant, and linalg.fills: an output zeroed in memory."""
    count = 0

    def visit(op: ir.Operation) -> ir.WalkResult:
        nonlocal count
        if op.name == "linalg.fill":
            count += 1
        elif op.name == "vector.transfer_write":
            value = getattr(op.operands[0].owner, "operation", None)  # None for a block argument
            if value is not None and value.name == "arith.constant" \
                    and re.fullmatch(r"dense<0\.0+e\+00> : vector<.*>", str(value.attributes["value"])):
                count += 1
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return count


@pytest.mark.parametrize("name", ["linear-rows", "bmm-batch-seq"])
def test_contractions_of_run_time_sizes_start_from_zero_in_registers(name: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A contraction whose output has a run-time size starts each register tile's sums from a
    zero vector, as a static one does (zero_init.py), instead of a pass zeroing the whole
    output and each tile reading it back (a dynamic Linear(256, 1024) over 256 rows: 1.80 ->
    1.45 ms on x86-64-v3 code, the static compile's 1.29)."""
    zeroed = _spy(monkeypatch, _zero_writes)
    build, make, dims = CASES[name]
    _run(build(), make, dims, [7, 33], "default")
    assert zeroed and not any(zeroed)


def test_reshapes_of_run_time_sizes_are_regrouped_dims() -> None:
    """`symbolic.reassociation`: the groups of dims a reshape of symbolic sizes collapses or
    expands, each a pair of equal products; None where no grouping proves it (a swap of sizes)."""
    b, s = sympy.symbols("s0 s1", positive=True, integer=True)
    cases = [
        ((b, s, 256), (b, s * 4, 64), [([0], [0]), ([1, 2], [1, 2])]),  # heads split: collapse, expand
        ((b * 4, s, 64), (b, 4, s, 64), [([0], [0, 1]), ([1], [2]), ([2], [3])]),
        ((b, 4, s, 64), (b * 4, s, 64), [([0, 1], [0]), ([2], [1]), ([3], [2])]),
        ((1, b, s), (b, s, 1), [([0, 1], [0]), ([2], [1, 2])]),  # unit dims join a group
        ((b * s, 768), (b, s, 768), [([0], [0, 1]), ([1], [2])]),
        ((b, 4), (4, b), None),
        ((b, s), (s, b), None),
        ((b, 6), (b, 4), None),
    ]
    for source, target, groups in cases:
        assert symbolic.reassociation(source, target) == groups, (source, target)


def test_attention_heads_of_run_time_sizes_are_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """An attention's head split and merge with a run-time batch and sequence are
    tensor.expand_shape / collapse_shape, not tensor.reshape (a copy to elementwise fusion):
    its two matmuls fuse with their transposes and the softmax as with static sizes, leaving
    the two projections' batch matmuls (there were four, and a dynamic encoder layer ran ~4% slower)."""
    seen = _spy(monkeypatch, _ops, until="unit-dims")
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(32, 4, batch_first=True).eval()
    _run(lambda x: attention(x, x, x, need_weights=False)[0], lambda n: (torch.randn(n % 3 + 2, n, 32),),
         [(0, 0), (0, 1)], [7, 33], "default")
    assert seen
    for ops in seen:
        assert ops.count("linalg.batch_matmul?") == 2, ops
