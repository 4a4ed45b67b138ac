"""The CPU table (opdefs/cpus.yaml) and what is derived from it.

The schedule is checked for every entry: planned for all of them, compiled and run for those
this machine runs, compiled only (LLVM for the entry's CPU) for the others. Code for a forced
entry uses that entry's registers only, whatever the host has.
"""

from __future__ import annotations

import math
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from test_generator import check_message, write
from test_library import run

import torchtosa
from generator.cpus import INT8_DOT, load_cpus
from generator.source import SpecError
from torchtosa import cpu as cpus
from torchtosa.execute import native, toolchain
from torchtosa.lower import int8_dot, pipeline
from torchtosa.lower.tiles import MAX_ROWS, derive

ROOT = Path(__file__).resolve().parent.parent
TABLE = cpus.table()
RUNNABLE_X86 = sorted(name for name, c in TABLE.items() if c.arch == "x86_64" and c.runs_here)


def _matmul_exp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.tanh(a @ b)) + b.sum(0)


def _lowered(cpu: cpus.Cpu, fn: Any = _matmul_exp, args: tuple[torch.Tensor, ...] | None = None
             ) -> tuple[torchtosa.Program, object]:
    """`fn`'s TOSA program (`_matmul_exp` of a 16 x 40 and a 40 x 64 matrix unless said), and its
    module lowered to the LLVM dialect for `cpu`."""
    args = args or (torch.randn(16, 40), torch.randn(40, 64))
    program = torchtosa.to_tosa(fn, *args, target=None)
    module = native._prepare(program.module, "forward", tuple(program.inputs), tuple(program.outputs))
    pipeline.lower(module, "default", cpu=cpu)
    return program, module


def _llc(cpu: cpus.Cpu, module: object, folder: Path, filetype: str) -> Path:
    """`module` compiled by llc -O3 for `cpu`'s triple and LLVM CPU: an object file or assembly."""
    (folder / "k.ll").write_text(toolchain.llvm_ir(module))
    out = folder / ("k.o" if filetype == "obj" else "k.s")
    toolchain.run([toolchain.llvm_tool("llc"), "-O3", f"-mtriple={toolchain.TRIPLES[cpu.arch]}",
                   f"-mcpu={cpu.llvm_cpu}", f"-filetype={filetype}", str(folder / "k.ll"), "-o", str(out)])
    return out


def _disassembly(obj: Path) -> str:
    return subprocess.run([toolchain.llvm_tool("llvm-objdump"), "-d", "--no-show-raw-insn", str(obj)],
                          capture_output=True, text=True, check=True).stdout


def test_host_entry_runs_here() -> None:
    host = cpus.host()
    assert host.runs_here and host.native and host.arch == cpus.host_arch()
    assert all(c.runs_here for c in TABLE.values() if set(c.features) <= set(host.features) and c.arch == host.arch)


def test_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpus.ENV, raising=False)
    assert cpus.select() == cpus.host()
    monkeypatch.setenv(cpus.ENV, "neoverse-n1")
    assert cpus.select().name == "neoverse-n1" and cpus.select("zen4").name == "zen4"
    monkeypatch.setenv(cpus.ENV, "pentium")
    with pytest.raises(ValueError, match=r"unknown CPU 'pentium' \(TORCHTOSA_CPU\).*x86-64-v3"):
        cpus.select()
    with pytest.raises(ValueError, match="unknown CPU 'i486' \\(cpu\\)"):
        torchtosa.compile(torch.relu, cpu="i486")


