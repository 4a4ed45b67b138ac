"""int8 matmul/conv2d computed as exact f32 contractions (runtime/lower/float_int8.py) or on an
int8 dot-product instruction (runtime/lower/int8_dot.py: vpdpbusd, vpmaddwd): bit for bit the
reference lowering's i32 results (opt="none"), for odd sizes, reductions longer than the 1024
products f32 sums exactly (split into chunks), the largest products, constant weights reshaped
or transposed, and zero points (taken apart first by zero_points.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from mlir import ir

from torchtosa.cpu import Cpu, host_arch, select, table
from torchtosa.execute import toolchain
from torchtosa.execute.native import NativeFunction, TensorSpec, _prepare, library_ir, shared_object
from torchtosa.lower import int8_dot, pipeline
from torchtosa.lower.float_int8 import EXACT_TERMS, fast_int8_contractions
from torchtosa.lower.zero_points import separate_zero_points

I8, I32 = torch.int8, torch.int32


def int8_values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random int8 values, half of them at the extremes (-128, -127, 127): large odd products,
    whose sums past 2^24 f32 would round."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(-128, 128, shape, generator=g)
    extremes = torch.tensor([-128, -127, 127])[torch.randint(0, 3, shape, generator=g)]
    return torch.where(torch.rand(shape, generator=g) < 0.5, extremes, values).to(I8)


def aligned_values(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Odd values near -128: every product is odd and at least 123^2, so a sum of more than
    1024 of them passes 2^24 (where f32 holds even integers only) and f32 would round it."""
    g = torch.Generator().manual_seed(seed)
    return torch.tensor([-127, -125, -123])[torch.randint(0, 3, shape, generator=g)].to(I8)


def dense(t: torch.Tensor) -> str:
    """An MLIR dense attribute holding `t`'s bytes."""
    return f'dense<"0x{t.contiguous().numpy().tobytes().hex().upper()}">'


def ttype(shape: tuple[int, ...], element: str) -> str:
    return f"tensor<{'x'.join(map(str, shape))}x{element}>"


def zp(name: str, value: int) -> str:
    return f'%{name} = "tosa.const"() {{values = dense<{value}> : tensor<1xi8>}} : () -> tensor<1xi8>'


def constant_weight_matmul(w: torch.Tensor, m: int, za: int = 0) -> str:
    """TOSA: an int8 [1, m, K] input (zero point `za`) times the constant int8 weight `w` [N, K]
    transposed and reshaped, as a frozen nn.Linear's; i32 out."""
    n, k = w.shape
    a_t, out_t = ttype((1, m, k), "i8"), ttype((1, m, n), "i32")
    return f"""
    func.func @forward(%a: {a_t}) -> {out_t} {{
      {zp("za", za)}
      {zp("zb", 0)}
      %w = "tosa.const"() {{values = {dense(w)} : {ttype((n, k), "i8")}}} : () -> {ttype((n, k), "i8")}
      %t = tosa.transpose %w {{perms = array<i32: 1, 0>}} : ({ttype((n, k), "i8")}) -> {ttype((k, n), "i8")}
      %s = tosa.const_shape {{values = dense<[1, {k}, {n}]> : tensor<3xindex>}} : () -> !tosa.shape<3>
      %b = tosa.reshape %t, %s : ({ttype((k, n), "i8")}, !tosa.shape<3>) -> {ttype((1, k, n), "i8")}
      %r = tosa.matmul %a, %b, %za, %zb : ({a_t}, {ttype((1, k, n), "i8")}, tensor<1xi8>, tensor<1xi8>) -> {out_t}
      return %r : {out_t}
    }}"""


def compile_all(src: str, inputs: list[TensorSpec], outputs: list[TensorSpec],
                cpu: Cpu | None = None) -> list[NativeFunction]:
    with ir.Context():
        module = ir.Module.parse(src)
        return [NativeFunction(module, inputs, outputs, opt=opt, cpu=cpu) for opt in ("none", "default", "parallel")]


def rewritten(src: str, cpu: Cpu | None = None) -> str:
    """The module after zero_points.py and float_int8.py."""
    with ir.Context():
        module = ir.Module.parse(src)
        separate_zero_points(module)
        fast_int8_contractions(module, cpu or select())
        return str(module)


