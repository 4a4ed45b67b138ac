"""Builtins of the rule language, as called by generated code (`R.<name>`).

Every function here is pure and works on plain Python values: ints, lists,
torch dtypes, and tensor descriptions exposing `.shape`, `.rank` and `.dtype`.
The generator's `generator/rules.py` lists the same names with their arities.
"""

from __future__ import annotations

import builtins
import functools
import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..errors import InvalidInput
from . import target
from .tosa import INT48 as i48
from .tosa import Range

f16, bf16, f32, f64 = torch.float16, torch.bfloat16, torch.float32, torch.float64
i8, i16, i32, i64, u8, bool_ = torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool
inf = math.inf

len, range, abs, sum, all, any = (
    builtins.len, builtins.range, builtins.abs, builtins.sum, builtins.all, builtins.any)


float, list, sorted, enumerate, zip, reversed = (
    builtins.float, builtins.list, builtins.sorted, builtins.enumerate, builtins.zip, builtins.reversed)

# Sizes are ints or SymInts (symbolic sizes of the graph's ShapeEnv, see runtime/capture/symbolic.py).
# Arithmetic on a SymInt stays symbolic; a comparison whose answer is needed (`if`, `and`,
# sorted) guards, i.e. fixes what the compiled code assumes. The builtins below compute
# symbolically where they can: min/max as sym_min/sym_max, int() keeps a SymInt.


def _symbolic(xs: Sequence[Any]) -> bool:
    return builtins.any(isinstance(x, torch.SymInt) for x in xs)


def min(a: Any, b: Any = None) -> Any:
    """min(a, b) or min(list); a symbolic size's min stays symbolic (no guard)."""
    xs = builtins.list(a) if b is None else [a, b]
    return functools.reduce(torch.sym_min, xs) if _symbolic(xs) else builtins.min(xs)


def max(a: Any, b: Any = None) -> Any:
    """max(a, b) or max(list); a symbolic size's max stays symbolic (no guard)."""
    xs = builtins.list(a) if b is None else [a, b]
    return functools.reduce(torch.sym_max, xs) if _symbolic(xs) else builtins.max(xs)


def int(x: Any) -> Any:
    """int(x); a symbolic size stays symbolic (Python's int() would fix it to its value)."""
    return x if isinstance(x, torch.SymInt) else builtins.int(x)


def known(cond: Any) -> bool:
    """Whether a condition on sizes is true without a guard: False where it depends on a symbolic
    size (so a rule can take the branch that is right for every size)."""
    return statically_known_true(cond) if isinstance(cond, torch.SymBool) else builtins.bool(cond)


def prod(xs: Iterable[int]) -> int:
    """Product of a list of ints (1 for an empty list)."""
    return math.prod(xs)


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b); for a positive divisor as torch writes it, (a + b - 1) // b."""
    if _symbolic([a, b]) and known(b > 0):
        return (a + b - 1) // b
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
    """The broadcast shape of two or three shapes (numpy rules); InvalidInput if there is
    none, as torch raises (so no entry can forget to require `broadcastable`)."""
    if c is not None:
        return broadcast(broadcast(a, b), c)
    if not broadcastable(a, b):
        i, x, y = next((i, x, y) for i, (x, y) in enumerate(zip(a[::-1], b[::-1])) if x != y and 1 not in (x, y))
        raise InvalidInput(f"The size of tensor a ({x}) must match the size of tensor b ({y}) at non-singleton "
                           f"dimension {max(len(a), len(b)) - 1 - i} (shapes {list(a)} and {list(b)} do not broadcast)")
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
    return isinstance(x, (bool, builtins.int)) or (isinstance(x, float) and x.is_integer())


def acc_type(dt: torch.dtype) -> torch.dtype:
    """The accumulator dtype TOSA uses for convolutions and matmuls of `dt`."""
    return torch.float32 if dt.is_floating_point else torch.int32 if dt in (i8, i16, u8) else torch.int64


def product_acc_type(dt: torch.dtype) -> Any:
    """The accumulator of TOSA's convolutions and matmul of `dt`: i48 for int16 (EXT-INT16), else
    acc_type's (pooling sums int16 in i32)."""
    return i48 if dt == i16 else acc_type(dt)


