"""Small queries on MLIR IR that several lowering steps share."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator

from mlir import ir
from mlir.dialects import arith, tensor
from mlir.passmanager import PassManager

# The dialects torchtosa builds ops of from Python (importer, schedule, rewrites): loaded when a
# context is made. The parser and the passes load what else they need (the transform dialect,
# 12 ms of the 20 it takes to load all ~60 registered ones, only when a schedule is parsed).
DIALECTS = ("builtin", "func", "tosa", "arith", "tensor", "math", "linalg", "scf", "memref", "vector",
            "bufferization", "affine", "llvm", "cf", "ub", "complex")


def context() -> ir.Context:
    """A new MLIR context with `DIALECTS` loaded."""
    return ir.Context(load_on_create_dialects=list(DIALECTS))


def find_ops(root: ir.Module | ir.Operation, predicate: Callable[[ir.Operation], bool]) -> list[ir.Operation]:
    """The ops nested in `root` (pre-order) for which `predicate` holds: collected first, so
    the caller may rewrite them."""
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if predicate(op):
            found.append(op)
        return ir.WalkResult.ADVANCE

    root.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def function_bodies(module: ir.Module) -> Iterator[ir.Block]:
    """The body of each func.func of `module` that has one (declarations have none)."""
    for func in module.body.operations:
        if func.operation.name == "func.func" and func.regions[0].blocks:
            yield func.regions[0].blocks[0]


def top_level(op: ir.Operation, function: ir.Operation) -> ir.Operation:
    """The ancestor of `op` (or `op` itself) directly in `function`'s body."""
    op = op.operation
    while op.parent is not None and op.parent.operation != function:
        op = op.parent.operation
    return op


def defined_in(value: ir.Value, op: ir.Operation) -> bool:
    """Whether `value` is defined inside `op`'s regions: an argument of one of their blocks (a
    loop's induction variable or iter arg), or a result of an op nested in them."""
    op = op.operation
    parent = value.owner.owner if isinstance(value, ir.BlockArgument) else value.owner.operation.parent
    while parent is not None and parent.operation != op:
        parent = parent.parent
    return parent is not None


def constant_int(value: ir.Value) -> int | None:
    """The integer (or index) of an arith.constant `value`, else None."""
    op = value.owner if isinstance(value, ir.OpResult) else None
    if op is None or op.name != "arith.constant" or not isinstance(op.attributes["value"], ir.IntegerAttr):
        return None
    return ir.IntegerAttr(op.attributes["value"]).value


def positive_zero(value: ir.Value) -> bool:
    """A constant +0.0 (a fill of -0.0 would make a sum of -0.0 products -0.0)."""
    op = value.owner if isinstance(value, ir.OpResult) else None
    if op is None or op.name != "arith.constant" or not isinstance(op.attributes["value"], ir.FloatAttr):
        return False
    x = ir.FloatAttr(op.attributes["value"]).value
    return x == 0.0 and math.copysign(1.0, x) > 0


def is_sub_byte(t: ir.Type) -> bool:
    """An integer element type narrower than a byte (i1): never stored in memory."""
    return isinstance(t, ir.IntegerType) and t.width < 8


def run_passes(module: ir.Module, pipeline: str) -> None:
    """Run a textual pass pipeline on `module` without verifying the IR after every pass.

    MLIR's pass manager verifies the whole module after each pass by default, which cost a
    third of the lowering time of a BERT model; `pipeline.lower` verifies once per stage
    instead, so invalid IR still stops at the stage that made it. Raises ir.MLIRError.
    """
    pm = PassManager.parse(pipeline, context=module.context)
    pm.enable_verifier(False)
    pm.run(module.operation)


def run_transform(module: ir.Module, body: list[str]) -> None:
    """Run a transform-dialect script on `module` with MLIR's interpreter: `body` is the lines of
    its entry sequence, whose argument `%root` is the module; the script is removed afterwards,
    whatever happens. Raises ir.MLIRError."""
    script = ir.Module.parse("\n".join([
        "module attributes {transform.with_named_sequence} {",
        "transform.named_sequence @__transform_main(%root: !transform.any_op {transform.readonly}) {",
        *body, "  transform.yield", "}", "}"]), context=module.context)
    module.operation.attributes["transform.with_named_sequence"] = ir.UnitAttr.get(module.context)
    for op in list(script.body.operations):
        op.detach_from_parent()
        module.body.append(op)
    try:
        run_passes(module, "builtin.module(transform-interpreter)")
    finally:
        for op in list(module.body.operations):
            if op.name == "transform.named_sequence":
                op.erase()
        del module.operation.attributes["transform.with_named_sequence"]


def insert_functions(anchor: ir.Operation, name: str, source: str) -> None:
    """Add the functions of MLIR text `source` (`name` and any it calls) to the module of
    `anchor`, unless the module has `name` already; each one the module has is left as it is."""
    module_op = anchor.parent
    while module_op.operation.name != "builtin.module":
        module_op = module_op.parent
    block = module_op.regions[0].blocks[0]
    names = {ir.StringAttr(o.attributes["sym_name"]).value for o in block.operations
             if o.operation.name == "func.func"}
    if name in names:
        return
    parsed = ir.Module.parse(source)  # alive while its functions move out of it
    for function in list(parsed.body.operations):
        if ir.StringAttr(function.attributes["sym_name"]).value not in names:
            function.detach_from_parent()
            block.append(function)


