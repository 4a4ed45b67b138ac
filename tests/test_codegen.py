"""LLVM's code generation in this process (execute/codegen.py): the same machine code as the `opt`
and `llc` command lines it replaced, for every entry of the CPU table (those of another
architecture or ISA too: compiled, not run); LLVM's errors as CompileErrors; calls on several
threads at once; and the ELF reader that replaced `llvm-nm` agreeing with it."""

from __future__ import annotations

import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import torchtosa
from torchtosa import cpu as cpus
from torchtosa.errors import CompileError
from torchtosa.execute import native, toolchain
from torchtosa.lower import pipeline

TABLE = cpus.table()


def _kernel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A contraction, vector math (a libmvec call on x86) and a bf16 rounding (a runtime call
    where the CPU has no instruction for it) in one function."""
    return (torch.exp(a @ b).to(torch.bfloat16).float() + b.sum(0)).relu()


def _lowered(cpu: cpus.Cpu, opt: str = "default") -> object:
    """`_kernel`'s module lowered to the LLVM dialect for `cpu`."""
    program = torchtosa.to_tosa(_kernel, torch.randn(16, 40), torch.randn(40, 64), target=None)
    module = native._prepare(program.module, "forward", tuple(program.inputs), tuple(program.outputs))
    pipeline.lower(module, opt, cpu=cpu)
    return module


def _llvm_ir(cpu: cpus.Cpu, opt: str = "default") -> str:
    return toolchain.llvm_ir(_lowered(cpu, opt))


def _disassembly(obj: Path) -> str:
    text = subprocess.run([toolchain.llvm_tool("llvm-objdump"), "-d", "--no-show-raw-insn", str(obj)],
                          capture_output=True, text=True, check=True).stdout
    return text.split("\n", 2)[2]  # without the header line naming the file


@pytest.mark.parametrize("opt", ["default", "none"])  # LLVM's vectorizers have work at "none"
@pytest.mark.parametrize("entry", sorted(TABLE))
def test_same_code_as_opt_and_llc(entry: str, opt: str, tmp_path: Path) -> None:
    cpu = TABLE[entry]
    (tmp_path / "k.ll").write_text(_llvm_ir(cpu, opt))
    expected = _tools(tmp_path / "k.ll", tmp_path / "tools.o", cpu)
    toolchain.compile_object(tmp_path / "k.ll", tmp_path / "here.o", cpu)
    assert (tmp_path / "here.o").read_bytes() == expected
    assert "forward" in _disassembly(tmp_path / "here.o")  # a real function, not an empty object


# LLVM IR whose machine code depends on each option `compile_object` sets: straight-line code for
# the SLP vectorizer, a loop for the loop vectorizer, an external global and a jump table
# (position-independent code reads them otherwise), and long blocks for the instruction schedulers
_SLP = "\n".join(  # a[i] = b[i] * c[i] + b[i], element by element
    f"  %pb{i} = getelementptr float, ptr %b, i64 {i}\n  %vb{i} = load float, ptr %pb{i}\n"
    f"  %pc{i} = getelementptr float, ptr %c, i64 {i}\n  %vc{i} = load float, ptr %pc{i}\n"
    f"  %m{i} = fmul float %vb{i}, %vc{i}\n  %s{i} = fadd float %m{i}, %vb{i}\n"
    f"  %pa{i} = getelementptr float, ptr %a, i64 {i}\n  store float %s{i}, ptr %pa{i}" for i in range(8))
SENSITIVE_IR = f"""\
source_filename = "sample"
@g = external global float

define void @slp(ptr noalias %a, ptr noalias %b, ptr noalias %c) {{
{_SLP}
  ret void
}}

define float @global() {{
  %v = load float, ptr @g
  ret float %v
}}

define void @saxpy(ptr noalias %y, ptr noalias %x, float %s, i64 %n) {{
entry:
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%j, %loop]
  %px = getelementptr float, ptr %x, i64 %i
  %vx = load float, ptr %px
  %py = getelementptr float, ptr %y, i64 %i
  %vy = load float, ptr %py
  %m = fmul fast float %vx, %s
  %r = fadd fast float %m, %vy
  store float %r, ptr %py
  %j = add i64 %i, 1
  %c = icmp ult i64 %j, %n
  br i1 %c, label %loop, label %done
done:
  ret void
}}

define i32 @table(i32 %x, i32 %y) {{
entry:
  switch i32 %x, label %d [ i32 0, label %a0  i32 1, label %a1  i32 2, label %a2
                            i32 3, label %a3  i32 4, label %a4  i32 5, label %a5 ]
a0:
  %r0 = mul i32 %y, 3
  ret i32 %r0
a1:
  %r1 = sdiv i32 %y, 7
  ret i32 %r1
a2:
  %r2 = xor i32 %y, 12345
  ret i32 %r2
a3:
  %r3 = shl i32 %y, 5
  ret i32 %r3
a4:
  %r4 = srem i32 %y, 11
  ret i32 %r4
a5:
  %r5 = udiv i32 %y, 13
  ret i32 %r5
d:
  ret i32 0
}}
"""