def itemsize(dt: torch.dtype) -> int:
    return dt.itemsize


def dtype_min(dt: torch.dtype) -> float | int:
    """The lowest finite value of a dtype (False, 0, for bool)."""
    return 0 if dt == torch.bool else torch.finfo(dt).min if dt.is_floating_point else torch.iinfo(dt).min


def dtype_max(dt: torch.dtype) -> float | int:
    """The highest finite value of a dtype (True, 1, for bool)."""
    return 1 if dt == torch.bool else torch.finfo(dt).max if dt.is_floating_point else torch.iinfo(dt).max


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


# ---- added by shape


def promote_all(tensors: Sequence[Any]) -> torch.dtype:
    """torch's type promotion over a list of tensors (as torch.cat computes its dtype)."""
    out = tensors[0].dtype
    for t in tensors[1:]:
        out = torch.promote_types(out, t.dtype)
    return out


def broadcast_all(shapes: Sequence[Sequence[int]]) -> list[int] | None:
    """The broadcast shape of any number of shapes, or None if they do not broadcast."""
    out: list[int] = []
    for s in shapes:
        if not broadcastable(out, s):
            return None
        out = broadcast(out, s)
    return out


def expand_shape(shape: Sequence[int], size: Sequence[int]) -> list[int] | None:
    """aten.expand's result: -1 keeps a dim, new dims lead; None if torch rejects it."""
    lead = builtins.len(size) - builtins.len(shape)
    if lead < 0:
        return None
    out = []
    for i, s in builtins.enumerate(size):
        if i < lead:
            if s < 0:
                return None
            out.append(s)
            continue
        have = shape[i - lead]
        target = have if s == -1 else s
        if target != have and have != 1:
            return None
        out.append(target)
    return out


def strides(shape: Sequence[int]) -> list[int]:
    """Row-major (contiguous) element strides of a shape."""
    out, acc = [], 1
    for s in builtins.reversed(shape):
        out.append(acc)
        acc *= s
    return out[::-1]


def flat_offsets(shape: Sequence[int], index_shape: Sequence[int], dim: int) -> list[int]:
    """For each position p of index_shape (row-major), the flat offset into a contiguous
    tensor of `shape` of p with coordinate `dim` set to 0: what gather/scatter add to
    index * strides(shape)[dim] to address elements of the flattened tensor."""
    st = strides(shape)
    out = [0]
    for d, n in builtins.enumerate(index_shape):
        step = 0 if d == dim else st[d]
        out = [o + i * step for o in out for i in builtins.range(n)]
    return out


def window_indices(count: int, size: int, step: int, start: int = 0) -> list[int]:
    """[start + i * step + j for i < count, j < size]: unfold's and strided slices' positions."""
    return [start + i * step + j for i in builtins.range(count) for j in builtins.range(size)]


def slice_mask(size: int, start: int, step: int, length: int) -> list[int]:
    """1 at positions start, start + step, ... (length of them) of range(size), else 0."""
    hit = {start + i * step for i in builtins.range(length)}
    return [1 if p in hit else 0 for p in builtins.range(size)]
# ---- added by linear/conv

def hw(values: Sequence[int], one: int, spatial: int) -> list[int]:
    """The [h, w] pair of a 1-D or 2-D conv/pool parameter: a 1-value list is used for
    both dims, a 1-D op (spatial == 1) runs as 2-D over a [1, L] plane with `one` for h."""
    if not values:
        return [one, one]
    if spatial == 1:
        return [one, values[-1]]
    return [values[0], values[-1]]


def dhw(values: Sequence[int], one: int, spatial: int) -> list[int]:
    """The [d, h, w] triple of a conv/pool parameter of a `spatial`-D op (1 to 3): a
    1-value list is used for every spatial dim, and the dims a lower-D op lacks (d for
    2-D; d and h for 1-D, which runs as 2-D over a [1, L] plane) are `one`. Lists of
    another length (rejected by the entry's `requires`) give some triple, never an error."""
    spatial = builtins.max(1, builtins.min(spatial, 3))
    vals = builtins.list(values) or [one]
    if builtins.len(vals) == 1:
        vals = vals * spatial
    vals = (vals + [one] * spatial)[:spatial] if builtins.len(vals) < spatial else vals[-spatial:]
    return [one] * (3 - spatial) + vals


