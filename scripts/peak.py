"""Measure one core's peak f32 FMA throughput with the same MLIR/LLVM JIT torchtosa uses.

A loop of independent vector FMAs, one register wide (more accumulators than the FMA latency
times the number of FMA units, no loads or stores), compiled for a CPU entry of the table
(opdefs/cpus.yaml: by default $TORCHTOSA_CPU or this machine's) and timed on one thread: the
ceiling for any f32 kernel of that entry on this machine, against which `make bench` reads GF/s.

    python scripts/peak.py [--cpu x86-64-v3]
"""

from __future__ import annotations

import argparse
import ctypes
import time

from mlir import ir
from mlir.execution_engine import ExecutionEngine
from mlir.passmanager import PassManager

from torchtosa.cpu import Cpu, runnable, select
from torchtosa.lower.pipeline import target

MAX_CHAINS = 24  # independent accumulators: enough to hide FMA latency on 2 FMA units
SPARE = 4  # registers left for the two operands and the loop
_LOWER = ("builtin.module(convert-scf-to-cf,convert-vector-to-llvm,convert-arith-to-llvm,"
          "convert-func-to-llvm,convert-cf-to-llvm,reconcile-unrealized-casts)")


def chains(cpu: Cpu) -> int:
    """Accumulators of the loop: as many as fit the register file, at most MAX_CHAINS."""
    return min(MAX_CHAINS, cpu.vector_registers - SPARE)


def _source(lanes: int, n: int) -> str:
    vec = f"vector<{lanes}xf32>"
    accs = [f"%a{i}" for i in range(n)]
    body = [f"      %b{i} = vector.fma %a{i}, %x, %y : {vec}" for i in range(n)]
    total = ["    %s0 = arith.addf %r#0, %r#1 : " + vec]
    total += [f"    %s{i - 1} = arith.addf %s{i - 2}, %r#{i} : {vec}" for i in range(2, n)]
    return "\n".join([
        "func.func @fma(%n: index) -> f32 attributes {llvm.emit_c_interface} {",
        "  %c0 = arith.constant 0 : index",
        "  %c1 = arith.constant 1 : index",
        f"  %x = arith.constant dense<1.0000001> : {vec}",
        f"  %y = arith.constant dense<-0.5> : {vec}",
        f"  %z = arith.constant dense<0.25> : {vec}",
        f"  %r:{n} = scf.for %i = %c0 to %n step %c1 iter_args("
        + ", ".join(f"{a} = %z" for a in accs) + f") -> ({', '.join([vec] * n)}) {{",
        *body,
        "      scf.yield " + ", ".join(f"%b{i}" for i in range(n)) + " : " + ", ".join([vec] * n),
        "  }",
        *total,
        f"  %sum = vector.reduction <add>, %s{n - 2} : {vec} into f32",
        "  return %sum : f32",
        "}",
    ])


def fma_peak_gflops(seconds: float = 0.5, cpu: Cpu | None = None) -> float:
    """GF/s (2 flops per FMA lane) of one thread running independent vector FMAs of `cpu`'s
    registers (by default the selected entry's)."""
    cpu = runnable(cpu or select())
    lanes, n = cpu.lanes, chains(cpu)
    with ir.Context() as ctx:
        module = ir.Module.parse(_source(lanes, n))
        PassManager.parse(_LOWER, context=ctx).run(module.operation)
        target(module, cpu)
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
    return 2 * lanes * n * iterations / best / 1e9


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", help="an entry of opdefs/cpus.yaml (default: $TORCHTOSA_CPU or this machine's)")
    entry = select(parser.parse_args().cpu)
    print(f"one core, f32 FMA peak of {entry.name}: {fma_peak_gflops(cpu=entry):.1f} GF/s")
