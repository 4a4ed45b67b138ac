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
    n = max(rank, 1)
    return dim + n if dim < 0 else dim


def wrap_all(dims: Sequence[int], rank: int) -> list[int]:
    return [wrap(d, rank) for d in dims]


def dims_or_all(dims: Sequence[int] | None, rank: int) -> list[int]:
    """Reduction dims, wrapped and sorted; None or [] means every dim."""
    if not dims:
        return list(range(rank))
    return sorted(wrap(d, rank) for d in dims)


def is_perm(perm: Sequence[int]) -> bool:
    return sorted(perm) == list(range(len(perm)))


def inverse_perm(perm: Sequence[int]) -> list[int]:
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def move_to_end(rank: int, dim: int) -> list[int]:
    """The permutation that moves `dim` to the last position."""
    return [d for d in range(rank) if d != dim] + [dim]


def broadcastable(a: Sequence[int], b: Sequence[int]) -> bool:
    return all(x == y or x == 1 or y == 1 for x, y in zip(a[::-1], b[::-1]))


def broadcast(a: Sequence[int], b: Sequence[int], c: Sequence[int] | None = None) -> list[int]:
    """The broadcast shape of two or three shapes (numpy rules)."""
    if c is not None:
        return broadcast(broadcast(a, b), c)
    n = max(len(a), len(b))
    a = [1] * (n - len(a)) + list(a)
    b = [1] * (n - len(b)) + list(b)
    return [y if x == 1 else x for x, y in zip(a, b)]


def reduced(shape: Sequence[int], dims: Sequence[int], keepdim: bool) -> list[int]:
    """The shape after reducing `dims` (already wrapped)."""
    if keepdim:
        return [1 if i in dims else s for i, s in enumerate(shape)]
    return [s for i, s in enumerate(shape) if i not in dims]


def squeeze_dims(shape: Sequence[int], dims: Sequence[int]) -> list[int]:
    return [s for i, s in enumerate(shape) if not (i in dims and s == 1)]


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
    return isinstance(x, (bool, int)) or (isinstance(x, float) and x.is_integer())


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
    holes = [i for i, s in enumerate(size) if s == -1]
    if len(holes) > 1 or any(s < -1 for s in size):
        return []
    out = list(size)
    if holes:
        if known == 0 or numel % known:
            return []
        out[holes[0]] = numel // known
    return out if prod(out) == numel else []


def normalize_slice(size: int, start: int | None, end: int | None, step: int) -> list[int]:
    """[start, length] of aten.slice on a dim of `size`, clamped as torch does."""
    start = 0 if start is None else start
    end = size if end is None else end
    start = min(max(start + size if start < 0 else start, 0), size)
    end = min(max(end + size if end < 0 else end, 0), size)
    length = max(0, ceil_div(end - start, step)) if end > start else 0
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
    return [min(split, size - i) for i in range(0, size, split)] or [0]


def repeat_shape(shape: Sequence[int], repeats: Sequence[int]) -> list[int]:
    pad = [1] * (len(repeats) - len(shape)) + list(shape)
    return [s * r for s, r in zip(pad, repeats)]


def pairs(a: Sequence[Any], b: Sequence[Any]) -> list[list[Any]]:
    """[[a0, b0], [a1, b1], ...] as a list of lists."""
    return [[x, y] for x, y in zip(a, b)]


# ---- added by the reduction/norm family


def dims_in_range(dims: Sequence[int] | None, rank: int) -> bool:
    """Every dim of `dims` (None is none) is a valid, possibly negative, index for `rank` (0 takes -1 and 0)."""
    n = max(rank, 1)
    return all(-n <= d < n for d in (dims or []))


def dims_unique(dims: Sequence[int] | None, rank: int) -> bool:
    """No dim of `dims` names the same axis twice once wrapped."""
    wrapped = wrap_all(dims or [], rank)
    return len(wrapped) == len(set(wrapped))


def _folded(rank: int, dims: Sequence[int]) -> tuple[list[int], list[int], bool]:
    """(kept dims, reduced dims, reduced dims are adjacent) for wrapped `dims`."""
    red = sorted(d for d in set(dims) if d < rank)
    kept = [d for d in range(rank) if d not in red]
    adjacent = not red or red == list(range(red[0], red[0] + len(red)))
    return kept, red, adjacent


def fold_perm(rank: int, dims: Sequence[int]) -> list[int]:
    """The transpose that makes the reduced `dims` (wrapped) adjacent so that one reduce
    covers them all: the identity when they already are, else kept dims then reduced ones."""
    kept, red, adjacent = _folded(rank, dims)
    return list(range(rank)) if adjacent else kept + red


def fold_axis(rank: int, dims: Sequence[int]) -> int:
    """The axis of fold_shape that holds the merged reduced dims."""
    kept, red, adjacent = _folded(rank, dims)
    if not red:
        return rank
    return red[0] if adjacent else len(kept)


def fold_shape(shape: Sequence[int], dims: Sequence[int]) -> list[int]:
    """`shape` after fold_perm with the reduced `dims` merged into the one axis fold_axis
    (of size 1 when no dim is reduced, e.g. rank 0)."""
    rank = len(shape)
    kept, red, adjacent = _folded(rank, dims)
    size = prod(shape[d] for d in red)
    if not red:
        return [*shape, 1]
    if adjacent:
        return [*shape[:red[0]], size, *shape[red[-1] + 1:]]
    return [*(shape[d] for d in kept), size]


def tri_ones(n: int) -> list[float]:
    """The n x n upper-triangular matrix of ones (U[i][j] = 1 for i <= j), flat: x @ U is
    the running sum of the rows of x."""
    return [1.0 if i <= j else 0.0 for i in range(n) for j in range(n)]
