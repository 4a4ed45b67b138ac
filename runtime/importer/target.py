"""TOSA targets: a specification version, profiles, extensions and a level.

`Target.parse("TOSA-1.0+FP+INT+bf16")` names what a module must conform to. While a target is
active (`using`), the builder emits only TOSA ops and stores values in the element types the
target has (`storage`): bools are `i1`; without the int64 extension (TOSA 1.0 has none) an
int64 value is held in `i32` where its values provably fit (`bounds.py`); f64 scalars that torch
wraps become f32. `validate` attaches the target to a module (`tosa.target_env`) and runs MLIR's
`tosa-validate` with strict op-spec alignment: the profile tables of the spec are its data.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from mlir import ir

from ..errors import NotConformant
from ..lower.irutil import run_passes

PROFILES = {"FP": "pro_fp", "INT": "pro_int"}
VERSIONS = {"1.0": "1.0", "1.1": "1.1.draft"}
LEVELS = ("8k", "none")
_SYNTAX = re.compile(r"TOSA-(?P<version>\d+\.\d+)(?P<rest>(\+[A-Za-z0-9]+)+)")


@dataclass(frozen=True)
class Target:
    """What a TOSA module conforms to: `TOSA-1.0+FP`, `TOSA-1.0+FP+INT+bf16`, `TOSA-1.1+INT+int64`."""

    version: str  # "1.0" | "1.1"
    profiles: tuple[str, ...]  # "FP", "INT"
    extensions: tuple[str, ...] = ()  # "bf16", "int16", "int64", ... (MLIR's names)
    level: str = "8k"

    @classmethod
    def parse(cls, text: str | Target, level: str = "8k") -> Target:
        """A target from its name; a clear error for a malformed one."""
        if isinstance(text, Target):
            return text
        m = _SYNTAX.fullmatch(text.strip())
        if m is None or m["version"] not in VERSIONS:
            raise ValueError(f"bad TOSA target {text!r}: expected TOSA-<version>+<profile>[+...], version one of "
                             f"{sorted(VERSIONS)}, e.g. 'TOSA-1.0+FP' or 'TOSA-1.0+FP+INT+bf16'")
        parts = m["rest"].split("+")[1:]
        profiles = tuple(p for p in parts if p in PROFILES)
        extensions = tuple(p.lower() for p in parts if p not in PROFILES)
        if not profiles:
            raise ValueError(f"bad TOSA target {text!r}: name a profile, +FP and/or +INT")
        if "int64" in extensions and m["version"] == "1.0":
            raise ValueError(f"bad TOSA target {text!r}: the int64 extension is TOSA 1.1 (TOSA-1.1+...+int64)")
        if level not in LEVELS:
            raise ValueError(f"bad TOSA level {level!r}: one of {LEVELS}")
        return cls(m["version"], profiles, extensions, level)

    def __str__(self) -> str:
        return "+".join([f"TOSA-{self.version}", *self.profiles, *self.extensions])

    @property
    def narrows_int64(self) -> bool:
        """int64 values are held in i32 (no int64 extension)."""
        return "int64" not in self.extensions

    @property
    def clamp_types(self) -> tuple[str, ...]:
        """The integer element types TOSA's CLAMP takes: i8 (PRO-INT), i16 with EXT-INT16."""
        return ("i8", "i16") if "int16" in self.extensions else ("i8",)

    def storage(self, dtype: torch.dtype) -> str | None:
        """The MLIR element type of `dtype` under this target, where it differs from the native one."""
        if dtype == torch.bool:
            return "i1"
        if dtype == torch.int64 and self.narrows_int64:
            return "i32"
        if dtype == torch.float64:
            return "f32"  # only wrapped Python floats: f64 graph values are rejected (`check_dtypes`)
        return None

    def dtype_problem(self, dtype: torch.dtype) -> str | None:
        """Why a graph value of `dtype` has no TOSA type under this target, or None."""
        if dtype == torch.float64:
            return f"float64, which TOSA has no type for (target {self}); convert the model to float32 (model.float())"
        if dtype == torch.bfloat16 and "bf16" not in self.extensions:
            return f"bfloat16: add the extension, e.g. target '{self}+bf16'"
        return None

    def attach(self, module: ir.Module) -> None:
        """Attach `tosa.target_env` to the module."""
        _run(module, f"builtin.module(tosa-attach-target{{{self._options()}}})")

    def validate(self, module: ir.Module) -> None:
        """Attach the target and check every op against the spec (NotConformant naming each op)."""
        _run(module, f"builtin.module(tosa-attach-target{{{self._options()}}},"
                     "tosa-validate{strict-op-spec-alignment})", self)

    def _options(self) -> str:
        profiles = ",".join(PROFILES[p] for p in self.profiles)
        options = f"profiles={profiles} level={self.level} specification_version={VERSIONS[self.version]}"
        return options + (f" extensions={','.join(self.extensions)}" if self.extensions else "")


