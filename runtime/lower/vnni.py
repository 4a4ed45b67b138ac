"""int8 matmuls with a constant second operand on AVX512-VNNI (`vpdpbusd`), for the optimizing pipeline.

`vpdpbusd` adds to each 32-bit lane the sum of 4 products of an unsigned byte of its first
source and a signed byte of its second: 64 multiply-adds per instruction, 4x the f32 FMA's.
After `zero_points.separate_zero_points` an int8 `tosa.matmul` is a plain i8 x i8 -> i32 sum;
with the first operand made unsigned (a + 128, a bitwise xor of its sign bit),

    sum_k a[k] * b[k] = sum_k (a[k] + 128) * b[k] - 128 * sum_k b[k]

where the last term is a constant per column when b is (the frozen weight). The kernel is a
private function on tensors (`_kernel`): for each 32-column panel of b, packed at compile time
as [K/4][N][4] bytes (4 consecutive k of a column side by side, one vector of 64 bytes per 16
columns), 8 rows at a time keep 8 x 2 accumulators of 16 lanes in registers while k runs in
steps of 4 (one 4-byte broadcast of a per row); the rows left over run one at a time. K is
padded to a multiple of 4 with zeros (in b; a's padding is multiplied by them). Each lane
sums int8 products in i32 exactly as TOSA's accumulator (wrapping modulo 2^32, which sums of
this size never reach). Used where the target CPU's entry has AVX512-VNNI (opdefs/cpus.yaml);
elsewhere `float_int8` runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from mlir import ir

from ..cpu import Cpu

ROWS = 8  # rows of a register tile
LANES = 16  # i32 lanes of a 512-bit vector
PANEL = 2 * LANES  # columns of a register tile
INSTRUCTION = "torchtosa_vpdpbusd"  # the placeholder function of the instruction


def available(cpu: Cpu) -> bool:
    """Whether code for `cpu` uses this kernel: its int8 dot product is AVX512-VNNI's."""
    return cpu.int8_dot == "avx512_vnni"


def fits(m: int, k: int, n: int) -> bool:
    """Shapes the kernel takes: whole 16-column vectors."""
    return n % LANES == 0 and m > 0 and k > 0


def pack(b: np.ndarray) -> np.ndarray:
    """A constant [K, N] int8 operand as [K4, N * 4] (K4 = K / 4 rounded up, zero rows added):
    row k4 holds, for each column n, b[4 k4 .. 4 k4 + 3, n] side by side."""
    k, n = b.shape
    k4 = math.ceil(k / 4)
    padded = np.zeros((k4 * 4, n), dtype=np.int8)
    padded[:k] = b
    return np.ascontiguousarray(padded.reshape(k4, 4, n).transpose(0, 2, 1).reshape(k4, n * 4))


def kernel(name: str, m: int, k4: int, n: int) -> str:
    """MLIR text of `func.func private @name(%a: tensor<m x 4k4 x i8> (unsigned bytes),
    %b: tensor<k4 x 4n x i8> (packed), %out: tensor<1 x m x n x i32>) -> tensor<1 x m x n x i32>`:
    a loop over 32-column panels (then one of 16 if n is not a multiple of 32), each running
    8-row tiles, then the rows left over one at a time (`_rows`)."""
    t = _Types(f"tensor<{m}x{4 * k4}xi8>", f"tensor<{k4}x{n * 4}xi8>", f"tensor<1x{m}x{n}xi32>", None)
    return _function(name, t, n, [f"  %ck4 = arith.constant {k4} : index"],
                     lambda columns, acc, tag, indent: _rows(t, m, columns, acc, tag, indent))