def _grid(counts: Sequence[int]) -> list[tuple[int, ...]]:
    """Every index tuple of an array of shape `counts`, in row-major order."""
    return [tuple(ix) for ix in itertools.product(*(builtins.range(n) for n in counts))]


def _flat(ix: Sequence[int], sizes: Sequence[int]) -> int:
    """The row-major flat index of `ix` in an array of shape `sizes`."""
    out = 0
    for i, n in builtins.zip(ix, sizes):
        out = out * n + i
    return out


def pool_windows_nd(sizes: Sequence[int], kernel: Sequence[int], stride: Sequence[int], pad: Sequence[int],
                    dilation: Sequence[int], outs: Sequence[int]) -> list[list[int]]:
    """The windows of a max or average pooling over the last len(sizes) dims, for a gather
    from the input flattened over those dims with one padding slot appended (index
    prod(sizes)).

    Returns [taps, sources], each prod(outs) * prod(kernel) long: per output (row-major)
    its taps, in-bounds ones first in row-major order and padding ones after, so that an
    argmax (first maximum) picks what torch's scan picks (strictly greater replaces; an
    all -inf window reports its first in-bounds element). `sources` is each tap's flat
    input index; padding taps get torch's window start (each dim's first in-bounds tap)."""
    slot = prod(sizes)
    taps: list[int] = []
    sources: list[int] = []
    for o in _grid(outs):
        first = [o[i] * stride[i] - pad[i] for i in builtins.range(builtins.len(sizes))]
        start = []
        for f, d in builtins.zip(first, dilation):
            while f < 0:
                f += d
            start.append(f)
        inside, outside = [], []
        for t in _grid(kernel):
            pos = [f + k * d for f, k, d in builtins.zip(first, t, dilation)]
            if builtins.all(0 <= p < n for p, n in builtins.zip(pos, sizes)):
                inside.append(_flat(pos, sizes))
            else:
                outside.append(_flat(start, sizes))
        taps += inside + [slot] * builtins.len(outside)
        sources += inside + outside
    return [taps, sources]


def pool_divisors_nd(sizes: Sequence[int], kernel: Sequence[int], stride: Sequence[int], pad: Sequence[int],
                     outs: Sequence[int], count_include_pad: bool, divisor_override: int | None) -> list[int]:
    """torch's divisor of each output (row-major) of an average pooling over the last
    len(sizes) dims: divisor_override if given; else the window's size clipped to the
    padded input (count_include_pad) or to the input itself, per dim, multiplied."""
    out = []
    for o in _grid(outs):
        full = valid = 1
        for i, n in builtins.enumerate(sizes):
            lo = o[i] * stride[i] - pad[i]
            hi = builtins.min(lo + kernel[i], n + pad[i])
            full *= hi - lo
            valid *= builtins.min(hi, n) - builtins.max(lo, 0)
        out.append(divisor_override if divisor_override is not None else full if count_include_pad else valid)
    return out


