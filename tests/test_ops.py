"""One test per sample of every opdefs entry: shape/dtype rules against FakeTensor,
numerics of the native code against eager, rejection of bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from generator.spec import OpDef, Sample, load_specs
from torchtosa import InvalidInput, Unsupported
from torchtosa.importer import rules as R
from torchtosa.importer.registry import registry
from torchtosa.importer.tosa import storage_layout
from torchtosa.testing import assert_within, rounded_once, run_op

ROOT = Path(__file__).resolve().parent.parent
# Ops whose result values torch leaves unspecified: only shapes and dtypes are compared.
UNSPECIFIED_VALUES = {"aten.empty.memory_format", "aten.empty_permuted.default", "aten.empty_strided.default"}
CASES = [(e, s) for e in load_specs(ROOT / "opdefs")[1] for s in e.samples]
IDS = [f"{e.op}[{e.registry}]-{s.where.rsplit('/', 1)[-1]}" + (f"-{s.dtype}" if s.dtype else "") for e, s in CASES]
DTYPES = {name: getattr(R, name + "_" if name == "bool" else name) for name in
          ("f16", "bf16", "f32", "f64", "i8", "i16", "i32", "i64", "u8", "bool")}


class Desc:
    """What the rules see of a tensor: shape, rank, dtype (and whether it is a wrapped number, and
    its storage layout, as runtime.tosa.Tensor)."""

    def __init__(self, t: torch.Tensor | float, wrapped: bool = False):
        if wrapped:
            t = torch.tensor(t)
        self.shape, self.dtype, self.wrapped = tuple(t.shape), t.dtype, wrapped
        self.layout = None if wrapped else storage_layout(t)

    @property
    def rank(self) -> int:
        return len(self.shape)


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], rng: tuple[float, float] | None) -> torch.Tensor:
    """Random data, never all zeros: normal floats, small ints (non-negative for uint8), coin-flip bools."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape).bool()
    ints = (0, 10) if dtype == torch.uint8 else (-10, 10)
    lo, hi = rng if rng else ((-4.0, 4.0) if dtype.is_floating_point else ints)
    if dtype.is_floating_point:
        data = torch.rand(shape, dtype=torch.float64) * (hi - lo) + lo if rng else torch.randn(shape) * 2
        return data.to(dtype)
    return torch.randint(int(lo), int(hi), shape, dtype=dtype)


def make_args(e: OpDef, s: Sample) -> list[Any]:
    def make(v: Any, name: str) -> Any:
        if isinstance(v, tuple) and v and v[0] == "tensor":
            rng = s.range.get(name) if isinstance(s.range, dict) else s.range
            return random_tensor(DTYPES[v[1]], v[2], rng)
        if isinstance(v, tuple) and v and v[0] == "dtype":
            return DTYPES[v[1]]
        if isinstance(v, list):
            return [make(x, name) for x in v]
        return v

    args = [make(s.args[a.name], a.name) if a.name in s.args else a.default for a in e.args]
    return sort_args(e, args)


def sort_args(e: OpDef, args: list[Any]) -> list[Any]:
    """The entry's `sorted` tensor arguments sorted along their last dim (torch requires it)."""
    return [torch.sort(v).values if a.name in e.sorted and isinstance(v, torch.Tensor) and v.dim() > 0 else v
            for a, v in zip(e.args, args, strict=True)]


def entry_for(e: OpDef):
    return next(x for x in registry()[e.op] if x.registry == e.registry)


def call_torch(e: OpDef, args: list[Any]) -> list[torch.Tensor]:
    """Call the overload itself (aten or prims): positional arguments, then keyword-only ones."""
    ns, name, overload = e.op.split(".")
    op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    schema = op._schema.arguments
    pos = [a for a, s in zip(args, schema, strict=True) if not s.kwarg_only]
    kw = {s.name: a for a, s in zip(args, schema, strict=True) if s.kwarg_only}
    out = op(*pos, **kw)
    return list(out) if isinstance(out, (tuple, list)) else [out]


