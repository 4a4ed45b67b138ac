"""Ethos-U side by side: torchtosa's int8 (and a16w8) TOSA and ExecuTorch's Arm backend's, both through Vela.

The five models of issue 30 (LeNet with batch norm, transformers' ResNet and MobileNetV2 of the
tests, torchvision's mobilenet_v2 at 224x224, the ViT of tests/test_models.py), each built with
the same seeded weights (`randomize`: PyTorch's default initialization, random batch norm
statistics) and calibrated on the same 4 seeded random batches by each compiler's own quantizer:
- torchtosa: `torchtosa.quantizer.quantize` (TosaQuantizer), `to_tosa(ep, target="TOSA-1.0+INT",
  freeze=True, npu=True)`;
- ExecuTorch 1.5.1's Arm backend (`make executorch` installs it in .executorch/, run in a
  subprocess with it on PYTHONPATH): its TOSAQuantizer with `get_symmetric_quantization_config()`,
  `to_edge_transform_and_lower` with its TOSAPartitioner for TOSA-1.0+INT, the `.tosa` it writes.
The CNNs again with int16 activations and int8 weights (a16w8, TOSA-1.0+INT+int16): torchtosa's
`TosaQuantizer(a16w8=True)`, ExecuTorch's `get_symmetric_a16w8_quantization_config()`.
Both files compiled by Vela 5.2.0 (`torchtosa.vela.compile`) for ethos-u85-256 with Vela's
defaults for it (Ethos_U85_SYS_DRAM_Mid, Dedicated_Sram_384KB). The table: TOSA ops (constants
not counted) and transposes of each file, the ops Vela placed on the NPU and CPU, cycles,
SRAM/DRAM used; without .executorch/ torchtosa's columns alone. Vela's numbers are estimates of
its own performance model, the same on every host.

    make ethos-u                       # or: .venv/bin/python scripts/ethos_u.py [--doc docs/vela.md]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
EXECUTORCH = ROOT / ".executorch"  # make executorch: pip install --no-deps --target .executorch ...
CALIBRATION = 4
# Quantization schemes: int8 activations and weights, int16 activations with int8 weights; each
# one's TOSA target. a16w8 is measured on A16W8_MODELS (torchtosa's ViT: softmax, layer norms
# and GELU int8, TosaQuantizer's INT8_ONLY).
SCHEMES = {"int8": "TOSA-1.0+INT", "a16w8": "TOSA-1.0+INT+int16"}
A16W8_MODELS = ("lenet_bn", "resnet", "mobilenet_v2", "vit")
ACCELERATOR = "ethos-u85-256"
BEGIN, END = "<!-- ethos_u.py: begin -->", "<!-- ethos_u.py: end -->"


def _tests() -> tuple:
    """tests/test_int8_models.py and tests/test_models.py (their builders)."""
    sys.path.insert(0, str(ROOT / "tests"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import test_int8_models
        import test_models
    return test_int8_models, test_models


def models() -> dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]]:
    """Name: (builder of the model with its seeded weights, in eval mode; input shape)."""
    t8, tm = _tests()
    import vision_models

    def int8_model(name: str) -> Callable[[], nn.Module]:
        return lambda: t8.randomize(t8.MODELS[name][0]())

    def torchvision_mobilenet() -> nn.Module:
        return t8.randomize(vision_models.import_torchvision().models.mobilenet_v2())

    return {"lenet_bn": (int8_model("lenet_bn"), (1, 1, 28, 28)),
            "resnet": (int8_model("resnet"), (1, 3, 32, 32)),
            "mobilenet_v2": (int8_model("mobilenet_v2"), (1, 3, 32, 32)),
            "torchvision mobilenet_v2": (torchvision_mobilenet, (1, 3, 224, 224)),
            "vit": (lambda: tm.instantiate("vit")[0], (1, 3, 32, 32))}


def inputs(shape: tuple[int, ...]) -> tuple[torch.Tensor, list[tuple[torch.Tensor]]]:
    """The example input and the calibration batches, seeded."""
    torch.manual_seed(0)
    return torch.randn(shape), [(torch.randn(shape),) for _ in range(CALIBRATION)]


def torchtosa_file(name: str, out: Path, scheme: str = "int8") -> Path:
    """torchtosa's TOSA file of model `name`, for an NPU, quantized as `scheme` says (SCHEMES)."""
    import torchtosa
    from torchtosa.quantizer import TosaQuantizer, quantize

    build, shape = models()[name]
    example, calibration = inputs(shape)
    ep = quantize(build(), (example,), calibration, TosaQuantizer(a16w8=scheme == "a16w8"))
    program = torchtosa.to_tosa(ep, target=SCHEMES[scheme], freeze=True, npu=True)
    path = out / "torchtosa.tosa"
    program.save(path)
    return path