def adaptive_windows_nd(sizes: Sequence[int], outs: Sequence[int]) -> list[Any]:
    """The windows of an adaptive pooling over the last len(sizes) dims (along each dim,
    output i reads floor(i*n/o) to ceil((i+1)*n/o), as torch), for a gather from the input
    flattened over those dims with one padding slot appended (index prod(sizes)).
    Returns [taps, sources, counts, k]: each output's taps in row-major order padded with
    the slot to the largest window size k; sources are the flat input indices (a padding
    tap repeats the window's first); counts are the window sizes."""
    def bounds(i: int, n: int, o: int) -> range:
        return builtins.range((i * n) // o, -(-((i + 1) * n) // o))

    slot = prod(sizes)
    windows = []
    for o in _grid(outs):
        spans = [bounds(i, n, m) for i, n, m in builtins.zip(o, sizes, outs)]
        windows.append([_flat(p, sizes) for p in itertools.product(*spans)])
    k = builtins.max(builtins.len(c) for c in windows)
    taps: list[int] = []
    sources: list[int] = []
    for cells in windows:
        taps += cells + [slot] * (k - builtins.len(cells))
        sources += cells + [cells[0]] * (k - builtins.len(cells))
    return [taps, sources, [builtins.len(c) for c in windows], k]


def pool_windows(h: int, w: int, kh: int, kw: int, sh: int, sw: int, ph: int, pw: int,
                 dh: int, dw: int, oh: int, ow: int) -> list[list[int]]:
    """pool_windows_nd of a 2-D pooling of an [h, w] plane (padding slot h * w)."""
    return pool_windows_nd([h, w], [kh, kw], [sh, sw], [ph, pw], [dh, dw], [oh, ow])


def adaptive_windows(h: int, w: int, oh: int, ow: int) -> list[Any]:
    """adaptive_windows_nd of a 2-D adaptive pooling of an [h, w] plane (padding slot h * w)."""
    return adaptive_windows_nd([h, w], [oh, ow])
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
    if isinstance(v, builtins.float):  # compared in double, before truncation: 127.5 overflows i8
        return builtins.float(info.min) <= v <= builtins.float(info.max)
    # negative ints wrap into unsigned types down to -max (full(-1, dtype=uint8) is 255)
    return (info.min if dt.is_signed else -info.max) <= builtins.int(v) <= info.max


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
    """Whether a scalar is finite (a symbolic size is)."""
    return isinstance(v, torch.SymInt) or math.isfinite(builtins.float(v))


def is_symbolic(v: Any) -> bool:
    """Whether a scalar is a number computed from symbolic sizes (a SymInt)."""
    return isinstance(v, torch.SymInt)


def is_cpu(device: Any) -> bool:
    """A factory's or _to_copy's device argument: None or a CPU device."""
    return device is None or torch.device(device).type == "cpu"


def is_strided(layout: Any) -> bool:
    return layout is None or layout == torch.strided


def arange_acc(v: Any, dt: torch.dtype) -> Any:
    """An arange scalar in torch's CPU accumulation type: int64 (truncated) for integers, else a
    float; a symbolic size stays symbolic."""
    if isinstance(v, torch.SymInt):
        return v
    return builtins.float(v) if dt.is_floating_point else builtins.int(v)


def arange_len(start: Any, end: Any, step: Any, dt: torch.dtype) -> int:
    """torch.arange's length: ceil((end - start) / step) in double, or in int64 (on the truncated
    scalars) for an int64 result. With a symbolic bound (an integer result, a static step): the
    int64 form for the step's sign, whose numerator has that sign when the bounds agree with it
    (the entry requires that), so it needs no guard."""
    if _symbolic([start, end]):
        st = builtins.int(step)
        num = end - start + st - (1 if st > 0 else -1)
        return num // st if st > 0 else (-num) // (-st)
    if dt == torch.int64:
        s, e, st = builtins.int(start), builtins.int(end), builtins.int(step)
        sgn = (st > 0) - (st < 0)
        num = e - s + st - sgn
        q = builtins.abs(num) // builtins.abs(st)
        return q if (num >= 0) == (st > 0) else -q
    return math.ceil((builtins.float(end) - builtins.float(start)) / builtins.float(step))


# An arange of this many elements or more is computed by native code rather than embedded as a
# constant: a constant's every element passes through Python, MLIR and LLVM (2^20 int64 took 5 s
# to compile). TOSA has no iota: under a TOSA target the values stay a constant.
RUN_TIME_ARANGE = 1 << 13
_RUN_TIME_ARANGE_FLOATS = (torch.float32, torch.float64)  # rounded once from double, as LLVM's fptrunc does


def arange_values(start: Any, end: Any, step: Any, dt: torch.dtype) -> list[Any] | Range:
    """start + i * step for each index, in the accumulation type (double for floats, int64 for
    ints); for symbolic bounds (integers) or a long arange outside a TOSA target
    (`RUN_TIME_ARANGE`), a `Range` the program computes."""
    if _symbolic([start, end]):
        return Range(start, builtins.int(step))
    s, st = arange_acc(start, dt), arange_acc(step, dt)
    n = arange_len(start, end, step, dt)
    if (n >= RUN_TIME_ARANGE and target.active() is None
            and (not dt.is_floating_point or dt in _RUN_TIME_ARANGE_FLOATS)):
        return Range(s, st)
    return [scalar_value(s + st * i, dt) if not dt.is_floating_point else s + st * i for i in builtins.range(n)]


def is_bool_scalar(v: Any) -> bool:
    """A Python bool (torch's Scalar.isBoolean())."""
    return isinstance(v, builtins.bool)


def is_float_scalar(v: Any) -> bool:
    """A Python float (torch's Scalar.isFloatingPoint())."""
    return isinstance(v, builtins.float)


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
# ---- added by fallback/extra


def _ratio(x: float, limit: int = 1024) -> tuple[int, int] | None:
    """x as p / q with small integers, if the double nearest p / q is x itself."""
    from fractions import Fraction
    if not math.isfinite(x) or x <= 0:
        return None
    fr = Fraction(x).limit_denominator(limit)
    return (fr.numerator, fr.denominator) if fr.numerator > 0 and builtins.float(fr) == x else None


def _torch_nearest_index(y: int, in_size: int, out_size: int, scale: float | None) -> int:
    """torch's legacy nearest source index (ATen's nearest_idx), float32 arithmetic included."""
    if out_size == in_size:
        return y
    if out_size == 2 * in_size:
        return y >> 1
    if scale is not None and scale > 0:
        s = torch.tensor(1.0 / scale, dtype=torch.float64).float()
    else:
        s = torch.tensor(in_size, dtype=torch.float32) / out_size
    return builtins.min(builtins.int(torch.floor(torch.tensor(builtins.float(y), dtype=torch.float32) * s)),
                        in_size - 1)


def _tosa_nearest_index(y: int, in_size: int, n: int, d: int, offset: int) -> int:
    """The source row tosa.resize NEAREST_NEIGHBOR reads: (y * d + offset) / n rounded half up, clamped."""
    if in_size == 1:
        return 0
    val = y * d + offset
    iy = val // n
    iy += 1 if 2 * (val - iy * n) >= n else 0
    return builtins.min(builtins.max(iy, 0), in_size - 1)


def upsample_axis(in_size: int, out_size: int, scale: float | None, align_corners: bool,
                  nearest: bool) -> list[int]:
    """[scale_n, scale_d, offset, border] of tosa.resize along one axis reproducing torch's
    upsample_nearest / upsample_bilinear source coordinates, or [] if they cannot be.

    tosa.resize reads output row y at in_y = (y * scale_d + offset) / scale_n.
    - nearest (floor(y * in / out), or floor(y / scale) with a scale factor): the index
      TOSA rounds half up, so half a row is subtracted (offset -out over 2 * out). torch
      computes in float32 (its scale may round below in / out, which moves exact
      integers down a row): every index is checked against torch's float32 formula.
    - bilinear, half-pixel centres: (y + 0.5) * in / out - 0.5 (or / scale).
    - bilinear, align_corners: y * (in - 1) / (out - 1).
    A scale factor must be a ratio p / q of small integers (1.5, 2.0, 0.25, 1.7 ...)."""
    if in_size < 1 or out_size < 1:
        return []
    sc = _ratio(scale) if scale is not None and scale > 0 and not align_corners else None
    if scale is not None and scale > 0 and not align_corners and sc is None:
        return []
    if out_size == in_size:
        cands = [(1, 1, 0)]  # torch copies (it ignores the scale factor)
    elif nearest:
        # torch's float32 scale may round below in / out, turning exact integers k into k - 1:
        # the second offset of each pair reads just below them.
        cands = ([(2 * sc[0], 2 * sc[1], -sc[0]), (2 * sc[0], 2 * sc[1], -sc[0] - 1)] if sc else []) + [
            (2 * out_size, 2 * in_size, -out_size), (2 * out_size, 2 * in_size, -out_size - 1)]
    elif align_corners:
        cands = [(1, 1, 0)] if out_size == 1 else [(out_size - 1, in_size - 1, 0)]
    elif sc:
        cands = [(2 * sc[0], 2 * sc[1], sc[1] - sc[0])]
    else:
        cands = [(2 * out_size, 2 * in_size, in_size - out_size)]
    for n, d, offset in cands:
        g = math.gcd(n, d, offset)
        n, d, offset = n // g, d // g, offset // g
        # y * d + offset is i32; n and the remainder (< n) must convert to f32 exactly
        if d == 0 or n >= 2 ** 24 or (out_size - 1) * d + builtins.abs(offset) >= 2 ** 31:
            continue
        if nearest and builtins.any(
                _tosa_nearest_index(y, in_size, n, d, offset) != _torch_nearest_index(y, in_size, out_size, scale)
                for y in builtins.range(out_size)):
            continue
        return [n, d, offset, (out_size - 1) * d - (in_size - 1) * n + offset]
    return []
# ---- added by ops-a (as_strided)


def storage_layout(t: Any) -> list[Any] | None:
    """[strides, storage offset, storage size] (in elements) of how PyTorch stores the tensor
    `t` (runtime.tosa.Tensor.layout: known for graph values and test inputs), or None."""
    layout = getattr(t, "layout", None)
    return None if layout is None else [list(layout[0]), layout[1], layout[2]]


def dense_order(shape: Sequence[int], strides: Sequence[int]) -> list[int] | None:
    """The dims of a tensor of `shape` laid out with `strides` in storage order (outermost first,
    size-1 dims, whose stride does not matter, leading), if its elements fill a block of
    prod(shape) storage elements exactly once; None if the strides leave gaps or overlap."""
    ones = [d for d in range(len(shape)) if shape[d] == 1]
    rest = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -strides[d])
    expect = 1
    for d in reversed(rest):
        if strides[d] != expect:
            return None
        expect *= shape[d]
    return ones + rest


