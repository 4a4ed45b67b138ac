"""Attention by blocks of query rows: a block's scores computed, normalized and used while in the L2.

Lowered op by op, attention is three passes over a [heads, queries, keys] tensor: the scores
q @ kᵀ, the softmax's row-wise chain (`rows.fuse_rows`), and the probabilities @ v. With 16
heads of 577 tokens that tensor is 21 MB: q @ kᵀ's register tiles (k is a head's 64 dims) spent a
third of their time storing it, and the chain and the second product read it back from memory.
PyTorch's CPU flash kernel walks blocks of query rows instead. `block_attention(module, tiles)`
does the same for each contraction whose first factor is the end of a row-wise chain (a
normalization) over the rows of a contraction's output that nothing else reads: it tiles the
second product by blocks of query rows (per batch element) and fuses the chain and the first
product into that loop (the transform dialect's tile_using_for and fuse_into_containing_op, as
`rows.fuse_rows` does), so that a block's scores and probabilities stay in the L2; a last block
of fewer rows is peeled off (`loop.peel`: 577 tokens have no divisor). The schedule then tiles
the ops of a block as any others (the chain row by row inside it).

A block's rows fill `Tiles.row_block_bytes` (a quarter of the L2) with scores, in whole register
tiles; attention whose scores fit in the L2 anyway (a ViT-B's 12 heads of 197 tokens) is left
as it is. A mask (a boolean one, causal) is read block by block by the chain's select; what
computes it (a causal mask from two aranges) stays whole (`rows._row_producers`).
"""

from __future__ import annotations

import math

from mlir import ir

from .contractions import sum_of_products
from .irutil import find_ops, map_dims, producer
from .irutil import tensor_shape as _shape
from .rows import _chain_end, _own_init, _reduces_rows, _row_producers, fuse_into, match, run_fusion
from .tiles import Tiles

_ATTR = "torchtosa.attention"  # marks a second product ("<i>") and what is fused into its blocks ("<i>.<j>")
_F32_BYTES = 4


def block_attention(module: ir.Module, tiles: Tiles) -> None:
    """Tile each attention of `module` by blocks of query rows (see the module docstring)."""
    found = []
    for product in find_ops(module, lambda op: op.name == "linalg.generic" and sum_of_products(op) is not None):
        fused = _fused(product)
        rows = _block_rows(product, tiles) if fused is not None else None
        if rows is not None:
            found.append((product, fused, rows))
    if not found:
        return
    position = {op.operation: i for i, op in enumerate(find_ops(module, lambda op: True))}
    lines: list[str] = []
    with module.context, ir.Location.unknown():
        for i, (product, fused, rows) in enumerate(found):
            product.attributes[_ATTR] = ir.StringAttr.get(str(i))
            batch = len(_shape(product.results[0])) - 2
            sizes = ", ".join(["1"] * batch + [str(rows), "0", "0"])
            lines += [f"  %c{i} = {match(_ATTR, str(i))}",
                      f"  %t{i}, %l{i}:{batch + 1} = transform.structured.tile_using_for %c{i} tile_sizes [{sizes}]"
                      " : (!transform.any_op) -> (!transform.any_op" + ", !transform.any_op" * (batch + 1) + ")"]
            loop = f"%l{i}#{batch}"
            fusion, loop = fuse_into(loop, fused, str(i), _ATTR, position, _own_generic_init)
            lines += fusion
            if _shape(product.results[0])[-2] % rows:
                lines += [f'  %for{i} = transform.cast {loop} : !transform.any_op to !transform.op<"scf.for">',
                          f"  %whole{i}, %rest{i} = transform.loop.peel %for{i}"
                          ' : (!transform.op<"scf.for">) -> (!transform.any_op, !transform.any_op)']
    run_fusion(module, lines, _ATTR)


def _own_generic_init(op: ir.Operation) -> None:
    """`rows._own_init` of a generic (a fill keeps its output)."""
    if op.name == "linalg.generic":
        _own_init(op)


def _fused(product: ir.Operation) -> list[ir.Operation] | None:
    """What goes into `product`'s blocks of rows: the row-wise chain its first factor ends (read
    by nothing else), the contraction that computes the chain's rows (read by the chain only) and
    that contraction's fill; None where `product` is no such second product of attention: loops
    (batch..., rows, columns, k), output (batch..., rows, columns), the first factor (batch...,
    rows, k), at least one batch loop (the heads)."""
    maps = map_dims(product)
    loops = len(ir.ArrayAttr(product.attributes["iterator_types"]))
    if loops < 4 or maps[-1] != list(range(loops - 1)) or maps[0] != [*range(loops - 2), loops - 1]:
        return None
    end = producer(product.operands[0])
    if end is None or not _chain_end(end) or len(_shape(end.results[0])) != loops - 1:
        return None
    if any(use.owner.operation != product.operation for use in end.results[0].uses):
        return None
    chain = _row_producers(end)
    if not any(op.name == "linalg.generic" and _reduces_rows(op) for op in chain):
        return None  # no normalization: nothing to keep in cache between the passes
    members = {end.operation, *(op.operation for op in chain)}
    scores = [p for op in members for v in op.operands if (p := producer(v)) is not None
              and p.name == "linalg.generic" and sum_of_products(p) is not None
              and map_dims(p)[-1] == list(range(loops - 1))
              and all(u.owner.operation in members for u in p.results[0].uses)]
    if len(set(scores)) != 1:
        return None
    first = scores[0]
    fill = producer(first.operands[len(first.operands) - 1])
    fills = [fill] if fill is not None and fill.name == "linalg.fill" else []
    return [end.operation, *members - {end.operation}, first, *fills]


def _block_rows(product: ir.Operation, tiles: Tiles) -> int | None:
    """Query rows per block: as many whole register tiles of rows as fill `Tiles.row_block_bytes`
    with a block's scores (at least one tile); None for a run-time size, or scores that fit in
    the L2 whole."""
    *batch, queries, _ = _shape(product.results[0])
    keys = _shape(product.operands[0])[-1]
    if None in (*batch, queries, keys) or math.prod(batch) * queries * keys * _F32_BYTES <= tiles.streamed_matrix_bytes:
        return None
    tile = tiles.matmul[0]
    rows = max(tile, tiles.row_block_bytes // (keys * _F32_BYTES) // tile * tile)
    return rows if rows < queries else None
