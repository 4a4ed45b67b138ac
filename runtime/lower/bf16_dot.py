"""bf16 products of a few rows by a weight stored along k, on AVX512-BF16 (`vdpbf16ps`).

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
in registers while k runs in steps of 32 x `vectors`. The op is MLIR's
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


def kernel(name: str, m: int, k: int, n: int, rows: int, streams: bool) -> str:
    """MLIR text of `func.func private @name(%a: tensor<m x k x bf16>, %w: tensor<n x k x bf16>,
    %out: tensor<m x n x f32>) -> tensor<m x n x f32>`: out + a @ w^T, register tiles of `rows` rows
    (then single rows) by COLUMNS columns: adjacent rows of `w`, or with `streams` (a weight read
    from memory) rows n / COLUMNS apart, each tile's continuing where the last one's left off
    (COLUMNS sequential streams, as `schedule._interleave_streams` reads an f32 weight)."""
    out = f"tensor<{m}x{n}xf32>"
    lines = [f"func.func private @{name}(%a: tensor<{m}x{k}xbf16>, %w: tensor<{n}x{k}xbf16>, %out: {out}) -> {out} {{",
             "  %c0 = arith.constant 0 : index", "  %c1 = arith.constant 1 : index",
             f"  %cstep = arith.constant {1 if streams else COLUMNS} : index",
             f"  %cend = arith.constant {n // COLUMNS if streams else n} : index",
             f"  %capart = arith.constant {n // COLUMNS if streams else 1} : index",
             "  %pad = arith.constant 0.0 : bf16", f"  %zero = arith.constant dense<0.0> : vector<{LANES}xf32>",
             f"  %panels = scf.for %n = %c0 to %cend step %cstep iter_args(%o = %out) -> ({out}) {{"]
    acc = "%o"
    main = m // rows * rows
    for tile, start, stop in ((rows, 0, main), (1, main, m)):
        if start == stop:
            continue
        body, acc = _row_tiles(tile, start, stop, (m, n, k), acc)
        lines += body
    lines += [f"    scf.yield {acc} : {out}", "  }", f"  return %panels : {out}", "}"]
    return "\n".join(lines)


def _row_tiles(rows: int, start: int, stop: int, mnk: tuple[int, int, int], acc: str) -> tuple[list[str], str]:
    """Lines of a loop over the tiles of `rows` rows from `start` to `stop`, and its result."""
    m, n, k = mnk
    out, a_type, w_type = f"tensor<{m}x{n}xf32>", f"tensor<{m}x{k}xbf16>", f"tensor<{n}x{k}xbf16>"
    vectors = _vectors(k, rows)
    t = f"r{rows}"
    count = rows * COLUMNS * vectors
    vector = f"vector<{LANES}xf32>"
    accs = ", ".join([vector] * count)
    i4, i6, i8 = " " * 4, " " * 6, " " * 8
    lines = [f"{i4}%start{t} = arith.constant {start} : index", f"{i4}%stop{t} = arith.constant {stop} : index",
             f"{i4}%step{t} = arith.constant {rows} : index", f"{i4}%ck{t} = arith.constant {k} : index",
             f"{i4}%kstep{t} = arith.constant {PAIRS * vectors} : index",
             f"{i4}%tiles{t} = scf.for %m{t} = %start{t} to %stop{t} step %step{t}"
             f" iter_args(%x{t} = {acc}) -> ({out}) {{"]
    row = [f"%row{t}_{i}" for i in range(rows)]
    col = [f"%col{t}_{j}" for j in range(COLUMNS)]
    for i in range(rows):
        lines += [f"{i6}%ci{t}_{i} = arith.constant {i} : index",
                  f"{i6}{row[i]} = arith.addi %m{t}, %ci{t}_{i} : index"]
    for j in range(COLUMNS):
        lines += [f"{i6}%cj{t}_{j} = arith.constant {j} : index",
                  f"{i6}%oj{t}_{j} = arith.muli %cj{t}_{j}, %capart : index",
                  f"{i6}{col[j]} = arith.addi %n, %oj{t}_{j} : index"]
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
        lines += [f"{i8}{w[j]} = vector.transfer_read %w[{col[j]}, %kv{t}_{v}], %pad {{in_bounds = [true]}}"
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
