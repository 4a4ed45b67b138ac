"""NaN/Inf propagation, integer overflow and division by zero: every entry against eager.

For every opdefs entry (data-driven: new entries are covered when they land) this
takes the entry's first accepted sample with float tensors and its first with integer
tensors, fills every tensor with special values — floats, twice: NaN, ±Inf, ±0 among
ordinary values (compared at the entry's tolerance), and extreme magnitudes ±1e38, ±1e30,
±1e-30 (subnormal in f32) among ordinary values (compared where both sides are finite, at
eps times the inputs' total magnitude: whether a reassociated sum of huge terms overflows
or cancels depends on its order); integers:
the dtype's min and max, 0, ±1, ordinary values — and compares the native result with
eager, NaNs equal. Where eager raises on these values (integer division by zero is a
RuntimeError in torch), the case is skipped: torchtosa computes some value there.

Where torch's own kernels disagree on a special value (its vectorized f32 gelu(+inf) is
NaN, its f64 kernel gives +inf), matching torch's float64 kernel counts as a match.

What this pins down (docs/numerics.md has the table): floats follow IEEE like torch
(NaN in → NaN out, maximum/minimum/amax/clamp propagate NaN, x/0 = ±Inf, 0/0 = NaN);
integer add/sub/mul/neg wrap around in two's complement like torch; integer
min/max/abs(INT_MIN) agree with torch's wrap-around.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from test_ops import call_torch, entry_for, make_args, sort_args

import torchtosa
from generator.spec import OpDef, Sample, load_specs
from torchtosa import Unsupported
from torchtosa.testing import run_op

ROOT = Path(__file__).resolve().parent.parent
# two float fills: non-finite values among ordinary ones (compared strictly), and extreme
# magnitudes (compared at eps * the tensors' total magnitude: sums of 1e30 and 1e-30 cancel
# differently in any other order, but overflow to inf and NaN must still agree exactly)
NONFINITE = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1.5, -2.5, 3.0, 0.5, math.nan, -1.0, 2.0]
EXTREME = [1e30, -1e30, 1e-30, -1e-30, 1.5, -2.5, 3.0e20, -7.0e-20, 0.5, 1e38, -1e38, 2.0]


def ints(dtype: torch.dtype) -> list[int]:
    info = torch.iinfo(dtype)
    return [info.max, info.min, 0, -1, 1, 7, -7, info.max - 1, info.min + 1, 2, 0, 3]


def fill(t: torch.Tensor, kind: str, ordered: bool = False) -> torch.Tensor:
    """t's shape and dtype, filled with the special values (cycled, so every one appears when there is room);
    without NaN for an argument the entry declares `sorted` (NaN has no place in an order)."""
    if t.dtype == torch.bool or t.numel() == 0:
        return t
    pool = (NONFINITE if kind == "nonfinite" else EXTREME) if t.dtype.is_floating_point else ints(t.dtype)
    pool = [v for v in pool if v == v] if ordered else pool
    flat = list(itertools.islice(itertools.cycle(pool), t.numel()))
    return torch.tensor(flat, dtype=torch.float64 if t.dtype.is_floating_point else torch.int64).to(t.dtype).reshape(
        t.shape)


def cases() -> list[tuple[OpDef, Sample, str]]:
    out = []
    for e in load_specs(ROOT / "opdefs")[1]:
        found: dict[str, Sample] = {}
        for s in e.samples:
            if s.raises or s.unsupported:
                continue
            tensors = [v for v in s.args.values() if isinstance(v, tuple) and v and v[0] == "tensor"]
            tensors += [x for v in s.args.values() if isinstance(v, list)
                        for x in v if isinstance(x, tuple) and x and x[0] == "tensor"]
            kinds = {"float" if t[1] in ("f32", "f64", "f16", "bf16") else "int" if t[1] != "bool" else "bool"
                     for t in tensors}
            for kind in ("float", "int"):
                if kind in kinds and kind not in found and 0 not in [d for t in tensors for d in t[2]]:
                    found[kind] = s
        out += [(e, s, kind) for kind, s in found.items() if kind == "int"]
        out += [(e, found["float"], kind) for kind in ("nonfinite", "extreme") if "float" in found]
    return out


# Known deviations from eager on special values, each described in docs/numerics.md:
# left out of the comparison (not skipped), so a new deviation still fails.
DEVIATIONS = {
    ("aten.pow.Tensor_Tensor", "int"): "integer pow with exponents >= 64 does not wrap like torch",
    ("aten.pow.Scalar", "int"): "integer pow with exponents >= 64 does not wrap like torch",
    ("aten.upsample_bilinear2d.vec", "nonfinite"): "tosa.resize blends NaN/Inf into neighbours differently",
    ("aten.upsample_bilinear2d.default", "nonfinite"): "tosa.resize blends NaN/Inf into neighbours differently",
    ("quantized_decomposed.dequantize_per_channel.default", "int"): "int64 zero points past 2^24: f32, not int64",
    ("quantized_decomposed.dequantize_per_channel.default", "nonfinite"): "int64 zero points past 2^24: f32, not int64",
}
CASES = [c for c in cases() if (c[0].op, c[2]) not in DEVIATIONS]


@pytest.mark.parametrize(("e", "s", "kind"), CASES,
                         ids=[f"{e.op}[{e.registry}]-{kind}" for e, s, kind in CASES])
def test_special_values_match_eager(e: OpDef, s: Sample, kind: str) -> None:
    def filled(a: Any, ordered: bool = False) -> Any:
        if isinstance(a, torch.Tensor):
            return fill(a, kind, ordered)
        return [filled(x) for x in a] if isinstance(a, list) else a

    args = sort_args(e, [filled(a, arg.name in e.sorted) for a, arg in zip(make_args(e, s), e.args, strict=True)])
    try:
        expected = call_torch(e, args)
    except Exception as err:  # e.g. integer division by zero, an index out of range
        pytest.skip(f"eager raises {type(err).__name__}: {str(err)[:100]}")
    try:
        got = run_op(entry_for(e), args)
    except Unsupported as err:
        pytest.skip(f"unsupported: {err}")
    tol = dict(s.tolerance or e.tolerance or {})
    for g, x in zip(got, expected, strict=True):
        if kind == "extreme" and x.dtype.is_floating_point:
            # whether a sum of huge terms overflows to inf, or meets inf - inf, depends on its
            # order: compare where both sides are finite
            both = torch.isfinite(g) & torch.isfinite(x)
            g, x = g[both], x[both]
        if kind in ("int", "extreme") and x.dtype.is_floating_point:
            # extreme values in float: sums cancel catastrophically in any other order
            mass = sum(float(t.double().abs().nan_to_num(posinf=0.0).sum()) for t in _tensors(args))
            tol = {"rtol": tol.get("rtol", 1.3e-6), "atol": max(tol.get("atol", 1e-5), torch.finfo(x.dtype).eps * mass)}
        try:
            kw = {"rtol": tol["rtol"], "atol": tol["atol"]} if tol else {}
            torch.testing.assert_close(g, x, equal_nan=True, **kw,
                                       msg=lambda m: f"{e.op} ({s.where}) on special values {[_show(a) for a in args]}:"
                                                     f"\n{m}")
        except AssertionError:
            # torch's own kernels disagree on some special values (its vectorized f32 gelu(inf) is NaN,
            # its f64 kernel gives inf): matching torch's float64 kernel is matching torch
            if not x.dtype.is_floating_point or x.dtype == torch.float64 or not _matches_f64(e, args, g):
                raise


def _matches_f64(e: OpDef, args: list[Any], got: torch.Tensor) -> bool:
    def up(a: Any) -> Any:
        if isinstance(a, torch.Tensor) and a.dtype.is_floating_point:
            return a.double()
        return [up(x) for x in a] if isinstance(a, list) else a

    try:
        want = call_torch(e, [up(a) for a in args])[0].to(got.dtype)
    except Exception:
        return False
    return bool(torch.allclose(got.double(), want.double(), equal_nan=True, rtol=1e-3, atol=1e-5))


def _tensors(args: list[Any]) -> list[torch.Tensor]:
    return [x for a in args for x in (a if isinstance(a, list) else [a]) if isinstance(x, torch.Tensor)]


def _show(a: Any) -> Any:
    return a.tolist() if isinstance(a, torch.Tensor) and a.numel() <= 16 else a


DIVISION_BY_ZERO = """
import torch, torchtosa
a = torch.tensor([7, -7, 0, 5], dtype=torch.{dt})
b = torch.tensor([2, 2, 3, -3], dtype=torch.{dt})
fns = [lambda x, y: x // y, lambda x, y: x % y, lambda x, y: torch.div(x, y, rounding_mode="trunc"),
       lambda x, y: torch.fmod(x, y), lambda x, y: torch.remainder(x, 3) // y]
for fn in fns:
    c = torchtosa.compile(fn, a, b)
    assert torch.equal(c(a, b), fn(a, b))
    c(a, torch.zeros_like(b))  # torch raises here; compiled code must not trap
print("ok")
"""


@pytest.mark.parametrize("dt", ["int32", "int64"])
def test_integer_division_by_zero_at_run_time_does_not_kill_the_process(dt: str) -> None:
    """A zero divisor reaching native integer division would be SIGFPE: the process dies.
    torch raises instead, which native code cannot; torchtosa computes some value."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", DIVISION_BY_ZERO.format(dt=dt)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0 and "ok" in done.stdout, f"exit {done.returncode}: {done.stderr[-2000:]}"


@pytest.mark.parametrize("opt", ["none", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_maxima_of_infinities_only_are_infinite(dtype: torch.dtype, opt: str) -> None:
    """The maximum of a row of -inf only is -inf (the minimum of +inf only +inf), as in eager:
    tosa-to-linalg starts a float maximum from the lowest finite value (-3.4e38 came out of an
    amax over a fully masked row; `lower/reduction_identities.py`). Rows of ordinary values,
    with a NaN, of -inf and of +inf, reduced over the last dim and over all."""
    x = torch.randn(5, 40, dtype=torch.float64).to(dtype)
    x[1], x[2], x[3, 7] = -math.inf, math.inf, math.nan

    def extremes(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return t.amax(-1), t.amin(-1), t.max(-1).values, t.min(-1).values, t[1].max(), t[2].min(), t[1:3].amax(0)

    for got, want in zip(torchtosa.compile(extremes, x, opt=opt)(x), extremes(x), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
