"""The schedule's tile sizes, derived from a CPU description (opdefs/cpus.yaml) as BLIS derives
its micro-kernel shapes from the register file.

A contraction's register tile is `rows` x `columns` f32 accumulators held in vector registers
for the whole reduction; each step of k loads the tile's `columns` of the second operand (one
vector per `lanes` columns), broadcasts one element of the first operand per row and issues one
FMA per accumulator vector. Accumulators take the registers the operands leave: all but the
loaded vectors of columns and one broadcast, so nothing spills (a spilled accumulator costs a
load and a store per FMA, and LLVM's register allocator time grows with the spill code), and at
most three quarters of the register file; rows at most MAX_ROWS. Of the tiles that fit, the one
with the most accumulators, the narrower of equals (`register_tile`):

    AVX-512 (32 x 16 lanes): 3 vectors x 8 rows = 24 accumulators: an 8 x 48 tile
    AVX2    (16 x  8 lanes): 2 vectors x 6 rows = 12 accumulators: a 6 x 16 tile (4 x 24 ties)
    NEON    (32 x  4 lanes): 2 vectors x 8 rows = 16 accumulators: an 8 x 8 tile (two vectors
                             at most, MAX_COLUMN_VECTORS)

MKL's AVX-512 sgemm kernel is 8 x 48, BLIS's Haswell one 6 x 16. On an Emerald Rapids core (one
thread, interleaved) 8 x 48 ran a 1024 x 1024 x 960 matmul at 146 GF/s against 133 for the 8 x 32
tile before (eager 159); x86-64-v3 code on the same core, 4 x 24 at 58 against 66 for 6 x 16
(docs/performance.md). A tile of a number of vectors other than a power of two is vectorized
one vector of columns at a time and its FMAs ordered row by row (`schedule._vectorize`,
`schedule.rows_first`): whole, LLVM legalizes its loop-carried vector<8x48xf32> element by
element. A tile over a loop of a run-time size is peeled in powers of two, vectorized whole: its
columns are the convolution's.

A direct convolution's tile is vectorized whole (decomposed into 1-D convolutions first): its
columns are the largest power of two of vectors in the contraction's (`convolution`: 8 x 32,
6 x 16, 8 x 8), as are a depthwise convolution's (`depthwise`, output columns x channels).
AVX2's contraction tile had half of the registers before (4 x 16: 8 accumulators, exactly the
FMAs in flight, no slack): it ran a 1024^3 matmul 6% slower than 6 x 16 with the remainder rows
peeled (`schedule._peel_rows`), ResNet-50 and ConvNeXt-T 4% slower.

A direct convolution reads a packed panel of its filter (every tap and input channel, one
column tile of output channels) once per register tile of output pixels; up to half of the L2
cache (`direct_filter_bytes`) those reads stay in it. A larger panel (ResNet's 3x3 x 512
channels with Zen 4's 1 MiB of L2; from 256 channels with x86-64-v3's 256 KiB) would come from
memory each time: such a convolution runs as a matmul per filter tap
(`convolutions._taps_as_matmuls`), whose packed panels hold one tap's rows.

A contraction walks its second operand's column panels outside its rows, so each panel is read
once and the first operand once per panel: from memory, if it is larger than the L2. Where the
whole second operand, packed, fits in half of the L2 (`resident_operand_bytes`), it is packed
once and the rows are walked in blocks of a quarter of the L2 (`row_block_bytes`, BLIS's mc),
every panel passing over a block while it stays in the L2 (`schedule._row_blocks`).

A product of few rows by a second operand larger than the L2's half (a training step's input
gradient, grad @ W) gives each panel, copied from the operand's rows far apart in memory, few row
tiles to serve: those copies took a third of its time. Where its output fits the L2's quarter, it
is a loop over chunks of k (BLIS's kc, `schedule.k_chunk`): a chunk's rows of the operand are
packed from rows read whole, its panels' rows fit half of L1 (`chunk_panel_bytes`), and each
chunk adds to the output. 32 x 1024 x 1024, one thread, Sapphire Rapids: 84 -> 97 GF/s (eager
112), 64 x 2048 x 512 114 -> 134 (169).

A vector-matrix product (one row: a decoding step's nn.Linear) reads the weight along k, its
rows contiguous, as dot products: half of the registers hold DOT_COLUMNS output columns x a
chunk of k each (the other half the rows' and the vector's loads), summed across lanes once k is
done (64 of k with AVX-512, 16 with AVX2). A matrix larger than the L2 cache
(`streamed_matrix_bytes`) comes from memory: its DOT_COLUMNS columns are then rows far apart,
read as that many sequential streams (`schedule._interleave_streams`).

A product of a few rows (a prefill of a few tokens: up to DOT_MAX_ROWS) reads the weight the same
way, with register tiles of `dot_rows` rows x DOT_COLUMNS columns x one vector of k (fewer rows
take more of k), half of the registers again: each loaded vector of a row serves DOT_COLUMNS
accumulators, each of a column `dot_rows` (4 x 4 with AVX-512, 2 x 4 with AVX2). The column tiles
are the outer loop, so a tile's columns of the weight come from memory once and stay in L1 while
the row tiles pass. Packing the weight instead (as for more rows) wrote and read it again at
every call: a 1024 x 2816 weight by 2 / 8 rows, one thread, Sapphire Rapids: bf16 558 -> 294 us /
724 -> 576 us, f32 686 -> 488 us / 855 -> 619 us (eager 480 us bf16 with AMX; f32 480 / 1300 us).
At 16 bf16 rows the packed form was as fast (its f32 FMAs bound both): DOT_MAX_ROWS is 8. bf16 pairs
multiplied by `vdpbf16ps` (AVX512-BF16) stay dot products for any number of rows: at twice the
FMAs' rate they beat packed f32 panels (`lower/bf16_dot.py`), rows walked in blocks of
`row_block_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..cpu import Cpu, select

MAX_ROWS = 8  # rows of a register tile, at most
# Vectors of columns a register tile may have, by architecture. x86 broadcasts the first
# operand's values one at a time (vbroadcastss) and LLVM keeps the order `schedule.rows_first`
# gives each step of k; AArch64's fmla multiplies by a lane, and LLVM's scheduler loads every
# row's value first, which then stay live: BLIS's 8 x 12 spilled two registers (its kernel
# loads them packed, two to a register), so NEON keeps two vectors.
MAX_COLUMN_VECTORS = {"x86_64": 3, "aarch64": 2}
DOT_COLUMNS = 4  # output columns of a vector-matrix product's register tile
DOT_MAX_ROWS = 8  # a product of up to this many rows reads its weight as dot products
OTHER_OPS_VECTORS = 4  # vectors of the innermost tile of elementwise ops and reductions


@dataclass(frozen=True)
class Tiles:
    """The tile sizes of one CPU's schedule, in f32 elements."""

    lanes: int  # f32 lanes of one vector register
    registers: int  # vector registers
    l1_bytes: int  # the L1 data cache
    matmul: tuple[int, int]  # rows x columns of a contraction's register tile
    convolution: tuple[int, int]  # rows x columns of a direct convolution's register tile
    depthwise: tuple[int, int]  # output columns x channels of a depthwise convolution's tile
    vector: int  # innermost tile of other vectorized ops
    transpose: int  # side of a transpose's square tile, transposed in registers: one vector
    dot: tuple[int, int]  # output columns x k chunk of a vector-matrix product's register tile
    dot_rows: int  # rows of the register tile of a product of a few rows (columns DOT_COLUMNS, k one vector)
    direct_filter_bytes: int  # the largest filter panel a convolution reads directly, else a matmul per tap
    resident_operand_bytes: int  # the largest second operand of a contraction packed whole, kept in the L2
    row_block_bytes: int  # rows of a contraction's first operand that stay in the L2 while every panel passes
    chunk_panel_bytes: int  # a column panel's rows of a chunk of k, read by every row tile from L1
    streamed_matrix_bytes: int  # a vector-matrix product's matrix from this size is read as streams


