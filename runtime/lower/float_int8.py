"""int8 contractions on fast kernels, exactly (f32 FMAs, or AVX512-VNNI), for the optimizing pipeline.

After `zero_points.separate_zero_points`, an int8 `tosa.matmul` / `tosa.conv2d` is a plain
i8 x i8 -> i32 contraction. The schedule's register tile for i32 is slow on x86 (sign
extensions and vpmulld, no multiply-add), while its f32 tile is the well-tuned FMA kernel. The
f32 contraction of the same values is exact when every partial sum is: each product is an
integer of magnitude at most 128 * 128 = 2^14, so a sum of at most EXACT_TERMS = 1024 of them
stays within 2^24, where f32 holds every integer, in any order of summation (FMA or not). So:

    matmul:  A, B int8  ->  cast(f32 matmul(f32(A), f32(B)), i32)       (K <= 1024)
    K > 1024: K split into chunks of at most 1024, each exact as above, summed in i32
    conv2d:  the same with KH * KW * C terms per output (the input channels split into chunks
             if needed), the i32 bias added after the cast

A matmul whose second operand is a constant (a frozen nn.Linear weight) and a stride-1 conv2d
with a constant weight, with output columns in whole vectors, run on the target CPU's int8 dot
product instead where its entry names one (`int8_dot`: AVX512-VNNI's `vpdpbusd`, 4x the f32 FMA's
multiply-adds per instruction; AVX-512BW's and AVX2's `vpmaddwd`, 2x; exact in i32 without
chunks).

The result is bit for bit the i32 accumulator TOSA defines (which wraps modulo 2^32; no sum
of int8 products of these sizes comes near that). A constant operand (the frozen weights:
tosa.const, possibly reshaped or transposed) becomes an f32 constant laid out as the
contraction reads it, computed here once; any other operand is cast per call, which fuses into
its producer. Only contractions whose zero points are constant zeros are taken; opt="none"
(the reference lowering) does not run this.
"""

from __future__ import annotations

import math

import numpy as np
from mlir import ir

from ..cpu import Cpu
from . import int8_dot
from .int8_dot import Dot
from .irutil import find_ops, insert_functions
from .zero_points import constant, int_width

EXACT_TERMS = 1024  # products of two int8 values whose sum is exact in f32: 1024 * 2^14 = 2^24


def fast_int8_contractions(module: ir.Module, cpu: Cpu) -> None:
    """Rewrite each int8 x int8 -> i32 tosa.matmul / tosa.conv2d with zero zero points as a call
    of an int8 dot-product kernel (where `cpu` has the instruction) or an exact f32 contraction
    (see the module docstring)."""
    dot = int8_dot.for_cpu(cpu)
    rows = dot.rows(cpu) if dot else 0
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda o: o.name in ("tosa.matmul", "tosa.conv2d")):
            if not _int8_contraction(op):
                continue
            if op.name == "tosa.matmul":
                _matmul(op, dot, rows)
            else:
                _conv2d(op, dot, rows)


def _int8_contraction(op: ir.Operation) -> bool:
    """Static int8 operands, an i32 result, and zero points that are constant zeros."""
    operands = list(op.operands)
    if int_width(operands[0].type) != 8 or int_width(operands[1].type) != 8 or int_width(op.results[0].type) != 32:
        return False
    if not all(ir.RankedTensorType(v.type).has_static_shape for v in [*operands[:2], op.results[0]]):
        return False
    return all(constant(zp) is not None and not np.any(constant(zp)) for zp in operands[-2:])


