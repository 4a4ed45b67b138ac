"""export_library: a model as a shared library and C header, run from C (examples/) and through
ctypes, against eager PyTorch; the header's content; the clear errors."""

from __future__ import annotations

import ctypes
import importlib.util
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from torch import nn

import torchtosa
from torchtosa.execute import toolchain
from torchtosa.execute.library import Library
from torchtosa.lower import partition

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def run(lib: Library, *inputs: torch.Tensor, scratch: bool = False) -> list[torch.Tensor]:
    """Call the library's entry point through ctypes on contiguous tensors; its outputs."""
    entry = getattr(ctypes.CDLL(str(lib.path)), f"{lib.name}_run" + ("_with_scratch" if scratch else ""))
    outputs = [torch.empty(spec.shape, dtype=spec.dtype) for _, spec in lib.outputs]
    pointers = [ctypes.c_void_p(t.data_ptr()) for t in [*inputs, *outputs]]
    if scratch:
        buffer = torch.empty(max(lib.scratch_bytes, 1) + 64, dtype=torch.uint8)
        pointers.append(ctypes.c_void_p(-(-buffer.data_ptr() // 64) * 64))
    assert entry(*pointers) == 0
    return outputs


def symbols(path: Path, dynamic: bool = False) -> list[tuple[str, str]]:
    """(kind letter, name) of each symbol `llvm-nm` lists for a library."""
    out = toolchain.run([toolchain.llvm_tool("llvm-nm"), *(["-D", "--defined-only"] if dynamic else []), str(path)])
    return [(line.split()[-2], line.split()[-1]) for line in out.splitlines() if len(line.split()) >= 2]


def _example_module():
    spec = importlib.util.spec_from_file_location("export_mlp", EXAMPLES / "export_mlp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["export_mlp"] = module  # TorchDynamo looks the model's class up by its module
    spec.loader.exec_module(module)
    return module


def test_c_example_matches_eager(tmp_path: Path) -> None:
    """examples/: export_mlp.py exports the MLP, `make run` builds main.c against mlp.so and
    prints what eager PyTorch computes."""
    for name in ("Makefile", "main.c", "export_mlp.py"):
        shutil.copy2(EXAMPLES / name, tmp_path / name)  # keeps their times: mlp.so will be newer
    example = _example_module()
    example.main(str(tmp_path))  # in this process: a second torch import would double the time
    done = subprocess.run(["make", "-s", "run", "PYTHON=false", "CFLAGS=-std=c11 -O2 -Wall -Wextra -pedantic -Werror"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [lines[0], lines[5]] == ["logits [4, 5]", "probs [4, 5]"]
    with torch.no_grad():
        expected = example.build_model()(*example.example_inputs())
    for rows, key in ((lines[1:5], "logits"), (lines[6:10], "probs")):
        got = torch.tensor([[float(v) for v in row.split()] for row in rows])
        torch.testing.assert_close(got, expected[key], rtol=1e-5, atol=1e-6)

    library = tmp_path / "mlp.so"
    assert sorted(n for _, n in symbols(library, dynamic=True)) == ["mlp_run", "mlp_run_with_scratch"]
    # torch.cat's copies into slices of its result are contiguous rows (`lower.copies`): memcpy's
    assert not any(n == "memrefCopy" for _, n in symbols(library))
    needs = toolchain.needed_libraries(library)
    assert set(needs) <= {"libc.so.6", "libm.so.6", "libmvec.so.1"}, needs
    # no mutable global state of the model's own (only the C runtime's start-up files have some)
    writable = [n for kind, n in symbols(library) if kind in "dDbB" and not n.startswith("_") and n != "completed.0"]
    assert writable == []


def test_header_declares_shapes_and_dtypes(tmp_path: Path) -> None:
    """The header's macros, shapes and prototype, checked by the C compiler itself; every
    dtype crosses the C boundary as its documented type."""

    def mixed(x: torch.Tensor, mask: torch.Tensor, counts: torch.Tensor, scale: torch.Tensor):
        return (x * mask).to(torch.float16), ~mask, counts * 3, scale * 2

    x = torch.randn(3, 4).to(torch.float16)
    mask = torch.rand(3, 4) > 0.5
    counts = torch.randint(-100, 100, (4,), dtype=torch.int32)
    scale = torch.tensor(1.25, dtype=torch.float64)
    lib = torchtosa.export_library(mixed, x, mask, counts, scale, path=tmp_path / "libmixed.so", opt="none")
    assert lib.name == "mixed" and lib.header == tmp_path / "libmixed.h"
    assert [n for n, _ in lib.inputs] == ["x", "mask", "counts", "scale"]
    assert [n for n, _ in lib.outputs] == ["out0", "out1", "out2", "out3"]
    text = lib.header.read_text()
    prototype = ("int mixed_run(const uint16_t *x, const uint8_t *mask, const int32_t *counts, const double *scale, "
                 "uint16_t *out0, uint8_t *out1, int32_t *out2, double *out3);")
    assert prototype in text
    for row in (r"x\s+input 0\s+\[3, 4\]\s+float16 \(IEEE half-precision bits\)",
                r"mask\s+input 1\s+\[3, 4\]\s+bool \(one byte, 0 or 1\)",
                r"scale\s+input 3\s+\[\]\s+float64", r"out2\s+output 2\s+\[4\]\s+int32"):
        assert re.search(r"\* +" + row + "\n", text), row
    assert "/* input 3: scale, float64 [] (a scalar) */" in text
    assert "static const int64_t MIXED_X_SHAPE[2] = {3, 4};" in text
    assert "MIXED_SCALE_SHAPE" not in text  # rank 0: no array
    checks = tmp_path / "checks.c"
    checks.write_text('#include "libmixed.h"\n'
                      "_Static_assert(MIXED_NUM_INPUTS == 4 && MIXED_NUM_OUTPUTS == 4, \"counts\");\n"
                      "_Static_assert(MIXED_X_RANK == 2 && MIXED_X_DIM0 == 3 && MIXED_X_DIM1 == 4, \"x\");\n"
                      "_Static_assert(MIXED_X_NUMEL == 12 && MIXED_X_BYTES == 24, \"x size\");\n"
                      "_Static_assert(MIXED_COUNTS_NUMEL == 4 && MIXED_SCALE_RANK == 0, \"counts\");\n"
                      "_Static_assert(MIXED_SCALE_NUMEL == 1, \"scale\");\n"
                      "_Static_assert(MIXED_OUT1_BYTES == 12 && MIXED_SCRATCH_BYTES == 0 && MIXED_OK == 0, \"out1\");\n"
                      "int (*entry)(const uint16_t *, const uint8_t *, const int32_t *, const double *,\n"
                      "             uint16_t *, uint8_t *, int32_t *, double *) = mixed_run;\n"
                      "int check(void) { return (int)MIXED_X_SHAPE[1]; }\n")
    toolchain.run([toolchain.c_compiler(), "-std=c11", "-Wall", "-Wextra", "-pedantic", "-Werror", "-c",
                   "checks.c", "-o", "checks.o"], cwd=tmp_path)

    got = run(lib, x, mask, counts, scale)
    for g, e in zip(got, mixed(x, mask, counts, scale), strict=True):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def _wide_mlp() -> tuple[nn.Module, torch.Tensor]:
    # 64 x 512 x 512 multiply-adds: enough for opt="parallel" to split the matmuls across threads
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 256)).eval()
    return model, torch.randn(64, 512)


@pytest.mark.parametrize("opt", ["none", "parallel"])
def test_opt_levels(tmp_path: Path, opt: str) -> None:
    """opt="none" (buffers from malloc, no scratch) and opt="parallel" (OpenMP: the runtime is
    copied next to the library and found through its RUNPATH) match eager."""
    model, x = _wide_mlp()
    lib = torchtosa.export_library(model, x, path=tmp_path / "wide.so", opt=opt)
    needs = toolchain.needed_libraries(lib.path)
    if opt == "parallel":
        assert lib.files == (tmp_path / "libiomp5.so",) and lib.files[0].is_file()
        assert "libiomp5.so" in needs and "libiomp5.so" in lib.header.read_text()
        dynamic = toolchain.run([toolchain.llvm_tool("llvm-readobj"), "--dynamic-table", str(lib.path)])
        assert re.search(r"RUNPATH\s+Library runpath: \[\$ORIGIN\]", dynamic)
    else:
        assert lib.scratch_bytes == 0 and lib.files == ()
    assert not any("python" in n or "MLIR" in n or "torch" in n for n in needs), needs
    with torch.no_grad():
        expected = model(x)
    (got,) = run(lib, x, scratch=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_strided_copies_without_the_runner_library(tmp_path: Path) -> None:
    """opt="none" copies into slices (a cat along the last dim: each source is a strided view
    of the result) element by element with MLIR's `memrefCopy`, which the glue defines, so the
    library needs no MLIR runtime; the default lowering copies them by rows instead."""
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a * 2, b + 1], dim=-1)

    a, b = torch.randn(3, 5, 7), torch.randn(3, 5, 2)
    for opt, defined in (("none", True), ("default", False)):
        lib = torchtosa.export_library(fn, a, b, path=tmp_path / f"cat_{opt}.so", opt=opt)
        assert (("t", "memrefCopy") in symbols(lib.path)) is defined
        assert not any("MLIR" in n for n in toolchain.needed_libraries(lib.path))
        (got,) = run(lib, a, b, scratch=True)
        torch.testing.assert_close(got, fn(a, b))


def test_partitioned_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model cut into parts (its C wrapper then glue compiled without optimization, its layer
    parts one function) matches eager as a library too."""
    monkeypatch.setattr(partition, "PART_OPS", 8)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.LayerNorm(32)) for _ in range(4))).eval()
    x = torch.randn(8, 32)
    lib = torchtosa.export_library(model, x, path=tmp_path / "parts.so")
    with torch.no_grad():
        expected = model(x)
    (got,) = run(lib, x, scratch=True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    symbols = toolchain.run([toolchain.llvm_tool("llvm-nm"), str(lib.path)])
    assert "forward__part" in symbols, symbols  # it was cut into parts


_LIBRARY_THEN_JIT = """
import ctypes, sys, torch, torchtosa
x, out = torch.randn(64, 512), torch.empty(64, 512)
assert ctypes.CDLL(sys.argv[1]).wide_run(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(out.data_ptr())) == 0
model = torch.nn.Linear(512, 512).eval()
with torch.no_grad():
    torch.testing.assert_close(torchtosa.compile(model, x, opt="parallel")(x), model(x), rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_parallel_library_then_jit(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """A parallel library loaded first (with its copy of the OpenMP runtime), then JIT-compiled
    parallel code in the same process: one runtime serves both (two would abort the process)."""
    model, x = _wide_mlp()
    lib = torchtosa.export_library(model, x, path=tmp_path / "wide.so", opt="parallel")
    done = subprocess.run([sys.executable, "-c", _LIBRARY_THEN_JIT, str(lib.path)], capture_output=True, text=True,
                          timeout=300, env=subprocess_env)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_threads_and_scratch(tmp_path: Path) -> None:
    """Concurrent calls each compute their own result; a caller's scratch buffer serves every
    call; a NULL array is refused."""
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 8)).eval()
    xs = [torch.randn(16, 32) for _ in range(4)]
    lib = torchtosa.export_library(model, xs[0], path=tmp_path / "block.so")
    assert lib.scratch_bytes > 0
    with torch.no_grad():
        expected = [model(x) for x in xs]
    results: dict[int, list[torch.Tensor]] = {}

    def work(i: int) -> None:
        results[i] = [run(lib, xs[i])[0] for _ in range(50)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(4):
        for got in results[i]:
            torch.testing.assert_close(got, expected[i], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run(lib, xs[1], scratch=True)[0], expected[1], rtol=1e-5, atol=1e-5)

    so = ctypes.CDLL(str(lib.path))
    out = torch.empty(16, 8)
    assert so.block_run(None, ctypes.c_void_p(out.data_ptr())) == 1  # BLOCK_ERR_NULL
    assert so.block_run_with_scratch(ctypes.c_void_p(xs[0].data_ptr()), ctypes.c_void_p(out.data_ptr()), None) == 1


def test_exported_program(tmp_path: Path) -> None:
    """An ExportedProgram exports with its inputs' names."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh()).eval()
    x = torch.randn(2, 8)
    ep = torch.export.export(model, (x,))
    lib = torchtosa.export_library(ep, path=tmp_path / "ep.so")
    assert [n for n, _ in lib.inputs] == [ep.graph_signature.user_inputs[0]]
    with torch.no_grad():
        torch.testing.assert_close(run(lib, x)[0], model(x), rtol=1e-5, atol=1e-6)


def test_errors(tmp_path: Path) -> None:
    """An op that can't be lowered natively, a symbolic shape, a bad path or name: clear errors,
    no files written."""
    with pytest.raises(torchtosa.Unsupported, match=r"aten\._fft_r2c"):
        torchtosa.export_library(lambda x: torch.fft.rfft(x).abs(), torch.randn(8), path=tmp_path / "fft.so")

    class Scale(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    batch = torch.export.Dim("batch", min=2, max=64)
    ep = torch.export.export(Scale(), (torch.randn(4, 3),), dynamic_shapes={"x": {0: batch}})
    with pytest.raises(torchtosa.Unsupported, match=r"symbolic shape \[s\w+, 3\].*static shapes only"):
        torchtosa.export_library(ep, path=tmp_path / "dyn.so")
    with pytest.raises(ValueError, match=r"ends in \.so"):
        torchtosa.export_library(Scale(), torch.randn(2), path=tmp_path / "scale.dll")
    with pytest.raises(ValueError, match="not a C identifier"):
        torchtosa.export_library(Scale(), torch.randn(2), path=tmp_path / "scale.so", name="2x")
    assert list(tmp_path.iterdir()) == []


def test_a_library_of_amx_code_asks_for_the_tiles_when_loaded(tmp_path: Path) -> None:
    """Linux runs AMX instructions only in a process that asked for the tiles' state: a library
    whose code uses them (a bf16 product of 48 rows, for an entry with AMX) asks in a constructor,
    so a program loading it need not know; one without them has no such constructor."""
    linear = nn.Linear(256, 96, bias=False).to(torch.bfloat16).eval()
    x = torch.randn(48, 256, dtype=torch.bfloat16)
    for cpu, asks in (("sapphirerapids", True), ("x86-64-v3", False)):
        with torch.no_grad():
            lib = torchtosa.export_library(linear, x, path=tmp_path / f"lib{cpu.replace('-', '_')}.so", cpu=cpu)
        symbols = toolchain.run([toolchain.llvm_tool("llvm-nm"), str(lib.path)])
        assert ("torchtosa_request_amx" in symbols) == asks
