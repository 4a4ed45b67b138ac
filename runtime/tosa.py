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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from mlir import ir

from .errors import LoweringError, Unsupported

_ELEMENT = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.bool: "i8",
}


def element_type(dtype: torch.dtype, i1: bool = False) -> ir.Type:
    """The MLIR element type a torch dtype lives in (bool as i8 unless `i1`)."""
    if i1 and dtype == torch.bool:
        return ir.IntegerType.get_signless(1)
    if dtype not in _ELEMENT:
        raise Unsupported(f"dtype {dtype} has no TOSA element type; supported: "
                          + ", ".join(str(d).removeprefix("torch.") for d in _ELEMENT))
    return ir.Type.parse(_ELEMENT[dtype])


def element_dtypes() -> frozenset[torch.dtype]:
    """The torch dtypes that have a TOSA element type."""
    return frozenset(_ELEMENT)


def wrapped_dtype(value: bool | int | float) -> torch.dtype:
    """The dtype torch gives a Python number passed where aten takes a Tensor."""
    return torch.bool if isinstance(value, bool) else torch.int64 if isinstance(value, int) else torch.float64


def tensor_type(shape: Sequence[int], dtype: torch.dtype, i1: bool = False) -> ir.RankedTensorType:
    return ir.RankedTensorType.get(list(shape), element_type(dtype, i1))


Layout = tuple[tuple[int, ...], int, int]  # (strides, storage offset, storage size), in elements


@dataclass(frozen=True)
class Tensor:
    """An SSA tensor value with the shape and dtype the rules see."""

    value: ir.Value
    shape: tuple[int, ...]
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
    "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
    "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8,
}


def dense(value: Any, result: ir.RankedTensorType) -> ir.DenseElementsAttr:
    """A dense attribute of `result`'s type from a scalar (splat), a list or a tensor.

    Non-splat data goes through one buffer copy (numpy), not one attribute per element."""
    elem = result.element_type
    storage = _STORAGE[str(elem)]
    data = value.detach() if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=storage)
    data = data.to(storage)
    if data.numel() == 1:
        item = data.reshape(()).item()
        is_float = isinstance(elem, ir.FloatType)
        attr = ir.FloatAttr.get(elem, float(item)) if is_float else ir.IntegerAttr.get(elem, int(item))
        return ir.DenseElementsAttr.get_splat(result, attr)
    data = data.reshape(result.shape).contiguous()
    if storage == torch.bfloat16:  # numpy has no bfloat16: hand over the bits
        data = data.view(torch.int16)
    return ir.DenseElementsAttr.get(data.numpy(), type=elem, shape=list(result.shape))


class Builder:
    """Creates TOSA ops at the current insertion point and location."""

    def __init__(self, where: str = ""):
        self.where = where  # the spec entry being lowered, for error messages

    def invalid(self, message: str) -> LoweringError:
        """A catalogue check failed: the lowering at `self.where` is wrong."""
        return LoweringError(f"{self.where}: the lowering emits invalid TOSA: {message}")

    def create(self, name: str, operands: Sequence[Tensor | ir.Value], attrs: dict[str, tuple[str, Any]],
               shape: Sequence[int], dtype: torch.dtype, i1: Sequence[int] = (), i1_out: bool = False) -> Tensor:
        """One op with one result of the given shape and dtype."""
        shape = tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise self.invalid(f"{name} would have the negative shape {list(shape)}")
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
        values = []
        for i, operand in enumerate(operands):
            if isinstance(operand, Tensor):
                values.append(self.to_i1(operand) if i in i1 else operand.value)
            else:
                values.append(operand)
        result = tensor_type(shape, dtype, i1_out)
        first = next((o for o in operands if isinstance(o, Tensor)), None)
        elem = element_type(first.dtype) if first is not None else result.element_type
        op = ir.Operation.create(name, results=[result], operands=values,
                                 attributes={k: _attr(kind, v, elem, result) for k, (kind, v) in attrs.items()})
        out = Tensor(op.result, shape, dtype)
        return self.from_i1(out) if i1_out and dtype == torch.bool else out

    def check_nonempty(self, name: str, shapes: Sequence[Sequence[int]]) -> None:
        """TOSA has no zero-size tensors: an op on one is valid PyTorch that is not lowered."""
        for shape in shapes:
            if 0 in shape:
                raise Unsupported(f"{self.where}: {name} on a zero-size tensor {list(shape)}: "
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
        if t.dtype != torch.bool:
            return t.value
        op = ir.Operation.create("tosa.cast", results=[tensor_type(t.shape, t.dtype, True)], operands=[t.value])
        return op.result

    def from_i1(self, t: Tensor) -> Tensor:
        op = ir.Operation.create("tosa.cast", results=[tensor_type(t.shape, t.dtype)], operands=[t.value])
        return Tensor(op.result, t.shape, t.dtype)

    def const_shape(self, dims: Sequence[int]) -> ir.Value:
        """A `!tosa.shape<n>` value for reshape, tile, slice and pad."""
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

    def constant(self, value: Any, dtype: torch.dtype, shape: Sequence[int] = ()) -> Tensor:
        """A constant tensor: a scalar splat, a flat list, or a torch tensor's data."""
        self.check_nonempty("tosa.const", [shape])
        result = tensor_type(shape, dtype)
        op = ir.Operation.create("tosa.const", results=[result], attributes={"values": dense(value, result)})
        return Tensor(op.result, tuple(shape), dtype)

    def wrap_number(self, value: bool | int | float) -> Tensor:
        """A Python number passed where aten takes a Tensor, as torch wraps it: a rank-0
        f64, i64 or bool constant that type promotion treats as a scalar."""
        t = self.constant(value, wrapped_dtype(value))
        return Tensor(t.value, t.shape, t.dtype, wrapped=True)

    def argument(self, value: Any, schema_arg: Any) -> Any:
        """An aten argument as a lowering takes it: a number in a Tensor slot is wrapped."""
        if schema_arg.type.str() in ("Tensor", "Tensor?") and isinstance(value, bool | int | float):
            return self.wrap_number(value)
        return value

    def reshape(self, t: Tensor, shape: Sequence[int]) -> Tensor:
        shape = tuple(int(s) for s in shape)
        if shape == t.shape:
            return t
        return self.create("tosa.reshape", [t, self.const_shape(shape)], {}, shape, t.dtype)

    def equal_rank(self, *ts: Tensor) -> list[Tensor]:
        """Reshape lower-rank operands with leading 1s, as TOSA's binary ops need."""
        rank = max(t.rank for t in ts)
        out = [self.reshape(t, (1,) * (rank - t.rank) + t.shape) for t in ts]
        for dims in zip(*(t.shape for t in out), strict=True):
            if len(set(dims) - {1}) > 1:  # not broadcastable: the entry's rules let a bad case through
                raise self.invalid(f"operands of shapes {[list(t.shape) for t in ts]} do not broadcast")
        return out

    def results(self, values: Sequence[Tensor], types: Sequence[tuple[Sequence[int], torch.dtype]]) -> list[Tensor]:
        """Check the emitted results against the entry's own shape and dtype rules."""
        for i, (t, (shape, dtype)) in enumerate(zip(values, types, strict=True)):
            if t.shape != tuple(shape) or t.dtype != dtype:
                raise self.invalid(f"result {i} is {_show(t.shape, t.dtype)} but the shape/dtype rules say "
                                   f"{_show(shape, dtype)}")
        return list(values)


def _show(shape: Sequence[int], dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"