def strided_indices(size: Sequence[int], stride: Sequence[int], start: int) -> list[int]:
    """start + sum(i_d * stride_d) for every index i of `size`, in row-major order: the storage
    positions as_strided reads."""
    out = [start]
    for n, s in zip(size, stride):
        out = [o + i * s for o in out for i in range(n)]
    return out


# ---- added by linear (_trilinear)


def unsqueeze_shape(shape: Sequence[int], dims: Sequence[int], rank: int) -> list[int]:
    """`shape` unsqueezed at each of `dims` (already wrapped into range(rank)): size 1 at
    those positions, the sizes of `shape` in order elsewhere; [] if the counts do not make
    `rank` dims."""
    if builtins.len(shape) + builtins.len(builtins.set(dims)) != rank:
        return []
    sizes = iter(shape)
    return [1 if i in dims else next(sizes) for i in builtins.range(rank)]
# ---- added by sorting/scatter-reduce


def pad_to(shape: Sequence[int], target: Sequence[int]) -> list[int]:
    """tosa.pad's padding list that grows `shape` to `target` at the high end of every dim:
    [0, target[0] - shape[0], 0, target[1] - shape[1], ...]."""
    return [x for s, t in builtins.zip(shape, target) for x in (0, t - s)]
# ---- added by distances (pdist)


