"""Property tests: every opdefs entry's shape/dtype rules against PyTorch on drawn arguments.

For each entry (all of `opdefs/*.yaml`, loaded with `generator.spec.load_specs`, so a
new entry is covered the moment it lands) hypothesis draws argument variations from
the entry's own samples:

- shapes: the sample's ranks with the sizes redrawn (either consistently — every
  occurrence of a size becomes the same new size, which keeps matmul/broadcast
  structure — or independently), and for entries whose only non-tensor arguments
  are not ints (elementwise-like) fresh ranks 0–5 with broadcast-compatible shapes;
  sizes are 1–7, and one size becomes 0 now and then;
- dtypes: the sample's, one dtype for every tensor, or one per tensor, from
  f16 bf16 f32 f64 i8 i16 i32 i64 u8 bool;
- dim arguments (`dim`, `dims`, `dim0`, ...): kept, shifted by -rank, or redrawn in
  [-rank-1, rank] (out of range on purpose); `keepdim` and other bools flipped;
- Python numbers in Tensor slots, Scalar and ScalarType arguments: redrawn from a
  few values of every kind; other int arguments: kept or redrawn in [-2, 8].

Each variation is checked the way tests/test_ops.py checks samples:

- the entry's rules (its generated function with `b=None`, on descriptors) and
  PyTorch (the aten overload on FakeTensors; eager on real data when FakeTensor
  cannot tell) must agree: equal result shapes/dtypes, or torch raises and the
  entry raises InvalidInput or Unsupported; InvalidInput only where torch raises
  (FakeTensor or eager: meta kernels check less than CPU kernels, e.g. mm of f32 and f16);
  any other exception from the rules is a bug;
- whatever the rules accept must lower (build + verify the TOSA module) or raise
  Unsupported: a LoweringError (e.g. a zero-size operand TOSA rejects) is a bug;
- with TORCHTOSA_FUZZ_EXAMPLES set (`make fuzz`) every accepted variation also runs
  natively and is compared with eager.

A failure prints the variation as a sample line, ready to paste into the entry.
`make test` runs PROPERTY_EXAMPLES (20, derandomized) per entry; `make fuzz` runs
TORCHTOSA_FUZZ_EXAMPLES / 20 per entry with fresh random seeds (hypothesis prints the
seed of a failure to reproduce it).
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_ops import (
    DTYPES,
    UNSPECIFIED_VALUES,
    call_torch,
    describe,
    entry_for,
    fake_results,
    random_tensor,
    sort_args,
)
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)

from generator.spec import OpDef, load_specs
from torchtosa import InvalidInput, Unsupported
from torchtosa.testing import lower_op, run_op

ROOT = Path(__file__).resolve().parent.parent
OPDEFS = load_specs(ROOT / "opdefs")[1]
FUZZ = int(os.environ.get("TORCHTOSA_FUZZ_EXAMPLES", "0"))
# per entry: 20 in `make test`; `make fuzz` (TORCHTOSA_FUZZ_EXAMPLES=2000) runs 1/20 of it, each natively too
PROPERTY_EXAMPLES = max(20, FUZZ // 20) if FUZZ else 20
settings.register_profile("properties", max_examples=PROPERTY_EXAMPLES, derandomize=not FUZZ, deadline=None,
                          database=None, print_blob=bool(FUZZ),
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                 HealthCheck.filter_too_much])

BROAD_DTYPES = ["f32", "f16", "bf16", "f64", "i64", "i32", "i16", "i8", "u8", "bool"]
DIM_ARG = re.compile(r"(dim\d*|dims|axis|start_dim|end_dim)")
NEEDS_DATA = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)
# FakeTensor logs every meta function that raises; here raising is an expected outcome
logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
INTISH = re.compile(r"(int|SymInt)(\[\d*\])?\??")


def _is_tensor(v: Any) -> bool:
    return isinstance(v, tuple) and len(v) == 3 and v[0] == "tensor"


def _base(t: str) -> str:
    return t.rstrip("?")


def rank_free(e: OpDef) -> bool:
    """Ops whose arguments say nothing about ranks or sizes: any shapes may be drawn."""
    return any(a.kind == "tensor" for a in e.args) and not any(
        a.kind == "tensors" or (a.kind == "scalar" and INTISH.fullmatch(a.type)) for a in e.args)


def _default(a: Any) -> Any:
    d = a.default
    return None if d is None or not isinstance(d, bool | int | float | list | str) else d


# ---------------------------------------------------------------- drawing


@st.composite
def sizes(draw: Any, n: int) -> list[int]:
    out = [draw(st.integers(1, 7)) for _ in range(n)]
    if n and draw(st.integers(0, 9)) == 0:  # a zero-size dim now and then
        out[draw(st.integers(0, n - 1))] = 0
    return out


@st.composite
def variation(draw: Any, e: OpDef) -> dict[str, Any]:
    """One argument mapping in sample form (tensors as ("tensor", dtype, dims))."""
    s = draw(st.sampled_from(e.samples))
    args: dict[str, Any] = {a.name: s.args[a.name] if a.name in s.args else _default(a) for a in e.args}
    # every tensor slot, as (arg name, index in a list or None)
    slots = [(a.name, None) for a in e.args if _is_tensor(args[a.name])]
    slots += [(a.name, i) for a in e.args if a.kind == "tensors" and isinstance(args[a.name], list)
              for i, v in enumerate(args[a.name]) if _is_tensor(v)]

    def get(slot: tuple[str, int | None]) -> Any:
        name, i = slot
        return args[name] if i is None else args[name][i]

    def put(slot: tuple[str, int | None], v: Any) -> None:
        name, i = slot
        if i is None:
            args[name] = v
        else:
            args[name] = [*args[name][:i], v, *args[name][i + 1:]]

    # shapes
    modes = ["keep", "relabel", "independent"] + (["free", "free"] if rank_free(e) else [])
    mode = draw(st.sampled_from(modes))
    shapes = [list(get(x)[2]) for x in slots]
    if mode == "relabel":
        distinct = sorted({d for shp in shapes for d in shp})
        new = draw(sizes(len(distinct)))
        keep_ones = draw(st.integers(0, 2)) > 0
        table = {d: (1 if d == 1 and keep_ones else n) for d, n in zip(distinct, new, strict=True)}
        shapes = [[table[d] for d in shp] for shp in shapes]
    elif mode == "independent":
        flat = draw(sizes(sum(len(shp) for shp in shapes)))
        out, k = [], 0
        for shp in shapes:
            out.append(flat[k:k + len(shp)])
            k += len(shp)
        shapes = out
    elif mode == "free":
        r = draw(st.integers(0, 5))
        full = draw(sizes(r))
        shapes = []
        for _ in slots:
            k = draw(st.integers(0, r))
            shapes.append([1 if draw(st.integers(0, 3)) == 0 else d for d in full[r - k:]])
    # dtypes
    dmode = draw(st.sampled_from(["sample", "same", "each"]))
    one = draw(st.sampled_from(BROAD_DTYPES))
    for x, shp in zip(slots, shapes, strict=True):
        dt = get(x)[1] if dmode == "sample" else one if dmode == "same" else draw(st.sampled_from(BROAD_DTYPES))
        put(x, ("tensor", dt, tuple(shp)))
    rank = len(shapes[0]) if shapes else 0
    # the other arguments
    for a in e.args:
        v, base = args[a.name], _base(a.type)
        if a.kind == "tensor" and isinstance(v, bool | int | float):  # a Python number in a Tensor slot
            args[a.name] = draw(st.sampled_from([v, 2, -3, 0, 0.5, True, False]))
        elif a.kind != "scalar":
            continue
        elif base in ("Scalar", "number"):
            args[a.name] = draw(st.sampled_from([v, 2, -1, 0, 0.5, True] + ([None] if a.type.endswith("?") else [])))
        elif base == "ScalarType":
            names = [None if v is None else v, *(("dtype", d) for d in BROAD_DTYPES)]
            args[a.name] = draw(st.sampled_from(names + ([None] if a.type.endswith("?") else [])))
        elif base == "bool" and not a.type.endswith("?"):
            args[a.name] = draw(st.booleans())
        elif DIM_ARG.fullmatch(a.name) and INTISH.fullmatch(a.type):
            args[a.name] = draw(dims(v, rank, a.type))
        elif base in ("int", "SymInt") and v is not None and draw(st.integers(0, 3)) == 0:
            args[a.name] = draw(st.integers(-2, 8))
    return args


@st.composite
def dims(draw: Any, v: Any, rank: int, type_: str) -> Any:
    """A dim argument: kept, shifted by -rank, or redrawn (possibly out of range)."""
    n = max(rank, 1)
    how = draw(st.sampled_from(["keep", "negative", "negative", "redraw"]))
    if how == "keep":
        return v
    if how == "negative":
        if isinstance(v, int):
            return v - n if v >= 0 else v
        if isinstance(v, list):
            return [d - n if d >= 0 and draw(st.booleans()) else d for d in v]
        return v
    one = st.integers(-n - 1, n)
    if "[" in type_:
        return draw(st.one_of(st.lists(one, max_size=rank + 1), st.just(None) if type_.endswith("?") else st.nothing()))
    return draw(st.one_of(one, st.just(None) if type_.endswith("?") else st.nothing()))


# ---------------------------------------------------------------- checking


def fmt(v: Any) -> str:
    """A sample value as YAML flow text."""
    if _is_tensor(v):
        return f'"{v[1]}[{", ".join(map(str, v[2]))}]"'
    if isinstance(v, tuple) and v and v[0] == "dtype":
        return v[1]
    if isinstance(v, list):
        return "[" + ", ".join(fmt(x) for x in v) + "]"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    return repr(v)


def reproducer(e: OpDef, args: dict[str, Any]) -> str:
    defaults = {a.name: _default(a) for a in e.args}
    shown = {k: v for k, v in args.items() if k not in defaults or v != defaults[k] or
             any(a.name == k and a.default is not None and a.kind != "scalar" for a in e.args)}
    body = ", ".join(f"{k}: {fmt(v)}" for k, v in shown.items())
    return f"{e.op} ({e.where}):\n    - {{{body}}}"


def materialize(e: OpDef, args: dict[str, Any], real: bool) -> list[Any]:
    """Arguments in schema order: zeros (enough for FakeTensor) or random data."""
    def make(v: Any) -> Any:
        if _is_tensor(v):
            dt = DTYPES[v[1]]
            if not real:
                return torch.zeros(v[2], dtype=dt)
            return random_tensor(dt, v[2], None)
        if isinstance(v, tuple) and v and v[0] == "dtype":
            return DTYPES[v[1]]
        if isinstance(v, list):
            return [make(x) for x in v]
        return v

    return sort_args(e, [make(args[a.name]) for a in e.args])


def torch_types(e: OpDef, args: dict[str, Any]) -> tuple[list[tuple] | None, Exception | None]:
    """PyTorch's result types, or its error, as capture sees them: FakeTensor (where it cannot
    tell without data — data-dependent output shapes, no meta function — eager decides)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [(tuple(t.shape), t.dtype) for t in fake_results(e, materialize(e, args, real=False))], None
    except NEEDS_DATA as err:
        fake_err: Exception = err
    except Exception as err:  # torch's own error types vary
        return None, err
    try:
        return eager_types(e, args), None
    except Exception:
        return None, fake_err


