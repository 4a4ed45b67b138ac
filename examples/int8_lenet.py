"""A LeNet quantized with PT2E to int8, as a TOSA-1.0+INT flatbuffer, checked on TOSA's
reference model and compiled by Arm's Vela for the Ethos-U85 (`make vela` installs it).

    python int8_lenet.py [OUT_DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import torchtosa
from torchtosa.quantizer import quantize


class LeNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 5), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(256, 120), nn.ReLU(), nn.Linear(120, 84),
                                        nn.ReLU(), nn.Linear(84, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def main(out: Path) -> None:
    torch.manual_seed(0)
    model = LeNet().eval()
    x = torch.randn(1, 1, 28, 28)
    calibration = [(torch.randn(1, 1, 28, 28),) for _ in range(16)]
    ep = quantize(model, (x,), calibration)  # PT2E with torchtosa's TosaQuantizer
    program = torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True)
    print(program.report())
    program.save(out / "lenet_int8.tosa")
    print(f"wrote {out / 'lenet_int8.tosa'} ({(out / 'lenet_int8.tosa').stat().st_size:,} bytes)")

    (qin,), (qout,) = program.input_quantization, program.output_quantization
    (q,) = program.reference(qin.quantize(x))  # int8 in, int8 out, on TOSA's reference model
    logits = qout.dequantize(q)
    steps = ((logits - ep.module()(x)) / qout.scale).abs().round().int()
    print(f"reference model: logits {[round(v, 3) for v in logits[0].tolist()]}")
    print(f"  {int((steps == 0).sum())} of {steps.numel()} equal to PyTorch's quantized model, "
          f"at most {int(steps.max())} quantum off; float model's argmax {int(model(x).argmax())}, "
          f"int8 argmax {int(logits.argmax())}")
    report = torchtosa.vela.compile(program, accelerator="ethos-u85-256", output_dir=out / "vela")
    print(report.summary())


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("."))