def triu_pairs(n: int) -> list[list[int]]:
    """[rows, cols] of the pairs (i, j) with i < j < n in row-major order (0,1), (0,2), ...,
    (1,2), ...: the strict upper triangle of an n x n matrix, in pdist's output order."""
    pairs = [(i, j) for i in builtins.range(n) for j in builtins.range(i + 1, n)]
    return [[i for i, _ in pairs], [j for _, j in pairs]]


def native() -> bool:
    """The lowering is for torchtosa's own pipeline, not for a TOSA target: index clamps that
    keep native code inside a tensor (TOSA makes an out-of-range gather or scatter index an
    error, as torch does, so a target's module has none)."""
    return target.active() is None
# ---- added by refpow (pow)


def rounded(v: Any, dt: torch.dtype) -> float:
    """The scalar `v` rounded to the float dtype `dt`, as a Python float: the value torch's pow
    kernel uses for a scalar exponent of an f16 or bf16 tensor."""
    return builtins.float(torch.tensor(builtins.float(v), dtype=torch.float64).to(dt).item())
# ---- added by int8b (integer DQ -> op -> Q groups)


def rescale_scale(scale: float, bits: int = 32) -> list[int] | None:
    """[multiplier, shift] of a TOSA RESCALE for the real `scale` > 0 with `bits`-bit multipliers
    (32: scale32; 16: an i48 input's), derived as MLIR's TOSA quantization utilities do: scale =
    f * 2^e (frexp, f in [0.5, 1)), multiplier = round(f * 2^(bits-1)) (half away from zero;
    2^(bits-1) becomes 2^(bits-2) with e + 1), shift = bits - 1 - e. None if the shift leaves
    [2, 62], the range RESCALE requires (or scale is not positive)."""
    if not (scale > 0 and math.isfinite(scale)):
        return None
    f, e = math.frexp(scale)
    one = 1 << (bits - 1)
    m = math.floor(f * one + 0.5)  # f * 2^(bits-1) is exact in a double: round half up
    if m == one:
        m, e = m // 2, e + 1
    shift = bits - 1 - e
    return [m, shift] if 2 <= shift <= 62 else None


