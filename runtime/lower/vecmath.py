"""Vector math functions from glibc's libmvec, for opt="default".

Without it, a vectorized `math.exp`/`erf`/`tanh`/... is lowered one element at a time: an
extract, a scalar libm call and an insert per lane. libmvec has the same functions for one
vector register of floats or doubles, under the x86-64 vector function ABI names
(`_ZGVeN16v_expf`: AVX-512 ("e"), unmasked, 16 lanes, one vector argument; `_ZGVdN8v_expf`: the
AVX2 ("d") variant on 8 lanes). Which variant a CPU uses is its table entry's `vecmath`
(opdefs/cpus.yaml). glibc documents them accurate to 4 ulp, with special values (NaN,
infinities, overflow) handled as the scalar functions do.

`use_vector_library(module, cpu)` rewrites each such 1-D vector op into calls on register-sized
slices. `library(cpu)` says whether code for `cpu` can use them: libmvec is found with every
function of the variant and, where this machine runs the variant, a compiled probe agrees with
numpy on special and ordinary values; else the rewrite is skipped and the scalar path stays.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import numpy as np
from mlir import ir
from mlir.dialects import arith, func, vector
from mlir.execution_engine import ExecutionEngine
from mlir.passmanager import PassManager
from mlir.runtime import get_ranked_memref_descriptor

from ..cpu import Cpu
from .irutil import context, find_ops

# math op -> libmvec base name (float variant appends "f")
FUNCTIONS = {
    "math.exp": "exp", "math.exp2": "exp2", "math.expm1": "expm1", "math.log": "log", "math.log2": "log2",
    "math.log10": "log10", "math.log1p": "log1p", "math.erf": "erf", "math.erfc": "erfc", "math.tanh": "tanh",
    "math.sinh": "sinh", "math.cosh": "cosh", "math.sin": "sin", "math.cos": "cos", "math.tan": "tan",
    "math.asin": "asin", "math.acos": "acos", "math.atan": "atan", "math.asinh": "asinh", "math.acosh": "acosh",
    "math.atanh": "atanh", "math.cbrt": "cbrt",
}
# (base, width) -> x below which the function is +0.0 in that float (exp: ln of half the least
# subnormal, -103.97 in f32, -745.13 in f64); libmvec takes such lanes ("special values") one by
# one through the scalar function, 6x slower over a row that is half -inf (a causal mask's
# scores), so those lanes are set here instead
FLUSHED_BELOW = {("exp", 32): -104.0, ("exp", 64): -746.0}
# a CPU entry's `vecmath` -> (ISA letter of the x86-64 vector function ABI, register bits)
VARIANTS = {"avx2": ("d", 256), "avx512": ("e", 512)}
WIDTHS = (32, 64)  # f32 and f64


def lanes(variant: str, width: int) -> int:
    """Lanes of one register of `width`-bit floats in a libmvec variant."""
    return VARIANTS[variant][1] // width


def symbol(base: str, width: int, variant: str = "avx512") -> str:
    """The libmvec name of `base` on one register of `width`-bit floats."""
    return f"_ZGV{VARIANTS[variant][0]}N{lanes(variant, width)}v_{base}{'f' if width == 32 else ''}"


def library(cpu: Cpu) -> str | None:
    """The path of libmvec if code for `cpu` can call its functions, else None."""
    return _library(cpu.vecmath, cpu.runs_here)


@functools.cache
def _library(variant: str, probe: bool) -> str | None:
    path = ctypes.util.find_library("mvec")
    if path is None or variant not in VARIANTS:
        return None
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    if not all(hasattr(lib, symbol(base, width, variant)) for base in FUNCTIONS.values() for width in WIDTHS):
        return None
    return path if not probe or all(_probe(width, variant) for width in WIDTHS) else None


# exp at ordinary and special values: overflow, underflow, infinities, NaN
_PROBE_VALUES = [-1.5, 0.0, -0.0, 0.5, 1.0, 2.25, 10.0, -10.0, 80.0, 1000.0, -1000.0,
                 float("inf"), float("-inf"), float("nan"), 1e-30, -87.0]


def _probe(width: int, variant: str) -> bool:
    """Whether JIT-compiled code calling libmvec's exp (as the rewrite does) computes exp:
    checks the calling convention the JIT uses for a register of the variant against the library's."""
    n, dtype = lanes(variant, width), {32: np.float32, 64: np.float64}[width]
    t = f"vector<{n}xf{width}>"
    name = symbol("exp", width, variant)
    src = f"""
    func.func private @{name}({t}) -> {t}
    func.func @probe(%a: memref<{n}xf{width}>, %b: memref<{n}xf{width}>) attributes {{llvm.emit_c_interface}} {{
      %c0 = arith.constant 0 : index
      %v = vector.load %a[%c0] : memref<{n}xf{width}>, {t}
      %r = func.call @{name}(%v) : ({t}) -> {t}
      vector.store %r, %b[%c0] : memref<{n}xf{width}>, {t}
      return
    }}"""
    with context():
        module = ir.Module.parse(src)
        PassManager.parse("builtin.module(convert-vector-to-llvm,finalize-memref-to-llvm,convert-arith-to-llvm,"
                          "convert-func-to-llvm,reconcile-unrealized-casts)").run(module.operation)
        engine = ExecutionEngine(module, opt_level=2)  # libmvec is loaded into the process
        x = np.array((_PROBE_VALUES * 2)[:n], dtype=dtype)
        y = np.zeros_like(x)
        engine.invoke("probe", *(ctypes.pointer(ctypes.pointer(get_ranked_memref_descriptor(a))) for a in (x, y)))
    with np.errstate(over="ignore"):
        expected = np.exp(x)
    return bool(np.allclose(y, expected, rtol=1e-6, atol=0.0, equal_nan=True))


