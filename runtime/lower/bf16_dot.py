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


# Products of many rows by a short k go in panel form instead (`panel_kernel`): the dot form ends
# each output element with a sum across an accumulator's lanes, as costly as 2-3 steps of k, which
# a short k cannot amortize (a ConvNeXt block's 96 channels: 3 steps). Zen 4, one thread, eager's
# time in brackets, ms: 3136 x 96 x 384 3.12 -> 1.50 (1.20), 3136 x 384 x 96 1.46 -> 1.17 (1.14),
# 784 x 768 x 192 1.35 -> 1.20 (1.23), 197 x 768 x 3072 even (5.97, 5.24); from k = 1024, where
# a panel's weight no longer stays near the core while its rows pass, the dot form is faster
# (256 x 1024 x 1024 2.80 against 3.68, 2.58).
PANEL_MIN_ROWS = 64
PANEL_MAX_ROWS = 8  # rows of a panel-form register tile, at most


def panel_fits(m: int, k: int, n: int, l1_bytes: int) -> bool:
    """Shapes `panel_kernel` takes and is the faster kernel for: from PANEL_MIN_ROWS rows, whole
    vectors of columns, pairs of k, and a weight panel of 4 vectors of columns at most twice
    `l1_bytes` (the L1 data cache: k up to 512 with Zen 4's 32 KiB)."""
    return m >= PANEL_MIN_ROWS and n % LANES == 0 and k % 2 == 0 and 4 * LANES * k * 2 <= 2 * l1_bytes