def rescale_scale32(scale: float) -> list[int] | None:
    """rescale_scale with 32-bit multipliers (scale32)."""
    return rescale_scale(scale, 32)


def rescale_params(input_scale: float, weight_scales: Sequence[float], output_scale: float,
                   bits: int = 32) -> list[list[int]] | None:
    """[[multipliers], [shifts]] that rescale an accumulator at scale input_scale *
    weight_scales[c] to output_scale, per channel, with `bits`-bit multipliers (16 for an i48
    accumulator); None if one channel's shift is out of range."""
    pairs = [rescale_scale(input_scale * builtins.float(s) / output_scale, bits) for s in weight_scales]
    if any(p is None for p in pairs):
        return None
    return [[p[0] for p in pairs], [p[1] for p in pairs]]


def quantize_bias(bias: Sequence[float] | None, input_scale: float, weight_scales: Sequence[float]) -> list[int]:
    """The float bias as int32 at the accumulator's scale: round(b[c] / (input_scale *
    weight_scales[c])), half to even, in double; zeros if there is no bias."""
    if bias is None:
        return [0] * len(weight_scales)
    return [builtins.round(builtins.float(b) / (input_scale * builtins.float(s)))
            for b, s in builtins.zip(bias, weight_scales, strict=True)]


def fits_i32(values: Sequence[int]) -> bool:
    return fits_bits(values, 32)


def fits_bits(values: Sequence[int], bits: int) -> bool:
    """Whether every value fits a signed integer of `bits` bits (48: an int16 convolution's bias)."""
    return all(-(1 << (bits - 1)) <= v < (1 << (bits - 1)) for v in values)


# ---- quantized elementwise ops (opdefs/quantize_eltwise.yaml)

def rescale_bounded(scale: float, bound: Any) -> list[int] | None:
    """rescale_scale32(scale), or None if it has none or if an input of magnitude up to `bound`
    (the RESCALE's input less its zero point) could leave [-2^(shift-1), 2^(shift-1)), the
    range TOSA's apply_scale_32 requires of its value."""
    ms = rescale_scale32(builtins.float(scale))
    return ms if ms is not None and bound < (1 << (ms[1] - 1)) else None


def centred_bound(dt: torch.dtype) -> int:
    """The largest |q - zero_point| of an int8 value (255: any zero point in [-128, 127]) or an
    int16 one (2^15: TOSA's int16 activations have zero point 0): the bound rescale_bounded takes
    for a RESCALE of the raw values."""
    return 255 if dt == i8 else 1 << 15


# ---- quantized CNN groups (clamp bounds, pooling)


def quantize_scalar(v: float, scale: float, zero_point: int, quant_min: int, quant_max: int) -> int:
    """The f32 value `v` quantized as PT2E's quantize_per_tensor does it (times the f32 inverse
    scale, rounded half to even, plus the zero point, clamped): the integer bound of a clamp
    fused before a quantize (rounding is monotone, so clamp-then-quantize is
    quantize-then-clamp at these bounds)."""
    import torch.ao.quantization.fx._decomposed  # registers quantized_decomposed

    x = torch.tensor([builtins.float(v)], dtype=torch.float32)
    q = torch.ops.quantized_decomposed.quantize_per_tensor.default(x, scale, zero_point, quant_min, quant_max,
                                                                   torch.int32)  # any integer dtype: clamped
    return builtins.int(q.item())
# ---- added by qtab (quantized transformer ops: tables, activation matmul)


