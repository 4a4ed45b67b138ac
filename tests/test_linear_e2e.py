"""torch.matmul, F.linear, convolutions and pooling end to end through torchtosa.compile
(core ATen spells most of these with ops of other families: view, expand, permute, sum...)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import torchtosa


def check(fn: Callable, *args: torch.Tensor, **tol: float) -> None:
    got = torchtosa.compile(fn, *args)(*args)
    torch.testing.assert_close(got, fn(*args), **tol)


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


MATMUL_SHAPES = [
    ((3, 4), (4, 5)),  # mm
    ((4,), (4, 5)),  # unsqueeze + mm + squeeze
    ((3, 4), (4,)),  # mul + sum
    ((4,), (4,)),  # mul + sum
    ((2, 3, 4), (4, 5)),  # view + mm + view
    ((3, 4), (2, 4, 5)),  # expand + bmm
    ((2, 3, 4), (2, 4, 5)),  # bmm
    ((2, 4, 6, 8), (2, 4, 8, 6)),  # attention scores: expand + view + bmm + view
    ((2, 1, 3, 4), (3, 4, 5)),  # broadcast batch dims
    ((5,), (2, 5, 3)),  # 1-D @ batched
]


@pytest.mark.parametrize(("sa", "sb"), MATMUL_SHAPES, ids=[f"{a}x{b}" for a, b in MATMUL_SHAPES])
def test_matmul_shapes(sa: tuple[int, ...], sb: tuple[int, ...]) -> None:
    check(matmul, torch.randn(sa), torch.randn(sb))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matmul_half_precision(dtype: torch.dtype) -> None:
    check(matmul, torch.randn(2, 4, 6, 8).to(dtype), torch.randn(2, 4, 8, 6).to(dtype))


def test_attention_scores_and_weighted_sum() -> None:
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (q @ k.transpose(-2, -1)) @ v

    check(attend, torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8))


def test_linear_with_and_without_bias() -> None:
    w, b = torch.randn(5, 4), torch.randn(5)
    check(lambda x: F.linear(x, w, b), torch.randn(3, 4))
    check(lambda x: F.linear(x, w), torch.randn(3, 4))
    check(lambda x: F.linear(x, w, b), torch.randn(2, 3, 4))


def test_addmm_scalars() -> None:
    check(lambda s, a, b: torch.addmm(s, a, b, beta=0.5, alpha=-2), torch.randn(5), torch.randn(3, 4),
          torch.randn(4, 5))


def test_small_convnet() -> None:
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 8, 3, groups=8, padding=1), torch.nn.Conv2d(8, 16, 1, groups=2),
        torch.nn.AvgPool2d(2, ceil_mode=True), torch.nn.AdaptiveAvgPool2d((3, 3)),
    ).eval()
    with torch.no_grad():
        check(net, torch.randn(2, 3, 16, 16), atol=1e-4, rtol=1e-5)


def test_conv1d_and_1d_pools() -> None:
    w, b = torch.randn(6, 4, 3), torch.randn(6)
    check(lambda x: F.conv1d(x, w, b, stride=2, padding=1), torch.randn(2, 4, 17))
    check(lambda x: F.max_pool1d(x, 3, 2, 1), torch.randn(2, 4, 17))
    check(lambda x: F.avg_pool1d(x, 3, 2, 1, count_include_pad=False), torch.randn(2, 4, 17))
    check(lambda x: F.adaptive_avg_pool1d(x, 5), torch.randn(2, 4, 17))


def test_max_pool_indices() -> None:
    check(lambda x: F.max_pool2d(x, 3, 2, 1, ceil_mode=True, return_indices=True), torch.randn(2, 3, 9, 9))
    check(lambda x: F.adaptive_max_pool2d(x, (3, 4), return_indices=True), torch.randn(2, 3, 9, 9))


def test_transposed_convolutions() -> None:
    w2, w1, b = torch.randn(4, 3, 4, 4), torch.randn(4, 3, 5), torch.randn(3)
    check(lambda x: F.conv_transpose2d(x, w2, b, stride=2, padding=1), torch.randn(2, 4, 6, 7))
    check(lambda x: F.conv_transpose2d(x, w2, stride=2, padding=1, output_padding=1), torch.randn(2, 4, 6, 7))
    check(lambda x: F.conv_transpose1d(x, w1, b, stride=3, padding=2, output_padding=1), torch.randn(2, 4, 9))
