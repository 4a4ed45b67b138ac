"""Random small programs over the supported ops: compiled with torchtosa.compile, compared with eager.

A program is a list of nodes — inputs (`["input", dtype, shape]`) and ops
(`["op", expression, operands]`, the expression a Python expression over `{0}`,
`{1}`... naming the operands) — and the nodes it returns. `generate(seed)` builds
one from the op table `OPS`: each builder declares the aten overloads its torch call
becomes in a core-ATen graph (`needs`) and is used only if every one of them is in the
registry, so the table covers each op family the moment its entries land. Programs
are chains and DAGs (an op takes the newest value or any earlier one) with random
shapes (rank 0–4, sizes 1–5, broadcasting partners), dtypes and arguments; partners
such as matmul or conv weights are fresh inputs. Every step is checked eagerly while
generating, so a program is always valid PyTorch.

Exactness: discontinuous ops (floor/round/sign, comparisons, argmax, float→int casts,
remainder) amplify last-ulp differences into different answers, so they only take
values that are computed exactly on both sides (inputs, shape ops, neg/abs/max...),
tracked per value. Everything else is compared at the output dtype's tolerance.

Outcome of a program: pass, unsupported (a spec's `limits`, or an aten op with no
mapping: `needs` are what the float32 graph uses, other dtypes may decompose further,
e.g. bf16 silu adds _to_copy), or fail (any other error, or a numeric mismatch). A failure is
shrunk (fewer nodes and outputs while it still fails the same way) and printed as
Python source and as a JSON entry for `tests/fuzz/regressions.json`, where it stays
as a regression test (`expect`: "pass" once fixed, or "unsupported" once a `limits`
entry covers it).

`make test` runs FUZZ_PROGRAMS seeded programs; `make fuzz` sets TORCHTOSA_FUZZ_EXAMPLES
(and TORCHTOSA_FUZZ_SEED picks the first seed, default 0).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import torchtosa
from torchtosa import Unsupported
from torchtosa.importer.registry import registry

ROOT = Path(__file__).resolve().parent
REGRESSIONS = ROOT / "fuzz" / "regressions.json"
FUZZ_PROGRAMS = int(os.environ.get("TORCHTOSA_FUZZ_EXAMPLES", "0")) or 40
FIRST_SEED = int(os.environ.get("TORCHTOSA_FUZZ_SEED", "0"))
MAX_NUMEL = 2048

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
          "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "bool": torch.bool}
NAMES = {v: k for k, v in DTYPES.items()}
# Program dtypes, weighted: mostly f32
PROGRAM_DTYPES = ["f32"] * 8 + ["f16", "bf16", "f64", "i64", "i32", "i32", "i8", "bool"]
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float64: (1e-7, 1e-7), torch.float16: (1e-2, 1e-2),
             torch.bfloat16: (5e-2, 5e-2)}


# ---------------------------------------------------------------- programs


@dataclass
class Program:
    nodes: list[list[Any]]  # ["input", dtype, shape, data seed] | ["op", expression, operands, builder]
    outputs: list[int]

    def inputs(self) -> list[int]:
        return [i for i, n in enumerate(self.nodes) if n[0] == "input"]

    def source(self) -> str:
        args = ", ".join(f"v{i}" for i in self.inputs())
        lines = [f"def program({args}):"]
        for i, n in enumerate(self.nodes):
            if n[0] == "input":
                lines.append(f"    # v{i}: {n[1]}{list(n[2])}")
            else:
                lines.append(f"    v{i} = " + n[1].format(*(f"v{j}" for j in n[2])))
        lines.append("    return (" + "".join(f"v{i}, " for i in self.outputs) + ")")
        return "\n".join(lines)

    def function(self) -> Callable[..., Any]:
        scope: dict[str, Any] = {"torch": torch, "F": F}
        exec(compile(self.source(), f"<fuzz program {id(self)}>", "exec"), scope)
        return scope["program"]

    def to_json(self) -> dict[str, Any]:
        return {"nodes": self.nodes, "outputs": self.outputs}

    @staticmethod
    def from_json(d: dict[str, Any]) -> Program:
        return Program([list(n) for n in d["nodes"]], list(d["outputs"]))


def make_inputs(p: Program) -> list[torch.Tensor]:
    """Random data from each input's own seed: normal floats (scaled by 2), ints in [-10, 10], coin-flip bools."""
    return [make_input(p.nodes[i]) for i in p.inputs()]


