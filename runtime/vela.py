"""Arm's Ethos-U compiler Vela, run as a subprocess on a TOSA flatbuffer (docs/vela.md).

    report = torchtosa.vela.compile(program)              # a Program (saved as .tosa) or a .tosa path
    report.cycles, report.npu_ops, report.cpu_ops          # Vela's estimate and op placement

Vela (PyPI `ethos-u-vela`) reads `.tosa` files of the integer profile (`TOSA-1.0+INT`: int8
activations, a frozen PT2E-quantized model without its float edges) for Ethos-U85. It lives in
a venv of its own, `.vela/` of the checkout (`make vela`), as it pins its own numpy and
flatbuffers; `$TORCHTOSA_VELA` names another `vela` program, else `vela` on PATH is used.
Vela writes the compiled network (`<name>_vela.tflite`) and `<name>_summary_<system>.csv` (cycles,
inference time, memory used) to its output directory; which ops it placed on the NPU and which
on the CPU it prints (`--show-cpu-operations`).
"""

from __future__ import annotations

import csv
import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .artifacts import tosa_tools
from .errors import VelaError

if TYPE_CHECKING:
    from .importer.graph import Program

ENV = "TORCHTOSA_VELA"
VERSION = "5.2.0"  # the ethos-u-vela release `make vela` installs (keep in step with the Makefile)
ACCELERATOR = "ethos-u85-256"
CONFIG = "Arm/vela.ini"  # Vela's own file of system configurations and memory modes
TIMEOUT = 600.0  # seconds Vela may run

# "NPU operators = 4 (100.0%)", and with --show-cpu-operations one line per op:
# "   NPU: Conv2D = layer_10 (outputs [1, 8, 8, 8])"
_COUNT = re.compile(r"^(CPU|NPU) operators = (\d+)", re.MULTILINE)
_OP = re.compile(r"^\s*(CPU|NPU): (\S+) = ", re.MULTILINE)
# a rejected file: "Compilation failed: Validation error:" then per op "MatMul:" and " - reason" lines
_FAILED = re.compile(r"Compilation failed: (.*)", re.DOTALL)
_REJECTED_OP = re.compile(r"^(\w+):\s*$", re.MULTILINE)


@dataclass(frozen=True)
class VelaReport:
    """What Vela estimates for one network on one accelerator (its summary CSV and op placement).

    Memory sizes are KiB; `inference_time` is seconds at the accelerator's clock; `npu_ops` and
    `cpu_ops` are Vela's op kinds ("Conv2D", "Rescale", ...) after its own rewrites, one per op."""

    network: str
    accelerator: str  # as Vela names it: "Ethos_U85_256"
    system_config: str
    memory_mode: str
    cycles: int  # cycles_total: the inference's estimated cycles
    npu_cycles: int
    inference_time: float
    macs: int
    sram_used: float
    dram_used: float
    on_chip_flash_used: float
    off_chip_flash_used: float
    weights_original: int  # bytes of weights before and after Vela's encoding
    weights_encoded: int
    npu_ops: list[str] = field(default_factory=list)
    cpu_ops: list[str] = field(default_factory=list)
    output: Path | None = None  # the compiled network Vela wrote (None: a temporary directory)

    @property
    def all_on_npu(self) -> bool:
        """Every op placed on the NPU (and at least one op)."""
        return bool(self.npu_ops) and not self.cpu_ops

    def summary(self) -> str:
        """A few lines for a person: placement, cycles and time, memory."""

        def kinds(ops: list[str]) -> str:
            counts = Counter(ops)
            return f" ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))})" if ops else ""

        return "\n".join([
            f"Vela: {self.network} on {self.accelerator} ({self.system_config}, {self.memory_mode})",
            f"ops: {len(self.npu_ops)} on the NPU{kinds(self.npu_ops)}, {len(self.cpu_ops)} on the CPU"
            f"{kinds(self.cpu_ops)}",
            f"cycles: {self.cycles:,} (NPU {self.npu_cycles:,}), inference time {self.inference_time * 1e6:.2f} us, "
            f"{self.macs:,} MACs",
            f"memory: SRAM {self.sram_used:.2f} KiB, DRAM {self.dram_used:.2f} KiB, flash "
            f"{self.on_chip_flash_used + self.off_chip_flash_used:.2f} KiB; weights {self.weights_original:,} bytes, "
            f"{self.weights_encoded:,} encoded"])


