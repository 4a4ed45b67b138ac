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
with a constant weight, with output columns in whole 16-lane vectors, run on AVX512-VNNI
instead where the target CPU has it (`vnni`: 4x the f32 FMA's multiply-adds per instruction, exact
in i32 without chunks).

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
from . import vnni
from .irutil import find_ops, insert_functions
from .zero_points import constant, int_width

EXACT_TERMS = 1024  # products of two int8 values whose sum is exact in f32: 1024 * 2^14 = 2^24


def fast_int8_contractions(module: ir.Module, cpu: Cpu) -> None:
    """Rewrite each int8 x int8 -> i32 tosa.matmul / tosa.conv2d with zero zero points as a VNNI
    kernel call (where `cpu` has the instruction) or an exact f32 contraction (see the module
    docstring)."""
    dot = vnni.available(cpu)
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda o: o.name in ("tosa.matmul", "tosa.conv2d")):
            if not _int8_contraction(op):
                continue
            if op.name == "tosa.matmul":
                _matmul(op, dot)
            else:
                _conv2d(op, dot)


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
        t = ir.RankedTensorType.get(list(values.shape), element)
        dtype = np.float32 if isinstance(element, ir.F32Type) else np.int32
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
        t = ir.RankedTensorType.get([len(values)], ir.IntegerType.get_signless(8))
        return self.op("tosa.const", t, [], values=ir.DenseElementsAttr.get(np.asarray(values, dtype=np.int8), type=t))

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


def _matmul(op: ir.Operation, dot: bool) -> None:
    a, b = list(op.operands)[:2]
    batch, m, k = ir.RankedTensorType(a.type).shape
    n = ir.RankedTensorType(b.type).shape[2]
    emit = _Emit(op)
    weight = constant(b)
    if batch == 1 and weight is not None and dot and vnni.fits(m, k, n):
        _vnni_matmul(op, emit, a, weight[0])
        return
    zero = emit.zero(emit.f32, [1])
    parts = []
    for start, size in _chunks(k, 1):
        fa, fb = emit.f32_chunk(a, 2, start, size), emit.f32_chunk(b, 1, start, size)
        parts.append(emit.op("tosa.matmul", ir.RankedTensorType.get([batch, m, n], emit.f32), [fa, fb, zero, zero]))
    op.results[0].replace_all_uses_with(_sum_i32(emit, parts))
    _erase(op)


def _vnni_matmul(op: ir.Operation, emit: _Emit, a: ir.Value, b: np.ndarray) -> None:
    """`vnni.kernel` on a + 128 (its sign bit flipped) and b packed, minus 128 times b's column
    sums (a constant)."""
    _, m, k = ir.RankedTensorType(a.type).shape
    n = b.shape[1]
    k4 = math.ceil(k / 4)
    i8 = ir.IntegerType.get_signless(8)
    sign = emit.op("tosa.const", ir.RankedTensorType.get([1, 1, 1], i8), [],
                   values=ir.DenseElementsAttr.get(np.full((1, 1, 1), -128, dtype=np.int8),
                                                   type=ir.RankedTensorType.get([1, 1, 1], i8)))
    unsigned = emit.op("tosa.bitwise_xor", a.type, [a, sign])
    flat = emit.op("tosa.reshape", ir.RankedTensorType.get([m, k], i8), [unsigned, emit.shape([m, k])])
    if 4 * k4 != k:
        pad_value = emit.op("tosa.const", ir.RankedTensorType.get([1], i8), [],
                            values=ir.DenseElementsAttr.get(np.zeros(1, dtype=np.int8),
                                                            type=ir.RankedTensorType.get([1], i8)))
        flat = emit.op("tosa.pad", ir.RankedTensorType.get([m, 4 * k4], i8),
                       [flat, emit.shape([0, 0, 0, 4 * k4 - k]), pad_value])
    packed = vnni.pack(b)
    packed_t = ir.RankedTensorType.get(list(packed.shape), i8)
    panels = emit.op("tosa.const", packed_t, [], values=ir.DenseElementsAttr.get(packed, type=packed_t))
    result = ir.RankedTensorType(op.results[0].type)
    name = f"torchtosa_vnni_{m}x{k4}x{n}"
    _insert_kernel(op, name, vnni.kernel(name, m, k4, n))
    empty = ir.Operation.create("tensor.empty", results=[result], operands=[], ip=emit.ip).result
    call = ir.Operation.create("func.call", results=[result], operands=[flat, panels, empty],
                               attributes={"callee": ir.FlatSymbolRefAttr.get(name)}, ip=emit.ip).result
    sums = b.astype(np.int64).sum(axis=0) * -128
    correction = emit.const(((sums + 2**31) % 2**32 - 2**31).reshape(1, 1, n), emit.i32)
    op.results[0].replace_all_uses_with(emit.op("tosa.add", result, [call, correction]))
    _erase(op)


