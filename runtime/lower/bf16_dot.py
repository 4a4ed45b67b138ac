"""bf16 products of rows by a weight stored along k, on AVX512-BF16 (`vdpbf16ps`).

`vdpbf16ps` adds to each of 16 f32 lanes the products of a pair of adjacent bf16 elements of its
two sources: 32 multiply-adds per instruction, twice an f32 FMA's, and nothing to extend. A
product in dot form (`schedule._dot_form`: rows of `a` [M, K] by a weight `w` [N, K], both
contiguous along k) has its pairs side by side already: each lane of an accumulator sums the
products of its own pairs of k, and one sum across the lanes at the end gives the dot product.
The products of two bf16 values are exact in f32; each step rounds once, as an FMA does; the
instruction treats denormal inputs and results as zero (as AMX and oneDNN's bf16 kernels do).

`kernel` writes the function as MLIR text on tensors, the shape BLIS would give it: for each tile
of COLUMNS columns of the weight (outer: their rows of `w` come from memory once and stay in
L1; rows far apart for a weight larger than the L2, read as COLUMNS sequential streams), tiles
of `rows` rows of `a` (then single rows), each keeping rows x COLUMNS x `vectors` accumulators
in registers while k runs in steps of 32 x `vectors`. Many rows are walked in blocks that stay
in the L2 while every column tile passes (BLIS's mc); a large product gives each thread a chunk
of the columns (an scf.forall). At twice the FMAs' rate and with nothing packed, this beats
packed f32 panels at any number of rows (Zen 4, one thread: 32 x 1024 x 2816 1949 -> 964 us,
eager 999; 512 x 1024 x 1024 9.6 -> 5.4 ms, eager 4.8; a 4-layer bf16 Llama's 32-token prefill
70 -> 34 ms, eager 44.6, two threads 37 -> 18 ms, eager 25.6). The op is MLIR's
`x86vector.avx512.dot`, lowered to LLVM's intrinsic by `convert-vector-to-llvm{enable-x86vector}`.
Used where the target CPU's entry has AVX512-BF16 (`bf16_dot` in opdefs/cpus.yaml).
"""

from __future__ import annotations

from ..cpu import Cpu

LANES = 16  # f32 lanes of a 512-bit accumulator
PAIRS = 2 * LANES  # bf16 elements of k one instruction takes from each source
COLUMNS = 4  # columns of a register tile
ACCUMULATORS = 16  # vector registers of a register tile's accumulators, at most


def available(cpu: Cpu) -> bool:
    """Whether code for `cpu` multiplies bf16 pairs with this kernel."""
    return cpu.bf16_dot == "avx512_bf16"


def fits(m: int, k: int, n: int) -> bool:
    """Shapes the kernel takes: whole column tiles and whole pairs of vectors along k."""
    return m > 0 and n % COLUMNS == 0 and k % PAIRS == 0


