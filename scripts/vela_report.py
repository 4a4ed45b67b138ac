"""Regenerate the table of docs/vela.md: Vela's estimates for torchtosa's int8 models.

The models of tests/test_int8_models.py (the MLP, LeNet with batch norm, transformers' ResNet
and MobileNetV2, their builders imported from the tests) and a stack of four convs are
quantized with torchtosa's TosaQuantizer (`torchtosa.quantizer.quantize`: PT2E, calibrated on 4
seeded random batches), lowered with `to_tosa(ep, target="TOSA-1.0+INT", freeze=True, npu=True)`
(int8 in, int8 out: the float input quantize and output dequantize are stripped by to_tosa;
linear layers as 1x1 convolutions), its TOSA ops and transposes counted in the flatbuffer, and
compiled by Vela (`torchtosa.vela.compile`) for each accelerator and system configuration of
`CONFIGS`.
The rows between the markers of docs/vela.md are replaced (`--check`: exit 1 if they would
change; `--print`: print them only).

    make vela-report      # or .venv/bin/python scripts/vela_report.py (needs make vela, make tosa-tools)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

import torchtosa
from torchtosa import vela
from torchtosa.quantizer import quantize

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "vela.md"
BEGIN, END = "<!-- vela_report.py: begin -->", "<!-- vela_report.py: end -->"
CALIBRATION = 4  # random batches the observers see

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


def _int8_tests() -> ModuleType:
    """tests/test_int8_models.py (its model builders, and `randomize` of the tests it imports)."""
    sys.path.insert(0, str(ROOT / "tests"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import test_int8_models
    return test_int8_models


def models(t8: ModuleType) -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], str]]:
    """Name: (builder of the model, input shape, what it is)."""
    build = {name: entry[0] for name, entry in t8.MODELS.items()}
    return {"mlp": (build["mlp"], (8, 16), "Linear(16, 32)-ReLU-Linear(32, 32)-ReLU-Linear(32, 8), batch 8"),
            "lenet_bn": (build["lenet_bn"], (1, 1, 28, 28), "LeNet-5, BatchNorm after each conv, 28x28"),
            "resnet": (build["resnet"], (1, 3, 32, 32), "transformers ResNet (basic, 16-32 ch), mean-pooled"),
            "mobilenet_v2": (build["mobilenet_v2"], (1, 3, 32, 32), "transformers MobileNetV2 (x0.35), mean-pooled"),
            "convstack": (ConvStack, (1, 3, 64, 64), "4 Conv2d-ReLU (3x3, 2x2 of stride 2; 16-32-32-64 ch), 64x64")}


def program_of(t8: ModuleType, build: Callable[[], nn.Module], shape: tuple[int, ...]) -> torchtosa.Program:
    """The model (`randomize`d: PyTorch's seeded default initialization, random batch norm
    statistics) quantized with TosaQuantizer on seeded random calibration, as `TOSA-1.0+INT` for
    an NPU."""
    model = t8.randomize(build())
    torch.manual_seed(0)
    ep = quantize(model, (torch.randn(shape),), [(torch.randn(shape),) for _ in range(CALIBRATION)])
    return torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True, npu=True)


def tosa_ops(program: torchtosa.Program) -> tuple[int, int]:
    """The operators of the program's flatbuffer (not its constants) and its transposes."""
    with tempfile.TemporaryDirectory() as tmp:
        program.save(Path(tmp) / "model.tosa")
        return file_ops(Path(tmp) / "model.tosa")


def file_ops(path: Path) -> tuple[int, int]:
    """The operators of a TOSA flatbuffer (not its constants) and its transposes."""
    loaded = torchtosa.load(path)
    with loaded.context:
        names = [op.operation.name for f in loaded.module.body.operations
                 for op in f.regions[0].blocks[0].operations]
    ops = [n for n in names if n.startswith("tosa.") and n not in ("tosa.const", "tosa.const_shape")]
    return len(ops), ops.count("tosa.transpose")


def rows() -> list[str]:
    """The table's rows in markdown."""
    t8 = _int8_tests()
    out = []
    for name, (build, shape, about) in models(t8).items():
        program = program_of(t8, build, shape)
        declined = [g for g in program.groups if g.path != "integer"]
        if declined:
            raise SystemExit(f"{name}: groups kept the float path: {declined}")
        print(f"{name}: {about}; {len(program.groups)} integer groups", file=sys.stderr)
        count, transposes = tosa_ops(program)
        for accelerator, system, memory in CONFIGS:
            r = vela.compile(program, accelerator=accelerator, system_config=system, memory_mode=memory)
            kinds = Counter(r.npu_ops)
            ops = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            out.append(f"| {name} | {'x'.join(map(str, shape))} | {count} ({transposes}) | {r.accelerator} | "
                       f"{r.system_config} | {r.memory_mode} | {len(r.npu_ops)}/{len(r.npu_ops) + len(r.cpu_ops)} "
                       f"({ops}) | "
                       f"{kinds['Transpose'] + Counter(r.cpu_ops)['Transpose']} | "
                       f"{r.macs:,} | {r.cycles:,} | {r.inference_time * 1e6:.2f} | {r.sram_used:.2f} | "
                       f"{r.dram_used:.2f} | {r.off_chip_flash_used + r.on_chip_flash_used:.2f} | "
                       f"{r.weights_original:,} / {r.weights_encoded:,} |")
            print(out[-1], file=sys.stderr)
    return out


HEADER = ["| model | input | TOSA ops (transposes) | accelerator | system config | memory mode | ops on NPU | "
          "transposes | MACs | cycles | inference µs | SRAM KiB | DRAM KiB | flash KiB | "
          "weights bytes (original / encoded) |",
          "|---|---|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]


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
