"""torchtosa: PyTorch → TOSA → native code, with every aten mapping declared in YAML.

    prog = torchtosa.to_tosa(fn, *example_inputs)     # TOSA MLIR (print(prog), prog.module)
    torchtosa.to_tosa(model, x, target="TOSA-1.0+FP", freeze=True)  # conformant, weights inside
    fast = torchtosa.compile(fn, *example_inputs)     # native code through the pass pipeline
    torch.compile(fn, backend="torchtosa")            # the same as a torch.compile backend
    torchtosa.explain(fn, *example_inputs)            # which ops run natively, which eagerly and why
    prog.save("model.tosa"); torchtosa.load("model.tosa")  # TOSA files (.mlir text, .tosa flatbuffer)
    prog.reference(*inputs)                           # the outputs of TOSA's reference model
    torchtosa.export_library(fn, *example_inputs, path="model.so")   # a shared library + C header
    torchtosa.vela.compile(prog)                      # Arm's Vela for Ethos-U85 on an int8 program
"""

from . import vela
from .api import CompiledFunction, compile, explain, to_tosa, torchtosa_backend
from .artifacts.tosa_files import load
from .delegate import Delegation
from .errors import (
    CompileError,
    InputMismatch,
    InternalError,
    InvalidFile,
    InvalidInput,
    LoweringError,
    MissingRuntime,
    NotConformant,
    ToolError,
    TorchTosaError,
    Unsupported,
    VelaError,
)
from .execute.library import Library, export_library
from .importer.graph import Program
from .importer.target import Target
from .regions import Explanation, FallbackWarning

__all__ = [
    "CompileError", "CompiledFunction", "Delegation", "Explanation", "FallbackWarning", "InputMismatch",
    "InternalError", "InvalidFile", "InvalidInput", "Library", "LoweringError", "MissingRuntime", "NotConformant",
    "Program", "Target", "ToolError", "TorchTosaError", "Unsupported", "VelaError", "compile", "explain",
    "export_library", "load", "to_tosa", "torchtosa_backend", "vela",
]


def _register_backend() -> None:
    """Name the backend for `torch.compile(backend="torchtosa")`, unless torch found it already: an
    installed torchtosa is also an entry point of `torch_dynamo_backends`, which torch loads (so
    imports this package) and registers itself."""
    from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend

    if "torchtosa" not in _COMPILER_FNS and "torchtosa" not in _BACKENDS:
        register_backend(torchtosa_backend, name="torchtosa")


_register_backend()
