"""The convolution rewrites of opt="default" (runtime/lower/convolutions.py): 1x1 convolutions as
matmuls, depthwise convolutions without the channel multiplier, padded inputs written in place;
each checked for what it makes of the IR and against eager and the reference lowering on random
inputs of odd sizes, strides, paddings and groups."""

from __future__ import annotations

import math
import re
from typing import Any

import numpy as np
import pytest
import torch
from mlir import ir
from test_models import _randomize_bn
from test_schedule import _linalg
from test_schedule import _ops as op_names
from torch import nn

import torchtosa
from torchtosa.cpu import select
from torchtosa.lower import convolutions, copies, partition, tiles, winograd
from torchtosa.lower.irutil import find_ops
from torchtosa.lower.schedule import _divisor, _lanes_divisor, pack_panels, plans
from torchtosa.lower.sink import sink_transposes


def _ops(fn: Any, *args: torch.Tensor, stop_before: str = "bufferize") -> list[str]:
    """The names of the ops of `fn`'s module, lowered with opt="default" up to `stop_before`."""
    return op_names(_linalg(fn, *args, stop_before=stop_before))


def _check(model: nn.Module, x: torch.Tensor) -> None:
    """opt="default" and opt="none" agree with eager on `x`."""
    model.eval()
    with torch.no_grad():
        want = model(x)
        for opt in ("default", "none"):
            got = torchtosa.compile(model, x, opt=opt, fallback="error")(x)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_pointwise_convolution_is_a_packed_matmul() -> None:
    names = _ops(nn.Conv2d(24, 40, 1).eval(), torch.randn(1, 24, 10, 12), stop_before="unit-dims")
    assert "linalg.conv_2d_nhwc_fhwc" in names
    names = _ops(nn.Conv2d(24, 40, 1).eval(), torch.randn(1, 24, 10, 12))
    assert "linalg.conv_2d_nhwc_fhwc" not in names and "linalg.matmul" not in names
    assert "vector.fma" in names


def test_depthwise_convolution_is_vectorized_along_channels() -> None:
    model = nn.Conv2d(32, 32, 3, padding=1, groups=32).eval()
    x = torch.randn(1, 32, 16, 16)
    assert "linalg.depthwise_conv_2d_nhwc_hwcm" in _ops(model, x, stop_before="unit-dims")
    names = _ops(model, x)
    assert not any(n.startswith("linalg.depthwise") for n in names)
    assert "vector.fma" in names


GROUPED = [  # (in, out, kernel, stride, padding, dilation, groups, input size)
    (56, 56, 3, 1, 1, 1, 7, (13, 11)),  # RegNet: groups of 8 channels, 8 outputs each
    (32, 32, 3, 2, 1, 1, 4, (15, 15)),  # strided
    (64, 128, 3, 1, 1, 1, 8, (9, 10)),  # 8 channels in, 16 out per group
    (128, 128, 3, 1, 1, 1, 32, (7, 7)),  # ResNeXt 32x4d: 4 and 4
    (24, 48, (3, 1), (2, 1), (0, 1), (2, 1), 6, (12, 9)),  # rectangular, dilated
    (16, 8, 5, 1, 2, 1, 2, (10, 10)),  # more inputs than outputs per group
    (12, 36, 1, 1, 0, 1, 3, (7, 7)),  # 1x1: an elementwise product and a sum by the time it is rewritten
    (128, 128, 1, 1, 0, 1, 4, (6, 9)),
]


