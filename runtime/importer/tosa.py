"""The thin builder under generated code: TOSA 1.0 operand details and result types.

Generated catalogue functions (`_generated/catalogue.py`, from opdefs/tosa.yaml)
compute each op's result shape and dtype and call `Builder.create`. This module
only knows how to make MLIR values: element types, constants, `!tosa.shape`
operands, rank equalisation, and the bool convention.

Bool convention: torch keeps bools in one byte and the MLIR→LLVM lowering of
this build cannot load or store `i1` buffers, so a bool tensor lives as `i8`
(0 or 1) between ops. Ops that need `i1` (comparisons, logical ops, the
predicate of select) get a `tosa.cast` on the way in or out, which
`linalg-fuse-elementwise-ops` fuses away.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import sympy
import torch
from mlir import ir
from mlir.dialects import arith, linalg

from ..capture import symbolic
from ..capture.symbolic import Dim, is_static, same_shape, static
from ..errors import LoweringError, Unsupported
from . import bounds, target

_ELEMENT = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.bool: "i8",
}


class Int48:
    """TOSA's i48, the accumulator of int16 x int8 convolutions (EXT-INT16), which torch has
    no dtype for: the rule language's `i48`. Only lowerings' intermediate values have it (the
    accumulator and bias of a convolution, the input of the RESCALE after it); it answers the
    questions rules ask of a torch.dtype."""

    is_floating_point = is_complex = False
    is_signed = True
    itemsize = 8  # what LLVM allocates for an i48 (lower/pipeline.py)
    bits = 48

    def __repr__(self) -> str:
        return "i48"


INT48 = Int48()


def element_type(dtype: torch.dtype, i1: bool = False) -> ir.Type:
    """The MLIR element type a torch dtype lives in: bool as i8 unless `i1`, and under a TOSA
    target the target's storage type (`Target.storage`: bool as i1, int64 as i32 without the
    int64 extension)."""
    if i1 and dtype == torch.bool:
        return ir.IntegerType.get_signless(1)
    if dtype is INT48:
        return ir.IntegerType.get_signless(48)
    if dtype not in _ELEMENT:
        raise Unsupported(f"dtype {dtype} has no TOSA element type; supported: "
                          + ", ".join(str(d).removeprefix("torch.") for d in _ELEMENT))
    t = target.active()
    return ir.Type.parse((t and t.storage(dtype)) or _ELEMENT[dtype])


def element_dtypes() -> frozenset[torch.dtype]:
    """The torch dtypes that have a TOSA element type."""
    return frozenset(_ELEMENT)


def wrapped_dtype(value: bool | int | float) -> torch.dtype:
    """The dtype torch gives a Python number passed where aten takes a Tensor."""
    return torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float64


def tensor_type(shape: Sequence[Dim], dtype: torch.dtype, i1: bool = False) -> ir.RankedTensorType:
    """The MLIR type of a tensor; a symbolic dim is `?`."""
    return ir.RankedTensorType.get(symbolic.mlir_dims(shape), element_type(dtype, i1))


def _groups_attr(groups: Any) -> ir.ArrayAttr:
    """A reassociation: the dims of each group."""
    i64 = ir.IntegerType.get_signless(64)
    return ir.ArrayAttr.get([ir.ArrayAttr.get([ir.IntegerAttr.get(i64, d) for d in g]) for g in groups])


@dataclass(frozen=True)
class ShapeOperand:
    """A `!tosa.shape` operand (reshape, slice, tile, pad), made into a `tosa.const_shape` when
    the op is created. TOSA 1.0 has no symbolic shape values: an op given a symbolic one is
    emitted in the tensor and linalg dialects instead (`Builder._dynamic`)."""

    dims: tuple[Dim, ...]


Layout = tuple[tuple[int, ...], int, int]  # (strides, storage offset, storage size), in elements


@dataclass(frozen=True)
class Tensor:
    """An SSA tensor value with the shape and dtype the rules see."""

    value: ir.Value
    shape: tuple[Dim, ...]  # ints, and SymInts of the graph's ShapeEnv for sizes known at run time
    dtype: torch.dtype
    wrapped: bool = False  # a Python number in a Tensor slot: promotes like a scalar
    # How PyTorch stores this value, where known (graph values, from their FakeTensor; test
    # inputs): only ops that read the storage beneath a value (as_strided) use it, through
    # the rule builtin storage_layout. None: unknown.
    layout: Layout | None = None

    @property
    def rank(self) -> int:
        return len(self.shape)


def storage_layout(t: Any) -> Layout | None:
    """How PyTorch stores a (fake or real) tensor: strides, storage offset and storage size in
    elements; None for anything else (not a strided tensor, symbolic strides)."""
    if not isinstance(t, torch.Tensor) or t.layout is not torch.strided:
        return None
    if not all(isinstance(s, int) for s in (*t.stride(), t.storage_offset())):
        return None
    return tuple(int(s) for s in t.stride()), int(t.storage_offset()), t.untyped_storage().nbytes() // t.element_size()


def _attr(kind: str, value: Any, elem: ir.Type | None, result: ir.RankedTensorType) -> ir.Attribute:
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    if kind == "i32":
        return ir.IntegerAttr.get(i32, int(value))
    if kind == "i64":
        return ir.IntegerAttr.get(i64, int(value))
    if kind == "f32":
        return ir.FloatAttr.get_f32(float(value))
    if kind == "bool":
        return ir.BoolAttr.get(bool(value))
    if kind == "i32_array":
        return ir.DenseI32ArrayAttr.get([int(v) for v in value])
    if kind == "i64_array":
        return ir.DenseI64ArrayAttr.get([int(v) for v in value])
    if kind == "type":
        return ir.TypeAttr.get(element_type(value))
    if kind == "elem":
        if isinstance(elem, ir.FloatType):
            return ir.FloatAttr.get(elem, float(value))
        return ir.IntegerAttr.get(elem, int(value))
    if kind == "str":
        return ir.Attribute.parse(str(value))
    if kind == "dense":
        return dense(value, result)
    raise LoweringError(f"unknown attribute kind {kind!r}")


_STORAGE = {
    "i1": torch.bool, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
    "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8,
}


def dense(value: Any, result: ir.RankedTensorType) -> ir.DenseElementsAttr:
    """A dense attribute of `result`'s type from a scalar (splat), a list or a tensor.

    Non-splat data goes through one buffer copy (numpy), not one attribute per element."""
    elem = result.element_type
    if str(elem) == "i48":
        return _dense_i48(value, result)
    storage = _STORAGE[str(elem)]
    exact = storage if storage.is_floating_point or storage == torch.bool else torch.int64  # before the fit check
    data = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=exact)
    if (target.active() is not None and not storage.is_floating_point and storage != torch.bool and data.numel()
            and not (data.dtype.is_floating_point or data.dtype.is_complex)):
        info = torch.iinfo(storage)
        if data.min() < info.min or data.max() > info.max:
            raise Unsupported(f"a constant with values in [{data.min()}, {data.max()}] does not fit {elem} "
                              f"(int64 is held as i32 under {target.active()}, which has no int64)")
    data = data.to(storage)
    if data.numel() == 1:
        item = data.reshape(()).item()
        is_float = isinstance(elem, ir.FloatType)
        attr = ir.FloatAttr.get(elem, float(item)) if is_float else ir.IntegerAttr.get(elem, int(item))
        return ir.DenseElementsAttr.get_splat(result, attr)
    data = data.reshape(result.shape).contiguous()
    if storage == torch.bool:  # i1 data is bit-packed
        bits = np.packbits(data.reshape(-1).numpy(), bitorder="little")
        return ir.DenseElementsAttr.get(bits, type=elem, shape=list(result.shape))
    if storage == torch.bfloat16:  # numpy has no bfloat16: hand over the bits
        data = data.view(torch.int16)
    return ir.DenseElementsAttr.get(data.numpy(), type=elem, shape=list(result.shape))


def _dense_i48(value: Any, result: ir.RankedTensorType) -> ir.DenseElementsAttr:
    """An i48 dense attribute (biases of int16 convolutions: short lists), through its text: the
    bindings take no buffer of 6-byte elements."""
    data = torch.as_tensor(value, dtype=torch.int64).reshape(-1)
    if data.numel() and (data.min() < -(1 << 47) or data.max() >= 1 << 47):
        raise Unsupported(f"a constant with values in [{data.min()}, {data.max()}] does not fit i48")
    if data.numel() == 1:
        return ir.DenseElementsAttr.get_splat(result, ir.IntegerAttr.get(result.element_type, int(data[0])))
    return ir.Attribute.parse(f"dense<{data.reshape(result.shape).tolist()}> : {result}")


class Builder:
    """Creates TOSA ops at the current insertion point and location."""

    def __init__(self, where: str = ""):
        self.where = where  # the spec entry being lowered, for error messages

    def invalid(self, message: str) -> LoweringError:
        """A catalogue check failed: the lowering at `self.where` is wrong."""
        return LoweringError(f"{self.where}: the lowering emits invalid TOSA: {message}")

    def create(self, name: str, operands: Sequence[Tensor | ShapeOperand | ir.Value],
               attrs: dict[str, tuple[str, Any]], shape: Sequence[Dim], dtype: torch.dtype,
               i1: Sequence[int] = (), i1_out: bool = False) -> Tensor:
        """One op with one result of the given shape and dtype."""
        shape = tuple(_dim(s) for s in shape)
        if any(isinstance(s, int) and s < 0 for s in shape):
            raise self.invalid(f"{name} would have the negative shape {list(shape)}")
        aim = target.active()
        if aim is not None:
            conformant = self._for_target(aim, name, operands, attrs, shape, dtype)
            if conformant is not None:
                return conformant
        if name.startswith("tosa."):  # other dialects' ops (tensor.empty) may make empty tensors on purpose
            self.check_nonempty(name, [shape, *(o.shape for o in operands if isinstance(o, Tensor))])
        if (name == "tosa.cast" and dtype == torch.bool and isinstance(operands[0], Tensor)
                and operands[0].dtype.is_floating_point):
            return self.float_to_bool(operands[0])
        if (name == "tosa.cast" and isinstance(operands[0], Tensor)
                and {operands[0].dtype, dtype} == {torch.float16, torch.bfloat16}):
            # tosa-to-linalg makes an invalid arith.truncf of a cast between the two 16-bit
            # floats; through f32 (exact) it rounds once, as torch converts them
            operands = [self.create("tosa.cast", operands, {}, operands[0].shape, torch.float32)]
        if (any(isinstance(o, ShapeOperand) and not is_static(o.dims) for o in operands)
                or (name == "tosa.const" and (not is_static(shape) or _made_at_run_time(attrs["values"][1])))
                # tosa-to-linalg's tile of a symbolic shape reshapes with several -1 (invalid)
                or (name == "tosa.tile" and not is_static(operands[0].shape))):
            return self._dynamic(name, operands, attrs, shape, dtype)
        values = []
        for i, operand in enumerate(operands):
            if isinstance(operand, Tensor):
                values.append(self.to_i1(operand) if i in i1 else operand.value)
            elif isinstance(operand, ShapeOperand):
                values.append(self._const_shape(operand.dims))
            else:
                values.append(operand)
        result = tensor_type(shape, dtype, i1_out)
        first = next((o for o in operands if isinstance(o, Tensor)), None)
        elem = element_type(first.dtype) if first is not None else result.element_type
        op = ir.Operation.create(name, results=[result], operands=values,
                                 attributes={k: _attr(kind, v, elem, result) for k, (kind, v) in attrs.items()})
        out = Tensor(op.result, shape, dtype)
        if aim is not None and dtype == torch.int64 and aim.narrows_int64:
            self._check_narrowed(aim, name, out)
        return self.from_i1(out) if i1_out and dtype == torch.bool else out

    def _for_target(self, aim: target.Target, name: str, operands: Sequence[Tensor | ShapeOperand | ir.Value],
                    attrs: dict[str, tuple[str, Any]], shape: tuple[Dim, ...], dtype: torch.dtype) -> Tensor | None:
        """What a TOSA target changes: only TOSA ops; casts between types held alike vanish; an
        integer clamp of a type the target's CLAMP lacks (`Target.clamp_types`) is a maximum and a
        minimum. None: create as usual."""
        if name == "tensor.empty":  # a zero-element result nothing uses (the importer checks)
            return Tensor(None, shape, dtype)
        if not name.startswith("tosa."):
            raise Unsupported(f"{self.where}: emits {name}, which is not TOSA (target {aim})")
        if not is_static(shape) or any(isinstance(o, Tensor) and not is_static(o.shape) for o in operands):
            raise Unsupported(f"{self.where}: {name} of symbolic shape: a TOSA target needs static shapes")
        if name == "tosa.const" and _made_at_run_time(attrs["values"][1]):
            raise Unsupported(f"{self.where}: a constant computed from symbolic sizes: a TOSA target needs "
                              "static values")
        first = operands[0] if operands else None
        if dtype == torch.bool and name in _BOOL_FORMS:
            return self.create(_BOOL_FORMS[name], operands, {k: v for k, v in attrs.items() if k == "axis"},
                               shape, dtype)
        if dtype == torch.bool and name in _BOOL_AS_I8:
            moved = [self.create("tosa.cast", [o], {}, o.shape, torch.int8)
                     if isinstance(o, Tensor) and o.dtype == torch.bool else o for o in operands]
            out = self.create(name, moved, attrs, shape, torch.int8)
            return self.create("tosa.cast", [out], {}, shape, torch.bool)
        if name == "tosa.pad" and len(shape) > 3:
            return self._pad_low_rank(first, operands[1].dims, operands[2], shape)
        if name == "tosa.cast" and isinstance(first, Tensor):
            if element_type(first.dtype) == element_type(dtype):
                return Tensor(first.value, shape, dtype)
            if first.dtype == torch.bool and dtype.is_floating_point:  # TOSA casts bools to integers only
                one, zero = (self.constant(v, dtype, [1] * len(shape)) for v in (1, 0))
                return self.create("tosa.select", [first, one, zero], {}, shape, dtype)
        if (name == "tosa.clamp" and isinstance(first, Tensor) and not first.dtype.is_floating_point
                and str(element_type(first.dtype)) not in aim.clamp_types):
            # a bound beyond what the storage type holds (int64's max for an int64 held in i32,
            # whose values provably fit) changes nothing: that side is left out
            bits = ir.IntegerType(element_type(first.dtype)).width
            lowest, highest = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
            out = first
            if attrs["min_val"][1] > lowest:
                low = self.constant(attrs["min_val"][1], dtype, [1] * len(shape))
                out = self.create("tosa.maximum", [out, low], {}, shape, dtype)
            if attrs["max_val"][1] < highest:
                high = self.constant(attrs["max_val"][1], dtype, [1] * len(shape))
                out = self.create("tosa.minimum", [out, high], {}, shape, dtype)
            return out if out is not first else Tensor(first.value, shape, dtype)
        return None

    def _pad_low_rank(self, t: Tensor, padding: Sequence[int], pad_const: ir.Value,
                      shape: tuple[int, ...]) -> Tensor | None:
        """tosa.pad of rank > 3 as a pad of rank <= 3: unpadded unit dims dropped and neighbouring
        unpadded dims merged; None if that leaves more than 3 dims. (MLIR's level check counts the
        2 * rank padding values of a pad of rank 4 against MAX_RANK = 6.)"""
        groups: list[list[int]] = []  # dims merged into each dim of the low-rank pad
        for d in range(t.rank):
            padded = _is_padded(padding, d)
            if not padded and t.shape[d] == 1:
                continue
            if not padded and groups and not _is_padded(padding, groups[-1][-1]):
                groups[-1].append(d)
            else:
                groups.append([d])
        if len(groups) > 3 or not groups:
            return None
        low = [math.prod(t.shape[d] for d in g) for g in groups]
        amounts = [v for g in groups for v in (padding[2 * g[0]], padding[2 * g[0] + 1])]
        padded = tuple(n + amounts[2 * i] + amounts[2 * i + 1] for i, n in enumerate(low))
        flat = self.reshape(t, low)
        out = self.create("tosa.pad", [flat, self.const_shape(amounts), pad_const], {}, padded, t.dtype)
        return self.reshape(out, shape)

    def _regroup(self, t: Tensor, groups: symbolic.Groups, shape: tuple[Dim, ...], dtype: torch.dtype) -> Tensor:
        """`t` reshaped to `shape` by its `groups` (`symbolic.reassociation`): tensor.collapse_shape
        where each group ends in one dim, expand_shape where each starts from one, else the one
        after the other. Unlike tensor.reshape these are views that elementwise fusion moves
        through (an attention's heads stay in its matmuls' loops, as with static sizes)."""
        value = t.value
        expands = any(len(target) > 1 for _, target in groups)
        if any(len(source) > 1 for source, _ in groups):
            collapsed = shape if not expands else tuple(
                math.prod((symbolic.expr(t.shape[i]) for i in source), start=sympy.Integer(1)) for source, _ in groups)
            value = ir.Operation.create("tensor.collapse_shape", results=[tensor_type(collapsed, dtype)],
                                        operands=[value],
                                        attributes={"reassociation": _groups_attr(source for source, _ in groups)}
                                        ).result
        if expands:
            dynamic = ir.ShapedType.get_dynamic_size()
            value = ir.Operation.create(
                "tensor.expand_shape", results=[tensor_type(shape, dtype)],
                operands=[value, *(self.index(d) for d in shape if static(d) is None)],
                attributes={"reassociation": _groups_attr(target for _, target in groups),
                            "static_output_shape": ir.DenseI64ArrayAttr.get(
                                [dynamic if static(d) is None else static(d) for d in shape])}).result
        return Tensor(value, shape, dtype)

    def _check_narrowed(self, aim: target.Target, name: str, out: Tensor) -> None:
        """An int64 value held in i32 must provably fit it."""
        b = bounds.of(out.value, target.memo())
        if not bounds.fits(b):
            known = "unbounded" if b is None else f"in [{b[0]}, {b[1]}]"
            raise Unsupported(f"{self.where}: {name} makes int64 values ({known}) that may not fit int32, and "
                              f"{aim} has no int64; int64 inputs are taken as int32 values. Use a target with "
                              "int64 (TOSA-1.1+...+int64) or int32 in the model")

    def _dynamic(self, name: str, operands: Sequence[Tensor | ShapeOperand | ir.Value],
                 attrs: dict[str, tuple[str, Any]], shape: tuple[Dim, ...], dtype: torch.dtype) -> Tensor:
        """A TOSA op whose shape operand or constant result has symbolic sizes, in the tensor and
        linalg dialects (upstream's tosa-to-tensor makes the same ops of static ones)."""
        if name == "tosa.reshape":
            source, new = operands[0], operands[1].dims
            if tuple(new) == tuple(source.shape):  # to its own sizes (a view in a decomposition)
                return source
            dynamic = [i for i, d in enumerate(new) if static(d) is None]
            if len(dynamic) == 1:  # TOSA's reshape infers one size (-1)
                dims = [-1 if i == dynamic[0] else d for i, d in enumerate(new)]
                op = ir.Operation.create("tosa.reshape", results=[tensor_type(shape, dtype)],
                                         operands=[source.value, self._const_shape(dims)])
                return Tensor(op.result, shape, dtype)
            groups = symbolic.reassociation(source.shape, new)
            # memref.expand_shape's lowering (expand-strided-metadata) takes at most one dynamic
            # size per group (it asserts otherwise: the process aborts)
            if groups is not None and all(sum(static(new[i]) is None for i in target) <= 1 for _, target in groups):
                return self._regroup(source, groups, tuple(new), dtype)
            sizes = [self.index(d) for d in new]
            kind = ir.RankedTensorType.get([len(new)], ir.IndexType.get())
            spec = ir.Operation.create("tensor.from_elements", results=[kind], operands=sizes).result
            op = ir.Operation.create("tensor.reshape", results=[tensor_type(shape, dtype)],
                                     operands=[source.value, spec])
            return Tensor(op.result, shape, dtype)
        if name == "tosa.slice":
            source, start, size = operands[0], operands[1].dims, operands[2].dims
            return self._extract_slice(source, start, size)
        if name == "tosa.pad":
            return self._pad(operands[0], operands[1].dims, operands[2], shape)
        if name == "tosa.tile":
            source, multiples = operands[0], operands[1].dims
            if any(static(m) != 1 and static(s) != 1 for s, m in zip(source.shape, multiples, strict=True)):
                raise Unsupported(f"{self.where}: tosa.tile of {symbolic.show(source.shape)} by the symbolic "
                                  f"multiples {symbolic.show(multiples)}")
            return self.broadcast_to(source, shape)
        if name == "tosa.const":
            value = attrs["values"][1]
            if isinstance(value, Range):
                return self._range(value, shape, dtype)
            if _sized(value):  # a number computed from sizes (1 / count): made at run time
                value = value[0] if isinstance(value, list | tuple) else value
                scalar = symbolic.current().scalar(value, element_type(dtype))
                one = tensor_type([1] * len(shape), dtype)
                splat = ir.Operation.create("tensor.from_elements", results=[one],
                                            operands=[scalar] * math.prod(one.shape)).result
                return self.broadcast_to(Tensor(splat, (1,) * len(shape), dtype), shape)
            if isinstance(value, torch.Tensor | list | tuple) and torch.as_tensor(value).numel() != 1:
                raise Unsupported(f"{self.where}: a constant of symbolic shape {symbolic.show(shape)} "
                                  "that is not one value repeated")
            one = self.create("tosa.const", [], attrs, [1] * len(shape), dtype)
            return self.broadcast_to(one, shape)
        raise Unsupported(f"{self.where}: {name} with the symbolic shape operand "
                          f"{[symbolic.show(o.dims) for o in operands if isinstance(o, ShapeOperand)]}")

    def _range(self, values: Range, shape: tuple[Dim, ...], dtype: torch.dtype) -> Tensor:
        """An arange computed by the code (`Range`): start + i * step for each i of the 1-D
        `shape`, as a linalg.generic; in int64, then `dtype`'s width, or for floats (static
        bounds) in double, as `rules.arange_values` computes a constant's values, then rounded
        once to `dtype`."""
        i64 = ir.IntegerType.get_signless(64)
        wide = ir.F64Type.get() if dtype.is_floating_point else i64
        if dtype.is_floating_point:
            start, step = arith.constant(wide, float(values.start)), arith.constant(wide, float(values.step))
        else:
            start = (symbolic.current().scalar(values.start, i64) if isinstance(values.start, torch.SymInt)
                     else arith.constant(i64, int(values.start)))
            step = arith.constant(i64, values.step)
        result = tensor_type(shape, dtype)
        parallel = ir.Attribute.parse("#linalg.iterator_type<parallel>")
        identity = ir.AffineMapAttr.get(ir.AffineMap.get_identity(1))
        generic = linalg.GenericOp([result], [], [self.empty(shape, dtype)], ir.ArrayAttr.get([identity]),
                                   ir.ArrayAttr.get([parallel]))
        elem = result.element_type
        body = generic.regions[0].blocks.append(elem)
        with ir.InsertionPoint(body):
            i = arith.index_cast(i64, linalg.IndexOp(0).result)
            if dtype.is_floating_point:
                value = arith.addf(start, arith.mulf(arith.sitofp(wide, i), step))
                linalg.YieldOp([value if elem == wide else arith.truncf(elem, value)])
            else:
                value = arith.addi(start, arith.muli(i, step))
                linalg.YieldOp([value if elem == wide else arith.trunci(elem, value)])
        return Tensor(generic.results[0], shape, dtype)

    def index(self, d: Dim) -> ir.Value:
        """An `index` value of a dim, read from the function's inputs at run time if symbolic."""
        v = static(d)
        if v is not None:
            return ir.Operation.create("arith.constant", results=[ir.IndexType.get()],
                                       attributes={"value": ir.IntegerAttr.get(ir.IndexType.get(), v)}).result
        return symbolic.current().index(d)

    def empty(self, shape: Sequence[Dim], dtype: torch.dtype) -> ir.Value:
        """An uninitialized `tensor.empty` of a shape that may be symbolic."""
        sizes = [self.index(d) for d in shape if static(d) is None]
        return ir.Operation.create("tensor.empty", results=[tensor_type(shape, dtype)], operands=sizes).result

    def broadcast_to(self, t: Tensor, shape: Sequence[Dim]) -> Tensor:
        """`t` (same rank) repeated along its size-1 dims to `shape`, as a linalg.generic."""
        rank = len(shape)
        exprs = [ir.AffineExpr.get_constant(0) if static(s) == 1 and static(d) != 1 else ir.AffineDimExpr.get(i)
                 for i, (s, d) in enumerate(zip(t.shape, shape, strict=True))]
        maps = [ir.AffineMap.get(rank, 0, exprs), ir.AffineMap.get_identity(rank)]
        result = tensor_type(shape, t.dtype)
        parallel = ir.Attribute.parse("#linalg.iterator_type<parallel>")
        generic = linalg.GenericOp([result], [t.value], [self.empty(shape, t.dtype)],
                                   ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps]),
                                   ir.ArrayAttr.get([parallel] * rank))
        elem = result.element_type
        body = generic.regions[0].blocks.append(elem, elem)
        with ir.InsertionPoint(body):
            linalg.YieldOp([body.arguments[0]])
        return Tensor(generic.results[0], tuple(shape), t.dtype)

    def _pad(self, t: Tensor, padding: Sequence[Dim], pad_const: ir.Value, shape: tuple[Dim, ...]) -> Tensor:
        """tosa.pad with symbolic amounts, as tensor.pad (what tosa-to-tensor makes of static ones)."""
        dynamic = ir.ShapedType.get_dynamic_size()
        low, high = padding[0::2], padding[1::2]
        operands = [t.value] + [self.index(d) for d in low if static(d) is None]
        operands += [self.index(d) for d in high if static(d) is None]
        index = ir.IndexType.get()
        zero = ir.Operation.create("arith.constant", results=[index],
                                   attributes={"value": ir.IntegerAttr.get(index, 0)}).result
        elem = element_type(t.dtype)
        value = ir.Operation.create("tensor.extract", results=[elem], operands=[pad_const, zero]).result
        op = ir.Operation.create(
            "tensor.pad", results=[tensor_type(shape, t.dtype)], operands=operands, regions=1,
            attributes={"static_low": ir.DenseI64ArrayAttr.get([dynamic if static(d) is None else static(d)
                                                                for d in low]),
                        "static_high": ir.DenseI64ArrayAttr.get([dynamic if static(d) is None else static(d)
                                                                 for d in high]),
                        "operandSegmentSizes": ir.DenseI32ArrayAttr.get(
                            [1, sum(static(d) is None for d in low), sum(static(d) is None for d in high)])})
        body = op.regions[0].blocks.append(*([index] * t.rank))
        with ir.InsertionPoint(body):
            ir.Operation.create("tensor.yield", operands=[value])
        return Tensor(op.result, shape, t.dtype)

    def _extract_slice(self, t: Tensor, start: Sequence[Dim], size: Sequence[Dim]) -> Tensor:
        dynamic = ir.ShapedType.get_dynamic_size()
        offsets = [self.index(d) for d in start if static(d) is None]
        sizes = [self.index(d) for d in size if static(d) is None]
        static_offsets = [dynamic if static(d) is None else static(d) for d in start]
        static_sizes = [dynamic if static(d) is None else static(d) for d in size]
        op = ir.Operation.create(
            "tensor.extract_slice", results=[tensor_type(size, t.dtype)], operands=[t.value, *offsets, *sizes],
            attributes={"static_offsets": ir.DenseI64ArrayAttr.get(static_offsets),
                        "static_sizes": ir.DenseI64ArrayAttr.get(static_sizes),
                        "static_strides": ir.DenseI64ArrayAttr.get([1] * len(size)),
                        "operandSegmentSizes": ir.DenseI32ArrayAttr.get([1, len(offsets), len(sizes), 0])})
        return Tensor(op.result, tuple(size), t.dtype)

    def check_nonempty(self, name: str, shapes: Sequence[Sequence[Dim]]) -> None:
        """TOSA has no zero-size tensors: an op on one is valid PyTorch that is not lowered."""
        for shape in shapes:
            if any(static(d) == 0 for d in shape):
                raise Unsupported(f"{self.where}: {name} on a zero-size tensor {symbolic.show(shape)}: "
                                  "TOSA has no empty tensors")

    def float_to_bool(self, t: Tensor) -> Tensor:
        """x != 0 as not(x == 0) (NaN is true): MLIR's folder of a float -> i1 tosa.cast
        turns every constant into false (full_like(x, 2.0).any() was False)."""
        zero = self.constant(0.0, t.dtype, [1] * t.rank)
        i1 = tensor_type(t.shape, torch.bool, True)
        eq = ir.Operation.create("tosa.equal", results=[i1], operands=[t.value, zero.value]).result
        ne = ir.Operation.create("tosa.logical_not", results=[i1], operands=[eq]).result
        return self.from_i1(Tensor(ne, t.shape, torch.bool))

    def to_i1(self, t: Tensor) -> ir.Value:
        if t.dtype != torch.bool or _bool_is_i1():
            return t.value
        op = ir.Operation.create("tosa.cast", results=[tensor_type(t.shape, t.dtype, True)], operands=[t.value])
        return op.result

    def from_i1(self, t: Tensor) -> Tensor:
        if _bool_is_i1():
            return t
        op = ir.Operation.create("tosa.cast", results=[tensor_type(t.shape, t.dtype)], operands=[t.value])
        return Tensor(op.result, t.shape, t.dtype)

    def const_shape(self, dims: Sequence[Dim]) -> ShapeOperand:
        """A `!tosa.shape<n>` operand for reshape, tile, slice and pad."""
        return ShapeOperand(tuple(_dim(d) for d in dims))

    def _const_shape(self, dims: Sequence[int]) -> ir.Value:
        dims = [int(d) for d in dims]
        shape_type = ir.Type.parse(f"!tosa.shape<{len(dims)}>")
        index = ir.IndexType.get()
        kind = ir.RankedTensorType.get([len(dims)], index)
        if dims:
            values = ir.DenseElementsAttr.get([ir.IntegerAttr.get(index, d) for d in dims], type=kind)
        else:
            values = ir.Attribute.parse("dense<> : tensor<0xindex>")
        return ir.Operation.create("tosa.const_shape", results=[shape_type], attributes={"values": values}).result

    def scalar(self, value: float | int, dtype: torch.dtype) -> ir.Value:
        """A `tensor<1xT>` constant: zero points, shift and pad values."""
        result = tensor_type([1], dtype)
        return ir.Operation.create("tosa.const", results=[result], attributes={"values": dense(value, result)}).result

    def zero_point(self, t: Tensor) -> ir.Value:
        return self.scalar(0, t.dtype)

    def constant(self, value: Any, dtype: torch.dtype, shape: Sequence[Dim] = ()) -> Tensor:
        """A constant tensor: a scalar splat, a flat list, or a torch tensor's data."""
        self.check_nonempty("tosa.const", [shape])
        if not is_static(shape):
            return self.create("tosa.const", [], {"values": ("dense", value)}, shape, dtype)
        result = tensor_type(shape, dtype)
        op = ir.Operation.create("tosa.const", results=[result], attributes={"values": dense(value, result)})
        return Tensor(op.result, tuple(shape), dtype)

    def wrap_number(self, value: bool | int | float) -> Tensor:
        """A Python number passed where aten takes a Tensor, as torch wraps it: a rank-0
        f64, i64 or bool constant that type promotion treats as a scalar."""
        t = self.constant(value, wrapped_dtype(value))
        return Tensor(t.value, t.shape, t.dtype, wrapped=True)

    def argument(self, value: Any, schema_arg: Any) -> Any:
        """An aten argument as a lowering takes it: a number in a Tensor slot is wrapped (a
        symbolic size too, computed from the inputs' shapes at run time)."""
        if schema_arg.type.str() in ("Tensor", "Tensor?"):
            if isinstance(value, torch.SymInt) and static(value) is None:
                return self.wrap_size(value)
            if isinstance(value, bool | int | float | torch.SymInt):
                return self.wrap_number(value if isinstance(value, bool | float) else int(value))
        return value

    def wrap_size(self, d: torch.SymInt) -> Tensor:
        """A symbolic size where aten takes a Tensor: a rank-0 i64 tensor holding it."""
        i64 = ir.IntegerType.get_signless(64)
        value = ir.Operation.create("arith.index_cast", results=[i64], operands=[self.index(d)]).result
        op = ir.Operation.create("tensor.from_elements", results=[tensor_type((), torch.int64)], operands=[value])
        return Tensor(op.result, (), torch.int64, wrapped=True)

    def reshape(self, t: Tensor, shape: Sequence[Dim]) -> Tensor:
        shape = tuple(_dim(s) for s in shape)
        if same_shape(shape, t.shape):
            return t
        return self.create("tosa.reshape", [t, self.const_shape(shape)], {}, shape, t.dtype)

    def equal_rank(self, *ts: Tensor) -> list[Tensor]:
        """Reshape lower-rank operands with leading 1s, as TOSA's binary ops need."""
        rank = max(t.rank for t in ts)
        out = [self.reshape(t, (1,) * (rank - t.rank) + t.shape) for t in ts]
        for dims in zip(*(t.shape for t in out), strict=True):
            sizes = [d for d in dims if static(d) != 1]
            # not broadcastable: the entry's rules let a bad case through
            if any(not symbolic.same(d, sizes[0], guard=True) for d in sizes[1:]):
                raise self.invalid(f"operands of shapes {[list(t.shape) for t in ts]} do not broadcast")
        return out

    def results(self, values: Sequence[Tensor], types: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[Tensor]:
        """Check the emitted results against the entry's own shape and dtype rules."""
        for i, (t, (shape, dtype)) in enumerate(zip(values, types, strict=True)):
            if not same_shape(t.shape, tuple(shape), guard=True) or t.dtype != dtype:
                raise self.invalid(f"result {i} is {_show(t.shape, t.dtype)} but the shape/dtype rules say "
                                   f"{_show(shape, dtype)}")
        return list(values)


# Under a target bools are i1, which TOSA's max/min ops don't take: their logical forms.
_BOOL_FORMS = {"tosa.reduce_max": "tosa.reduce_any", "tosa.reduce_min": "tosa.reduce_all",
               "tosa.maximum": "tosa.logical_or", "tosa.minimum": "tosa.logical_and"}


# TOSA's data movement and pooling ops take no bools: through i8 (pro_int).
_BOOL_AS_I8 = {"tosa.gather", "tosa.scatter", "tosa.max_pool2d"}


def _is_padded(padding: Sequence[int], d: int) -> bool:
    return bool(padding[2 * d] or padding[2 * d + 1])


def _bool_is_i1() -> bool:
    """Under a TOSA target bools live as i1 (no casts to and from i8)."""
    return target.active() is not None


@dataclass(frozen=True)
class Range:
    """A constant's values that the program computes (`rules.arange_values`, `Builder._range`):
    start + i * step, an arange between symbolic sizes (`start` an int or a SymInt) or a long one
    (ints, or floats computed in double)."""

    start: Any
    step: int | float


def _sized(value: Any) -> bool:
    """A constant's value that is a symbolic number (computed from symbolic sizes), alone or in a
    one-element list."""
    if isinstance(value, list | tuple) and len(value) == 1:
        value = value[0]
    return isinstance(value, torch.SymInt | torch.SymFloat)


def _made_at_run_time(value: Any) -> bool:
    """A constant's value the program computes: a symbolic number (`_sized`) or an arange
    between symbolic sizes (`Range`)."""
    return _sized(value) or isinstance(value, Range)


def _show(shape: Sequence[Dim], dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}{symbolic.show(shape)}"


def _dim(d: Any) -> Dim:
    """A dim as Tensor.shape keeps it: an int, or a SymInt whose value is not known yet."""
    if isinstance(d, torch.SymInt):
        v = static(d)
        return d if v is None else v
    return int(d)
