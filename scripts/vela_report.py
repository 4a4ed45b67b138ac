"""Regenerate the table of docs/vela.md: Vela's estimates for torchtosa's int8 models.

Each model is quantized with PT2E and the XNNPACK quantizer as tests/test_quantized.py does
(`quantized`: calibrated on random data), its float input quantize and output dequantize are
stripped (`int8_edges`: int8 in, int8 out), and it is lowered with
`to_tosa(target="TOSA-1.0+INT", freeze=True)` and compiled by Vela (`torchtosa.vela.compile`) for
each accelerator and system configuration of `CONFIGS`. The rows between the markers of
docs/vela.md are replaced (`--check`: exit 1 if they would change; `--print`: print them only).

    make vela-report      # or .venv/bin/python scripts/vela_report.py (needs make vela, make tosa-tools)
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import warnings
from collections import Counter
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

import torchtosa
from torchtosa import vela

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "vela.md"
BEGIN, END = "<!-- vela_report.py: begin -->", "<!-- vela_report.py: end -->"

# (accelerator, system configuration, memory mode); None: Vela's default for the accelerator
CONFIGS = [("ethos-u85-256", None, None),
           ("ethos-u85-256", "Ethos_U85_SYS_Flash_High", "Shared_Sram"),
           ("ethos-u85-1024", None, None)]


class ConvStack(nn.Module):
    """Four convs with ReLU, 3x3 ones and 2x2 ones of stride 2: 64x64 RGB to 64 channels of 16x16.
    (A 3x3 conv of stride 2 and padding 1 on an even size would not tile its padded input, which
    TOSA's conv2d requires: the integer lowering declines it.)"""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 32, 2, stride=2),
                                    nn.Conv2d(32, 32, 3, padding=1), nn.Conv2d(32, 64, 2, stride=2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = conv(x).relu()
        return x


def _test_quantized() -> ModuleType:
    """tests/test_quantized.py, for its models and quantization helpers."""
    path = ROOT / "tests" / "test_quantized.py"
    spec = importlib.util.spec_from_file_location("torchtosa_test_quantized", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def models(tq: ModuleType) -> dict[str, tuple[nn.Module, tuple[int, ...], str]]:
    """Name: (model, input shape, what it is)."""
    torch.manual_seed(0)
    return {"mlp": (tq.MLP(), (8, 16), "Linear(16, 32)-ReLU-Linear(32, 8), batch 8"),
            "convnet": (tq.ConvNet(), (1, 3, 32, 32), "Conv2d(3, 8, 3)-BatchNorm-ReLU-Conv2d(8, 4, 3), 32x32"),
            "convstack": (ConvStack(), (1, 3, 64, 64), "4 Conv2d-ReLU (3x3, 2x2 of stride 2; 16-32-32-64 ch), 64x64")}


def rows() -> list[str]:
    """The table's rows in markdown."""
    tq = _test_quantized()
    out = []
    for name, (model, shape, about) in models(tq).items():
        ep, x = tq.quantized(model, shape)
        ep8, _ = tq.int8_edges(ep, x)
        program = torchtosa.to_tosa(ep8, target="TOSA-1.0+INT", freeze=True)
        declined = [g for g in program.groups if g.path != "integer"]
        if declined:
            raise SystemExit(f"{name}: groups kept the float path: {declined}")
        print(f"{name}: {about}", file=sys.stderr)
        for accelerator, system, memory in CONFIGS:
            r = vela.compile(program, accelerator=accelerator, system_config=system, memory_mode=memory)
            ops = ", ".join(f"{n} {k}" for k, n in sorted(Counter(r.npu_ops).items()))
            out.append(f"| {name} | {'x'.join(map(str, shape))} | {r.accelerator} | {r.system_config} | "
                       f"{r.memory_mode} | {len(r.npu_ops)}/{len(r.npu_ops) + len(r.cpu_ops)} ({ops}) | "
                       f"{r.macs:,} | {r.cycles:,} | {r.inference_time * 1e6:.2f} | {r.sram_used:.2f} | "
                       f"{r.dram_used:.2f} | {r.off_chip_flash_used + r.on_chip_flash_used:.2f} | "
                       f"{r.weights_original:,} / {r.weights_encoded:,} |")
            print(out[-1], file=sys.stderr)
    return out


HEADER = ["| model | input | accelerator | system config | memory mode | ops on NPU | MACs | cycles | "
          "inference µs | SRAM KiB | DRAM KiB | flash KiB | weights bytes (original / encoded) |",
          "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/vela.md's table would change")
    parser.add_argument("--print", action="store_true", help="print the table, leave docs/vela.md alone")
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = "\n".join([*HEADER, *rows()])
    if args.print:
        print(table)
        return 0
    text = DOC.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    if not rest or END not in rest:
        raise SystemExit(f"{DOC} has no {BEGIN} ... {END} markers")
    new = f"{head}{BEGIN}\n{table}\n{END}{tail}"
    if args.check:
        return int(new != text)
    DOC.write_text(new)
    print(f"wrote {DOC.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