def test_an_entry_this_machine_cannot_run_is_refused() -> None:
    arm = TABLE["neoverse-n1"] if cpus.host_arch() == "x86_64" else TABLE["x86-64-v3"]
    with pytest.raises(torchtosa.TorchTosaError, match=r"can.t run on this machine.*export_library"):
        torchtosa.compile(torch.relu, torch.randn(3), cpu=arm.name)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_register_tiles_fit_the_register_file(name: str) -> None:
    """Accumulators, the loaded row of columns and a broadcast fit the vector registers, the
    accumulators in three quarters of them; every width is whole vectors, a convolution's and a
    depthwise one's a power of two of them, of the contraction's rows."""
    c, t = TABLE[name], derive(TABLE[name])
    rows, columns = t.matmul
    vectors = columns // c.lanes
    assert columns % c.lanes == 0 and t.vector % c.lanes == 0 and t.transpose == c.lanes
    assert rows * vectors + vectors + 1 <= c.vector_registers and rows * vectors <= c.vector_registers * 3 // 4
    assert rows <= MAX_ROWS
    for tile in (t.convolution, t.depthwise):
        assert tile[0] == rows and tile[1] % c.lanes == 0 and (tile[1] // c.lanes).bit_count() == 1
        assert tile[1] <= columns < 2 * tile[1]


def test_register_tiles_are_the_known_kernels() -> None:
    """The rule gives the register tiles of the libraries measured against: MKL's AVX-512 sgemm
    kernel (8 x 48) and BLIS's Haswell one (6 x 16); NEON's two vectors of columns (8 x 8)."""
    by_registers = {(c.vector_registers, c.lanes): derive(c).matmul for c in TABLE.values()}
    assert by_registers[32, 16] == (8, 48) and by_registers[16, 8] == (6, 16) and by_registers[32, 4] == (8, 8)


@pytest.mark.parametrize("name", RUNNABLE_X86)
def test_forced_entry_uses_only_its_registers(name: str, tmp_path: Path) -> None:
    """Code for an entry this machine runs holds no wider register than the entry's and matches
    eager (another entry than the host's is compiled by llc for its CPU and loaded, the host's by
    the JIT). Entries it can't run: `test_every_entry_compiles`."""
    c = TABLE[name]
    a, b = torch.randn(16, 40), torch.randn(40, 64)
    torch.testing.assert_close(torchtosa.compile(_matmul_exp, a, b, cpu=name)(a, b), _matmul_exp(a, b),
                               rtol=1e-5, atol=1e-5)
    if c.native:
        return  # the JIT's, for the host: every register it has
    _, module = _lowered(c)
    asm = _disassembly(native.shared_object(native.library_ir(module, "forward"), c, tmp_path))
    assert ("%zmm" in asm) == (c.vector_bits == 512)  # its widest registers, and none wider
    assert c.vector_bits == 512 or "%ymm" in asm


def test_forced_int64_topk_matches_eager() -> None:
    """AVX2 code JIT-compiled within the host's (AVX-512) target machine got this wrong; code
    for a forced entry is compiled by llc for that entry's CPU instead."""
    x = torch.tensor([[-76, 39, -67, -120, 43, 99], [-53, -17, 97, -117, -19, 26]])
    for name in RUNNABLE_X86:
        values, indices = torchtosa.compile(torch.topk, x, 2, dim=0, cpu=name)(x, 2, dim=0)
        assert torch.equal(values, torch.topk(x, 2, dim=0).values) and torch.equal(indices, x.topk(2, 0).indices)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_exp_below_underflow_is_zero_for_every_runnable_entry(dtype: torch.dtype) -> None:
    """libmvec's exp on lanes below `vecmath.FLUSHED_BELOW` (a causal mask's -inf) is set to
    +0.0 around the call: the bound is where exp rounds to 0, those lanes are exactly 0, the
    subnormal results just above the bound are libmvec's (within its 4 ulp), special values are
    exp's, for every entry this host runs (37 lanes: whole registers and a padded tail)."""
    from torchtosa.lower.vecmath import FLUSHED_BELOW
    floor = FLUSHED_BELOW[("exp", torch.finfo(dtype).bits)]
    # the bound is where exp rounds to +0.0 in the dtype: below it 0, a unit above it not
    bound = torch.tensor([math.exp(floor), math.exp(floor + 1)], dtype=torch.float64).to(dtype)
    assert bound[0] == 0 < bound[1]
    edge = [float("-inf"), float("inf"), float("nan"), -1e30, floor - 1, floor - 1e-3, floor + 0.05, floor + 0.5,
            floor + 1, -87.5, -20.0, 0.0, 1.5, 88.0, 700.0]
    x = torch.cat([torch.tensor(edge, dtype=dtype), torch.randn(37 - len(edge), dtype=dtype) * 50])
    want = torch.exp(x.double()).to(dtype)  # correctly rounded but for a double rounding
    tiny = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    for name in RUNNABLE_X86:
        got = torchtosa.compile(torch.exp, x, cpu=name)(x)
        assert torch.equal(got.isnan(), want.isnan()), name
        assert (got[x < floor] == 0).all(), name
        torch.testing.assert_close(got, want, rtol=4 * torch.finfo(dtype).eps, atol=4 * tiny, equal_nan=True)


def _bf16_roundings(x: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.to(torch.bfloat16), d.to(torch.bfloat16), torch.maximum(x.to(torch.bfloat16), d.to(torch.bfloat16)) * 3


def test_bfloat16_roundings_run_for_every_runnable_entry(tmp_path: Path) -> None:
    """Without AVX512-BF16, LLVM calls `__truncsfbf2` / `__truncdfbf2` for f32/f64 -> bfloat16,
    which GCC's runtime lacks before GCC 13: a library of such code failed to load (every bf16
    sample of `make test-avx2`). torchtosa compiles its own (`toolchain.BUILTINS`), for f64 only:
    an entry without the instruction rounds f32 in vectors of integers (`half.round_bf16_in_integers`;
    one call per element took 6% of a bf16 Llama's decoding step). Bits equal to PyTorch's, NaN
    and infinities included; and export_library links (it forbids undefined symbols) and runs."""
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.3895e38, 1e-40, 1.00390625,
                             1.005859375])
    x = torch.cat([torch.randn(4096) * torch.exp(torch.randn(4096) * 10), specials])
    d = x.double() * (1 + 2.0 ** -40)  # not f32 values: rounded twice, as PyTorch does
    want = _bf16_roundings(x, d)
    normal = x.abs() >= torch.finfo(torch.float32).tiny
    for name in RUNNABLE_X86:
        got = torchtosa.compile(_bf16_roundings, x, d, cpu=name)(x, d)
        # AVX512-BF16's vcvtneps2bf16 flushes a subnormal f32 to zero (PyTorch rounds it)
        compared = normal if "avx512_bf16" in TABLE[name].features else torch.ones_like(normal)
        assert all(_same_bits(g[compared], w[compared]) for g, w in zip(got, want, strict=True)), name
    library = torchtosa.export_library(_bf16_roundings, x, d, path=tmp_path / "libbf16.so", cpu="x86-64-v3")
    assert "__truncsfbf2" not in toolchain.undefined_symbols([library.path])
    only_f32 = torchtosa.export_library(lambda x: x.to(torch.bfloat16) * 3, x, path=tmp_path / "libf32.so",
                                        cpu="x86-64-v3")
    assert "__truncsfbf2" not in toolchain.run([toolchain.llvm_tool("llvm-nm"), str(only_f32.path)])  # no call
    assert _same_bits(run(only_f32, x)[0], x.to(torch.bfloat16) * 3)
    assert all(_same_bits(g, w) for g, w in zip(run(library, x, d), want, strict=True))


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bits, but any NaN for a NaN (PyTorch's own conversions give 0x7fc0 or 0xffff)."""
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])


