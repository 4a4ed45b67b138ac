"""Small queries on MLIR IR that several lowering steps share."""

from __future__ import annotations

from mlir import ir


def top_level(op: ir.Operation, function: ir.Operation) -> ir.Operation:
    """The ancestor of `op` (or `op` itself) directly in `function`'s body."""
    op = op.operation
    while op.parent is not None and op.parent.operation != function:
        op = op.parent.operation
    return op


def is_sub_byte(t: ir.Type) -> bool:
    """An integer element type narrower than a byte (i1): never stored in memory."""
    return isinstance(t, ir.IntegerType) and t.width < 8