class _Emit:
    """Creates TOSA ops before `anchor`."""

    def __init__(self, anchor: ir.Operation) -> None:
        self.ip = ir.InsertionPoint(anchor)
        self.f32 = ir.F32Type.get()
        self.i32 = ir.IntegerType.get_signless(32)

    def op(self, name: str, result: ir.Type, operands: list[ir.Value], **attributes: ir.Attribute) -> ir.Value:
        return ir.Operation.create(name, results=[result], operands=operands, attributes=attributes,
                                   ip=self.ip).result

    def const(self, values: np.ndarray, element: ir.Type) -> ir.Value:
        """A tosa.const of `values` as f32 or an integer type of 8, 16 or 32 bits."""
        t = ir.RankedTensorType.get(list(values.shape), element)
        dtype = np.float32 if isinstance(element, ir.F32Type) else {8: np.int8, 16: np.int16, 32: np.int32}[
            ir.IntegerType(element).width]
        data = np.ascontiguousarray(values, dtype=dtype)
        return self.op("tosa.const", t, [], values=ir.DenseElementsAttr.get(data, type=t))

    def shape(self, dims: list[int]) -> ir.Value:
        t = ir.Type.parse(f"!tosa.shape<{len(dims)}>")
        attr = ir.DenseElementsAttr.get(np.asarray(dims, dtype=np.int64),
                                        type=ir.RankedTensorType.get([len(dims)], ir.IndexType.get()))
        return self.op("tosa.const_shape", t, [], values=attr)

    def cast(self, x: ir.Value, element: ir.Type) -> ir.Value:
        return self.op("tosa.cast", ir.RankedTensorType.get(ir.RankedTensorType(x.type).shape, element), [x])

    def slice(self, x: ir.Value, axis: int, start: int, size: int) -> ir.Value:
        """`x[..., start:start + size, ...]` along `axis` (all of it: `x` itself)."""
        shape = list(ir.RankedTensorType(x.type).shape)
        if start == 0 and size == shape[axis]:
            return x
        starts = [0] * len(shape)
        starts[axis], shape[axis] = start, size
        result = ir.RankedTensorType.get(shape, ir.RankedTensorType(x.type).element_type)
        return self.op("tosa.slice", result, [x, self.shape(starts), self.shape(shape)])

    def f32_chunk(self, x: ir.Value, axis: int, start: int, size: int) -> ir.Value:
        """The chunk of int8 `x` along `axis` as f32: a constant if `x` is one, else a cast."""
        data = constant(x)
        if data is not None:
            index = [slice(None)] * data.ndim
            index[axis] = slice(start, start + size)
            return self.const(data[tuple(index)], self.f32)
        return self.cast(self.slice(x, axis, start, size), self.f32)

    def int8(self, values: list[int]) -> ir.Value:
        return self.const(np.asarray(values), ir.IntegerType.get_signless(8))

    def zero(self, element: ir.Type, shape: list[int]) -> ir.Value:
        return self.const(np.zeros(shape), element)


def _chunks(total: int, terms_per_unit: int) -> list[tuple[int, int]]:
    """(start, size) of near-equal chunks of `total` units, each of at most EXACT_TERMS terms."""
    count = math.ceil(total * terms_per_unit / EXACT_TERMS)
    size = math.ceil(total / count)
    return [(start, min(size, total - start)) for start in range(0, total, size)]


def _sum_i32(emit: _Emit, parts: list[ir.Value]) -> ir.Value:
    acc = emit.cast(parts[0], emit.i32)
    for part in parts[1:]:
        acc = emit.op("tosa.add", acc.type, [acc, emit.cast(part, emit.i32)])
    return acc


def _matmul(op: ir.Operation, dot: Dot | None, rows: int) -> None:
    a, b = list(op.operands)[:2]
    batch, m, k = ir.RankedTensorType(a.type).shape
    n = ir.RankedTensorType(b.type).shape[2]
    emit = _Emit(op)
    weight = constant(b)
    if batch == 1 and weight is not None and dot and dot.fits(m, k, n):
        _dot_matmul(op, emit, a, weight[0], dot, rows)
        return
    zero = emit.zero(emit.f32, [1])
    parts = []
    for start, size in _chunks(k, 1):
        fa, fb = emit.f32_chunk(a, 2, start, size), emit.f32_chunk(b, 1, start, size)
        parts.append(emit.op("tosa.matmul", ir.RankedTensorType.get([batch, m, n], emit.f32), [fa, fb, zero, zero]))
    op.results[0].replace_all_uses_with(_sum_i32(emit, parts))
    _erase(op)


