"""Measure one core's peak f32 FMA throughput with the same MLIR/LLVM JIT torchtosa uses.

A loop of independent 16-lane vector FMAs (more accumulators than the FMA latency times the
number of FMA units, no loads or stores), compiled for the host CPU and timed on one thread:
the ceiling for any f32 kernel on this machine, against which `make bench` reads GF/s.

    python scripts/peak.py
"""

from __future__ import annotations

import ctypes
import time

from mlir import ir
from mlir.execution_engine import ExecutionEngine
from mlir.passmanager import PassManager

CHAINS = 24  # independent accumulators: enough to hide FMA latency on 2 FMA units
LANES = 16  # f32 lanes of an AVX-512 register; narrower targets split the vector
_LOWER = ("builtin.module(convert-scf-to-cf,convert-vector-to-llvm,convert-arith-to-llvm,"
          "convert-func-to-llvm,convert-cf-to-llvm,reconcile-unrealized-casts)")


def _source() -> str:
    vec = f"vector<{LANES}xf32>"
    accs = [f"%a{i}" for i in range(CHAINS)]
    body = [f"      %b{i} = vector.fma %a{i}, %x, %y : {vec}" for i in range(CHAINS)]
    total = ["    %s0 = arith.addf %r#0, %r#1 : " + vec]
    total += [f"    %s{i - 1} = arith.addf %s{i - 2}, %r#{i} : {vec}" for i in range(2, CHAINS)]
    return "\n".join([
        "func.func @fma(%n: index) -> f32 attributes {llvm.emit_c_interface} {",
        "  %c0 = arith.constant 0 : index",
        "  %c1 = arith.constant 1 : index",
        f"  %x = arith.constant dense<1.0000001> : {vec}",
        f"  %y = arith.constant dense<-0.5> : {vec}",
        f"  %z = arith.constant dense<0.25> : {vec}",
        f"  %r:{CHAINS} = scf.for %i = %c0 to %n step %c1 iter_args("
        + ", ".join(f"{a} = %z" for a in accs) + f") -> ({', '.join([vec] * CHAINS)}) {{",
        *body,
        "      scf.yield " + ", ".join(f"%b{i}" for i in range(CHAINS)) + " : " + ", ".join([vec] * CHAINS),
        "  }",
        *total,
        f"  %sum = vector.reduction <add>, %s{CHAINS - 2} : {vec} into f32",
        "  return %sum : f32",
        "}",
    ])


def fma_peak_gflops(seconds: float = 0.5) -> float:
    """GF/s (2 flops per FMA lane) of one thread running independent vector FMAs."""
    with ir.Context() as ctx:
        module = ir.Module.parse(_source())
        PassManager.parse(_LOWER, context=ctx).run(module.operation)
        engine = ExecutionEngine(module, opt_level=3)
        result = ctypes.c_float()

        def run(iterations: int) -> float:
            n = ctypes.c_int64(iterations)
            start = time.perf_counter()
            engine.invoke("fma", ctypes.pointer(n), ctypes.pointer(result))
            return time.perf_counter() - start

        iterations = 1 << 16
        while run(iterations) < seconds / 5:
            iterations *= 2
        best = min(run(iterations) for _ in range(5))
    return 2 * LANES * CHAINS * iterations / best / 1e9


if __name__ == "__main__":
    print(f"one core, f32 FMA peak: {fma_peak_gflops():.1f} GF/s")