def executorch_file(name: str, out: Path, scheme: str = "int8") -> Path:
    """ExecuTorch's Arm backend's TOSA file of model `name` (run with .executorch/ on PYTHONPATH)."""
    from executorch.backends.arm.quantizer import (
        TOSAQuantizer,
        get_symmetric_a16w8_quantization_config,
        get_symmetric_quantization_config,
    )
    from executorch.backends.arm.tosa.compile_spec import TosaCompileSpec
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    build, shape = models()[name]
    example, calibration = inputs(shape)
    spec = TosaCompileSpec(SCHEMES[scheme])
    quantizer = TOSAQuantizer(spec)
    quantizer.set_global(get_symmetric_a16w8_quantization_config() if scheme == "a16w8"
                         else get_symmetric_quantization_config())
    model = prepare_pt2e(torch.export.export(build(), (example,)).module(check_guards=False), quantizer)
    with torch.no_grad():
        for batch in calibration:
            model(*batch)
    ep = torch.export.export(convert_pt2e(model), (example,))
    spec.dump_intermediate_artifacts_to(str(out))
    to_edge_transform_and_lower(ep, partitioner=[TOSAPartitioner(spec)])
    files = sorted(out.glob("*.tosa"))
    if len(files) != 1:
        raise SystemExit(f"{name}: ExecuTorch wrote {len(files)} TOSA files (delegated parts): {files}")
    return files[0]


@dataclass
class Row:
    """One compiler's file of one model, as Vela sees it."""

    ops: int
    transposes: int
    npu_ops: int
    cpu_ops: int
    cycles: int
    sram: float
    dram: float

    def cells(self) -> list[str]:
        return [f"{self.ops} ({self.transposes})", f"{self.npu_ops}/{self.npu_ops + self.cpu_ops}",
                f"{self.cycles:,}", f"{self.sram:.1f}", f"{self.dram:.1f}"]


def measure(path: Path) -> Row:
    """TOSA ops and transposes of the file at `path`, and Vela's report of it."""
    from vela_report import file_ops

    from torchtosa import vela

    ops, transposes = file_ops(path)
    r = vela.compile(path, accelerator=ACCELERATOR)
    return Row(ops, transposes, len(r.npu_ops), len(r.cpu_ops), r.cycles, r.sram_used, r.dram_used)


def rows(executorch: bool) -> list[str]:
    """The table in markdown, one line per model and scheme."""
    head = "| model | input | scheme | torchtosa: TOSA ops (transposes) | NPU ops | cycles | SRAM KiB | DRAM KiB |"
    rule = "|---|---|---|---:|---:|---:|---:|---:|"
    if executorch:
        head += (" ExecuTorch: TOSA ops (transposes) | NPU ops | cycles | SRAM KiB | DRAM KiB |"
                 " cycles, torchtosa / ExecuTorch |")
        rule += "---:|---:|---:|---:|---:|---:|"
    out = [head, rule]
    runs = [(name, "int8") for name in models()] + [(name, "a16w8") for name in A16W8_MODELS]
    for name, scheme in runs:
        shape = models()[name][1]
        with tempfile.TemporaryDirectory(prefix="torchtosa-ethos-u-") as tmp:
            ours = measure(torchtosa_file(name, Path(tmp), scheme))
            cells = [name, "x".join(map(str, shape)), scheme, *ours.cells()]
            if executorch:
                theirs = measure(_in_subprocess(name, scheme, Path(tmp) / "executorch"))
                cells += [*theirs.cells(), f"{ours.cycles / theirs.cycles:.2f}"]
        out.append("| " + " | ".join(cells) + " |")
        print(out[-1], file=sys.stderr)
    return out


def _in_subprocess(name: str, scheme: str, out: Path) -> Path:
    """ExecuTorch's file of `name`, made by this script in a process with .executorch/ on its path
    (its tosa-tools and flatbuffers stay out of this one)."""
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(EXECUTORCH), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, __file__, "--executorch-file", name, scheme, str(out)], env=env,
                          capture_output=True, text=True, check=False)
    files = sorted(out.glob("*.tosa"))
    if done.returncode != 0 or len(files) != 1:
        raise SystemExit(f"{name} ({scheme}): ExecuTorch's lowering failed:\n{done.stderr[-3000:]}")
    return files[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doc", type=Path, help="write the table between the markers of this file")
    parser.add_argument("--executorch-file", nargs=3, metavar=("MODEL", "SCHEME", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.executorch_file:
            executorch_file(args.executorch_file[0], Path(args.executorch_file[2]), args.executorch_file[1])
            return 0
        executorch = (EXECUTORCH / "executorch").is_dir()
        if not executorch:
            print(f"ExecuTorch's Arm backend is not installed in {EXECUTORCH.name}/ (make executorch): "
                  "torchtosa's numbers alone", file=sys.stderr)
        table = "\n".join(rows(executorch))
    print(table)
    if args.doc is not None:
        text = args.doc.read_text()
        head, _, rest = text.partition(BEGIN)
        if END not in rest:
            raise SystemExit(f"{args.doc} has no {BEGIN} ... {END} markers")
        args.doc.write_text(f"{head}{BEGIN}\n{table}\n{END}{rest.partition(END)[2]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
