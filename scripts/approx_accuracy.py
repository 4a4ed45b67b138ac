"""Measure the float32 accuracy of the `approx` registry's TOSA forms (opdefs/math_tosa.yaml).

Each entry runs natively (through the same pipeline as tests/test_ops.py) on dense grids of
float32 inputs over the regions its branches cover; the result is compared with torch's
float64 result of the same inputs, in float32 ulps of that reference, next to the `math` (or
`arith`) entry the native path uses (libm; libmvec where the CPU has AVX-512) and torch's own
float32 kernel, measured the same way. The TOSA ops the forms build on (exp, log, rsqrt of the
`tosa` registry) are measured too: their error is most of the forms'. Prints the markdown
table of docs/numerics.md.

    python scripts/approx_accuracy.py
"""

from __future__ import annotations

import torch

from torchtosa.importer.registry import Entry, registry
from torchtosa.testing import run_op

N = 200_000  # points per region


def entry(op: str, name: str = "approx") -> Entry:
    return next(e for e in registry()[op] if e.registry == name)


def ulps(got: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """|got − ref| in float32 ulps of ref; 0 where both are NaN or equal (infinities)."""
    ref32 = ref.float().abs()
    ulp = (torch.nextafter(ref32, torch.tensor(float("inf"))) - ref32).double()
    err = (got.double() - ref).abs() / ulp
    err[(got.isnan() & ref.isnan()) | (got.double() == ref)] = 0
    return err


def grid(lo: float, hi: float, log: bool) -> torch.Tensor:
    """N float32 points in [lo, hi], or (log) both signs of 10^[lo, hi]."""
    if not log:
        return torch.linspace(lo, hi, N, dtype=torch.float64).float()
    mag = torch.logspace(lo, hi, N // 2, dtype=torch.float64)
    return torch.cat([mag, -mag]).float()


UNARY: list[tuple[str, float, float, bool]] = [
    ("asin", -1, 1, False), ("asin", 0.49, 0.51, False), ("asin", -40, 0, True),
    ("acos", -1, 1, False), ("acos", 0.999, 1, False),
    ("atan", -4, 4, False), ("atan", -45, 38, True),
    ("sinh", -4, 4, False), ("sinh", -88.7, 88.7, False), ("sinh", -40, 1.94, True),
    ("cosh", -4, 4, False), ("cosh", -88.7, 88.7, False),
    ("asinh", -4, 4, False), ("asinh", -45, 38, True),
    ("acosh", 1, 1.001, False), ("acosh", 1, 4, False), ("acosh", 0, 38, True),
    ("atanh", -1, 1, False), ("atanh", 0.999, 1, False), ("atanh", -45, 0, True),
]


def row(name: str, region: str, ref: torch.Tensor, *results: torch.Tensor | None) -> str:
    cells = ["—" if r is None else f"{float(ulps(r, ref).max()):.2f}" for r in results]
    return f"| {name} | {region} | " + " | ".join(cells) + " |"


def main() -> None:
    torch.manual_seed(0)
    print("| op | inputs | approx (TOSA) | math (libm) | torch f32 |\n|---|---|---|---|---|")
    for name, lo, hi, log in UNARY:
        x = grid(lo, hi, log)
        fn = getattr(torch, name)
        region = f"±10^[{lo:g}, {hi:g}]" if log else f"[{lo:g}, {hi:g}]"
        op = f"aten.{name}.default"
        print(row(name, region, fn(x.double()), run_op(entry(op), [x])[0], run_op(entry(op, "math"), [x])[0], fn(x)))
    g = torch.linspace(-3, 3, 801)
    sign = lambda: torch.randint(0, 2, (N,)) * 2.0 - 1  # noqa: E731
    big = [sign() * torch.exp(torch.empty(N).uniform_(-87, 88)) for _ in range(2)]
    for region, (y, x) in [("[-3, 3]² grid", (g[:, None], g[None, :])), ("±e^[-87, 88] each", big)]:
        op = "aten.atan2.default"
        print(row("atan2", region, torch.atan2(y.double(), x.double()), run_op(entry(op), [y, x])[0],
                  run_op(entry(op, "math"), [y, x])[0], torch.atan2(y, x)))
    for name, lo, hi in [("exp", -88, 88), ("log", 0.01, 100), ("rsqrt", 0.01, 100)]:
        x = grid(lo, hi, False)
        fn = getattr(torch, name)
        tosa = run_op(entry(f"aten.{name}.default", "tosa"), [x])[0]
        print(row(f"tosa.{name} (the forms' parts)", f"[{lo:g}, {hi:g}]", fn(x.double()), tosa, None, fn(x)))


if __name__ == "__main__":
    main()
