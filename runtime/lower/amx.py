"""bf16 matmuls on AMX tiles (Intel's Advanced Matrix Extensions: Sapphire Rapids and later).

One `tdpbf16ps` multiplies a tile of 16 rows x 32 bf16 by one of 16 pairs of rows x 16 columns
(pairs of k side by side, "VNNI" order) into 16 x 16 f32 sums: 8192 multiply-adds, 16x what an
AVX-512 FMA does in the same time. MLIR's `amx` dialect has the tiles as values
(`amx.tile_load`, `amx.tile_mulf`, `amx.tile_store` on memrefs), which LLVM's X86 backend
configures (`ldtilecfg`) itself; tiles are not carried through loops (LLVM's type conversion has
none for them), so a kernel runs k in unrolled stretches of UNROLL steps, its accumulators
stored and loaded between them.

A product C = A @ W^T of A [M, K] by a weight W [N, K] stored along k (nn.Linear's) is computed
as its transpose, C^T = W @ A^T: W's rows are the first tile's rows as stored, and A^T in pairs of
k is the second operand, packed at each call (the small one in a prefill: M x K, not N x K): M
padded to whole tiles of 16, each tile's [K/2, 16, 2] contiguous, so that one tile load reads 1
KiB in a row (with rows of A^T 2 M apart, a load's 16 lines fell into one L1 set from M = 1024:
a 1024^3 matmul ran at a twentieth of the peak). The kernel keeps 2 x 2 accumulator tiles (32
rows of W by 32 rows of A) while k runs in steps of 32, four of the eight tile registers, in
C^T [N, M16]; the caller reads it transposed. `schedule._amx_product` inserts that at the
tensor level with a placeholder kernel (`placeholder`: returns its output, which bufferizes to
an in-place argument); after bufferization, `lower` gives each placeholder its AMX body on
memrefs. Linux runs AMX code only in a process that asked for the tile data state
(`request_permission`, arch_prctl), else the first tile instruction faults.
"""

from __future__ import annotations

import ctypes
import functools

from mlir import ir

from ..cpu import Cpu

ROWS = 16  # rows of a tile
PAIRS = 32  # bf16 elements of k in a row of the first tile (64 bytes)
BLOCK = 2 * ROWS  # rows of W, and of A, of a kernel step's 2 x 2 accumulator tiles
ATTR = "torchtosa.amx"  # marks a placeholder kernel: "n,k,m16"
INSTRUCTION = "llvm.x86.tdpbf16ps"  # in the LLVM IR of code that uses the tiles
# A library's constructor asking for the tiles' state (`export_library`): a program loading it
# need not know
PERMISSION_C = """#include <sys/syscall.h>
#include <unistd.h>

__attribute__((constructor)) static void torchtosa_request_amx(void) {
    syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */);
}
"""
MIN_ROWS = 4  # fewer rows: dot products (`bf16_dot`); 8 rows of Linear(1024, 2816): 312 us here, 574 there
UNROLL = 8  # steps of k between the accumulators' trips to memory, at most


def available(cpu: Cpu) -> bool:
    """Whether code for `cpu` multiplies bf16 matrices on AMX tiles (and, on this machine, this
    process may use them)."""
    return cpu.bf16_matmul == "amx" and (not cpu.runs_here or request_permission())


def fits(m: int, k: int, n: int) -> bool:
    """Shapes the kernel takes: W's rows in whole blocks of 32, k in whole tiles."""
    return m > 0 and n % BLOCK == 0 and k % PAIRS == 0