@pytest.mark.parametrize("name", sorted(TABLE))
def test_every_entry_compiles(name: str, tmp_path: Path) -> None:
    """Every entry's code goes through LLVM for its CPU (and triple): schedule, vector math and
    instruction selection hold for targets this machine can't run."""
    c = TABLE[name]
    _, module = _lowered(c)
    obj = _llc(c, module, tmp_path, "obj")
    asm, calls = _disassembly(obj), toolchain.undefined_symbols([obj])
    assert ("_ZGVeN16v_expf" in calls, "_ZGVdN8v_expf" in calls) == (c.vecmath == "avx512", c.vecmath == "avx2")
    if c.arch == "x86_64":
        assert ("%zmm" in asm) == (c.vector_bits == 512)
    else:
        assert "fmla" in asm and not any(s.startswith("_ZGV") for s in calls)


@pytest.mark.parametrize("name", sorted(TABLE))
def test_register_tiles_do_not_spill(name: str, tmp_path: Path) -> None:
    """The loop of a matmul's register tile (llc's assembly for the entry's CPU) neither spills
    nor reloads a register: the tile's accumulators, its loaded columns and a broadcast fit the
    register file as `tiles.derive` counts them (an 8 x 16 tile on AVX2 spilled in that loop)."""
    c = TABLE[name]
    # whole tiles of 6 and 8 rows, 16, 48 and 8 columns (AVX2, AVX-512, NEON)
    _, module = _lowered(c, torch.mm, (torch.randn(96, 256), torch.randn(256, 144)))
    blocks: dict[str, list[str]] = {}
    label = ""
    for line in _llc(c, module, tmp_path, "asm").read_text().splitlines():
        if re.match(r"^[.\w]+:", line):
            label = line.split(":")[0]
        blocks.setdefault(label, []).append(line)
    tile_loops = [lines for lines in blocks.values() if sum(("vfmadd" in x or "fmla" in x) for x in lines) >= 8]
    assert tile_loops, "no register tile's loop found"
    assert not [x for lines in tile_loops for x in lines if "Spill" in x or "Reload" in x]


def test_every_int8_dot_product_the_table_allows_has_a_kernel() -> None:
    """The generator's choices of `int8_dot` and lower/int8_dot.py's instructions are one set."""
    assert set(INT8_DOT) - {"none"} == set(int8_dot.DOTS)


