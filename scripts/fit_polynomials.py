"""Derive the polynomial coefficients of opdefs/math_tosa.yaml (the `approx` registry).

Each kernel approximates a function on a reduced interval by a polynomial in z (z = x² for the
odd functions: f(x) ≈ x + x·z·P(z); for acosh near 1, acosh(1 + d) ≈ sqrt(2d)·P(d)). P is
fitted to minimize the largest relative error of f on a dense grid (Lawson's iteratively
reweighted least squares, which converges to the minimax polynomial), with reference values
from mpmath at 40 digits. Reports the polynomial's largest relative error, then rounds the
coefficients to float32 (printed as the YAML's constants) and evaluates the kernel with float32
arithmetic in the order the emit lines use (Horner), reporting its largest error in float32 ulps
of the reference.

    python scripts/fit_polynomials.py            # every kernel: coefficients and errors
    python scripts/fit_polynomials.py atan asin  # some of them
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import mpmath
import numpy as np

mpmath.mp.dps = 40


@dataclass(frozen=True)
class Kernel:
    """f ≈ x + x·z·P(z), z = x², for |x| ≤ hi (odd), or f(1 + d) ≈ sqrt(2d)·P(d) (acosh)."""

    name: str
    f: Callable[[mpmath.mpf], mpmath.mpf]
    hi: float
    degree: int  # of P
    odd: bool = True


KERNELS = {k.name: k for k in [
    Kernel("atan", mpmath.atan, 1.0, 8),
    Kernel("asin", mpmath.asin, 0.5, 4),
    Kernel("sinh", mpmath.sinh, 1.0, 3),
    Kernel("asinh", mpmath.asinh, 0.75, 6),
    Kernel("atanh", mpmath.atanh, 0.5, 5),
    Kernel("acosh", mpmath.acosh, 0.5, 5, odd=False),
]}


def target(k: Kernel, x: float) -> tuple[float, float]:
    """(P's target value, weight turning an error of P into a relative error of f) at x."""
    v = mpmath.mpf(x)
    if k.odd:
        fx = k.f(v)
        return float((fx - v) / v**3), float(v**3 / fx)
    fx = k.f(1 + v)
    s = mpmath.sqrt(2 * v)
    return float(fx / s), float(s / fx)


def fit(k: Kernel, points: int = 3000, rounds: int = 200) -> np.ndarray:
    """Minimax coefficients of P (lowest degree first) in float64."""
    # Chebyshev-distributed grid over (0, hi]: dense at both ends, where minimax errors peak
    x = k.hi * (1 - np.cos(np.linspace(0, np.pi, points))) / 2
    x = x[x > k.hi * 1e-6]
    t = np.array([target(k, float(v)) for v in x])
    g, w = t[:, 0], t[:, 1]
    z = x * x if k.odd else x
    scale = z.max()
    a = (z[:, None] / scale) ** np.arange(k.degree + 1)[None, :] * w[:, None]
    b = g * w
    weights = np.full(len(x), 1.0 / len(x))
    for _ in range(rounds):
        sw = np.sqrt(weights)
        c, *_ = np.linalg.lstsq(a * sw[:, None], b * sw, rcond=None)
        err = np.abs(a @ c - b)
        weights = weights * err
        weights /= weights.sum()
    return c / scale ** np.arange(k.degree + 1)


def fit_error(k: Kernel, coefs: np.ndarray, samples: int = 4000) -> float:
    """Largest relative error of the float64 polynomial (before rounding) on (0, hi]."""
    x = np.linspace(0, k.hi, samples + 1)[1:]
    z = x * x if k.odd else x
    p = np.polyval(coefs[::-1], z)
    got = x + x * z * p if k.odd else np.sqrt(2 * x) * p
    ref = np.array([float(k.f(mpmath.mpf(v) + (0 if k.odd else 1))) for v in x])
    return float(np.max(np.abs(got - ref) / np.abs(ref)))


def evaluate_f32(k: Kernel, coefs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The kernel in float32, as the YAML computes it (Horner, then x + x·(z·P))."""
    f = np.float32
    c = [f(v) for v in coefs]
    x = x.astype(f)
    z = x * x if k.odd else x
    p = np.full_like(x, c[-1])
    for v in reversed(c[:-1]):
        p = p * z + v
    if k.odd:
        return x + x * (z * p)
    s2 = f(2) * x
    return (s2 * (f(1) / np.sqrt(s2))) * p


def ulp_error(k: Kernel, coefs: np.ndarray, samples: int = 20000) -> float:
    """Largest error of the float32 kernel on [0, hi], in float32 ulps of the reference."""
    x = np.unique(np.concatenate([np.linspace(0, k.hi, samples), k.hi * np.logspace(-8, 0, samples)]).astype(
        np.float32))
    x = x[(x > 0) & (x <= k.hi)]
    got = evaluate_f32(k, coefs, x).astype(np.float64)
    ref = np.array([float(k.f(mpmath.mpf(float(v)) + (0 if k.odd else 1))) for v in x])
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    return float(np.max(np.abs(got - ref) / ulp))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kernels", nargs="*", help="kernels to fit (default: all)")
    names = parser.parse_args().kernels or list(KERNELS)
    if unknown := [n for n in names if n not in KERNELS]:
        parser.error(f"unknown kernels {unknown}; choose from {list(KERNELS)}")
    for name in names:
        k = KERNELS[name]
        coefs = fit(k)
        print(f"{name}: {'|x|' if k.odd else 'd'} <= {k.hi:.9g}, P of degree {k.degree}: "
              f"relative error {fit_error(k, coefs):.1e}, "
              f"{ulp_error(k, coefs):.2f} ulp evaluated in f32")
        print("  " + ", ".join(repr(float(np.float32(c))) for c in coefs))


if __name__ == "__main__":
    main()