def padded_rows(m: int) -> int:
    """M padded to whole tiles of 16."""
    return -(-m // ROWS) * ROWS


@functools.cache
def request_permission() -> bool:
    """Ask Linux for AMX's tile data state (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA),
    once per process; whether it was granted."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0  # SYS_arch_prctl on x86-64
    except (OSError, AttributeError):
        return False


def placeholder(name: str, n: int, k: int, m16: int) -> str:
    """MLIR text of the kernel's stand-in until `lower`: `(%w: [N, K] bf16, %b: [K/2, 2 M16] bf16,
    %out: [N, M16] f32) -> %out`, marked with ATTR."""
    w, b, out = f"tensor<{n}x{k}xbf16>", f"tensor<{m16 // ROWS * k // 2}x{2 * ROWS}xbf16>", f"tensor<{n}x{m16}xf32>"
    return (f"func.func private @{name}(%w: {w}, %b: {b}, %out: {out}) -> {out}"
            f' attributes {{{ATTR} = "{n},{k},{m16}"}} {{\n  return %out : {out}\n}}')


def lower(module: ir.Module) -> None:
    """Give each placeholder (bufferized: memref arguments, the output's perhaps still returned)
    its AMX body."""
    block = module.body
    for op in list(block.operations):
        if op.operation.name != "func.func" or ATTR not in op.attributes:
            continue
        n, k, m16 = map(int, ir.StringAttr(op.attributes[ATTR]).value.split(","))
        name = ir.StringAttr(op.attributes["sym_name"]).value
        signature = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
        with module.context:
            parsed = ir.Module.parse(_kernel(name, n, k, m16, [str(t) for t in signature.inputs],
                                             [str(t) for t in signature.results]))
            parsed.body.operations[0].move_before(op)  # the replacement takes the placeholder's place
        op.operation.erase()


def _kernel(name: str, n: int, k: int, m16: int, inputs: list[str], results: list[str]) -> str:
    """The AMX body: for each block of 32 rows of W, blocks of 32 (then 16) rows of A, 2 x 2 (or
    2 x 1) accumulator tiles over k in steps of 32, unrolled by UNROLL steps: LLVM's type
    conversion has no tile values carried through loops, so the accumulators are stored into C^T
    after each unrolled stretch and loaded again before the next."""
    a_tile, acc_tile = f"!amx.tile<{ROWS}x{PAIRS}xbf16>", f"!amx.tile<{ROWS}x{ROWS}xf32>"
    w, b, c = inputs
    steps = k // PAIRS
    unroll = next(u for u in range(UNROLL, 0, -1) if steps % u == 0)
    returns = f" -> {results[0]}" if results else ""
    lines = [f"func.func private @{name}(%w: {w}, %b: {b}, %c: {c}){returns} {{",
             "  %c0 = arith.constant 0 : index", "  %c2 = arith.constant 2 : index",
             f"  %c16 = arith.constant {ROWS} : index", f"  %c32 = arith.constant {BLOCK} : index",
             f"  %cn = arith.constant {n} : index", f"  %ck = arith.constant {k} : index",
             f"  %ckstep = arith.constant {PAIRS * unroll} : index", f"  %chalfk = arith.constant {k // 2} : index",
             "  scf.for %n0 = %c0 to %cn step %c32 {",
             "    %n1 = arith.addi %n0, %c16 : index"]
    full = m16 // BLOCK * BLOCK
    for start, stop, columns in ((0, full, 2), (full, m16, 1)):
        if start == stop:
            continue
        t = f"b{columns}"
        at = [(i, j) for i in range(2) for j in range(columns)]
        lines += [f"    %start{t} = arith.constant {start} : index", f"    %stop{t} = arith.constant {stop} : index",
                  f"    %step{t} = arith.constant {ROWS * columns} : index",
                  f"    scf.for %m0{t} = %start{t} to %stop{t} step %step{t} {{",
                  f"      %m1{t} = arith.addi %m0{t}, %c16 : index",
                  f"      %mt{t}_0 = arith.divui %m0{t}, %c16 : index",  # the tile of rows
                  f"      %row{t}_0 = arith.muli %mt{t}_0, %chalfk : index",
                  f"      %row{t}_1 = arith.addi %row{t}_0, %chalfk : index",
                  f"      %zero{t} = amx.tile_zero : {acc_tile}"]
        where = {(i, j): f"{'%n0' if i == 0 else '%n1'}, {'%m0' if j == 0 else '%m1'}{t}" for i, j in at}
        lines += [f"      amx.tile_store %c[{where[i, j]}], %zero{t} : {c}, {acc_tile}" for i, j in at]
        lines += [f"      scf.for %kb{t} = %c0 to %ck step %ckstep {{"]
        lines += [f"        %s{t}_{i}{j}_0 = amx.tile_load %c[{where[i, j]}] : {c} into {acc_tile}" for i, j in at]
        for u in range(unroll):
            x = f"{t}_{u}"
            lines += [f"        %off{x} = arith.constant {PAIRS * u} : index",
                      f"        %kk{x} = arith.addi %kb{t}, %off{x} : index",
                      f"        %kp{x} = arith.divui %kk{x}, %c2 : index",
                      *(f"        %br{x}_{j} = arith.addi %row{t}_{j}, %kp{x} : index" for j in range(columns))]
            loads = {("a", 0): f"%a{x}_0 = amx.tile_load %w[%n0, %kk{x}] : {w} into {a_tile}",
                     ("a", 1): f"%a{x}_1 = amx.tile_load %w[%n1, %kk{x}] : {w} into {a_tile}",
                     **{("b", j): f"%b{x}_{j} = amx.tile_load %b[%br{x}_{j}, %c0] : {b} into {a_tile}"
                        for j in range(columns)}}
            for i, j in at:  # each load just before its first product, overlapping the products before it
                lines += [f"        {loads.pop(key)}" for key in (("a", i), ("b", j)) if key in loads]
                lines.append(f"        %s{t}_{i}{j}_{u + 1} = amx.tile_mulf %a{x}_{i}, %b{x}_{j}, %s{t}_{i}{j}_{u}"
                             f" : {a_tile}, {a_tile}, {acc_tile}")
        lines += [f"        amx.tile_store %c[{where[i, j]}], %s{t}_{i}{j}_{unroll} : {c}, {acc_tile}" for i, j in at]
        lines += ["      }", "    }"]
    lines += ["  }", f"  return{' %c : ' + results[0] if results else ''}", "}"]
    return "\n".join(lines)