def _dot_operand(emit: _Emit, x: ir.Value, dot: Dot) -> ir.Value:
    """int8 `x` as the instruction reads it: its bytes unsigned (+ 128, the sign bit flipped), or
    sign-extended to the instruction's element type."""
    if dot.unsigned:
        sign = emit.const(np.full([1] * ir.RankedTensorType(x.type).rank, -128), ir.IntegerType.get_signless(8))
        return emit.op("tosa.bitwise_xor", x.type, [x, sign])
    if dot.element == 8:
        return x
    return emit.cast(x, ir.IntegerType.get_signless(dot.element))


def _packed(emit: _Emit, b: np.ndarray, dot: Dot) -> ir.Value:
    """The constant [K, N] int8 `b` as `int8_dot.pack` lays it out for `dot`."""
    return emit.const(int8_dot.pack(b, dot), ir.IntegerType.get_signless(dot.element))


def _correction(emit: _Emit, sums: np.ndarray, dot: Dot, shape: list[int]) -> ir.Value | None:
    """-128 times the weight sums `sums`, where the kernel read a's bytes unsigned, as i32."""
    if not dot.unsigned:
        return None
    values = sums.astype(np.int64) * -128
    return emit.const(((values + 2**31) % 2**32 - 2**31).reshape(shape), emit.i32)


def _dot_matmul(op: ir.Operation, emit: _Emit, a: ir.Value, b: np.ndarray, dot: Dot, rows: int) -> None:
    """`int8_dot.kernel` on a as the instruction reads it and b packed (minus 128 times b's
    column sums, a constant, where a's bytes were made unsigned)."""
    _, m, k = ir.RankedTensorType(a.type).shape
    n = b.shape[1]
    g = dot.group
    kg = math.ceil(k / g)
    element = ir.IntegerType.get_signless(dot.element)
    flat = emit.op("tosa.reshape", ir.RankedTensorType.get([m, k], element),
                   [_dot_operand(emit, a, dot), emit.shape([m, k])])
    if g * kg != k:
        flat = emit.op("tosa.pad", ir.RankedTensorType.get([m, g * kg], element),
                       [flat, emit.shape([0, 0, 0, g * kg - k]), emit.zero(element, [1])])
    result = ir.RankedTensorType(op.results[0].type)
    name = f"torchtosa_{dot.name}_{m}x{kg}x{n}"
    _insert_kernel(op, name, int8_dot.kernel(name, dot, rows, m, kg, n), dot)
    empty = ir.Operation.create("tensor.empty", results=[result], operands=[], ip=emit.ip).result
    call = ir.Operation.create("func.call", results=[result], operands=[flat, _packed(emit, b, dot), empty],
                               attributes={"callee": ir.FlatSymbolRefAttr.get(name)}, ip=emit.ip).result
    correction = _correction(emit, b.sum(axis=0), dot, [1, 1, n])
    op.results[0].replace_all_uses_with(call if correction is None else emit.op("tosa.add", result, [call, correction]))
    _erase(op)


def _insert_kernel(anchor: ir.Operation, name: str, source: str, dot: Dot) -> None:
    """Add the private function `name` (MLIR text `source`) and the placeholder of `dot`'s
    instruction to the module of `anchor`, unless there."""
    insert_functions(anchor, name, source + "\n" + int8_dot.declaration(dot))