def conv_kernel(name: str, x: tuple[int, int, int, int], out: tuple[int, int, int, int], kh: int, kw: int) -> str:
    """MLIR text of `func.func private @name(%a: tensor<x> (NHWC, padded, unsigned bytes, C a
    multiple of 4), %b: tensor<(kh * kw * C / 4) x 4F x i8> (packed), %out: tensor<out>)`: a
    stride-1 convolution read straight from the input, each output row (n, oh) tiled along ow
    like a matmul's rows, k running over (kh, kw, 4 channels)."""
    batch, oh, ow, f = out
    c4 = x[3] // 4
    t = _Types(f"tensor<{'x'.join(map(str, x))}xi8>", f"tensor<{kh * kw * c4}x{f * 4}xi8>",
               f"tensor<{'x'.join(map(str, out))}xi32>", (kh, kw))

    def rows(columns: list[str], acc: str, tag: str, indent: str) -> tuple[list[str], str]:
        lines = [f"{indent}%img{tag} = scf.for %nn = %c0 to %cbatch step %c1"
                 f" iter_args(%i{tag} = {acc}) -> ({t.out}) {{",
                 f"{indent}  %line{tag} = scf.for %oh = %c0 to %coh step %c1"
                 f" iter_args(%l{tag} = %i{tag}) -> ({t.out}) {{"]
        body, value = _rows(t, ow, columns, f"%l{tag}", tag, indent + "    ")
        lines += [*body, f"{indent}    scf.yield {value} : {t.out}", f"{indent}  }}",
                  f"{indent}  scf.yield %line{tag} : {t.out}", f"{indent}}}"]
        return lines, f"%img{tag}"

    constants = [f"  %ck4 = arith.constant {c4} : index", f"  %ckh = arith.constant {kh} : index",
                 f"  %ckw = arith.constant {kw} : index", f"  %cbatch = arith.constant {batch} : index",
                 f"  %coh = arith.constant {oh} : index"]
    return _function(name, t, f, constants, rows)


class _Types:
    def __init__(self, a: str, b: str, out: str, window: tuple[int, int] | None) -> None:
        self.a, self.b, self.out = a, b, out
        self.window = window  # a convolution's (kh, kw); None for a matmul
        self.v32, self.v64 = f"vector<{LANES}xi32>", f"vector<{4 * LANES}xi8>"


def _function(name: str, t: _Types, n: int, constants: list[str],
              rows: Callable[[list[str], str, str, str], tuple[list[str], str]]) -> str:
    lines = [f"func.func private @{name}(%a: {t.a}, %b: {t.b}, %out: {t.out}) -> {t.out} {{",
             "  %c0 = arith.constant 0 : index", "  %c1 = arith.constant 1 : index",
             "  %c4 = arith.constant 4 : index", f"  %c16 = arith.constant {LANES} : index",
             f"  %c32 = arith.constant {PANEL} : index", *constants,
             "  %p8 = arith.constant 0 : i8", f"  %zero = arith.constant dense<0> : {t.v32}"]
    full = n // PANEL * PANEL
    result = "%out"
    if full:
        lines += [f"  %cfull = arith.constant {full} : index",
                  f"  %panels = scf.for %n = %c0 to %cfull step %c32 iter_args(%o = %out) -> ({t.out}) {{",
                  "    %n16 = arith.addi %n, %c16 : index"]
        body, value = rows(["%n", "%n16"], "%o", "p", "    ")
        lines += [*body, f"    scf.yield {value} : {t.out}", "  }"]
        result = "%panels"
    if n % PANEL:
        lines.append(f"  %nlast = arith.constant {full} : index")
        body, result = rows(["%nlast"], result, "q", "  ")
        lines += body
    lines += [f"  return {result} : {t.out}", "}"]
    return "\n".join(lines)


