"""int8 matmuls and stride-1 convolutions with a constant second operand on an int8 dot-product
instruction, for the optimizing pipeline.

The instructions (`DOTS`, one per value of the CPU table's `int8_dot`) add to each 32-bit lane
the sum of `group` products of consecutive k, exactly in i32:

- avx512_vnni and avx_vnni: `vpdpbusd` (512 bit; AVX-VNNI's VEX form, 256 bit, on cores without
  AVX-512 such as Intel's Alder Lake), 4 products of an unsigned byte of its first source and a
  signed byte of its second, added to its accumulator: 64 (32) multiply-adds per instruction, 4x
  an f32 FMA's. With
  the first operand made unsigned (a + 128, a bitwise xor of its sign bit),

      sum_k a[k] * b[k] = sum_k (a[k] + 128) * b[k] - 128 * sum_k b[k]

  where the last term is a constant per column when b is (the frozen weight);
- avx512bw and avx2: `vpmaddwd` (512 or 256 bit), 2 products of signed 16-bit values (both
  operands sign-extended from int8), then an add: twice an f32 FMA's products per instruction,
  the add issuing beside it. (`vpmaddubsw`, 32 products of bytes, saturates its 16-bit sums:
  not exact.)
- asimddp (Armv8.2's dot product: Neoverse N1/V1, Cortex-A76): `sdot`, 4 products of signed
  bytes added to each lane of its accumulator: 16 multiply-adds per 128-bit instruction, 4x an
  f32 FMA's.

After `zero_points.separate_zero_points` an int8 `tosa.matmul` is a plain i8 x i8 -> i32 sum.
The kernel is a private function on tensors (`kernel`): for each panel of two vectors of columns
of b, packed at compile time as [N/panel][K/g][panel][g] (`pack`; g = group: g consecutive k of a
column side by side, one vector per `lanes` columns), `rows` rows at a time (`Dot.rows`, from
the register file) keep rows x 2 accumulators in registers
while k runs in steps of g (one g-element broadcast of a per row); the rows left over run one at
a time. K is padded to a multiple of g with zeros (in b; a's padding is multiplied by them). Each
lane sums int8 products in i32 exactly as TOSA's accumulator (wrapping modulo 2^32, which sums
of this size never reach). Used where the target CPU's entry names the instruction
(opdefs/cpus.yaml); elsewhere `float_int8`'s exact f32 chunks run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from mlir import ir

from ..cpu import Cpu

VECTORS = 2  # vectors of columns in a register tile
MAX_ROWS = 8  # rows of a register tile, at most


@dataclass(frozen=True)
class Dot:
    """An int8 dot-product instruction as the kernels use it."""

    name: str  # the CPU table's int8_dot
    bits: int  # vector width
    group: int  # consecutive k one i32 lane sums
    intrinsic: str  # LLVM's intrinsic
    accumulates: bool  # adds to its first operand (else an add follows)
    unsigned: bool  # reads its first operand's bytes unsigned: a + 128, corrected by 128 x column sums

    @property
    def lanes(self) -> int:
        """i32 lanes of one vector: the columns one vector of b holds."""
        return self.bits // 32

    @property
    def element(self) -> int:
        """Bits of an operand element: 8 (bytes) or 16 (int8 sign-extended)."""
        return 32 // self.group

    @property
    def panel(self) -> int:
        """Columns of a register tile."""
        return VECTORS * self.lanes

    @property
    def placeholder(self) -> str:
        """The function standing for the instruction until `lower_calls`."""
        return f"torchtosa_{self.name}"

    def rows(self, cpu: Cpu) -> int:
        """Rows of a register tile: its accumulators (VECTORS per row), b's VECTORS vectors, a's
        broadcast and, for an instruction that doesn't accumulate, its product fit `cpu`'s
        vector registers (BLIS's mr from the register file)."""
        spare = cpu.vector_registers - VECTORS - 1 - (0 if self.accumulates else 1)
        return max(1, min(MAX_ROWS, spare // VECTORS))

    def fits(self, m: int, k: int, n: int) -> bool:
        """Shapes the kernel takes: whole vectors of columns."""
        return n % self.lanes == 0 and m > 0 and k > 0


DOTS = {d.name: d for d in (
    Dot("avx512_vnni", 512, 4, "llvm.x86.avx512.vpdpbusd.512", accumulates=True, unsigned=True),
    Dot("avx_vnni", 256, 4, "llvm.x86.avx512.vpdpbusd.256", accumulates=True, unsigned=True),
    Dot("avx512bw", 512, 2, "llvm.x86.avx512.pmaddw.d.512", accumulates=False, unsigned=False),
    Dot("avx2", 256, 2, "llvm.x86.avx2.pmadd.wd", accumulates=False, unsigned=False),
    Dot("asimddp", 128, 4, "llvm.aarch64.neon.sdot.v4i32.v16i8", accumulates=True, unsigned=False),
)}


def for_cpu(cpu: Cpu) -> Dot | None:
    """The int8 dot product code for `cpu` uses (None: f32 emulation)."""
    return DOTS.get(cpu.int8_dot)


def pack(b: np.ndarray, dot: Dot) -> np.ndarray:
    """A constant [K, N] int8 operand as [P, KG, panel * g] (g = dot.group, KG = K / g and P =
    N / dot.panel rounded up, zeros added), of the instruction's element type: panel p, row kg
    holds, for each of the panel's columns n, b[g kg .. g kg + g - 1, n] side by side. A panel is
    contiguous, as BLIS packs: the kernel's loop over k reads it front to back (rows N g elements
    apart, a multiple of 4 KiB for a wide N, all fell in one set of the L1 cache)."""
    k, n = b.shape
    g, panel = dot.group, dot.panel
    kg, panels = math.ceil(k / g), math.ceil(n / panel)
    padded = np.zeros((kg * g, panels * panel), dtype=np.int8 if dot.element == 8 else np.int16)
    padded[:k, :n] = b
    return np.ascontiguousarray(padded.reshape(kg, g, panels, panel).transpose(2, 0, 3, 1)
                                .reshape(panels, kg, panel * g))


def kernel(name: str, dot: Dot, rows: int, m: int, kg: int, n: int) -> str:
    """MLIR text of `func.func private @name(%a: tensor<m x g kg x iE> (bytes unsigned for an
    instruction that reads them so), %b: tensor<P x kg x g panel x iE> (`pack`ed), %out:
    tensor<1 x m x n x i32>) -> tensor<1 x m x n x i32>` (g = dot.group, E = dot.element): a loop over panels of
    two vectors of columns (then one of a vector if n is not a whole number of panels), each
    running tiles of `rows` rows, then the rows left over one at a time (`_rows`)."""
    g, e = dot.group, dot.element
    t = _Types(dot, rows, f"tensor<{m}x{g * kg}xi{e}>", f"tensor<{-(-n // dot.panel)}x{kg}x{dot.panel * g}xi{e}>",
               f"tensor<1x{m}x{n}xi32>", None)
    return _function(name, t, n, [f"  %ckg = arith.constant {kg} : index"],
                     lambda columns, panel, acc, tag, indent: _rows(t, m, columns, panel, acc, tag, indent))


def conv_kernel(name: str, dot: Dot, rows: int, x: tuple[int, int, int, int], out: tuple[int, int, int, int],
                kh: int, kw: int) -> str:
    """MLIR text of `func.func private @name(%a: tensor<x> (NHWC, padded, of the instruction's
    element type, C a multiple of g), %b: tensor<P x (kh * kw * C / g) x g panel x iE> (packed), %out:
    tensor<out>)`: a stride-1 convolution read straight from the input, each output row (n, oh)
    tiled along ow like a matmul's rows, k running over (kh, kw, g channels)."""
    batch, oh, ow, f = out
    g, e = dot.group, dot.element
    cg = x[3] // g
    t = _Types(dot, rows, f"tensor<{'x'.join(map(str, x))}xi{e}>",
               f"tensor<{-(-f // dot.panel)}x{kh * kw * cg}x{dot.panel * g}xi{e}>",
               f"tensor<{'x'.join(map(str, out))}xi32>", (kh, kw))

    def row_loops(columns: list[str], panel: str, acc: str, tag: str, indent: str) -> tuple[list[str], str]:
        lines = [f"{indent}%img{tag} = scf.for %nn = %c0 to %cbatch step %c1"
                 f" iter_args(%i{tag} = {acc}) -> ({t.out}) {{",
                 f"{indent}  %line{tag} = scf.for %oh = %c0 to %coh step %c1"
                 f" iter_args(%l{tag} = %i{tag}) -> ({t.out}) {{"]
        body, value = _rows(t, ow, columns, panel, f"%l{tag}", tag, indent + "    ")
        lines += [*body, f"{indent}    scf.yield {value} : {t.out}", f"{indent}  }}",
                  f"{indent}  scf.yield %line{tag} : {t.out}", f"{indent}}}"]
        return lines, f"%img{tag}"

    constants = [f"  %ckg = arith.constant {cg} : index", f"  %ckh = arith.constant {kh} : index",
                 f"  %ckw = arith.constant {kw} : index", f"  %cbatch = arith.constant {batch} : index",
                 f"  %coh = arith.constant {oh} : index"]
    return _function(name, t, f, constants, row_loops)


class _Types:
    def __init__(self, dot: Dot, rows: int, a: str, b: str, out: str, window: tuple[int, int] | None) -> None:
        self.dot, self.rows = dot, rows
        self.a, self.b, self.out = a, b, out
        self.window = window  # a convolution's (kh, kw); None for a matmul
        self.element = f"i{dot.element}"
        self.acc = f"vector<{dot.lanes}xi32>"
        self.operand = f"vector<{dot.lanes * dot.group}x{self.element}>"  # g k of each column of a vector


def _function(name: str, t: _Types, n: int, constants: list[str],
              rows: Callable[[list[str], str, str, str, str], tuple[list[str], str]]) -> str:
    dot = t.dot
    lines = [f"func.func private @{name}(%a: {t.a}, %b: {t.b}, %out: {t.out}) -> {t.out} {{",
             "  %c0 = arith.constant 0 : index", "  %c1 = arith.constant 1 : index",
             f"  %cg = arith.constant {dot.group} : index", f"  %clanes = arith.constant {dot.lanes} : index",
             f"  %cpanel = arith.constant {dot.panel} : index",
             *(f"  %cv{v} = arith.constant {v * dot.lanes * dot.group} : index" for v in range(VECTORS)),
             *constants,
             f"  %pad = arith.constant 0 : {t.element}", f"  %zero = arith.constant dense<0> : {t.acc}"]
    full = n // dot.panel * dot.panel
    result = "%out"
    if full:
        lines += [f"  %cfull = arith.constant {full // dot.panel} : index",
                  f"  %panels = scf.for %pn = %c0 to %cfull step %c1 iter_args(%o = %out) -> ({t.out}) {{",
                  "    %n = arith.muli %pn, %cpanel : index",
                  "    %n1 = arith.addi %n, %clanes : index"]
        body, value = rows(["%n", "%n1"], "%pn", "%o", "p", "    ")
        lines += [*body, f"    scf.yield {value} : {t.out}", "  }"]
        result = "%panels"
    if n % dot.panel:
        lines += [f"  %nlast = arith.constant {full} : index",
                  f"  %plast = arith.constant {full // dot.panel} : index"]
        body, result = rows(["%nlast"], "%plast", result, "q", "  ")
        lines += body
    lines += [f"  return {result} : {t.out}", "}"]
    return "\n".join(lines)


def _rows(t: _Types, m: int, columns: list[str], panel: str, acc: str, tag: str, indent: str) -> tuple[list[str], str]:
    """Lines computing the output columns starting at `columns` (one vector each, of b's packed
    panel `panel`) for all rows: tiles of `t.rows` rows, then single rows; and the output tensor
    after them."""
    lines: list[str] = []
    main = m // t.rows * t.rows
    for rows, start, stop in ((t.rows, 0, main), (1, main, m)):
        if start == stop:
            continue
        tile = f"{tag}{rows}"
        lines += [f"{indent}%start{tile} = arith.constant {start} : index",
                  f"{indent}%stop{tile} = arith.constant {stop} : index",
                  f"{indent}%step{tile} = arith.constant {rows} : index",
                  f"{indent}%rows{tile} = scf.for %m{tile} = %start{tile} to %stop{tile} step %step{tile}"
                  f" iter_args(%w{tile} = {acc}) -> ({t.out}) {{"]
        lines += _tile(t, rows, columns, panel, tile, indent + "  ")
        lines.append(f"{indent}}}")
        acc = f"%rows{tile}"
    return lines, acc


def _tile(t: _Types, rows: int, columns: list[str], panel: str, tile: str, indent: str) -> list[str]:
    """The body of a row loop: `rows` x len(columns) accumulators over k in steps of g, stored."""
    dot = t.dot
    count = rows * len(columns)
    accs = [f"%s{tile}_{j}" for j in range(count)]
    vectors = ", ".join([t.acc] * count)
    lines = [f"{indent}%row{tile}_0 = arith.addi %m{tile}, %c0 : index"]
    for i in range(1, rows):
        lines += [f"{indent}%ci{tile}_{i} = arith.constant {i} : index",
                  f"{indent}%row{tile}_{i} = arith.addi %m{tile}, %ci{tile}_{i} : index"]
    if t.window is None:  # one loop over k / g
        inner = indent + "  "
        lines += [f"{indent}%acc{tile}:{count} = scf.for %k{tile} = %c0 to %ckg step %c1 iter_args("
                  + ", ".join(f"{a} = %zero" for a in accs) + f") -> ({vectors}) {{",
                  f"{inner}%ka{tile} = arith.muli %k{tile}, %cg : index"]
        packed_row = f"%k{tile}"

        def a_index(i: int) -> str:
            return f"%row{tile}_{i}, %ka{tile}"
        closing = [f"{indent}}}"]
    else:  # loops over kh, kw, channels / g
        outer, middle = [f"%h{tile}_{j}" for j in range(count)], [f"%q{tile}_{j}" for j in range(count)]
        i2, i3, inner = indent + "  ", indent + "    ", indent + "      "
        lines += [f"{indent}%acc{tile}:{count} = scf.for %kh{tile} = %c0 to %ckh step %c1 iter_args("
                  + ", ".join(f"{a} = %zero" for a in outer) + f") -> ({vectors}) {{",
                  f"{i2}%y{tile} = arith.addi %oh, %kh{tile} : index",
                  f"{i2}%khw{tile} = arith.muli %kh{tile}, %ckw : index",
                  f"{i2}%accw{tile}:{count} = scf.for %kw{tile} = %c0 to %ckw step %c1 iter_args("
                  + ", ".join(f"{a} = {o}" for a, o in zip(middle, outer, strict=True)) + f") -> ({vectors}) {{",
                  f"{i3}%tap{tile} = arith.addi %khw{tile}, %kw{tile} : index",
                  f"{i3}%base{tile} = arith.muli %tap{tile}, %ckg : index"]
        lines += [f"{i3}%x{tile}_{i} = arith.addi %row{tile}_{i}, %kw{tile} : index" for i in range(rows)]
        lines += [f"{i3}%accc{tile}:{count} = scf.for %kc{tile} = %c0 to %ckg step %c1 iter_args("
                  + ", ".join(f"{a} = {q}" for a, q in zip(accs, middle, strict=True)) + f") -> ({vectors}) {{",
                  f"{inner}%ka{tile} = arith.muli %kc{tile}, %cg : index",
                  f"{inner}%kb{tile} = arith.addi %base{tile}, %kc{tile} : index"]
        packed_row = f"%kb{tile}"

        def a_index(i: int) -> str:
            return f"%nn, %y{tile}, %x{tile}_{i}, %ka{tile}"
        closing = [f"{i3}}}", f"{i3}scf.yield " + ", ".join(f"%accc{tile}#{j}" for j in range(count)) + f" : {vectors}",
                   f"{i2}}}", f"{i2}scf.yield " + ", ".join(f"%accw{tile}#{j}" for j in range(count)) + f" : {vectors}",
                   f"{indent}}}"]
    for v in range(len(columns)):  # `lanes` columns x g k of the packed panel: one vector
        lines.append(f"{inner}%b{tile}_{v} = vector.transfer_read %b[{panel}, {packed_row}, %cv{v}], %pad"
                     f" {{in_bounds = [true]}} : {t.b}, {t.operand}")
    results = []
    for i in range(rows):  # g elements of a row (32 bits), broadcast to every lane
        lines += [f"{inner}%ab{tile}_{i} = vector.transfer_read %a[{a_index(i)}], %pad"
                  f" {{in_bounds = [true]}} : {t.a}, vector<{dot.group}x{t.element}>",
                  f"{inner}%ai{tile}_{i} = vector.bitcast %ab{tile}_{i} : vector<{dot.group}x{t.element}>"
                  " to vector<1xi32>",
                  f"{inner}%as{tile}_{i} = vector.extract %ai{tile}_{i}[0] : i32 from vector<1xi32>",
                  f"{inner}%aw{tile}_{i} = vector.broadcast %as{tile}_{i} : i32 to {t.acc}",
                  f"{inner}%a{tile}_{i} = vector.bitcast %aw{tile}_{i} : {t.acc} to {t.operand}"]
        for v in range(len(columns)):
            j = i * len(columns) + v
            if dot.accumulates:
                lines.append(f"{inner}%d{tile}_{j} = func.call @{dot.placeholder}({accs[j]}, %a{tile}_{i}, "
                             f"%b{tile}_{v}) : ({t.acc}, {t.operand}, {t.operand}) -> {t.acc}")
            else:
                lines += [f"{inner}%p{tile}_{j} = func.call @{dot.placeholder}(%a{tile}_{i}, %b{tile}_{v})"
                          f" : ({t.operand}, {t.operand}) -> {t.acc}",
                          f"{inner}%d{tile}_{j} = arith.addi {accs[j]}, %p{tile}_{j} : {t.acc}"]
            results.append(f"%d{tile}_{j}")
    lines += [f"{inner}scf.yield {', '.join(results)} : {vectors}", *closing]
    current = f"%w{tile}"
    for i in range(rows):
        for v, column in enumerate(columns):
            j = i * len(columns) + v
            where = f"%c0, %row{tile}_{i}" if t.window is None else f"%nn, %oh, %row{tile}_{i}"
            lines.append(f"{indent}%o{tile}_{j} = vector.transfer_write %acc{tile}#{j}, {current}"
                         f"[{where}, {column}] {{in_bounds = [true]}} : {t.acc}, {t.out}")
            current = f"%o{tile}_{j}"
    lines.append(f"{indent}scf.yield {current} : {t.out}")
    return lines


def declaration(dot: Dot) -> str:
    """The function that stands for the instruction until `lower_calls` (the buffer
    deallocation passes reject an intrinsic call, an op of unknown memory effects)."""
    acc = f"vector<{dot.lanes}xi32>"
    operand = f"vector<{dot.lanes * dot.group}xi{dot.element}>"
    operands = [acc, operand, operand] if dot.accumulates else [operand, operand]
    return f"func.func private @{dot.placeholder}({', '.join(operands)}) -> {acc}"


def lower_calls(module: ir.Module) -> None:
    """Replace each call of an instruction's placeholder by its LLVM intrinsic (after bufferization)."""
    from .irutil import find_ops

    placeholders = {dot.placeholder: dot for dot in DOTS.values()}
    calls = find_ops(module, lambda op: op.name == "func.call"
                     and ir.FlatSymbolRefAttr(op.attributes["callee"]).value in placeholders)
    with module.context:
        for call in calls:
            dot = placeholders[ir.FlatSymbolRefAttr(call.attributes["callee"]).value]
            with call.location:
                new = ir.Operation.create(
                    "llvm.call_intrinsic", results=[call.results[0].type], operands=list(call.operands),
                    attributes={"intrin": ir.StringAttr.get(dot.intrinsic),
                                "op_bundle_sizes": ir.DenseI32ArrayAttr.get([]),
                                "operandSegmentSizes": ir.DenseI32ArrayAttr.get([len(list(call.operands)), 0])},
                    ip=ir.InsertionPoint(call))
            call.results[0].replace_all_uses_with(new.results[0])
            call.erase()
    for op in list(module.body.operations):
        if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value in placeholders:
            op.erase()