def check_results(e: OpDef, s: Sample, got: list[torch.Tensor], args: list[Any]) -> None:
    """Results against the entry's oracle: eager (`assert_matches_eager`), or for an entry with
    `oracle: exact` its f16/bf16 results against the op on f64 rounded once, within the bound of
    an f32 sum (`torchtosa.testing.rounded_once`): eager's low-precision kernels of such ops differ
    from one CPU to another. Zero-element results (saved statistics) have no TOSA value under a
    target: where fewer results came back, those are not compared."""
    if e.oracle == "eager":
        expected = [(x, None) for x in call_torch(e, args)]
    else:
        expected = rounded_once(lambda *a: call_torch(e, list(a)), args)
    if len(got) != len(expected):
        expected = [(x, bound) for x, bound in expected if x.numel()]
    assert len(got) == len(expected)
    for i, (g, (x, bound)) in enumerate(zip(got, expected, strict=True)):
        if bound is None:
            assert_matches_eager(e, s, [g], [x])
        else:
            assert_within(g, x, bound, f"result {i} of {e.op} ({s.where})")


def describe(e: OpDef, args: list[Any]) -> list[Any]:
    """Arguments as the rules see them; numbers in Tensor slots become wrapped numbers."""
    out = []
    for a, arg in zip(args, e.args, strict=True):
        if isinstance(a, torch.Tensor):
            out.append(Desc(a))
        elif arg.kind == "tensor" and isinstance(a, bool | int | float):
            out.append(Desc(a, wrapped=True))
        elif isinstance(a, list):
            out.append([Desc(x) if isinstance(x, torch.Tensor) else x for x in a])
        else:
            out.append(a)
    return out


def fake_results(e: OpDef, args: list[Any]) -> list[torch.Tensor]:
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else
                 [mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in a] if isinstance(a, list)
                 else a for a in args]
        return call_torch(e, fakes)


@pytest.mark.parametrize(("e", "s"), CASES, ids=IDS)
def test_shape_and_dtype_rules_match_pytorch(e: OpDef, s: Sample) -> None:
    args = make_args(e, s)
    if s.raises:
        with pytest.raises(InvalidInput, match=s.raises):
            entry_for(e).fn(None, *describe(e, args))
        with pytest.raises(Exception):  # noqa: B017 - torch rejects it too, with its own error type
            fake_results(e, args)
            call_torch(e, args)  # some value checks (e.g. overflow of a fill value) run in eager only
        return
    if s.unsupported:
        with pytest.raises(Unsupported, match=s.unsupported):
            entry_for(e).fn(None, *describe(e, args))
        return
    types = entry_for(e).fn(None, *describe(e, args))
    expected = [(tuple(t.shape), t.dtype) for t in fake_results(e, args)]
    assert types == expected


@pytest.mark.parametrize(("e", "s"), [c for c in CASES if not (c[1].raises or c[1].unsupported)],
                         ids=[i for i, c in zip(IDS, CASES, strict=True) if not (c[1].raises or c[1].unsupported)])
def test_native_matches_eager(e: OpDef, s: Sample) -> None:
    args = make_args(e, s)
    check_results(e, s, run_op(entry_for(e), args), args)


def assert_matches_eager(e: OpDef, s: Sample, got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    """Native results against eager at the sample's (or entry's) tolerance; only shapes and
    dtypes for ops whose values torch leaves unspecified."""
    tol = s.tolerance or e.tolerance or {}
    assert len(got) == len(expected)
    for g, x in zip(got, expected, strict=True):
        if e.op in UNSPECIFIED_VALUES:
            assert (g.shape, g.dtype) == (x.shape, x.dtype)
            continue
        torch.testing.assert_close(g, x, equal_nan=True, **({"rtol": tol["rtol"], "atol": tol["atol"]} if tol else {}))