def _vectors(k: int, rows: int) -> int:
    """Vectors of k per accumulator of a tile of `rows` rows: as many as the accumulators allow
    that divide k."""
    most = max(1, ACCUMULATORS // (rows * COLUMNS))
    return next(v for v in range(most, 0, -1) if (k // PAIRS) % v == 0)


def kernel(name: str, m: int, k: int, n: int, rows: int, streams: bool, block: int, chunks: int = 1) -> str:
    """MLIR text of `func.func private @name(%a: tensor<m x k x bf16>, %w: tensor<n x k x bf16>,
    %out: tensor<m x n x f32>) -> tensor<m x n x f32>`: out + a @ w^T, register tiles of `rows` rows
    (then single rows) by COLUMNS columns: adjacent rows of `w`, or with `streams` (a weight read
    from memory) rows apart by a quarter of a chunk's columns, each tile's continuing where the
    last one's left off (COLUMNS sequential streams, as `schedule._interleave_streams` reads an
    f32 weight). The tiles of more than `block` rows (a multiple of `rows`) run a block at a
    time, every column tile passing over one block before the next. With `chunks` > 1 (which
    divides n / COLUMNS), an scf.forall gives each thread a chunk of n / chunks columns."""
    out = f"tensor<{m}x{n}xf32>"
    width = n // chunks
    lines = [f"func.func private @{name}(%a: tensor<{m}x{k}xbf16>, %w: tensor<{n}x{k}xbf16>, %out: {out}) -> {out} {{",
             "  %c0 = arith.constant 0 : index", "  %c1 = arith.constant 1 : index",
             f"  %cstep = arith.constant {1 if streams else COLUMNS} : index",
             f"  %cend = arith.constant {width // COLUMNS if streams else width} : index",
             f"  %capart = arith.constant {width // COLUMNS if streams else 1} : index",
             "  %pad = arith.constant 0.0 : bf16", f"  %zero = arith.constant dense<0.0> : vector<{LANES}xf32>",
             f"  %cmain = arith.constant {m // rows * rows} : index", f"  %cblock = arith.constant {block} : index",
             f"  %cm = arith.constant {m} : index"]
    if chunks == 1:
        body, result = _columns("%out", (m, n, k), width, rows)
        lines += ["  %n0 = arith.constant 0 : index", *body, f"  return {result} : {out}", "}"]
        return "\n".join(lines)
    part, at = f"tensor<{m}x{width}xf32>", f"[0, %n0] [{m}, {width}] [1, 1]"
    body, result = _columns("%part", (m, n, k), width, rows)
    lines += [f"  %cwidth = arith.constant {width} : index",
              f"  %chunks = scf.forall (%t) in ({chunks}) shared_outs(%shared = %out) -> ({out}) {{",
              "    %n0 = arith.muli %t, %cwidth : index",
              f"    %part = tensor.extract_slice %shared{at} : {out} to {part}",
              *body, "    scf.forall.in_parallel {",
              f"      tensor.parallel_insert_slice {result} into %shared{at} : {part} into {out}",
              "    }", "  }", f"  return %chunks : {out}", "}"]
    return "\n".join(lines)


def _columns(acc: str, mnk: tuple[int, int, int], width: int, rows: int) -> tuple[list[str], str]:
    """Lines computing `acc` (`width` output columns, the first one %n0's row of `w`) plus its
    products, and their result: blocks of row tiles, then the rows left over, each under a loop
    over the column tiles."""
    m, _, _ = mnk
    out = f"tensor<{m}x{width}xf32>"
    main = m // rows * rows
    lines = []
    if main:
        body, panels = _panels("%ob", out, _row_tiles(rows, "%b", "%bend", mnk, width, "%o"), "    ")
        lines += [f"  %blocks = scf.for %b = %c0 to %cmain step %cblock iter_args(%ob = {acc}) -> ({out}) {{",
                  "    %bnext = arith.addi %b, %cblock : index", "    %bend = arith.minsi %bnext, %cmain : index",
                  *body, f"    scf.yield {panels} : {out}", "  }"]
        acc = "%blocks"
    if main < m:
        body, acc = _panels(acc, out, _row_tiles(1, "%cmain", "%cm", mnk, width, "%o"), "  ")
        lines += body
    return lines, acc


def _panels(acc: str, out: str, tiles: tuple[list[str], str], indent: str) -> tuple[list[str], str]:
    """Lines of the loop over column tiles around `tiles` (the lines of a loop over row tiles,
    and its result), and the loop's result."""
    body, result = tiles
    name = result.replace("%tiles", "%panels")
    return [f"{indent}{name} = scf.for %n = %c0 to %cend step %cstep iter_args(%o = {acc}) -> ({out}) {{",
            *body, f"{indent}  scf.yield {result} : {out}", f"{indent}}}"], name


def _row_tiles(rows: int, start: str, stop: str, mnk: tuple[int, int, int], width: int,
               acc: str) -> tuple[list[str], str]:
    """Lines of a loop over the tiles of `rows` rows from `start` to `stop` (index values) of
    `acc` (`width` columns from %n0), and its result."""
    m, n, k = mnk
    out, a_type, w_type = f"tensor<{m}x{width}xf32>", f"tensor<{m}x{k}xbf16>", f"tensor<{n}x{k}xbf16>"
    vectors = _vectors(k, rows)
    t = f"r{rows}"
    count = rows * COLUMNS * vectors
    vector = f"vector<{LANES}xf32>"
    accs = ", ".join([vector] * count)
    i4, i6, i8 = " " * 4, " " * 6, " " * 8
    lines = [f"{i4}%step{t} = arith.constant {rows} : index", f"{i4}%ck{t} = arith.constant {k} : index",
             f"{i4}%kstep{t} = arith.constant {PAIRS * vectors} : index",
             f"{i4}%tiles{t} = scf.for %m{t} = {start} to {stop} step %step{t}"
             f" iter_args(%x{t} = {acc}) -> ({out}) {{"]
    row = [f"%row{t}_{i}" for i in range(rows)]
    col = [f"%col{t}_{j}" for j in range(COLUMNS)]
    for i in range(rows):
        lines += [f"{i6}%ci{t}_{i} = arith.constant {i} : index",
                  f"{i6}{row[i]} = arith.addi %m{t}, %ci{t}_{i} : index"]
    for j in range(COLUMNS):
        lines += [f"{i6}%cj{t}_{j} = arith.constant {j} : index",
                  f"{i6}%oj{t}_{j} = arith.muli %cj{t}_{j}, %capart : index",
                  f"{i6}{col[j]} = arith.addi %n, %oj{t}_{j} : index",
                  f"{i6}%wr{t}_{j} = arith.addi %n0, {col[j]} : index"]
    names = [[[f"%s{t}_{i}_{j}_{v}" for v in range(vectors)] for j in range(COLUMNS)] for i in range(rows)]
    flat = [s for per_row in names for per_col in per_row for s in per_col]
    lines.append(f"{i6}%dots{t}:{count} = scf.for %k{t} = %c0 to %ck{t} step %kstep{t} iter_args("
                 + ", ".join(f"{s} = %zero" for s in flat) + f") -> ({accs}) {{")
    results = []
    for v in range(vectors):
        lines += [f"{i8}%cv{t}_{v} = arith.constant {PAIRS * v} : index",
                  f"{i8}%kv{t}_{v} = arith.addi %k{t}, %cv{t}_{v} : index"]
        a = [f"%a{t}_{i}_{v}" for i in range(rows)]
        w = [f"%w{t}_{j}_{v}" for j in range(COLUMNS)]
        lines += [f"{i8}{a[i]} = vector.transfer_read %a[{row[i]}, %kv{t}_{v}], %pad {{in_bounds = [true]}}"
                  f" : {a_type}, vector<{PAIRS}xbf16>" for i in range(rows)]
        lines += [f"{i8}{w[j]} = vector.transfer_read %w[%wr{t}_{j}, %kv{t}_{v}], %pad {{in_bounds = [true]}}"
                  f" : {w_type}, vector<{PAIRS}xbf16>" for j in range(COLUMNS)]
    for i in range(rows):
        for j in range(COLUMNS):
            for v in range(vectors):
                lines.append(f"{i8}%d{t}_{i}_{j}_{v} = x86vector.avx512.dot {names[i][j][v]}, %a{t}_{i}_{v}, "
                             f"%w{t}_{j}_{v} : vector<{PAIRS}xbf16> -> {vector}")
                results.append(f"%d{t}_{i}_{j}_{v}")
    lines += [f"{i8}scf.yield {', '.join(results)} : {accs}", f"{i6}}}"]
    current = f"%x{t}"
    for i in range(rows):
        for j in range(COLUMNS):
            parts = [f"%dots{t}#{(i * COLUMNS + j) * vectors + v}" for v in range(vectors)]
            total = parts[0]
            for v, part in enumerate(parts[1:], 1):
                lines.append(f"{i6}%p{t}_{i}_{j}_{v} = arith.addf {total}, {part} : {vector}")
                total = f"%p{t}_{i}_{j}_{v}"
            lines += [f"{i6}%e{t}_{i}_{j} = tensor.extract {current}[{row[i]}, {col[j]}] : {out}",
                      f"{i6}%r{t}_{i}_{j} = vector.reduction <add>, {total}, %e{t}_{i}_{j}"
                      f" fastmath<reassoc> : {vector} into f32",
                      f"{i6}%y{t}_{i}_{j} = tensor.insert %r{t}_{i}_{j} into {current}[{row[i]}, {col[j]}] : {out}"]
            current = f"%y{t}_{i}_{j}"
    lines += [f"{i6}scf.yield {current} : {out}", f"{i4}}}"]
    return lines, f"%tiles{t}"
