"""bf16 and f16 arithmetic computed in f32, rounded after each op: what the schedule vectorizes.

LLVM's x86 backend aborts on some vector ops of bf16 and f16 ("soft promote"), so the schedule
vectorizes half-precision values only as storage: loaded and extended to f32, or truncated from
it and stored (`schedule._plain_body`). `widen_arithmetic(module)` rewrites every other use in a
linalg.generic's body: each arith or math op on half-precision values becomes the same op on
their f32 extensions, its result truncated back, which is how LLVM computes a scalar bf16 op
(promoted to f32, rounded once) and how PyTorch's CPU kernels compute bf16 elementwise ops.
In a reduction, the ops that combine with the output (a max over bf16 values, an argmax's
compare) keep their type (`_combines`), and such a reduction its scalar loops; the ops before
them (a contraction's factors computed from its inputs: a bf16 attention's rotary embedding and
scaling that fusion moved into the scores) are widened, so that a sum of products accumulating
in f32 vectorizes as an f32 one does.
Left as scalar loops, a bf16 Llama's elementwise ops took LLVM's loop vectorizer seconds to
compile and ran slower than eager.

Rounding f32 to bf16 is an instruction only with AVX512-BF16 or Arm's BF16 (the CPU entry's
`bf16_round`); elsewhere LLVM's x86 backend calls `__truncsfbf2` once per element, which took 6%
of a bf16 Llama's decoding step on an x86-64-v3 entry. `round_bf16_in_integers` computes it in
vectors of integers instead, as PyTorch's CPU kernels do (`c10::BFloat16`).
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith

from .irutil import find_ops

_KEEP = ("arith.extf", "arith.truncf", "arith.bitcast")  # already storage, or bits


def widen_arithmetic(module: ir.Module) -> None:
    """Compute the half-precision arithmetic of `module`'s linalg.generic bodies in f32."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name == "linalg.generic"):
            combines = _combines(op)
            for inner in list(op.regions[0].blocks[0].operations):
                if _widened(inner) and inner not in combines:
                    _widen(inner)


def _combines(op: ir.Operation) -> list[ir.Operation]:
    """The ops of a reduction's body that read its output (the accumulator), or that read what
    such an op computed: widened, a max or argmax over bf16 values became vector reductions and
    compares of bf16 values, on which LLVM aborted. An elementwise generic has none."""
    if "reduction" not in str(op.attributes["iterator_types"]):
        return []
    block = op.regions[0].blocks[0]
    tainted = {block.arguments[len(block.arguments) - 1]}
    found = []
    for inner in block.operations:
        if any(v in tainted for v in inner.operands):
            found.append(inner)
            tainted.update(inner.results)
    return found


def is_half(t: ir.Type) -> bool:
    """bf16 or f16."""
    return isinstance(t, ir.BF16Type | ir.F16Type)


def _widened(op: ir.Operation) -> bool:
    """An arith or math op of scalar half-precision operands or results that `_widen` rewrites."""
    types = [v.type for v in list(op.operands) + list(op.results)]
    return (op.name.startswith(("arith.", "math.")) and op.name not in _KEEP and not op.regions
            and any(is_half(t) for t in types) and all(is_half(t) or t == ir.F32Type.get() or
                                                     isinstance(t, ir.IntegerType | ir.IndexType) for t in types))


def _widen(op: ir.Operation) -> None:
    """Replace `op` by the same op on f32: half operands extended (constants rebuilt in f32),
    half results truncated back to their type."""
    f32 = ir.F32Type.get()
    with ir.InsertionPoint(op), op.location:
        operands = [_as_f32(v) if is_half(v.type) else v for v in op.operands]
        if op.name == "arith.constant":
            wide = _f32_constant(op).owner
        else:
            wide = ir.Operation.create(op.name, results=[f32 if is_half(r.type) else r.type for r in op.results],
                                       operands=operands,
                                       attributes={name: op.attributes[name] for name in op.attributes})
        for old, new in zip(op.results, wide.results, strict=True):
            old.replace_all_uses_with(arith.TruncFOp(old.type, new).result if is_half(old.type) else new)
    op.erase()


def _as_f32(value: ir.Value) -> ir.Value:
    """`value` as f32: a half-precision constant rebuilt, anything else extended."""
    owner = value.owner if isinstance(value, ir.OpResult) else None
    if owner is not None and owner.name == "arith.constant" and isinstance(owner.attributes["value"], ir.FloatAttr):
        return _f32_constant(owner)
    return arith.ExtFOp(ir.F32Type.get(), value).result


def _f32_constant(constant: ir.Operation) -> ir.Value:
    """A half-precision float constant's value as an f32 constant (exact)."""
    f32 = ir.F32Type.get()
    return arith.ConstantOp(f32, ir.FloatAttr.get(f32, ir.FloatAttr(constant.attributes["value"]).value)).result


def round_bf16_in_integers(module: ir.Module) -> None:
    """Rewrite every `arith.truncf` of f32 (or a vector of f32) to bf16 as integer arithmetic on
    the bits: round to nearest even (add 0x7fff plus the lowest kept bit, shift right by 16), a
    NaN to 0x7fc0, as `c10::BFloat16` rounds."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name == "arith.truncf" and _f32_to_bf16(op)):
            _round_in_integers(op)


def _f32_to_bf16(op: ir.Operation) -> bool:
    source, result = (_element(v.type) for v in (op.operands[0], op.results[0]))
    return source == ir.F32Type.get() and isinstance(result, ir.BF16Type)


def _element(t: ir.Type) -> ir.Type:
    return ir.VectorType(t).element_type if isinstance(t, ir.VectorType) else t


def _like(t: ir.Type, element: ir.Type) -> ir.Type:
    """`t`'s shape (a vector's, or a scalar) with `element` type."""
    return ir.VectorType.get(ir.VectorType(t).shape, element) if isinstance(t, ir.VectorType) else element


def _integer(t: ir.Type, value: int) -> ir.Value:
    """An integer constant of type `t` (a scalar, or a vector splat)."""
    if isinstance(t, ir.VectorType):
        element = ir.IntegerAttr.get(ir.VectorType(t).element_type, value)
        return arith.ConstantOp(t, ir.DenseElementsAttr.get_splat(t, element)).result
    return arith.ConstantOp(t, ir.IntegerAttr.get(t, value)).result


def _round_in_integers(op: ir.Operation) -> None:
    source = op.operands[0]
    i32 = _like(source.type, ir.IntegerType.get_signless(32))
    i16 = _like(source.type, ir.IntegerType.get_signless(16))
    with ir.InsertionPoint(op), op.location:
        bits = arith.BitcastOp(i32, source).result
        kept = arith.AndIOp(arith.ShRUIOp(bits, _integer(i32, 16)).result, _integer(i32, 1)).result
        biased = arith.AddIOp(bits, arith.AddIOp(kept, _integer(i32, 0x7FFF)).result).result
        rounded = arith.ShRUIOp(biased, _integer(i32, 16)).result
        nan = arith.CmpFOp(arith.CmpFPredicate.UNO, source, source).result
        chosen = arith.SelectOp(nan, _integer(i32, 0x7FC0), rounded).result
        result = arith.BitcastOp(op.results[0].type, arith.TruncIOp(i16, chosen).result).result
    op.results[0].replace_all_uses_with(result)
    op.erase()
