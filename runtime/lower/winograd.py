"""3x3 convolutions of stride 1 by Winograd's minimal filtering algorithm F(m x m, 3 x 3).

Each m x m tile of output pixels is At [(G g Gt) * (Bt d B)] A, d the (m + 2)^2 input pixels
under it and g the 3 x 3 filter (Lavin and Gray, "Fast Algorithms for Convolutional Neural
Networks", 2015). Over C input and F output channels the elementwise product is a sum over C:
for each of the (m + 2)^2 transformed positions, a matmul [tiles x C] x [C x F]. F(2, 3) takes
16 products where the direct convolution takes 36 (2.25x fewer multiply-adds); F(4, 3) 36 for 144
(4x), but its transforms' large coefficients cost f32 accuracy: a 3x3x128 convolution of unit-
scale inputs was off from a float64 one by 4e-5 (F(2, 3): 2e-6, the direct one: 1.2e-6). F(2, 3) it is.

Every step is a matmul the schedule already runs fast (packed panels, register tiles), on
tensors laid out so that each transform is one matmul by a constant Kronecker product:

    D[ij, p, t, c] = image[p, m*th + i, m*tw + j, c]      (t = (th, tw); (m + 2)^2 strided copies)
    V = kron(Bt, Bt) @ D                                 [(m + 2)^2, P*T*C]
    U = kron(G, G) @ g                                   [(m + 2)^2, KD*C*F]   (g: taps x C*F)
    M[xy] = sum over depth taps kd of V[xy, planes of kd] @ U[xy, kd]   (batch_matmul)
    Y = kron(At, At) @ M                                 [m*m, Q*T*F]
    out[q, m*th + i, m*tw + j, f] = Y[ij, q, t, f]       (a transpose)

A 3-D convolution (NDHWC, DHWCF filter, any depth stride and dilation) transforms each input
plane once; its depth taps accumulate in M.
"""

from __future__ import annotations

import math

import numpy as np
from mlir import ir
from mlir.dialects import arith, linalg, tensor

from .irutil import collapse, expand, static_insert, static_slice

# F(m x m, 3 x 3): Bt [(m+2) x (m+2)], G [(m+2) x 3], At [m x (m+2)] (Lavin and Gray's, points 0, 1, -1, inf)
TRANSFORMS = {
    2: ([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]],
        [[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]],
        [[1, 1, 1, 0], [0, 1, -1, -1]]),
}
M = 2  # output tile side used (see the module docstring)
# Where the matmuls outweigh the transforms (one thread, Zen 4; 3x3 convolutions of stride 1 as
# in ResNet-50 at batch 1, direct against Winograd): 64 channels on 56 x 56, 2.4 against 2.6 ms;
# 128 on 28 x 28, 2.3 against 1.6 ms. The filter's transform, [16, C, F], is computed on every
# call: over few tiles (512 channels on 7 x 7: 16 tiles) it costs more than it saves.
MIN_CHANNELS = 128  # input and output channels
MIN_ROWS = 64  # tiles of an output plane x planes: the rows of each transformed position's matmul
TAPS = 3


def applies(filter_hw: list[int], strides: list[int], dilations: list[int], channels: int, features: int,
            output_hw: list[int], planes: int) -> bool:
    """A 2-D (or a 3-D convolution's per-plane) 3 x 3 filter of stride and dilation 1 over at
    least MIN_CHANNELS input and output channels and MIN_ROWS tiles of output pixels in `planes`
    output planes of `output_hw` pixels."""
    rows = planes * math.ceil(output_hw[0] / M) * math.ceil(output_hw[1] / M)
    return filter_hw == [TAPS, TAPS] and strides == [1, 1] and dilations == [1, 1] \
        and min(channels, features) >= MIN_CHANNELS and rows >= MIN_ROWS


