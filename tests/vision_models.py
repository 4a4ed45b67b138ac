"""torchvision and timm, from `.torchvision/` of the checkout (`make test` installs them there).

They are not in the venv: PyPI's torchvision wheel is built for CUDA (the CPU one comes from
PyTorch's own index), so its C++ ops (`torchvision::nms` and the other detection ops) don't
load, registering their fake kernels fails `import torchvision`, and transformers, which imports
torchvision whenever it is installed, would fail with it. `import_torchvision` skips those
registrations (the classification, segmentation and video models use none of the ops); timm,
which imports torchvision, is imported after it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

DIRECTORY = Path(__file__).resolve().parent.parent / ".torchvision"


def import_torchvision() -> ModuleType:
    """torchvision, imported from `DIRECTORY` with its C++ ops' fake registrations skipped."""
    if "torchvision" in sys.modules:
        return sys.modules["torchvision"]
    if not (DIRECTORY / "torchvision").is_dir():
        raise ModuleNotFoundError(f"torchvision is not installed in {DIRECTORY}: run `make test` (or "
                                  "`make ethos-u`), which installs it there")
    sys.path.append(str(DIRECTORY))
    real = torch.library.register_fake

    def tolerant(op: object, func: Callable | None = None, /, *args: object, **kwargs: object) -> object:
        if not (isinstance(op, str) and op.startswith("torchvision::")):
            return real(op, func, *args, **kwargs)

        def register(f: Callable) -> Callable:
            try:
                return real(op, f, *args, **kwargs)
            except RuntimeError:  # "operator torchvision::nms does not exist"
                return f
        return register if func is None else register(func)

    torch.library.register_fake = tolerant
    try:
        import torchvision
    finally:
        torch.library.register_fake = real
    return torchvision


def import_timm() -> ModuleType:
    """timm (after torchvision, which it imports)."""
    import_torchvision()
    import timm

    return timm
