"""The optimizing schedule of opt="default" (and "parallel"): tile each linalg op, vectorize the tiles.

`schedule(module)` picks tile sizes for every linalg op it knows how to vectorize (from the
op's static shapes), writes them as a transform-dialect script and runs MLIR's transform
interpreter on the module. Ops it does not pick stay as they are and lower to plain loops,
exactly as in the reference pipeline (opt="none").

Every tile size is derived from the description of the CPU the code is for (`tiles.derive`:
register tiles sized to its vector register file, vector widths from its lanes).

- Contractions (batch_matmul, matmul, and generics that are a sum of products, as elementwise
  fusion leaves a matmul it moved a reshape through; the factors fusion computes in one, such as
  attention's scaling, are split off into ops of their own first, `split_prologues`) get a
  register tile of `Tiles.matmul` rows x columns and a reduction step of 1: the vectorized tile
  is a chain of outer products (one broadcast FMA per row), its accumulator hoisted out of the
  reduction loop into registers. A tile of three vectors of columns (AVX-512's 8 x 48) is
  vectorized a vector of columns at a time, each step of k then ordered row by row
  (`_vectorize`, `rows_first`).
  Column tiles are the outer loop, so a column panel of the second operand stays in cache. A
  named contraction's second operand is packed: a loop over column panels first computes each
  panel (transposing nn.Linear's weight, or copying) into one small contiguous buffer, then
  the contraction with it (`pack_panels`). With opt="parallel" that loop is an scf.forall for
  large contractions (and batch contractions from SPLIT_MIN_MACS), run by OpenMP threads. A
  first operand larger than the L2 would then come from memory once per panel: where the whole
  second operand, packed, fits in the L2, it is packed at once and the rows are walked in blocks
  that stay in the L2 while every panel passes (`_row_blocks`, BLIS's mc blocking): Winograd's
  16 x [1568 x 128] x [128 x 128] batch matmul 11.6 -> 11.0 ms on Zen 4, ResNet-50 at batch 8
  (with Winograd) 756 -> 706 ms.
- A contraction of one row, or a few (up to DOT_MAX_ROWS: a prefill of a few tokens), whose
  second operand is a transpose of a tensor stored along k (nn.Linear's weight, attention's
  q @ k^T) reads that tensor directly, as dot products (`_dot_form`): a register tile of
  `Tiles.dot` output columns x a chunk of k (and `Tiles.dot_rows` rows, the column tiles
  outside), vector accumulators carried through the k loop and summed across lanes once
  (`tile_reduction_using_for`). Packing would transpose the whole weight at every call. In bf16,
  on a CPU with AVX512-BF16 and one thread, such a product of any number of rows is a call of a
  `bf16_dot` kernel instead, which multiplies the bf16 pairs as stored (`_bf16_dot_product`:
  twice the packed f32 panels' rate; 32 x 1024 x 2816 on Zen 4 1949 -> 964 us, eager 999); a
  bf16 product of amx.MIN_ROWS rows or more, on a CPU with AMX, is computed on AMX tiles
  (`_amx_product`).
- 2-D convolutions (NHWC) get the same register tile over (output column, output channel); each
  tile, one output row and one filter tap, is decomposed into a 1-D convolution and vectorized.
  One of more output channels than a column tile is first a loop over panels of them, each
  packing its filter panel into a contiguous buffer (`pack_panels`), like a contraction's.
  1x1 convolutions are matmuls by now, and depthwise ones of multiplier 1 have lost the
  multiplier (`convolutions.rewrite_convolutions`); padded inputs are written in place
  (`convolutions.pads_in_place`). Depthwise convolutions get a tile of `Tiles.depthwise` (output
  columns x channels), decomposed and vectorized along the channels like the dense ones, and so
  do static f32 poolings (max, min, sum: the same loops, a window instead of a filter).
- Everything else that is vectorizable (elementwise and reduction generics, fill, transpose)
  gets a tile of 1 on every loop but the innermost, which gets up to `Tiles.vector`; an op that
  strides through an operand along that loop (a transpose) gets square `Tiles.transpose` tiles,
  transposed in registers. Vector reductions are marked reassociable so LLVM sums them as trees.
  A tile carried through a reduction loop outside it (a sum over H of NCHW) is a power of two
  (`_carries_vectors`). A reduction along long contiguous rows (softmax, layer norm, a sum over
  (0, 2, 3) once it reads through TOSA's transpose, `contractions.fold_transposes`, and its trailing
  reduction loops are one, `collapse_reductions`) keeps vector partial results along the row and
  sums across lanes once per row (`_row_reduction`, tiled as a dot product).
- A chain of row-wise ops (a softmax, a layer norm: a row's statistic, the ops reading it, the
  next statistic, the output) is first made one loop over the rows, each op of it then tiled as
  above on one row (`rows.fuse_rows`; with opt="parallel" the loop over a large chain's rows is
  an scf.forall). Before that, attention whose scores exceed the L2 becomes a loop over blocks
  of query rows, q @ kᵀ and the chain fused into the tiles of its second product
  (`attention.block_attention`, opt="default").
- Vector math (exp, erf, tanh, ...) becomes libmvec calls where usable (`vecmath`).
- With opt="parallel", every other op with enough work (convolutions and contractions from
  SPLIT_MIN_MACS multiply-adds, other ops from SPLIT_MIN_ELEMENTS loop iterations) is first
  tiled into one chunk per OpenMP thread (`threads`) along its outermost parallel loop that
  divides into equal chunks of whole tiles (`thread_split`): an scf.forall, tiled and vectorized
  inside exactly as the whole op would be. Poolings and depthwise convolutions that stay plain
  loops (sizes known at run time only, bf16) are split along their outermost output dimension
  (`_window_split`). Each split op is
  one OpenMP region (a fork and a join, a few microseconds with libiomp5's spinning workers),
  so smaller ops stay on the calling thread.

Every tile has a static shape and needs no masks. A static loop gets a tile size that divides
it: a loop whose size has no divisor near the target gets a smaller tile, down to 1. A loop of
a dynamic size (a `?` dim: torch.compile(dynamic=True)) gets the target tile and is peeled:
whole tiles are vectorized exactly as static ones, the remainder is tiled again in smaller
static tiles (`_Remainders`). Contractions with dynamic rows or batch are packed as static ones.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

from mlir import ir
from mlir.dialects import arith, func, linalg, scf, tensor, vector

from ..cpu import Cpu, cores, select
from ..internal import blaming
from . import amx, bf16_dot, vecmath
from .attention import block_attention
from .contractions import contraction_of_inputs, fold_transposes, normalize, sum_of_products, transposed
from .convolutions import CONV as _CONV
from .convolutions import CONV_HWCF as _CONV_HWCF
from .convolutions import DEPTHWISE as _DEPTHWISE
from .convolutions import pads_in_place, static_f32
from .half import is_half, widen_arithmetic
from .irutil import (
    clone_into,
    collapse,
    constant_int,
    copy_body,
    defined_in,
    dims_map,
    expand,
    find_ops,
    insert_functions,
    iterator_types,
    map_dims,
    positive_zero,
    producer,
    run_passes,
    run_transform,
    static_slice,
)
from .irutil import tensor_dim as _dim
from .irutil import tensor_shape as _shape
from .rows import fuse_rows
from .tiles import DOT_MAX_ROWS, Tiles, derive
from .zero_init import ACCUMULATES, drop_zero_fills, zero_accumulators

_CONTRACTIONS = {"linalg.batch_matmul": 1, "linalg.matmul": 0}  # op -> number of batch loops
_DENSE = (_CONV, _CONV_HWCF)  # 2-D convolutions: loops (n, oh, ow, f, kh, kw, c)
# loops (n, oh, ow, c, kh, kw), as a depthwise convolution's
_POOLS = ("linalg.pooling_nhwc_max", "linalg.pooling_nhwc_min", "linalg.pooling_nhwc_sum")
_DECOMPOSED = (*_DENSE, _DEPTHWISE, *_POOLS)  # tiled by one output row and filter tap, then decomposed to 1-D
# not tiled (unless `plan` tiles them), but split across threads: loops (output dims..., kh, kw)
_WINDOWED = ("linalg.pooling_nhwc_max", "linalg.pooling_nhwc_min", "linalg.pooling_nhwc_sum",
             "linalg.depthwise_conv_2d_nhwc_hwc", "linalg.depthwise_conv_2d_nhwc_hwcm")
_WINDOW = "window"
_DOT = "dot"  # a vector-matrix product in dot form (`_dot_form`)
PARALLEL_MIN_MACS = 1 << 24  # smaller contractions stay on the calling thread (4M was no faster)
# Smaller ops stay on the calling thread: convolutions and batch or unpacked contractions (in
# multiply-adds), other ops (in loop iterations: elementwise ops, reductions, transposes). On the
# 2-core VM, with the other core idle, one OpenMP region costs a few microseconds: an elementwise
# op of 8K elements ran in 13.7 us split against 16.2 us serial, 32K in 19 against 33 us (best of
# 300 batches). With the other core busy (another process), every region may wait for the worker
# thread to be scheduled, up to milliseconds a call: the thresholds keep the region count down.
SPLIT_MIN_MACS = 1 << 20
SPLIT_MIN_ELEMENTS = 1 << 16
SPLIT_ROW = 4096  # elements of a row a scalar result's first stage sums (`_split_long_reduction`)
MAX_SCALAR_ROWS = 16  # at most this many partial results may be summed in scalars by the second stage
MIN_K_CHUNK = 64  # rows of k of a chunk (`k_chunk`): its output tiles' loads and stores stay few beside its FMAs
DYNAMIC_SIZE_GUESS = 64  # what _parallel_worth assumes a size known at run time only to be
_PLAIN_MAPS = {
    "linalg.batch_matmul": "[affine_map<(d0, d1, d2, d3) -> (d0, d1, d3)>, affine_map<(d0, d1, d2, d3) -> "
    "(d0, d3, d2)>, affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>]",
    "linalg.matmul": "[affine_map<(d0, d1, d2) -> (d0, d2)>, affine_map<(d0, d1, d2) -> (d2, d1)>, "
    "affine_map<(d0, d1, d2) -> (d0, d1)>]",
}
_VECTORIZABLE = ("linalg.generic", "linalg.fill", "linalg.transpose", "linalg.copy")
_TILE_ATTR = "torchtosa.tile"
_ONCE_ATTR = "torchtosa.once"  # a loop `_Remainders` knows runs exactly once where it is reached
_FOR = '!transform.op<"scf.for">'
Extent = int | None  # a loop's size; None if known at run time only
# tile sizes, order of the tile loops, the loops whose last tile may be partial (a dynamic size,
# see `_Remainders`), and which of those are a matmul's rows
Tiling = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]
# (conv or "", tile sizes, loop order, partial loops, rows loops, thread split: (loop, chunk) or ())
Key = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]

# After tiling and vectorizing: contractions become outer products with their accumulators in
# registers; vector transfers and reductions are lowered to what the LLVM lowering handles.
# Separate pattern sets: lowering broadcasts and shape casts together with canonicalization
# can loop forever. Two scripts: `_mark_hoistable` picks the loops in between.
_CLEANUP = """
  transform.apply_patterns to %func {
    transform.apply_patterns.tensor.fold_tensor_empty
    transform.apply_patterns.vector.sink_ops
    transform.apply_patterns.vector.reduction_to_contract
    transform.apply_patterns.vector.transfer_permutation_patterns
    transform.apply_patterns.canonicalization
  } : !transform.any_op
  transform.apply_cse to %func : !transform.any_op
  transform.apply_patterns to %func {
    transform.apply_patterns.vector.cast_away_vector_leading_one_dim
    transform.apply_patterns.vector.drop_unit_dims_with_shape_cast
    transform.apply_patterns.canonicalization
  } : !transform.any_op
"""
_LOWERING = """
  %loops = transform.structured.match ops{["scf.for"]} attributes{$HOIST} in %func
    : (!transform.any_op) -> !transform.any_op
  transform.foreach %loops : !transform.any_op {
  ^bb0(%loop: !transform.any_op):
    transform.loop.hoist_loop_invariant_subsets %loop : !transform.any_op
  }
  transform.apply_patterns to %func {
    transform.apply_patterns.vector.lower_contraction lowering_strategy = "outerproduct"
    transform.apply_patterns.vector.transfer_permutation_patterns
    transform.apply_patterns.vector.lower_multi_reduction lowering_strategy = "innerreduction"
    transform.apply_patterns.vector.lower_transpose $TRANSPOSE
  } : !transform.any_op
  transform.apply_patterns to %func {
    transform.apply_patterns.vector.lower_outerproduct
  } : !transform.any_op
"""
_HOIST_ATTR = "torchtosa.hoist"  # a loop `_mark_hoistable` found a loop-invariant subset in
# How a square transpose tile of one vector per row is lowered, by its side (`Tiles.transpose`):
# 16 x 16 f32 in AVX-512 shuffles, 8 x 8 in AVX2's, anything else element by element.
_TRANSPOSE_LOWERING = {16: 'lowering_strategy = "shuffle_16x16"',
                       8: 'lowering_strategy = "shuffle_1d" avx2_lowering_strategy = true'}


def schedule(module: ir.Module, parallel: bool = False, cpu: Cpu | None = None) -> None:
    """Tile and vectorize the linalg ops of `module` (on tensors) in place, for `cpu` (by default
    the CPU a compile targets now, `cpu.select`).

    With `parallel`, the column-panel loops of packed contractions of at least
    PARALLEL_MIN_MACS multiply-adds (a dynamic size counted as DYNAMIC_SIZE_GUESS) are
    `scf.forall` loops (`pack_panels`), and every other op with enough work is split into one
    scf.forall chunk per thread (`thread_split`, `_window_split`); the "openmp" stage of the
    pipeline makes them OpenMP worksharing loops.
    """
    cpu = cpu or select()
    tiles = derive(cpu)
    chunks = threads() if parallel else 1
    widen_arithmetic(module)
    # before the row-wise chains: a softmax normalization split off a contraction is then the
    # last op of its chain, written row by row (not a pass over all the scores after it)
    split_prologues(module)
    if chunks == 1:
        block_attention(module, tiles)
    fuse_rows(module, SPLIT_MIN_ELEMENTS if chunks > 1 else None)
    fold_transposes(module)
    collapse_outputs(module)
    generalize_reductions(module)
    collapse_reductions(module)
    split_long_reductions(module, tiles)
    peel_row_remainders(module, tiles)
    normalize(module)
    pads_in_place(module)
    if amx.available(cpu):  # one thread's kernels, with opt="parallel" too: faster than two threads' FMAs
        _rewrite_named_contractions(module, _amx_product)
    if bf16_dot.available(cpu):
        _rewrite_named_contractions(module, lambda op: _bf16_dot_product(op, tiles, chunks))
    pack_panels(module, parallel, tiles)
    interleave_streams(module, tiles)
    if chunks == 1:  # contractions of register tiles start from zero in registers
        with module.context, ir.Location.unknown():
            drop_zero_fills(_register_tiled(module, tiles))
    groups: dict[Key, list[ir.Operation]] = {}
    for op, tiling in plans(module, tiles):
        with blaming(op):
            split = thread_split(op, tiling, chunks)
        dot = _dot_loops(op) is not None or _row_reduction(op, tiles.lanes)
        kind = op.name if op.name in _DECOMPOSED else _DOT if dot else ""
        groups.setdefault((kind, *tiling, split), []).append(op)
    planned = {op.operation for ops in groups.values() for op in ops}  # depthwise ones `plan` tiles
    for op in find_ops(module, lambda op: op.name in _WINDOWED and op.operation not in planned):
        split = _window_split(op, chunks)
        if split:
            groups.setdefault((_WINDOW, (), (), (), (), split), []).append(op)
    if not groups:
        return
    with module.context, ir.Location.unknown():
        for key, ops in groups.items():
            for op in ops:
                op.attributes[_TILE_ATTR] = ir.StringAttr.get(_key(key))
    try:
        module.operation.verify()  # the interpreter runs unverified on what pack_panels built
        run_transform(module, _script(groups, tiles))
        _mark_hoistable(module)
        run_transform(module, _lowering(tiles))
    finally:
        _drop_attrs(module, (_TILE_ATTR, _HOIST_ATTR))
    fold_piece_writes(module)
    zero_accumulators(module)
    inline_single_iterations(module)
    # canonicalize drops the loop-carried values that hoisting leaves unchanged, which
    # bufferization would otherwise resolve with a buffer copy per tile
    run_passes(module, "builtin.module(canonicalize,cse)")
    rows_first(module)  # once CSE has made the pieces' broadcasts one per row
    _reassociate_reductions(module)
    tree_reductions(module)
    if vecmath.library(cpu) is not None:
        vecmath.use_vector_library(module, cpu)


def _rewrite_named_contractions(module: ir.Module, rewrite: Callable[[ir.Operation], None]) -> None:
    """Apply `rewrite` to each named contraction (matmul, batch_matmul) of `module`."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name in _CONTRACTIONS):
            with blaming(op):
                rewrite(op)


def _bf16_contraction_loops(op: ir.Operation) -> tuple[Extent, ...] | None:
    """`_half_contraction_loops` of a contraction of bf16 operands (not f16)."""
    loops = _half_contraction_loops(op)
    if loops is None or not all(isinstance(ir.RankedTensorType(v.type).element_type, ir.BF16Type)
                                for v in list(op.operands)[:2]):
        return None
    return loops


