"""Split a long function into private functions of bounded size, called in sequence.

Several MLIR passes and LLVM's code generation take time that grows faster than the size of
the one function they work on, so a deep model (BERT of 8 layers) compiled as one function
took more than linear time in its depth. `partition(module)` cuts each function of more than
1.5 x PART_OPS top-level ops into consecutive parts of PART_OPS to 1.5 x PART_OPS ops, each
cut where the fewest values cross it (between a transformer's layers, only the residual
stream), and makes each part a private function `@<name>__part<i>` that the function calls.
Constants are cloned into every part that uses them, so they stay visible to folding and
shape verification. Values crossing a cut become arguments and results.
"""

from __future__ import annotations

import itertools

from mlir import ir
from mlir.dialects import func

from .irutil import is_sub_byte, top_level

PART_OPS = 200  # top-level ops per part
_CONSTANTS = ("tosa.const", "tosa.const_shape", "arith.constant")


def partition(module: ir.Module, part_ops: int | None = None) -> None:
    """Split every function of `module` longer than 1.5 x `part_ops` (default PART_OPS)."""
    size = part_ops or PART_OPS
    for op in list(module.body.operations):
        if op.operation.name == "func.func" and len(op.regions[0].blocks) == 1:
            body = list(op.regions[0].blocks[0].operations)[:-1]  # without the return
            if len(body) > size * 3 // 2:
                with module.context, ir.Location.unknown():
                    _split(op.operation, body, size)


def _split(function: ir.Operation, body: list[ir.Operation], size: int) -> None:
    name = ir.StringAttr(function.attributes["sym_name"]).value
    body = [op.operation for op in body]
    position = {op: i for i, op in enumerate(body)}
    cuts = _cuts(body, position, function, size)
    if not cuts:
        return
    for part, (start, end) in enumerate(zip([0, *cuts], [*cuts, len(body)], strict=True)):
        _outline(function, body[start:end], f"{name}__part{part}")


def _cuts(body: list[ir.Operation], position: dict[ir.Operation, int], function: ir.Operation,
          size: int) -> list[int]:
    """Positions to cut `body` before: each part has `size` to 1.5 x `size` ops, cut where the
    fewest values are live across. Never where a boolean crosses: as an argument or result it
    would be an i1 buffer, which the LLVM lowering cannot store. Nor where a value of dynamic
    shape crosses: bufferization can't make a caller-allocated result of it."""
    # crossing[c]: values defined before c and used at or after c; booleans[c]: of them, booleans
    crossing, booleans = [0] * (len(body) + 2), [0] * (len(body) + 2)  # as differences first
    for i, op in enumerate(body):
        if op.name in _CONSTANTS:
            continue
        for result in op.results:
            last = max((position.get(top_level(use.owner, function), len(body)) for use in result.uses), default=i)
            t = result.type
            element = ir.ShapedType(t).element_type if isinstance(t, ir.ShapedType) else t
            dynamic = isinstance(t, ir.ShapedType) and not ir.ShapedType(t).has_static_shape
            counts = (crossing, booleans) if is_sub_byte(element) or dynamic else (crossing,)
            for count in counts:
                count[i + 1] += 1
                count[last + 1] -= 1
    crossing, booleans = list(itertools.accumulate(crossing)), list(itertools.accumulate(booleans))
    cuts, start = [], 0
    while len(body) - start > size * 3 // 2:
        allowed = [c for c in range(start + size, len(body) - size // 2) if not booleans[c]]
        if not allowed:
            break
        window = [c for c in allowed if c <= start + size * 3 // 2] or allowed[:1]
        start = min(window, key=lambda c: (crossing[c], c))
        cuts.append(start)
    return cuts


def _outline(function: ir.Operation, ops: list[ir.Operation], name: str) -> None:
    """Move the consecutive top-level `ops` of `function` into a new private function @name,
    called in their place. Constants stay (cloned into @name where used)."""
    ops = [op for op in ops if op.name not in _CONSTANTS]
    inside = set(ops)
    inputs: list[ir.Value] = []
    constants: list[ir.Operation] = []
    for op in ops:
        for value in _free_operands(op):
            owner = value.owner if isinstance(value, ir.OpResult) else None
            if owner is not None and owner.name in _CONSTANTS:
                if owner.operation not in constants:
                    constants.append(owner.operation)
            elif (owner is None or owner.operation not in inside) and value not in inputs:
                inputs.append(value)
    outputs = [r for op in ops for r in op.results
               if any(top_level(use.owner, function) not in inside for use in r.uses)]
    if not outputs:
        return  # nothing of it is used (folding removes it later)
    callee = func.FuncOp(name, ([v.type for v in inputs], [v.type for v in outputs]), visibility="private",
                         ip=ir.InsertionPoint(function))
    entry = callee.add_entry_block()
    with ir.InsertionPoint(ops[0]):
        call = func.CallOp([v.type for v in outputs], ir.FlatSymbolRefAttr.get(name), inputs)
    for value, result in zip(outputs, call.results, strict=True):
        for use in list(value.uses):
            if top_level(use.owner, function) not in inside:
                use.owner.operands[use.operand_number] = result
    with ir.InsertionPoint(entry):
        clones = {c: c.clone() for c in constants}
        for op in ops:
            op.detach_from_parent()
            ir.InsertionPoint(entry).insert(op)
        func.ReturnOp(outputs)
    replacements = [*zip(inputs, entry.arguments, strict=True),
                    *((const.results[0], clone.results[0]) for const, clone in clones.items())]
    for old, new in replacements:
        for use in list(old.uses):
            if _within(use.owner.operation, callee.operation):
                use.owner.operands[use.operand_number] = new
    for const in constants:
        if not list(const.results[0].uses):
            const.erase()


def _free_operands(op: ir.Operation) -> list[ir.Value]:
    """Operands of `op` and of the ops nested in it that are defined outside `op`."""
    found: list[ir.Value] = []

    def visit(inner: ir.Operation) -> ir.WalkResult:
        for value in inner.operands:
            if not _within(_defining_op(value), op):
                found.append(value)
        return ir.WalkResult.ADVANCE

    op.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _defining_op(value: ir.Value) -> ir.Operation | None:
    if isinstance(value, ir.OpResult):
        return value.owner.operation
    return ir.BlockArgument(value).owner.owner.operation


def _within(op: ir.Operation | None, ancestor: ir.Operation) -> bool:
    while op is not None:
        if op == ancestor:
            return True
        op = op.parent.operation if op.parent is not None else None
    return False