ATTR = "torchtosa.target"  # the target's name on a module in text (`TOSA-1.0+FP`, level `:none` if not 8k)
_ENV = "tosa.target_env"


def printable(module: ir.Module, target: Target | None) -> ir.OpView:
    """A copy of `module` whose text parses back: it names its target in `torchtosa.target` and
    keeps `tosa.target_env` only if that has extensions (MLIR 22 prints an empty list,
    `extensions = []`, that its parser rejects)."""
    with module.context:
        copy = module.operation.clone()
        if target is not None:
            copy.attributes[ATTR] = ir.StringAttr.get(str(target) + ("" if target.level == "8k" else ":none"))
            if not target.extensions and _ENV in copy.attributes:
                del copy.attributes[_ENV]
        return copy


def restore(module: ir.Module) -> Target | None:
    """The target a module read from text names (`torchtosa.target`), re-attached as its
    `tosa.target_env`; None if it names none."""
    if ATTR not in module.operation.attributes:
        return None
    name, _, level = ir.StringAttr(module.operation.attributes[ATTR]).value.partition(":")
    target = Target.parse(name, level or "8k")
    del module.operation.attributes[ATTR]
    if _ENV not in module.operation.attributes:
        target.attach(module)
    return target


def _run(module: ir.Module, pipeline: str, target: Target | None = None) -> None:
    with module.context:
        try:
            run_passes(module, pipeline)
        except ir.MLIRError as err:
            problems = [f"{_where(d.location)}: {d.message}" for d in err.error_diagnostics]
            what = f"not conformant to {target}" if target else "cannot take this TOSA target"
            found = (_LOC.fullmatch(str(d.location)) for d in err.error_diagnostics)
            names = tuple(dict.fromkeys(m["node"] for m in found if m))
            message = f"the TOSA module is {what}:\n  " + "\n  ".join(problems or [str(err)])
            raise NotConformant(message, names) from None
        except ValueError as err:  # a bad pass option (an unknown extension)
            raise ValueError(f"MLIR rejects the target options: {err}") from None


_LOC = re.compile(r'loc\("(?P<node>[^"]+)"(?:\("(?P<file>[^"]+)":(?P<line>\d+):\d+\))?\)')


def _where(loc: ir.Location) -> str:
    """`node (file:line)` from the importer's locations `loc("node"("file":line:0))`."""
    m = _LOC.fullmatch(str(loc))
    if m is None:
        return str(loc)
    return m["node"] + (f" ({m['file']}:{m['line']})" if m["file"] else "")


_ACTIVE: ContextVar[Target | None] = ContextVar("torchtosa_target", default=None)
_MEMO: ContextVar[dict] = ContextVar("torchtosa_bounds")


def active() -> Target | None:
    """The target the builder emits for, or None (the native pipeline's flavour of TOSA)."""
    return _ACTIVE.get()


@contextmanager
def using(target: Target | None) -> Iterator[None]:
    """Emit for `target` inside the block."""
    token, memo = _ACTIVE.set(target), _MEMO.set({})
    try:
        yield
    finally:
        _ACTIVE.reset(token)
        _MEMO.reset(memo)


def memo() -> dict:
    """The value bounds computed so far while emitting for the active target (`bounds.of`)."""
    return _MEMO.get()

