"""The exceptions torchtosa raises: every failure a user can meet is one of these."""

from __future__ import annotations


class TorchTosaError(Exception):
    """Base class of every torchtosa error."""


class Unsupported(TorchTosaError):
    """Valid PyTorch that torchtosa cannot lower (no mapping, or a spec's `limits`)."""


class NotConformant(Unsupported):
    """A TOSA module breaks its target's profiles, extensions or level (tosa-validate); `names`
    are the graph nodes (or parameters) whose ops broke it."""

    def __init__(self, message: str, names: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.names = names


class InvalidInput(TorchTosaError, ValueError):
    """Input that PyTorch rejects too (a spec's `requires` failed)."""


class InputMismatch(TorchTosaError, TypeError):
    """A compiled function was called with arguments it was not compiled for."""


class CompileError(TorchTosaError):
    """The MLIR pass pipeline or the JIT failed on a module torchtosa produced."""


class NotInPlace(CompileError):
    """Bufferization computed an update of an input elsewhere than in the input's buffer
    (the function is then compiled to return the new value instead)."""


class MissingRuntime(CompileError):
    """A library native code needs is not installed (opt="parallel"'s OpenMP runtime, MLIR's
    runner utils): the installation's to fix, not the program's."""


class InternalError(TorchTosaError):
    """torchtosa failed on a program PyTorch runs: its own lowering, scheduling or JIT raised
    (a bug to report). `op` and `where`: the aten op (or region) and source line it was working
    on, `stage` the step, where known; `__cause__` the original exception. With the default
    fallback="eager" the region runs with PyTorch instead, with a FallbackWarning saying so."""

    def __init__(self, detail: str, op: str | None = None, where: str | None = None,
                 stage: str | None = None) -> None:
        self.detail, self.op, self.where, self.stage = detail, op, where, stage
        super().__init__(f"torchtosa failed {self.short()}. This is a bug in torchtosa, not in your "
                         "program: please report it with this message. torchtosa.compile's default "
                         "fallback=\"eager\" runs such a region with PyTorch instead.")

    def short(self) -> str:
        """What failed in one line: `on aten.sum.dim_IntList (model.py:3: ...) in stage 'schedule': IndexError: ...`."""
        on = f"on {self.op}" + (f" ({self.where})" if self.where else "") if self.op else "compiling"
        stage = f" in {self.stage}" if self.stage else ""
        return f"{on}{stage}: {self.detail}"


class LoweringError(TorchTosaError):
    """A lowering emitted TOSA that breaks the catalogue's rules: a bug in a spec."""


class ToolError(TorchTosaError):
    """A program of tosa-tools (tosa-opt, the TOSA reference model) is missing or failed."""


class InvalidFile(TorchTosaError, ValueError):
    """A file torchtosa can't save to or load: not `.mlir`/`.tosa`, or not a TOSA program."""


class VelaError(ToolError):
    """Arm's Vela is missing, failed, or rejected a network; `ops`: the ops it could not place."""

    def __init__(self, message: str, ops: list[str] | None = None) -> None:
        super().__init__(message)
        self.ops = ops or []
