"""The decomposition table capture hands AOTAutograd, valid for training as for inference.

AOTAutograd applies a decomposition below autograd: the autograd node of the original op is
recorded first, so its backward formula receives the decomposition's results. A decomposition
must therefore return what the op's schema promises, every result included, or the backward
computes with the wrong values while the forward looks right. `DECOMPOSITIONS` is
`torch._decomp.core_aten_decompositions()` with these changes:

- `_scaled_dot_product_flash_attention_for_cpu` (what `F.scaled_dot_product_attention` runs on
  the CPU): core ATen's decomposition returns the attention probabilities where the schema has
  the logsumexp of the scores, which the backward kernel reads. Here it returns the logsumexp,
  and its backward (`..._backward`) is decomposed too, into matmuls and elementwise ops.
- `convolution_backward` (not decomposed by core ATen): the input gradient is a transposed
  convolution of the output gradient (or a convolution of it, spread to the input's grid, by the
  flipped kernel), the weight gradient a convolution of the input by the output gradient (batch
  and channels swapped), the bias gradient a sum. `max_pool2d_with_indices_backward` (core
  ATen's decomposition scatters, with a one-hot mask of every input position by every output
  position where torchtosa lowers scatter_add): a masked gradient per kernel tap, spread to the
  input's grid, or, where the windows tile the input (stride = kernel, as 2x2 pooling), one
  select over the windows' grid. Both into ops with entries of their own.
- `_transformer_encoder_layer_fwd` (nn.TransformerEncoderLayer's fused inference kernel, which
  Dynamo puts in a graph under no_grad) in composite ops.
- `roll` as slices and a cat (core ATen gathers with computed integer indices, which a float
  TOSA profile has no op for).
- `_safe_softmax` (attention's probabilities) is kept whole: it has an entry of its own, which
  finds the rows of -inf only from the row's max and sum, where core ATen's decomposition
  compared every score with -inf (one more pass over the scores).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
from torch._decomp import core_aten_decompositions

from ..errors import Unsupported
from ..importer.rules import conv_out
from .resizes import keep_nearest

__all__ = ["DECOMPOSITIONS"]

aten = torch.ops.aten
Tensor = torch.Tensor


def _scores(query: Tensor, key: Tensor, is_causal: bool, attn_mask: Tensor | None,
            scale: float | None) -> Tensor:
    """q kᵀ · scale plus the mask (a bool mask as 0 / -inf, causal as the lower triangle), as
    core ATen's `_scaled_dot_product_attention_math` computes it (the scale split between q and k)."""
    root = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(query.size(-1)))
    scores = (query * root) @ (key.transpose(-2, -1) * root)
    if is_causal:
        length, source = query.size(-2), key.size(-2)
        keep = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(keep.logical_not(), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros_like(attn_mask, dtype=scores.dtype).masked_fill(attn_mask.logical_not(),
                                                                                 float("-inf"))
        scores = scores + attn_mask
    return scores


def _heads(t: Tensor, query: Tensor) -> Tensor:
    """Key or value heads repeated for grouped-query attention (query has a multiple of them)."""
    groups = query.size(1) // t.size(1)
    return t.repeat_interleave(groups, dim=1) if groups > 1 else t


def _grouped(grad: Tensor, like: Tensor) -> Tensor:
    """A gradient of repeated key/value heads summed back over each group."""
    groups = grad.size(1) // like.size(1)
    if groups == 1:
        return grad
    b, _, s, e = grad.shape
    return grad.reshape(b, like.size(1), groups, s, e).sum(2)


def _flash_cpu(query: Tensor, key: Tensor, value: Tensor, dropout_p: float = 0.0, is_causal: bool = False, *,
               attn_mask: Tensor | None = None, scale: float | None = None) -> tuple[Tensor, Tensor]:
    """(output, logsumexp of the scores over the keys), laid out as the CPU kernel lays them out.
    A row whose every key is masked has output 0 (and logsumexp -inf), as in eager."""
    torch._check(dropout_p == 0.0, lambda: f"dropout probability must be zero, got {dropout_p}")
    torch._check(query.dim() == 4 and key.dim() == 4 and value.dim() == 4,
                 lambda: "q, k, v must be 4 dimensional tensors")
    scores = _scores(query, _heads(key, query), is_causal, attn_mask, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = aten._safe_softmax.default(scores, -1)
    out = probs @ _heads(value, query)
    # the kernel's output is [B, L, H, E] in memory: a view the model takes of it (MHA merges
    # heads with .view) must stay valid
    return out.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3), lse


def _flash_cpu_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                        logsumexp: Tensor, dropout_p: float, is_causal: bool, *, attn_mask: Tensor | None = None,
                        scale: float | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of query, key and value from the probabilities recomputed from the logsumexp:
    P = exp(S - lse), dV = Pᵀ dO, dS = P (dO Vᵀ - rowsum(dO * O)), dQ = dS K scale, dK = dSᵀ Q scale."""
    torch._check(dropout_p == 0.0, lambda: f"dropout probability must be zero, got {dropout_p}")
    keys, values = _heads(key, query), _heads(value, query)
    scores = _scores(query, keys, is_causal, attn_mask, scale)
    lse = logsumexp.unsqueeze(-1)
    # a fully masked row (lse = -inf) has probabilities 0, not exp(-inf + inf) = nan
    probs = torch.where(lse == float("-inf"), 0.0, torch.exp(scores - lse)).to(query.dtype)
    grad_probs = grad_out @ values.transpose(-2, -1)
    rowsum = (grad_out * out).sum(-1, keepdim=True)
    grad_scores = probs * (grad_probs - rowsum)
    factor = scale if scale is not None else 1.0 / math.sqrt(query.size(-1))
    grad_query = (grad_scores @ keys) * factor
    grad_key = _grouped((grad_scores.transpose(-2, -1) @ query) * factor, key)
    grad_value = _grouped(probs.transpose(-2, -1) @ grad_out, value)
    return grad_query, grad_key, grad_value


def _spread(t: Tensor, steps: list[int], offsets: list[int], sizes: list[int]) -> Tensor:
    """A grid of `sizes` (the trailing dims) holding t[..., o] at o * step + offset, zero elsewhere:
    zeros interleaved between t's values, then padded (or, past the grid, cropped) into place."""
    lead, inner = list(t.shape[:-len(steps)]), list(t.shape[-len(steps):])
    if any(s > 1 for s in steps):
        t = t.reshape(*lead, *(d for o in inner for d in (o, 1)))
        pad = [p for s in reversed(steps) for p in (0, s - 1, 0, 0)]
        t = aten.constant_pad_nd.default(t, pad)
        t = t.reshape(*lead, *(o * s for o, s in zip(inner, steps, strict=True)))
    pad = [p for o, s, off, n in reversed(list(zip(inner, steps, offsets, sizes, strict=True)))
           for p in (off, n - off - o * s)]
    return aten.constant_pad_nd.default(t, pad)


def _convolution_backward(grad_output: Tensor, input: Tensor, weight: Tensor, bias_sizes: Any, stride: list[int],
                          padding: list[int], dilation: list[int], transposed: bool, output_padding: list[int],
                          groups: int, output_mask: list[bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """The gradients of a (not transposed) convolution, each only where `output_mask` asks:

    - input: grad_output by the weight, transposed: a transposed convolution (with the output
      padding that restores the input's size) where tosa.transpose_conv2d takes it (no groups, no
      dilation, padding below the kernel); else grad_output spread to the input's grid (stride - 1
      zeros between rows, shifted by (k - 1) * dilation - padding) convolved by the flipped
      kernel with each group's input and output channels swapped;
    - weight: for groups G, input [N, G*Cg, ...] as [Cg, G*N, ...] convolved (groups G, stride and
      dilation swapped) by grad_output [N, G*M, ...] as [G*M, N, ...] gives [Cg, G*M, k'...], cut
      to the kernel's size k (k' >= k) and transposed to [G*M, Cg, k...];
    - bias: grad_output summed over every dim but the channels.
    """
    if transposed:
        return NotImplemented  # a transposed convolution's gradients: the op stays in the graph
    spatial = weight.dim() - 2
    stride, padding, dilation = (list(p) * spatial if len(p) == 1 else list(p) for p in (stride, padding, dilation))
    kernel, sizes = list(weight.shape[2:]), list(input.shape[2:])
    n, c = input.shape[:2]
    cg, o = c // groups, grad_output.size(1)
    grad_input = grad_weight = grad_bias = None
    if output_mask[0]:
        reach = [(g - 1) * s - 2 * p + d * (k - 1) + 1
                 for g, s, p, d, k in zip(grad_output.shape[2:], stride, padding, dilation, kernel, strict=True)]
        if groups == 1 and dilation == [1] * spatial and all(p < k for p, k in zip(padding, kernel, strict=True)):
            extra = [i - r for i, r in zip(sizes, reach, strict=True)]
            grad_input = aten.convolution.default(grad_output, weight, None, stride, padding, dilation, True, extra,
                                                  groups)
        else:
            halo = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
            grid = _spread(grad_output, stride, [h - p for h, p in zip(halo, padding, strict=True)],
                           [i + h for i, h in zip(sizes, halo, strict=True)])
            flipped = weight.reshape(groups, o // groups, cg, *kernel).transpose(1, 2).flip(list(range(3, 3 + spatial)))
            grad_input = aten.convolution.default(grid, flipped.reshape(c, o // groups, *kernel), None, [1] * spatial,
                                                  [0] * spatial, dilation, False, [0] * spatial, groups)
    if output_mask[1]:
        x = input.reshape(n, groups, cg, *sizes).transpose(0, 2).reshape(cg, groups * n, *sizes)
        g = grad_output.transpose(0, 1)
        full = aten.convolution.default(x, g, None, dilation, padding, stride, False, [0] * spatial, groups)
        cut = full[(slice(None), slice(None), *(slice(0, k) for k in kernel))]
        grad_weight = cut.transpose(0, 1).reshape(o, cg, *kernel)
    if output_mask[2]:
        grad_bias = grad_output.sum([0, *range(2, grad_output.dim())])
    return grad_input, grad_weight, grad_bias


def _max_pool2d_backward(grad_output: Tensor, input: Tensor, kernel_size: list[int], stride: list[int],
                         padding: list[int], dilation: list[int], ceil_mode: bool, indices: Tensor) -> Tensor:
    """Each window's gradient to the input position its index names, tap by tap: for kernel tap
    (i, j), the windows whose max is at that tap (index == its position, computed from the output
    position) give their gradient, spread to the input's grid at o * stride + tap * dilation -
    padding; the taps' grids are summed (overlapping windows may share a max). A tap position
    outside the input may equal another position's index, but its grid crops it away."""
    def pair(v: list[int], default: list[int]) -> list[int]:
        return default if not v else list(v) * 2 if len(v) == 1 else list(v)

    kernel = pair(kernel_size, [])
    steps, pads, dils = pair(stride, kernel), pair(padding, [0, 0]), pair(dilation, [1, 1])
    height, width = input.shape[-2:]
    rows, cols = grad_output.shape[-2:]
    zero = torch.zeros((), dtype=grad_output.dtype, device=grad_output.device)
    if steps == kernel and pads == [0, 0] and dils == [1, 1] and rows * steps[0] <= height and cols * steps[1] <= width:
        return _unpool(grad_output, indices, kernel, height, width)
    grad = None
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            top, left = i * dils[0] - pads[0], j * dils[1] - pads[1]
            r = torch.arange(rows, device=indices.device) * steps[0] + top
            q = torch.arange(cols, device=indices.device) * steps[1] + left
            picked = torch.where(indices == r.unsqueeze(-1) * width + q, grad_output, zero)
            part = _spread(picked, steps, [top, left], [height, width])
            grad = part if grad is None else grad + part
    return grad


def _unpool(grad_output: Tensor, indices: Tensor, kernel: list[int], height: int, width: int) -> Tensor:
    """`_max_pool2d_backward` of windows that tile the input (stride = kernel, no padding or
    dilation): an input position lies in one window at most and gets that window's gradient where
    the window's index names it. One select over the grid of windows [..., rows, kh, cols, kw]
    (each window's index and gradient broadcast over its taps), then zeros for the rows and
    columns no window covers."""
    rows, cols = grad_output.shape[-2:]
    lead = list(grad_output.shape[:-2])
    row = torch.arange(rows * kernel[0], device=indices.device).reshape(rows, kernel[0], 1, 1)
    col = torch.arange(cols * kernel[1], device=indices.device).reshape(1, 1, cols, kernel[1])
    window = [*lead, rows, 1, cols, 1]
    zero = torch.zeros((), dtype=grad_output.dtype, device=grad_output.device)
    picked = torch.where(indices.reshape(window) == row * width + col, grad_output.reshape(window), zero)
    grad = picked.reshape(*lead, rows * kernel[0], cols * kernel[1])
    if (rows * kernel[0], cols * kernel[1]) == (height, width):
        return grad
    return aten.constant_pad_nd.default(grad, [0, width - cols * kernel[1], 0, height - rows * kernel[0]])


def _encoder_layer_fwd(
    src: Tensor, embed_dim: int, num_heads: int, qkv_weight: Tensor, qkv_bias: Tensor,
    proj_weight: Tensor, proj_bias: Tensor, use_gelu: bool, norm_first: bool, eps: float,
    norm_weight_1: Tensor, norm_bias_1: Tensor, norm_weight_2: Tensor,
    norm_bias_2: Tensor, ffn_weight_1: Tensor, ffn_bias_1: Tensor,
    ffn_weight_2: Tensor, ffn_bias_2: Tensor, mask: Tensor | None = None,
    mask_type: int | None = None,
) -> Tensor:
    """aten._transformer_encoder_layer_fwd (nn.TransformerEncoderLayer's fused inference kernel) in
    composite ops. Dynamo takes that fast path under no_grad, and no decomposition ships with torch;
    `capture` avoids it by disabling the fast path while tracing, a torch.compile backend cannot."""
    if mask is not None:
        raise Unsupported("nn.TransformerEncoderLayer's fused inference path with a mask under torch.compile: "
                          "call torch.backends.mha.set_fastpath_enabled(False) or use torchtosa.compile")
    F = torch.nn.functional
    b, s, _ = src.shape
    head_dim = embed_dim // num_heads

    def heads(t: Tensor) -> Tensor:
        return t.reshape(b, s, num_heads, head_dim).transpose(1, 2)

    def attention(x: Tensor) -> Tensor:
        q, k, v = F.linear(x, qkv_weight, qkv_bias).chunk(3, dim=-1)
        scores = torch.matmul(heads(q), heads(k).transpose(-2, -1)) / math.sqrt(head_dim)
        out = torch.matmul(torch.softmax(scores, dim=-1), heads(v))
        return F.linear(out.transpose(1, 2).reshape(b, s, embed_dim), proj_weight, proj_bias)

    def feed_forward(x: Tensor) -> Tensor:
        h = F.linear(x, ffn_weight_1, ffn_bias_1)
        return F.linear(F.gelu(h) if use_gelu else F.relu(h), ffn_weight_2, ffn_bias_2)

    def norm1(x: Tensor) -> Tensor:
        return F.layer_norm(x, (embed_dim,), norm_weight_1, norm_bias_1, eps)

    def norm2(x: Tensor) -> Tensor:
        return F.layer_norm(x, (embed_dim,), norm_weight_2, norm_bias_2, eps)

    if norm_first:
        x = src + attention(norm1(src))
        return x + feed_forward(norm2(x))
    x = norm1(src + attention(src))
    return norm2(x + feed_forward(x))


def _roll(self: Tensor, shifts: list[int], dims: list[int] | None = None) -> Tensor:
    """torch.roll as two slices and a cat per rolled dim where the sizes and shifts are static:
    core ATen's decomposition gathers with the indices (arange(n) - shift) mod n, an integer
    gather (TOSA's PRO-INT: a float model's roll, Swin's cyclic shift, would not be TOSA-1.0+FP).
    Symbolic sizes keep core ATen's."""
    dims = list(dims or [])
    if not dims and len(shifts) == 1:  # the flattened tensor rolled
        return _roll(self.flatten(), shifts, [0]).view(self.shape)
    if len(shifts) != len(dims) or not all(isinstance(v, int) for v in [*shifts, *(self.shape[d] for d in dims)]):
        return _CORE[aten.roll.default](self, shifts, dims)
    out = self
    for shift, dim in zip(shifts, dims, strict=True):
        n = out.shape[dim]
        if n and shift % n:
            k = shift % n
            out = torch.cat([out.narrow(dim, n - k, k), out.narrow(dim, 0, n - k)], dim)
    return out if out is not self else self.clone()


def _taps_read(size: int, kernel: int, stride: int, pad: int, dilation: int, out: int) -> range | None:
    """The kernel taps along one dimension (of `out` outputs) whose windows read some of the
    input, not only its zero padding; None if there is no output along it."""
    read = [t for t in range(kernel) if -pad + t * dilation < size and (out - 1) * stride - pad + t * dilation >= 0]
    return range(read[0], read[-1] + 1) if out > 0 and read else None


def _convolution(input: Tensor, weight: Tensor, bias: Tensor | None, stride: list[int], padding: list[int],
                 dilation: list[int], transposed: bool, output_padding: list[int], groups: int) -> Any:
    """A convolution without the kernel taps that read only zero padding, where it has such taps:
    DeepLabV3's atrous convolutions (3x3, dilation 24 and 36, over 16x16 maps) are 1x1
    convolutions, where every tap's products of zeros were computed (10x the work). The input
    is padded (or cropped) so that the kept taps read what they read before. Otherwise the
    convolution itself (NotImplemented: AOTAutograd records the op)."""
    spatial = weight.dim() - 2
    params = [list(v) * spatial if len(v) == 1 else list(v) for v in (stride, padding, dilation)]
    values = [*input.shape[2:], *weight.shape[2:], *itertools.chain(*params)]
    if transposed or input.dim() != weight.dim() or not all(isinstance(v, int) for v in values):
        return NotImplemented
    # per spatial dim: input size, kernel size, stride, padding, dilation
    dims = [(input.shape[2 + i], weight.shape[2 + i], *(p[i] for p in params)) for i in range(spatial)]
    outs = [conv_out(*d) for d in dims]
    taps = [_taps_read(*d, out) for d, out in zip(dims, outs, strict=True)]
    if None in taps or all(len(t) == d[1] for t, d in zip(taps, dims, strict=True)):
        return NotImplemented
    pads: list[int] = []  # constant_pad_nd's [before, after] per dim, last dim first
    for i, ((size, _, st, pd, dl), out, t) in enumerate(zip(dims, outs, taps, strict=True)):
        before = pd - t.start * dl  # the first kept tap's first row, from the input's first
        after = (out - 1) * st + dl * (len(t) - 1) + 1 - before - size
        pads = [before, after, *pads]
        weight = weight.narrow(2 + i, t.start, len(t))
    if all(b == a >= 0 for b, a in zip(pads[::2], pads[1::2], strict=True)):
        return aten.convolution.default(input, weight, bias, params[0], pads[::2][::-1], params[2], False,
                                        output_padding, groups)
    return aten.convolution.default(aten.constant_pad_nd.default(input, pads), weight, bias, params[0],
                                    [0] * spatial, params[2], False, output_padding, groups)


_CORE = core_aten_decompositions()
_KEPT = (aten._safe_softmax.default,)  # ops with an entry that does better than the decomposition
DECOMPOSITIONS = {
    **{op: fn for op, fn in _CORE.items() if op not in _KEPT},
    aten._scaled_dot_product_flash_attention_for_cpu.default: _flash_cpu,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _flash_cpu_backward,
    aten.convolution.default: _convolution,
    aten.convolution_backward.default: _convolution_backward,
    aten.max_pool2d_with_indices_backward.default: _max_pool2d_backward,
    aten._transformer_encoder_layer_fwd.default: _encoder_layer_fwd,
    aten.upsample_nearest2d.default: keep_nearest,  # one tosa.resize where it reproduces torch
    aten.roll.default: _roll,
}