def test_the_table_renders_deterministically() -> None:
    from generator.render import render_cpus

    entries = load_cpus(ROOT / "opdefs" / "cpus.yaml")
    assert render_cpus(entries, "opdefs/cpus.yaml") == render_cpus(load_cpus(ROOT / "opdefs" / "cpus.yaml"),
                                                                   "opdefs/cpus.yaml")
    assert {e.name for e in entries} == set(TABLE)


BASE = """\
base-avx2:
  doc: an AVX2 entry
  arch: x86_64
  llvm_cpu: x86-64-v3
  features: [avx, avx2, fma]
  vector: {bits: 256, registers: 16}
  fma_units: 2
  cache: {l1d: 32, l2: 256}
  int8_dot: none
  vecmath: avx2
  bf16_round: integer
  bf16_dot: none
  bf16_matmul: none
refined:
  doc: a refinement
  base: base-avx2
  features: [avx512f]
  vector: {bits: 512, registers: 32}
  vecmath: avx512
"""

# (test id, [(old text of BASE, new text)], words the message must hold); `‸` marks where it points
CPU_MISTAKES = [
    ("unknown-key", [("  fma_units: 2\n", "  ‸fma_unit: 2\n")], "unknown key 'fma_unit'", "did you mean 'fma_units'"),
    ("unknown-feature", [("[avx512f]", "[‸avx512]")], "'avx512' is not an x86_64 feature", "did you mean 'avx512f'"),
    ("unknown-base", [("  base: base-avx2", "  base: ‸base-avx")], "unknown base 'base-avx'",
     "did you mean 'base-avx2'"),
    ("vecmath-needs-features", [("[avx512f]", "[]"), ("  vecmath: avx512", "  vecmath: ‸avx512")],
     "vecmath 'avx512' needs the features ['avx512f']"),
    ("vnni-needs-features", [("  int8_dot: none", "  int8_dot: ‸avx512_vnni")], "int8_dot 'avx512_vnni' needs"),
    ("vpmaddwd-needs-features", [("  int8_dot: none", "  int8_dot: ‸avx512bw")],
     "int8_dot 'avx512bw' needs the features ['avx512bw']"),
    ("bf16-needs-features", [("  bf16_round: integer", "  bf16_round: ‸avx512_bf16")],
     "bf16_round 'avx512_bf16' needs the features ['avx512_bf16']"),
    ("bf16-dot-needs-features", [("  bf16_dot: none", "  bf16_dot: ‸avx512_bf16")],
     "bf16_dot 'avx512_bf16' needs the features ['avx512_bf16']"),
    ("amx-needs-features", [("  bf16_matmul: none", "  bf16_matmul: ‸amx")],
     "bf16_matmul 'amx' needs the features ['amx_bf16', 'amx_tile']"),
    ("bf16-of-another-arch", [("  bf16_round: integer", "  bf16_round: ‸bf16")], "bf16_round 'bf16' on x86_64"),
    ("vector-bits", [("{bits: 512, registers: 32}", "{bits: 384, registers: 32}"), ("refined:", "‸refined:")],
     "vector bits 384"),
    ("missing-key", [("  cache: {l1d: 32, l2: 256}\n", ""), ("base-avx2:\n", "‸base-avx2:\n")], "lacks cache"),
]


@pytest.mark.parametrize(("case", "edits", "hints"), [(m[0], m[1], m[2:]) for m in CPU_MISTAKES],
                         ids=[m[0] for m in CPU_MISTAKES])
def test_table_mistakes_point_at_their_place(case: str, edits: list[tuple[str, str]], hints: tuple[str, ...],
                                             tmp_path: Path) -> None:
    marked = BASE
    for old, new in edits:
        assert marked.count(old) == 1, old
        marked = marked.replace(old, new)
    path = tmp_path / "cpus.yaml"
    line, col = write(path, marked)
    with pytest.raises(SpecError) as err:
        load_cpus(path)
    check_message(str(err.value), path, line, col, *hints)


def test_a_base_cycle_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "cpus.yaml"
    path.write_text(BASE.replace("refined:\n  doc: a refinement\n  base: base-avx2",
                                 "refined:\n  doc: a refinement\n  base: refined"))
    with pytest.raises(SpecError, match="is its own base"):
        load_cpus(path)


def test_explain_names_the_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpus.ENV, raising=False)
    x = torch.randn(4, 8)
    forced = RUNNABLE_X86[0]
    assert f"native code for {forced} (" in str(torchtosa.compile(torch.tanh, x, cpu=forced).explain())
    assert f"native code for {cpus.host().name} (this machine" in str(torchtosa.compile(torch.tanh, x).explain())