def panel_tile(n: int, registers: int) -> tuple[int, int]:
    """(rows, vectors of columns) of a panel-form register tile: the most vectors of columns (up
    to 4) that divide n's, then the most rows whose accumulators fit in `registers` beside a
    register per vector of the weight and one for a row's broadcast pair."""
    vectors = next(c for c in (4, 3, 2, 1) if (n // LANES) % c == 0)
    return min(PANEL_MAX_ROWS, (registers - vectors - 1) // vectors), vectors


def packed_shape(k: int, n: int, vectors: int) -> list[int]:
    """The shape of a weight [n, k] as `panel_kernel` reads it: per panel of `vectors` x LANES
    columns, per pair of k, the panel's columns' pairs side by side
    (`wp[c // cols, p, 2 (c % cols) + i] = w[c, 2 p + i]`): a panel's weight is one stream."""
    cols = vectors * LANES
    return [n // cols, k // 2, 2 * cols]


def _packed_type(k: int, n: int, vectors: int) -> str:
    return f"tensor<{'x'.join(map(str, packed_shape(k, n, vectors)))}xbf16>"


def panel_kernel(name: str, m: int, k: int, n: int, rows: int, vectors: int) -> str:
    """MLIR text of `func.func private @name(%a: tensor<m x k x bf16>, %wp: <packed_shape>,
    %out: tensor<m x n x f32>) -> tensor<m x n x f32>`: a @ w^T written into `out` (which holds
    nothing yet: the product's zeros are never written and read back), `wp` the weight packed
    (`packed_shape`). Panels of
    `vectors` x LANES columns (their weight read as one stream while every row passes), each in register
    tiles of `rows` rows (then single rows): per pair of k, a row's pair is broadcast to every
    lane and multiplied into the tile's accumulators, one per row and vector of columns, which
    are the output's columns: written as vectors, no sum across lanes."""
    out = f"tensor<{m}x{n}xf32>"
    cols = vectors * LANES
    main = m // rows * rows
    lines = [f"func.func private @{name}(%a: tensor<{m}x{k}xbf16>, %wp: {_packed_type(k, n, vectors)}, "
             f"%out: {out}) -> {out} {{",
             "  %c0 = arith.constant 0 : index", "  %c1 = arith.constant 1 : index", "  %c2 = arith.constant 2 : index",
             f"  %cpairs = arith.constant {k // 2} : index", f"  %cn = arith.constant {n} : index",
             f"  %ccols = arith.constant {cols} : index", f"  %cmain = arith.constant {main} : index",
             f"  %cm = arith.constant {m} : index", "  %pad = arith.constant 0.0 : bf16",
             f"  %zero = arith.constant dense<0.0> : vector<{LANES}xf32>",
             f"  %cpanels = arith.constant {n // cols} : index",
             f"  %panels = scf.for %q = %c0 to %cpanels step %c1 iter_args(%o = %out) -> ({out}) {{",
             "    %n0 = arith.muli %q, %ccols : index"]
    acc = "%o"
    for tile, (start, stop) in ((rows, ("%c0", "%cmain")), (1, ("%cmain", "%cm"))):
        if (tile == rows and main) or (tile == 1 and main < m):
            body, acc = _panel_rows(tile, vectors, start, stop, acc, (m, k, n))
            lines += body
    lines += [f"    scf.yield {acc} : {out}", "  }", f"  return %panels : {out}", "}"]
    return "\n".join(lines)


def _panel_rows(rows: int, vectors: int, start: str, stop: str, acc: str,
                mnk: tuple[int, int, int]) -> tuple[list[str], str]:
    """Lines of the loop over the register tiles of `rows` rows from `start` to `stop` of a panel
    (from %n0) of `acc`, and its result."""
    m, k, n = mnk
    out, a_type, w_type = f"tensor<{m}x{n}xf32>", f"tensor<{m}x{k}xbf16>", _packed_type(k, n, vectors)
    t, vector, pair = f"r{rows}", f"vector<{LANES}xf32>", f"vector<{PAIRS}xbf16>"
    i4, i6, i8 = " " * 4, " " * 6, " " * 8
    names = [[f"%s{t}_{i}_{j}" for j in range(vectors)] for i in range(rows)]
    count = rows * vectors
    lines = [f"{i4}%step{t} = arith.constant {rows} : index",
             f"{i4}%tiles{t} = scf.for %m{t} = {start} to {stop} step %step{t} iter_args(%x{t} = {acc}) -> ({out}) {{"]
    for i in range(rows):
        lines += [f"{i6}%ci{t}_{i} = arith.constant {i} : index",
                  f"{i6}%row{t}_{i} = arith.addi %m{t}, %ci{t}_{i} : index"]
    for j in range(vectors):
        lines += [f"{i6}%wc{t}_{j} = arith.constant {2 * LANES * j} : index",
                  f"{i6}%cc{t}_{j} = arith.constant {LANES * j} : index",
                  f"{i6}%col{t}_{j} = arith.addi %n0, %cc{t}_{j} : index"]
    lines.append(f"{i6}%dots{t}:{count} = scf.for %p{t} = %c0 to %cpairs step %c1 iter_args("
                 + ", ".join(f"{s} = %zero" for row in names for s in row) + f") -> ({', '.join([vector] * count)}) {{")
    lines.append(f"{i8}%k{t} = arith.muli %p{t}, %c2 : index")
    for j in range(vectors):
        lines.append(f"{i8}%w{t}_{j} = vector.transfer_read %wp[%q, %p{t}, %wc{t}_{j}], %pad {{in_bounds = [true]}}"
                     f" : {w_type}, {pair}")
    results = []
    for i in range(rows):
        lines += [f"{i8}%ap{t}_{i} = vector.transfer_read %a[%row{t}_{i}, %k{t}], %pad {{in_bounds = [true]}}"
                  f" : {a_type}, vector<2xbf16>",
                  f"{i8}%ai{t}_{i} = vector.bitcast %ap{t}_{i} : vector<2xbf16> to vector<1xi32>",
                  f"{i8}%as{t}_{i} = vector.extract %ai{t}_{i}[0] : i32 from vector<1xi32>",
                  f"{i8}%ab{t}_{i} = vector.broadcast %as{t}_{i} : i32 to vector<{LANES}xi32>",
                  f"{i8}%a{t}_{i} = vector.bitcast %ab{t}_{i} : vector<{LANES}xi32> to {pair}"]
        for j in range(vectors):
            lines.append(f"{i8}%d{t}_{i}_{j} = x86vector.avx512.dot {names[i][j]}, %a{t}_{i}, %w{t}_{j}"
                         f" : {pair} -> {vector}")
            results.append(f"%d{t}_{i}_{j}")
    lines += [f"{i8}scf.yield {', '.join(results)} : {', '.join([vector] * count)}", f"{i6}}}"]
    current = f"%x{t}"
    for i in range(rows):
        for j in range(vectors):
            lines.append(f"{i6}%u{t}_{i}_{j} = vector.transfer_write %dots{t}#{i * vectors + j}, "
                         f"{current}[%row{t}_{i}, %col{t}_{j}] {{in_bounds = [true]}} : {vector}, {out}")
            current = f"%u{t}_{i}_{j}"
    lines += [f"{i6}scf.yield {current} : {out}", f"{i4}}}"]
    return lines, f"%tiles{t}"
