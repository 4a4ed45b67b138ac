"""Symbolic sizes: the SymInt dims of a graph's FakeTensors as the lowering and the native code see them.

A dim is an `int` or a `torch.SymInt` of the graph's ShapeEnv. Rules compute on SymInts as on
ints, so arithmetic stays symbolic and a comparison that needs a concrete answer adds a guard to
the ShapeEnv (Dynamo checks those guards before it calls the compiled graph). MLIR sees a
symbolic dim as `?`; where an op needs its value (a dynamic reshape or slice), `Symbols.index`
emits it from `tensor.dim` of the function argument the symbol is a size of. At run time
`evaluator`s of the same expressions compute output sizes from the inputs' sizes (execute.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch
from mlir import ir
from mlir.dialects import arith, tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq
from torch.utils._sympy.functions import (
    CeilDiv,
    FloatTrueDiv,
    FloorDiv,
    IntTrueDiv,
    Max,
    Min,
    Mod,
    PythonMod,
    ToFloat,
)

from ..errors import Unsupported

Dim = int | torch.SymInt
Size = int | sympy.Expr  # a dim of a TensorSpec: an int or an expression in the graph's symbols


def expr(d: Dim | sympy.Expr) -> sympy.Expr:
    """A dim as a sympy expression, with the ShapeEnv's replacements applied."""
    if isinstance(d, sympy.Expr):
        return d
    if isinstance(d, torch.SymInt):
        node = d.node
        return node.shape_env.simplify(node.expr) if node.shape_env is not None else node.expr
    return sympy.Integer(int(d))


def static(d: Dim | sympy.Expr) -> int | None:
    """A dim's value if it is known without a guard, else None."""
    if isinstance(d, int):
        return d
    e = expr(d) if isinstance(d, torch.SymInt) else d
    return int(e) if isinstance(e, sympy.Integer) else None


def is_static(shape: Sequence[Dim]) -> bool:
    return all(static(d) is not None for d in shape)


def size(d: Dim) -> Size:
    """A dim as a TensorSpec holds it: an int, or an expression of symbols."""
    v = static(d)
    return v if v is not None else expr(d)


def mlir_dims(shape: Sequence[Dim]) -> list[int]:
    """A shape as MLIR types take it: `?` (the dynamic size) for a symbolic dim."""
    dynamic = ir.ShapedType.get_dynamic_size()
    return [dynamic if (v := static(d)) is None else v for d in shape]


def same(a: Dim, b: Dim, guard: bool = False) -> bool:
    """Whether two dims are provably equal, without adding a guard; or, if `guard`, equal for
    the sizes at hand, with a guard that they stay so (`api.Guarded` checks it per call)."""
    sa, sb = static(a), static(b)
    if sa is not None and sb is not None:
        return sa == sb
    ea, eb = expr(a), expr(b)
    if ea == eb or sympy.expand(ea - eb) == 0:
        return True
    # the ShapeEnv's ranges and what its guards established (s0*s1 == 6 after a view's check)
    if statically_known_true(a == b):
        return True
    return guard and bool(sym_eq(a, b))


Groups = list[tuple[list[int], list[int]]]  # (source dims, target dims) of a reshape, in order


def reassociation(source: Sequence[Dim | sympy.Expr], target: Sequence[Dim | sympy.Expr]) -> Groups | None:
    """A reshape of `source` sizes to `target` sizes as consecutive groups of dims, (source dims,
    target dims) of provably equal products, in order: what tensor.collapse_shape and
    expand_shape take; None if the reshape is not one (the sizes, symbolic, don't tell).
    A group grows on the side whose product divides the other's (as polynomials with integer
    coefficients); unit dims left at either end join the last group."""
    src, dst = [expr(d) for d in source], [expr(d) for d in target]

    def divides(a: sympy.Expr, b: sympy.Expr) -> bool:
        return sympy.fraction(sympy.cancel(b / a))[1] == 1

    groups: Groups = []
    i = j = 0
    while i < len(src) and j < len(dst):
        grown = ([i], [j])
        ps, pt = src[i], dst[j]
        i, j = i + 1, j + 1
        while sympy.expand(ps - pt) != 0:
            if i < len(src) and divides(ps, pt):
                ps, i = ps * src[i], i + 1
                grown[0].append(i - 1)
            elif j < len(dst) and divides(pt, ps):
                pt, j = pt * dst[j], j + 1
                grown[1].append(j - 1)
            else:
                return None
        groups.append(grown)
    if not groups or any(d != 1 for d in src[i:] + dst[j:]):
        return None
    groups[-1][0].extend(range(i, len(src)))
    groups[-1][1].extend(range(j, len(dst)))
    return groups


def same_shape(a: Sequence[Dim], b: Sequence[Dim], guard: bool = False) -> bool:
    return len(a) == len(b) and all(same(x, y, guard) for x, y in zip(a, b, strict=True))


def shape_env_of(values: Iterable[Any]) -> Any:
    """The ShapeEnv of the first symbolic size among graph values (tensors or sizes), or None."""
    for val in values:
        for d in (val.shape if isinstance(val, torch.Tensor) else [val]):
            if isinstance(d, torch.SymInt):
                return d.node.shape_env
    return None


