"""Which CPU native code is compiled for: an entry of the CPU table (opdefs/cpus.yaml).

`host()` is the entry this machine matches: the one whose LLVM CPU name is the host's (LLVM's own
detection, what `-mcpu=native` means) if the host has its features, else the most specific
entry of the host's arch whose features it all has. `select(name)` is what a compile uses:
`name` (the `cpu=` option), else $TORCHTOSA_CPU, else the host's. Code for the host's entry is
generated for the host itself (every feature LLVM detects); code for another entry, for that
entry's LLVM CPU only, which is how an AVX-512 host runs what an AVX2 host would.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

from .errors import TorchTosaError

ENV = "TORCHTOSA_CPU"


@dataclass(frozen=True)
class Cpu:
    """One CPU description (opdefs/cpus.yaml; the keys' meanings are documented there)."""

    name: str
    doc: str
    arch: str  # "x86_64" or "aarch64"
    llvm_cpu: str
    features: tuple[str, ...]  # /proc/cpuinfo flags its code needs
    vector_bits: int
    vector_registers: int
    fma_units: int
    l1d_kib: int
    l2_kib: int
    int8_dot: str  # "none", "avx2", "avx512bw", "avx512_vnni" or "asimddp" (lower/int8_dot.py)
    vecmath: str  # libmvec's variant: "none", "avx2" or "avx512"
    bf16_round: str  # "integer" (lower/half.py), "avx512_bf16" or "bf16": an instruction
    bf16_dot: str  # "none" or "avx512_bf16" (vdpbf16ps, lower/bf16_dot.py)
    bf16_matmul: str  # "none" or "amx" (AMX tiles, lower/amx.py)
    where: str  # "opdefs/cpus.yaml:23"

    @property
    def lanes(self) -> int:
        """f32 lanes of one vector register."""
        return self.vector_bits // 32

    @property
    def runs_here(self) -> bool:
        """Whether this machine can run code compiled for this entry."""
        return self.arch == host_arch() and set(self.features) <= host_flags()

    @property
    def native(self) -> bool:
        """Whether code for this entry is generated for the host itself (it is the host's entry)."""
        return self == host()

    def describe(self) -> str:
        """One line for reports: name, LLVM CPU, vector registers."""
        origin = "this machine" if self.native else "forced"
        return (f"{self.name} ({origin}; LLVM CPU {self.llvm_cpu}, {self.vector_registers} x {self.vector_bits}-bit "
                f"vector registers, int8 dot product: {self.int8_dot}, bf16 dot product: {self.bf16_dot}, "
                f"vector math: {self.vecmath})")


@functools.cache
def table() -> dict[str, Cpu]:
    """Every entry of the CPU table, by name."""
    try:
        from ._generated.cpus import CPUS
    except ImportError as err:
        raise TorchTosaError(f"the generated CPU table is missing: run `make gen` [{err}]") from None
    return {name: Cpu(**fields) for name, fields in CPUS.items()}


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def host_arch() -> str:
    """This machine's architecture as the table names it."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


@functools.cache
def host_flags() -> frozenset[str]:
    """The instruction set flags /proc/cpuinfo reports ("flags" on x86, "Features" on Arm)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@functools.cache
def host_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (or the platform's processor string)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "CPU part"):
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


@functools.cache
def host() -> Cpu:
    """The table's entry for this machine (see the module docstring)."""
    from .execute.toolchain import host_cpu

    usable = [c for c in table().values() if c.runs_here]
    if not usable:
        raise TorchTosaError(f"no entry of the CPU table (opdefs/cpus.yaml) runs on this {host_arch()} machine "
                             f"({host_model()}); add one for it")
    llvm_name = host_cpu()
    exact = [c for c in usable if c.llvm_cpu == llvm_name]
    return exact[0] if exact else max(usable, key=lambda c: len(c.features))


def select(name: str | None = None) -> Cpu:
    """The entry a compile targets: `name`, else $TORCHTOSA_CPU, else the host's.
    ValueError for a name the table lacks, naming the ones it has."""
    name = name or os.environ.get(ENV) or None
    if name is None:
        return host()
    cpus = table()
    if name not in cpus:
        source = "cpu" if name != os.environ.get(ENV) else ENV
        raise ValueError(f"unknown CPU {name!r} ({source}); the table (opdefs/cpus.yaml) has: {', '.join(cpus)}")
    return cpus[name]


def runnable(cpu: Cpu) -> Cpu:
    """`cpu` if this machine can run its code, else an error saying what to do instead."""
    if not cpu.runs_here:
        missing = sorted(set(cpu.features) - host_flags()) if cpu.arch == host_arch() else [cpu.arch]
        raise TorchTosaError(f"code for CPU {cpu.name!r} can't run on this machine ({host_model()}; it lacks "
                             f"{', '.join(missing)}): export it with export_library(..., cpu={cpu.name!r}) instead")
    return cpu
