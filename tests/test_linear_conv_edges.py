"""Edge cases of opdefs/linear.yaml and opdefs/conv.yaml that random samples cannot reach:
NaN and infinities, ties, windows hanging over the padding. Each runs one aten op natively
(torchtosa.testing.run_op) and compares with eager, bit for bit where torch is exact."""

from __future__ import annotations

import pytest
import torch

from torchtosa.importer.registry import registry
from torchtosa.testing import run_op

A = torch.ops.aten
NAN, INF = float("nan"), float("inf")


def overload(op: str) -> torch._ops.OpOverload:
    _, name, over = op.split(".")
    return getattr(getattr(A, name), over)


def run(op: str, *args: object) -> list[torch.Tensor]:
    """The op lowered natively, for positional args (the schema's defaults fill the rest)."""
    schema = overload(op)._schema.arguments
    full = list(args) + [a.default_value for a in schema[len(args):]]
    return run_op(registry()[op][0], full)


def check(op: str, *args: object) -> None:
    expected = overload(op)(*args)
    expected = list(expected) if isinstance(expected, tuple) else [expected]
    got = run(op, *args)
    assert len(got) == len(expected)
    for g, x in zip(got, expected, strict=True):
        torch.testing.assert_close(g, x, equal_nan=True)


# ---------------------------------------------------------------- addmm


def test_addmm_beta_zero_ignores_nan_in_self() -> None:
    self = torch.full((3, 5), NAN)
    m1, m2 = torch.randn(3, 4), torch.randn(4, 5)
    got = run("aten.addmm.default", self, m1, m2, 0, 1)[0]
    assert not got.isnan().any()
    torch.testing.assert_close(got, A.addmm(self, m1, m2, beta=0))


def test_addmm_alpha_zero_ignores_nan_and_inf_in_the_product() -> None:
    self = torch.randn(3, 5)
    m1 = torch.randn(3, 4)
    m1[0, 0], m1[1, 1] = NAN, INF
    got = run("aten.addmm.default", self, m1, torch.randn(4, 5), 0.5, 0)[0]
    torch.testing.assert_close(got, self * 0.5)


def test_mm_propagates_nan_and_inf() -> None:
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    a[0, 1], a[2, 2] = NAN, INF
    check("aten.mm.default", a, b)


# ---------------------------------------------------------------- max pooling indices


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_max_pool_ties_pick_the_first_maximum(dtype: torch.dtype) -> None:
    x = torch.randint(0, 3, (2, 3, 9, 9)).to(dtype)
    check("aten.max_pool2d_with_indices.default", x, [3, 3], [1, 1], [1, 1])
    check("aten.max_pool2d_with_indices.default", x, [3, 2], [2, 2], [1, 1], [2, 1], True)
    check("aten.adaptive_max_pool2d.default", x, [4, 3])


def test_max_pool_constant_plane_reports_the_first_in_bounds_element() -> None:
    # every window ties (padding included for -inf planes): torch keeps its first real element
    for value in (1.0, -INF):
        x = torch.full((1, 2, 7, 7), value)
        check("aten.max_pool2d_with_indices.default", x, [3, 3], [2, 2], [1, 1], [1, 1], True)
        check("aten.max_pool2d_with_indices.default", x, [3, 3], [2, 2], [1, 1], [2, 2], False)
        check("aten.adaptive_max_pool2d.default", x, [3, 5])


def test_max_pool_nan_wins_and_the_last_nan_is_reported() -> None:
    x = torch.randn(1, 1, 6, 6)
    x[0, 0, 0, 0] = NAN  # one NaN in a window
    x[0, 0, 2, 3] = x[0, 0, 3, 2] = NAN  # two NaNs in one window: torch reports the later
    x[0, 0, 5, 5] = INF
    check("aten.max_pool2d_with_indices.default", x, [2, 2], [2, 2])
    check("aten.max_pool2d_with_indices.default", x, [3, 3], [1, 1], [1, 1])
    check("aten.max_pool2d_with_indices.default", x, [2, 2], [1, 1], [0, 0], [2, 2])
    check("aten.adaptive_max_pool2d.default", x, [2, 4])


def test_max_pool_dilated_ceil_mode_windows() -> None:
    x = torch.randn(2, 2, 11, 10)
    for kernel, stride, pad, dil in [([3, 3], [2, 3], [1, 1], [2, 2]), ([2, 3], [3, 2], [1, 0], [3, 1])]:
        for ceil in (False, True):
            check("aten.max_pool2d_with_indices.default", x, kernel, stride, pad, dil, ceil)


# ---------------------------------------------------------------- average pooling


def test_avg_pool_every_divisor_rule() -> None:
    x = torch.randn(2, 3, 9, 8)
    for ceil in (False, True):
        for include in (False, True):
            for divisor in (None, 1, 7):
                check("aten.avg_pool2d.default", x, [3, 2], [2, 3], [1, 1], ceil, include, divisor)


def test_avg_pool_infinities_stay_in_their_windows() -> None:
    x = torch.randn(1, 1, 8, 8)
    x[0, 0, 0, 0], x[0, 0, 7, 7] = INF, -INF
    check("aten.avg_pool2d.default", x, [2, 2])
    check("aten._adaptive_avg_pool2d.default", x, [3, 3])
    check("aten._adaptive_avg_pool2d.default", x, [4, 4])


# ---------------------------------------------------------------- convolution


def test_conv_nan_stays_in_its_receptive_field() -> None:
    x = torch.randn(1, 4, 8, 8)
    x[0, 1, 0, 0] = NAN
    for groups, weight in [(1, torch.randn(6, 4, 3, 3)), (2, torch.randn(6, 2, 3, 3)), (4, torch.randn(8, 1, 3, 3))]:
        check("aten.convolution.default", x, weight, torch.randn(weight.shape[0]), [1, 1], [1, 1], [1, 1],
              False, [0, 0], groups)


def test_f16_transposed_conv_is_the_f32_result_rounded_once() -> None:
    # torch's CPU f16 transposed convolution rounds partial sums to f16; ours runs in f32
    x, w, b = torch.randn(2, 4, 5, 6) * 2, torch.randn(4, 3, 3, 3) * 2, torch.randn(3)
    x16, w16, b16 = x.half(), w.half(), b.half()
    rest = ([2, 2], [1, 1], [1, 1], True, [1, 1], 1)
    got = run("aten.convolution.default", x16, w16, b16, *rest)[0]
    expected = A.convolution(x16.float(), w16.float(), b16.float(), *rest).half()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