@pytest.mark.parametrize(("cin", "cout", "kernel", "stride", "padding", "dilation", "groups", "size"), GROUPED)
def test_grouped_convolutions_are_batched_matmuls_over_taps(cin: int, cout: int, kernel: Any, stride: Any,
                                                             padding: Any, dilation: Any, groups: int,
                                                             size: tuple[int, int]) -> None:
    """A grouped convolution (opdefs/conv.yaml: a depthwise convolution of multiplier O/G, summed
    over each group's C/G channels) is a loop over its filter taps of batched matmuls over the
    groups (`convolutions._grouped_as_matmuls`), vectorized: neither the depthwise form (plain
    loops, 5-10x eager's time on a RegNet's groups of 8) nor its M times larger sum is left.
    Eager's values, batch 2, with and without a bias."""
    torch.manual_seed(cin + groups)
    model = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, dilation=dilation, groups=groups,
                      bias=cin % 3 == 0)
    x = torch.randn(2, cin, *size)
    if kernel != 1:
        assert "linalg.depthwise_conv_2d_nhwc_hwcm" in _ops(model.eval(), x, stop_before="unit-dims")
    names = _ops(model.eval(), x)
    assert not any(n.startswith("linalg.") for n in names) and "vector.fma" in names, sorted(set(names))
    _check(model, x)


def test_padded_input_is_written_in_place() -> None:
    """The transpose before a padded convolution writes the interior of the padded buffer: no
    tensor.pad remains, so bufferization makes no strided copy into it."""
    names = _ops(nn.Conv2d(8, 16, 3, padding=2).eval(), torch.randn(1, 8, 9, 11))
    assert "tensor.pad" not in names