def eager_types(e: OpDef, args: dict[str, Any]) -> list[tuple]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [(tuple(t.shape), t.dtype) for t in call_torch(e, materialize(e, args, real=True))]


def check(e: OpDef, args: dict[str, Any]) -> str:
    """Compare the rules with torch for one variation; returns the outcome's kind."""
    where = reproducer(e, args)
    expected, torch_err = torch_types(e, args)
    entry = entry_for(e)
    try:
        got = entry.fn(None, *describe(e, materialize(e, args, real=False)))
    except Unsupported:
        return "unsupported"
    except InvalidInput as err:
        if expected is not None:
            try:
                eager_types(e, args)
            except Exception:
                return "invalid"  # FakeTensor accepts it but eager rejects it (meta kernels check less)
        assert expected is None, f"the rules raise InvalidInput ({err}) but torch gives {expected}\n{where}"
        return "invalid"
    except Exception as err:
        pytest.fail(f"the rules crash with {type(err).__name__}: {err}\n{where}")
    assert expected is not None, (f"torch raises {type(torch_err).__name__}: {str(torch_err)[:300]}\n"
                                  f"but the rules accept it and give {got}\n{where}")
    assert got == expected, f"the rules give {got}, torch gives {expected}\n{where}"
    real = materialize(e, args, real=True)
    try:
        want = None
        if FUZZ:
            try:
                want = call_torch(e, real)
            except Exception:  # eager rejects these random values (an index out of range, an integer // 0)
                want = None  # data-dependent: nothing to compare, the lowering is still checked
        if want is not None:
            out = run_op(entry, real)
            tol = e.tolerance or {}
            for g, w in zip(out, want, strict=True):
                if e.op in UNSPECIFIED_VALUES:  # empty*: values are whatever memory held
                    assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{g.dtype}{list(g.shape)} != {w}"
                    continue
                torch.testing.assert_close(g, w, equal_nan=True,
                                           **({"rtol": tol["rtol"], "atol": tol["atol"]} if tol else {}))
        else:
            lower_op(entry, real)
    except Unsupported:
        return "unsupported"
    except AssertionError as err:
        pytest.fail(f"native result differs from eager: {err}\n{where}")
    except Exception as err:
        pytest.fail(f"lowering fails with {type(err).__name__}: {str(err)[:600]}\n{where}")
    return "ok"


@pytest.mark.parametrize("e", OPDEFS, ids=[f"{e.op}[{e.registry}]" for e in OPDEFS])
def test_rules_match_pytorch_on_drawn_arguments(e: OpDef) -> None:
    seen: dict[str, int] = {}

    @settings(settings.get_profile("properties"))
    @given(st.data())
    def run(data: Any) -> None:
        args = data.draw(variation(e), label="args")
        kind = check(e, args)
        seen[kind] = seen.get(kind, 0) + 1

    torch.manual_seed(0)
    run()
    # the accepting path must be reached: by a drawn variation, or else by the entry's own
    # first accepted sample (ops whose int arguments are tied to shapes, like group norm's
    # N, C, HxW, rarely draw a valid variation)
    if not seen.get("ok", 0) + seen.get("unsupported", 0):
        s = next(s for s in e.samples if not s.raises)
        kind = check(e, {a.name: s.args[a.name] if a.name in s.args else _default(a) for a in e.args})
        seen[kind] = seen.get(kind, 0) + 1
    assert seen.get("ok", 0) + seen.get("unsupported", 0) > 0, seen