def tensor_shape(value: ir.Value) -> list[int | None]:
    """The shape of a ranked tensor value, None for each dynamic dimension."""
    t = ir.RankedTensorType(value.type)
    return [None if t.is_dynamic_dim(i) else t.shape[i] for i in range(t.rank)]


def tensor_dim(value: ir.Value, i: int) -> int | ir.Value:
    """Dimension `i` of a ranked tensor: its static size, or a tensor.dim op's result (built at
    the current insertion point)."""
    size = tensor_shape(value)[i]
    if size is not None:
        return size
    return tensor.DimOp(value, arith.ConstantOp(ir.IndexType.get(), i).result).result


def collapse(value: ir.Value, groups: list[list[int]]) -> ir.Value:
    """`value` (a ranked tensor) with each group of dimensions merged into one, dynamic if one of
    them is; `value` itself if every group is one dimension."""
    if all(len(g) == 1 for g in groups):
        return value
    shape = tensor_shape(value)
    merged = [None if any(shape[d] is None for d in g) else math.prod(shape[d] for d in g) for g in groups]
    result = ir.RankedTensorType.get([ir.ShapedType.get_dynamic_size() if m is None else m for m in merged],
                                     ir.RankedTensorType(value.type).element_type)
    return tensor.CollapseShapeOp(result, value, groups).result


def expand(value: ir.Value, groups: list[list[int]], sizes: list[int | ir.Value]) -> ir.Value:
    """`value` expanded by `groups` to `sizes` (ints, or index values for dynamic sizes): the
    inverse of `collapse`."""
    if all(len(g) == 1 for g in groups):
        return value
    static = [ir.ShapedType.get_dynamic_size() if isinstance(d, ir.Value) else d for d in sizes]
    result = ir.RankedTensorType.get(static, ir.RankedTensorType(value.type).element_type)
    return tensor.ExpandShapeOp(result, value, groups, [d for d in sizes if isinstance(d, ir.Value)], static).result


def producer(value: ir.Value) -> ir.Operation | None:
    """The operation whose result `value` is (None for a block argument)."""
    return value.owner.operation if isinstance(value, ir.OpResult) else None


def user(use: ir.OpOperand) -> ir.Operation:
    """The operation that reads a value through `use`."""
    return use.owner.operation if isinstance(use.owner, ir.OpView) else use.owner


def static_slice(value: ir.Value, offsets: list[int], sizes: list[int], strides: list[int] | None = None) -> ir.Value:
    """The slice of ranked tensor `value` at static `offsets`, of static `sizes` (and `strides`,
    by default 1), rank kept."""
    result = ir.RankedTensorType.get(sizes, ir.RankedTensorType(value.type).element_type)
    return tensor.ExtractSliceOp(result, value, [], [], [], offsets, sizes, strides or [1] * len(sizes)).result


def static_insert(value: ir.Value, dest: ir.Value, offsets: list[int]) -> ir.Value:
    """`dest` with ranked tensor `value` inserted at static `offsets` (unit strides): `static_slice`'s inverse."""
    sizes = ir.RankedTensorType(value.type).shape
    return tensor.InsertSliceOp(value, dest, [], [], [], offsets, sizes, [1] * len(sizes)).result


def clone_into(op: ir.Operation, mapping: dict[ir.Value, ir.Value], ip: ir.InsertionPoint) -> None:
    """Clone `op` at `ip`, its operands read through `mapping`, and map its results to the clone's."""
    clone = op.operation.clone(ip=ip)
    for i, operand in enumerate(clone.operands):
        if operand in mapping:
            clone.operands[i] = mapping[operand]
    mapping.update(zip(op.results, clone.results, strict=True))


def copy_body(source: ir.Operation, generic: ir.OpView) -> None:
    """Give the linalg generic `generic` a copy of the body of the generic `source` (same block arguments)."""
    old = source.regions[0].blocks[0]
    body = generic.regions[0].blocks.append(*[a.type for a in old.arguments])
    values = dict(zip(old.arguments, body.arguments, strict=True))
    for inner in old.operations:
        clone_into(inner, values, ir.InsertionPoint(body))


def dims_map(n_loops: int, dims: list[int]) -> ir.AffineMapAttr:
    """The indexing map of an operand indexed by the loops `dims` (of `n_loops`): `map_dims`'s inverse."""
    return ir.AffineMapAttr.get(ir.AffineMap.get(n_loops, 0, [ir.AffineDimExpr.get(d) for d in dims]))


def iterator_types(n_loops: int, reductions: Iterable[int] = ()) -> ir.ArrayAttr:
    """A linalg generic's iterator types: the loops `reductions` reduce, the others are parallel."""
    reduced = set(reductions)
    return ir.ArrayAttr.get([ir.Attribute.parse(f"#linalg.iterator_type<{'reduction' if d in reduced else 'parallel'}>")
                             for d in range(n_loops)])


def map_dims(op: ir.Operation) -> list[list[int]]:
    """For each operand of a linalg generic (whose maps are projected permutations), the loops
    it is indexed by."""
    return [[ir.AffineDimExpr(e).position for e in ir.AffineMapAttr(m).value.results]
            for m in ir.ArrayAttr(op.attributes["indexing_maps"])]
