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


# ---- added by elementwise/creation


def result_type_all(xs: Sequence[Any]) -> torch.dtype:
    """torch's type promotion of several operands (tensors or Python scalars); None entries are skipped."""
    from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes
    ops = [_as_operand(x) for x in xs if x is not None]
    return elementwise_dtypes(*ops, type_promotion_kind=ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT)[1]


def scalar_dtype(v: Any) -> torch.dtype:
    """The dtype torch infers for a Python scalar in a factory (full): bool, int64 or the default float."""
    if isinstance(v, builtins.bool):
        return torch.bool
    if isinstance(v, builtins.int):
        return torch.int64
    return torch.get_default_dtype()


def scalars_dtype(xs: Sequence[Any]) -> torch.dtype:
    """The dtype torch.arange infers from its scalars: int64 unless one of them is a float."""
    return torch.get_default_dtype() if builtins.any(isinstance(x, builtins.float) for x in xs) else torch.int64


def fits(v: Any, dt: torch.dtype) -> bool:
    """Whether torch converts the scalar `v` to `dt` without its overflow error (factories check this)."""
    if dt == torch.bool:
        return True
    if dt.is_floating_point:
        x = builtins.float(v)
        return not math.isfinite(x) or builtins.abs(x) <= torch.finfo(dt).max or dt == torch.float64
    if isinstance(v, builtins.float) and not math.isfinite(v):
        return False
    info = torch.iinfo(dt)
    return info.min <= builtins.int(v) <= info.max


def scalar_value(v: Any, dt: torch.dtype) -> Any:
    """A Python scalar converted to `dt` as C++ casts it: bool is v != 0, integers truncate toward
    zero and wrap around, floats stay floats (the constant rounds them)."""
    if dt == torch.bool:
        return builtins.bool(v != 0)
    if dt.is_floating_point:
        return builtins.float(v)
    bits = dt.itemsize * 8
    x = builtins.int(v) % (1 << bits)
    return x - (1 << bits) if dt.is_signed and x >= 1 << (bits - 1) else x


def is_finite_value(v: Any) -> bool:
    return math.isfinite(builtins.float(v))


def is_cpu(device: Any) -> bool:
    """A factory's or _to_copy's device argument: None or a CPU device."""
    return device is None or torch.device(device).type == "cpu"


def is_strided(layout: Any) -> bool:
    return layout is None or layout == torch.strided


def arange_acc(v: Any, dt: torch.dtype) -> Any:
    """An arange scalar in torch's CPU accumulation type: int64 (truncated) for integers, else a float."""
    return builtins.float(v) if dt.is_floating_point else builtins.int(v)


def arange_len(start: Any, end: Any, step: Any, dt: torch.dtype) -> int:
    """torch.arange's length: ceil((end - start) / step) in double, or in int64 (on the truncated
    scalars) for an int64 result."""
    if dt == torch.int64:
        s, e, st = builtins.int(start), builtins.int(end), builtins.int(step)
        sgn = (st > 0) - (st < 0)
        num = e - s + st - sgn
        q = builtins.abs(num) // builtins.abs(st)
        return q if (num >= 0) == (st > 0) else -q
    return math.ceil((builtins.float(end) - builtins.float(start)) / builtins.float(step))


def arange_values(start: Any, end: Any, step: Any, dt: torch.dtype) -> list[Any]:
    """start + i * step for each index, in the accumulation type (double for floats, int64 for ints)."""
    s, st = arange_acc(start, dt), arange_acc(step, dt)
    return [scalar_value(s + st * i, dt) if not dt.is_floating_point else s + st * i
            for i in builtins.range(arange_len(start, end, step, dt))]


def is_bool_scalar(v: Any) -> bool:
    """A Python bool (torch's Scalar.isBoolean())."""
    return isinstance(v, builtins.bool)


def is_float_scalar(v: Any) -> bool:
    """A Python float (torch's Scalar.isFloatingPoint())."""
    return isinstance(v, builtins.float)