def _changed(flags: tuple[str, ...], old: str, new: str) -> tuple[str, ...]:
    assert old in flags
    return tuple(new if f == old else f for f in flags)


# opt's and llc's command lines with one option changed: each changes the object file
OPT, LLC = toolchain.OPT_FLAGS, toolchain.LLC_FLAGS
VARIANTS = {
    "no SLP vectorization": ((*OPT, "-vectorize-slp=false"), LLC),
    "opt -O1": (_changed(OPT, "-O2", "-O1"), LLC),
    "llc -O0": (OPT, _changed(LLC, "-O3", "-O0")),
    "the instruction schedulers": (OPT, _changed(_changed(LLC, "-enable-misched=false", "-enable-misched=true"),
                                                 "-post-RA-scheduler=false", "-post-RA-scheduler=true")),
    "static relocation model": (OPT, _changed(LLC, "-relocation-model=pic", "-relocation-model=static")),
}


def _tools(source: Path, out: Path, cpu: cpus.Cpu, opt: tuple[str, ...] = OPT, llc: tuple[str, ...] = LLC) -> bytes:
    """The object file `opt` then `llc` make of `source` for `cpu`, with these options."""
    flags = toolchain.target_flags(cpu)
    toolchain.run([toolchain.llvm_tool("opt"), *opt, *flags, str(source), "-o", f"{out}.bc"])
    toolchain.run([toolchain.llvm_tool("llc"), *llc, *flags, f"{out}.bc", "-o", str(out)])
    return out.read_bytes()


@pytest.mark.parametrize("entry", [cpus.host().name, *sorted({c.arch: n for n, c in TABLE.items()
                                                                if c.arch != cpus.host_arch()}.values())])
def test_every_option_is_the_tools_option(entry: str, tmp_path: Path) -> None:
    cpu = TABLE[entry]
    (tmp_path / "k.ll").write_text(SENSITIVE_IR)
    expected = _tools(tmp_path / "k.ll", tmp_path / "tools.o", cpu)
    toolchain.compile_object(SENSITIVE_IR, tmp_path / "here.o", cpu)
    assert (tmp_path / "here.o").read_bytes() == expected
    for name, (opt, llc) in VARIANTS.items():  # the sample is one each option matters to
        if name == "static relocation model" and cpu.arch != "x86_64":
            continue  # AArch64 code reads globals and jump tables PC-relative either way
        assert _tools(tmp_path / "k.ll", tmp_path / "other.o", cpu, opt, llc) != expected, name


def test_threads_at_once_make_the_same_code(tmp_path: Path) -> None:
    cpu = cpus.host()
    text = _llvm_ir(cpu)
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda i: toolchain.compile_object(text, tmp_path / f"k{i}.o", cpu), range(4)))
    objects = {(tmp_path / f"k{i}.o").read_bytes() for i in range(4)}
    assert len(objects) == 1


def test_errors_name_what_failed(tmp_path: Path) -> None:
    with pytest.raises(CompileError, match=r"could not parse LLVM IR.*expected"):
        toolchain.compile_object("define void @f() { ret i32 }", tmp_path / "k.o", cpus.host())
    with pytest.raises(CompileError, match=r"could not parse broken\.ll"):
        (tmp_path / "broken.ll").write_text("this is not LLVM IR")
        toolchain.compile_object(tmp_path / "broken.ll", tmp_path / "k.o", cpus.host())
    assert not (tmp_path / "k.o").exists()


def _nm_undefined(files: list[Path]) -> set[str]:
    out = toolchain.run([toolchain.llvm_tool("llvm-nm"), *map(str, files)])
    listed = [line.split() for line in out.splitlines() if line.strip() and not line.endswith(":")]
    return {f[-1] for f in listed if len(f) == 2} - {f[-1] for f in listed if len(f) == 3}


def test_undefined_symbols_as_llvm_nm_lists_them(tmp_path: Path) -> None:
    host = cpus.host()
    (tmp_path / "objects").mkdir()
    objects = toolchain.machine_code(_llvm_ir(host), tmp_path / "objects", host)
    library = native.shared_object(native.library_ir(_lowered(host), "forward"), host, tmp_path)
    for files in (objects, [library], [*objects, library]):
        undefined = toolchain.undefined_symbols(files)
        assert undefined == _nm_undefined(files)
    assert toolchain.undefined_symbols(objects)  # vector math or memory functions at least
    (tmp_path / "k.ll").write_text("not ELF")
    with pytest.raises(CompileError, match="not an ELF file"):
        toolchain.undefined_symbols([tmp_path / "k.ll"])
