"""torchtosa: PyTorch → TOSA → native code, with every aten mapping declared in YAML."""

from .errors import CompileError, InputMismatch, InvalidInput, LoweringError, TorchTosaError, Unsupported

__all__ = ["CompileError", "InputMismatch", "InvalidInput", "LoweringError", "TorchTosaError", "Unsupported"]