def executable() -> Path:
    """The `vela` program: `$TORCHTOSA_VELA`, else `.vela/bin/vela` of this checkout, else `vela`
    on PATH; VelaError saying how to install it if there is none."""
    configured = os.environ.get(ENV)
    local = Path(__file__).resolve().parent.parent / ".vela" / "bin" / "vela"
    for path in ([Path(configured)] if configured else [local, shutil.which("vela")]):
        if path is not None and Path(path).is_file() and os.access(path, os.X_OK):
            return Path(path)
    where = f"{ENV}={configured} is not an executable" if configured else f"neither {local} nor `vela` on PATH exists"
    raise VelaError(f"Arm's Vela is not installed ({where}): run `make vela` in the torchtosa checkout (a venv "
                    f"with ethos-u-vela=={VERSION} in .vela/), or set {ENV} to a vela program")


def compile(network: Program | str | os.PathLike[str], *, accelerator: str = ACCELERATOR,
            output_dir: str | os.PathLike[str] | None = None, system_config: str | None = None,
            memory_mode: str | None = None, options: Sequence[str] = (), timeout: float = TIMEOUT,
            npu: bool = True) -> VelaReport:
    """Compile `network` (a Program, saved as a TOSA flatbuffer named after it, or a `.tosa`
    file) with Vela for `accelerator` (`--accelerator-config`), and read its report.

    `output_dir` keeps what Vela writes (the compiled `<name>_vela.tflite`, the summary CSV)
    and a Program's `.tosa` file; None uses a temporary directory. `system_config` and
    `memory_mode` are sections of Vela's `Arm/vela.ini` ("Ethos_U85_SYS_Flash_High",
    "Shared_Sram"; Vela's defaults for the accelerator if both are None: for Ethos-U85
    Ethos_U85_SYS_DRAM_Mid, Dedicated_Sram_384KB); `options` are more arguments for Vela.
    With `npu` (the default) a Program is compiled as `to_tosa(..., npu=True)` would have made it
    (a copy, its integer linear layers as 1x1 convolutions, whose weights Vela encodes: the same
    results); a `.tosa` file is compiled as it is.
    VelaError if Vela is missing, fails or rejects the network (its message and `.ops`, the ops
    it could not place)."""
    program = executable()
    if isinstance(network, str | os.PathLike) and not (Path(network).suffix == ".tosa" and Path(network).is_file()):
        raise VelaError(f"Vela reads TOSA flatbuffers: {network} is not a .tosa file")
    with tempfile.TemporaryDirectory(prefix="torchtosa-vela-") as tmp:
        out = Path(output_dir) if output_dir is not None else Path(tmp) / "out"
        out.mkdir(parents=True, exist_ok=True)
        if isinstance(network, str | os.PathLike):
            source = Path(network)
        else:
            source = out / f"{network.name}.tosa"
            (_for_npu(network) if npu else network).save(source)
        command = [str(program), str(source), "--accelerator-config", accelerator, "--output-dir", str(out),
                   "--show-cpu-operations"]
        if system_config or memory_mode:  # Vela takes them from a config file, and then needs both
            command += ["--config", CONFIG, "--system-config", system_config or _default(accelerator, "system"),
                        "--memory-mode", memory_mode or _default(accelerator, "memory")]
        command += list(options)
        for stale in out.glob(f"{source.stem}_summary_*.csv"):  # of an earlier run, maybe another system
            stale.unlink()
        done = _run(command, timeout)
        summaries = sorted(out.glob(f"{source.stem}_summary_*.csv"))
        if len(summaries) != 1:
            raise VelaError(f"Vela wrote {len(summaries)} summaries for {source.name} in {out}: {shlex.join(command)}\n"
                            + tosa_tools.tail(done.stdout + done.stderr))
        compiled = out / f"{source.stem}_vela.tflite"
        return report(summaries[0], done.stdout,
                      compiled if output_dir is not None and compiled.is_file() else None)


