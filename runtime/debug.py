"""TORCHTOSA_DEBUG=<directory>: every native compile writes what it made, in a folder named by its key.

The key is what decides the code (the TOSA module, the input and output specs, the
optimization level and the CPU table's entry), so the same compile always writes to the same
folder, and a second compile of an equal graph is the same folder again:

    <key>/graph.py          the aten-level FX graph, as Python (TorchDynamo + AOTAutograd's capture)
    <key>/tosa.mlir         the TOSA module imported from it
    <key>/NN-<stage>.mlir   the module after each stage of the pass pipeline (lower/pipeline.py)
    <key>/kernel.ll         the LLVM IR compiled to native code
    <key>/compile.txt       the options, the signature and the seconds each step took
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .execute.native import TensorSpec

ENV = "TORCHTOSA_DEBUG"
_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
           torch.bool: "bool"}


def key(*parts: object) -> str:
    """A compile's key: 16 hex digits of the SHA-256 of its parts' text."""
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


class Artifacts:
    """The folder one compile writes to."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.stages = 0
        self.log: list[str] = []

    def write(self, name: str, text: str) -> None:
        (self.folder / name).write_text(text)

    def stage(self, name: str, seconds: float, module: object) -> None:
        """After a pipeline stage: the module's text, and the time the stage took."""
        self.stages += 1
        self.write(f"{self.stages:02d}-{re.sub(r'[^A-Za-z0-9_-]+', '-', name)}.mlir", str(module))
        self.note(f"{name}: {seconds:.3f} s")

    def note(self, line: str) -> None:
        self.log.append(line)
        self.write("compile.txt", "\n".join(self.log) + "\n")


def signature(specs: Sequence[TensorSpec]) -> str:
    """Tensor specs as `f32[2, 16], i64[?]`."""
    return ", ".join(f"{_DTYPES.get(s.dtype, str(s.dtype))}[{', '.join(map(str, s.shape))}]" for s in specs)


def artifacts(*parts: object) -> Artifacts | None:
    """The folder of the compile whose key `parts` make, created, if TORCHTOSA_DEBUG is set."""
    root = os.environ.get(ENV)
    if not root:
        return None
    folder = Path(root) / key(*parts)
    folder.mkdir(parents=True, exist_ok=True)
    return Artifacts(folder)