def entry(dot: str) -> Cpu:
    """A CPU entry whose int8 dot product is `dot` ("none": x86-64-v3 without its vpmaddwd, exact
    f32 chunks), one this machine runs if there is one: each instruction's kernels are run where
    the host can, else compiled for it only (llc), so every path is checked on every host."""
    if dot == "none":
        return dataclasses.replace(table()["x86-64-v3"], int8_dot="none")
    found = [c for c in table().values() if c.int8_dot == dot]
    wider = [dataclasses.replace(c, int8_dot=dot) for c in table().values() if c.int8_dot == EVEX_FORM.get(dot)]
    return next((c for c in found + wider if c.runs_here), found[0])


# AVX-VNNI's vpdpbusd (VEX) is AVX512-VNNI's 256-bit form: an AVX512-VNNI host runs its kernels
# so (EVEX-encoded, the same results); the VEX encoding is test_machine_code_has_the_instruction's
EVEX_FORM = {"avx_vnni": "avx512_vnni"}


DOTS = ["none", *int8_dot.DOTS]


def checked_on(src: str, inputs: list[TensorSpec], outputs: list[TensorSpec], cpu: Cpu,
               work: Path) -> list[NativeFunction]:
    """The module compiled at every opt level for `cpu` if this machine runs it (else compiled by
    llc only, and linked if `cpu` is of this machine's architecture: no function to call; an
    aarch64 entry's kernels run under qemu in test_cross.py)."""
    if cpu.runs_here:
        return compile_all(src, inputs, outputs, cpu)
    with ir.Context():
        module = _prepare(ir.Module.parse(src), "forward", tuple(inputs), tuple(outputs))
        pipeline.lower(module, "default", cpu=cpu)
        if cpu.arch == host_arch():
            assert shared_object(library_ir(module, "forward"), cpu, work).is_file()
        else:
            assert all(o.is_file() for o in toolchain.machine_code(toolchain.llvm_ir(module), work, cpu))
    return []


MATMULS = [  # batch, m, k, n
    (1, 7, 13, 5),
    (2, 9, 1024, 33),     # the most terms in one f32 chunk
    (1, 5, 1025, 3),      # one term over: two chunks
    (1, 11, 2049, 37),    # three chunks
    (3, 1, 1100, 1),
]


