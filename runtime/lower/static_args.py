"""Lighter calls of private functions: static memref arguments lose their constant fields.

MLIR's default calling convention passes a memref as its whole descriptor spread into scalars:
allocated pointer, aligned pointer, offset, sizes, strides (3 + 2 x rank values). For the
private parts of a partitioned function (`partition`) that takes a transformer's weights, the
caller passed more than a thousand scalars to its part calls at 12 layers, and LLVM's code
generation of that caller grew with depth (about 1 s of a 12-layer BERT's compile time).

A memref type with a static shape and a static layout (the identity, or strides and offset
given) fixes the offset, the sizes and the strides, so a private function needs only its
pointers. `constant_fields(module, types)` runs after the LLVM conversion: in every private
`llvm.func` named in `types` (the memref-level argument types of the private functions, recorded
before the conversion), the offset, size and stride arguments of such memrefs are replaced by
constants, and the function gets internal linkage. LLVM's dead argument elimination (part of the
JIT's -O3 pipeline) then drops them from the function and from every call, and the caller only
loads and passes pointers. The function's body is unchanged otherwise, so the values it computes
with are the same.

What is left of a partitioned function is glue: it loads each argument's descriptor and calls its
parts in order, in one basic block that grows with depth (a thousand instructions at 12 BERT
layers), whose -O3 code generation took ~0.1 s there for no run-time gain. `unoptimized_glue`
compiles such a function's C-interface wrapper (into which the function is inlined) without
optimization.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import llvm


def private_arg_types(module: ir.Module) -> dict[str, list[ir.Type]]:
    """The argument types of each private `func.func` of `module` with a body, by name."""
    types: dict[str, list[ir.Type]] = {}
    for op in module.body.operations:
        if op.operation.name != "func.func" or not op.regions[0].blocks:
            continue
        if "sym_visibility" in op.attributes and ir.StringAttr(op.attributes["sym_visibility"]).value == "private":
            signature = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
            types[ir.StringAttr(op.attributes["sym_name"]).value] = list(signature.inputs)
    return types


def constant_fields(module: ir.Module, types: dict[str, list[ir.Type]]) -> None:
    """Replace the offset, size and stride arguments of memrefs of a static shape and layout
    by constants in the private `llvm.func`s named in `types`, and make those functions internal."""
    for op in module.body.operations:
        if op.operation.name != "llvm.func" or not op.regions[0].blocks:
            continue
        name = ir.StringAttr(op.attributes["sym_name"]).value
        if name not in types:
            continue
        block = op.regions[0].blocks[0]
        fields = _constant_fields(types[name])
        with module.context, ir.Location.unknown():
            i64 = ir.IntegerType.get_signless(64)
            if (fields is None or _width(types[name]) != len(block.arguments)
                    or any(block.arguments[position].type != i64 for position, _ in fields)):
                continue  # a calling convention this module does not know: left as it is
            start = ir.InsertionPoint.at_block_begin(block)
            for position, value in fields:
                constant = llvm.ConstantOp(i64, ir.IntegerAttr.get(i64, value), ip=start).result
                block.arguments[position].replace_all_uses_with(constant)
            op.attributes["linkage"] = ir.Attribute.parse("#llvm.linkage<internal>")


def _static_layout(t: ir.Type) -> tuple[list[int], list[int], int] | None:
    """Shape, strides and offset of a memref type that fixes all three, else None."""
    if not isinstance(t, ir.MemRefType):
        return None
    memref = ir.MemRefType(t)
    if not memref.has_static_shape:
        return None
    strides, offset = memref.get_strides_and_offset()
    dynamic = ir.ShapedType.get_dynamic_stride_or_offset()
    if offset == dynamic or dynamic in strides:
        return None
    return list(memref.shape), list(strides), offset


def _width(types: list[ir.Type]) -> int:
    """How many LLVM arguments `types` become."""
    return sum(map(_arg_width, types))


def _arg_width(t: ir.Type) -> int:
    """How many LLVM arguments one argument of type `t` becomes: a ranked memref 3 + 2 x rank
    (two pointers, offset, sizes, strides), anything else one."""
    return 3 + 2 * ir.MemRefType(t).rank if isinstance(t, ir.MemRefType) else 1


def _constant_fields(types: list[ir.Type]) -> list[tuple[int, int]] | None:
    """(LLVM argument position, value) of every constant descriptor field; None if an argument
    is an unranked memref (whose convention differs)."""
    fields: list[tuple[int, int]] = []
    position = 0
    for t in types:
        if isinstance(t, ir.UnrankedMemRefType):
            return None
        layout = _static_layout(t)
        if layout is not None:
            shape, strides, offset = layout
            fields += [(position + 2 + i, v) for i, v in enumerate([offset, *shape, *strides])]
        position += _arg_width(t)
    return fields


# LLVM-dialect ops of a function that only unpacks descriptors and calls other functions
_GLUE_OPS = frozenset({"llvm.extractvalue", "llvm.insertvalue", "llvm.mlir.poison", "llvm.mlir.undef",
                       "llvm.mlir.constant", "llvm.mlir.zero", "llvm.getelementptr", "llvm.ptrtoint",
                       "llvm.mul", "llvm.add", "llvm.load", "llvm.intr.memcpy", "llvm.call", "llvm.return"})


def unoptimized_glue(module: ir.Module) -> None:
    """Mark `_mlir_ciface_<f>` optnone where @f is glue: one block of `_GLUE_OPS` that calls
    functions of `module` (the parts of a partitioned function) and nothing else."""
    functions = {ir.StringAttr(op.attributes["sym_name"]).value: op for op in module.body.operations
                 if op.operation.name == "llvm.func"}
    for name, wrapper in functions.items():
        inner = functions.get(name.removeprefix("_mlir_ciface_"))
        if not name.startswith("_mlir_ciface_") or inner is None or not _is_glue(inner, functions):
            continue
        with module.context:
            wrapper.attributes["passthrough"] = ir.ArrayAttr.get([ir.StringAttr.get("noinline"),
                                                                  ir.StringAttr.get("optnone")])


def _is_glue(function: ir.Operation, functions: dict[str, ir.Operation]) -> bool:
    blocks = function.regions[0].blocks
    if len(blocks) != 1:
        return False
    calls = 0
    for op in blocks[0].operations:
        if op.operation.name not in _GLUE_OPS:
            return False
        if op.operation.name == "llvm.call":
            callee = op.attributes.get("callee", None)  # none: an indirect call
            target = functions.get(ir.FlatSymbolRefAttr(callee).value) if callee is not None else None
            if target is None or not target.regions[0].blocks:
                return False  # an indirect call or one of a library function (memrefCopy, malloc)
            calls += 1
    return calls > 0
