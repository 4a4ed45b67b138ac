"""The choices a compile takes: optimization level, target CPU, what to do with ops TOSA can't run."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .cpu import select
from .lower.pipeline import check_opt

FALLBACKS = ("eager", "error")

# A native region of fewer aten ops than this, in a graph that also runs eager ops, runs
# eagerly too: each native call costs a few microseconds at the boundary (argument checks,
# output allocation, the ctypes call), about what one small eager op costs (README).
MIN_REGION_OPS = 2


@dataclass(frozen=True)
class Options:
    """`opt`: the lowering ("default", "parallel", "none"; see `pipeline.OPT_LEVELS`).
    `fallback`: "eager" runs what TOSA can't lower with PyTorch, between native regions (and a
    region torchtosa fails to compile: `InternalError`, warned about); "error" raises instead.
    `min_region_ops`: the smallest native region worth its call, in a graph that has eager ops.
    `outline`: trace a module's repeated layers (a transformer's blocks) once each while capturing
    (outline.py); a torch.compile graph arrives traced, so the backend ignores it. `cpu`: the
    entry of the CPU table (opdefs/cpus.yaml) to compile for, by default $TORCHTOSA_CPU or the
    host's; native code must run on this machine."""

    opt: str = "default"
    fallback: str = "eager"
    min_region_ops: int = MIN_REGION_OPS
    outline: bool = True
    cpu: str | None = None

    def __post_init__(self) -> None:
        check_opt(self.opt)
        if self.cpu is not None:
            select(self.cpu)  # ValueError naming the table's entries
        if self.fallback not in FALLBACKS:
            raise ValueError(f"unknown fallback {self.fallback!r}; choose one of {', '.join(map(repr, FALLBACKS))}")
        if not isinstance(self.min_region_ops, int) or self.min_region_ops < 1:
            raise ValueError(f"min_region_ops must be a positive int, got {self.min_region_ops!r}")
        if not isinstance(self.outline, bool):
            raise ValueError(f"outline must be a bool, got {self.outline!r}")

    @classmethod
    def of(cls, options: dict[str, Any] | None) -> Options:
        """Options from a dict (torch.compile's `options=`); TypeError names unknown keys."""
        options = dict(options or {})
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unknown torchtosa options {unknown}; known: {known}")
        return cls(**options)
