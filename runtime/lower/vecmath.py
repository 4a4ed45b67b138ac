"""Vector math functions from glibc's libmvec, for opt="default".

Without it, a vectorized `math.exp`/`erf`/`tanh`/... is lowered one element at a time: an
extract, a scalar libm call and an insert per lane. libmvec has the same functions for 16
floats (or 8 doubles) in one AVX-512 register, under the x86-64 vector function ABI names
(`_ZGVeN16v_expf`: AVX-512, unmasked, 16 lanes, one vector argument). glibc documents
them accurate to 4 ulp, with special values (NaN, infinities, overflow) handled as
the scalar functions do.

`use_vector_library(module)` rewrites each such 1-D vector op into calls on 16- (8-) lane
slices. `library()` says whether this process can use them: libmvec is found, the CPU has
AVX-512 and a compiled probe agrees with torch on special and ordinary values; else the
rewrite is skipped and the scalar path stays.
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

from ..execute.toolchain import host_has
from .irutil import find_ops

# math op -> libmvec base name (float variant appends "f")
FUNCTIONS = {
    "math.exp": "exp", "math.exp2": "exp2", "math.expm1": "expm1", "math.log": "log", "math.log2": "log2",
    "math.log10": "log10", "math.log1p": "log1p", "math.erf": "erf", "math.erfc": "erfc", "math.tanh": "tanh",
    "math.sinh": "sinh", "math.cosh": "cosh", "math.sin": "sin", "math.cos": "cos", "math.tan": "tan",
    "math.asin": "asin", "math.acos": "acos", "math.atan": "atan", "math.asinh": "asinh", "math.acosh": "acosh",
    "math.atanh": "atanh", "math.cbrt": "cbrt",
}
_LANES = {32: 16, 64: 8}  # element width -> lanes of one AVX-512 register


def symbol(base: str, width: int) -> str:
    """The libmvec name of `base` on one AVX-512 register of `width`-bit floats."""
    return f"_ZGVeN{_LANES[width]}v_{base}{'f' if width == 32 else ''}"


@functools.cache
def library() -> str | None:
    """The path of libmvec if this process can call its AVX-512 functions, else None."""
    path = ctypes.util.find_library("mvec")
    if path is None or not host_has("avx512f"):
        return None
    try:
        lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    if not all(hasattr(lib, symbol(base, width)) for base in FUNCTIONS.values() for width in _LANES):
        return None
    return path if all(_probe(path, width) for width in _LANES) else None


# exp at ordinary and special values: overflow, underflow, infinities, NaN
_PROBE_VALUES = [-1.5, 0.0, -0.0, 0.5, 1.0, 2.25, 10.0, -10.0, 80.0, 1000.0, -1000.0,
                 float("inf"), float("-inf"), float("nan"), 1e-30, -87.0]


def _probe(path: str, width: int) -> bool:
    """Whether JIT-compiled code calling libmvec's exp (as the rewrite does) computes exp:
    checks the calling convention the JIT uses for a 512-bit vector against the library's."""
    lanes, dtype = _LANES[width], {32: np.float32, 64: np.float64}[width]
    t = f"vector<{lanes}xf{width}>"
    src = f"""
    func.func private @{symbol("exp", width)}({t}) -> {t}
    func.func @probe(%a: memref<{lanes}xf{width}>, %b: memref<{lanes}xf{width}>) attributes {{llvm.emit_c_interface}} {{
      %c0 = arith.constant 0 : index
      %v = vector.load %a[%c0] : memref<{lanes}xf{width}>, {t}
      %r = func.call @{symbol("exp", width)}(%v) : ({t}) -> {t}
      vector.store %r, %b[%c0] : memref<{lanes}xf{width}>, {t}
      return
    }}"""
    with ir.Context():
        module = ir.Module.parse(src)
        PassManager.parse("builtin.module(convert-vector-to-llvm,finalize-memref-to-llvm,convert-arith-to-llvm,"
                          "convert-func-to-llvm,reconcile-unrealized-casts)").run(module.operation)
        engine = ExecutionEngine(module, opt_level=2)  # libmvec is loaded into the process
        x = np.array((_PROBE_VALUES * 2)[:lanes], dtype=dtype)
        y = np.zeros_like(x)
        engine.invoke("probe", *(ctypes.pointer(ctypes.pointer(get_ranked_memref_descriptor(a))) for a in (x, y)))
    with np.errstate(over="ignore"):
        expected = np.exp(x)
    return bool(np.allclose(y, expected, rtol=1e-6, atol=0.0, equal_nan=True))


def use_vector_library(module: ir.Module) -> None:
    """Replace every math op of `FUNCTIONS` on a 1-D vector of f32 (f64) whose length is a
    multiple of 16 (8) by libmvec calls, one per register-sized slice."""
    found = find_ops(module, lambda op: op.name in FUNCTIONS and _lanes(op.operands[0].type) is not None)
    if not found:
        return
    declared: set[str] = set()
    with module.context, ir.Location.unknown():
        for op in found:
            t = ir.VectorType(op.operands[0].type)
            lanes = _lanes(t)
            assert lanes is not None
            width = ir.FloatType(t.element_type).width
            name = symbol(FUNCTIONS[op.name], width)
            register = ir.VectorType.get([lanes], t.element_type)
            if name not in declared:
                _declare(module, name, register)
                declared.add(name)
            with ir.InsertionPoint(op), op.location:
                source = op.operands[0]
                if t.shape[0] == lanes:
                    result = _call(name, source)
                else:  # one call per register-sized slice
                    result = _zeros(t)
                    for start in range(0, t.shape[0], lanes):
                        part = vector.ExtractStridedSliceOp(register, source, [start], [lanes], [1]).result
                        result = vector.InsertStridedSliceOp(_call(name, part), result, [start], [1]).result
            op.results[0].replace_all_uses_with(result)
            op.erase()


def _lanes(t: ir.Type) -> int | None:
    """Lanes per call for a vector type this rewrite handles, else None."""
    if not isinstance(t, ir.VectorType) or t.rank != 1 or t.scalable:
        return None
    element = t.element_type
    if not isinstance(element, ir.F32Type | ir.F64Type):
        return None
    lanes = _LANES[ir.FloatType(element).width]
    return lanes if t.shape[0] % lanes == 0 else None


def _call(name: str, register: ir.Value) -> ir.Value:
    return func.CallOp([register.type], ir.FlatSymbolRefAttr.get(name), [register]).result


def _zeros(t: ir.VectorType) -> ir.Value:
    return arith.ConstantOp(t, ir.DenseElementsAttr.get_splat(t, ir.FloatAttr.get(t.element_type, 0.0))).result


def _declare(module: ir.Module, name: str, register: ir.VectorType) -> None:
    with ir.InsertionPoint.at_block_begin(module.body), ir.Location.unknown():
        func.FuncOp(name, ir.FunctionType.get([register], [register]), visibility="private")
