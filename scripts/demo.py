"""`make demo`: compile a small MLP block through TOSA to native code and compare with eager; save
its conformant TOSA flatbuffer (weights frozen) and run it on TOSA's reference model too."""

from __future__ import annotations

import tempfile
import timeit
from pathlib import Path

import torch
from torch import nn

import torchtosa


class MLPBlock(nn.Module):
    """Linear → GELU → LayerNorm → Linear → softmax: the ops of a transformer's MLP."""

    def __init__(self, dim: int = 64, hidden: int = 256, classes: int = 10):
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(hidden)
        self.down = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.down(self.norm(self.act(self.up(x)))), dim=-1)


def per_call(fn, x: torch.Tensor) -> float:
    """Best-of-5 mean seconds per call."""
    runs = timeit.repeat(lambda: fn(x), number=50, repeat=5)
    return min(runs) / 50


def main() -> None:
    torch.manual_seed(0)
    model = MLPBlock().eval()
    x = torch.randn(32, 64)
    with torch.no_grad():
        program = torchtosa.to_tosa(model, x)
        print("// TOSA MLIR of MLPBlock (parameters are function arguments)")
        print(program)
        print("// registry that lowered each aten op:")
        print(program.report())
        native = torchtosa.compile(model, x)
        expected, got = model(x), native(x)
        diff = (got - expected).abs().max().item()
        t_eager, t_native = per_call(model, x), per_call(native, x)
        # for deployment: the weights frozen into a conformant module, written as a TOSA
        # flatbuffer, loaded back and run on TOSA's reference model
        frozen = torchtosa.to_tosa(model, x, freeze=True)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "mlp_block.tosa"
            frozen.save(path)
            (reference,) = torchtosa.load(path).reference(x=x)
            size = path.stat().st_size
    print(f"\nmax |native - eager| = {diff:.3e}")
    print(f"time per call: eager {t_eager * 1e6:.1f} us, torchtosa native {t_native * 1e6:.1f} us "
          f"(native/eager = {t_native / t_eager:.2f}x)")
    print(f"max |TOSA reference model - eager| = {(reference - expected).abs().max().item():.3e} "
          f"({path.name}: {frozen.target}, weights frozen, {size} bytes)")
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(reference, expected)


if __name__ == "__main__":
    main()
