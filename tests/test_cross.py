"""Ahead of time for Arm: export_library for the CPU table's aarch64 entries cross-compiles (llc
for the entry's CPU, Debian's aarch64-linux-gnu-gcc for the glue and the link), and the library,
called by a small C program, runs under qemu-aarch64 against eager PyTorch.

`make test` installs the cross compiler and qemu (`make cross-tools`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from mlir import ir
from test_float_int8 import constant_weight_matmul
from torch import nn

from torchtosa import Unsupported, cpu
from torchtosa.api import _capture
from torchtosa.execute import library, toolchain
from torchtosa.execute.library import Library
from torchtosa.execute.native import TensorSpec
from torchtosa.importer.graph import Program, import_graph

ARM = sorted(name for name, c in cpu.table().items() if c.arch == "aarch64")
QEMU = "qemu-aarch64"
SYSROOT = "/usr/aarch64-linux-gnu"  # Debian's libc for aarch64, which the cross compiler links against


def _models() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, ...]]]:
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(8, 16, 3, groups=8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))
    with torch.no_grad():
        cnn[1].running_mean.uniform_(-0.5, 0.5)
        cnn[1].running_var.uniform_(0.5, 2.0)
    encoder = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True, activation="gelu")
    mlp = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 10), nn.Softmax(-1))
    return {"mlp": (mlp.eval(), (torch.randn(4, 24),)), "cnn": (cnn.eval(), (torch.randn(2, 3, 12, 12),)),
            "encoder": (encoder.eval(), (torch.randn(2, 6, 32),))}


MODELS = _models()
_PROGRAMS: dict[str, tuple] = {}


def _program(name: str) -> tuple:
    """The model's TOSA program and parameters (captured once for every CPU)."""
    if name not in _PROGRAMS:
        model, inputs = MODELS[name]
        captured = _capture(model, inputs, {})
        _PROGRAMS[name] = (import_graph(captured.gm), captured.params)
    return _PROGRAMS[name]


def _runner(lib: Library) -> str:
    """C source of a program that reads each input from in<i>.bin, calls the library and writes
    each output to out<i>.bin."""
    args = [f"in{i}" for i in range(len(lib.inputs))] + [f"out{i}" for i in range(len(lib.outputs))]
    sizes = [_bytes(spec) for _, spec in (*lib.inputs, *lib.outputs)]
    lines = ["#include <stdio.h>", "#include <stdlib.h>", f'#include "{lib.header.name}"',
             "static void *load(const char *path, size_t n) {",
             "  void *p = malloc(n); FILE *f = fopen(path, \"rb\");",
             "  if (!p || !f || fread(p, 1, n, f) != n) exit(2);", "  fclose(f); return p; }",
             "static void save(const char *path, const void *p, size_t n) {",
             "  FILE *f = fopen(path, \"wb\"); if (!f || fwrite(p, 1, n, f) != n) exit(3); fclose(f); }",
             "int main(void) {"]
    for i, size in enumerate(sizes):
        name = args[i]
        lines.append(f'  void *{name} = ' + (f'load("{name}.bin", {size});' if name.startswith("in")
                                               else f"malloc({size});"))
    lines.append(f"  int rc = {lib.name}_run({', '.join(args)});")
    lines += [f'  save("{name}.bin", {name}, {size});' for name, size in zip(args, sizes, strict=True)
              if name.startswith("out")]
    lines += ["  return rc;", "}"]
    return "\n".join(lines) + "\n"


def _bytes(spec) -> int:
    return max(1, torch.Size(spec.shape).numel()) * torch.empty((), dtype=spec.dtype).element_size()


def _run_under_qemu(lib: Library, inputs: tuple[torch.Tensor, ...], work: Path) -> list[torch.Tensor]:
    (work / "runner.c").write_text(_runner(lib))
    toolchain.run([toolchain.c_compiler(cpu.table()[ARM[0]]), "-std=c11", "-O2", "-Wall", "-Werror", "-o", "runner",
                   "runner.c", lib.path.name, "-Wl,-rpath,$ORIGIN"], cwd=work, what="cc (runner)")
    for i, t in enumerate(inputs):
        (work / f"in{i}.bin").write_bytes(t.contiguous().numpy().tobytes())
    done = subprocess.run([QEMU, "-L", SYSROOT, "./runner"], cwd=work, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return [torch.frombuffer(bytearray((work / f"out{i}.bin").read_bytes()), dtype=spec.dtype).reshape(spec.shape)
            for i, (_, spec) in enumerate(lib.outputs)]


def test_the_tools_are_installed() -> None:
    assert shutil.which(QEMU) and Path(SYSROOT).is_dir() and toolchain.c_compiler(cpu.table()[ARM[0]]), \
        "make cross-tools installs gcc-aarch64-linux-gnu and qemu-user"


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("entry", ARM)
def test_cross_compiled_library_matches_eager(entry: str, name: str, tmp_path: Path) -> None:
    program, params = _program(name)
    c = cpu.table()[entry]
    lib = library.build(program, params, tmp_path / f"{name}.so", name="model", cpu=c)
    elf = toolchain.run([toolchain.llvm_tool("llvm-readobj"), "--file-headers", str(lib.path)])
    assert "EM_AARCH64" in elf
    assert not any(n.startswith("libmvec") for n in lib.needs)  # no vector-math library on aarch64 entries
    model, inputs = MODELS[name]
    with torch.no_grad():
        expected = model(*inputs)
    (got,) = _run_under_qemu(lib, inputs, tmp_path)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_parallel_is_refused_for_another_architecture(tmp_path: Path) -> None:
    program, params = _program("mlp")
    with pytest.raises(Unsupported, match="opt='parallel' needs the OpenMP runtime"):
        library.build(program, params, tmp_path / "mlp.so", opt="parallel", cpu=cpu.table()[ARM[0]])


def _int8_matmul(m: int, weight: torch.Tensor) -> Program:
    """The program of `test_float_int8.constant_weight_matmul`: [1, m, K] int8 times the
    constant weight [N, K], i32 out."""
    n, k = weight.shape
    context = ir.Context()
    return Program(ir.Module.parse(constant_weight_matmul(weight, m), context=context), context,
                   [TensorSpec((1, m, k), torch.int8)], [TensorSpec((1, m, n), torch.int32)])


@pytest.mark.parametrize("entry", ARM)
def test_int8_dot_product_kernels_match_eager_under_qemu(entry: str, tmp_path: Path) -> None:
    """A constant-weight int8 matmul on the entry's int8 dot product (`sdot` on Armv8.2 with
    asimddp, lower/int8_dot.py): register tiles of 8 rows and 5 rows left over, K padded to a
    multiple of 4, 3 panels of 8 columns and a last one of 4; extreme values (-128 x -128 sums
    of 70 terms), exact in i32 as eager's int64 product."""
    m, k, n = 13, 70, 28
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (1, m, k), generator=g, dtype=torch.int8)
    weight = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    a[0, 0], weight[0] = -128, -128  # the largest product, 70 times
    c = cpu.table()[entry]
    lib = library.build(_int8_matmul(m, weight), [], tmp_path / "int8.so", name="int8", cpu=c)
    text = toolchain.run([toolchain.llvm_tool("llvm-objdump"), "-d", str(lib.path)])
    assert ("\tsdot\t" in text) == (c.int8_dot == "asimddp")
    (got,) = _run_under_qemu(lib, (a,), tmp_path)
    assert torch.equal(got, (a.long() @ weight.long().T).to(torch.int32))
