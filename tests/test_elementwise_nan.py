"""Elementwise ops on the values random samples never produce: NaN, ±inf, ±0, exact
quotients and mixed-sign integers, compiled end to end (Dynamo capture → TOSA → native)
and compared with eager PyTorch."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

import torchtosa

NAN, INF = float("nan"), float("inf")
SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.1, -0.1, 2.5, -3.0, 6.0, 49.0, 1e30, -1e-30, INF, -INF, NAN]
FLOATS = [torch.float32, torch.float16, torch.bfloat16]


def pairs(values: list[float], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Every (a, b) combination of `values`, as two flat tensors."""
    a, b = zip(*itertools.product(values, values), strict=True)
    return torch.tensor(a).to(dtype), torch.tensor(b).to(dtype)


def check(fn: Callable, *args: torch.Tensor) -> None:
    got = torchtosa.compile(fn, *args)(*args)
    want = fn(*args)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, equal_nan=True, rtol=0, atol=0)


BINARY = {
    "maximum": torch.maximum,
    "minimum": torch.minimum,
    "fmax": torch.fmax,
    "fmin": torch.fmin,
    "clamp_tensor": lambda a, b: torch.clamp(a, min=b),
    "clamp_tensor_max": lambda a, b: torch.clamp(a, max=b),
    "where": lambda a, b: torch.where(a > b, a, b),
    "compare": lambda a, b: (a == b, a != b, a < b, a <= b, a > b, a >= b),
    "div": lambda a, b: a / b,
    "div_trunc": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "fmod": torch.fmod,
    "remainder": torch.remainder,
}


# bf16 fmod/remainder of 1 by 1e-30 exceeds the documented exact range |a / b| < 2^29.
BINARY_CASES = [(n, d) for n in BINARY for d in FLOATS
                if not (d == torch.bfloat16 and n in ("fmod", "remainder"))]