def _insert_kernel(anchor: ir.Operation, name: str, source: str) -> None:
    """Add the private function `name` (MLIR text `source`) and the placeholder of the VNNI
    instruction to the module of `anchor`, unless there."""
    insert_functions(anchor, name, source + "\n" + vnni.declaration())


def _vnni_conv2d(op: ir.Operation, emit: _Emit, x: ir.Value, w: np.ndarray, bias: ir.Value) -> None:
    """A stride-1 conv2d on VNNI (`vnni.conv_kernel`), read straight from the input: padded (and
    its channels to a multiple of 4, with zeros, as the weight's), made unsigned (+ 128, the sign
    bit flipped), minus 128 times each output channel's weight sum (a constant), plus the bias."""
    channels_out, kh, kw, channels = w.shape
    batch, h, width, _ = ir.RankedTensorType(x.type).shape
    top, bottom, left, right = list(ir.DenseI64ArrayAttr(op.attributes["pad"]))
    extra = -channels % 4
    i8 = ir.IntegerType.get_signless(8)
    shape = [batch, h + top + bottom, width + left + right, channels + extra]
    if top or bottom or left or right or extra:
        x = emit.op("tosa.pad", ir.RankedTensorType.get(shape, i8),
                    [x, emit.shape([0, 0, top, bottom, left, right, 0, extra]), emit.int8([0])])
    sign = emit.op("tosa.const", ir.RankedTensorType.get([1, 1, 1, 1], i8), [],
                   values=ir.DenseElementsAttr.get(np.full((1, 1, 1, 1), -128, dtype=np.int8),
                                                   type=ir.RankedTensorType.get([1, 1, 1, 1], i8)))
    unsigned = emit.op("tosa.bitwise_xor", x.type, [x, sign])
    w = np.pad(w, [(0, 0), (0, 0), (0, 0), (0, extra)])
    packed = vnni.pack(w.reshape(channels_out, -1).T)
    packed_t = ir.RankedTensorType.get(list(packed.shape), i8)
    panels = emit.op("tosa.const", packed_t, [], values=ir.DenseElementsAttr.get(packed, type=packed_t))
    result = ir.RankedTensorType(op.results[0].type)
    out = tuple(result.shape)
    name = "torchtosa_vnni_conv_" + "x".join(map(str, [*shape, *out, kh, kw]))
    _insert_kernel(op, name, vnni.conv_kernel(name, tuple(shape), out, kh, kw))
    empty = ir.Operation.create("tensor.empty", results=[result], operands=[], ip=emit.ip).result
    acc = ir.Operation.create("func.call", results=[result], operands=[unsigned, panels, empty],
                              attributes={"callee": ir.FlatSymbolRefAttr.get(name)}, ip=emit.ip).result
    sums = w.astype(np.int64).sum(axis=(1, 2, 3)) * -128
    correction = emit.const(((sums + 2**31) % 2**32 - 2**31).reshape(1, 1, 1, -1), emit.i32)
    acc = emit.op("tosa.add", result, [acc, correction])
    bias_shape = [1, 1, 1, ir.RankedTensorType(bias.type).shape[0]]
    bias = emit.op("tosa.reshape", ir.RankedTensorType.get(bias_shape, emit.i32), [bias, emit.shape(bias_shape)])
    op.results[0].replace_all_uses_with(emit.op("tosa.add", result, [acc, bias]))
    _erase(op)


def _conv2d(op: ir.Operation, dot: bool) -> None:
    x, w, bias = list(op.operands)[:3]
    channels_out, kh, kw, channels_in = ir.RankedTensorType(w.type).shape
    if kh * kw > EXACT_TERMS or int_width(bias.type) != 32:
        return
    emit = _Emit(op)
    weight = constant(w)
    if (weight is not None and dot and channels_out % vnni.LANES == 0
            and list(ir.DenseI64ArrayAttr(op.attributes["stride"])) == [1, 1]
            and list(ir.DenseI64ArrayAttr(op.attributes["dilation"])) == [1, 1]):
        _vnni_conv2d(op, emit, x, weight, bias)
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