def use_vector_library(module: ir.Module, cpu: Cpu) -> None:
    """Replace every math op of `FUNCTIONS` on a 1-D vector of f32 (f64) of 2 lanes or more by
    libmvec calls on register-sized slices of `cpu`'s variant, the last one padded with zeros
    where the length is not a multiple of a register (LLVM would make a libm call per lane of a
    vector<28xf32>, the rows of a 28 x 28 image: a SiLU 6x slower than eager's)."""
    variant = cpu.vecmath
    found = find_ops(module, lambda op: op.name in FUNCTIONS and _lanes(op.operands[0].type, variant) is not None)
    if not found:
        return
    declared: set[str] = set()
    with module.context, ir.Location.unknown():
        for op in found:
            t = ir.VectorType(op.operands[0].type)
            n = _lanes(t, variant)
            assert n is not None
            width = ir.FloatType(t.element_type).width
            name = symbol(FUNCTIONS[op.name], width, variant)
            register = ir.VectorType.get([n], t.element_type)
            if name not in declared:
                _declare(module, name, register)
                declared.add(name)
            floor = FLUSHED_BELOW.get((FUNCTIONS[op.name], width))
            call = functools.partial(_flushed_call, floor=floor) if floor is not None else _plain_call
            with ir.InsertionPoint(op), op.location:
                source = op.operands[0]
                if t.shape[0] == n:
                    result = call(name, source)
                else:  # one call per register-sized slice, the last padded
                    result = _zeros(t)
                    for start in range(0, t.shape[0], n):
                        size = min(n, t.shape[0] - start)
                        if size == n:
                            part = vector.ExtractStridedSliceOp(register, source, [start], [n], [1]).result
                            result = vector.InsertStridedSliceOp(call(name, part), result, [start], [1]).result
                            continue
                        tail = ir.VectorType.get([size], t.element_type)
                        part = vector.ExtractStridedSliceOp(tail, source, [start], [size], [1]).result
                        padded = vector.InsertStridedSliceOp(part, _zeros(register), [0], [1]).result
                        value = vector.ExtractStridedSliceOp(tail, call(name, padded), [0], [size], [1]).result
                        result = vector.InsertStridedSliceOp(value, result, [start], [1]).result
            op.results[0].replace_all_uses_with(result)
            op.erase()


def _lanes(t: ir.Type, variant: str) -> int | None:
    """Lanes per call for a vector type this rewrite handles, else None."""
    if not isinstance(t, ir.VectorType) or t.rank != 1 or t.scalable:
        return None
    element = t.element_type
    if not isinstance(element, ir.F32Type | ir.F64Type):
        return None
    return lanes(variant, ir.FloatType(element).width) if t.shape[0] > 1 else None


def _plain_call(name: str, register: ir.Value) -> ir.Value:
    return func.CallOp([register.type], ir.FlatSymbolRefAttr.get(name), [register]).result


def _flushed_call(name: str, register: ir.Value, floor: float) -> ir.Value:
    """The call on `register` with its lanes below `floor` (and their results) replaced by +0.0."""
    t = ir.VectorType(register.type)
    below = arith.CmpFOp(arith.CmpFPredicate.OLT, register, _splat(t, floor))
    zeros = _zeros(t)
    result = _plain_call(name, arith.SelectOp(below, zeros, register).result)
    return arith.SelectOp(below, zeros, result).result


def _zeros(t: ir.VectorType) -> ir.Value:
    return _splat(t, 0.0)


def _splat(t: ir.VectorType, value: float) -> ir.Value:
    return arith.ConstantOp(t, ir.DenseElementsAttr.get_splat(t, ir.FloatAttr.get(t.element_type, value))).result


def _declare(module: ir.Module, name: str, register: ir.VectorType) -> None:
    with ir.InsertionPoint.at_block_begin(module.body), ir.Location.unknown():
        func.FuncOp(name, ir.FunctionType.get([register], [register]), visibility="private")