def show(shape: Sequence[Dim]) -> str:
    return "[" + ", ".join(str(static(d) if static(d) is not None else expr(d)) for d in shape) + "]"


def symbolic_part(value: Any) -> str | None:
    """What is symbolic in an argument: a tensor's shape or a symbolic number, else None."""
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return str(value)
    shape = getattr(value, "shape", None)
    if shape is not None and not is_static(shape):
        return f"of shape {show(shape)}"
    if isinstance(value, list | tuple):
        return next((f"[..., {p}, ...]" for v in value if (p := symbolic_part(v)) is not None), None)
    return None


def require_static(op: str, where: str, checks: Sequence[tuple[str, Any, str]]) -> None:
    """An entry's `static` key: Unsupported (the op then runs eagerly) if an argument it names,
    given as (name, value, reason), has a symbolic size; checked before any rule runs, so that
    no rule compares (and so specializes) that size."""
    for name, value, reason in checks:
        part = symbolic_part(value)
        if part is not None:
            raise Unsupported(f"{op} needs static sizes ({where}): {reason}; {name} is {part}")


# --- sizes in the IR --------------------------------------------------------------------------


_ARITH: dict[type, Callable[[ir.Value, ir.Value], ir.Value]] = {
    sympy.Add: lambda a, b: arith.addi(a, b),
    sympy.Mul: lambda a, b: arith.muli(a, b),
    Max: lambda a, b: arith.maxsi(a, b),
    Min: lambda a, b: arith.minsi(a, b),
}


class Symbols:
    """Where each symbol of a function's input shapes lives: (argument value, dim)."""

    def __init__(self) -> None:
        self.sources: dict[sympy.Symbol, tuple[ir.Value, int | None]] = {}  # dim None: a scalar argument

    def bind(self, value: ir.Value, shape: Sequence[Dim]) -> None:
        for i, d in enumerate(shape):
            e = expr(d)
            if isinstance(e, sympy.Symbol):
                self.sources.setdefault(e, (value, i))

    def bind_scalar(self, value: ir.Value, symbol: sympy.Symbol) -> None:
        """A symbol passed as a rank-0 i64 tensor argument (a size torch.compile passes as an int)."""
        self.sources.setdefault(symbol, (value, None))

    def index(self, d: Dim | sympy.Expr) -> ir.Value:
        """An `index` value holding the dim at run time."""
        return self._emit(d if isinstance(d, sympy.Expr) else expr(d))

    def _emit(self, e: sympy.Expr) -> ir.Value:
        index = ir.IndexType.get()
        if isinstance(e, sympy.Integer):
            return arith.constant(index, int(e))
        if isinstance(e, sympy.Symbol):
            if e not in self.sources:
                raise Unsupported(f"size {e} is not a dim of any tensor input, so native code can't read it")
            value, dim = self.sources[e]
            if dim is None:
                return arith.index_cast(index, tensor.extract(value, []))
            return tensor.dim(value, arith.constant(index, dim))
        if type(e) in _ARITH:
            args = [self._emit(a) for a in e.args]
            out = args[0]
            for a in args[1:]:
                out = _ARITH[type(e)](out, a)
            return out
        if isinstance(e, sympy.Pow) and isinstance(e.args[1], sympy.Integer) and int(e.args[1]) > 0:
            base = self._emit(e.args[0])
            out = base
            for _ in range(int(e.args[1]) - 1):
                out = arith.muli(out, base)
            return out
        if isinstance(e, CeilDiv):  # -((-a) // b)
            a, b = self._emit(e.args[0]), self._emit(e.args[1])
            return arith.ceildivsi(a, b)
        if isinstance(e, FloorDiv):
            return arith.floordivsi(self._emit(e.args[0]), self._emit(e.args[1]))
        if isinstance(e, Mod | PythonMod):  # sizes are not negative: remainder and modulo agree
            return arith.remsi(self._emit(e.args[0]), self._emit(e.args[1]))
        raise Unsupported(f"the size expression {e} has no lowering")

    def scalar(self, value: torch.SymInt | torch.SymFloat, element: ir.Type) -> ir.Value:
        """A number computed from sizes (a count, 1 / count) as a scalar of `element` at run time:
        integers in i64, floats in f64 (as Python computes them), then converted once."""
        f64, i64 = ir.F64Type.get(), ir.IntegerType.get_signless(64)
        e = value.node.expr
        if value.node.shape_env is not None:
            e = value.node.shape_env.simplify(e)
        if isinstance(value, torch.SymInt):
            out = arith.index_cast(i64, self._emit(e))
            if isinstance(element, ir.IntegerType):
                width = element.width
                return out if width == 64 else arith.trunci(element, out)
            out = arith.sitofp(f64, out)
        else:
            out = self._float(e)
        if isinstance(element, ir.IntegerType):
            raise Unsupported(f"the float {e} as an integer constant has no lowering")
        return out if element == f64 else arith.truncf(element, out)

    def _float(self, e: sympy.Expr) -> ir.Value:
        f64, i64 = ir.F64Type.get(), ir.IntegerType.get_signless(64)
        if e.is_number:
            return arith.constant(f64, float(e))
        if isinstance(e, ToFloat) or e.is_integer:
            inner = e.args[0] if isinstance(e, ToFloat) else e
            return arith.sitofp(f64, arith.index_cast(i64, self._emit(inner)))
        if isinstance(e, FloatTrueDiv | IntTrueDiv):
            return arith.divf(self._float(e.args[0]), self._float(e.args[1]))
        if isinstance(e, sympy.Add | sympy.Mul):
            combine = arith.addf if isinstance(e, sympy.Add) else arith.mulf
            parts = [self._float(a) for a in e.args]
            out = parts[0]
            for a in parts[1:]:
                out = combine(out, a)
            return out
        raise Unsupported(f"the size expression {e} has no lowering as a float")


