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
