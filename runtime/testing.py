"""Lower and run one aten op from its registry entry: what the per-op tests use."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from .execute.native import NativeFunction, TensorSpec
from .importer import target
from .importer.graph import Program, build_function
from .importer.registry import Entry
from .importer.target import Target
from .importer.tosa import Builder, Tensor, storage_layout


def _tensors(args: list[Any]) -> list[torch.Tensor]:
    out = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out.extend(x for x in a if isinstance(x, torch.Tensor))
    return out


def _schema(entry: Entry) -> torch.FunctionSchema:
    ns, name, overload = entry.op.split(".")
    return getattr(getattr(getattr(torch.ops, ns), name), overload)._schema


def lower_op(entry: Entry, args: list[Any], aim: Target | None = None) -> Program:
    """A module whose function takes the tensors among `args` and applies the entry to them;
    for a TOSA target `aim`, one validated for it (else Unsupported or NotConformant)."""
    if aim is not None:
        with target.using(aim):
            program = lower_op(entry, args)
        aim.validate(program.module)
        program.target = aim
        return program
    tensors = _tensors(args)
    specs = [TensorSpec(tuple(t.shape), t.dtype) for t in tensors]

    def body(values: list[Tensor]) -> list[Tensor]:
        by_id = {id(t): dataclasses.replace(v, layout=storage_layout(t)) for t, v in zip(tensors, values, strict=True)}

        def bind(a: Any) -> Any:
            if isinstance(a, torch.Tensor):
                return by_id[id(a)]
            if isinstance(a, (list, tuple)):
                return [bind(x) for x in a]
            return a

        b = Builder(entry.where)
        schema = _schema(entry).arguments
        bound = [b.argument(bind(a), s) for a, s in zip(args, schema, strict=True)]
        # under a target a zero-element result (batch norm's saved statistics) has no TOSA value
        return [r for r in entry.fn(b, *bound) if r.value is not None]

    return build_function("forward", specs, body)


def run_op(entry: Entry, args: list[Any]) -> list[torch.Tensor]:
    """Compile the entry for these arguments and run it natively."""
    program = lower_op(entry, args)
    return NativeFunction(program.module, program.inputs, program.outputs)(*_tensors(args))


LOW_PRECISION = (torch.float16, torch.bfloat16)
_F32_UNIT = 2.0**-24  # unit roundoff of f32, in which native code sums low-precision products


def _upcast(a: Any, f: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return f(a) if a.dtype in LOW_PRECISION else a
    if isinstance(a, (list, tuple)):
        return type(a)(_upcast(x, f) for x in a)
    return a


def rounded_once(op: Any, args: list[Any]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each result of `op(*args)` computed exactly, for f16/bf16 results: (the op on the arguments'
    values in f64, rounded once to the result's dtype; the bound on how far a result computed with
    f32 sums may be from it), else (eager's result, None).

    What eager computes in f16/bf16 can depend on the CPU (oneDNN's convolutions round partial
    sums to the low-precision type without AVX512-BF16), so it is no oracle there. For a sum of
    products (a convolution, a matmul), an f32 sum of K terms is within K u |terms| of the exact
    one (u = 2^-24; |terms| is the op on the arguments' absolute values, K is bounded by the
    largest argument's size), and rounding it once to the dtype adds at most one ulp: the bound is
    eps(dtype) |exact| + K u |terms|.
    """
    eager = op(*args)
    eager = list(eager) if isinstance(eager, (tuple, list)) else [eager]
    if not any(isinstance(r, torch.Tensor) and r.dtype in LOW_PRECISION for r in eager):
        return [(r, None) for r in eager]
    exact = op(*_upcast(args, lambda t: t.double()))
    magnitude = op(*_upcast(args, lambda t: t.double().abs()))
    exact, magnitude = ([x] if isinstance(x, torch.Tensor) else list(x) for x in (exact, magnitude))
    terms = max((t.numel() for t in _tensors(args)), default=1)
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    for r, e, m in zip(eager, exact, magnitude, strict=True):
        if not (isinstance(r, torch.Tensor) and r.dtype in LOW_PRECISION):
            out.append((r, None))
            continue
        rounded = e.to(r.dtype)
        bound = torch.finfo(r.dtype).eps * rounded.double().abs() + terms * _F32_UNIT * m
        out.append((rounded, bound))
    return out


def assert_within(got: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str = "result") -> None:
    """`got` has `expected`'s shape and dtype and is within `bound` of it everywhere (NaN where it is NaN)."""
    assert (got.shape, got.dtype) == (expected.shape, expected.dtype), \
        f"{what}: {tuple(got.shape)} {got.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
    g, x = got.double(), expected.double()
    ok = ((g - x).abs() <= bound) | (g.isnan() & x.isnan()) | (g == x)
    if not bool(ok.all()):
        bad = (~ok).nonzero()[0].tolist()
        worst = ((g - x).abs() - bound).nan_to_num(float("inf")).max().item()
        raise AssertionError(f"{what}: {int((~ok).sum())} of {ok.numel()} elements are further from the exact "
                             f"result rounded once than the bound (by up to {worst:.3g}); first at {bad}: "
                             f"got {g[tuple(bad)].item()}, expected {x[tuple(bad)].item()}, "
                             f"bound {bound[tuple(bad)].item():.3g}")