def test_only_the_border_of_a_padded_buffer_is_filled() -> None:
    """The padded buffer a convolution reads is filled with the pad value along its border only
    (a slab before and after the interior per padded dimension), in place: the producer writes
    the interior, which a fill of the whole buffer wrote first for nothing (memsets of up to
    39 MB a call at batch 8 in MobileNetV2). The result equals eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 32, 1), nn.ReLU6(), nn.Conv2d(32, 32, 3, padding=1, groups=32)).eval()
    x = torch.randn(2, 8, 14, 14)
    module = _linalg(model, x, stop_before="schedule")
    with module.context:
        convolutions.pads_in_place(module)
    assert "tensor.pad" not in op_names(module)
    padded = [op.results[0] for op in find_ops(module, lambda op: op.name == "bufferization.alloc_tensor")]
    assert [ir.RankedTensorType(v.type).shape for v in padded] == [[2, 16, 16, 32]]
    fills = sorted(list(ir.RankedTensorType(op.results[0].type).shape)
                   for op in find_ops(module, lambda op: op.name == "linalg.fill")
                   if op.operands[1].owner.name == "tensor.extract_slice")
    assert fills == [[2, 1, 16, 32]] * 2 + [[2, 16, 1, 32]] * 2  # rows and columns of the border
    assert not [op for op in find_ops(module, lambda op: op.name == "linalg.fill")
                if ir.RankedTensorType(op.results[0].type).shape == [2, 16, 16, 32]]
    _check(model, x)


def test_an_argument_copied_into_its_padded_buffer_is_copied_by_rows() -> None:
    """A padded convolution of the function's argument (NHWC, as inside a channels-last model)
    copies it into the padded buffer's interior, a strided view: rows of it, each contiguous,
    become memcpy's (`copies.row_copies`), not a call of the runner library's element-wise
    `memrefCopy` (9x slower than eager on a 3x3 depthwise convolution over 112x112x32)."""
    conv = nn.Conv2d(32, 32, 3, padding=1, groups=32).eval()

    def fn(x: torch.Tensor) -> torch.Tensor:
        return conv(x.permute(0, 3, 1, 2)).permute(0, 2, 3, 1)

    x = torch.randn(1, 13, 17, 32)
    module = _linalg(fn, x, stop_before=None)
    calls = [ir.FlatSymbolRefAttr(op.attributes["callee"]).value
             for op in find_ops(module, lambda o: o.name == "llvm.call") if "callee" in op.attributes]
    intrinsics = [op.name for op in find_ops(module, lambda o: o.name == "llvm.intr.memcpy")]
    assert "memrefCopy" not in calls and intrinsics
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(fn, x)(x), fn(x), rtol=1e-5, atol=1e-5)


def test_contiguous_suffix_counts_innermost_dims_contiguous_on_both_sides() -> None:
    with ir.Context():
        def t(text: str) -> ir.Type:
            return ir.Type.parse(f"memref<{text}xf32>" if "strided" not in text else f"memref<{text}>")
        padded = t("4x5x8xf32, strided<[56, 8, 1], offset: 65>")  # a 4x5 interior of 6x7 rows
        assert copies._contiguous_suffix(t("4x5x8"), padded) == 2
        assert copies._contiguous_suffix(t("4x5x8"), t("4x5x8")) == 3
        assert copies._contiguous_suffix(t("4x1x8xf32, strided<[99, 7, 1]>"), t("4x1x8")) == 2
        assert copies._contiguous_suffix(t("4x5x8xf32, strided<[80, 16, 2]>"), t("4x5x8")) == 0
        assert copies._contiguous_suffix(t("?x5x8"), t("?x5x8")) == 2  # rows of a run-time count
        assert copies._contiguous_suffix(t("4x?x8"), t("4x?x8")) == 1
        assert copies._contiguous_suffix(t("?x5x8xf32, strided<[?, 16, 1]>"), t("?x5x8")) == 1


@pytest.mark.parametrize(("cin", "cout", "stride", "size"), [
    (5, 13, 1, (7, 9)), (16, 33, 2, (11, 10)), (3, 8, 3, (13, 13)), (64, 24, 2, (8, 8)),
])
def test_pointwise_convolutions_match_eager(cin: int, cout: int, stride: int, size: tuple[int, int]) -> None:
    torch.manual_seed(cin + cout)
    _check(nn.Conv2d(cin, cout, 1, stride=stride), torch.randn(2, cin, *size))


@pytest.mark.parametrize(("channels", "kernel", "stride", "padding", "multiplier"), [
    (7, 3, 1, 1, 1), (24, 3, 2, 1, 1), (40, 5, 2, 2, 1), (17, 3, 1, 0, 1), (6, 3, 1, 1, 2),
])
def test_depthwise_convolutions_match_eager(channels: int, kernel: int, stride: int, padding: int,
                                            multiplier: int) -> None:
    torch.manual_seed(channels)
    model = nn.Conv2d(channels, channels * multiplier, kernel, stride=stride, padding=padding, groups=channels)
    _check(model, torch.randn(2, channels, 13, 11))


def test_conv_block_with_bn_relu_and_pool_matches_eager() -> None:
    """Padded convolutions whose input is computed by a fused BatchNorm + ReLU (an elementwise
    generic writing the padded interior), a depthwise and a pointwise convolution in a row."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU6(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 24, 1), nn.MaxPool2d(3, 2, 1), nn.Conv2d(24, 24, 3, padding=1),
    )
    _check(_randomize_bn(model), torch.randn(2, 3, 29, 31))


def test_consecutive_convolutions_stay_nhwc() -> None:
    """Only the input's and the output's layout transposes of activations remain: each one
    between two layers is moved below its BatchNorm + ReLU epilogue and cancels the next."""
    model = nn.Sequential(nn.Conv2d(8, 16, 1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1),
                          nn.ReLU6(), nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.ReLU()).eval()
    module = torchtosa.to_tosa(model, torch.randn(1, 8, 12, 12), target=None).module
    assert _activation_transposes(module, 1, 16) == 6  # in and out of each of the three convolutions
    with module.context:
        sink_transposes(module)
    module.operation.verify()
    assert _activation_transposes(module, 1, 16) == 2


def _activation_transposes(module: ir.Module, batch: int, channels: int) -> int:
    """The tosa.transposes in `module`'s functions of [batch, ...] tensors of more than batch x
    channels elements: of activations, not of weights or BatchNorm parameters."""
    shapes = [ir.RankedTensorType(op.results[0].type).shape for f in module.body.operations
              if f.operation.name == "func.func" for op in f.regions[0].blocks[0].operations
              if op.operation.name == "tosa.transpose"]
    return sum(1 for shape in shapes if shape[0] == batch and math.prod(shape) > batch * channels)