_CURRENT: contextvars.ContextVar[Symbols | None] = contextvars.ContextVar("torchtosa_symbols", default=None)


@contextlib.contextmanager
def binding(symbols: Symbols) -> Iterator[Symbols]:
    """Make `symbols` the one `current()` returns while a function body is emitted."""
    token = _CURRENT.set(symbols)
    try:
        yield symbols
    finally:
        _CURRENT.reset(token)


def current() -> Symbols:
    symbols = _CURRENT.get()
    if symbols is None:
        raise Unsupported("a symbolic size outside of a function being imported")
    return symbols


# --- sizes at run time ------------------------------------------------------------------------


_EVAL: dict[type, Callable[[int, int], int]] = {
    sympy.Add: operator.add, sympy.Mul: operator.mul, Max: max, Min: min,
    CeilDiv: lambda a, b: -(-a // b), FloorDiv: operator.floordiv, Mod: operator.mod, PythonMod: operator.mod,
    sympy.Eq: operator.eq, sympy.Ne: operator.ne, sympy.Lt: operator.lt, sympy.Le: operator.le,
    sympy.Gt: operator.gt, sympy.Ge: operator.ge, sympy.And: operator.and_, sympy.Or: operator.or_,
}


def evaluator(e: Size) -> Callable[[dict[sympy.Symbol, int]], int]:
    """A function of the symbols' values computing `e`, built once (no sympy per call)."""
    if isinstance(e, int):
        return lambda _values, e=e: e
    if isinstance(e, sympy.Integer):
        return lambda _values, v=int(e): v
    if isinstance(e, sympy.Symbol):
        return operator.itemgetter(e)
    if e is sympy.true or e is sympy.false:
        return lambda _values, v=bool(e): v
    if isinstance(e, sympy.Not):
        inner = evaluator(e.args[0])
        return lambda values: not inner(values)
    if isinstance(e, sympy.Pow) and isinstance(e.args[1], sympy.Integer) and int(e.args[1]) > 0:
        base, power = evaluator(e.args[0]), int(e.args[1])
        return lambda values: base(values) ** power
    fn = next((f for cls, f in _EVAL.items() if isinstance(e, cls)), None)
    if fn is not None:
        parts = [evaluator(a) for a in e.args]

        def apply(values: dict[sympy.Symbol, int]) -> int:
            out = parts[0](values)
            for p in parts[1:]:
                out = fn(out, p(values))
            return out

        return apply
    raise Unsupported(f"the size expression {e} can't be computed at run time")


@dataclass(frozen=True)
class Bound:
    """Where a symbol's value comes from at run time: input `arg`, dim `dim`."""

    arg: int
    dim: int | None  # None: the input is a rank-0 tensor holding the value


def symbol_sources(shapes: Sequence[Sequence[Size]],
                   scalars: dict[int, sympy.Symbol] | None = None) -> dict[sympy.Symbol, Bound]:
    """The first input dim that is exactly each symbol; `scalars`: inputs that are a symbol's
    value (rank-0 tensors, `Bound.dim` None)."""
    sources: dict[sympy.Symbol, Bound] = {}
    for i, shape in enumerate(shapes):
        for d, s in enumerate(shape):
            if isinstance(s, sympy.Symbol):
                sources.setdefault(s, Bound(i, d))
    for i, sym in (scalars or {}).items():
        sources.setdefault(sym, Bound(i, None))
    return sources


def free_symbols(shapes: Sequence[Sequence[Size]]) -> set[sympy.Symbol]:
    return {sym for shape in shapes for s in shape if isinstance(s, sympy.Expr) for sym in s.free_symbols}


def value_range(e: sympy.Symbol, shape_env: Any) -> tuple[int, int | None]:
    """The range of values a symbol's ShapeEnv allows: (low, high or None)."""
    if shape_env is None or e not in shape_env.var_to_range:
        return 0, None
    vr = shape_env.var_to_range[e]
    low = int(vr.lower) if isinstance(vr.lower, sympy.Integer) else 0
    high = int(vr.upper) if isinstance(vr.upper, sympy.Integer) else None
    return low, high
