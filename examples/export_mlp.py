"""Export a small MLP tagger as `mlp.so` + `mlp.h` for main.c: `python export_mlp.py [OUT_DIR]`.

The model takes float features and integer token ids (an embedding concatenated with the
features, then Linear → GELU → LayerNorm → Linear) and returns a dict of logits and
probabilities, so the header names its outputs `logits` and `probs`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import torchtosa

BATCH, FEATURES, VOCAB, EMBED, HIDDEN, CLASSES = 4, 16, 50, 8, 32, 5


class TaggerMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, EMBED)
        self.up = nn.Linear(FEATURES + EMBED, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)
        self.down = nn.Linear(HIDDEN, CLASSES)

    def forward(self, features: torch.Tensor, token_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.cat([features, self.embed(token_ids)], dim=-1)
        logits = self.down(self.norm(nn.functional.gelu(self.up(h))))
        return {"logits": logits, "probs": logits.softmax(-1)}


def build_model() -> TaggerMLP:
    """The model with deterministic weights."""
    torch.manual_seed(0)
    return TaggerMLP().eval()


def example_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs main.c feeds, by the same formulas (exact in float32)."""
    i = torch.arange(BATCH * FEATURES)
    features = (((i * 37) % 17 - 8).float() / 8).reshape(BATCH, FEATURES)
    token_ids = (torch.arange(BATCH) * 7 + 3) % VOCAB
    return features, token_ids


def main(out_dir: str = ".") -> None:
    lib = torchtosa.export_library(build_model(), *example_inputs(), path=Path(out_dir) / "mlp.so")
    print(f"wrote {lib.path} and {lib.header}")


if __name__ == "__main__":
    main(*sys.argv[1:])
