"""Builtins of the rule language, as called by generated code (`R.<name>`).

Every function here is pure and works on plain Python values: ints, lists,
torch dtypes, and tensor descriptions exposing `.shape`, `.rank` and `.dtype`.
The generator's `generator/rules.py` lists the same names with their arities.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
i8, i16, i32, i64, u8, bool_ = torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool
inf = math.inf

len, range, min, max, abs, sum, all, any = (
    builtins.len, builtins.range, builtins.min, builtins.max, builtins.abs, builtins.sum, builtins.all, builtins.any)
int, float, list, sorted, enumerate, zip, reversed = (
    builtins.int, builtins.float, builtins.list, builtins.sorted, builtins.enumerate, builtins.zip, builtins.reversed)


def prod(xs: Iterable[int]) -> int:
    """Product of a list of ints (1 for an empty list)."""
    return math.prod(xs)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def wrap(dim: int, rank: int) -> int:
    """A possibly negative dim as an index in range(rank); rank 0 takes dims -1 and 0."""
    n = builtins.max(rank, 1)
    return dim + n if dim < 0 else dim


def wrap_all(dims: Sequence[int], rank: int) -> list[int]:
    return [wrap(d, rank) for d in dims]


def dims_or_all(dims: Sequence[int] | None, rank: int) -> list[int]:
    """Reduction dims, wrapped and sorted; None or [] means every dim."""
    if not dims:
        return builtins.list(builtins.range(rank))
    return builtins.sorted(wrap(d, rank) for d in dims)


def is_perm(perm: Sequence[int]) -> bool:
    return builtins.sorted(perm) == builtins.list(builtins.range(builtins.len(perm)))


def inverse_perm(perm: Sequence[int]) -> list[int]:
    inv = [0] * builtins.len(perm)
    for i, p in builtins.enumerate(perm):
        inv[p] = i
    return inv


def move_to_end(rank: int, dim: int) -> list[int]:
    """The permutation that moves `dim` to the last position."""
    return [d for d in builtins.range(rank) if d != dim] + [dim]


def broadcastable(a: Sequence[int], b: Sequence[int]) -> bool:
    return builtins.all(x == y or x == 1 or y == 1 for x, y in builtins.zip(a[::-1], b[::-1]))


def broadcast(a: Sequence[int], b: Sequence[int], c: Sequence[int] | None = None) -> list[int]:
    """The broadcast shape of two or three shapes (numpy rules)."""
    if c is not None:
        return broadcast(broadcast(a, b), c)
    n = builtins.max(builtins.len(a), builtins.len(b))
    a = [1] * (n - builtins.len(a)) + builtins.list(a)
    b = [1] * (n - builtins.len(b)) + builtins.list(b)
    return [y if x == 1 else x for x, y in builtins.zip(a, b)]


def reduced(shape: Sequence[int], dims: Sequence[int], keepdim: bool) -> list[int]:
    """The shape after reducing `dims` (already wrapped)."""
    if keepdim:
        return [1 if i in dims else s for i, s in builtins.enumerate(shape)]
    return [s for i, s in builtins.enumerate(shape) if i not in dims]


def squeeze_dims(shape: Sequence[int], dims: Sequence[int]) -> list[int]:
    return [s for i, s in builtins.enumerate(shape) if not (i in dims and s == 1)]


def _as_operand(x: Any) -> Any:
    """A tensor description as a meta tensor torch.result_type understands; a wrapped
    Python number (see Builder.wrap_number) as a number of its kind."""
    if getattr(x, "wrapped", False):
        return {torch.bool: True, torch.int64: 1}.get(x.dtype, 1.0)
    if hasattr(x, "dtype") and hasattr(x, "rank"):
        return torch.empty([1] * x.rank, dtype=x.dtype, device="meta")
    return x


def result_type(a: Any, b: Any) -> torch.dtype:
    """torch's type promotion of two operands: tensors (rank matters) or Python scalars."""
    return torch.result_type(_as_operand(a), _as_operand(b))


def is_float(dt: torch.dtype) -> bool:
    return dt.is_floating_point


def is_bool(dt: torch.dtype) -> bool:
    return dt == torch.bool


def is_int(dt: torch.dtype) -> bool:
    return not dt.is_floating_point and not dt.is_complex and dt != torch.bool


def is_signed(dt: torch.dtype) -> bool:
    return dt.is_signed


def to_float(dt: torch.dtype) -> torch.dtype:
    """The dtype int→float ops compute in: floats stay, everything else is the default float."""
    return dt if dt.is_floating_point else torch.get_default_dtype()


def is_integral_value(x: Any) -> bool:
    return isinstance(x, (builtins.bool, builtins.int)) or (isinstance(x, builtins.float) and x.is_integer())


def acc_type(dt: torch.dtype) -> torch.dtype:
    """The accumulator dtype TOSA uses for convolutions and matmuls of `dt`."""
    return torch.float32 if dt.is_floating_point else torch.int32 if dt in (i8, i16, u8) else torch.int64


def itemsize(dt: torch.dtype) -> int:
    return dt.itemsize


def dtype_min(dt: torch.dtype) -> float | int:
    return torch.finfo(dt).min if dt.is_floating_point else torch.iinfo(dt).min


def dtype_max(dt: torch.dtype) -> float | int:
    return torch.finfo(dt).max if dt.is_floating_point else torch.iinfo(dt).max


