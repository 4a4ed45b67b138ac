"""Random programs around what the pipeline rewrites, through every `opt` level, against eager.

test_fuzz.py draws programs over the whole op table and compiles them strictly at the default
level; this file aims at the partitioner, the schedule and the storage beneath views instead:
reductions over several dims (sums of squares and of products, norms: the reduction loops the
schedule merges, a head merge before a matmul), views of views (`as_strided` reading the storage
beneath a value, `expand`, slices with steps and empty ones, `diagonal`, `unfold`, selects down
to 0-d) and 0-d tensors in broadcasts. Each program runs as a user runs it (`torchtosa.compile`
with the default eager fallback: an empty slice runs eagerly) at every level of
`pipeline.OPT_LEVELS`, and passes when every output matches eager and no region fell back on
an internal error (`explain().failures`): the program still runs then, but it is a bug.

Programs, shrinking and reports are test_fuzz.py's; a failure stays as a regression test in
`tests/fuzz/pipeline_regressions.json`. `make test` runs PIPELINE_PROGRAMS seeded programs,
`make fuzz` a quarter of TORCHTOSA_FUZZ_EXAMPLES (each program compiles once per level);
TORCHTOSA_FUZZ_SEED picks the first seed.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_fuzz import (
    DTYPES,
    FIRST_SEED,
    NAMES,
    ROOT,
    TOLERANCE,
    Outcome,
    Program,
    _dead_code_free,
    _eager_value,
    _factor,
    make_input,
    make_inputs,
    report,
    shrink,
)

import torchtosa
from torchtosa import FallbackWarning
from torchtosa.lower.pipeline import OPT_LEVELS

REGRESSIONS = ROOT / "fuzz" / "pipeline_regressions.json"
PIPELINE_PROGRAMS = int(os.environ.get("TORCHTOSA_FUZZ_EXAMPLES", "0")) // 4 or 12
MAX_NUMEL = 2048
BASE_DTYPES = ["f32"] * 7 + ["i32"]

Made = tuple[str, list[int]] | None  # (expression over {0}, {1}..., operands) or not applicable


class Ctx:
    """Generation state: the nodes so far and their eager values (as_strided reads a value's storage)."""

    def __init__(self, rng: random.Random, nodes: list[list[Any]], data: dict[int, torch.Tensor]) -> None:
        self.rng, self.nodes, self.data = rng, nodes, data

    def fresh(self, shape: list[int] | tuple[int, ...], dtype: torch.dtype = torch.float32) -> int:
        self.nodes.append(["input", NAMES[dtype], list(shape), self.rng.randrange(2**31)])
        self.data[len(self.nodes) - 1] = make_input(self.nodes[-1])
        return len(self.nodes) - 1

    def partner(self, a: int, shape: tuple[int, ...]) -> int:
        """An earlier value of `shape` and `a`'s dtype, or a fresh input."""
        t = self.data[a]
        found = [i for i, v in self.data.items() if i != a and tuple(v.shape) == shape and v.dtype == t.dtype]
        return self.rng.choice(found) if found and self.rng.random() < 0.5 else self.fresh(shape, t.dtype)

    def dims(self, t: torch.Tensor) -> list[int]:
        """Dims of t, several more often than not, negative half the time."""
        k = self.rng.randint(2, t.dim()) if t.dim() >= 2 and self.rng.random() < 0.7 else 1
        return [d - t.dim() if self.rng.random() < 0.5 else d for d in sorted(self.rng.sample(range(t.dim()), k))]

    def broadcast(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """shape, a suffix of it, it with some sizes 1, or () (a 0-d partner)."""
        r = self.rng.random()
        if r < 0.4 or not shape:
            return shape
        if r < 0.6:
            return ()
        if r < 0.8:
            return shape[self.rng.randint(1, len(shape)):]
        return tuple(1 if self.rng.random() < 0.4 else s for s in shape)


BUILDERS: list[tuple[str, float, Callable[[Ctx, int], Made]]] = []


def builder(name: str, weight: float = 1.0) -> Callable[[Callable[[Ctx, int], Made]], Callable[[Ctx, int], Made]]:
    def register(fn: Callable[[Ctx, int], Made]) -> Callable[[Ctx, int], Made]:
        BUILDERS.append((name, weight, fn))
        return fn
    return register


def _float(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point


# ---------------------------------------------------------------- reductions over several dims


@builder("reduce", 2.0)
def _reduce(c: Ctx, a: int) -> Made:
    t = c.data[a]
    fn = c.rng.choice(["sum", "amax", "amin"] + ["mean"] * _float(t))
    if t.dim() == 0 or c.rng.random() < 0.15:
        return f"{{0}}.{fn}()", [a]
    return f"{{0}}.{fn}({c.dims(t)}, keepdim={c.rng.random() < 0.5})", [a]


@builder("var")
def _var(c: Ctx, a: int) -> Made:
    t = c.data[a]
    if not _float(t) or t.dim() == 0:
        return None
    dims = c.dims(t)
    count = math.prod(t.shape[d] for d in dims)
    return f"{{0}}.var({dims}, correction={c.rng.choice([0, 1]) if count > 1 else 0})", [a]


@builder("sum_of_squares", 1.5)
def _squares(c: Ctx, a: int) -> Made:
    t = c.data[a]
    return (f"({{0}} * {{0}}).sum({c.dims(t)})", [a]) if _float(t) and t.dim() else None


@builder("sum_of_products", 1.5)
def _products(c: Ctx, a: int) -> Made:
    t = c.data[a]
    if not _float(t) or not t.dim():
        return None
    b = c.partner(a, c.broadcast(tuple(t.shape)))
    return f"({{0}} * {{1}}).sum({c.dims(t)}, keepdim={c.rng.random() < 0.3})", [a, b]


@builder("rms_norm", 1.5)
def _rms_norm(c: Ctx, a: int) -> Made:
    t = c.data[a]
    if not _float(t) or not t.dim():
        return None
    shape = list(t.shape[-c.rng.randint(1, t.dim()):])
    eps = c.rng.choice([None, 1e-6, 0.7])
    if c.rng.random() < 0.3:
        return f"F.rms_norm({{0}}, {shape}, eps={eps})", [a]
    return f"F.rms_norm({{0}}, {shape}, {{1}}, eps={eps})", [a, c.fresh(shape, t.dtype)]


@builder("layer_norm")
def _layer_norm(c: Ctx, a: int) -> Made:
    t = c.data[a]
    if not _float(t) or not t.dim():
        return None
    shape = list(t.shape[-c.rng.randint(1, t.dim()):])
    dims = list(range(-len(shape), 0))
    if t.numel() and t.var(dims, correction=0).min() < 1e-2:
        return None  # (x - mean) / sqrt(var + eps) of (nearly) equal values turns an ulp into 3e-4
    return f"F.layer_norm({{0}}, {shape}, {{1}}, {{2}})", [a, c.fresh(shape, t.dtype), c.fresh(shape, t.dtype)]


@builder("vector_norm")
def _vector_norm(c: Ctx, a: int) -> Made:
    t = c.data[a]
    return (f"torch.linalg.vector_norm({{0}}, dim={c.dims(t)})", [a]) if _float(t) and t.dim() else None


@builder("merge_heads")
def _merge_heads(c: Ctx, a: int) -> Made:
    """(..., h, s, d) -> (..., s, h * d) @ w: a contraction over (h, d) once fusion moves the reshape."""
    t = c.data[a]
    if not _float(t) or t.dim() < 3:
        return None
    w = c.fresh((t.shape[-3] * t.shape[-1], c.rng.randint(1, 6)), t.dtype)
    return "{0}.transpose(-3, -2).flatten(-2) @ {1}", [a, w]


@builder("matmul")
def _matmul(c: Ctx, a: int) -> Made:
    t = c.data[a]
    if not _float(t) or not t.dim():
        return None
    return "{0} @ {1}", [a, c.partner(a, (t.shape[-1], c.rng.randint(1, 5)))]


# ---------------------------------------------------------------- views of views


@builder("as_strided", 2.0)
def _as_strided(c: Ctx, a: int) -> Made:
    """A window on the storage beneath the value (beyond its own elements too), broadcasts by
    stride 0, sometimes empty; the offset given or the value's own."""
    t = c.data[a]
    storage = t.untyped_storage().nbytes() // t.element_size()
    if storage == 0:
        return None
    sizes = [0, 1, 2, 3, 4] if c.rng.random() < 0.15 else [1, 2, 3, 4]
    size = [c.rng.choice(sizes) for _ in range(c.rng.randint(0, 3))]
    stride = [c.rng.choice([0, 1, 1, 2, 3, 5]) for _ in size]
    span = sum((n - 1) * s for n, s in zip(size, stride, strict=True) if n)
    if span >= storage:
        return None
    if c.rng.random() < 0.5:
        return (f"torch.as_strided({{0}}, {size}, {stride})", [a]) if t.storage_offset() + span < storage else None
    return f"torch.as_strided({{0}}, {size}, {stride}, {c.rng.randint(0, storage - 1 - span)})", [a]


@builder("expand", 1.5)
def _expand(c: Ctx, a: int) -> Made:
    t = c.data[a]
    sizes = [c.rng.randint(2, 3) if n == 1 and c.rng.random() < 0.7 else (-1 if c.rng.random() < 0.3 else n)
             for n in t.shape]
    lead = [c.rng.randint(1, 3) for _ in range(c.rng.randint(0, max(0, 4 - t.dim())))]
    return f"{{0}}.expand({lead + sizes})", [a]


@builder("slice", 2.0)
def _slice(c: Ctx, a: int) -> Made:
    t = c.data[a]
    if not t.dim():
        return None
    d = c.rng.randrange(t.dim())
    n = t.shape[d]
    if c.rng.random() < 0.35:  # empty: its storage offset may lie beyond its elements
        k = c.rng.randint(0, n)
        return f"{{0}}[{':, ' * d}{k}:{k}]", [a]
    start, step = c.rng.randint(-n, max(n - 1, 0)), c.rng.choice([1, 1, 2, 3])
    return f"{{0}}[{':, ' * d}{start}::{step}]", [a]


@builder("select")
def _select(c: Ctx, a: int) -> Made:
    t = c.data[a]
    if not t.dim() or not t.numel():
        return None
    d = c.rng.randrange(t.dim())
    return f"{{0}}.select({d}, {c.rng.randint(-t.shape[d], t.shape[d] - 1)})", [a]


@builder("permute")
def _permute(c: Ctx, a: int) -> Made:
    t = c.data[a]
    return (f"{{0}}.permute({c.rng.sample(range(t.dim()), t.dim())})", [a]) if t.dim() >= 2 else None


@builder("transpose")
def _transpose(c: Ctx, a: int) -> Made:
    t = c.data[a]
    return (f"{{0}}.transpose({c.rng.randrange(t.dim())}, {c.rng.randrange(t.dim())})", [a]) if t.dim() else None


@builder("unsqueeze")
def _unsqueeze(c: Ctx, a: int) -> Made:
    t = c.data[a]
    return (f"{{0}}.unsqueeze({c.rng.randint(-t.dim() - 1, t.dim())})", [a]) if t.dim() < 5 else None


@builder("squeeze")
def _squeeze(c: Ctx, a: int) -> Made:
    ones = [d for d, n in enumerate(c.data[a].shape) if n == 1]
    return (f"{{0}}.squeeze({c.rng.choice(ones)})", [a]) if ones else None


@builder("reshape")
def _reshape(c: Ctx, a: int) -> Made:
    t = c.data[a]
    return (f"{{0}}.reshape({_factor(c.rng, tuple(t.shape))})", [a]) if t.numel() else None


@builder("flatten", 0.5)
def _flatten(c: Ctx, a: int) -> Made:
    return "{0}.flatten()", [a]


@builder("diagonal", 0.7)
def _diagonal(c: Ctx, a: int) -> Made:
    t = c.data[a]
    if t.dim() < 2:
        return None
    d1, d2 = c.rng.sample(range(t.dim()), 2)
    return f"{{0}}.diagonal({c.rng.randint(-1, 1)}, {d1}, {d2})", [a]


@builder("unfold", 0.7)
def _unfold(c: Ctx, a: int) -> Made:
    t = c.data[a]
    if not t.dim():
        return None
    d = c.rng.randrange(t.dim())
    return f"{{0}}.unfold({d}, {c.rng.randint(1, max(t.shape[d], 1))}, {c.rng.randint(1, 2)})", [a]


builder("contiguous", 0.5)(lambda c, a: ("{0}.contiguous()", [a]))


# ---------------------------------------------------------------- 0-d values and elementwise glue


@builder("binary", 2.0)
def _binary(c: Ctx, a: int) -> Made:
    t = c.data[a]
    zero_d = [i for i, v in c.data.items() if i != a and v.dim() == 0 and v.dtype == t.dtype]
    b = c.rng.choice(zero_d) if zero_d and c.rng.random() < 0.4 else c.partner(a, c.broadcast(tuple(t.shape)))
    return c.rng.choice(["{0} + {1}", "{0} * {1}", "{1} - {0}"]), [a, b]


@builder("unary", 1.5)
def _unary(c: Ctx, a: int) -> Made:
    ops = ["{0} * 3", "-{0}", "{0}.abs()", "torch.relu({0})"]
    return c.rng.choice(ops + ["torch.tanh({0})", "torch.sigmoid({0})"] * _float(c.data[a])), [a]


# ---------------------------------------------------------------- generating and running


def generate(seed: int) -> Program:
    """A random valid program: 1-2 inputs of one shape (rank 0-4, sizes 1-5), 2-8 ops; the values no
    op uses are returned (at most 3). Values may be empty; every step is checked eagerly."""
    rng = random.Random(seed)
    nodes: list[list[Any]] = []
    data: dict[int, torch.Tensor] = {}
    c = Ctx(rng, nodes, data)
    dtype = DTYPES[rng.choice(BASE_DTYPES)]
    base = tuple(rng.randint(1, 5) for _ in range(rng.choice([0, 1, 2, 3, 3, 4, 4])))
    c.fresh(base, dtype)
    if rng.random() < 0.5:
        c.fresh(c.broadcast(base), dtype)
    last = len(nodes) - 1
    weights = [w for _, w, _ in BUILDERS]
    for _ in range(rng.randint(2, 8)):
        for _attempt in range(30):
            name, _, make = rng.choices(BUILDERS, weights)[0]
            a = last if rng.random() < 0.6 else rng.randrange(len(nodes))
            mark = len(nodes)
            made = make(c, a)
            if made is not None:
                node = ["op", made[0], made[1], name]
                try:
                    t = _eager_value(node, data)
                except Exception:  # not valid PyTorch: try another
                    t = None
                if isinstance(t, torch.Tensor) and t.dim() <= 6 and t.numel() <= MAX_NUMEL and t.dtype in NAMES:
                    nodes.append(node)
                    data[len(nodes) - 1] = t
                    last = len(nodes) - 1
                    break
            for i in range(mark, len(nodes)):
                data.pop(i, None)
            del nodes[mark:]
    used = {j for n in nodes if n[0] == "op" for j in n[2]}
    outputs = [i for i, n in enumerate(nodes) if n[0] == "op" and i not in used][-3:]
    return _dead_code_free(Program(nodes, outputs))


def run_pipeline(p: Program) -> Outcome:
    """Compile `p` at every opt level with the default eager fallback: pass if each level matches
    eager and no region fell back on an internal error."""
    fn = p.function()
    inputs = make_inputs(p)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = fn(*[t.clone() for t in inputs])
    except Exception as err:
        return Outcome("invalid", f"eager raises {type(err).__name__}: {err}")
    for opt in OPT_LEVELS:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FallbackWarning)  # empty slices run eagerly: expected
                compiled = torchtosa.compile(fn, *inputs, opt=opt)
                got = compiled(*inputs)
        except Exception as err:
            first = str(err).splitlines()[0] if str(err) else ""
            return Outcome("fail", f"opt={opt}: {type(err).__name__}: {str(err)[:1500]}",
                           f"{opt} {type(err).__name__}: {re.sub(r'[0-9]+', 'N', first)[:80]}")
        failures = compiled.explain().failures
        if failures:
            return Outcome("fail", f"opt={opt}: a region fell back on internal error {failures[0].short()}",
                           f"{opt} internal {re.sub(r'[0-9]+', 'N', failures[0].detail)[:80]}")
        for k, (g, w) in enumerate(zip(got, want, strict=True)):
            rtol, atol = TOLERANCE.get(w.dtype, (0, 0))
            try:
                torch.testing.assert_close(g, w, rtol=rtol, atol=atol, equal_nan=True)
            except AssertionError as err:
                return Outcome("fail", f"opt={opt}: output {k} (v{p.outputs[k]}) differs from eager: {err}",
                               f"{opt} mismatch {w.dtype}")
    return Outcome("pass")


@pytest.mark.parametrize("seed", range(FIRST_SEED, FIRST_SEED + PIPELINE_PROGRAMS))
def test_random_pipeline_program_matches_eager_at_every_level(seed: int) -> None:
    p = generate(seed)
    out = run_pipeline(p)
    assert out.kind == "pass", report(shrink(p, out, run=run_pipeline), seed, out, REGRESSIONS)


def _regressions() -> list[dict[str, Any]]:
    return json.loads(REGRESSIONS.read_text()) if REGRESSIONS.exists() else []


@pytest.mark.parametrize("case", _regressions(), ids=lambda c: c["name"])
def test_pipeline_regression(case: dict[str, Any]) -> None:
    p = Program.from_json(case["program"])
    out = run_pipeline(p)
    assert out.kind == case.get("expect", "pass"), f"{case['name']} ({case.get('bug', '')}): {out}\n{p.source()}"


def test_generator_is_deterministic_and_reaches_its_targets() -> None:
    """Same seed, same program; over a few seeds the programs have empty values, 0-d values,
    reductions over several dims and as_strided of views."""
    assert generate(7).to_json() == generate(7).to_json()
    sources = "\n".join(generate(seed).source() for seed in range(40))
    for wanted in (r"\[(\d+):\1\]", r"as_strided\(v\d+, \[", r"\.sum\(\[-?\d+, -?\d+", r"# v\d+: \w+\[\]",
                   r"\.expand\("):
        assert re.search(wanted, sources), wanted