def _bf16_dot_product(op: ir.Operation, tiles: Tiles, chunks: int = 1) -> None:
    """Replace a bf16 contraction into f32 sums of static rows (any number of them: AMX, where
    the CPU has it, took those of amx.MIN_ROWS or more) by a transposed weight stored along k
    (`_dot_source`), of one batch and shapes `bf16_dot.fits` takes, by a call of a
    `bf16_dot.kernel` (vdpbf16ps on the bf16 pairs as stored). The kernel walks the rows in
    blocks that stay in the L2 (`Tiles.row_block_bytes`) while every column tile passes; from
    SPLIT_MIN_MACS multiply-adds, its columns are split into `chunks` equal chunks of whole
    column tiles where they divide so (one per thread)."""
    loops = _bf16_contraction_loops(op)
    if loops is None:
        return
    batch = _CONTRACTIONS[op.name]
    m, n, k = loops[batch:]
    transpose = _dot_source(op, loops, tiles, max_rows=None)
    if (transpose is None or any(size != 1 for size in loops[:batch])
            or list(ir.DenseI64ArrayAttr(transpose.attributes["permutation"])) != [*range(batch), batch + 1, batch]):
        return
    lhs, _, init = list(op.operands)[:3]
    groups = [[0, 1], [2]] if batch else [[0], [1]]
    fill = init.owner if isinstance(init, ir.OpResult) else None
    zeros = (fill is not None and fill.name == "linalg.fill" and positive_zero(fill.operands[0])
             and len(list(init.uses)) == 1)
    if chunks == 1 and zeros and bf16_dot.panel_fits(m, k, n, tiles.l1_bytes):
        rows, vectors = bf16_dot.panel_tile(n, tiles.registers)
        name = f"torchtosa_bf16_panel_{m}x{k}x{n}_{rows}x{vectors}"
        insert_functions(op, name, bf16_dot.panel_kernel(name, m, k, n, rows, vectors))
        with ir.InsertionPoint(op), op.location:
            empty = tensor.EmptyOp(_shape(init), ir.F32Type.get()).result  # the zeros are not written
            a, w, out = (collapse(v, groups) for v in (lhs, transpose.operands[0], empty))
            packed = _packed(w, bf16_dot.packed_shape(k, n, vectors))
            call = func.CallOp([out.type], ir.FlatSymbolRefAttr.get(name), [a, packed, out]).result
            result = expand(call, groups, _shape(init))
        op.results[0].replace_all_uses_with(result)
        op.erase()
        transpose.erase()
        fill.erase()
        return
    if not bf16_dot.fits(m, k, n):
        return
    rows = min(tiles.dot_rows, bf16_dot.ACCUMULATORS // bf16_dot.COLUMNS)
    streams = n * k * 2 >= tiles.streamed_matrix_bytes
    block = max(1, tiles.row_block_bytes // (k * 2) // rows) * rows
    if m * n * k < SPLIT_MIN_MACS or n // bf16_dot.COLUMNS % chunks:
        chunks = 1
    name = f"torchtosa_bf16_dot_{m}x{k}x{n}_{rows}{'_streams' if streams else ''}_{block}_{chunks}"
    insert_functions(op, name, bf16_dot.kernel(name, m, k, n, rows, streams, block, chunks))
    with ir.InsertionPoint(op), op.location:
        operands = [collapse(v, groups) for v in (lhs, transpose.operands[0], init)]
        call = func.CallOp([operands[2].type], ir.FlatSymbolRefAttr.get(name), operands).result
        result = expand(call, groups, _shape(init))
    op.results[0].replace_all_uses_with(result)
    op.erase()
    transpose.erase()


def _packed(w: ir.Value, shape: list[int]) -> ir.Value:
    """A weight `w` [n, k] as `bf16_dot.panel_kernel` reads it (`bf16_dot.packed_shape`: panels
    [n / cols, k / 2, 2 cols]), a copy of it per call."""
    panels, pairs, width = shape
    split = expand(w, [[0, 1], [2, 3]], [panels, width // 2, pairs, 2])
    return collapse(transposed(split, [0, 2, 1, 3]), [[0], [1], [2, 3]])


def _amx_product(op: ir.Operation) -> None:
    """Replace a static bf16 contraction into f32 sums of amx.MIN_ROWS rows or more, one batch,
    and shapes `amx.fits` takes, by its transpose computed on AMX tiles (`amx`): the weight as
    stored (the input of the transpose producing the second operand, else that operand
    transposed), the rows packed in pairs of k, a call of the kernel's placeholder, and the init
    plus the result read transposed."""
    loops = _bf16_contraction_loops(op)
    if loops is None:
        return
    batch = _CONTRACTIONS[op.name]
    if None in loops or any(size != 1 for size in loops[:batch]):
        return
    m, n, k = loops[batch:]
    if m < amx.MIN_ROWS or not amx.fits(m, k, n):
        return
    lhs, rhs, init = list(op.operands)[:3]
    producer = rhs.owner if isinstance(rhs, ir.OpResult) else None
    swap = [*range(batch), batch + 1, batch]
    transposed = (producer is not None and producer.name == "linalg.transpose" and len(list(rhs.uses)) == 1
                  and list(ir.DenseI64ArrayAttr(producer.attributes["permutation"])) == swap)
    groups = [[0, 1], [2]] if batch else [[0], [1]]
    m16 = amx.padded_rows(m)
    bf16, f32 = ir.BF16Type.get(), ir.F32Type.get()
    name = f"torchtosa_amx_{n}x{k}x{m16}"
    insert_functions(op, name, amx.placeholder(name, n, k, m16))
    with ir.InsertionPoint(op), op.location:
        if transposed:
            weight = collapse(producer.operands[0], groups)
        else:
            weight = _value(linalg.transpose(collapse(rhs, groups), outs=[tensor.EmptyOp([n, k], bf16).result],
                                             permutation=[1, 0]))
        rows = collapse(lhs, groups)
        if m16 != m:  # whole tiles of rows, zeros after
            zero = arith.ConstantOp(bf16, 0.0).result
            filled = _value(linalg.fill(zero, outs=[tensor.EmptyOp([m16, k], bf16).result]))
            rows = _insert(tensor.InsertSliceOp, rows, filled, [0, 0], [m, k]).result
        tiles = m16 // amx.ROWS  # each tile of 16 rows in pairs of k, [K/2, 16, 2], one after the other
        pairs = _value(linalg.transpose(expand(rows, [[0, 1], [2, 3]], [tiles, amx.ROWS, k // 2, 2]),
                                        outs=[tensor.EmptyOp([tiles, k // 2, amx.ROWS, 2], bf16).result],
                                        permutation=[0, 2, 1, 3]))
        packed = collapse(pairs, [[0, 1], [2, 3]])
        out = tensor.EmptyOp([n, m16], f32).result
        product = func.CallOp([out.type], ir.FlatSymbolRefAttr.get(name), [weight, packed, out]).result
        if m16 != m:
            product = _extract(product, [0, 0], [n, m])
        flat = collapse(init, groups)
        maps = ir.ArrayAttr.get([dims_map(2, [1, 0]), dims_map(2, [0, 1])])
        generic = linalg.GenericOp([flat.type], [product], [flat], maps, iterator_types(2))
        body = generic.regions[0].blocks.append(f32, f32)
        with ir.InsertionPoint(body):
            linalg.YieldOp([arith.AddFOp(body.arguments[1], body.arguments[0]).result])
        result = expand(generic.results[0], groups, _shape(init))
    op.results[0].replace_all_uses_with(result)
    op.erase()
    if transposed:
        producer.erase()


def _value(built: ir.Value | ir.OpView) -> ir.Value:
    """The result of a named linalg op as its Python builder returns it (the value, or the op)."""
    return built if isinstance(built, ir.Value) else built.results[0]


def pack_panels(module: ir.Module, parallel: bool = False, tiles: Tiles | None = None) -> None:
    """Rewrite each named contraction whose second operand is worth packing (`_panel_source`)
    as a loop over column panels: each iteration computes one panel of the second operand (all
    k, one column tile) into a small contiguous buffer, then the contraction of all rows with
    it. With `parallel`, contractions of at least PARALLEL_MIN_MACS multiply-adds loop with one
    scf.forall, whose iterations (each with its own panel buffer) OpenMP threads run in
    parallel. The same for 2-D convolutions and their filters (`_pack_filter`).

    The loops are built here rather than by the transform dialect's fuse_into_containing_op,
    whose cost grows with the size of the whole function (compile time then grew with the
    square of a model's depth).
    """
    tiles = tiles or derive(select())
    _rewrite_named_contractions(module, lambda op: _pack_panels(op, parallel, tiles))
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name in _DENSE):
            with blaming(op):
                _pack_filter(op, parallel, tiles)


def _pack_filter(op: ir.Operation, parallel: bool, tiles: Tiles) -> None:
    """`_filter_panels` of one 2-D convolution (static, f32) whose output channels are more than
    one column tile: with `parallel`, its panels are an scf.forall if it has at least
    SPLIT_MIN_MACS multiply-adds."""
    tiling = plan(op, tiles) if static_f32(op) else None
    if tiling is None:
        return
    loops, tn = _loop_sizes(op), tiling[0][3]
    if _whole_tiles_and_rest(loops[3], tiles.convolution[1]):
        tn = tiles.convolution[1]
    if loops[3] > tn:
        rest = _filter_panels(op, tn, parallel and threads() > 1 and math.prod(loops) >= SPLIT_MIN_MACS)
        if rest is not None:
            _pack_filter(rest, parallel, tiles)


def _filter_panels(op: ir.Operation, tn: int, forall: bool) -> ir.Operation | None:
    """Replace 2-D convolution `op` by a loop (an scf.forall if `forall`) over its output
    channels in panels of `tn`: per panel, its filter (every tap and input channel, `tn` output
    channels) copied into one contiguous HWCF buffer, then the convolution of the whole input
    with it, which the schedule tiles as any other. The channels beyond the whole panels (136 in
    panels of 32: 128 + 8) are a convolution of their own after the loop, returned: before, 136
    channels went in panels of 8, a fraction of a vector (a 3x3 convolution 64 -> 136 on 56 x 56
    ran at 90 GF/s, 64 -> 128 at 144, eager at 112)."""
    image, weight, init = list(op.operands)[:3]
    n, oh, ow, f = _shape(init)
    hwcf = op.name == _CONV_HWCF
    w = _shape(weight)
    kh, kw, c = w[:3] if hwcf else w[1:]
    strides = ir.DenseIntElementsAttr(op.attributes["strides"])
    dilations = ir.DenseIntElementsAttr(op.attributes["dilations"])
    whole = f // tn * tn
    with ir.InsertionPoint(op), op.location:
        ivs, acc, body, finish = _loop_nest([whole], [tn], init, forall)
        with ir.InsertionPoint(body):
            (column,) = ivs
            element = ir.RankedTensorType(weight.type).element_type
            empty = tensor.EmptyOp([kh, kw, c, tn], element).result
            if hwcf:
                panel = linalg.copy(_extract(weight, [0, 0, 0, column], [kh, kw, c, tn]), outs=[empty])
            else:
                panel = linalg.transpose(_extract(weight, [column, 0, 0, 0], [tn, kh, kw, c]), outs=[empty],
                                         permutation=[1, 2, 3, 0])
            tile_offsets, tile_shape = [0, 0, 0, column], [n, oh, ow, tn]
            tile = linalg.conv_2d_nhwc_hwcf(image, panel, outs=[_extract(acc, tile_offsets, tile_shape)],
                                            strides=strides, dilations=dilations)
            result = finish(tile, tile_offsets, tile_shape)
    rest = None
    if whole < f:
        with ir.InsertionPoint(op), op.location:
            at, shape = [0, 0, 0, whole], [n, oh, ow, f - whole]
            filters = _extract(weight, [0, 0, 0, whole], [kh, kw, c, f - whole]) if hwcf else \
                _extract(weight, [whole, 0, 0, 0], [f - whole, kh, kw, c])
            part = getattr(linalg, op.name.removeprefix("linalg."))(
                image, filters, outs=[_extract(result, at, shape)], strides=strides, dilations=dilations)
            rest = part.owner
            result = _insert(tensor.InsertSliceOp, part, result, at, shape).result
    op.results[0].replace_all_uses_with(result)
    op.erase()
    return rest


def _pack_panels(op: ir.Operation, parallel: bool, tiles: Tiles) -> None:
    """`pack_panels` of one named contraction."""
    tiling = plan(op, tiles)
    if tiling is None:
        loops = _half_contraction_loops(op)
        transposed = None if loops is None else _dot_source(op, loops, tiles)
        if transposed is not None:
            _dot_form(op, transposed)
        elif loops is not None and None not in loops[-2:]:  # f32 rows times panels extended to f32,
            _pack_panels(_widen(op), parallel, tiles)  # packed as any (rows or batch may be dynamic)
        return
    sizes = tiling[0]
    loops = _loop_sizes(op)
    panel = _panel_columns(loops[-2], tiles)
    if panel is not None:
        sizes = (*sizes[:-2], panel, sizes[-1])
    elif loops[-2] is None or len(loops) - 2 in tiling[2]:
        return  # a dynamic or peeled column count: its last panel would be partial
    transposed = _dot_source(op, loops, tiles)
    if transposed is not None:
        _dot_form(op, transposed)
        return
    source = _panel_source(op, loops, sizes)
    if source is not None:
        forall = parallel and threads() > 1 and _parallel_worth(loops, _CONTRACTIONS[op.name])
        chunk = None if forall else _k_chunk(op, source, loops, sizes, tiles)
        if chunk is not None:
            _k_chunks(op, sizes[-2], chunk)
            return
        block = None if forall else _row_block(op, source, loops, sizes, tiles)
        if block is not None:
            _row_blocks(op, source, sizes[-2], block)
        else:
            rest = _column_panels(op, source, sizes[-2], forall)
            if rest is not None:
                _pack_panels(rest, parallel, tiles)


def _panel_columns(columns: Extent, tiles: Tiles) -> int | None:
    """The columns of a contraction's whole panels where its output columns run as those and,
    after them, a contraction of the rest (`_whole_tiles_and_rest`): the register tile's, where
    they leave a rest of whole vectors, at most an eighth of the columns (1024 = 21 x 48 + 16);
    else the largest power of two of vectors in it, as before the tile of 48 (1000 = 31 x 32 + 8,
    64 in two tiles of 32: 48 and a rest of 16, its tiles at half the FMAs in flight, ran an
    encoder layer's attention slower)."""
    wide, narrow = tiles.matmul[1], tiles.convolution[1]
    if columns is None or columns % wide == 0:
        return None  # whole tiles (`_column_divisor`)
    if columns > wide and columns % wide % tiles.lanes == 0 and 8 * (columns % wide) <= columns:
        return wide
    return narrow if _whole_tiles_and_rest(columns, narrow) else None


def _whole_tiles_and_rest(columns: Extent, tile: int) -> bool:
    """Whether a static count of output columns (channels) that the register tile's `tile`
    columns do not divide runs as panels of whole tiles and, after them, a contraction
    (convolution) of the rest (`_column_panels`, `_filter_panels`), rather than in tiles of a
    divisor of it."""
    return columns is not None and columns > tile and columns % tile != 0


def _half_contraction_loops(op: ir.Operation) -> tuple[Extent, ...] | None:
    """The loops (batch..., m, n, k) of a named contraction of bf16 or f16 operands into f32 sums
    (`_loop_sizes` takes no half-precision contraction), else None."""
    if op.name not in _CONTRACTIONS or "indexing_maps" in op.attributes:
        return None
    lhs, rhs, init = list(op.operands)[:3]
    if not (all(is_half(ir.RankedTensorType(v.type).element_type) for v in (lhs, rhs))
            and isinstance(ir.RankedTensorType(init.type).element_type, ir.F32Type)):
        return None
    a, b = _shape(lhs), _shape(rhs)
    return (*a[:-1], b[-1], a[-1])


def _widen(op: ir.Operation) -> ir.Operation:
    """Replace a named contraction of bf16/f16 operands into f32 sums by the f32 contraction of
    its operands extended to f32 (`_extended`), which `pack_panels` packs as any: the second
    operand's extension (reading a transpose's input, if it is one) becomes its panels' copy."""
    lhs, rhs, init = list(op.operands)[:3]
    producer = rhs.owner if isinstance(rhs, ir.OpResult) else None
    with ir.InsertionPoint(op), op.location:
        if producer is not None and producer.name == "linalg.transpose" and len(list(rhs.uses)) == 1:
            perm = list(ir.DenseI64ArrayAttr(producer.attributes["permutation"]))
            wide_rhs = _extended(producer.operands[0], [perm.index(d) for d in range(len(perm))])
        else:
            producer, wide_rhs = None, _extended(rhs)
        named = getattr(linalg, op.name.removeprefix("linalg."))(_extended(lhs), wide_rhs, outs=[init])
    result = _value(named)
    op.results[0].replace_all_uses_with(result)
    op.erase()
    if producer is not None:
        producer.erase()
    return result.owner


def _extended(value: ir.Value, dims: list[int] | None = None, shape: list | None = None) -> ir.Value:
    """`value` extended to f32 by a linalg.generic; with `dims` (the result dimension indexing
    each dimension of `value`), transposed too, and with the result's `shape`, broadcast along
    the dimensions `dims` leaves out (a weight shared by a batch)."""
    dims = dims if dims is not None else list(range(ir.RankedTensorType(value.type).rank))
    if shape is None:
        shape = [0] * len(dims)
        for d, r in enumerate(dims):
            shape[r] = _dim(value, d)
    rank = len(shape)
    f32 = ir.F32Type.get()
    empty = tensor.EmptyOp(shape, f32).result
    maps = ir.ArrayAttr.get([dims_map(rank, dims), dims_map(rank, list(range(rank)))])
    generic = linalg.GenericOp([empty.type], [value], [empty], maps, iterator_types(rank))
    body = generic.regions[0].blocks.append(ir.RankedTensorType(value.type).element_type, f32)
    with ir.InsertionPoint(body):
        linalg.YieldOp([arith.ExtFOp(f32, body.arguments[0]).result])
    return generic.results[0]


def _widening(op: ir.Operation) -> bool:
    """A generic that only extends its one input to f32 (`_extended`)."""
    body = list(op.regions[0].blocks[0].operations) if op.name == "linalg.generic" else []
    return len(op.operands) == 2 and [o.name for o in body] == ["arith.extf", "linalg.yield"]


def _dot_source(op: ir.Operation, loops: tuple[Extent, ...], tiles: Tiles,
                max_rows: int | None = DOT_MAX_ROWS) -> ir.Operation | None:
    """The transpose producing a named contraction's second operand (f32, or bf16/f16 into f32
    sums), if the contraction has a few static rows (m up to `max_rows`; None: any number),
    static columns and k, the transpose's input is stored along k and a whole number of vectors
    long in k: the contraction is then better read as dot products."""
    m = _CONTRACTIONS[op.name]
    rhs = op.operands[1]
    producer = rhs.owner if isinstance(rhs, ir.OpResult) else None
    f32 = isinstance(ir.RankedTensorType(rhs.type).element_type, ir.F32Type)
    if (None in loops[m:] or (max_rows is not None and loops[m] > max_rows) or producer is None
            or producer.name != "linalg.transpose" or len(list(rhs.uses)) != 1
            or not (f32 or _half_contraction_loops(op) is not None)):
        return None
    perm = list(ir.DenseI64ArrayAttr(producer.attributes["permutation"]))
    if perm[-2] != len(perm) - 1 or loops[-1] % tiles.lanes:
        return None  # the source's innermost dimension is not k, or k is not whole vectors
    if perm[-1] != len(perm) - 2:
        # a batch dimension inside n (attention's k^T from [B, S, H, D], S before H): MLIR's
        # vectorizer broadcast such a tile's rows of the matrix along its rows of products instead
        # of its columns (q @ k^T of 2-8 queries: wrong scores)
        return None
    return producer.operation


def _dot_form(op: ir.Operation, transpose: ir.Operation) -> None:
    """Replace contraction `op` by a generic reading `transpose`'s input in its own order (k its
    innermost dimension): loops (batch..., m, n, k), its product and sum contractible into FMAs."""
    batch = _CONTRACTIONS[op.name]
    lhs, _, init = list(op.operands)[:3]
    source = transpose.operands[0]
    perm = list(ir.DenseI64ArrayAttr(transpose.attributes["permutation"]))
    m, n, k = batch, batch + 1, batch + 2
    element = ir.RankedTensorType(init.type).element_type
    if _shape(lhs)[m] != 1 and ir.RankedTensorType(lhs.type).element_type != element:
        with ir.InsertionPoint(op), op.location:  # rows extended once, not once per column tile
            lhs = _extended(lhs)
    rhs_loops = [*range(batch), k, n]  # the loop of each dimension of the contraction's second operand
    source_loops = [rhs_loops[perm.index(d)] for d in range(len(perm))]
    rank = batch + 3
    maps = [[*range(batch), m, k], source_loops, [*range(batch), m, n]]
    with ir.InsertionPoint(op), op.location:
        attr = ir.ArrayAttr.get([dims_map(rank, dims) for dims in maps])
        generic = linalg.GenericOp([init.type], [lhs, source], [init], attr, iterator_types(rank, [k]))
        body = generic.regions[0].blocks.append(*(ir.RankedTensorType(v.type).element_type
                                                  for v in (lhs, source, init)))
        contract = ir.Attribute.parse("#arith.fastmath<contract>")
        with ir.InsertionPoint(body):
            x, y = (arith.ExtFOp(element, a).result if a.type != element else a for a in body.arguments[:2])
            product = arith.MulFOp(x, y, fastmath=contract).result
            linalg.YieldOp([arith.AddFOp(body.arguments[2], product, fastmath=contract).result])
    op.results[0].replace_all_uses_with(generic.results[0])
    op.erase()
    transpose.erase()


def interleave_streams(module: ir.Module, tiles: Tiles) -> None:
    """Let each vector-matrix product in dot form (`_dot_loops`) whose matrix exceeds
    `Tiles.streamed_matrix_bytes` read its matrix as `Tiles.dot[0]` sequential streams
    (`_interleave_streams`)."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name == "linalg.generic" and _dot_loops(op) is not None):
            with blaming(op):
                _interleave_streams(op, tiles)


def _interleave_streams(op: ir.Operation, tiles: Tiles) -> None:
    """Split the column loop n (of size N) of a dot-form product into (g, r), n = r * N/R + g,
    r innermost and tiled whole: a register tile's R columns are then rows of the matrix N/R rows
    apart, and each is read on from where the previous tile's left off, R sequential streams.
    Adjacent rows (n = g * R + r), each tile a jump of R rows, read the weights of one decoding
    step at two thirds of the speed (17-18 GB/s against 25-27 on Zen 4, one thread, C and
    torchtosa alike) from memory; a matrix that fits the cache gains nothing."""
    streams = tiles.dot[0]
    n, k = _dot_loops(op)
    sizes = _loop_sizes(op)
    maps = map_dims(op)
    matrix = next(i for i, dims in enumerate(maps[:-1]) if n in dims)
    value = op.operands[matrix]
    element = ir.RankedTensorType(value.type).element_type
    width = 2 if is_half(element) else 4 if isinstance(element, ir.F32Type) else 0
    if (None in sizes or sizes[n] % streams or sizes[n] // streams < 2 or not width
            or sizes[n] * sizes[k] * width < tiles.streamed_matrix_bytes):
        return
    if _dot_rows(op, n, k) is not None:  # several rows: MLIR's vectorizer broadcast the interleaved
        return  # tile's weight along its rows (wrong results); the column tiles read adjacent rows
    rank, g, r = len(sizes) + 1, n, n + 1
    renumber = [d if d < n else d + 1 for d in range(len(sizes))]  # loops after n move one on

    def split(dims: list[int]) -> list[int]:  # the loops of an operand, n read as (r, g)
        return [x for d in dims for x in ((r, g) if d == n else (renumber[d],))]

    def groups(dims: list[int]) -> list[list[int]]:  # an operand's dimension reading n as two
        at = dims.index(n)
        return [[i + (i > at)] if i != at else [at, at + 1] for i in range(len(dims))]

    def expanded(value: ir.Value, dims: list[int]) -> ir.Value:
        if n not in dims:
            return value
        at, shape = dims.index(n), _shape(value)
        return expand(value, groups(dims), [*shape[:at], streams, shape[at] // streams, *shape[at + 1:]])

    block = op.regions[0].blocks[0]
    with ir.InsertionPoint(op), op.location:
        operands = [expanded(v, dims) for v, dims in zip(op.operands, maps, strict=True)]
        attr = ir.ArrayAttr.get([dims_map(rank, split(dims)) for dims in maps])
        kinds = list(ir.ArrayAttr(op.attributes["iterator_types"]))
        kinds.insert(n, kinds[n])
        generic = linalg.GenericOp([operands[-1].type], operands[:-1], operands[-1:], attr, ir.ArrayAttr.get(kinds))
        body = generic.regions[0].blocks.append(*(a.type for a in block.arguments))
        for old, new in zip(block.arguments, body.arguments, strict=True):
            old.replace_all_uses_with(new)
        for inner in list(block.operations):
            inner.detach_from_parent()
            ir.InsertionPoint(body).insert(inner)
        result = collapse(generic.results[0], groups(maps[-1]))
    op.results[0].replace_all_uses_with(result)
    op.erase()


def _dot_loops(op: ir.Operation) -> tuple[int, int] | None:
    """The (n, k) loops of a vector-matrix product in dot form, else None: every input read along
    the one reduction loop k, the innermost; the last parallel loop n read by the output and by one
    input (the matrix) but not the other (the vector), which reads no loop of a size above 1 but k,
    the matrix's batch loops and at most one loop of rows of a static size up to DOT_MAX_ROWS
    (`_dot_rows`) (`_dot_form`'s generics; those `contractions.fold_transposes` leaves; and
    `_interleave_streams`', whose output reads n before another loop)."""
    if sum_of_products(op) is None:
        return None
    maps = map_dims(op)
    rank = len(ir.ArrayAttr(op.attributes["iterator_types"]))
    k = rank - 1
    kinds = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    if sum("reduction" in kind for kind in kinds) != 1 or "reduction" not in kinds[k]:
        return None
    out, n = maps[-1], rank - 2
    if sorted(out) != list(range(rank - 1)) or not out or any(not dims or dims[-1] != k for dims in maps[:-1]):
        return None
    sizes = _loop_sizes(op)
    vectors, matrices = [d for d in maps[:-1] if n not in d], [d for d in maps[:-1] if n in d]
    if sizes is None or None in (sizes[n], sizes[k]) or len(vectors) != 1 or len(matrices) != 1:
        return None
    rows = [d for d in vectors[0] if sizes[d] != 1 and d not in matrices[0]]
    if len(rows) > 1 or any(sizes[d] is None or sizes[d] > DOT_MAX_ROWS for d in rows):
        return None
    return n, k


def _dot_rows(op: ir.Operation, n: int, k: int) -> int | None:
    """The loop of rows (m) of a product in dot form (`_dot_loops`) of more than one row, else None."""
    sizes = _loop_sizes(op)
    maps = map_dims(op)
    vector = next(dims for dims in maps[:-1] if n not in dims)
    matrix = next(dims for dims in maps[:-1] if n in dims)
    return next((d for d in vector if d != k and d not in matrix and sizes[d] != 1), None)


# The ops a row reduction combines its output with one value by (a sum, a maximum, a minimum:
# those tile_reduction_using_for knows the identity of), and each one's identity
_COMBINERS = {"arith.addf": 0.0, "arith.maximumf": -math.inf, "arith.maxnumf": -math.inf,
              "arith.minimumf": math.inf, "arith.minnumf": math.inf}


def _row_reduction(op: ir.Operation, lanes: int) -> bool:
    """Whether `op` reduces long rows: a generic whose innermost loop is a reduction of a
    static size of at least two whole vector registers, every operand that reads it reading it
    as its innermost dimension (contiguous), its body ending in a sum, maximum or minimum of the
    output and one value (other reduction loops, outside, are tiled by 1). Such a row is summed
    in vector partial results across the whole row and across lanes once
    (`tile_reduction_using_for`, as a dot product), not across lanes at every tile: a sum of
    rows of 12544 ran 5.6x slower than eager."""
    if not _reduces_rows(op):
        return False
    sizes = _loop_sizes(op)
    return sizes is not None and None not in sizes and sizes[-1] >= 2 * lanes and sizes[-1] % lanes == 0


def _reduces_rows(op: ir.Operation) -> bool:
    """`_row_reduction` but for the size of its rows."""
    if op.name != "linalg.generic" or sum_of_products(op) is not None:
        return False
    kinds = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    k = len(kinds) - 1
    if "reduction" not in kinds[k]:
        return False
    maps = map_dims(op)
    reductions = [d for d, kind in enumerate(kinds) if "reduction" in kind]
    if any(d in maps[-1] for d in reductions) or any(k in dims and dims[-1] != k for dims in maps[:-1]):
        return False
    block = op.regions[0].blocks[0]
    body = list(block.operations)
    out = block.arguments[len(block.arguments) - 1]
    combine, end = body[-2:] if len(body) > 1 else (None, None)
    if combine is None or combine.name not in _COMBINERS or end.operands[0] != combine.results[0]:
        return False
    return out in list(combine.operands) and all(out not in list(inner.operands) for inner in body[:-2])


def _parallel_worth(loops: tuple[Extent, ...], batch: int) -> bool:
    """Whether a contraction of these loop sizes (with `batch` batch loops) is split across
    threads: at least PARALLEL_MIN_MACS multiply-adds, or SPLIT_MIN_MACS for a batch of at least
    two (whose threads take whole matrices), a dynamic size counted as DYNAMIC_SIZE_GUESS."""
    sizes = [DYNAMIC_SIZE_GUESS if n is None else n for n in loops]
    batched = batch and math.prod(sizes[:batch]) >= 2
    return math.prod(sizes) >= (SPLIT_MIN_MACS if batched else PARALLEL_MIN_MACS)


def threads() -> int:
    """How many OpenMP threads run a parallel region: OMP_NUM_THREADS (its first level) if set,
    else one per core this process may run on (`cpu.cores`), as the OpenMP runtime decides."""
    setting = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if setting.isdigit() and int(setting) > 0:
        return int(setting)
    return cores()


def thread_split(op: ir.Operation, tiling: Tiling, chunks: int) -> tuple[int, ...]:
    """(loop, chunk size) splitting `op` into `chunks` chunks, one per thread, or () to leave it on
    the calling thread.

    Split: convolutions and contractions of at least SPLIT_MIN_MACS multiply-adds, other ops of
    at least SPLIT_MIN_ELEMENTS loop iterations, that are not in a loop already (a packed
    contraction's column panels decide for themselves, `pack_panels`) and whose tiles are all
    whole or peeled from a static size (no dynamic `partial` loop; a dynamic size counts as
    DYNAMIC_SIZE_GUESS). The split loop is the outermost parallel loop of a static size (in
    tile-loop order), not a peeled one, that divides into `chunks` equal chunks of whole tiles,
    so each chunk tiles exactly as the whole op did.
    """
    sizes, order, partial, _ = tiling
    loops = _loop_sizes(op)
    if chunks < 2 or loops is None or op.parent.name != "func.func" or any(loops[d] is None for d in partial):
        return ()
    macs = op.name in _DENSE or _matmul_loops(op) is not None  # a depthwise one: per element, as poolings
    work = math.prod(DYNAMIC_SIZE_GUESS if n is None else n for n in loops)
    if work < (SPLIT_MIN_MACS if macs else SPLIT_MIN_ELEMENTS):
        return ()
    parallel = _parallel_loops(op, len(loops))
    for d in order:
        if d in parallel and d not in partial and loops[d] is not None and loops[d] % (chunks * sizes[d]) == 0:
            return (d, loops[d] // chunks)
    return ()


def _window_split(op: ir.Operation, chunks: int) -> tuple[int, ...]:
    """(loop, chunk size) splitting a pooling or depthwise convolution (`_WINDOWED`, which the
    schedule leaves as plain loops) into `chunks` chunks along its outermost output dimension of
    a size that divides evenly, if it has at least SPLIT_MIN_ELEMENTS output elements x window
    positions; else ()."""
    out, window = (_shape(v) for v in (op.results[0], op.operands[1]))
    if chunks < 2 or op.parent.name != "func.func" or None in out or None in window:
        return ()
    if math.prod(out) * math.prod(window[:2]) < SPLIT_MIN_ELEMENTS:
        return ()
    return next(((d, n // chunks) for d, n in enumerate(out) if n % chunks == 0), ())


def _parallel_loops(op: ir.Operation, n_loops: int) -> set[int]:
    """The loops of a linalg op this schedule tiles whose iterations are independent."""
    if op.name in _CONTRACTIONS:
        return set(range(n_loops - 1))  # all but k
    if op.name in _DECOMPOSED:
        return {0, 1, 2, 3}  # n, oh, ow, f (c for a depthwise one)
    if op.name != "linalg.generic":
        return set(range(n_loops))  # fill, transpose, copy
    kinds = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    return {d for d, kind in enumerate(kinds) if "parallel" in kind}


def _panel_source(op: ir.Operation, loops: tuple[Extent, ...], sizes: tuple[int, ...]) -> ir.Operation | None:
    """The transpose producing contraction `op`'s second operand (nn.Linear's weight), which
    panels replace: then no call transposes the whole weight. Otherwise `op` itself, meaning
    "copy the operand panel by panel", if more than one row tile reads each panel (its rows
    are far apart in memory, the panel's are not). None if packing does not pay."""
    rhs = op.operands[1]
    producer = rhs.owner if isinstance(rhs, ir.OpResult) else None
    if producer is not None and len(list(rhs.uses)) == 1 and (producer.name == "linalg.transpose"
                                                               or _widening(producer)):
        return producer.operation
    m = _CONTRACTIONS[op.name]
    return op if loops[m] is None or loops[m] // sizes[m] >= 2 else None


def _column_panels(op: ir.Operation, source: ir.Operation, tn: int, forall: bool) -> ir.Operation | None:
    """Replace contraction `op` by a loop over (batch..., column tiles of `tn`) computing, per
    iteration, the panel (transposed from `source`'s input, or copied from the operand) and
    the contraction of its rows of the first operand with it. Columns beyond the whole tiles
    are a contraction of their own after the loop (`_rest_columns`), returned."""
    lhs, rhs, init = list(op.operands)[:3]
    transposed = source != op
    with ir.InsertionPoint(op), op.location:
        *batch, m, k = (_dim(lhs, i) for i in range(ir.RankedTensorType(lhs.type).rank))
        n = _shape(rhs)[-1] // tn * tn
        ones = [1] * len(batch)
        ivs, acc, body, finish = _loop_nest([*batch, n], [*ones, tn], init, forall)
        with ir.InsertionPoint(body):
            *at, column = ivs
            panel = _columns_of(op, source, [*at, 0, column], [*ones, k, tn], packed=True)
            rows = _extract(lhs, [*at, 0, 0], [*ones, m, k]) if batch else lhs
            tile_offsets, tile_shape = [*at, 0, column], [*ones, m, tn]
            tile = getattr(linalg, op.name.removeprefix("linalg."))(
                rows, panel, outs=[_extract(acc, tile_offsets, tile_shape)])
            result = finish(tile, tile_offsets, tile_shape)
    rest = None
    if n < _shape(rhs)[-1]:
        with ir.InsertionPoint(op), op.location:
            result, rest = _rest_columns(op, source, n, result)
    op.results[0].replace_all_uses_with(result)
    op.erase()
    if transposed:
        source.erase()  # the whole transpose, now unused
    return rest


def _rest_columns(op: ir.Operation, source: ir.Operation, at: int, out: ir.Value) -> tuple[ir.Value, ir.Operation]:
    """The columns of contraction `op` from `at` on, fewer than a column tile (1000 columns in
    tiles of 32: 992 + 8), as a contraction of their own into `out` (what the whole tiles'
    loop made: the rest of its columns are still `op`'s initial output): its part of the second
    operand (transposed from its rows of `source`'s input, if `source` is a transpose). The
    output and that contraction. Before, 1000 columns were tiled by 8, a fraction of a vector
    (a 64 x 512 x 1000 matmul at half of eager's speed), and 1040 by 16 with the rest peeled and
    nothing packed (1024 x 1024 x 1040: 0.65x eager's speed)."""
    lhs, rhs = list(op.operands)[:2]
    *batch, m, n = (_dim(out, i) for i in range(ir.RankedTensorType(out.type).rank))  # rows may be dynamic
    k = _dim(rhs, len(batch))
    zeros, width = [0] * len(batch), n - at
    columns = _columns_of(op, source, [*zeros, 0, at], [*batch, k, width], packed=False)
    part = getattr(linalg, op.name.removeprefix("linalg."))(
        lhs, columns, outs=[_extract(out, [*zeros, 0, at], [*batch, m, width])])
    return _insert(tensor.InsertSliceOp, part, out, [*zeros, 0, at], [*batch, m, width]).result, part.owner


def _columns_of(op: ir.Operation, source: ir.Operation, offsets: list, shape: list, packed: bool) -> ir.Value:
    """The part of contraction `op`'s second operand at `offsets` of `shape` ([batch..., k,
    columns]): extended to f32 from the input of `source` if it is the widening generic (`_widen`),
    transposed from its input's rows if it is a transpose, else the operand's slice itself (copied
    into a contiguous buffer if `packed`)."""
    if source.name == "linalg.generic":
        weight, dims = source.operands[0], map_dims(source)[0]
        return _extended(_extract(weight, [offsets[r] for r in dims], [shape[r] for r in dims]), dims, shape)
    rhs = op.operands[1]
    if source == op and not packed:
        return _extract(rhs, offsets, shape)
    empty = tensor.EmptyOp(shape, ir.RankedTensorType(rhs.type).element_type).result
    if source == op:
        return linalg.copy(_extract(rhs, offsets, shape), outs=[empty])
    perm = list(ir.DenseI64ArrayAttr(source.attributes["permutation"]))
    weight_offsets, weight_shape = [0] * len(perm), [0] * len(perm)
    for d, p in enumerate(perm):
        weight_offsets[p], weight_shape[p] = offsets[d], shape[d]
    return linalg.transpose(_extract(source.operands[0], weight_offsets, weight_shape), outs=[empty], permutation=perm)


def _k_chunk(op: ir.Operation, source: ir.Operation, loops: tuple[Extent, ...], sizes: tuple[int, ...],
             tiles: Tiles) -> int | None:
    """`k_chunk` of matmul `op` with static f32 row-major operands, else None."""
    if op.name != "linalg.matmul" or source != op or None in loops \
            or not isinstance(ir.RankedTensorType(op.operands[1].type).element_type, ir.F32Type):
        return None
    m, n, k = loops
    return k_chunk(m, n, k, sizes[-2], tiles)


def k_chunk(m: int, n: int, k: int, tn: int, tiles: Tiles) -> int | None:
    """The rows of k of a chunk of an m x k x n f32 product with column panels of `tn` for
    `_k_chunks` (BLIS's kc), or None.

    Where the second operand is larger than the L2's half (it comes from memory or L3) and the output
    fits its quarter (it stays there while the chunks add to it): the largest divisor of k, at least
    MIN_K_CHUNK, whose rows of a column panel fit `Tiles.chunk_panel_bytes` (they stay in L1 while
    the row tiles pass) and whose rows of the whole operand fit the L2's quarter too, if a panel of
    all of k doesn't."""
    if n % tn or 4 * k * tn <= tiles.chunk_panel_bytes or 4 * k * n <= tiles.resident_operand_bytes \
            or 4 * m * n > tiles.row_block_bytes:
        return None
    return max((c for c in range(MIN_K_CHUNK, k) if k % c == 0 and 4 * c * tn <= tiles.chunk_panel_bytes
                and 4 * c * n <= tiles.row_block_bytes), default=None)


def _k_chunks(op: ir.Operation, tn: int, chunk: int) -> None:
    """Replace matmul `op` by a loop over chunks of `chunk` rows of k, each adding the product of
    its columns of the first operand and its rows of the second, packed whole into panels of
    `tn` columns from rows read contiguously (`_row_blocks` with one block of rows), to the output."""
    lhs, rhs, init = list(op.operands)[:3]
    m, k = _shape(lhs)
    n = _shape(rhs)[-1]
    index = ir.IndexType.get()
    with ir.InsertionPoint(op), op.location:
        bounds = [arith.ConstantOp(index, v).result for v in (0, k, chunk)]
        loop = scf.ForOp(*bounds, iter_args=[init])
        loop.operation.attributes[ACCUMULATES] = ir.UnitAttr.get()
        with ir.InsertionPoint(loop.body):
            at = loop.induction_variable
            part = linalg.matmul(_extract(lhs, [0, at], [m, chunk]), _extract(rhs, [at, 0], [chunk, n]),
                                 outs=[loop.inner_iter_args[0]])
            scf.YieldOp([part])
    op.results[0].replace_all_uses_with(loop.results[0])
    op.erase()
    _row_blocks(part.owner, part.owner, tn, m)


def _row_block(op: ir.Operation, source: ir.Operation, loops: tuple[Extent, ...], sizes: tuple[int, ...],
               tiles: Tiles) -> int | None:
    """The rows of a block of contraction `op`'s first operand for `_row_blocks`: the most
    dividing m that fit in `Tiles.row_block_bytes`, whole register tiles where m has such; None
    where blocks don't pay or apply: dynamic or f32-widened operands, one column panel, a first
    operand that fits in the L2's half anyway, a second one that doesn't (`resident_operand_bytes`),
    or a transposed one whose batch dimensions are permuted too. Columns beyond the whole panels
    (256 = 5 x 48 + 16), whole vectors, are a product of their own in each block (`_row_blocks`)."""
    batch = _CONTRACTIONS[op.name]
    m, n, k = loops[batch:]
    if None in loops or n <= sizes[-2] or (n % sizes[-2] and (batch or n % sizes[-2] % tiles.lanes)) \
            or source.name == "linalg.generic" \
            or not isinstance(ir.RankedTensorType(op.operands[1].type).element_type, ir.F32Type):
        return None
    if source != op and list(ir.DenseI64ArrayAttr(source.attributes["permutation"])) != [*range(batch), batch + 1,
                                                                                           batch]:
        return None
    if 4 * m * k <= tiles.resident_operand_bytes or 4 * k * n > tiles.resident_operand_bytes:
        return None
    rows = sizes[batch]
    fits = [b for b in range(rows, m) if m % b == 0 and 4 * b * k <= tiles.row_block_bytes]
    whole = [b for b in fits if b % rows == 0]  # else each block's remainder rows are peeled (AVX2's 6 in 512)
    return max(whole or fits, default=None)


def _row_blocks(op: ir.Operation, source: ir.Operation, tn: int, block: int) -> None:
    """Replace contraction `op` by, per batch element, its second operand packed whole into
    panels of `tn` columns ([n / tn, k, tn]: transposed from `source`'s input if `source` is a
    transpose, else copied from the operand's rows, each read whole, `_panels_by_rows`), then a
    loop over blocks of `block` rows and, inside, over the panels: the contraction of the block's
    rows with each panel. Columns beyond the whole panels (a matmul's) are `_blocks_with_rest`."""
    if _shape(op.operands[1])[-1] % tn:
        _blocks_with_rest(op, source, tn, block)
        return
    lhs, rhs, init = list(op.operands)[:3]
    transposed = source != op
    batch = _CONTRACTIONS[op.name]
    *_, m, k = _shape(lhs)
    n = _shape(rhs)[-1]
    ones = [1] * batch
    plane = [list(range(batch + 1)), [batch + 1]]  # a batch element's [1..., a, b] as [a, b]
    element = ir.RankedTensorType(rhs.type).element_type
    index = ir.IndexType.get()
    with ir.InsertionPoint(op), op.location:
        if batch:
            ivs, acc, body, finish = _loop_nest([_dim(lhs, d) for d in range(batch)], ones, init, False)
        else:
            ivs, acc, body, finish = [], init, None, None
        with ir.InsertionPoint(body) if body is not None else ir.InsertionPoint(op):
            panels_out = tensor.EmptyOp([n // tn, k, tn], element).result
            if not transposed:
                columns = collapse(_extract(rhs, [*ivs, 0, 0], [*ones, k, n]), plane)
                panels = _panels_by_rows(expand(columns, [[0], [1, 2]], [k, n // tn, tn]), panels_out)
            else:
                weight = collapse(_extract(source.operands[0], [*ivs, 0, 0], [*ones, n, k]), plane)
                panels = linalg.transpose(expand(weight, [[0, 1], [2]], [n // tn, tn, k]), outs=[panels_out],
                                          permutation=[0, 2, 1])
                panels = panels.results[0]
            out = collapse(_extract(acc, [*ivs, 0, 0], [*ones, m, n]), plane) if batch else acc
            (row, column), racc, rbody, rfinish = _loop_nest([m, n], [block, tn], out, False)
            with ir.InsertionPoint(rbody):
                rows = collapse(_extract(lhs, [*ivs, row, 0], [*ones, block, k]), plane) if batch else \
                    _extract(lhs, [row, 0], [block, k])
                j = arith.DivUIOp(column, arith.ConstantOp(index, tn).result).result
                panel = collapse(_extract(panels, [j, 0, 0], [1, k, tn]), [[0, 1], [2]])
                tile = linalg.matmul(rows, panel, outs=[_extract(racc, [row, column], [block, tn])])
                result = rfinish(tile, [row, column], [block, tn])
            if batch:
                result = finish(expand(result, plane, [*ones, m, n]), [*ivs, 0, 0], [*ones, m, n])
    op.results[0].replace_all_uses_with(result)
    op.erase()
    if transposed:
        source.erase()


def _blocks_with_rest(op: ir.Operation, source: ir.Operation, tn: int, block: int) -> None:
    """`_row_blocks` of a matmul whose columns end in a rest narrower than a panel (256 = 5 x 48 +
    16): the rest of the second operand is packed too ([k, rest]), and each block of rows, while it
    is in the L2, passes over the panels and then the rest. Before, the rest was a product of its
    own after the panels' (`_rest_columns`), which read the first operand again from memory, and
    the panels did too: a ResNet-50 1x1 convolution 64 -> 256 on 8 x 56 x 56 (25088 x 64 x 256)
    spent 2.2 of its 9.6 ms on the rest's 16 columns."""
    lhs, rhs, init = list(op.operands)[:3]
    transposed = source != op
    m, k = _shape(lhs)
    n = _shape(rhs)[-1]
    whole = n // tn * tn
    element = ir.RankedTensorType(rhs.type).element_type
    with ir.InsertionPoint(op), op.location:
        panels_out = tensor.EmptyOp([whole // tn, k, tn], element).result
        if not transposed:
            panels = _panels_by_rows(expand(_extract(rhs, [0, 0], [k, whole]), [[0], [1, 2]], [k, whole // tn, tn]),
                                     panels_out)
        else:
            weight = _extract(source.operands[0], [0, 0], [whole, k])
            panels = linalg.transpose(expand(weight, [[0, 1], [2]], [whole // tn, tn, k]), outs=[panels_out],
                                      permutation=[0, 2, 1]).results[0]
        rest = _value(_columns_of(op, source, [0, whole], [k, n - whole], packed=True))
        (row,), racc, rbody, rfinish = _loop_nest([m], [block], init, False)
        with ir.InsertionPoint(rbody):
            rows = _extract(lhs, [row, 0], [block, k])
            out = _extract(racc, [row, 0], [block, n])
            (column,), cacc, cbody, cfinish = _loop_nest([whole], [tn], out, False)
            with ir.InsertionPoint(cbody):
                j = arith.DivUIOp(column, arith.ConstantOp(ir.IndexType.get(), tn).result).result
                panel = collapse(_extract(panels, [j, 0, 0], [1, k, tn]), [[0, 1], [2]])
                tile = linalg.matmul(rows, panel, outs=[_extract(cacc, [0, column], [block, tn])])
                done = cfinish(tile, [0, column], [block, tn])
            tail = linalg.matmul(rows, rest, outs=[_extract(done, [0, whole], [block, n - whole])])
            done = _insert(tensor.InsertSliceOp, tail, done, [0, whole], [block, n - whole]).result
            result = rfinish(done, [row, 0], [block, n])
    op.results[0].replace_all_uses_with(result)
    op.erase()
    if transposed:
        source.erase()


def _panels_by_rows(columns: ir.Value, out: ir.Value) -> ir.Value:
    """`columns` ([k, panels, columns of a panel]) copied into `out` ([panels, k, columns]) by a
    generic whose loops run over k outside the panels: each row of the operand read once,
    contiguously (a transpose's loops follow its output, each panel's rows far apart)."""
    maps = ir.ArrayAttr.get([dims_map(3, [0, 1, 2]), dims_map(3, [1, 0, 2])])
    element = ir.RankedTensorType(out.type).element_type
    generic = linalg.GenericOp([out.type], [columns], [out], maps, iterator_types(3))
    body = generic.regions[0].blocks.append(element, element)
    with ir.InsertionPoint(body):
        linalg.YieldOp([body.arguments[0]])
    return generic.results[0]


Finish = Callable[[ir.Value, list, list[int]], ir.Value]


def _loop_nest(sizes: list[int | ir.Value], steps: list[int], init: ir.Value, forall: bool
               ) -> tuple[list[ir.Value], ir.Value, ir.Block, Finish]:
    """Loops over `sizes` by `steps` carrying the tensor `init`: nested scf.for, or one
    scf.forall. Returns the induction variables, the carried tensor, the innermost body, and a
    function that inserts a tile into the carried tensor at the end of the body (yielding it
    out of every loop) and returns the loops' result."""
    if forall:
        loop = scf.ForallOp([0] * len(sizes), sizes, steps, shared_outs=[init])
        acc = loop.inner_iter_args[0]

        def finish_forall(tile: ir.Value, offsets: list, shape: list) -> ir.Value:
            with ir.InsertionPoint(loop.terminator().block):
                _insert(tensor.ParallelInsertSliceOp, tile, acc, offsets, shape)
            return loop.results[0]

        return list(loop.induction_variables), acc, loop.body, finish_forall
    index = ir.IndexType.get()
    loops: list[scf.ForOp] = []
    ivs, acc = [], init
    for size, step in zip(sizes, steps, strict=True):
        ip = ir.InsertionPoint(loops[-1].body) if loops else None
        bounds = [v if isinstance(v, ir.Value) else arith.ConstantOp(index, v, ip=ip).result for v in (0, size, step)]
        loops.append(scf.ForOp(*bounds, iter_args=[acc], ip=ip))
        ivs.append(loops[-1].induction_variable)
        acc = loops[-1].inner_iter_args[0]

    def finish_for(tile: ir.Value, offsets: list, shape: list) -> ir.Value:
        value = _insert(tensor.InsertSliceOp, tile, acc, offsets, shape).result
        for loop in reversed(loops):
            scf.YieldOp([value], ip=ir.InsertionPoint(loop.body))
            value = loop.results[0]
        return value

    return ivs, acc, loops[-1].body, finish_for


def _static(offsets: list) -> tuple[list[ir.Value], list[int]]:
    """Offsets or sizes (ints or index values) as the dynamic and static operands of a slice op."""
    dynamic = [o for o in offsets if isinstance(o, ir.Value)]
    return dynamic, [ir.ShapedType.get_dynamic_size() if isinstance(o, ir.Value) else o for o in offsets]


def _extract(source: ir.Value, offsets: list, shape: list) -> ir.Value:
    """The slice of `source` at `offsets` of size `shape` (ints or index values; unit strides,
    rank kept)."""
    dynamic, static = _static(offsets)
    dynamic_sizes, static_sizes = _static(shape)
    result = ir.RankedTensorType.get(static_sizes, ir.RankedTensorType(source.type).element_type)
    return tensor.ExtractSliceOp(result, source, dynamic, dynamic_sizes, [], static, static_sizes,
                                 [1] * len(shape)).result


def _insert(kind: type, tile: ir.Value, dest: ir.Value, offsets: list, shape: list) -> ir.OpView:
    dynamic, static = _static(offsets)
    dynamic_sizes, static_sizes = _static(shape)
    return kind(tile, dest, dynamic, dynamic_sizes, [], static, static_sizes, [1] * len(shape))


def plans(module: ir.Module, tiles: Tiles | None = None) -> list[tuple[ir.Operation, Tiling]]:
    """Each op of `module` that `plan` tiles (for `tiles`, by default the selected CPU's), in
    pre-order, with its tiling."""
    found: list[tuple[ir.Operation, Tiling]] = []
    tiles = tiles or derive(select())

    def visit(op: ir.Operation) -> ir.WalkResult:
        with blaming(op):
            tiling = plan(op, tiles)
        if tiling is not None:
            found.append((op, tiling))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _register_tiled(module: ir.Module, tiles: Tiles) -> list[ir.Operation]:
    """The contractions and convolutions of `module` that `plan` tiles as register tiles (not
    dot forms), planned alone rather than with every op as `plans` does: those whose output
    `drop_zero_fills` may start in registers (a depthwise one's; a dense one starts from its
    bias, broadcast)."""
    def tiled(op: ir.Operation) -> bool:
        if op.name not in _DECOMPOSED and (_matmul_loops(op) is None or _dot_loops(op) is not None):
            return False
        with blaming(op):
            return plan(op, tiles) is not None

    return find_ops(module, tiled)


def plan(op: ir.Operation, tiles: Tiles | None = None) -> Tiling | None:
    """`_plan`, with tiles that are a power of two along every loop for an op of bf16 or f16
    values: LLVM aborts on odd vectors of them ("Do not know how to soft promote this operator's
    operand": a bf16 pooling's `vector<9xbf16>`). A generic's odd tile (a static KV cache of 31
    positions) becomes the power of two below it, the remainder peeled by halves (16 + 8 + 4 +
    2 + 1); another op with one stays loops (None)."""
    tiling = _plan(op, tiles)
    if tiling is None or not any(is_half(ir.ShapedType(v.type).element_type) for v in op.operands
                                 if isinstance(v.type, ir.ShapedType)):
        return tiling
    sizes, order, partial, rows = tiling
    odd = {d for d, size in enumerate(sizes) if size & (size - 1)}
    if not odd:
        return tiling
    loops = _loop_sizes(op)
    if op.name != "linalg.generic" or any(loops[d] is None for d in odd):  # a dynamic one has a whole target tile
        return None
    sizes = tuple(_power_tile(size, size) if d in odd else size for d, size in enumerate(sizes))
    # peeled where the power of two leaves a remainder (144 in tiles of 24 -> of 16: none, and
    # peeling a loop without one fails)
    ragged = {d for d in odd if loops[d] % sizes[d]}
    return sizes, order, tuple(sorted({*partial, *ragged})), tuple(sorted({*rows, *ragged}))


def _plan(op: ir.Operation, tiles: Tiles | None = None) -> Tiling | None:
    """The tile size of each loop of `op`, the order of the tile loops, the loops (of a dynamic
    size) whose last tile may be partial and which of those are a matmul's rows; or None to
    leave `op` alone.

    Contractions walk the columns (n) outside the rows (m), so one column panel of the second
    input stays in cache while every row tile passes over it.
    """
    loops = _loop_sizes(op)
    if loops is None or not loops or 0 in loops or _broadcast_product_to_scalar(op):
        return None
    t = tiles or derive(select())
    order = list(range(len(loops)))
    if op.name in _DENSE:
        rows, columns = t.convolution  # a dynamic output width gets tiles of 1 (no masked 1-D convolutions)
        n, _, ow, f, _, _, _ = loops
        tf = _column_divisor(f, columns)
        ragged = (3,) if tf & (tf - 1) else ()  # by a power of two, the rest by the powers below, as
        if ragged:  # a matmul's columns (61 channels, or the 29 after a panel of 32: vector<8x29xf32>)
            tf = _power_tile(f, columns)
        if _batch_rows(n, ow, rows):
            return (_divisor(n, rows), 1, 1, tf, 1, 1, 1), tuple(order), ragged, ragged
        sizes = (1, 1, 1 if ow is None else _divisor(ow, rows), tf, 1, 1, 1)
        if _peel_rows(ow, rows):  # rows of the output width: the remainder peeled, as a matmul's
            return (1, 1, rows, *sizes[3:]), tuple(order), (2, *ragged), (2, *ragged)
        return sizes, tuple(order), ragged, ragged
    if op.name == _DEPTHWISE or op.name in _POOLS:  # loops (n, oh, ow, c, kh, kw), static
        _, _, ow, c, _, _ = loops
        sizes = (1, 1, _divisor(ow, t.depthwise[0]), _lanes_divisor(c, t.depthwise[1], t.lanes), 1, 1)
        if sizes[3] & (sizes[3] - 1):  # 300 channels by 30: loop-carried vector<8x30xf32> sums in scalars
            sizes = (*sizes[:3], _power_tile(c, t.depthwise[1]), 1, 1)
            return sizes, tuple(order), (3,), (3,)  # by a power of two, the rest by the powers below
        return sizes, tuple(order), (), ()
    sizes = [1] * len(loops)
    dot = _dot_loops(op)
    if dot is not None and loops[dot[1]] % t.lanes == 0:
        n, k = dot
        sizes[n] = _divisor(loops[n], t.dot[0])
        vectors = t.dot[1] // t.lanes  # of k, per column: fewer with more rows in the tile
        m = _dot_rows(op, n, k)
        if m is not None:  # the column tiles outside the rows: a tile's columns stay in L1
            sizes[m] = _divisor(loops[m], t.dot_rows)
            vectors = max(1, vectors // sizes[m])
            order.remove(n)
            order.insert(order.index(m), n)
        sizes[k] = _divisor(loops[k] // t.lanes, vectors) * t.lanes
        return tuple(sizes), tuple(order), (), ()
    if _row_reduction(op, t.lanes):  # partial results in registers, as a dot product's
        sizes[-1] = _lanes_divisor(loops[-1], t.vector, t.lanes)
        return tuple(sizes), tuple(order), (), ()
    mn = _matmul_loops(op)
    if mn is not None:  # reduction step 1: the k loop keeps tile 1
        m, n = mn
        rows, columns = t.matmul
        if None in (loops[m], loops[n]):  # peeled tiles are vectorized whole: a power of two of vectors
            columns = t.convolution[1]
        sizes[m] = _tile(loops[m], rows)
        sizes[n] = columns if loops[n] is None else _column_divisor(loops[n], columns)
        order.remove(n)
        order.insert(order.index(m), n)
        partial = _partial(loops, sizes)
        halved = [m]  # loops whose remainder goes in tiles of the powers of two below the tile
        if _peel_columns(loops[n], columns):
            sizes[n] = _power_tile(loops[n], columns)
            partial = tuple(sorted((*partial, n)))
            halved.append(n)
        if _peel_rows(loops[m], rows):
            sizes[m] = rows
            partial = tuple(sorted((*partial, m)))
        return tuple(sizes), tuple(order), partial, tuple(d for d in partial if d in halved)
    sizes[-1] = _tile(loops[-1], t.vector)
    inner = _transposed_inner_loop(op, len(loops))
    if inner is not None:  # a square tile, transposed in registers, instead of a strided gather
        sizes[-1] = _tile(loops[-1], t.transpose)
        sizes[inner] = _tile(loops[inner], t.transpose)
        # a side of no divisor near the tile (k of 577 keys: 1, 16 scalar stores per 16 loads)
        # gets whole tiles, the rest peeled
        ragged = [d for d in (inner, len(loops) - 1)
                  if loops[d] is not None and loops[d] > t.transpose and 2 * sizes[d] < t.transpose]
        if ragged:
            for d in ragged:
                sizes[d] = t.transpose
            return tuple(sizes), tuple(order), tuple(sorted({*_partial(loops, sizes), *ragged})), ()
    elif loops[-1] is not None and loops[-1] > t.vector:
        # whole registers: 80 in tiles of 16, not 40; or, without a divisor of whole registers, one
        # register and the remainder peeled: a softmax over rows of 100 in tiles of 50
        # (vector<50xf32>) ran 5x slower than eager, 3.2x faster peeled
        sizes[-1] = _lanes_divisor(loops[-1], t.vector, t.lanes)
        if sizes[-1] % t.lanes:
            sizes[-1] = t.lanes
            return tuple(sizes), tuple(order), tuple(sorted((*_partial(loops, sizes), len(loops) - 1))), ()
    if loops[-1] is not None and sizes[-1] & (sizes[-1] - 1) and _carries_vectors(op):
        # the tile is an accumulator carried through a reduction loop: LLVM keeps a loop-carried
        # vector<56xf32> (or 48, 24) in scalars (a sum over H of [4, 32, 56, 56] 2.3x eager's
        # time); a power of two instead, the remainder in smaller powers of two (56: 32, 16, 8)
        last = len(loops) - 1
        sizes[last] = _power_tile(loops[last], t.vector)
        if loops[last] % sizes[last]:
            return tuple(sizes), tuple(order), tuple(sorted((*_partial(loops, sizes), last))), (last,)
    return tuple(sizes), tuple(order), _partial(loops, sizes), ()


def _carries_vectors(op: ir.Operation) -> bool:
    """Whether `op`'s vectorized tiles are carried through a loop: a parallel innermost loop, a
    reduction loop outside it."""
    if "iterator_types" not in op.attributes:
        return False
    kinds = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    return "reduction" not in kinds[-1] and any("reduction" in kind for kind in kinds)


def _broadcast_product_to_scalar(op: ir.Operation) -> bool:
    """A sum of products into a 0-d result with an input broadcast along a loop (`(x * w).sum()`,
    w of fewer dims): vectorized, MLIR's contraction patterns cast its scalar accumulator to a
    vector and abort the process (found by tests/test_pipeline_fuzz.py). It stays loops."""
    if sum_of_products(op) is None or map_dims(op)[-1]:
        return False
    n_loops = len(ir.ArrayAttr(op.attributes["iterator_types"]))
    return any(len(dims) < n_loops for dims in map_dims(op)[:-1])


def _peel_rows(n: Extent, rows: int) -> bool:
    """Whether a static number of rows `n` is better tiled by `rows` with its remainder peeled
    (`_Remainders`: in tiles of the powers of two below `rows`) than by its largest divisor up to
    `rows`: when that takes fewer register tiles. A 7 x 7 feature map's 49 rows with a tile of 4:
    in tiles of 1 a 49 x 4608 x 512 matmul ran at 8.9 GF/s, 48 rows at 30; AVX2's 6-row tile
    over 1024 rows (170 x 6 + 4, not 256 x 4) ran 6% faster, over a 56-pixel row (9 x 6 + 2,
    not 14 x 4) a convolution 2% faster. An AVX-512 tile of 8 keeps 7 rows for 49 or 28 (7
    tiles against 6 + 1, 4 against 3 + 1)."""
    if n is None or n <= rows:
        return False
    return n // rows + (n % rows).bit_count() < n // _divisor(n, rows)


def _batch_rows(n: Extent, ow: Extent, rows: int) -> bool:
    """Whether a 2-D convolution's register tile takes its rows from the batch (one output pixel
    of `n` images) rather than the output width: when the batch gives more of them. A weight
    gradient is such a convolution: AOTAutograd writes it as the forward's input channels (the
    batch) convolved with the output gradient as a filter the size of the image, into 3 x 3
    outputs; 3 rows of a width left 10 of AVX-512's 16 accumulators unused."""
    if n is None or ow is None:
        return False
    return _divisor(n, rows) > (rows if _peel_rows(ow, rows) else _divisor(ow, rows))


def _peel_columns(n: Extent, columns: int) -> bool:
    """Whether a static number of columns `n` is better tiled by a power of two (`columns`, or
    the largest below `n`) with its remainder peeled in the powers of two below that than by a
    divisor: when it has no power-of-two divisor from 8 up (`_column_divisor`), is no power of
    two itself and no multiple of the tile (NEON's 12 columns: 3 vectors). As attention's scores
    over 100 keys: in tiles of 25 columns (vector<25xf32>) their 16 x 100 x 64 x 100 batch
    matmul ran 19x slower than eager; and a 1x1 convolution to 61
    channels (RexNet's), panels of 32 and the rest, 29, in one tile: LLVM kept its loop-carried
    vector<8x29xf32> accumulators in scalars, 8.8x eager's time."""
    return n is not None and n % 8 != 0 and n % columns != 0 and n & (n - 1) != 0


def _partial(loops: tuple[Extent, ...], sizes: list[int]) -> tuple[int, ...]:
    """The loops whose last tile may be partial: a dynamic size tiled by more than 1."""
    return tuple(d for d, (n, t) in enumerate(zip(loops, sizes, strict=True)) if n is None and t > 1)


def _matmul_loops(op: ir.Operation) -> tuple[int, int] | None:
    """The (m, n) loops of a named contraction, or of a generic one (a matmul that elementwise
    fusion generalized to move a reshape through it)."""
    if op.name in _CONTRACTIONS:
        batch = _CONTRACTIONS[op.name]
        return batch, batch + 1
    return _generic_contraction(op)


def _generic_contraction(op: ir.Operation) -> tuple[int, int] | None:
    """The (m, n) loops of a generic that is a matmul-like sum of products, else None.

    Its body ends in `out + x * y`; x and y may be computed from the inputs first (elementwise
    fusion moves producers such as attention's scaling into the matmul, which `_split_prologue`
    splits off again before tiling), but then no input may be broadcast. n is the output's
    innermost dimension and m the one before it; an input read along n must run along it
    contiguously, as the register tile needs.
    """
    mul = sum_of_products(op)
    if mul is None:
        return None
    maps = map_dims(op)
    if len(maps[-1]) < 2:
        return None
    m, n = maps[-1][-2:]
    if any(n in dims and dims[-1] != n for dims in maps[:-1]):
        return None
    if len(list(op.regions[0].blocks[0].operations)) > 3 and _broadcast_inputs(op, m, n):
        return None  # vectorized as one op, it came out wrong on square tiles
    return m, n




def _broadcast_inputs(op: ir.Operation, m: int, n: int) -> bool:
    """Whether an input of a generic contraction is indexed by fewer loops than a matmul factor
    (every loop but n, or every loop but m)."""
    every = set(range(len(ir.ArrayAttr(op.attributes["iterator_types"]))))
    return any(set(dims) not in (every - {n}, every - {m}) for dims in map_dims(op)[:-1])


def split_prologues(module: ir.Module) -> None:
    """`_split_prologue` every generic contraction of `module`."""
    _rewrite_contractions(module, _split_prologue)


def _split_prologue(op: ir.Operation) -> None:
    """Compute the factors of a generic contraction's `out + x * y` that its prologue derives
    from its inputs (softmax @ v with the normalization fused in, q @ k^T with attention's
    scaling of q and k) as elementwise generics of their own, leaving a plain contraction of the
    two factors, which tiles as a matmul. Computed in the register tile, a factor was computed
    again for every tile that reads it (the scaled q gathered row by row at every step of k: a
    577-token attention's q @ k^T ran at a third of the FMA rate); split off, each element is
    computed once.

    x (read along every loop but n) and y (every loop but m, n innermost) become tensors; a
    factor that is an input as it is stays that input.
    """
    mul = sum_of_products(op)
    block = op.regions[0].blocks[0]
    if mul is None or len(list(block.operations)) <= 3 or contraction_of_inputs(op):
        return  # no prologue, or only its inputs' extensions (`normalize` takes those)
    add = list(block.operations)[-2]
    maps = map_dims(op)
    n_loops = len(ir.ArrayAttr(op.attributes["iterator_types"]))
    if len(maps[-1]) < 2:
        return
    m, n = maps[-1][-2:]
    inputs = list(op.operands)[: len(maps) - 1]
    u, v = mul.operands[0], mul.operands[1]

    def touches(value: ir.Value, loop: int) -> bool:
        indices = [ir.IntegerAttr(o.attributes["dim"]).value for o in _slice(value, block) if o.name == "linalg.index"]
        return loop in indices or any(loop in maps[a] for a in _arguments_of(value, block))

    if touches(u, n) or touches(v, m):
        u, v = v, u
        if touches(u, n) or touches(v, m):
            return  # not a product of an (m, k) factor and a (k, n) one
    new_inputs, new_maps = [], []
    for value, skip in ((u, n), (v, m)):
        arg = _input_argument(value, block)
        if arg is not None and (skip == n or maps[arg][-1] == n):
            new_inputs.append(inputs[arg])
            new_maps.append(maps[arg])
            continue
        domain = [d for d in range(n_loops) if d != skip]
        if skip == m:
            domain = [d for d in domain if d != n] + [n]  # the second factor runs along n
        new_inputs.append(_materialize(op, value, domain))
        new_maps.append(domain)
    _replace_with_contraction(op, new_inputs, new_maps, mul.name, add.name)


def collapse_outputs(module: ir.Module) -> None:
    """`_collapse_outputs` every generic contraction of `module`."""
    _rewrite_contractions(module, _collapse_outputs)


def _collapse_outputs(op: ir.Operation) -> None:
    """Merge a run of adjacent parallel loops of a generic contraction into one where every
    operand reads them as one run of adjacent dimensions in the same order, the output too: a
    linear layer on one token whose output fusion split into attention heads (q = x @ W.t()
    viewed [heads, head_dim]) is then one vector-matrix product over all of W's rows, which
    `_interleave_streams` reads as a few long streams instead of 4-row tiles of each head (a bf16
    projection streamed at 8 instead of 20 GB/s). The body is kept as it is (prologues too)."""
    iterators = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    maps = map_dims(op)
    out = maps[-1]
    run = next((out[i:j] for i in range(len(out)) for j in range(len(out), i + 1, -1)
                if all("parallel" in iterators[d] for d in out[i:j]) and _read_as_run(maps, out[i:j])), None)
    if run is None:
        return
    if not _collapsible(list(op.operands), maps, run):
        return
    init = op.operands[len(maps) - 1]
    with ir.InsertionPoint(op), op.location:
        sizes = [_dim(init, d) for d in range(len(out))]  # the result is expanded back to them
        operands, dims, _, kept = _merge_run(op, list(op.operands), maps, run)
        n_loops = len(iterators) - len(run) + 1
        generic = linalg.GenericOp([operands[-1].type], operands[:-1], [operands[-1]],
                                   ir.ArrayAttr.get([dims_map(n_loops, ds) for ds in dims]), kept)
        copy_body(op, generic)
        result = expand(generic.results[0], _run_groups(out.index(run[0]), len(run), len(out)), sizes)
    op.results[0].replace_all_uses_with(result)
    op.erase()


def _collapsible(values: list[ir.Value], maps: list[list[int]], run: list[int]) -> bool:
    """Whether each of `values` (read along the loops `maps`) has at most one dynamic size among
    the dimensions it reads the loops `run` along: a reshape of two in one group does not lower
    (an assertion in MLIR)."""
    return all(sum(_shape(value)[i] is None for i, d in enumerate(dims) if d in run) <= 1
               for value, dims in zip(values, maps, strict=True))


def _merge_run(op: ir.Operation, values: list[ir.Value], maps: list[list[int]], run: list[int]
               ) -> tuple[list[ir.Value], list[list[int]], dict[int, int], ir.ArrayAttr]:
    """`values` (operands of generic `op`, read along the loops `maps`) with the adjacent
    dimensions each reads the loops `run` along collapsed into one (at the current insertion
    point); the loops each is then read along, the new number of each loop, and `op`'s
    iterator types without the merged loops."""
    first, merged = run[0], set(run[1:])
    iterators = ir.ArrayAttr(op.attributes["iterator_types"])
    renumber = {d: d - sum(1 for m in merged if m < d) for d in range(len(iterators)) if d not in merged}
    collapsed, dims = [], []
    for value, operand_dims in zip(values, maps, strict=True):
        if first in operand_dims:
            start = operand_dims.index(first)
            value = collapse(value, _run_groups(start, len(run), len(operand_dims)))
            operand_dims = operand_dims[:start + 1] + operand_dims[start + len(run):]
        collapsed.append(value)
        dims.append([renumber[d] for d in operand_dims])
    kept = ir.ArrayAttr.get([a for d, a in enumerate(iterators) if d not in merged])
    return collapsed, dims, renumber, kept


def _run_groups(start: int, length: int, rank: int) -> list[list[int]]:
    """Reassociation groups of `rank` dimensions merging the `length` from `start` into one."""
    return [[i] for i in range(start)] + [list(range(start, start + length))] + \
        [[i] for i in range(start + length, rank)]


def _read_as_run(maps: list[list[int]], run: list[int]) -> bool:
    """Whether each operand that reads any loop of `run` reads all of them, adjacent, in order."""
    for dims in maps:
        found = [d for d in dims if d in run]
        if found and (found != run or dims[dims.index(run[0]):dims.index(run[0]) + len(run)] != run):
            return False
    return True


def generalize_reductions(module: ir.Module) -> None:
    """Rewrite each `linalg.reduce` of floats as the equivalent generic, which the schedule tiles.

    tosa-to-linalg makes a reduction a `linalg.reduce` and TOSA keeps the reduced dims as 1s; the
    reshape that drops them fuses into it as a generic (`fuse-before-reshapes`), except where the
    result is a scalar: `x.sum()` of a 1-D tensor stayed a named op the schedule didn't take, a
    serial scalar loop (2^20 floats 5.4x eager's time, with 10x its rounding error). As a generic
    it is a row reduction (`_row_reduction`): vector partial sums, summed across lanes once."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name == "linalg.reduce"):
            types = [ir.RankedTensorType(v.type).element_type for v in op.operands]
            if not all(isinstance(t, (ir.F32Type, ir.F16Type, ir.BF16Type)) for t in types):
                continue
            n_inits = len(op.results)
            inputs, inits = list(op.operands)[:-n_inits], list(op.operands)[-n_inits:]
            n_loops = ir.RankedTensorType(inputs[0].type).rank
            reduced = set(ir.DenseI64ArrayAttr(op.attributes["dimensions"]))
            kept = [d for d in range(n_loops) if d not in reduced]
            maps = [dims_map(n_loops, list(range(n_loops)))] * len(inputs) + [dims_map(n_loops, kept)] * n_inits
            with blaming(op), ir.InsertionPoint(op), op.location:
                generic = linalg.GenericOp([r.type for r in op.results], inputs, inits, ir.ArrayAttr.get(maps),
                                           iterator_types(n_loops, reduced))
                copy_body(op, generic)
            for old, new in zip(op.results, generic.results, strict=True):
                old.replace_all_uses_with(new)
            op.erase()


def collapse_reductions(module: ir.Module) -> None:
    """`_collapse_reductions` every generic contraction of `module`, `_collapse_row` every other
    generic reduction."""
    _rewrite_contractions(module, _collapse_reductions)
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name == "linalg.generic" and sum_of_products(op) is None):
            with blaming(op):
                _collapse_row(op)


def split_long_reductions(module: ir.Module, tiles: Tiles) -> None:
    """`_split_long_reduction` each generic reducing a whole static 1-D operand to a scalar."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name == "linalg.generic"):
            with blaming(op):
                _split_long_reduction(op, tiles)


def _split_long_reduction(op: ir.Operation, tiles: Tiles) -> None:
    """Sum (or max, min) a long row in two stages: rows of at most SPLIT_ROW elements into one
    partial result each, then those, instead of one row of vector partial sums.

    Each element of a row reduction's vector tile of partial sums (`Tiles.vector` wide) adds one
    element in `Tiles.vector` of the whole row in order, so its rounding error grows with the
    row's length: `x.sum()` of 2^26 normal floats was off by 0.11 (eager's cascade: 3e-4). Split,
    none adds more than SPLIT_ROW / vector + rows / vector of them. The row length is the largest
    multiple of the vector tile dividing the row that leaves a count of rows the second stage
    reduces in whole vectors (or a few, MAX_SCALAR_ROWS, in scalars). A row no such length
    divides (a prime length) is cut (`_peel`) after as many rows of SPLIT_ROW as that allows, and
    a shorter one after its whole vectors: the rest, reduced first, is split so in turn. A row
    reduction of a single loop has a scalar result (`_reduces_rows`: the output is not indexed
    by its reductions); every input reads the whole row, and no `linalg.index` names the loop."""
    if len(ir.ArrayAttr(op.attributes["iterator_types"])) != 1 or not _reduces_rows(op):
        return
    sizes = _loop_sizes(op)
    block = op.regions[0].blocks[0]
    n_inputs = len(block.arguments) - 1
    if (sizes is None or sizes[0] is None or any(dims != [0] for dims in map_dims(op)[:n_inputs])
            or any(inner.name == "linalg.index" for inner in block.operations)):
        return
    (k,) = sizes
    row = max((r for r in range(tiles.vector, min(SPLIT_ROW, k // 2) + 1, tiles.vector)
               if k % r == 0 and (k // r <= MAX_SCALAR_ROWS or k // r % tiles.lanes == 0)), default=None)
    if row is None:
        rows = k // SPLIT_ROW
        if rows >= 2:
            at = (rows if rows <= MAX_SCALAR_ROWS else rows - rows % tiles.lanes) * SPLIT_ROW
        elif k % tiles.lanes and k >= 2 * tiles.lanes:
            at = k - k % tiles.lanes
        else:
            return
        head, rest = _peel(op, at)
        _split_long_reduction(rest, tiles)
        _split_long_reduction(head, tiles)
        return
    rows = k // row
    combine = list(block.operations)[-2]
    element = ir.RankedTensorType(op.results[0].type).element_type
    inputs, init = list(op.operands)[:n_inputs], op.operands[n_inputs]
    with ir.InsertionPoint(op), op.location:
        split = [expand(v, [[0, 1]], [rows, row]) for v in inputs]
        identity = arith.ConstantOp(element, _COMBINERS[combine.name]).result
        partials_init = _value(linalg.fill(identity, outs=[tensor.EmptyOp([rows], element).result]))
        maps = [dims_map(2, [0, 1])] * n_inputs + [dims_map(2, [0])]
        first = linalg.GenericOp([partials_init.type], split, [partials_init], ir.ArrayAttr.get(maps),
                                 iterator_types(2, [1]))
        copy_body(op, first)
        second = linalg.GenericOp([op.results[0].type], [first.results[0]], [init],
                                  ir.ArrayAttr.get([dims_map(1, [0]), dims_map(1, [])]), iterator_types(1, [0]))
        body = second.regions[0].blocks.append(element, element)
        out = block.arguments[n_inputs]
        value = next(v for v in combine.operands if v != out)
        mapping = {value: body.arguments[0], out: body.arguments[1]}
        clone_into(combine, mapping, ir.InsertionPoint(body))
        linalg.YieldOp([mapping[combine.results[0]]], ip=ir.InsertionPoint(body))
    op.results[0].replace_all_uses_with(second.results[0])
    op.erase()


def peel_row_remainders(module: ir.Module, tiles: Tiles) -> None:
    """Cut each reduction of rows of a static length that is not a whole number of vector
    registers (`_reduces_rows`, two registers or more, a loop besides the row's) after its whole
    registers (`_peel`): the whole part keeps vector partial results through the row
    (`_row_reduction`), the few elements left are reduced first. Uncut, every tile of 16 was
    reduced across its lanes before the next: the row maximum of attention over 577 keys (a
    maximumf: NaN and signed zeros checked at each step) took 17% of the attention's time."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name == "linalg.generic"):
            if len(ir.ArrayAttr(op.attributes["iterator_types"])) < 2 or not _reduces_rows(op):
                continue  # a whole 1-D row: `split_long_reductions`
            sizes = _loop_sizes(op)
            if sizes is None or sizes[-1] is None or sizes[-1] < 2 * tiles.lanes or sizes[-1] % tiles.lanes == 0:
                continue
            if any(inner.name == "linalg.index" for inner in op.regions[0].blocks[0].operations):
                continue
            with blaming(op):
                _peel(op, sizes[-1] - sizes[-1] % tiles.lanes)


def _peel(op: ir.Operation, at: int) -> tuple[ir.Operation, ir.Operation]:
    """Cut a row reduction (`_reduces_rows`: every input that reads the innermost loop reads it
    as its last dimension) at `at` of that loop: the rest of the rows is reduced into the
    original result, then their first `at` elements into that. (head, rest)."""
    n_inputs = len(op.regions[0].blocks[0].arguments) - 1
    inputs, init = list(op.operands)[:n_inputs], op.operands[n_inputs]
    sizes = _loop_sizes(op)
    k, last = sizes[-1], len(sizes) - 1
    maps, kinds = op.attributes["indexing_maps"], op.attributes["iterator_types"]

    def part(value: ir.Value, dims: list[int], start: int, size: int) -> ir.Value:
        if not dims or dims[-1] != last:
            return value
        shape = _shape(value)
        return static_slice(value, [0] * (len(shape) - 1) + [start], [*shape[:-1], size])

    reads = map_dims(op)[:n_inputs]
    with ir.InsertionPoint(op), op.location:
        rest = linalg.GenericOp([init.type], [part(v, d, at, k - at) for v, d in zip(inputs, reads, strict=True)],
                                [init], maps, kinds)
        copy_body(op, rest)
        head = linalg.GenericOp([init.type], [part(v, d, 0, at) for v, d in zip(inputs, reads, strict=True)],
                                [rest.results[0]], maps, kinds)
        copy_body(op, head)
    op.results[0].replace_all_uses_with(head.results[0])
    op.erase()
    return head.operation, rest.operation


def _collapse_row(op: ir.Operation) -> None:
    """Merge the reduction loops that a generic reduction's operands read last (the innermost
    loop and those before it), as one run of adjacent dimensions in the same order, into one:
    a sum over dims (0, 2, 3) of [N, C, H, W], read through TOSA's transpose to [C, N, H, W]
    (`contractions.fold_transposes`), is then a loop over N around one over rows of H * W, which
    `_row_reduction` sums in vector partial results."""
    iterators = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    reductions = [d for d, kind in enumerate(iterators) if "reduction" in kind]
    maps = map_dims(op)
    block = op.regions[0].blocks[0]
    last = len(iterators) - 1
    if last not in reductions or any(d in maps[-1] for d in reductions):
        return
    if any(inner.name == "linalg.index" for inner in block.operations):
        return  # it names the loops by number
    reader = next((dims for dims in maps[:-1] if dims and dims[-1] == last), None)
    if reader is None:
        return
    run = [last]  # the reduction loops the reader reads last, adjacent
    for d in reversed(reader[:-1]):
        if d not in reductions or d in run:
            break
        run.insert(0, d)
    if len(run) < 2 or not _read_as_run(maps[:-1], run):
        return
    inputs = list(op.operands)[:len(maps) - 1]
    if not _collapsible(inputs, maps[:-1], run):
        return
    init = op.operands[len(maps) - 1]
    with ir.InsertionPoint(op), op.location:
        inputs, dims, renumber, kept = _merge_run(op, inputs, maps[:-1], run)
        n_loops = len(iterators) - len(run) + 1
        affine = [dims_map(n_loops, ds) for ds in [*dims, [renumber[d] for d in maps[-1]]]]
        generic = linalg.GenericOp([op.results[0].type], inputs, [init], ir.ArrayAttr.get(affine), kept)
        copy_body(op, generic)
    op.results[0].replace_all_uses_with(generic.results[0])
    op.erase()


def _rewrite_contractions(module: ir.Module, rewrite: Callable[[ir.Operation], None]) -> None:
    """Apply `rewrite` to each generic contraction (`sum_of_products`) of `module`."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: sum_of_products(op) is not None):
            with blaming(op):
                rewrite(op)


def _collapse_reductions(op: ir.Operation) -> None:
    """Merge the reduction loops of a plain generic contraction (`out + x * y`) into one when
    each input reads them as one run of adjacent dimensions in the same order: a linear layer
    applied to heads that fusion moved a reshape into (sum over head and head dimension).

    The register tile vectorizes a single reduction loop; with two, each tile became
    8 x 32 scalar multiply-adds.
    """
    if len(list(op.regions[0].blocks[0].operations)) != 3:
        return  # a prologue computes the factors
    iterators = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    reductions = [d for d, kind in enumerate(iterators) if "reduction" in kind]
    maps = map_dims(op)
    if len(reductions) < 2 or any(d in maps[-1] for d in reductions):
        return
    run: list[int] | None = None
    for dims in maps[:-1]:
        where = [i for i, d in enumerate(dims) if d in reductions]
        if not where:
            continue
        found = dims[where[0]:where[-1] + 1]
        if len(found) != len(reductions) or (run is not None and found != run):
            return
        run = found
    if run is None:
        return
    with ir.InsertionPoint(op), op.location:
        inputs, dims, renumber, kept = _merge_run(op, list(op.operands)[:len(maps) - 1], maps[:-1], run)
    block = op.regions[0].blocks[0]
    mul, add = list(block.operations)[:2]
    # x * x (a sum of squares: rms_norm) reads one input twice; a factor may also be a value from above
    factors = [_input_argument(v, block) if _input_argument(v, block) is not None else v for v in mul.operands]
    _replace_with_contraction(op, inputs, dims, mul.name, add.name, [renumber[d] for d in maps[-1]], kept, factors)


def _input_argument(value: ir.Value, block: ir.Block) -> int | None:
    """The input number if `value` is an input argument of the generic's body, else None."""
    if isinstance(value, ir.BlockArgument) and value.owner == block and value.arg_number < len(block.arguments) - 1:
        return value.arg_number
    return None


def _arguments_of(value: ir.Value, block: ir.Block) -> list[int]:
    """The input arguments of `block` that `value` is computed from."""
    values = [value, *(operand for inner in _slice(value, block) for operand in inner.operands)]
    args = (_input_argument(v, block) for v in values)
    return sorted({arg for arg in args if arg is not None})


def _materialize(op: ir.Operation, value: ir.Value, domain: list[int]) -> ir.Value:
    """A new elementwise generic over the loops `domain` (in that order) computing the body
    value `value` of generic `op`, before `op`; its result tensor."""
    block = op.regions[0].blocks[0]
    maps = map_dims(op)
    operands = list(op.operands)
    sizes = _generic_loop_sizes(op)
    args = _arguments_of(value, block)
    def amap(dims: list[int]) -> ir.AffineMapAttr:
        exprs = [ir.AffineDimExpr.get(domain.index(d)) for d in dims]
        return ir.AffineMapAttr.get(ir.AffineMap.get(len(domain), 0, exprs))

    element = value.type
    sources = _loop_dim_sources(op)
    with ir.InsertionPoint(op), op.location:
        empty = tensor.EmptyOp([_dim(*sources[d]) if sizes[d] is None else sizes[d] for d in domain], element).result
        result = empty.type
        generic = linalg.GenericOp([result], [operands[a] for a in args], [empty],
                                   ir.ArrayAttr.get([amap(maps[a]) for a in args] + [amap(domain)]),
                                   iterator_types(len(domain)))
        new_block = generic.regions[0].blocks.append(*[block.arguments[a].type for a in args], element)
    mapping = [(block.arguments[a], new_block.arguments[i]) for i, a in enumerate(args)]

    def mapped(v: ir.Value) -> ir.Value:
        return next((new for old, new in mapping if old == v), v)

    needed = _slice(value, block)
    with ir.InsertionPoint(new_block):
        for inner in block.operations:
            if inner not in needed:
                continue
            clone = inner.clone()
            for i, operand in enumerate(list(clone.operands)):
                clone.operands[i] = mapped(operand)
            if clone.name == "linalg.index":  # the loop's position in the new op
                loop = ir.IntegerAttr(clone.attributes["dim"]).value
                clone.attributes["dim"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), domain.index(loop))
            mapping += list(zip(inner.results, clone.results, strict=True))
        linalg.YieldOp([mapped(value)])
    return generic.results[0]


def _slice(value: ir.Value, block: ir.Block) -> set[ir.Operation]:
    """The ops of `block` that `value` is computed by."""
    ops: set[ir.Operation] = set()
    pending = [value]
    while pending:
        v = pending.pop()
        if isinstance(v, ir.OpResult) and v.owner.parent == block.owner and v.owner.operation not in ops:
            ops.add(v.owner.operation)
            pending += list(v.owner.operands)
    return ops


_ARITH = {"arith.mulf": arith.MulFOp, "arith.muli": arith.MulIOp,
          "arith.addf": arith.AddFOp, "arith.addi": arith.AddIOp}


def _replace_with_contraction(op: ir.Operation, inputs: list[ir.Value], dims: list[list[int]],
                              mul: str, add: str, out_dims: list[int] | None = None,
                              iterators: ir.ArrayAttr | None = None,
                              factors: Sequence[int | ir.Value] = (0, 1)) -> None:
    """Replace generic contraction `op` by `out + x * y` of the tensors `inputs` read along the
    loops `dims`, the output along `out_dims`, over the loops `iterators` (by default `op`'s
    own). x and y are `factors`: an input's position (by default the first two), or a value
    defined above the op."""
    maps = map_dims(op)
    iterators = iterators or op.attributes["iterator_types"]
    n_loops = len(ir.ArrayAttr(iterators))
    init = list(op.operands)[len(maps) - 1]
    affine = [dims_map(n_loops, ds) for ds in [*dims, maps[-1] if out_dims is None else out_dims]]
    with ir.InsertionPoint(op), op.location:
        generic = linalg.GenericOp([op.results[0].type], inputs, [init], ir.ArrayAttr.get(affine), iterators)
        types = [ir.RankedTensorType(v.type).element_type for v in [*inputs, init]]
        body = generic.regions[0].blocks.append(*types)
        with ir.InsertionPoint(body):
            x, y = (body.arguments[f] if isinstance(f, int) else f for f in factors)
            product = _ARITH[mul](x, y).result
            linalg.YieldOp([_ARITH[add](body.arguments[len(inputs)], product).result])
    op.results[0].replace_all_uses_with(generic.results[0])
    op.erase()


def _transposed_inner_loop(op: ir.Operation, n_loops: int) -> int | None:
    """The loop over an operand's innermost dimension, if the innermost loop strides through that operand."""
    if op.name == "linalg.transpose":
        perm = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
        rank = len(perm)
        shape = _shape(op.operands[0])
        # the output dimension that is the input's last one of a size above 1 (a depthwise
        # convolution's multiplier of 1 is a unit dimension after the channels)
        inner = perm.index(max((d for d in range(rank) if shape[d] != 1), default=rank - 1))
        return inner if inner != rank - 1 else None
    if op.name != "linalg.generic":
        return None
    last = n_loops - 1
    for dims in map_dims(op):
        if last in dims and dims[-1] != last:  # reads or writes along the innermost loop with a stride
            return dims[-1]
    return None




def _loop_sizes(op: ir.Operation) -> tuple[Extent, ...] | None:
    """Loop sizes of a linalg op this schedule handles (None for a size known at run time
    only), else None."""
    if op.name not in _CONTRACTIONS and op.name not in _VECTORIZABLE and op.name not in _DECOMPOSED:
        return None
    shaped = [t for t in [v.type for v in op.operands] + [r.type for r in op.results] if isinstance(t, ir.ShapedType)]
    if not all(isinstance(t, ir.RankedTensorType) for t in shaped):
        return None
    # bf16 and f16 values: a transpose only moves them; `_plain_body` checks how a generic uses them
    half = op.name in ("linalg.generic", "linalg.transpose")
    if not all(_vector_element(ir.ShapedType(t).element_type) or (half and is_half(ir.ShapedType(t).element_type))
               for t in shaped):
        return None
    if op.name in _CONTRACTIONS:
        if "indexing_maps" in op.attributes and str(op.attributes["indexing_maps"]) != _PLAIN_MAPS[op.name]:
            return None  # a transposed or broadcast variant
        a, b = (_shape(v) for v in list(op.operands)[:2])
        return (*a[:-1], b[-1], a[-1])  # (batch...,) m, n, k
    if op.name in _DENSE:
        w = _shape(op.operands[1])
        n, oh, ow, f = _shape(op.results[0])
        if None in w or f is None:
            return None
        kh, kw, c = w[1:] if op.name == _CONV else w[:3]  # FHWC or HWCF
        return (n, oh, ow, f, kh, kw, c)
    if op.name == _DEPTHWISE or op.name in _POOLS:
        kh, kw = _shape(op.operands[1])[:2]
        n, oh, ow, c = _shape(op.results[0])
        if None in (n, oh, ow, c, kh, kw):
            return None  # rewrite_convolutions makes static ones only
        return (n, oh, ow, c, kh, kw)
    if op.name != "linalg.generic":
        return tuple(_shape(op.results[0]))  # fill, transpose: the output's
    if not _plain_body(op):
        return None
    maps = [ir.AffineMapAttr(m).value for m in ir.ArrayAttr(op.attributes["indexing_maps"])]
    if not all(m.is_projected_permutation for m in maps):
        return None
    sizes = _generic_loop_sizes(op)
    n = maps[0].n_dims
    if set(sizes) != set(range(n)):
        return None
    return tuple(sizes[d] for d in range(n))


def _generic_loop_sizes(op: ir.Operation) -> dict[int, Extent]:
    """The size of each loop of a generic (whose maps are projected permutations) that indexes
    a ranked operand: None if every operand indexed by it has a dynamic size there."""
    sizes: dict[int, Extent] = {}
    for value, dims in zip(op.operands, map_dims(op), strict=True):
        shape = _shape(value) if isinstance(value.type, ir.RankedTensorType) else []
        for d, size in zip(dims, shape, strict=True):
            if sizes.get(d) is None:
                sizes[d] = size
    return sizes


def _loop_dim_sources(op: ir.Operation) -> dict[int, tuple[ir.Value, int]]:
    """For each loop of a generic, an operand and the dimension of it that the loop runs along."""
    found: dict[int, tuple[ir.Value, int]] = {}
    for value, dims in zip(op.operands, map_dims(op), strict=True):
        if isinstance(value.type, ir.RankedTensorType):
            for i, d in enumerate(dims):
                found.setdefault(d, (value, i))
    return found


def _vector_element(t: ir.Type) -> bool:
    """f32, f64 or a signless integer of a power-of-two width. Not f16/bf16 arithmetic: LLVM's
    x86 backend aborts on some of their vector ops ("soft promote"); their values are vectorized
    only as loaded and extended to f32, or truncated from it and stored (`_plain_body`,
    `_half_contraction_loops`: a bf16 Llama decoded 28x slower than eager as scalar loops); not
    unsigned integers, which only
    tosa.rescale uses; not i48 (int16 convolutions' accumulator): LLVM packs a vector of i48 in
    memory, 6 bytes an element, where a buffer of them holds one in 8 bytes."""
    return isinstance(t, ir.F32Type | ir.F64Type) or (isinstance(t, ir.IntegerType) and t.is_signless
                                                       and t.width & (t.width - 1) == 0)


def _plain_body(op: ir.Operation) -> bool:
    """A generic whose body the vectorizer maps to vector ops: arith and math ops on f32, f64 or
    signless integers, no nested regions, no gathers; bf16 and f16 values only loaded and
    extended to f32 (`arith.extf`) or truncated from it and stored (`half.widen_arithmetic` leaves
    bodies so)."""
    for block in op.regions[0].blocks:
        for inner in block.operations:
            if inner.regions or inner.name in ("tensor.extract", "linalg.index"):
                return False
            if inner.name != "linalg.yield" and not inner.name.startswith(("arith.", "math.")):
                return False
            values = list(inner.operands) + list(inner.results)
            if inner.name in ("arith.extf", "arith.truncf", "linalg.yield"):
                if not all(_vector_element(v.type) or is_half(v.type) for v in values):
                    return False
            elif not all(_vector_element(v.type) for v in values):
                return False
    return True


def _divisor(n: int, target: int) -> int:
    """The largest divisor of `n` that is at most `target`."""
    return next(d for d in range(min(n, target), 0, -1) if n % d == 0)


def _power_tile(n: int, target: int) -> int:
    """The largest power of two that is at most `n` and `target`: the tile of a loop without a
    divisor of whole registers, its remainder peeled in the powers of two below (`_Remainders`)."""
    return 1 << min(n, target).bit_length() - 1


def _lanes_divisor(n: int, target: int, lanes: int) -> int:
    """The largest divisor of `n` up to `target` that is a whole number of vector registers of f32
    (a multiple of `lanes`), else `_divisor`: 144 channels in tiles of 16, not 24 (16 + 8 lanes,
    with 16 lanes)."""
    return next((d for d in range(target - target % lanes, 0, -lanes) if n % d == 0), None) or _divisor(n, target)


def _column_divisor(n: int, target: int) -> int:
    """The column tile of a contraction or convolution: `target` (the register tile's columns) or
    the largest power of two from 8 below it that divides `n`, else `_divisor`. A tile of 24 or
    48 columns vectorized whole (MobileNetV2's 24 and 144 channels before a matmul's tile was
    vectorized in pieces, `_vectorize`) is not a whole number of AVX-512 registers of f32 in powers of two, and ran
    10-13x slower than tiles of 8 or 16 (a 1x1 convolution 96 -> 24 on 56 x 56: 2745 us, 198 us
    in tiles of 8)."""
    powers = (1 << e for e in range(target.bit_length() - 1, 2, -1))
    return next((d for d in (target, *powers) if n % d == 0), None) or _divisor(n, target)


def _tile(n: Extent, target: int) -> int:
    """The tile of a loop of size `n`: the largest divisor of a static size up to `target`;
    `target` itself for a size known at run time only (its last tile may be partial)."""
    return target if n is None else _divisor(n, target)


def _key(key: Key) -> str:
    kind, sizes, order, partial, rows, split = key
    parts = [kind, "x".join(map(str, sizes)), *(".".join(map(str, x)) for x in (order, partial, rows, split))]
    return ":".join(parts)


def _script(groups: dict[Key, list[ir.Operation]], tiles: Tiles) -> list[str]:
    """The transform script's lines (`irutil.run_transform`): tile each group's ops and vectorize the tiles.

    A group with partial tiles (`plan`) is tiled by `_Remainders`: whole tiles as static ones,
    the remainder in smaller static tiles. After canonicalization has given every tile its
    static shape, all are vectorized without masks.
    """
    lines: list[str] = []
    any_op = "!transform.any_op"
    peeled = []
    for i, key in enumerate(groups):
        kind, sizes, order, partial, _, split = key
        lines.append(f"  %ops{i} = {_match(_key(key))}")
        if partial:
            peeled.append(i)
            target = f"%ops{i}"
            if kind == _CONV:  # filter to HWCF first, as below, keeping the group's mark for the remainders
                lines += [f"  %ops{i}_hwcf = transform.structured.transpose_conv2d %ops{i} : ({any_op}) -> {any_op}",
                          f'  %mark{i} = transform.param.constant "{_key(key)}" -> !transform.any_param',
                          f'  transform.annotate %ops{i}_hwcf "{_TILE_ATTR}" = %mark{i}'
                          f" : {any_op}, !transform.any_param"]
                target = f"%ops{i}_hwcf"
            if split:  # one chunk per thread, as below, the remainders inside each chunk
                loop, chunk = split
                chunks = ", ".join(str(chunk if d == loop else 0) for d in range(len(sizes)))
                lines.append(f"  %chunk{i}, %forall{i} = transform.structured.tile_using_forall {target}"
                             f" tile_sizes [{chunks}] : ({any_op}) -> ({any_op}, {any_op})")
                target = f"%chunk{i}"
            vector_rest = tiles.lanes if any(_vector_math(op) for op in groups[key]) else None
            lines += _Remainders(key, f"g{i}_", vector_rest).dim(target, 0)
            continue
        if kind == _WINDOW:  # split across threads, each chunk plain loops
            loop, chunk = split
            chunks = ", ".join(str(chunk if d == loop else 0) for d in range(loop + 1))
            lines.append(f"  %chunk{i}, %forall{i} = transform.structured.tile_using_forall %ops{i}"
                         f" tile_sizes [{chunks}] : ({any_op}) -> ({any_op}, {any_op})")
            continue
        results = ", ".join([any_op] * (1 + len(sizes)))
        target = f"%ops{i}"
        if kind == _DOT:
            lines += _dot_lines(i, sizes, order, split)
            continue
        if kind == _CONV:  # filter to HWCF, then each tile (one output row, one filter tap) is a 1-D conv
            lines.append(f"  %ops{i}_hwcf = transform.structured.transpose_conv2d %ops{i} : ({any_op}) -> {any_op}")
            target = f"%ops{i}_hwcf"
        if split:  # one chunk per thread: an scf.forall, the register tiles inside each chunk
            loop, chunk = split
            chunks = ", ".join(str(chunk if d == loop else 0) for d in range(len(sizes)))
            lines.append(f"  %chunk{i}, %forall{i} = transform.structured.tile_using_forall {target}"
                         f" tile_sizes [{chunks}] : ({any_op}) -> ({any_op}, {any_op})")
            target = f"%chunk{i}"
        lines.append(f"  %tiled{i}, %loops{i}:{len(sizes)} = transform.structured.tile_using_for "
                     f"{target} tile_sizes [{', '.join(map(str, sizes))}]"
                     f" interchange = [{', '.join(map(str, order))}]"
                     f" : ({any_op}) -> ({results})")
        if kind in _DECOMPOSED:
            lines.append(f"  %tiled{i}_1d = transform.structured.decompose %tiled{i} : ({any_op}) -> {any_op}")
        lines += _vectorize(f"%tiled{i}{'_1d' if kind in _DECOMPOSED else ''}", groups[key][0], sizes, tiles.lanes)
    lines.append(f'  %funcs = transform.structured.match ops{{["func.func"]}} in %root : ({any_op}) -> {any_op}')
    if peeled:
        # the tiles' sizes are constants after peeling: fold them into the types. The tiles
        # vectorized already become contractions first: canonicalized as they were (a broadcast
        # and a transpose), a 6-row matmul tile no longer matched and ran as multiplies and adds
        # of shuffled vectors (an encoder layer on 33 tokens 1.6x slower than eager)
        lines += [f"  transform.foreach %funcs : {any_op} {{", f"  ^bb0(%func: {any_op}):",
                  "    transform.apply_patterns to %func {",
                  "      transform.apply_patterns.vector.reduction_to_contract",
                  "      transform.apply_patterns.canonicalization",
                  f"    }} : {any_op}",
                  "  }"]
        for i in peeled:
            key = list(groups)[i]
            lines.append(f"  %again{i} = {_match(_key(key))}")
            if key[0] in _DECOMPOSED:
                lines.append(f"  %again{i}_1d = transform.structured.decompose %again{i} : ({any_op}) -> {any_op}")
            lines += _vectorize(f"%again{i}{'_1d' if key[0] in _DECOMPOSED else ''}", groups[key][0], key[1],
                                tiles.lanes)
    lines += [f"  transform.foreach %funcs : {any_op} {{", f"  ^bb0(%func: {any_op}):", _CLEANUP, "  }"]
    return lines


def _vectorize(target: str, op: ir.Operation, sizes: tuple[int, ...], lanes: int) -> list[str]:
    """Transform-script lines vectorizing the tiles `target` of ops like `op`, tiled by `sizes`.

    A contraction's register tile of a number of vectors of columns other than a power of two
    (8 x 48: 3 vectors of 16 lanes) is vectorized one vector of columns at a time (8 x 16), the
    loop over them unrolled: vectorized whole, LLVM legalizes its loop-carried vector<8x48xf32>
    element by element (2 GF/s). `rows_first` then orders each step of k as MKL's kernel does.
    """
    any_op = "!transform.any_op"
    mn = _matmul_loops(op) if op.name not in _DECOMPOSED else None
    vectors = sizes[mn[1]] // lanes if mn is not None and sizes[mn[1]] % lanes == 0 else 1
    if vectors & (vectors - 1) == 0:
        return [f"  transform.structured.vectorize {target} : {any_op}"]
    pieces = ", ".join(str(lanes if d == mn[1] else 0) for d in range(len(sizes)))
    piece, columns = f"{target}_piece", f"{target}_columns"
    return [f"  {piece}, {columns} = transform.structured.tile_using_for {target} tile_sizes [{pieces}]"
            f" : ({any_op}) -> ({any_op}, {any_op})",
            f"  transform.structured.vectorize {piece} : {any_op}",
            f"  transform.loop.unroll {columns} {{factor = {vectors}}} : {any_op}"]


def rows_first(module: ir.Module) -> None:
    """Order the body of each reduction loop of a register tile vectorized in pieces (`_vectorize`)
    row by row: every op of it as early as its operands allow, just after the last of them. The
    pieces' code is one piece after another (all rows' FMAs of the first vector of columns, then
    of the second...), which keeps every row's broadcast live until the last piece: 8 broadcasts,
    24 accumulators and a vector of columns, one register more than AVX-512 has (a spill and a
    reload per step of k, 1024^3 at 74 GF/s against 123 for the 8 x 32 tile). Earliest first,
    the loads of columns lead and each row's broadcast is followed by its FMAs, MKL's order,
    which LLVM keeps.

    Each op is placed just after its last operand's op, before the ops placed there earlier: a
    rank extending that op's (`(anchor's rank, -count)`, compared as tuples) gives the order at
    once, without scanning the block for positions (which took 0.27 s of an encoder layer)."""
    for loop in find_ops(module, _carries_pieces):
        body = loop.regions[0].blocks[0]
        *ops, end = list(body.operations)
        rank: dict[ir.Operation, tuple[int, ...]] = {}
        for count, op in enumerate(ops):
            inside = [rank[a.operation] for a in map(producer, op.operands) if a is not None and a.operation in rank]
            rank[op.operation] = (*max(inside), -count) if inside else (-count,)
        for op in sorted(ops, key=lambda op: rank[op.operation]):
            op.move_before(end)


def _carries_pieces(op: ir.Operation) -> bool:
    """Whether `op` is a loop carrying the accumulators of a register tile vectorized in pieces
    (more than one vector, FMAs), whose body is ops without side effects (on tensors, before
    bufferization) and the yield."""
    if op.name != "scf.for" or sum(isinstance(r.type, ir.VectorType) for r in op.results) < 2:
        return False
    names = [inner.name for inner in op.regions[0].blocks[0].operations]
    return "vector.fma" in names and all(n.split(".")[0] in _PURE_DIALECTS for n in names[:-1])


_PURE_DIALECTS = ("vector", "arith", "affine", "tensor")  # on tensors: no side effects


def fold_piece_writes(module: ir.Module) -> None:
    """Write each vector that a transfer_write puts into a slice only to insert it straight into the
    tensor instead, as a register tile vectorized in pieces (`_vectorize`) does:
    `insert_slice(transfer_write(v, slice), tile)` is `transfer_write(v, tile)` where the write
    covers its slice (`_covering_write`). MLIR's fold of the pair (fold_tensor_subset_ops_
    into_vector_transfers) wants the vector's shape to be the slice's, and a piece of a tile of
    one row writes a vector<16xf32> into a 1 x 16 slice; left as a pair, bufferization gave
    every piece a buffer of its own and copied it into the tile."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name == "tensor.insert_slice"):
            write = _covering_write(op)
            if write is None:
                continue
            value, dest = write.operands[0], op.operands[1]
            rank, vector_rank = _rank(dest), ir.VectorType(value.type).rank
            with ir.InsertionPoint(op):
                offsets = ir.DenseI64ArrayAttr(op.attributes["static_offsets"])
                at = [arith.constant(ir.IndexType.get(), o) for o in offsets]
                new = vector.TransferWriteOp(dest.type, value, dest, at,
                                             ir.AffineMapAttr.get(ir.AffineMap.get_minor_identity(rank, vector_rank)),
                                             ir.ArrayAttr.get([ir.BoolAttr.get(True)] * vector_rank))
            op.results[0].replace_all_uses_with(new.result)
            op.erase()
            write.erase()


def _covering_write(insert: ir.Operation) -> ir.Operation | None:
    """The vector.transfer_write whose result `insert` (a tensor.insert_slice of static offsets,
    unit strides, of the destination's rank) alone inserts, where it writes its whole tensor: in
    bounds, at zeros, its vector that tensor's shape without leading units (vector<16xf32> in
    tensor<1x16xf32>)."""
    write = producer(insert.operands[0])
    if write is None or write.name != "vector.transfer_write" or len(list(write.results[0].uses)) != 1:
        return None
    shape, rank = _shape(insert.operands[0]), _rank(insert.operands[0])
    vector_shape = ir.VectorType(write.operands[0].type).shape
    leading = rank - len(vector_shape)
    minor = ir.AffineMapAttr.get(ir.AffineMap.get_minor_identity(rank, len(vector_shape)))
    static = len(list(insert.operands)) == 2 and set(ir.DenseI64ArrayAttr(insert.attributes["static_strides"])) == {1}
    if (not static or rank != _rank(insert.operands[1]) or leading < 0 or shape[leading:] != vector_shape
            or any(d != 1 for d in shape[:leading]) or len(list(write.operands)) != 2 + rank
            or any(constant_int(i) != 0 for i in list(write.operands)[2:])
            or str(write.attributes["permutation_map"]) != str(minor)
            or not all(ir.BoolAttr(b).value for b in ir.ArrayAttr(write.attributes["in_bounds"]))):
        return None
    return write


def _rank(value: ir.Value) -> int:
    return ir.ShapedType(value.type).rank


def _lowering(tiles: Tiles) -> list[str]:
    """The second script: hoist the accumulators of the loops `_mark_hoistable` marked into
    registers, then lower contractions, reductions and transposes for `tiles`."""
    any_op = "!transform.any_op"
    transpose = _TRANSPOSE_LOWERING.get(tiles.transpose, 'lowering_strategy = "eltwise"')
    lowering = _LOWERING.replace("$TRANSPOSE", transpose).replace("$HOIST", _HOIST_ATTR)
    return [f'  %funcs = transform.structured.match ops{{["func.func"]}} in %root : ({any_op}) -> {any_op}',
            f"  transform.foreach %funcs : {any_op} {{", f"  ^bb0(%func: {any_op}):", lowering, "  }"]


def _mark_hoistable(module: ir.Module) -> None:
    """Mark (`_HOIST_ATTR`) the scf.for loops that `hoist_loop_invariant_subsets` may change: those
    with an `_invariant_subset`. Tile loops over output dims are left alone: their subsets move
    with the loop, and asking MLIR's value-bounds analysis about each of the hundreds of them
    took a tiny Llama's prefill 0.7 s of its 1.0 s schedule, for no change."""
    with module.context:
        for loop in find_ops(module, lambda op: op.name == "scf.for"):
            if _invariant_subset(loop.operation) is not None:
                loop.attributes[_HOIST_ATTR] = ir.UnitAttr.get()


def _invariant_subset(loop: ir.Operation) -> list[ir.Value] | None:
    """The index operands of a subset of a loop-carried tensor that `loop`'s body reads where
    they do not depend on the loop (a reduction loop's accumulator tile: `vector.transfer_read`
    or `tensor.extract_slice`), or that an inner loop the tensor is carried into reads so (an
    outer reduction loop: the inner loop's hoisting brings that read into this body); None if
    there is none."""
    for arg in list(loop.regions[0].blocks[0].arguments)[1:]:
        for use in arg.uses:
            user = use.owner.operation
            if user.parent is None or user.parent.operation != loop:
                continue
            if user.name in ("vector.transfer_read", "tensor.extract_slice") and use.operand_number == 0:
                indices = list(user.operands)[1:]
            elif user.name == "scf.for" and use.operand_number >= 3:  # an init, not a bound
                indices = _invariant_subset(user)
            else:
                continue
            if indices is not None and not any(defined_in(v, loop) for v in indices):
                return indices
    return None


def _dot_lines(i: int, sizes: tuple[int, ...], order: tuple[int, ...], split: tuple[int, ...]) -> list[str]:
    """Transform-script lines for group `i` of vector-matrix products in dot form: tiled over
    its output in `order` (by thread chunks first if `split`), then its k loop split into vector
    chunks whose partial sums stay in registers (`tile_reduction_using_for`), all three parts
    vectorized."""
    any_op = "!transform.any_op"
    lines, target = [], f"%ops{i}"
    if split:
        loop, chunk = split
        chunks = ", ".join(str(chunk if d == loop else 0) for d in range(len(sizes)))
        lines.append(f"  %chunk{i}, %forall{i} = transform.structured.tile_using_forall {target}"
                     f" tile_sizes [{chunks}] : ({any_op}) -> ({any_op}, {any_op})")
        target = f"%chunk{i}"
    outer = [*sizes[:-1], 0]
    if any(outer):
        results = ", ".join([any_op] * (1 + sum(1 for s in outer if s)))
        lines.append(f"  %tiled{i}, %loops{i}:{sum(1 for s in outer if s)} = transform.structured.tile_using_for "
                     f"{target} tile_sizes [{', '.join(map(str, outer))}] interchange = [{', '.join(map(str, order))}]"
                     f" : ({any_op}) -> ({results})")
        target = f"%tiled{i}"
    inner = ", ".join(str(sizes[-1] if d == len(sizes) - 1 else 0) for d in range(len(sizes)))
    lines.append(f"  %fill{i}, %part{i}, %sum{i}, %kloop{i} = transform.structured.tile_reduction_using_for "
                 f"{target} by tile_sizes = [{inner}] : ({any_op}) -> ({any_op}, {any_op}, {any_op}, {any_op})")
    lines += [f"  transform.structured.vectorize %{part}{i} : {any_op}" for part in ("fill", "part", "sum")]
    return lines


class _Remainders:
    """Transform-script lines tiling a group's ops whose `partial` loops (a dynamic size) may end
    in a partial tile, so that every tile has a static shape.

    The partial loops are taken outermost first. Each is tiled (with the loops before it; the
    loops inside it wait) and peeled into whole tiles and a remainder, which is tiled by the next
    smaller size of `_levels` and peeled again, down to 1: a remainder of 7 matmul rows is one
    tile of 4, one of 2 and one of 1, each a static register tile. Inside each of these, the next
    partial loop is tiled the same way; the loops after the last one last (a matmul's reduction
    loop stays inside its row loop, so the accumulators stay in registers). Each level first
    takes the whole remainder as one tile (so that its size is an affine.min peeling simplifies);
    that loop runs exactly once and is marked for `inline_single_iterations`.
    """

    def __init__(self, key: Key, prefix: str, lanes: int | None = None) -> None:
        _, self.sizes, self.order, partial, self.rows, _ = key
        self.lanes = lanes  # the innermost loop's remainder goes by vectors of these lanes first
        self.partial = sorted(partial, key=self.order.index)
        self.match = _key(key)
        self.prefix = prefix
        self.count = 0

    def _name(self, what: str) -> str:
        self.count += 1
        return f"%{self.prefix}{what}{self.count}"

    def _tile(self, op: str, tiles: dict[int, int]) -> tuple[str, list[str], list[str]]:
        """Tile `op` by `tiles` (loop -> size): the tiled op, the loops (in loop order), the lines."""
        any_op = "!transform.any_op"
        tiled = self._name("tiled")
        loops = [self._name("loop") for d in self.order if d in tiles]
        sizes = ", ".join(str(tiles.get(d, 0)) for d in range(len(self.sizes)))
        types = ", ".join([any_op] * (1 + len(loops)))
        line = (f"    {', '.join([tiled, *loops])} = transform.structured.tile_using_for {op} tile_sizes [{sizes}]"
                f" interchange = [{', '.join(map(str, self.order))}] : ({any_op}) -> ({types})")
        return tiled, loops, [line]

    def _peel(self, loop: str) -> tuple[str, str, list[str]]:
        any_op = "!transform.any_op"
        cast, main, rest = self._name("for"), self._name("main"), self._name("rest")
        return main, rest, [f"    {cast} = transform.cast {loop} : {any_op} to {_FOR}",
                            f"    {main}, {rest} = transform.loop.peel {cast} : ({_FOR}) -> ({any_op}, {any_op})"]

    def _inside(self, parts: str, k: int, level: int | None = None) -> list[str]:
        """For each of the loops `parts`: its op, tiled from partial loop `k` on (or, given
        `level`, the remainder of loop k's tiles of `_levels(k)[level - 1]`)."""
        any_op = "!transform.any_op"
        part, op = self._name("part"), self._name("op")
        lines = [f"  transform.foreach {parts} : {any_op} {{", f"  ^bb0({part}: {any_op}):",
                 f'    {op} = transform.structured.match attributes{{{_TILE_ATTR} = "{self.match}"}}'
                 f" in {part} : ({any_op}) -> {any_op}"]
        lines += self.dim(op, k) if level is None else self.remainder(op, k, level)
        return [*lines, "  }"]

    def _start(self, k: int) -> int:
        return self.order.index(self.partial[k - 1]) + 1 if k else 0

    def _levels(self, k: int) -> list[int]:
        d = self.partial[k]
        levels = [self.sizes[d]]
        # a matmul's rows by the powers of two below the tile (at most one tile of each: 6 -> 4,
        # 2, 1; by halves, a remainder of 4 rows was a tile of 3 and one of 1, and a Winograd
        # convolution ran 3% slower); other loops' remainders one at a time: each level is another
        # copy of the tile's code, nested in the last (by quarters, a dynamic BERT's compile took
        # 33 s instead of 19, and ran no faster), but the innermost loop of ops calling vector math
        # by one vector register first (`lanes`: a softmax over a run-time count of keys called the
        # scalar expf for 36 of 100 keys; a level for every op cost a tiny Llama's first generate
        # 5% more compile time)
        while levels[-1] > 1:
            if d in self.rows:
                levels.append(1 << (levels[-1] - 1).bit_length() - 1)
            elif self.lanes and d == len(self.sizes) - 1 and levels[-1] > self.lanes:
                levels.append(self.lanes)
            else:
                levels.append(1)
        return levels

    def dim(self, op: str, k: int) -> list[str]:
        """Lines tiling `op` from partial loop `k` on (untiled from loop `_start(k)` on)."""
        if k == len(self.partial):  # the loops after the last partial one
            rest = {d: self.sizes[d] for d in self.order[self._start(k):]}
            return self._tile(op, rest)[2] if rest else []
        d = self.partial[k]
        tiles = {e: self.sizes[e] for e in self.order[self._start(k):self.order.index(d) + 1]}
        _, loops, lines = self._tile(op, tiles)
        main, rest, peel = self._peel(loops[-1])
        return lines + peel + self._inside(main, k + 1) + self._inside(rest, k, 1)

    def remainder(self, op: str, k: int, level: int) -> list[str]:
        """Lines tiling `op`, the remainder of partial loop `k`'s tiles of `_levels(k)[level - 1]`,
        by the next level: tiles of that size peeled, their remainder by the next, and so on."""
        d = self.partial[k]
        levels = self._levels(k)
        # one tile of the whole remainder first: its size is then an affine.min, which peeling
        # simplifies in the whole tiles (it does not see through the remainder's own size)
        whole, (once,), lines = self._tile(op, {d: levels[level - 1]})
        tiled, loops, more = self._tile(whole, {d: levels[level]})
        lines += [_once(once), *more]
        if levels[level] == 1:
            return lines + self.dim(tiled, k + 1)
        main, rest, peel = self._peel(loops[0])
        return lines + peel + self._inside(main, k + 1) + self._inside(rest, k, level + 1)


def _vector_math(op: ir.Operation) -> bool:
    """Whether `op`'s body calls a function of the vector math library (exp, tanh, erf, ...)."""
    return any(inner.name in vecmath.FUNCTIONS for region in op.regions for block in region.blocks
               for inner in block.operations)


def _once(loop: str) -> str:
    return f'    transform.annotate {loop} "{_ONCE_ATTR}" : !transform.any_op'


def _match(key: str) -> str:
    return (f'transform.structured.match attributes{{{_TILE_ATTR} = "{key}"}} in %root'
            " : (!transform.any_op) -> !transform.any_op")


def _reassociate_reductions(module: ir.Module) -> None:
    """Let LLVM sum each vector.reduction as a tree rather than element by element.

    The vectorized reductions already add in another order than a sequential loop (as PyTorch's
    own kernels do); without `reassoc` a float reduction of a vector is one long dependent chain.
    """
    with module.context:
        reassoc = ir.Attribute.parse("#arith.fastmath<reassoc>")

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "vector.reduction":
            op.attributes["fastmath"] = reassoc
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)


_TREE_KINDS = {"maximumf": arith.MaximumFOp, "minimumf": arith.MinimumFOp}


def tree_reductions(module: ir.Module) -> None:
    """Reduce each vector's maximum (minimum) across lanes as a tree of vector maxima of its
    halves. LLVM expands `llvm.vector.reduce.fmaximum` (x86 has no IEEE maximum: NaNs and signed
    zeros are checked) one lane after another, a chain of about ten scalar instructions per lane
    (amax over rows of 64: a fifth of its time). The tree's result is the same: the maximum is
    associative and commutative with NaN propagated and -0 below +0."""
    found = find_ops(module, lambda op: op.name == "vector.reduction" and _tree_kind(op) is not None)
    with module.context, ir.Location.unknown():
        for op in found:
            combine = _TREE_KINDS[_tree_kind(op)]
            value, n = op.operands[0], ir.VectorType(op.operands[0].type).shape[0]
            element = ir.VectorType(value.type).element_type
            with ir.InsertionPoint(op), op.location:
                while n > 1:
                    n //= 2
                    half = ir.VectorType.get([n], element)
                    value = combine(vector.ExtractStridedSliceOp(half, value, [0], [n], [1]).result,
                                    vector.ExtractStridedSliceOp(half, value, [n], [n], [1]).result).result
                result = vector.ExtractOp(value, [], [0]).result
                if len(op.operands) > 1:  # the accumulator
                    result = combine(result, op.operands[1]).result
            op.results[0].replace_all_uses_with(result)
            op.erase()


def _tree_kind(op: ir.Operation) -> str | None:
    """The kind of vector.reduction `op` if `tree_reductions` rewrites it: a maximum or minimum of
    a 1-D vector of floats of a power of two lanes, four or more."""
    kind = str(op.attributes["kind"]).removeprefix("#vector.kind<").removesuffix(">")
    t = op.operands[0].type
    if kind not in _TREE_KINDS or not isinstance(t, ir.VectorType) or ir.VectorType(t).rank != 1:
        return None
    n = ir.VectorType(t).shape[0]
    return kind if n >= 4 and n & (n - 1) == 0 and isinstance(ir.VectorType(t).element_type, ir.FloatType) else None


def inline_single_iterations(module: ir.Module) -> None:
    """Replace each loop `_Remainders` marked as running exactly once by its body.

    A dynamic size's remainder is tiled by halves, each level inside the last, and one-shot
    bufferization's buffer types of loop-carried tensors took time exponential in the depth of
    such nests (4.6 s of a tiny Llama decoding graph's 12 s of lowering); each level's loop
    over the whole remainder, one tile of it, need not be a loop."""
    for loop in find_ops(module, lambda op: op.name == "scf.for" and _ONCE_ATTR in op.attributes):
        for_op = loop.operation.opview
        for_op.induction_variable.replace_all_uses_with(for_op.lowerBound)
        for arg, init in zip(for_op.inner_iter_args, for_op.initArgs, strict=True):
            arg.replace_all_uses_with(init)
        body = list(for_op.body.operations)
        for op in body[:-1]:
            op.move_before(loop.operation)
        for result, value in zip(loop.results, body[-1].operands, strict=True):
            result.replace_all_uses_with(value)
        loop.operation.erase()


def _drop_attrs(module: ir.Module, names: tuple[str, ...]) -> None:
    def visit(op: ir.Operation) -> ir.WalkResult:
        for name in names:
            if name in op.attributes:
                del op.attributes[name]
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