def infer_view(shape: Sequence[int], size: Sequence[int]) -> list[int]:
    """A view's target size with one -1 inferred, or [] if it cannot be inferred."""
    numel = prod(shape)
    known = prod(s for s in size if s != -1)
    holes = [i for i, s in builtins.enumerate(size) if s == -1]
    if builtins.len(holes) > 1 or builtins.any(s < -1 for s in size):
        return []
    out = builtins.list(size)
    if holes:
        if known == 0 or numel % known:
            return []
        out[holes[0]] = numel // known
    return out if prod(out) == numel else []


def normalize_slice(size: int, start: int | None, end: int | None, step: int) -> list[int]:
    """[start, length] of aten.slice on a dim of `size`, clamped as torch does."""
    start = 0 if start is None else start
    end = size if end is None else end
    start = builtins.min(builtins.max(start + size if start < 0 else start, 0), size)
    end = builtins.min(builtins.max(end + size if end < 0 else end, 0), size)
    length = builtins.max(0, ceil_div(end - start, step)) if end > start else 0
    return [start, length]


def pool_out(size: int, kernel: int, stride: int, pad: int, dilation: int, ceil_mode: bool = False) -> int:
    """Output size of a pooling window along one dim, as torch computes it."""
    eff = dilation * (kernel - 1) + 1
    num = size + 2 * pad - eff
    out = (ceil_div(num, stride) if ceil_mode else num // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + pad:
        out -= 1
    return out


def conv_out(size: int, kernel: int, stride: int, pad: int, dilation: int) -> int:
    return (size + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1


def split_sizes(size: int, split: int) -> list[int]:
    """Chunk sizes of aten.split.Tensor."""
    if split == 0:
        return [0]
    return [builtins.min(split, size - i) for i in builtins.range(0, size, split)] or [0]


def repeat_shape(shape: Sequence[int], repeats: Sequence[int]) -> list[int]:
    pad = [1] * (builtins.len(repeats) - builtins.len(shape)) + builtins.list(shape)
    return [s * r for s, r in builtins.zip(pad, repeats)]


def pairs(a: Sequence[Any], b: Sequence[Any]) -> list[list[Any]]:
    """[[a0, b0], [a1, b1], ...] as a list of lists."""
    return [[x, y] for x, y in builtins.zip(a, b)]


# ---- added by linear/conv

def hw(values: Sequence[int], one: int, spatial: int) -> list[int]:
    """The [h, w] pair of a 1-D or 2-D conv/pool parameter: a 1-value list is used for
    both dims, a 1-D op (spatial == 1) runs as 2-D over a [1, L] plane with `one` for h."""
    if not values:
        return [one, one]
    if spatial == 1:
        return [one, values[-1]]
    return [values[0], values[-1]]


def pool_windows(h: int, w: int, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int,
                 dh: int, dw: int, oh: int, ow: int) -> list[list[int]]:
    """The windows of a 2-D max pooling of an [h, w] plane, for a gather from the plane
    flattened with one padding slot appended (index h * w).

    Returns [taps, sources], each oh * ow * kh * kw long: per output (row-major) its
    taps, in-bounds ones first in row-major order and padding ones after, so that an
    argmax (first maximum) picks what torch's scan picks (strictly greater replaces;
    an all -inf window reports its first in-bounds element). `sources` is each tap's
    flat input index; padding taps get torch's window start."""
    taps: list[int] = []
    sources: list[int] = []
    for i in builtins.range(oh):
        for j in builtins.range(ow):
            hs, ws = i * sh - ph, j * sw - pw
            while hs < 0:
                hs += dh
            while ws < 0:
                ws += dw
            start = hs * w + ws
            inside, outside = [], []
            for a in builtins.range(kh):
                for c in builtins.range(kw):
                    y, x = i * sh - ph + a * dh, j * sw - pw + c * dw
                    if 0 <= y < h and 0 <= x < w:
                        inside.append(y * w + x)
                    else:
                        outside.append(start)
            taps += inside + [h * w] * builtins.len(outside)
            sources += inside + outside
    return [taps, sources]


def adaptive_windows(h: int, w: int, oh: int, ow: int) -> list[Any]:
    """The windows of a 2-D adaptive pooling of an [h, w] plane (rows floor(i*h/oh) to
    ceil((i+1)*h/oh), as torch), for a gather from the plane flattened with one padding
    slot appended (index h * w). Returns [taps, sources, counts, k]: each output's taps
    in row-major order padded with the slot to the largest window size k; sources are
    the flat input indices (a padding tap repeats the window's first); counts are the
    window sizes."""
    def bounds(i: int, size: int, out: int) -> tuple[int, int]:
        return (i * size) // out, -(-((i + 1) * size) // out)

    k = 0
    windows = []
    for i in builtins.range(oh):
        y0, y1 = bounds(i, h, oh)
        for j in builtins.range(ow):
            x0, x1 = bounds(j, w, ow)
            cells = [y * w + x for y in builtins.range(y0, y1) for x in builtins.range(x0, x1)]
            windows.append(cells)
            k = builtins.max(k, builtins.len(cells))
    taps: list[int] = []
    sources: list[int] = []
    for cells in windows:
        taps += cells + [h * w] * (k - builtins.len(cells))
        sources += cells + [cells[0]] * (k - builtins.len(cells))
    return [taps, sources, [builtins.len(c) for c in windows], k]