def _for_npu(program: Program) -> Program:
    """A copy of `program` rewritten for an NPU (`api.for_npu`)."""
    from .api import for_npu

    with program.context:
        copy = dataclasses.replace(program, module=program.module.operation.clone())
    for_npu(copy)
    return copy


def _default(accelerator: str, kind: str) -> str:
    """Vela's default system configuration or memory mode for an accelerator (architecture_features.py of 5.2.0)."""
    family = accelerator.split("-")[1]  # "u85"
    defaults = {"u55": ("Ethos_U55_High_End_Embedded", "Shared_Sram"),
                "u65": ("Ethos_U65_Client_Server", "Dedicated_Sram_384KB"),
                "u85": ("Ethos_U85_SYS_DRAM_Mid", "Dedicated_Sram_384KB")}
    if family not in defaults:
        raise VelaError(f"unknown accelerator {accelerator!r}: Vela's are ethos-u55-*, ethos-u65-*, ethos-u85-*")
    return defaults[family][0 if kind == "system" else 1]


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run Vela; VelaError with its message (and the ops it rejected) if it fails."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, errors="replace", timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise VelaError(f"vela did not finish within {timeout:.0f} s: {shlex.join(command)}") from None
    except OSError as err:
        raise VelaError(f"vela could not run ({err}): {shlex.join(command)}") from None
    if done.returncode == 0:
        return done
    text = done.stderr + done.stdout
    failed = _FAILED.search(text)
    if failed:  # Vela's own diagnosis, without the Python traceback before it
        ops = list(dict.fromkeys(_REJECTED_OP.findall(failed[1])))
        raise VelaError(f"Vela rejected {Path(command[1]).name} for {command[3]}"
                        + (f" (ops it can't place: {', '.join(ops)})" if ops else "")
                        + f": {failed[1].strip()}", ops=ops)
    raise VelaError(f"vela failed ({tosa_tools.exit_status(done.returncode)}): {shlex.join(command)}\n"
                    + tosa_tools.tail(text))


def report(summary: str | os.PathLike[str], printed: str = "", output: Path | None = None) -> VelaReport:
    """The VelaReport of a summary CSV Vela wrote, with the op placement from what it printed
    (`--show-cpu-operations`). VelaError if the CSV lacks a column."""
    with open(summary, newline="") as f:
        rows = list(csv.DictReader(f))
    if len(rows) != 1:
        raise VelaError(f"{summary}: expected one network's row in Vela's summary, found {len(rows)}")
    row = rows[0]
    ops = {kind: [m[2] for m in _OP.finditer(printed) if m[1] == kind] for kind in ("NPU", "CPU")}
    counts = {m[1]: int(m[2]) for m in _COUNT.finditer(printed)}
    for kind, listed in ops.items():  # each op listed: the counts Vela printed agree
        if kind in counts and counts[kind] != len(listed):
            raise VelaError(f"Vela printed {counts[kind]} {kind} operators but listed {len(listed)}")
    try:
        return VelaReport(
            network=row["network"], accelerator=row["accelerator_configuration"],
            system_config=row["system_config"], memory_mode=row["memory_mode"],
            cycles=round(float(row["cycles_total"])), npu_cycles=round(float(row["cycles_npu"])),
            inference_time=float(row["inference_time"]), macs=round(float(row["nn_macs"])),
            sram_used=float(row["sram_memory_used"]), dram_used=float(row["dram_memory_used"]),
            on_chip_flash_used=float(row["on_chip_flash_memory_used"]),
            off_chip_flash_used=float(row["off_chip_flash_memory_used"]),
            weights_original=round(float(row["total_original_weights"])),
            weights_encoded=round(float(row["total_npu_encoded_weights"])),
            npu_ops=ops["NPU"], cpu_ops=ops["CPU"], output=output)
    except (KeyError, ValueError) as err:
        raise VelaError(f"{summary}: Vela's summary has no number for {err}") from None
