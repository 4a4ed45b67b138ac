"""The exceptions torchtosa raises: every failure a user can meet is one of these."""

from __future__ import annotations


class TorchTosaError(Exception):
    """Base class of every torchtosa error."""


class Unsupported(TorchTosaError):
    """Valid PyTorch that torchtosa cannot lower (no mapping, or a spec's `limits`)."""


class NotConformant(Unsupported):
    """A TOSA module breaks its target's profiles, extensions or level (tosa-validate)."""


class InvalidInput(TorchTosaError, ValueError):
    """Input that PyTorch rejects too (a spec's `requires` failed)."""


class InputMismatch(TorchTosaError, TypeError):
    """A compiled function was called with arguments it was not compiled for."""


class CompileError(TorchTosaError):
    """The MLIR pass pipeline or the JIT failed on a module torchtosa produced."""


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