def make_input(node: list[Any]) -> torch.Tensor:
    _, dt, shape, seed = node
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[dt]
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 2).to(dtype)
    return torch.randint(-10, 11, shape, generator=g).to(dtype)


# ---------------------------------------------------------------- the op table


@dataclass
class V:
    """What a builder knows of a value."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    exact: bool

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def is_int(self) -> bool:
        return not self.dtype.is_floating_point and self.dtype != torch.bool


class Ctx:
    """Generation state: the values so far, with the ability to add fresh inputs."""

    def __init__(self, rng: random.Random, nodes: list[list[Any]], values: list[V]):
        self.rng, self.nodes, self.values = rng, nodes, values

    def fresh(self, dtype: torch.dtype, shape: list[int] | tuple[int, ...]) -> int:
        self.nodes.append(["input", NAMES[dtype], list(shape), self.rng.randrange(2**31)])
        self.values.append(V(tuple(shape), dtype, True))
        return len(self.nodes) - 1

    def partner(self, a: int, shapes: list[tuple[int, ...]], dtype: torch.dtype | None = None) -> int:
        """An existing value of one of `shapes` (and `dtype`), or a fresh input."""
        dtype = dtype or self.values[a].dtype
        found = [i for i, v in enumerate(self.values) if i != a and v.shape in shapes and v.dtype == dtype]
        if found and self.rng.random() < 0.6:
            return self.rng.choice(found)
        return self.fresh(dtype, self.rng.choice(shapes))

    def dim(self, v: V) -> int:
        """A dim of v, negative half the time."""
        d = self.rng.randrange(v.rank)
        return d - v.rank if self.rng.random() < 0.5 else d

    def dims(self, v: V) -> list[int]:
        k = self.rng.randint(1, v.rank)
        return [d - v.rank if self.rng.random() < 0.5 else d for d in sorted(self.rng.sample(range(v.rank), k))]


Made = tuple[str, list[int]] | None  # (expression over {0}, {1}..., operands) or not applicable


@dataclass
class Op:
    name: str
    needs: tuple[str, ...]
    make: Callable[[Ctx, int], Made]
    keeps_exact: bool = False  # exact inputs give an exact result
    needs_exact: bool = False  # discontinuous: only on exact values
    weight: float = 1.0


OPS: list[Op] = []


def op(name: str, needs: str, **kw: Any) -> Callable[[Callable[[Ctx, int], Made]], Callable[[Ctx, int], Made]]:
    def register(fn: Callable[[Ctx, int], Made]) -> Callable[[Ctx, int], Made]:
        OPS.append(Op(name, tuple("aten." + n for n in needs.split()), fn, **kw))
        return fn
    return register


def unary(name: str, expr: str, needs: str, when: Callable[[V], bool] = lambda v: True, **kw: Any) -> None:
    op(name, needs, **kw)(lambda c, a: (expr, [a]) if when(c.values[a]) else None)


def broadcast_variant(c: Ctx, shape: tuple[int, ...]) -> tuple[int, ...]:
    """shape itself, a suffix of it, or it with some sizes 1: a broadcasting partner."""
    r = c.rng.random()
    if r < 0.5 or not shape:
        return shape
    if r < 0.75:
        return shape[c.rng.randint(0, len(shape)):]
    return tuple(1 if c.rng.random() < 0.4 else s for s in shape)


def binary(name: str, expr: str, needs: str, when: Callable[[V], bool] = lambda v: True,
           scalars: tuple[Any, ...] = (), **kw: Any) -> None:
    """expr over {0}, {1}; with `scalars`, {1} is sometimes a Python number."""
    def make(c: Ctx, a: int) -> Made:
        va = c.values[a]
        if not when(va):
            return None
        if scalars and c.rng.random() < 0.3:
            return expr.replace("{1}", repr(c.rng.choice(scalars))), [a]
        dt = va.dtype if c.rng.random() < 0.85 else DTYPES[c.rng.choice(PROGRAM_DTYPES)]
        b = c.partner(a, [broadcast_variant(c, va.shape)], dt)
        if not when(c.values[b]):
            return None
        return (expr, [b, a]) if c.rng.random() < 0.2 else (expr, [a, b])
    op(name, needs, **kw)(make)


def is_float(v: V) -> bool:
    return v.is_float


def not_bool(v: V) -> bool:
    return v.dtype != torch.bool


def int_or_bool(v: V) -> bool:
    return not v.is_float


# elementwise: arithmetic and comparisons
binary("add", "{0} + {1}", "add.Tensor", scalars=(2, -1.5, True))
binary("sub", "{0} - {1}", "sub.Tensor", not_bool, scalars=(3, 0.5))
binary("mul", "{0} * {1}", "mul.Tensor", scalars=(2, -0.5, False))
binary("div", "{0} / {1}", "div.Tensor", scalars=(2, -4.0, 0.25))
binary("div_trunc", "torch.div({0}, {1}, rounding_mode='trunc')", "div.Tensor_mode", is_float, needs_exact=True,
       keeps_exact=True)
binary("div_floor", "torch.div({0}, {1}, rounding_mode='floor')", "div.Tensor_mode", is_float, needs_exact=True,
       keeps_exact=True)
binary("maximum", "torch.maximum({0}, {1})", "maximum.default", keeps_exact=True)
binary("minimum", "torch.minimum({0}, {1})", "minimum.default", keeps_exact=True)
binary("pow", "torch.pow({0}, {1})", "pow.Tensor_Tensor", is_float)
binary("atan2", "torch.atan2({0}, {1})", "atan2.default", is_float)
binary("fmod", "torch.fmod({0}, {1})", "fmod.Tensor", is_float, needs_exact=True)
binary("remainder", "torch.remainder({0}, {1})", "remainder.Tensor", is_float, needs_exact=True)
for _cmp, _sym in (("eq", "=="), ("ne", "!="), ("lt", "<"), ("le", "<="), ("gt", ">"), ("ge", ">=")):
    binary(_cmp, "{0} " + _sym + " {1}", f"{_cmp}.Tensor", needs_exact=True, keeps_exact=True)
    unary(f"{_cmp}_scalar", "{0} " + _sym + " 0.5", f"{_cmp}.Scalar", needs_exact=True, keeps_exact=True)
for _lg in ("and", "or", "xor"):
    binary(f"logical_{_lg}", f"torch.logical_{_lg}({{0}}, {{1}})", f"logical_{_lg}.default", keeps_exact=True)
    binary(f"bitwise_{_lg}", f"torch.bitwise_{_lg}({{0}}, {{1}})", f"bitwise_{_lg}.Tensor", int_or_bool,
           keeps_exact=True)
unary("add_scalar_alpha", "torch.add({0}, 3, alpha=2)", "add.Tensor", not_bool)
unary("pow_scalar", "{0} ** 2", "pow.Tensor_Scalar", not_bool)
unary("pow_half", "{0}.abs() ** 0.5", "abs.default pow.Tensor_Scalar", is_float)


@op("where", "where.self", keeps_exact=True)
def _where(c: Ctx, a: int) -> Made:
    va = c.values[a]
    conds = [i for i, v in enumerate(c.values) if v.dtype == torch.bool and i != a and
             len(v.shape) <= len(va.shape) and v.shape == va.shape[len(va.shape) - len(v.shape):]]
    cond = c.rng.choice(conds) if conds else c.fresh(torch.bool, broadcast_variant(c, va.shape))
    b = c.partner(a, [broadcast_variant(c, va.shape)])
    return "torch.where({0}, {1}, {2})", [cond, a, b]


# elementwise: unary
unary("neg", "-{0}", "neg.default", not_bool, keeps_exact=True)
unary("abs", "{0}.abs()", "abs.default", not_bool, keeps_exact=True)
unary("relu", "torch.relu({0})", "relu.default", not_bool, keeps_exact=True)
unary("sign", "torch.sign({0})", "sign.default", not_bool, needs_exact=True, keeps_exact=True)
for _fn in ("exp", "log", "sqrt", "rsqrt", "reciprocal", "sin", "cos", "tanh", "sigmoid", "erf", "log1p",
            "expm1", "exp2", "log2", "log10"):
    unary(_fn, f"torch.{_fn}({{0}})", f"{_fn}.default", not_bool)
for _fn in ("floor", "ceil", "trunc", "round"):
    unary(_fn, f"torch.{_fn}({{0}})", f"{_fn}.default", is_float, needs_exact=True, keeps_exact=True)
unary("round_decimals", "torch.round({0}, decimals=1)", "round.decimals", is_float, needs_exact=True)
unary("gelu", "F.gelu({0})", "gelu.default", is_float)
unary("gelu_tanh", "F.gelu({0}, approximate='tanh')", "gelu.default", is_float)
unary("silu", "F.silu({0})", "sigmoid.default mul.Tensor", is_float)
unary("clamp", "torch.clamp({0}, -1, 2)", "clamp.default", not_bool, keeps_exact=True)
unary("clamp_min", "torch.clamp({0}, min=0.5)", "clamp.default", is_float, keeps_exact=True)
unary("hardtanh", "F.hardtanh({0})", "hardtanh.default", is_float, keeps_exact=True)
unary("leaky_relu", "F.leaky_relu({0}, 0.1)", "leaky_relu.default", is_float)
unary("elu", "F.elu({0})", "elu.default", is_float)
unary("isnan", "torch.isnan({0})", "isnan.default", keeps_exact=True)
unary("logical_not", "torch.logical_not({0})", "logical_not.default", keeps_exact=True)
unary("bitwise_not", "torch.bitwise_not({0})", "bitwise_not.default", int_or_bool, keeps_exact=True)


@op("cast", "_to_copy.default", keeps_exact=True)
def _cast(c: Ctx, a: int) -> Made:
    va = c.values[a]
    to = DTYPES[c.rng.choice([n for n in DTYPES if DTYPES[n] != va.dtype])]
    if va.is_float and not to.is_floating_point and not va.exact:
        return None  # float→int truncation of an inexact value
    return f"{{0}}.to(torch.{str(to).removeprefix('torch.')})", [a]


# reductions
@op("sum", "sum.dim_IntList")
def _sum(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if v.rank == 0 or c.rng.random() < 0.2:
        return "{0}.sum()", [a]
    return f"{{0}}.sum({c.dims(v)}, keepdim={c.rng.random() < 0.5})", [a]


@op("mean", "mean.dim")
def _mean(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if not v.is_float or v.rank == 0:
        return None
    return f"{{0}}.mean({c.dims(v)}, keepdim={c.rng.random() < 0.5})", [a]


unary("mean_all", "{0}.mean()", "mean.default", is_float)
for _fn in ("amax", "amin"):
    op(_fn, f"{_fn}.default", keeps_exact=True)(
        lambda c, a, fn=_fn: (f"{{0}}.{fn}({c.dims(c.values[a])}, keepdim={c.rng.random() < 0.5})", [a])
        if c.values[a].rank and not_bool(c.values[a]) else None)
for _fn in ("argmax", "argmin"):
    op(_fn, f"{_fn}.default", needs_exact=True, keeps_exact=True)(
        lambda c, a, fn=_fn: (f"{{0}}.{fn}({c.dim(c.values[a])}, keepdim={c.rng.random() < 0.5})", [a])
        if c.values[a].rank and not_bool(c.values[a]) else None)
    unary(f"{_fn}_all", f"{{0}}.{_fn}()", f"{_fn}.default", not_bool, needs_exact=True, keeps_exact=True)
for _fn in ("max", "min"):
    op(f"{_fn}_dim_values", f"{_fn}.dim", keeps_exact=True)(
        lambda c, a, fn=_fn: (f"torch.{fn}({{0}}, {c.dim(c.values[a])}, keepdim={c.rng.random() < 0.5}).values", [a])
        if c.values[a].rank and not_bool(c.values[a]) else None)
    op(f"{_fn}_dim_indices", f"{_fn}.dim", needs_exact=True, keeps_exact=True)(
        lambda c, a, fn=_fn: (f"torch.{fn}({{0}}, {c.dim(c.values[a])}).indices", [a])
        if c.values[a].rank and not_bool(c.values[a]) else None)
    unary(f"{_fn}_all", f"{{0}}.{_fn}()", f"{_fn}.default", not_bool, keeps_exact=True)
op("prod", "prod.dim_int")(lambda c, a: (f"{{0}}.prod({c.dim(c.values[a])})", [a]) if c.values[a].rank else None)
op("var", "var.correction")(
    lambda c, a: (f"{{0}}.var({c.dims(c.values[a])}, correction={c.rng.choice([0, 1])})", [a])
    if c.values[a].rank and c.values[a].is_float else None)
op("any", "any.dim", keeps_exact=True)(
    lambda c, a: (f"{{0}}.any({c.dim(c.values[a])})", [a]) if c.values[a].rank else None)
unary("any_all", "{0}.any()", "any.default", keeps_exact=True)


# shape ops
def _factor(rng: random.Random, shape: tuple[int, ...]) -> list[int]:
    """A random shape with the same number of elements (rank 0-4), one size written -1 sometimes."""
    n = math.prod(shape)
    primes = []
    m, p = n, 2
    while m > 1:
        while m % p == 0:
            primes.append(p)
            m //= p
        p += 1
    out = [1] * rng.randint(1, 4)
    for q in primes:
        out[rng.randrange(len(out))] *= q
    if n == 1 and rng.random() < 0.3:
        return []
    if rng.random() < 0.3:
        out[rng.randrange(len(out))] = -1
    return out


op("reshape", "view.default", keeps_exact=True)(
    lambda c, a: (f"{{0}}.reshape({_factor(c.rng, c.values[a].shape)})", [a]))
op("flatten", "view.default", keeps_exact=True)(lambda c, a: ("{0}.flatten()", [a]))
op("permute", "permute.default", keeps_exact=True)(
    lambda c, a: (f"{{0}}.permute({c.rng.sample(range(c.values[a].rank), c.values[a].rank)})", [a]))
op("transpose", "permute.default", keeps_exact=True)(
    lambda c, a: (f"{{0}}.transpose({c.dim(c.values[a])}, {c.dim(c.values[a])})", [a]) if c.values[a].rank else None)
op("unsqueeze", "unsqueeze.default", keeps_exact=True)(
    lambda c, a: (f"{{0}}.unsqueeze({c.rng.randint(-c.values[a].rank - 1, c.values[a].rank)})", [a])
    if c.values[a].rank < 5 else None)


@op("squeeze", "squeeze.dims", keeps_exact=True)
def _squeeze(c: Ctx, a: int) -> Made:
    ones = [i for i, s in enumerate(c.values[a].shape) if s == 1]
    return (f"{{0}}.squeeze({c.rng.choice(ones)})", [a]) if ones else None


@op("expand", "expand.default", keeps_exact=True)
def _expand(c: Ctx, a: int) -> Made:
    v = c.values[a]
    new = [c.rng.randint(2, 4) if s == 1 and c.rng.random() < 0.7 else (-1 if c.rng.random() < 0.3 else s)
           for s in v.shape]
    lead = [c.rng.randint(1, 3) for _ in range(c.rng.randint(0, 4 - v.rank))] if v.rank < 4 else []
    return f"{{0}}.expand({lead + new})", [a]


@op("slice", "slice.Tensor", keeps_exact=True)
def _slice(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if not v.rank:
        return None
    d = c.rng.randrange(v.rank)
    n = v.shape[d]
    start = c.rng.randint(-n, n - 1)
    end = c.rng.choice([None, c.rng.randint(-n, n + 2)])
    step = c.rng.choice([1, 1, 2, 3])
    index = ", ".join([":"] * d + [f"{start}:{'' if end is None else end}:{step}"])
    return f"{{0}}[{index}]", [a]


@op("select", "select.int", keeps_exact=True)
def _select(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if not v.rank:
        return None
    d = c.rng.randrange(v.rank)
    return f"{{0}}.select({d}, {c.rng.randint(-v.shape[d], v.shape[d] - 1)})", [a]


@op("cat", "cat.default", keeps_exact=True)
def _cat(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if not v.rank:
        return None
    d = c.rng.randrange(v.rank)
    other = list(v.shape)
    other[d] = c.rng.randint(1, 4)
    b = c.partner(a, [tuple(other)])
    return f"torch.cat([{{0}}, {{1}}], {d - v.rank if c.rng.random() < 0.5 else d})", [a, b]


@op("stack", "cat.default unsqueeze.default", keeps_exact=True)
def _stack(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if v.rank >= 4:
        return None
    b = c.partner(a, [v.shape])
    return f"torch.stack([{{0}}, {{1}}], {c.rng.randint(0, v.rank)})", [a, b]


op("clone", "clone.default", keeps_exact=True)(lambda c, a: ("{0}.clone()", [a]))
op("flip", "flip.default", keeps_exact=True)(lambda c, a: (f"{{0}}.flip({c.dims(c.values[a])})", [a])
                                              if c.values[a].rank else None)
op("repeat", "repeat.default", keeps_exact=True)(
    lambda c, a: (f"{{0}}.repeat({[c.rng.randint(1, 2) for _ in range(max(c.values[a].rank, 1))]})", [a]))


# linear algebra, convolution, pooling, normalisation
@op("mm", "mm.default")
def _mm(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if v.rank != 2 or not v.is_float:
        return None
    b = c.partner(a, [(v.shape[1], c.rng.randint(1, 5))])
    return "torch.mm({0}, {1})", [a, b]


@op("bmm", "bmm.default")
def _bmm(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if v.rank != 3 or not v.is_float:
        return None
    b = c.partner(a, [(v.shape[0], v.shape[2], c.rng.randint(1, 5))])
    return "torch.bmm({0}, {1})", [a, b]


@op("matmul", "mm.default view.default")
def _matmul(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if v.rank < 2 or not v.is_float:
        return None
    b = c.partner(a, [(v.shape[-1], c.rng.randint(1, 5))])
    return "{0} @ {1}", [a, b]


@op("linear", "addmm.default permute.default view.default")
def _linear(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if v.rank != 2 or not v.is_float:  # addmm is what a rank-2 linear becomes; other ranks add views
        return None
    out = c.rng.randint(1, 5)
    w = c.fresh(v.dtype, (out, v.shape[-1]))
    bias = c.fresh(v.dtype, (out,))
    return "F.linear({0}, {1}, {2})", [a, w, bias]


@op("conv2d", "convolution.default")
def _conv2d(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if v.rank != 4 or not v.is_float:
        return None
    _, ch, h, w = v.shape
    k = c.rng.randint(1, min(h, w, 3))
    groups = c.rng.choice([g for g in (1, ch) if ch % g == 0])
    out = groups * c.rng.randint(1, 2)
    weight = c.fresh(v.dtype, (out, ch // groups, k, k))
    bias = c.fresh(v.dtype, (out,))
    stride, pad = c.rng.randint(1, 2), c.rng.randint(0, k // 2)
    return f"F.conv2d({{0}}, {{1}}, {{2}}, stride={stride}, padding={pad}, groups={groups})", [a, weight, bias]


@op("conv1d", "convolution.default")
def _conv1d(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if v.rank != 3 or not v.is_float:
        return None
    k = c.rng.randint(1, min(v.shape[2], 3))
    weight = c.fresh(v.dtype, (c.rng.randint(1, 4), v.shape[1], k))
    return f"F.conv1d({{0}}, {{1}}, padding={c.rng.randint(0, k // 2)})", [a, weight]


@op("max_pool2d", "max_pool2d_with_indices.default", keeps_exact=True)
def _max_pool(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if v.rank != 4 or not v.is_float or min(v.shape[2:]) < 2:
        return None
    k = c.rng.randint(2, min(v.shape[2:]))
    return f"F.max_pool2d({{0}}, {k}, stride={c.rng.randint(1, k)}, padding={c.rng.randint(0, k // 2)})", [a]


@op("avg_pool2d", "avg_pool2d.default")
def _avg_pool(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if v.rank != 4 or not v.is_float or min(v.shape[2:]) < 2:
        return None
    k = c.rng.randint(2, min(v.shape[2:]))
    return f"F.avg_pool2d({{0}}, {k}, padding={c.rng.randint(0, k // 2)})", [a]


op("softmax", "_softmax.default")(
    lambda c, a: (f"{{0}}.softmax({c.dim(c.values[a])})", [a]) if c.values[a].rank and c.values[a].is_float else None)
op("log_softmax", "_log_softmax.default")(
    lambda c, a: (f"{{0}}.log_softmax({c.dim(c.values[a])})", [a])
    if c.values[a].rank and c.values[a].is_float else None)


@op("layer_norm", "native_layer_norm.default")
def _layer_norm(c: Ctx, a: int) -> Made:
    v = c.values[a]
    if not v.rank or not v.is_float:
        return None
    shape = v.shape[-c.rng.randint(1, v.rank):]
    w, b = c.fresh(v.dtype, shape), c.fresh(v.dtype, shape)
    return f"F.layer_norm({{0}}, {list(shape)}, {{1}}, {{2}})", [a, w, b]


# creation
unary("zeros_like", "torch.zeros_like({0})", "full_like.default", keeps_exact=True)
unary("full_like", "torch.full_like({0}, 2)", "full_like.default", keeps_exact=True)
op("arange", "arange.start_step add.Tensor")(
    lambda c, a: (f"{{0}} + torch.arange({c.values[a].shape[-1]})", [a])
    if c.values[a].rank and not_bool(c.values[a]) else None)


def available() -> list[Op]:
    have = set(registry())
    return [o for o in OPS if all(n in have for n in o.needs)]


# ---------------------------------------------------------------- generating


def _eager_value(node: list[Any], tensors: dict[int, torch.Tensor]) -> Any:
    scope = {"torch": torch, "F": F, **{f"v{j}": tensors[j] for j in node[2]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return eval(node[1].format(*(f"v{j}" for j in node[2])), scope)


def generate(seed: int, ops: list[Op] | None = None) -> Program:
    """A random valid program: 1-3 inputs, 1-8 ops, the values no op uses returned (at most 4)."""
    rng = random.Random(seed)
    ops = available() if ops is None else ops
    nodes: list[list[Any]] = []
    values: list[V] = []
    c = Ctx(rng, nodes, values)
    dtype = DTYPES[rng.choice(PROGRAM_DTYPES)]
    rank = rng.choice([0, 1, 2, 2, 3, 3, 4, 4])
    base = tuple(rng.randint(1, 5) for _ in range(rank))
    for _ in range(rng.randint(1, 3)):
        c.fresh(dtype if rng.random() < 0.85 else DTYPES[rng.choice(PROGRAM_DTYPES)], broadcast_variant(c, base))
    data = {i: make_input(n) for i, n in enumerate(nodes)}
    last = len(nodes) - 1
    weights = [o.weight for o in ops]
    for _ in range(rng.randint(1, 8) if ops else 0):
        for _attempt in range(30):
            o = rng.choices(ops, weights)[0]
            a = last if rng.random() < 0.6 else rng.randrange(len(nodes))
            if o.needs_exact and not values[a].exact:
                continue
            mark = len(nodes)
            made = o.make(c, a)
            if made is not None and (not o.needs_exact or all(values[j].exact for j in made[1])):
                node = ["op", made[0], made[1], o.name]
                fresh = {j: make_input(nodes[j]) for j in range(mark, len(nodes))}
                try:
                    t = _eager_value(node, {**data, **fresh})
                except Exception:  # not valid PyTorch: try another
                    t = None
                if (isinstance(t, torch.Tensor) and t.dim() <= 5 and 0 < t.numel() <= MAX_NUMEL
                        and t.dtype in NAMES):
                    exact = all(values[j].exact for j in made[1]) and (o.keeps_exact or not t.is_floating_point())
                    nodes.append(node)
                    values.append(V(tuple(t.shape), t.dtype, exact))
                    data.update(fresh)
                    data[len(nodes) - 1] = t
                    last = len(nodes) - 1
                    break
            del nodes[mark:], values[mark:]
    used = {j for n in nodes if n[0] == "op" for j in n[2]}
    outputs = [i for i, n in enumerate(nodes) if n[0] == "op" and i not in used][-4:]
    return _dead_code_free(Program(nodes, outputs))


# ---------------------------------------------------------------- running


@dataclass
class Outcome:
    kind: str  # "pass", "unsupported", "fail"
    detail: str = ""
    signature: str = ""  # what a shrunk program must keep failing with

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


def run_program(p: Program) -> Outcome:
    fn = p.function()
    inputs = make_inputs(p)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = fn(*[t.clone() for t in inputs])
    except Exception as err:
        return Outcome("invalid", f"eager raises {type(err).__name__}: {err}")
    if not p.outputs:
        return Outcome("invalid", "no outputs")
    try:
        got = torchtosa.compile(fn, *inputs, fallback="error")(*inputs)
    except Unsupported as err:
        # includes "no mapping": decompositions differ by dtype (bf16 silu adds _to_copy)
        return Outcome("unsupported", str(err).splitlines()[0][:300])
    except Exception as err:
        first = str(err).splitlines()[0] if str(err) else ""
        return Outcome("fail", f"{type(err).__name__}: {str(err)[:1500]}",
                       f"{type(err).__name__}: {re.sub(r'[0-9]+', 'N', first)[:80]}")
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        rtol, atol = TOLERANCE.get(w.dtype, (0, 0))
        try:
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
        except AssertionError as err:
            return Outcome("fail", f"output {k} (v{p.outputs[k]}) differs from eager: {err}", f"mismatch {w.dtype}")
    return Outcome("pass")


def _dead_code_free(p: Program) -> Program:
    """Only the nodes the outputs need (unused inputs dropped too), renumbered."""
    keep: set[int] = set()
    todo = list(p.outputs)
    while todo:
        i = todo.pop()
        if i not in keep:
            keep.add(i)
            if p.nodes[i][0] == "op":
                todo.extend(p.nodes[i][2])
    order = sorted(keep)
    new = {old: k for k, old in enumerate(order)}
    nodes = [n if n[0] == "input" else ["op", n[1], [new[j] for j in n[2]], n[3]] for n in (p.nodes[i] for i in order)]
    return Program(nodes, [new[i] for i in p.outputs])


def shrink(p: Program, failing: Outcome, budget: int = 40, run: Callable[[Program], Outcome] | None = None) -> Program:
    """Smaller programs that fail the same way (under `run`, by default `run_program`): fewer
    outputs, then ops bypassed or dropped."""
    def fails(q: Program) -> bool:
        nonlocal budget
        budget -= 1
        out = (run or run_program)(q)
        return out.kind == "fail" and out.signature == failing.signature

    p = _dead_code_free(p)
    changed = True
    while changed and budget > 0:
        changed = False
        for o in list(p.outputs):
            if len(p.outputs) > 1 and budget > 0:
                q = _dead_code_free(Program(p.nodes, [o]))
                if fails(q):
                    p, changed = q, True
                    break
        # make an earlier op the output (drops everything after it)
        for i in range(len(p.nodes)):
            if p.nodes[i][0] == "op" and i not in p.outputs and budget > 0:
                q = _dead_code_free(Program(p.nodes, [i]))
                if fails(q):
                    p, changed = q, True
                    break
    return p


def report(p: Program, seed: int, out: Outcome, regressions: Path = REGRESSIONS) -> str:
    entry = {"name": f"seed-{seed}", "seed": seed, "expect": "pass", "bug": "...", "program": p.to_json()}
    return (f"{out}\n\n{p.source()}\n\nregression entry for {regressions.name}:\n"
            + json.dumps(entry))


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + FUZZ_PROGRAMS))
def test_random_program_matches_eager(seed: int) -> None:
    p = generate(seed)
    if not [n for n in p.nodes if n[0] == "op"]:
        pytest.skip("no op of the table is in the registry for these inputs")
    out = run_program(p)
    assert out.kind in ("pass", "unsupported"), report(shrink(p, out), seed, out)


def _regressions() -> list[dict[str, Any]]:
    return json.loads(REGRESSIONS.read_text()) if REGRESSIONS.exists() else []


@pytest.mark.parametrize("case", _regressions(), ids=lambda c: c["name"])
def test_regression(case: dict[str, Any]) -> None:
    p = Program.from_json(case["program"])
    by_name = {o.name: o for o in OPS}
    missing = {n for node in p.nodes if node[0] == "op" for n in by_name[node[3]].needs} - set(registry())
    if missing:
        pytest.skip(f"needs {', '.join(sorted(missing))}")
    out = run_program(p)
    assert out.kind == case.get("expect", "pass"), f"{case['name']} ({case.get('bug', '')}): {out}\n{p.source()}"


def test_generator_is_deterministic() -> None:
    assert generate(123).to_json() == generate(123).to_json()