@pytest.mark.parametrize(("name", "dtype"), BINARY_CASES, ids=[f"{n}-{d}" for n, d in BINARY_CASES])
def test_binary_special_values(name: str, dtype: torch.dtype) -> None:
    values = SPECIAL if name not in ("fmod", "remainder") else [v for v in SPECIAL if abs(v) not in (1e30, 1e-30)]
    check(BINARY[name], *pairs(values, dtype))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_floor_division_special_values(dtype: torch.dtype) -> None:
    # bf16 rounds the exact floor (e.g. 489) to bf16 where torch's bf16 arithmetic may land one
    # step away, and 1e30 / 1e-30 exceeds the exact range: use values whose quotients are exact
    values = [0.0, -0.0, 1.0, -1.0, 0.1, -0.1, 2.5, -3.0, 6.0, 7.5, INF, -INF, NAN]
    check(lambda a, b: torch.div(a, b, rounding_mode="floor"), *pairs(values, dtype))
    check(lambda a, b: a // b, *pairs(values, dtype))


@pytest.mark.parametrize("mode", ["trunc", "floor"])
def test_f64_rounding_division_special_values(mode: str) -> None:
    # f64 goes to the arith fallback (exact division and fmod): bit-for-bit torch's results,
    # also for quotients that overflow, underflow or sit next to an integer
    values = [*SPECIAL, 7.5, 0.3, 1e300, -1e-300, 5e-324, 2.0**53 + 2, 3.0 * (1 - 2.0**-52)]
    check(lambda a, b: torch.div(a, b, rounding_mode=mode), *pairs(values, torch.float64))
    check(lambda a: (torch.div(a, 0.1, rounding_mode=mode), torch.div(a, -3, rounding_mode=mode)),
          torch.tensor(values, dtype=torch.float64))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_unary_special_values(dtype: torch.dtype) -> None:
    x = torch.tensor(SPECIAL).to(dtype)
    check(lambda x: (torch.isnan(x), torch.isinf(x), torch.isfinite(x), torch.sign(x), x.to(torch.bool)), x)
    check(lambda x: (torch.clamp(x, -1, 1), torch.clamp(x, min=0.5), torch.clamp(x, max=-0.5), x.clamp(2, 1),
                     x.clamp(min=NAN), x.clamp(max=NAN)), x)
    check(lambda x: (torch.where(torch.isnan(x), 0.0, x), x == INF, x != x, x < NAN, x.abs(), -x), x)


@pytest.mark.parametrize("dtype", [*FLOATS, torch.float64], ids=str)
def test_signbit_special_values(dtype: torch.dtype) -> None:
    # -0.0 and a negative NaN have the sign bit set: random samples have neither
    x = torch.tensor([*SPECIAL, -NAN]).to(dtype)
    assert torch.signbit(x)[-1] and torch.signbit(x)[1]
    check(torch.signbit, x)


def test_exact_quotients() -> None:
    # a * (1 / b) in f32 misses exact quotients such as 49 / 49; the f64 path does not
    a = torch.tensor([6.0, 49.0, 1.0, 0.3, 7.0, 1e-3, 5.0, 0.7])
    b = torch.tensor([3.0, 49.0, 0.1, 0.1, 0.7, 1e-4, 0.5, 0.1])
    check(lambda a, b: (a / b, (a / b).long(), a // b, a % b, torch.fmod(a, b), a / b == a // b), a, b)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int16, torch.int8], ids=str)
def test_integer_division_signs(dtype: torch.dtype) -> None:
    values = list(range(-13, 14))
    a, b = zip(*[(x, y) for x, y in itertools.product(values, values) if y != 0], strict=True)
    a, b = torch.tensor(a, dtype=dtype), torch.tensor(b, dtype=dtype)
    check(lambda a, b: (a // b, torch.div(a, b, rounding_mode="trunc"), a % b, torch.fmod(a, b), a / b), a, b)
    check(lambda a: (a // 4, a // -4, a % 3, a % -3, torch.fmod(a, -3), torch.div(a, 3, rounding_mode="trunc")), a)
    check(lambda b: (7 % b, -7 % b, 7 // b), b)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_integer_pow(dtype: torch.dtype) -> None:
    base, exp = zip(*itertools.product(range(-5, 6), range(-4, 70)), strict=True)
    base, exp = torch.tensor(base, dtype=dtype), torch.tensor(exp, dtype=dtype)
    keep = (exp < 64) | (base.abs() <= 1)  # |base| >= 2 with exponents >= 64 overflows (documented)
    check(lambda a, e: a**e, base[keep], exp[keep])
    check(lambda a: (a**0, a**1, a**2, a**7, a**33, a**63, 2**a, (-1) ** a, 0**a), base[exp < 60] // 3)


def test_float_to_int_truncates() -> None:
    x = torch.tensor([-2.5, -1.5, -0.5, -0.0, 0.5, 1.5, 2.5, 3.7, -3.7, 1000.5, -700.9])
    check(lambda x: (x.to(torch.int32), x.long(), x.half().to(torch.int64), x.bfloat16().int(), x.bool()), x)


def check_signed(fn: Callable, *args: torch.Tensor) -> None:
    """As check, and the sign of every zero must match too (assert_close counts -0.0 == 0.0)."""
    got = torchtosa.compile(fn, *args)(*args)
    want = fn(*args)
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    keep = ~want.isnan()
    assert torch.equal(torch.signbit(got[keep]), torch.signbit(want[keep])), f"signs of zeros: {got} != {want}"


class _TimesZeroBuffer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("z", torch.zeros(len(SPECIAL)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mul(x, self.z.to(x.dtype))


# TOSA's folders turned x * (splat 0) into 0 (inf * 0 and NaN * 0 are NaN) and x + (splat 0)
# into x (-0.0 + 0.0 is +0.0), wherever a zero constant reached a float mul/add, even by folding
CONSTANT_OPERANDS = {
    "x*0": lambda x: x * 0.0,
    "0*x": lambda x: 0.0 * x,
    "x*-0": lambda x: x * -0.0,
    "x*0int": lambda x: x * 0,
    "x*zeros": lambda x: torch.mul(x, torch.zeros(len(SPECIAL), dtype=x.dtype)),
    "zeros_like*x": lambda x: torch.zeros_like(x) * x,
    "x*(i*0)": lambda x: x * (torch.arange(len(SPECIAL)) * 0).to(x.dtype),
    "x*zeros_broadcast": lambda x: x.reshape(-1, 1) * torch.zeros(1, 3, dtype=x.dtype),
    "x+0*x": lambda x: x + 0.0 * x,
    "0/x": lambda x: 0.0 / x,
    "x+0": lambda x: x + 0.0,
    "0+x": lambda x: 0.0 + x,
    "x+-0": lambda x: x + -0.0,
    "x-0": lambda x: x - 0.0,
    "x*1": lambda x: x * 1.0,
    "x/1": lambda x: x / 1.0,
    "buffer": _TimesZeroBuffer(),
}


@pytest.mark.parametrize("dtype", [*FLOATS, torch.float64], ids=str)
@pytest.mark.parametrize("name", CONSTANT_OPERANDS)
def test_constant_operands_are_not_folded(name: str, dtype: torch.dtype) -> None:
    check_signed(CONSTANT_OPERANDS[name], torch.tensor(SPECIAL).to(dtype))