def _dot_conv2d(op: ir.Operation, emit: _Emit, x: ir.Value, w: np.ndarray, bias: ir.Value, dot: Dot,
                rows: int) -> None:
    """A stride-1 conv2d on the int8 dot product (`int8_dot.conv_kernel`), read straight from
    the input: padded (and its channels to a multiple of the instruction's group, with zeros, as
    the weight's), as the instruction reads it (unsigned bytes, then minus 128 times each output
    channel's weight sum, a constant; or sign-extended), plus the bias."""
    channels_out, kh, kw, channels = w.shape
    batch, h, width, _ = ir.RankedTensorType(x.type).shape
    top, bottom, left, right = list(ir.DenseI64ArrayAttr(op.attributes["pad"]))
    extra = -channels % dot.group
    i8 = ir.IntegerType.get_signless(8)
    shape = [batch, h + top + bottom, width + left + right, channels + extra]
    if top or bottom or left or right or extra:
        x = emit.op("tosa.pad", ir.RankedTensorType.get(shape, i8),
                    [x, emit.shape([0, 0, top, bottom, left, right, 0, extra]), emit.int8([0])])
    x = _dot_operand(emit, x, dot)
    w = np.pad(w, [(0, 0), (0, 0), (0, 0), (0, extra)])
    result = ir.RankedTensorType(op.results[0].type)
    out = tuple(result.shape)
    name = f"torchtosa_{dot.name}_conv_" + "x".join(map(str, [*shape, *out, kh, kw]))
    _insert_kernel(op, name, int8_dot.conv_kernel(name, dot, rows, tuple(shape), out, kh, kw), dot)
    empty = ir.Operation.create("tensor.empty", results=[result], operands=[], ip=emit.ip).result
    acc = ir.Operation.create("func.call", results=[result],
                              operands=[x, _packed(emit, w.reshape(channels_out, -1).T, dot), empty],
                              attributes={"callee": ir.FlatSymbolRefAttr.get(name)}, ip=emit.ip).result
    correction = _correction(emit, w.sum(axis=(1, 2, 3)), dot, [1, 1, 1, -1])
    if correction is not None:
        acc = emit.op("tosa.add", result, [acc, correction])
    bias_shape = [1, 1, 1, ir.RankedTensorType(bias.type).shape[0]]
    bias = emit.op("tosa.reshape", ir.RankedTensorType.get(bias_shape, emit.i32), [bias, emit.shape(bias_shape)])
    op.results[0].replace_all_uses_with(emit.op("tosa.add", result, [acc, bias]))
    _erase(op)


def _conv2d(op: ir.Operation, dot: Dot | None, rows: int) -> None:
    x, w, bias = list(op.operands)[:3]
    channels_out, kh, kw, channels_in = ir.RankedTensorType(w.type).shape
    if kh * kw > EXACT_TERMS or int_width(bias.type) != 32:
        return
    emit = _Emit(op)
    weight = constant(w)
    if (weight is not None and dot and channels_out % dot.lanes == 0
            and list(ir.DenseI64ArrayAttr(op.attributes["stride"])) == [1, 1]
            and list(ir.DenseI64ArrayAttr(op.attributes["dilation"])) == [1, 1]):
        _dot_conv2d(op, emit, x, weight, bias, dot, rows)
        return
    result = ir.RankedTensorType(op.results[0].type)
    attributes = {name: op.attributes[name] for name in op.attributes}
    attributes["acc_type"] = ir.TypeAttr.get(emit.f32)
    zero, zero_bias = emit.zero(emit.f32, [1]), emit.zero(emit.f32, [channels_out])
    parts = []
    for start, size in _chunks(channels_in, kh * kw):
        fx, fw = emit.f32_chunk(x, 3, start, size), emit.f32_chunk(w, 3, start, size)
        parts.append(emit.op("tosa.conv2d", ir.RankedTensorType.get(result.shape, emit.f32),
                             [fx, fw, zero_bias, zero, zero], **attributes))
    acc = _sum_i32(emit, parts)
    bias_shape = [1] * (result.rank - 1) + [ir.RankedTensorType(bias.type).shape[0]]
    bias = emit.op("tosa.reshape", ir.RankedTensorType.get(bias_shape, emit.i32), [bias, emit.shape(bias_shape)])
    acc = emit.op("tosa.add", acc.type, [acc, bias])
    op.results[0].replace_all_uses_with(acc)
    _erase(op)


def _erase(op: ir.Operation) -> None:
    """Erase `op`, then each producer of its operands that is left unused (the int8 constants)."""
    producers: list[ir.Operation] = []
    for value in op.operands:
        owner = value.owner
        if isinstance(owner, ir.OpView | ir.Operation) and owner.operation not in producers:
            producers.append(owner.operation)
    op.erase()
    for producer in producers:
        if producer.name.startswith("tosa.") and not any(list(r.uses) for r in producer.results):
            _erase(producer)