@pytest.mark.parametrize("batch,m,k,n", MATMULS)
@pytest.mark.parametrize("zero_points", [(0, 0), (-3, 0), (5, -7)])
def test_matmul_is_exact(batch: int, m: int, k: int, n: int, zero_points: tuple[int, int]) -> None:
    a_t, b_t, out_t = ttype((batch, m, k), "i8"), ttype((batch, k, n), "i8"), ttype((batch, m, n), "i32")
    za, zb = zero_points
    src = f"""
    func.func @forward(%a: {a_t}, %b: {b_t}) -> {out_t} {{
      {zp("za", za)}
      {zp("zb", zb)}
      %r = tosa.matmul %a, %b, %za, %zb : ({a_t}, {b_t}, tensor<1xi8>, tensor<1xi8>) -> {out_t}
      return %r : {out_t}
    }}"""
    chunks = -(-k // EXACT_TERMS)
    assert rewritten(src).count("tosa.matmul") == chunks
    assert "xi8>, tensor<1xi8>, tensor<1xi8>) -> " not in rewritten(src)  # no int8 matmul left
    values = aligned_values if k > EXACT_TERMS and zero_points == (0, 0) else int8_values
    a, b = values((batch, m, k), 1), values((batch, k, n), 2)
    expected = torch.bmm(a.long() - za, b.long() - zb).to(I32)
    fns = compile_all(src, [TensorSpec((batch, m, k), I8), TensorSpec((batch, k, n), I8)],
                      [TensorSpec((batch, m, n), I32)])
    outs = [f(a, b)[0] for f in fns]
    for out in outs:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("m,k,n", [
    (6, 1030, 35), (64, 300, 19),  # N not a whole number of vectors: f32
    (9, 1030, 48), (64, 512, 64), (3, 7, 16), (17, 2049, 96), (8, 4, 32),  # whole vectors: the kernels
    (13, 301, 24), (5, 2, 8),  # vpmaddwd's 8 columns, not VNNI's 16; k odd (a group of 2 padded)
])
@pytest.mark.parametrize("za", [-128, 0, 37])
@pytest.mark.parametrize("dot", DOTS)
def test_matmul_constant_weight_is_exact(m: int, k: int, n: int, za: int, dot: str, tmp_path: Path) -> None:
    """nn.Linear's frozen weight: a constant [N, K] transposed and reshaped. With an int8 dot
    product and whole vectors of columns, `int8_dot.kernel` (rows left over from the register
    tile's, a last panel of one vector, K padded to a multiple of the instruction's group);
    otherwise an f32 constant in the layout the matmul reads. No int8 constant is left either way."""
    w = (aligned_values if k > EXACT_TERMS else int8_values)((n, k), 3)
    src = constant_weight_matmul(w, m, za)
    target = entry(dot)
    kernel = int8_dot.for_cpu(target)
    lowered = rewritten(src, target)
    assert f"() -> {ttype((n, k), 'i8')}" not in lowered and "tosa.transpose" not in lowered
    assert (f"torchtosa_{dot}_" in lowered) == (kernel is not None and n % kernel.lanes == 0)
    a = (aligned_values if k > EXACT_TERMS else int8_values)((1, m, k), 4)
    expected = ((a.long() - za) @ w.long().T).to(I32)
    fns = checked_on(src, [TensorSpec((1, m, k), I8)], [TensorSpec((1, m, n), I32)], target, tmp_path)
    for f in fns:
        assert torch.equal(f(a)[0], expected)


MNEMONICS = {"avx512_vnni": ("\tvpdpbusd\t", "%zmm"), "avx_vnni": ("{vex}\tvpdpbusd\t", "%ymm"),
             "avx512bw": ("\tvpmaddwd\t", "%zmm"), "avx2": ("\tvpmaddwd\t", "%ymm"),
             "asimddp": ("\tsdot\t", "v")}


@pytest.mark.parametrize("dot", list(int8_dot.DOTS))
def test_machine_code_has_the_instruction(dot: str, tmp_path: Path) -> None:
    """Each table entry's int8 kernels are its instruction at its width and encoding (AVX-VNNI's
    VEX vpdpbusd, not AVX512-VNNI's EVEX one a host without AVX-512 can't run), for every entry
    whose int8_dot it is, run here or not."""
    assert set(MNEMONICS) == set(int8_dot.DOTS)
    mnemonic, register = MNEMONICS[dot]
    src = constant_weight_matmul(int8_values((32, 70), 3), 13)
    for c in (c for c in table().values() if c.int8_dot == dot):
        with ir.Context():
            module = _prepare(ir.Module.parse(src), "forward", (TensorSpec((1, 13, 70), I8),),
                              (TensorSpec((1, 13, 32), I32),))
            pipeline.lower(module, "default", cpu=c)
            (tmp_path / c.name).mkdir()
            objects = toolchain.machine_code(toolchain.llvm_ir(module), tmp_path / c.name, c)
        text = toolchain.run([toolchain.llvm_tool("llvm-objdump"), "-d", *map(str, objects)])
        lines = [line for line in text.splitlines() if mnemonic in line]
        assert lines and all(register in line for line in lines), (c.name, lines[:3])


CONVS = [  # input [N, H, W, C], output channels, kernel, stride, pad, input zero point
    # output channels not a multiple of 16, or a stride: f32
    ((1, 9, 11, 5), 7, (3, 3), (1, 1), (1, 1, 1, 1), 0),
    ((2, 7, 6, 130), 3, (3, 3), (2, 1), (1, 1, 0, 1), -5),   # 1170 terms: two chunks of channels
    ((1, 5, 5, 1030), 9, (1, 1), (1, 1), (0, 0, 0, 0), 3),   # a 1x1 conv over 1030 channels
    ((1, 8, 8, 64), 33, (5, 5), (1, 1), (2, 2, 2, 2), 0),    # 1600 terms
    ((2, 7, 6, 130), 32, (3, 3), (2, 1), (1, 1, 0, 1), -5),
    # the kernels: channels padded to the group, register tiles along the row and the columns
    # left over, a last panel of one vector of output channels, asymmetric padding, zero points
    ((1, 9, 11, 5), 16, (3, 3), (1, 1), (1, 1, 1, 1), 0),
    ((2, 7, 6, 130), 48, (3, 3), (1, 1), (1, 1, 0, 1), -5),
    ((1, 5, 5, 1030), 32, (1, 1), (1, 1), (0, 0, 0, 0), 3),
    ((1, 8, 8, 64), 48, (5, 5), (1, 1), (2, 2, 2, 2), 0),
    ((1, 4, 19, 3), 16, (2, 3), (1, 1), (0, 1, 2, 0), 127),
    ((1, 6, 15, 7), 24, (3, 3), (1, 1), (1, 1, 1, 1), -9),   # vpmaddwd's 8 channels, 7 padded to 8
]


@pytest.mark.parametrize("shape,channels,kernel,stride,pad,zx", CONVS)
@pytest.mark.parametrize("dot", DOTS)
def test_conv2d_is_exact(shape: tuple[int, ...], channels: int, kernel: tuple[int, int], stride: tuple[int, int],
                         pad: tuple[int, ...], zx: int, dot: str, tmp_path: Path) -> None:
    n, h, w, c = shape
    kh, kw = kernel
    oh = (h + pad[0] + pad[1] - kh) // stride[0] + 1
    ow = (w + pad[2] + pad[3] - kw) // stride[1] + 1
    weight = (aligned_values if zx == 0 and kh * kw * c > EXACT_TERMS else int8_values)((channels, kh, kw, c), 5)
    bias = torch.randint(-(1 << 20), 1 << 20, (channels,), generator=torch.Generator().manual_seed(6)).to(I32)
    x_t, w_t, out_t = ttype(shape, "i8"), ttype(weight.shape, "i8"), ttype((n, oh, ow, channels), "i32")
    src = f"""
    func.func @forward(%x: {x_t}) -> {out_t} {{
      {zp("zx", zx)}
      {zp("zw", 0)}
      %w = "tosa.const"() {{values = {dense(weight)} : {w_t}}} : () -> {w_t}
      %b = "tosa.const"() {{values = {dense(bias)} : tensor<{channels}xi32>}} : () -> tensor<{channels}xi32>
      %r = tosa.conv2d %x, %w, %b, %zx, %zw {{acc_type = i32, dilation = array<i64: 1, 1>,
             pad = array<i64: {", ".join(map(str, pad))}>, stride = array<i64: {", ".join(map(str, stride))}>}}
           : ({x_t}, {w_t}, tensor<{channels}xi32>, tensor<1xi8>, tensor<1xi8>) -> {out_t}
      return %r : {out_t}
    }}"""
    target = entry(dot)
    instruction = int8_dot.for_cpu(target)
    on_dot = instruction is not None and channels % instruction.lanes == 0 and stride == (1, 1)
    lowered = rewritten(src, target)
    assert (f"torchtosa_{dot}_conv" in lowered) == on_dot
    assert lowered.count("tosa.conv2d") == (0 if on_dot else -(-(kh * kw * c) // EXACT_TERMS))
    x = (aligned_values if zx == 0 and kh * kw * c > EXACT_TERMS else int8_values)(shape, 7)
    padded = torch.nn.functional.pad(x.long().permute(0, 3, 1, 2) - zx, (pad[2], pad[3], pad[0], pad[1]))
    expected = torch.nn.functional.conv2d(padded.double(), weight.long().permute(0, 3, 1, 2).double(),
                                          stride=stride).round().long()
    expected = (expected + bias.long()[:, None, None]).permute(0, 2, 3, 1).to(I32)  # exact in f64: < 2^53
    fns = checked_on(src, [TensorSpec(shape, I8)], [TensorSpec((n, oh, ow, channels), I32)], target, tmp_path)
    for f in fns:
        assert torch.equal(f(x)[0], expected)


def test_chunks_are_exact_sizes() -> None:
    """Chunks cover the reduction, each with at most EXACT_TERMS products."""
    from torchtosa.lower.float_int8 import _chunks
    for total, per in [(1, 1), (1024, 1), (1025, 1), (2048, 1), (130, 9), (1030, 1), (64, 25), (3000, 7)]:
        chunks = _chunks(total, per)
        assert sum(size for _, size in chunks) == total
        assert all(size * per <= EXACT_TERMS for _, size in chunks)
        assert [start for start, _ in chunks] == list(np.cumsum([0] + [s for _, s in chunks[:-1]]))