def _rows(t: _Types, m: int, columns: list[str], acc: str, tag: str, indent: str) -> tuple[list[str], str]:
    """Lines computing the output columns starting at `columns` (one vector of 16 each) for all
    rows: tiles of ROWS rows, then single rows; and the output tensor after them."""
    lines: list[str] = []
    main = m // ROWS * ROWS
    for rows, start, stop in ((ROWS, 0, main), (1, main, m)):
        if start == stop:
            continue
        tile = f"{tag}{rows}"
        lines += [f"{indent}%start{tile} = arith.constant {start} : index",
                  f"{indent}%stop{tile} = arith.constant {stop} : index",
                  f"{indent}%step{tile} = arith.constant {rows} : index",
                  f"{indent}%rows{tile} = scf.for %m{tile} = %start{tile} to %stop{tile} step %step{tile}"
                  f" iter_args(%w{tile} = {acc}) -> ({t.out}) {{"]
        lines += _tile(t, rows, columns, tile, indent + "  ")
        lines.append(f"{indent}}}")
        acc = f"%rows{tile}"
    return lines, acc


def _tile(t: _Types, rows: int, columns: list[str], tile: str, indent: str) -> list[str]:
    """The body of a row loop: `rows` x len(columns) accumulators over k in steps of 4, stored."""
    count = rows * len(columns)
    accs = [f"%s{tile}_{j}" for j in range(count)]
    vectors = ", ".join([t.v32] * count)
    lines = [f"{indent}%row{tile}_0 = arith.addi %m{tile}, %c0 : index"]
    for i in range(1, rows):
        lines += [f"{indent}%ci{tile}_{i} = arith.constant {i} : index",
                  f"{indent}%row{tile}_{i} = arith.addi %m{tile}, %ci{tile}_{i} : index"]
    if t.window is None:  # one loop over k / 4
        inner = indent + "  "
        lines += [f"{indent}%acc{tile}:{count} = scf.for %k{tile} = %c0 to %ck4 step %c1 iter_args("
                  + ", ".join(f"{a} = %zero" for a in accs) + f") -> ({vectors}) {{",
                  f"{inner}%ka{tile} = arith.muli %k{tile}, %c4 : index"]
        packed_row = f"%k{tile}"

        def a_index(i: int) -> str:
            return f"%row{tile}_{i}, %ka{tile}"
        closing = [f"{indent}}}"]
    else:  # loops over kh, kw, channels / 4
        outer, middle = [f"%h{tile}_{j}" for j in range(count)], [f"%q{tile}_{j}" for j in range(count)]
        i2, i3, inner = indent + "  ", indent + "    ", indent + "      "
        lines += [f"{indent}%acc{tile}:{count} = scf.for %kh{tile} = %c0 to %ckh step %c1 iter_args("
                  + ", ".join(f"{a} = %zero" for a in outer) + f") -> ({vectors}) {{",
                  f"{i2}%y{tile} = arith.addi %oh, %kh{tile} : index",
                  f"{i2}%khw{tile} = arith.muli %kh{tile}, %ckw : index",
                  f"{i2}%accw{tile}:{count} = scf.for %kw{tile} = %c0 to %ckw step %c1 iter_args("
                  + ", ".join(f"{a} = {o}" for a, o in zip(middle, outer, strict=True)) + f") -> ({vectors}) {{",
                  f"{i3}%tap{tile} = arith.addi %khw{tile}, %kw{tile} : index",
                  f"{i3}%base{tile} = arith.muli %tap{tile}, %ck4 : index"]
        lines += [f"{i3}%x{tile}_{i} = arith.addi %row{tile}_{i}, %kw{tile} : index" for i in range(rows)]
        lines += [f"{i3}%accc{tile}:{count} = scf.for %kc{tile} = %c0 to %ck4 step %c1 iter_args("
                  + ", ".join(f"{a} = {q}" for a, q in zip(accs, middle, strict=True)) + f") -> ({vectors}) {{",
                  f"{inner}%ka{tile} = arith.muli %kc{tile}, %c4 : index",
                  f"{inner}%kb{tile} = arith.addi %base{tile}, %kc{tile} : index"]
        packed_row = f"%kb{tile}"

        def a_index(i: int) -> str:
            return f"%nn, %y{tile}, %x{tile}_{i}, %ka{tile}"
        closing = [f"{i3}}}", f"{i3}scf.yield " + ", ".join(f"%accc{tile}#{j}" for j in range(count)) + f" : {vectors}",
                   f"{i2}}}", f"{i2}scf.yield " + ", ".join(f"%accw{tile}#{j}" for j in range(count)) + f" : {vectors}",
                   f"{indent}}}"]
    for v, column in enumerate(columns):  # 16 columns x 4 k of the packed operand: 64 bytes
        lines += [f"{inner}%bc{tile}_{v} = arith.muli {column}, %c4 : index",
                  f"{inner}%b{tile}_{v} = vector.transfer_read %b[{packed_row}, %bc{tile}_{v}], %p8"
                  f" {{in_bounds = [true]}} : {t.b}, {t.v64}"]
    results = []
    for i in range(rows):  # 4 bytes of a row (4 k), broadcast to every lane
        lines += [f"{inner}%ab{tile}_{i} = vector.transfer_read %a[{a_index(i)}], %p8"
                  f" {{in_bounds = [true]}} : {t.a}, vector<4xi8>",
                  f"{inner}%ai{tile}_{i} = vector.bitcast %ab{tile}_{i} : vector<4xi8> to vector<1xi32>",
                  f"{inner}%as{tile}_{i} = vector.extract %ai{tile}_{i}[0] : i32 from vector<1xi32>",
                  f"{inner}%aw{tile}_{i} = vector.broadcast %as{tile}_{i} : i32 to {t.v32}",
                  f"{inner}%a{tile}_{i} = vector.bitcast %aw{tile}_{i} : {t.v32} to {t.v64}"]
        for v in range(len(columns)):
            j = i * len(columns) + v
            lines.append(f"{inner}%d{tile}_{j} = func.call @{INSTRUCTION}({accs[j]}, %a{tile}_{i}, %b{tile}_{v})"
                         f" : ({t.v32}, {t.v64}, {t.v64}) -> {t.v32}")
            results.append(f"%d{tile}_{j}")
    lines += [f"{inner}scf.yield {', '.join(results)} : {vectors}", *closing]
    current = f"%w{tile}"
    for i in range(rows):
        for v, column in enumerate(columns):
            j = i * len(columns) + v
            where = f"%c0, %row{tile}_{i}" if t.window is None else f"%nn, %oh, %row{tile}_{i}"
            lines.append(f"{indent}%o{tile}_{j} = vector.transfer_write %acc{tile}#{j}, {current}"
                         f"[{where}, {column}] {{in_bounds = [true]}} : {t.v32}, {t.out}")
            current = f"%o{tile}_{j}"
    lines.append(f"{indent}scf.yield {current} : {t.out}")
    return lines