def unary_table(function: str, alpha: float, input_scale: float, input_zero_point: int, output_scale: float,
                output_zero_point: int, quant_min: int, quant_max: int) -> list[int] | None:
    """The 256 int8 entries of the tosa.table for qunary's group (runtime/quant/table.py): the
    group's own float computation of every int8 input -128..127; None for an unknown function or
    a NaN result."""
    from ..quant.table import unary_table as table

    return table(function, alpha, input_scale, input_zero_point, output_scale, output_zero_point, quant_min, quant_max)


SOFTMAX_EXP_BITS = 15  # exp(-j * scale) as an integer of 15 bits: at most 2^15 - 1


def softmax_exp_tables(input_scale: float) -> list[list[int]]:
    """The two int8 tosa.table contents of qsoftmax's exponentials: for the table input
    t = d + 127 (d = x - max(x) in [-255, 0], so TABLE's index is d + 255), E = round((2^15 - 1)
    * exp(d * input_scale)) in double, split into its high byte (E >> 8, in [0, 127]) and its low
    byte minus 128 (so E = 256 * hi + lo + 128)."""
    top = (1 << SOFTMAX_EXP_BITS) - 1
    exps = [builtins.round(top * math.exp((i - 255) * input_scale)) for i in builtins.range(256)]
    return [[e >> 8 for e in exps], [(e & 255) - 128 for e in exps]]


# Seeds of Newton's iterations in Q29 fixed point (qsoftmax's 1/S, qlayernorm's 1/sqrt(V)), as
# [a, b] of the line a - b x: for 1/x on [0.5, 1) 48/17 - 32/17 x (relative error <= 1/17; three
# steps y (2 - x y) reach Q29's precision); for 1/sqrt(x) on [0.5, 2) the least-squares line
# 1.41327606 - 0.38093762 x (relative error <= 13.6%; four steps y (3 - x y^2) / 2).
NEWTON_SEEDS = {"reciprocal": (48 / 17, 32 / 17), "rsqrt": (1.41327606, 0.38093762)}


def newton_seed(function: str) -> list[int]:
    """[a, b] in Q29 of the line a - b x that starts Newton's iteration for `function`
    (`NEWTON_SEEDS`)."""
    return [builtins.round(c * 2 ** 29) for c in NEWTON_SEEDS[function]]


def layernorm_shift(C: int, input_scale: float, eps: float) -> list[int] | None:
    """[k, e] of qlayernorm over C int8 values: each square of D = C * q - sum(q) (at most
    (255 C)^2, in i32 for C <= 181) is shifted right by 2k, rounding, so that the i32 sum of the
    C squares cannot overflow (C * ((255 C)^2 / 4^k + 1) + e < 2^31), and e = round(eps * C^3 /
    (input_scale^2 * 4^k)) is eps at that sum's scale. None if C > 181 or e reaches 2^30."""
    if 255 * C > 46340:
        return None
    for k in builtins.range(5):
        e = builtins.round(eps * C ** 3 / (input_scale * input_scale * 4 ** k))
        if e < (1 << 30) and C * ((255 * C) ** 2 // 4 ** k + 1) + e < (1 << 31):
            return [k, e]
    return None


def layernorm_rescale(C: int, weight: Sequence[float] | None, bias: Sequence[float] | None,
                      output_scale: float) -> list[list[int]] | None:
    """[multipliers, shifts, biases, signs] per channel of qlayernorm's RESCALE: its accumulator
    t * sign(w[c]) + bq[c] holds the normalized value in units of sqrt(C) * 2^-15 times |w[c]|, so
    the multiplier is sqrt(C) 2^-15 |w[c]| / output_scale and bq[c] = round(b[c] / (sqrt(C)
    2^-15 |w[c]|)). None if a weight is 0, a shift leaves [2, 62] or a bias leaves int32."""
    w = [1.0] * C if weight is None else [builtins.float(v) for v in weight]
    if any(v == 0 for v in w):
        return None
    unit = math.sqrt(C) * 2.0 ** -15
    ms = rescale_params(unit, [builtins.abs(v) for v in w], output_scale)
    bq = quantize_bias(bias, unit, [builtins.abs(v) for v in w])
    if ms is None or not fits_i32(bq):
        return None
    return [ms[0], ms[1], bq, [1 if v > 0 else -1 for v in w]]