def derive(cpu: Cpu) -> Tiles:
    """The tiles for `cpu` (see the module docstring)."""
    lanes = cpu.lanes
    rows, vectors = register_tile(cpu.vector_registers, MAX_COLUMN_VECTORS[cpu.arch])
    whole = 1 << vectors.bit_length() - 1  # vectors of a tile vectorized whole: a power of two
    convolution = (rows, whole * lanes)
    dot_accumulators = cpu.vector_registers // 2
    dot = (DOT_COLUMNS, dot_accumulators // DOT_COLUMNS * lanes)
    return Tiles(lanes=lanes, registers=cpu.vector_registers, l1_bytes=cpu.l1d_kib * 1024,
                 matmul=(rows, vectors * lanes), convolution=convolution, depthwise=convolution,
                 vector=OTHER_OPS_VECTORS * lanes, transpose=lanes, dot=dot, dot_rows=dot_accumulators // DOT_COLUMNS,
                 direct_filter_bytes=cpu.l2_kib * 1024 // 2, resident_operand_bytes=cpu.l2_kib * 1024 // 2,
                 row_block_bytes=cpu.l2_kib * 1024 // 4, chunk_panel_bytes=cpu.l1d_kib * 1024 // 2,
                 streamed_matrix_bytes=cpu.l2_kib * 1024)


def register_tile(registers: int, max_vectors: int) -> tuple[int, int]:
    """Rows x vectors of columns (up to `max_vectors`) of a contraction's register tile on
    `registers` vector registers: the most accumulators that leave a register per vector of
    columns and one for a broadcast, at most three quarters of the registers and MAX_ROWS rows;
    the fewer vectors of equals."""
    def fit(vectors: int) -> tuple[int, int]:
        accumulators = min(registers - vectors - 1, registers * 3 // 4)
        return min(accumulators // vectors, MAX_ROWS), vectors

    return max((fit(v) for v in range(1, max_vectors + 1)), key=lambda t: (t[0] * t[1], -t[1]))


def selected(cpu: Cpu | None = None) -> Tiles:
    """The tiles of `cpu`, else of the CPU a compile targets now (`cpu.select`)."""
    return derive(cpu or select())