def convolve(image: ir.Value, taps: ir.Value, init: ir.Value, depth_stride: int = 1, depth_dilation: int = 1,
             m: int = M) -> ir.Value:
    """init + the convolution of `image` [P, H, W, C] (planes of padded pixels) by `taps`
    [KD, 3, 3, C, F] (HWCF filters of KD depth taps) into `init` [Q, OH, OW, F]: output plane q
    sums tap kd over input plane q * depth_stride + kd * depth_dilation. Built at the current
    insertion point; static f32 shapes."""
    bt, g, at = (np.array(x, dtype=np.float32) for x in TRANSFORMS[m])
    a = m + TAPS - 1
    p, _, _, c = ir.RankedTensorType(image.type).shape
    kd, _, _, _, f = ir.RankedTensorType(taps.type).shape
    q, oh, ow, _ = ir.RankedTensorType(init.type).shape
    th, tw = -(-oh // m), -(-ow // m)
    image = _padded(image, [p, m * th + TAPS - 1, m * tw + TAPS - 1, c])

    gathered = _empty([a * a, p, th, tw, c])  # D: each position of a tile, over every tile
    for i in range(a):
        for j in range(a):
            read = static_slice(image, [0, i, j, 0], [p, th, tw, c], [1, m, m, 1])
            slot = static_slice(gathered, [i * a + j, 0, 0, 0, 0], [1, p, th, tw, c])
            copied = linalg.copy(expand(read, [[0, 1], [2], [3], [4]], [1, p, th, tw, c]), outs=[slot])
            gathered = static_insert(copied, gathered, [i * a + j, 0, 0, 0, 0])
    transformed = _matmul(np.kron(bt, bt), collapse(gathered, [[0], [1, 2, 3, 4]]))  # V [a*a, P*T*C]
    transformed = expand(transformed, [[0], [1, 2, 3]], [a * a, p, th * tw, c])

    hwcf = linalg.transpose(taps, outs=[_empty([TAPS, TAPS, kd, c, f])], permutation=[1, 2, 0, 3, 4]).results[0]
    filters = _matmul(np.kron(g, g), collapse(hwcf, [[0, 1], [2, 3, 4]]))  # U [a*a, KD*C*F]
    filters = expand(filters, [[0], [1, 2, 3]], [a * a, kd, c, f])

    products = _zeros([a * a, q * th * tw, f])  # M
    for tap in range(kd):
        planes = static_slice(transformed, [0, tap * depth_dilation, 0, 0], [a * a, q, th * tw, c],
                              [1, depth_stride, 1, 1])
        if depth_stride != 1:
            planes = linalg.copy(planes, outs=[_empty([a * a, q, th * tw, c])])
        tap_filters = collapse(static_slice(filters, [0, tap, 0, 0], [a * a, 1, c, f]), [[0, 1], [2], [3]])
        products = linalg.batch_matmul(collapse(planes, [[0], [1, 2], [3]]), tap_filters, outs=[products])

    tiles = _matmul(np.kron(at, at), collapse(products, [[0], [1, 2]]))  # Y [m*m, Q*T*F]
    tiles = expand(tiles, [[0, 1], [2, 3, 4, 5]], [m, m, q, th, tw, f])
    pixels = linalg.transpose(tiles, outs=[_empty([q, th, m, tw, m, f])], permutation=[2, 3, 0, 4, 1, 5]).results[0]
    pixels = collapse(pixels, [[0], [1, 2], [3, 4], [5]])
    if [th * m, tw * m] != [oh, ow]:
        pixels = static_slice(pixels, [0, 0, 0, 0], [q, oh, ow, f])
    return linalg.add(pixels, init, outs=[init])


def _matmul(constant: np.ndarray, value: ir.Value) -> ir.Value:
    """constant @ value (a 2-D tensor)."""
    rows = constant.shape[0]
    columns = ir.RankedTensorType(value.type).shape[1]
    t = ir.RankedTensorType.get(list(constant.shape), ir.F32Type.get())
    lhs = arith.ConstantOp(t, ir.DenseElementsAttr.get(np.ascontiguousarray(constant), type=t)).result
    return linalg.matmul(lhs, value, outs=[_zeros([rows, columns])])


def _padded(image: ir.Value, shape: list[int]) -> ir.Value:
    """`image` with zeros after its end up to `shape`."""
    have = ir.RankedTensorType(image.type).shape
    if have == shape:
        return image
    return static_insert(image, _zeros(shape), [0] * len(shape))


def _empty(shape: list[int]) -> ir.Value:
    return tensor.EmptyOp(shape, ir.F32Type.get()).result


def _zeros(shape: list[int]) -> ir.Value:
    zero = arith.ConstantOp(ir.F32Type.get(), 0.0).result
    return linalg.fill(zero, outs=[_empty(shape)])