class _TfPadded(nn.Module):
    """transformers' MobileNetV2 pads TensorFlow's way: F.pad before each 3x3 convolution
    (symmetric for stride 1, bottom/right only for stride 2 on an even size), none in the conv."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(8, channels, 3, stride=2), nn.BatchNorm2d(channels), nn.ReLU6())
        self.depthwise = nn.Conv2d(channels, channels, 3, groups=channels)
        self.down = nn.Conv2d(channels, channels, 3, stride=2, groups=channels)
        self.norm = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.pad(self.stem(nn.functional.pad(x, (0, 1, 0, 1))), (1, 1, 1, 1))
        y = torch.clamp(self.norm(self.depthwise(y)), 0.0, 6.0)
        return self.down(nn.functional.pad(y, (0, 1, 0, 1)))


def test_explicit_pads_stay_channels_last() -> None:
    """An F.pad between two convolutions is sunk with the NHWC -> NCHW transpose (its amounts
    permuted), which then cancels the next convolution's; the input's pad moves after its
    transpose to NHWC. Only the input's and output's layout transposes remain, the pads are
    written in place by the epilogues and the input's transpose, and the result is eager's."""
    model = _randomize_bn(_TfPadded(24)).eval()
    x = torch.randn(2, 8, 14, 16)
    module = torchtosa.to_tosa(model, x, target=None).module
    before = _activation_transposes(module, 2, 24)
    with module.context:
        sink_transposes(module)
    module.operation.verify()
    assert before == 6 and _activation_transposes(module, 2, 24) == 2
    assert "tensor.pad" not in _ops(model, x)
    _check(model, x)


@pytest.mark.parametrize(("conv", "columns"), [(nn.Conv2d(40, 24, 1), {8: 8, 16: 8}),
                                               (nn.Conv2d(24, 144, 1), {8: 16, 16: 48}),
                                               (nn.Conv2d(8, 48, 3, padding=1), {8: 16, 16: 16})])
def test_narrow_channel_counts_get_power_of_two_column_tiles(conv: nn.Module, columns: dict[int, int]) -> None:
    """MobileNetV2's 24 and 144 channels: the register tile's columns (the matmul's of a 1x1
    convolution, the output channels' of a dense one) are 8 or 16, not 24 or 48 vectorized
    whole; a matmul's 144 on AVX-512 take its tile of 48, vectorized one vector at a time (by
    lanes: AVX2 / AVX-512)."""
    x = torch.randn(2, conv.in_channels, 10, 9)
    planned = [(op.name, tiling[0]) for op, tiling in plans(_linalg(conv.eval(), x, stop_before="schedule"))
               if op.name in ("linalg.matmul", "linalg.conv_2d_nhwc_fhwc")]
    want = columns[tiles.derive(select()).lanes]
    assert planned and all(sizes[-4 if name.startswith("linalg.conv") else 1] == want for name, sizes in planned)
    _check(conv, x)


@pytest.mark.parametrize(("batch", "size", "padding"), [(16, 12, 1), (12, 9, 0), (3, 10, 1)])
def test_weight_gradients_take_register_rows_from_the_batch(batch: int, size: int, padding: int) -> None:
    """A weight gradient as AOTAutograd writes it, the forward's input channels (the batch)
    convolved with the output gradient (a filter the size of the image) into a few output
    pixels, gets its register tile's rows from the batch when that gives more of them than the
    output width (`schedule._batch_rows`: a conv block's backward ran 20% faster), else from the
    width as before; the result agrees with eager's."""
    x, g = torch.randn(batch, 4, size, size), torch.randn(24, 4, size + 2 * padding - 2, size + 2 * padding - 2)

    def wgrad(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.conv2d(x, g, padding=padding)

    rows = tiles.derive(select()).matmul[0]
    [sizes] = [t[0] for op, t in plans(_linalg(wgrad, x, g, stop_before="schedule"))
               if op.name.startswith("linalg.conv_2d")]
    by_batch = _divisor(batch, rows)  # 3 output pixels a row
    assert (sizes[0], sizes[2]) == ((by_batch, 1) if by_batch > 3 else (1, 3))
    got = torchtosa.compile(wgrad, x, g, fallback="error")(x, g)
    torch.testing.assert_close(got, wgrad(x, g), rtol=1e-4, atol=1e-4)


def test_partition_boundaries_stay_channels_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transposes are sunk before the function is partitioned, so the values crossing part
    boundaries are NHWC: only the input's and the output's layout transposes remain."""
    monkeypatch.setattr(partition, "PART_OPS", 20)
    blocks = [m for _ in range(6) for m in (nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU6())]
    model = _randomize_bn(nn.Sequential(*blocks)).eval()
    x = torch.randn(2, 16, 10, 10)
    module = _linalg(model, x, stop_before="tosa-to-linalg")
    assert sum(1 for op in module.body.operations if op.operation.name == "func.func") > 2
    assert _activation_transposes(module, 2, 16) == 2
    _check(model, x)


def test_depthwise_channel_tiles_are_whole_registers() -> None:
    assert [_lanes_divisor(n, 32, 16) for n in (144, 96, 960, 24, 40, 7)] == [16, 32, 32, 24, 20, 7]
    assert [_lanes_divisor(n, 16, 8) for n in (144, 96, 960, 24, 40, 7)] == [16, 16, 16, 8, 8, 7]


def test_max_pooling_is_channels_last_with_its_pads_in_place() -> None:
    """The pooling is NHWC (channels innermost, for LLVM's vectorizer) and its padded input and
    -inf mask are written in place by their producers: no tensor.pad, no copy but the result's."""
    model = nn.MaxPool2d(3, 2, 1).eval()
    x = torch.randn(1, 64, 15, 17)
    program = torchtosa.to_tosa(model, x, target=None)
    assert "tosa.max_pool2d" in str(program.module) and "x64xf32>" in str(program.module)
    assert "tensor.pad" not in _ops(model, x, stop_before="bufferize")
    assert _ops(model, x, stop_before="openmp").count("memref.copy") <= 1


@pytest.mark.parametrize(("channels", "size", "kernel", "stride", "padding", "ceil_mode"), [
    (64, (15, 17), 3, 2, 1, False), (48, (9, 11), 3, 2, 1, True), (20, (8, 8), 2, 2, 0, False),
    (3, (7, 9), (3, 2), (2, 1), (1, 0), True), (32, (6, 6), 3, 1, 1, False),
])
def test_max_pooling_matches_eager(channels: int, size: tuple[int, int], kernel: Any, stride: Any, padding: Any,
                                   ceil_mode: bool) -> None:
    x = -torch.rand(2, channels, *size) - 1.0  # negative: the -inf padding, not 0, is the max's start
    x[0, :, :3, :3] = float("-inf")  # windows of -inf only come out -inf
    _check(nn.MaxPool2d(kernel, stride, padding, ceil_mode=ceil_mode), x)


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize(("channels", "size", "kernel", "stride", "padding", "ceil_mode"), [
    (64, (15, 17), 3, 2, 1, False), (40, (9, 11), 3, 2, 1, True), (32, (14, 14), 3, 1, 1, False),
    (5, (7, 9), (3, 2), (2, 1), (1, 0), True),
])
def test_avg_pooling_matches_eager(channels: int, size: tuple[int, int], kernel: Any, stride: Any, padding: Any,
                                   ceil_mode: bool, count_include_pad: bool) -> None:
    pool = nn.AvgPool2d(kernel, stride, padding, ceil_mode=ceil_mode, count_include_pad=count_include_pad)
    _check(pool, torch.randn(1, channels, *size))


@pytest.mark.parametrize(("conv", "batch"), [(nn.Conv3d(4, 8, 3, padding=1, stride=(2, 1, 1)), 1),
                                             (nn.Conv3d(3, 6, (2, 3, 3), stride=(1, 2, 2), dilation=(2, 1, 1)), 2),
                                             (nn.Conv3d(4, 8, 1, bias=False), 2)])
def test_3d_convolutions_are_sums_of_2d_ones(conv: nn.Module, batch: int) -> None:
    """A 3-D convolution is, per batch element and depth tap, a 2-D convolution of the planes that
    tap reads, tiled and vectorized as any 2-D one (no 3-D convolution left as plain loops)."""
    x = torch.randn(batch, conv.in_channels, 7, 9, 9)
    ops = _ops(conv.eval(), x)
    assert "linalg.conv_3d_ndhwc_dhwcf" not in ops and "linalg.conv_1d_nwc_wcf" not in ops  # decomposed, vectorized
    assert "vector.fma" in ops
    _check(conv, x)


def test_filter_panels_beyond_the_cache_are_matmuls_per_tap_up_to_max_taps(monkeypatch: pytest.MonkeyPatch) -> None:
    """For x86-64-v3 (256 KiB of L2), a 3x3 filter of 256 x 256 channels, whose panels of 16
    output channels (147 KiB) exceed half the L2, is a matmul per tap; a 20x20 one (400 taps, as
    a weight gradient's output-gradient "filter") stays one convolution: a matmul and a copy per
    tap made a conv block's backward graph take 100 s to bufferize. Both agree with eager."""
    wide = nn.Conv2d(256, 256, 3, padding=1, bias=False)
    x = torch.randn(1, 256, 6, 6)
    big = nn.Conv2d(64, 64, 20, bias=False)
    y = torch.randn(1, 64, 22, 22)
    with monkeypatch.context() as patched:
        patched.setenv("TORCHTOSA_CPU", "x86-64-v3")
        assert 9 * 256 * tiles.derive(select()).convolution[1] * 4 > tiles.derive(select()).direct_filter_bytes
        names = _ops(wide.eval(), x, stop_before="schedule")
        assert names.count("linalg.matmul") == 9 and "linalg.conv_2d_nhwc_fhwc" not in names
        assert convolutions.MAX_TAPS < 400
        names = _ops(big.eval(), y, stop_before="schedule")
        assert "linalg.conv_2d_nhwc_fhwc" in names and "linalg.matmul" not in names
    _check(wide, x)
    _check(big, y)


@pytest.mark.parametrize(("conv", "size"), [(nn.Conv2d(24, 96, 3, padding=1), 9),
                                            (nn.Conv2d(16, 64, (3, 2), stride=2, dilation=(1, 2)), 11)])
def test_filters_of_several_column_tiles_are_packed_in_panels(conv: nn.Module, size: int) -> None:
    """A dense convolution of more output channels than one column tile loops over panels of
    them, each computing its filter panel (every tap and input channel) into one contiguous HWCF
    buffer and convolving the whole input with it (a 3-D convolution of 128 channels on 8 x 28
    x 28 ran 1.2x slower than eager this way on Zen 4, 1.5x as matmuls per tap, 2x reading the
    filter unpacked, strided, from the cache)."""
    x = torch.randn(2, conv.in_channels, size, size + 2)
    module = _linalg(conv.eval(), x, stop_before="schedule")
    columns = tiles.derive(select()).convolution[1]
    with module.context, ir.Location.unknown():
        pack_panels(module)
    convs = find_ops(module, lambda op: op.name.startswith("linalg.conv_2d"))
    panel = [*conv.kernel_size, conv.in_channels, columns]
    assert len(convs) == 1 and convs[0].name == "linalg.conv_2d_nhwc_hwcf"
    assert ir.RankedTensorType(convs[0].operands[1].type).shape == panel
    assert convs[0].parent.name == "scf.for" and conv.out_channels > columns
    _check(conv, x)


@pytest.mark.parametrize("bias", [True, False])
def test_output_channels_beyond_whole_panels_are_a_convolution_of_their_own(bias: bool) -> None:
    """136 output channels (not a multiple of the register tile's columns) run as panels of
    whole column tiles and a convolution of the remaining 8 after them, not as 17 panels of 8 (a
    fraction of an AVX-512 vector: a 3x3 convolution 64 -> 136 on 56 x 56 at 0.6x the speed of
    64 -> 128). Without a bias the zero fill of the output may start the tiles in registers;
    the rest's tiles read what the fill left. Both agree with eager."""
    conv = nn.Conv2d(16, 136, 3, padding=1, bias=bias)
    x = torch.randn(2, 16, 9, 11)
    module = _linalg(conv.eval(), x, stop_before="schedule")
    columns = tiles.derive(select()).convolution[1]
    with module.context, ir.Location.unknown():
        pack_panels(module)
    filters = [ir.RankedTensorType(op.operands[1].type).shape
               for op in find_ops(module, lambda op: op.name.startswith("linalg.conv_2d"))]
    assert [3, 3, 16, columns] in filters  # a whole panel, in the loop
    rest = 136 % columns
    assert [3, 3, 16, rest] in filters or [rest, 3, 3, 16] in filters  # the rest, after it
    _check(conv, x)


@pytest.mark.parametrize("m", sorted(winograd.TRANSFORMS))
def test_winograd_transforms_compute_a_correlation(m: int) -> None:
    """Each F(m, 3) table of winograd.TRANSFORMS: At [(G g) * (Bt d)] is the correlation of m + 2
    samples d with a 3-tap filter g (in float64, to rounding)."""
    bt, g, at = (np.array(x, dtype=np.float64) for x in winograd.TRANSFORMS[m])
    rng = np.random.default_rng(m)
    for _ in range(4):
        d, k = rng.standard_normal(m + 2), rng.standard_normal(3)
        np.testing.assert_allclose(at @ ((g @ k) * (bt @ d)), [d[i:i + 3] @ k for i in range(m)], rtol=0, atol=1e-12)


@pytest.mark.parametrize(("conv", "shape"), [
    (nn.Conv2d(128, 128, 3, padding=1), (2, 128, 11, 13)),  # partial tiles at the bottom and right
    (nn.Conv3d(128, 128, 3, padding=1, stride=(2, 1, 1), bias=False), (2, 128, 5, 9, 9)),
    (nn.Conv3d(128, 136, 3, padding=(2, 1, 1), dilation=(2, 1, 1)), (1, 128, 4, 12, 12))])
def test_wide_3x3_convolutions_run_by_winograd(conv: nn.Module, shape: tuple[int, ...]) -> None:
    """A 3x3 convolution of stride 1 over winograd.MIN_CHANNELS channels and MIN_ROWS tiles (a 3-D
    one's per plane, any depth stride and dilation) is Winograd's: transforms and a batch of
    matmuls, no convolution op left; it agrees with eager as closely as the direct one does."""
    x = torch.randn(shape)
    names = _ops(conv.eval(), x, stop_before="schedule")
    assert not any(n.startswith("linalg.conv") for n in names) and "linalg.batch_matmul" in names
    _check(conv, x)


def test_3x3_convolutions_over_few_tiles_stay_direct() -> None:
    """512 channels on 7 x 7 (16 tiles of 2 x 2): the filter's transform would cost more than the
    matmuls save."""
    names = _ops(nn.Conv2d(512, 512, 3, padding=1).eval(), torch.randn(1, 512, 7, 7), stop_before="schedule")
    assert "linalg.batch_matmul" not in names


@pytest.mark.parametrize("pool", ["avg", "max"])
def test_a_pooling_kernel_larger_than_its_input_reads_only_the_input(pool: str) -> None:
    """HF EfficientNet pools its last 18 x 18 map with a 2560 x 2560 kernel (ceil_mode: one
    window): the window is clipped to the input, which the lowering padded to the kernel's size
    before (2560 channels: 67 GB, an allocation failure)."""
    def pooled(x: torch.Tensor) -> torch.Tensor:
        if pool == "avg":
            return nn.functional.avg_pool2d(x, 2560, ceil_mode=True)
        return nn.functional.max_pool2d(x, 2560, ceil_mode=True)

    x = torch.randn(1, 64, 18, 18)
    text = str(torchtosa.to_tosa(pooled, x))
    assert "kernel = array<i64: 18, 18>" in text and "2560x" not in text  # no tensor of its size
    torch.testing.assert_close(torchtosa.compile(pooled, x)(x), pooled(x))


ATROUS = {  # input, conv, the taps kept: dilated convolutions with taps that read only padding
    "deeplab-24": ((1, 8, 16, 16), dict(kernel_size=3, padding=24, dilation=24), (1, 1)),  # a 1x1 convolution
    "deeplab-12": ((1, 8, 16, 16), dict(kernel_size=3, padding=12, dilation=12), (3, 3)),  # every tap reads some
    "cropped": ((2, 4, 7, 9), dict(kernel_size=(3, 5), padding=(6, 8), dilation=(7, 4), stride=(2, 1)), (1, 5)),
    "depthwise": ((1, 8, 6, 6), dict(kernel_size=3, padding=8, dilation=8, groups=8), (1, 1)),
    "1-D": ((2, 4, 10), dict(kernel_size=5, padding=8, dilation=6), (1,)),
    "3-D": ((1, 2, 4, 6, 6), dict(kernel_size=3, padding=(4, 1, 6), dilation=(4, 1, 6)), (1, 3, 1)),
}


@pytest.mark.parametrize("name", ATROUS)
def test_kernel_taps_that_read_only_padding_are_dropped(name: str) -> None:
    """DeepLabV3's atrous convolutions (dilation 24 and 36 over 16x16 maps) computed every tap's
    products of the zero padding: the taps no window reads the input with are dropped
    (decompositions._convolution), the input padded or cropped for those left. Equal to eager."""
    shape, kwargs, kept = ATROUS[name]
    torch.manual_seed(0)
    x = torch.randn(*shape)
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[len(shape) - 3](shape[1], 8, **kwargs).eval()
    op, dims = re.search(r"tosa\.(depthwise_conv2d|conv2d|conv3d) .*? : \(tensor<[^>]*>, tensor<([\dx]+)x\w+>",
                         str(torchtosa.to_tosa(conv, x))).groups()
    weight = [int(d) for d in dims.split("x")]
    spatial = {"depthwise_conv2d": weight[:2], "conv2d": weight[1:3], "conv3d": weight[1:4]}[op]
    assert tuple(spatial[-len(kept):]) == kept
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(conv, x)(x), conv(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_bf16_pointwise_convolutions_are_matmuls_natively(bias: bool) -> None:
    """A bf16 1x1 convolution of stride 1 without padding is natively a matmul of the pixels by
    the weight (conv.yaml's `pw`: the schedule multiplies bf16 pairs where the CPU can, instead of
    an f32 convolution of widened operands); a TOSA target keeps the convolution. f32 sums plus
    the bias, rounded to bf16 once."""
    torch.manual_seed(0)
    conv = nn.Conv2d(64, 48, 1, bias=bias).to(torch.bfloat16).eval()
    x = torch.randn(1, 64, 10, 9, dtype=torch.bfloat16)
    native = str(torchtosa.to_tosa(conv, x, target=None).module)
    assert "tosa.matmul" in native and "tosa.conv2d" not in native
    assert "tosa.conv2d" in str(torchtosa.to_tosa(conv, x).module)
    expected = torch.nn.functional.conv2d(x.float(), conv.weight.float(), conv.bias.float() if bias else None)
    with torch.no_grad():
        got = torchtosa.compile(conv, x)(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.to(torch.bfloat16).float(), rtol=2**-8,
                               atol=2**-8 * expected.abs().max().item())
