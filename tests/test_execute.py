"""NativeFunction and the lowering pipeline on hand-written TOSA, checked against torch."""

from __future__ import annotations

import gc
import os
import threading

import pytest
import sympy
import torch
from mlir import ir

from torchtosa.errors import CompileError, InputMismatch, Unsupported
from torchtosa.execute import native as native_module
from torchtosa.execute.native import NativeFunction, TensorSpec
from torchtosa.lower.pipeline import PIPELINES, lower

F32 = torch.float32
SHIFT = '%shift = "tosa.const"() {values = dense<0> : tensor<1xi8>} : () -> tensor<1xi8>'


def parse(src: str) -> ir.Module:
    with ir.Context():
        return ir.Module.parse(src)


def native(src: str, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> NativeFunction:
    return NativeFunction(parse(src), inputs, outputs)


def rand(*shape: int, dtype: torch.dtype = F32, seed: int = 0) -> torch.Tensor:
    """Random values, never zero (integers in [1, 100))."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.rand(shape, generator=g) + 0.5).mul(torch.randn(shape, generator=g).sign()).to(dtype)
    return torch.randint(1, 100, shape, generator=g, dtype=dtype)


ADD_MUL = f"""
func.func @forward(%a: tensor<4x3xf32>, %b: tensor<1x3xf32>) -> (tensor<4x3xf32>, tensor<4x3xf32>, tensor<1x3xf32>) {{
  {SHIFT}
  %s = tosa.add %a, %b : (tensor<4x3xf32>, tensor<1x3xf32>) -> tensor<4x3xf32>
  %p = tosa.mul %s, %b, %shift : (tensor<4x3xf32>, tensor<1x3xf32>, tensor<1xi8>) -> tensor<4x3xf32>
  return %s, %p, %b : tensor<4x3xf32>, tensor<4x3xf32>, tensor<1x3xf32>
}}
"""
A, B = TensorSpec((4, 3), F32), TensorSpec((1, 3), F32)


@pytest.fixture(scope="module")
def add_mul() -> NativeFunction:
    return native(ADD_MUL, [A, B], [A, A, B])


def test_tensor_spec_types() -> None:
    assert TensorSpec((4, 3), F32).mlir_type_str() == "tensor<4x3xf32>"
    assert TensorSpec((2,), torch.bool).mlir_type_str() == "tensor<2xi8>"
    assert TensorSpec((), torch.float16).mlir_type_str() == "tensor<f16>"
    assert TensorSpec((0, 5), torch.bfloat16).mlir_type_str() == "tensor<0x5xbf16>"
    assert TensorSpec((2, 2), torch.uint8).mlir_type_str() == "tensor<2x2xui8>"
    assert TensorSpec(torch.Size([2, 2]), torch.int8) == TensorSpec((2, 2), torch.int8)
    for dtype in (torch.complex64, torch.qint8, torch.float8_e4m3fn):
        with pytest.raises(Unsupported, match="not supported"):
            TensorSpec((2,), dtype)
    with pytest.raises(Unsupported, match="negative shape"):
        TensorSpec((-1, 2), F32)
    s0 = sympy.Symbol("s0", positive=True, integer=True)
    dynamic = TensorSpec((s0, 2 * s0, 3), F32)
    assert dynamic.mlir_type_str() == "tensor<?x?x3xf32>" and not dynamic.static


def test_broadcast_add_mul_and_several_outputs(add_mul: NativeFunction) -> None:
    a, b = rand(4, 3), rand(1, 3, seed=1)
    a0, b0 = a.clone(), b.clone()
    s, p, b_out = add_mul(a, b)
    assert torch.equal(s, a + b)
    assert torch.equal(p, (a + b) * b)
    assert torch.equal(b_out, b) and b_out.data_ptr() != b.data_ptr()
    assert torch.equal(a, a0) and torch.equal(b, b0)


def test_original_module_is_untouched() -> None:
    module = parse(ADD_MUL)
    before = str(module)
    NativeFunction(module, [A, B], [A, A, B])
    assert str(module) == before


def test_module_attributes_are_kept() -> None:
    module = parse("module attributes {torchtosa.note = \"kept\"} {" + ADD_MUL + "}")
    compiled = NativeFunction(module, [A, B], [A, A, B])
    assert str(compiled._module.operation.attributes["torchtosa.note"]) == '"kept"'
    a, b = rand(4, 3), rand(1, 3, seed=1)
    torch.testing.assert_close(compiled(a, b)[1], (a + b) * b)


def test_non_contiguous_and_offset_inputs(add_mul: NativeFunction) -> None:
    a = rand(3, 4).t()  # transposed: not contiguous
    b = rand(5, 3, seed=1)[2:3]  # contiguous view with a storage offset
    odd = torch.empty_strided((1, 3), (100, 1))  # contiguous, odd stride on a size-1 dim
    odd.copy_(b)
    assert not a.is_contiguous() and b.storage_offset() == 6 and odd.is_contiguous()
    assert torch.equal(add_mul(a, b)[1], (a + b) * b)
    assert torch.equal(add_mul(a, odd)[1], (a + b) * b)


@pytest.mark.parametrize(
    "dtype",
    [F32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16, torch.int8],
)
def test_add_mul_every_dtype(dtype: torch.dtype) -> None:
    t = TensorSpec((2, 3), dtype).mlir_type_str()
    src = f"""
    func.func @forward(%a: {t}, %b: {t}) -> {t} {{
      {SHIFT}
      %s = tosa.add %a, %b : ({t}, {t}) -> {t}
      %p = tosa.mul %s, %a, %shift : ({t}, {t}, tensor<1xi8>) -> {t}
      return %p : {t}
    }}
    """
    spec = TensorSpec((2, 3), dtype)
    a, b = rand(2, 3, dtype=dtype), rand(2, 3, dtype=dtype, seed=1)
    (out,) = native(src, [spec, spec], [spec])(a, b)
    assert out.dtype == dtype
    torch.testing.assert_close(out, (a + b) * a)


def test_uint8_through_rescale() -> None:
    # Beyond tosa.rescale (input_unsigned), ui8 operands do not bufferize.
    src = """
    func.func @forward(%a: tensor<4xui8>) -> (tensor<4xi32>, tensor<4xui8>) {
      %m = "tosa.const"() {values = dense<1073741824> : tensor<1xi32>} : () -> tensor<1xi32>
      %s = "tosa.const"() {values = dense<30> : tensor<1xi8>} : () -> tensor<1xi8>
      %zi = "tosa.const"() {values = dense<0> : tensor<1xui8>} : () -> tensor<1xui8>
      %zo = "tosa.const"() {values = dense<0> : tensor<1xi32>} : () -> tensor<1xi32>
      %r = tosa.rescale %a, %m, %s, %zi, %zo {input_unsigned = true, output_unsigned = false, per_channel = false,
        rounding_mode = SINGLE_ROUND, scale32 = true}
        : (tensor<4xui8>, tensor<1xi32>, tensor<1xi8>, tensor<1xui8>, tensor<1xi32>) -> tensor<4xi32>
      return %r, %a : tensor<4xi32>, tensor<4xui8>
    }
    """
    u8 = TensorSpec((4,), torch.uint8)
    a = torch.tensor([1, 127, 200, 255], dtype=torch.uint8)
    wide, same = native(src, [u8], [TensorSpec((4,), torch.int32), u8])(a)
    assert torch.equal(wide, a.int()) and torch.equal(same, a)


def test_int64_beyond_int32() -> None:
    t = "tensor<3xi64>"
    src = f"""
    func.func @forward(%a: {t}, %b: {t}) -> {t} {{
      %s = tosa.sub %a, %b : ({t}, {t}) -> {t}
      return %s : {t}
    }}
    """
    spec = TensorSpec((3,), torch.int64)
    a = rand(3, dtype=torch.int64) * (1 << 40)
    b = rand(3, dtype=torch.int64, seed=1)
    assert torch.equal(native(src, [spec, spec], [spec])(a, b)[0], a - b)


def test_bool_inputs_and_outputs() -> None:
    src = """
    func.func @forward(%m: tensor<6xi8>, %a: tensor<6xf32>, %b: tensor<6xf32>) -> (tensor<6xf32>, tensor<6xi8>) {
      %mask = tosa.cast %m : (tensor<6xi8>) -> tensor<6xi1>
      %sel = tosa.select %mask, %a, %b : (tensor<6xi1>, tensor<6xf32>, tensor<6xf32>) -> tensor<6xf32>
      %gt = tosa.greater %a, %b : (tensor<6xf32>, tensor<6xf32>) -> tensor<6xi1>
      %and = tosa.logical_and %gt, %mask : (tensor<6xi1>, tensor<6xi1>) -> tensor<6xi1>
      %out = tosa.cast %and : (tensor<6xi1>) -> tensor<6xi8>
      return %sel, %out : tensor<6xf32>, tensor<6xi8>
    }
    """
    v, m = TensorSpec((6,), F32), TensorSpec((6,), torch.bool)
    f = native(src, [m, v, v], [v, m])
    mask = torch.tensor([True, False, True, True, False, False])
    a, b = rand(6), rand(6, seed=1)
    sel, both = f(mask, a, b)
    assert torch.equal(sel, torch.where(mask, a, b))
    assert both.dtype == torch.bool and torch.equal(both, (a > b) & mask)


def test_rank0() -> None:
    src = """
    func.func @forward(%a: tensor<f32>, %b: tensor<f32>) -> (tensor<f32>, tensor<i8>) {
      %s = tosa.add %a, %b : (tensor<f32>, tensor<f32>) -> tensor<f32>
      %gt = tosa.greater %a, %b : (tensor<f32>, tensor<f32>) -> tensor<i1>
      %c = tosa.cast %gt : (tensor<i1>) -> tensor<i8>
      return %s, %c : tensor<f32>, tensor<i8>
    }
    """
    s = TensorSpec((), F32)
    f = native(src, [s, s], [s, TensorSpec((), torch.bool)])
    a, b = torch.tensor(1.5), torch.tensor(-2.25)
    total, gt = f(a, b)
    assert total.shape == () and total.item() == -0.75
    assert gt.shape == () and gt.item() is True


def test_zero_size() -> None:
    # TOSA ops reject zero-size operands, so such tensors can only pass through.
    src = """
    func.func @forward(%a: tensor<0x3xf32>, %b: tensor<2xf32>) -> (tensor<0x3xf32>, tensor<2xf32>) {
      %e = tosa.exp %b : (tensor<2xf32>) -> tensor<2xf32>
      return %a, %e : tensor<0x3xf32>, tensor<2xf32>
    }
    """
    z, v = TensorSpec((0, 3), F32), TensorSpec((2,), F32)
    b = rand(2)
    empty, e = native(src, [z, v], [z, v])(torch.empty(0, 3), b)
    assert empty.shape == (0, 3)
    torch.testing.assert_close(e, b.exp())


def test_erf() -> None:
    src = """
    func.func @forward(%a: tensor<64xf32>) -> tensor<64xf32> {
      %e = tosa.erf %a : (tensor<64xf32>) -> tensor<64xf32>
      return %e : tensor<64xf32>
    }
    """
    s = TensorSpec((64,), F32)
    a = rand(64) * 2
    torch.testing.assert_close(native(src, [s], [s])(a)[0], torch.erf(a))


def test_control_flow_on_computed_predicate() -> None:
    src = """
    func.func @forward(%p: tensor<f32>, %a: tensor<4xf32>) -> tensor<4xf32> {
      %zero = "tosa.const"() {values = dense<0.0> : tensor<f32>} : () -> tensor<f32>
      %c = tosa.greater %p, %zero : (tensor<f32>, tensor<f32>) -> tensor<i1>
      %r = tosa.cond_if %c (%x = %a) : tensor<i1> (tensor<4xf32>) -> tensor<4xf32> {
      ^bb0(%x1: tensor<4xf32>):
        %e = tosa.exp %x1 : (tensor<4xf32>) -> tensor<4xf32>
        tosa.yield %e : tensor<4xf32>
      } else {
      ^bb0(%x1: tensor<4xf32>):
        tosa.yield %x1 : tensor<4xf32>
      }
      return %r : tensor<4xf32>
    }
    """
    v = TensorSpec((4,), F32)
    f = native(src, [TensorSpec((), F32), v], [v])
    a = rand(4)
    torch.testing.assert_close(f(torch.tensor(1.0), a)[0], a.exp())
    assert torch.equal(f(torch.tensor(-1.0), a)[0], a)


def test_scatter_leaves_its_input_alone() -> None:
    src = """
    func.func @forward(%v: tensor<1x4x2xf32>, %i: tensor<1x2xi32>, %x: tensor<1x2x2xf32>) -> tensor<1x4x2xf32> {
      %s = tosa.scatter %v, %i, %x : (tensor<1x4x2xf32>, tensor<1x2xi32>, tensor<1x2x2xf32>) -> tensor<1x4x2xf32>
      return %s : tensor<1x4x2xf32>
    }
    """
    v = TensorSpec((1, 4, 2), F32)
    f = native(src, [v, TensorSpec((1, 2), torch.int32), TensorSpec((1, 2, 2), F32)], [v])
    values, x = rand(1, 4, 2), rand(1, 2, 2, seed=1)
    before = values.clone()
    (out,) = f(values, torch.tensor([[3, 1]], dtype=torch.int32), x)
    expected = before.clone()
    expected[0, [3, 1]] = x[0]
    assert torch.equal(out, expected)
    assert torch.equal(values, before)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((rand(4, 3),), "takes 2 tensors, got 1"),
        ((rand(4, 3), rand(2, 3)), r"argument 1: expected .*\[1, 3\].* got shape \[2, 3\]"),
        ((rand(4, 3, dtype=torch.float64), rand(1, 3)), "argument 0: .*float32.* got .*float64"),
        ((rand(4, 3), torch.empty(1, 3, device="meta")), "argument 1: .* got .*device meta"),
        ((rand(4, 3).to_sparse(), rand(1, 3)), "argument 0: .* got .*sparse"),
        ((rand(4, 3), [1.0, 2.0, 3.0]), "argument 1: .* got list"),
    ],
)
def test_input_mismatch(add_mul: NativeFunction, args: tuple, message: str) -> None:
    with pytest.raises(InputMismatch, match=message):
        add_mul(*args)


def test_signature_mismatch() -> None:
    with pytest.raises(CompileError, match="signature"):
        NativeFunction(parse(ADD_MUL), [A, A], [A, A, B])
    with pytest.raises(CompileError, match=r"no func\.func @main"):
        NativeFunction(parse(ADD_MUL), [A, B], [A, A, B], name="main")


def test_lowering_failure_names_stage() -> None:
    src = """
    func.func @forward(%a: tensor<4xf32>) -> tensor<4xf32> {
      %c = tosa.custom %a {domain_name = "x", implementation_attrs = "", operator_name = "y"}
        : (tensor<4xf32>) -> tensor<4xf32>
      return %c : tensor<4xf32>
    }
    """
    with pytest.raises(CompileError, match=r"(?s)stage 'tosa-to-linalg'.*tosa\.custom"):
        lower(parse(src))


@pytest.mark.parametrize("opt", ["none", "default"])
def test_invalid_stage_input_is_a_compile_error(opt: str) -> None:
    # Passes run without the per-pass verifier: invalid IR must be caught before a stage runs.
    module = parse("""
    func.func @forward(%a: tensor<4xf32>) -> tensor<4xf32> {
      %b = tosa.abs %a : (tensor<4xf32>) -> tensor<4xf32>
      return %b : tensor<4xf32>
    }
    """)
    with module.context:
        func = module.body.operations[0]
        func.attributes["function_type"] = ir.TypeAttr.get(ir.Type.parse("(tensor<4xf32>) -> tensor<5xf32>"))
    with pytest.raises(CompileError, match=r"(?s)input of stage 'tosa-to-linalg' is invalid.*type of return operand"):
        lower(module, opt)


def test_i1_buffers_raise_instead_of_aborting() -> None:
    # tosa.reverse reads its input by index, so the i1 comparison gets a buffer.
    internal = """
    func.func @forward(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xi8> {
      %g = tosa.greater %a, %b : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xi1>
      %r = tosa.reverse %g {axis = 0 : i32} : (tensor<4xi1>) -> tensor<4xi1>
      %c = tosa.cast %r : (tensor<4xi1>) -> tensor<4xi8>
      return %c : tensor<4xi8>
    }
    """
    returned = """
    func.func @forward(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xi1> {
      %g = tosa.greater %a, %b : (tensor<4xf32>, tensor<4xf32>) -> tensor<4xi1>
      return %g : tensor<4xi1>
    }
    """
    v = TensorSpec((4,), F32)
    with pytest.raises(CompileError, match=r"sub-byte.*memref<4xi1>"):
        native(internal, [v, v], [TensorSpec((4,), torch.bool)])
    with pytest.raises(CompileError, match="stage 'bufferize'"):
        lower(parse(returned))
    assert list(PIPELINES) == ["tosa-to-linalg", "fuse-before-reshapes", "linalg", "fuse-dynamic", "unit-dims",
                               "schedule", "bufferize", "out-params", "openmp", "llvm"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_repeated_calls_do_not_grow_memory() -> None:
    # 64 KiB output, plus a 64 KiB intermediate buffer the native code frees.
    t = "tensor<16384xf32>"
    src = f"""
    func.func @forward(%a: {t}) -> {t} {{
      %s = tosa.add %a, %a : ({t}, {t}) -> {t}
      %r = tosa.reverse %s {{axis = 0 : i32}} : ({t}) -> {t}
      return %r : {t}
    }}
    """
    s = TensorSpec((16384,), F32)
    f = native(src, [s], [s])
    a = rand(16384)
    assert torch.equal(f(a)[0], (a + a).flip(0))
    for _ in range(100):
        f(a)
    before = _rss()
    for _ in range(10_000):
        f(a)
    assert _rss() - before < 50 * 2**20


def test_two_threads() -> None:
    t = "tensor<4096xf32>"
    src = f"""
    func.func @forward(%a: {t}, %b: {t}) -> {t} {{
      {SHIFT}
      %p = tosa.mul %a, %b, %shift : ({t}, {t}, tensor<1xi8>) -> {t}
      %r = tosa.reverse %p {{axis = 0 : i32}} : ({t}) -> {t}
      return %r : {t}
    }}
    """
    s = TensorSpec((4096,), F32)
    f = native(src, [s, s], [s])
    failures: list[int] = []

    def work(seed: int) -> None:
        a, b = rand(4096, seed=seed), rand(4096, seed=seed + 1)
        expected = (a * b).flip(0)
        for _ in range(500):
            if not torch.equal(f(a, b)[0], expected):
                failures.append(seed)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in (10, 20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert failures == []


def _mapped(path: str) -> bool:
    """Whether the file at `path` (perhaps deleted since) is mapped into this process."""
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").removesuffix(" (deleted)").endswith(path) for line in f)


@pytest.mark.parametrize(("limit", "jit"), [(0, False), (10**9, True)])
def test_small_code_is_jit_compiled_and_large_code_a_library(monkeypatch: pytest.MonkeyPatch, limit: int,
                                                             jit: bool) -> None:
    """With the disk cache off, LLVM IR below JIT_MAX_IR_BYTES goes to the JIT, the rest to a
    library (`_jit_is_faster`); both compute the same."""
    monkeypatch.setattr(native_module, "JIT_MAX_IR_BYTES", limit)
    f = native(ADD_MUL, [A, B], [A, A, B])
    assert (hasattr(f, "_engine"), hasattr(f, "_library")) == (jit, not jit)
    a, b = rand(4, 3), rand(1, 3, seed=1)
    s, p, _ = f(a, b)
    assert torch.equal(s, a + b) and torch.equal(p, (a + b) * b)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc")
def test_a_library_is_unmapped_when_its_function_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native_module, "JIT_MAX_IR_BYTES", 0)
    f = native(ADD_MUL, [A, B], [A, A, B])
    f(rand(4, 3), rand(1, 3, seed=1))
    path = f._library._name
    assert _mapped(path)
    del f
    gc.collect()
    assert not _mapped(path)