def declaration() -> str:
    """The function that stands for the instruction until `lower_calls` (the buffer
    deallocation passes reject an intrinsic call, an op of unknown memory effects)."""
    v32, v64 = f"vector<{LANES}xi32>", f"vector<{4 * LANES}xi8>"
    return f"func.func private @{INSTRUCTION}({v32}, {v64}, {v64}) -> {v32}"


def lower_calls(module: ir.Module) -> None:
    """Replace each call of the placeholder by the instruction's LLVM intrinsic (after bufferization)."""
    from .irutil import find_ops

    calls = find_ops(module, lambda op: op.name == "func.call"
                     and ir.FlatSymbolRefAttr(op.attributes["callee"]).value == INSTRUCTION)
    with module.context:
        for call in calls:
            with call.location:
                new = ir.Operation.create(
                    "llvm.call_intrinsic", results=[call.results[0].type], operands=list(call.operands),
                    attributes={"intrin": ir.StringAttr.get("llvm.x86.avx512.vpdpbusd.512"),
                                "op_bundle_sizes": ir.DenseI32ArrayAttr.get([]),
                                "operandSegmentSizes": ir.DenseI32ArrayAttr.get([3, 0])},
                    ip=ir.InsertionPoint(call))
            call.results[0].replace_all_uses_with(new.results[0])
            call.erase()
    for op in list(module.body.operations):
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == INSTRUCTION:
            op.erase()
