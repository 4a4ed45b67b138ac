"""TOSA files: a Program written as MLIR text (`.mlir`) or as a TOSA flatbuffer (`.tosa`), and read back.

Both name the function's inputs and outputs with the argument/result attribute `tosa.tensor_name`
(the attribute tosa-opt's serializer reads; `x`, `p_fc_weight`, `output_0`). A tensor whose torch
dtype its MLIR element type doesn't say (a bool held as i8, an int64 held as i32) also carries
`torchtosa.dtype = "bool"` in a `.mlir` file. A flatbuffer has no place for it: `.tosa` tensors
load with the dtype of their TOSA type (int8, int32...). tosa-opt writes and reads `.tosa` files
(`--tosa-serialize`, `--tosa-deserialize`); its deserializer names the function `@main`. Bool
constants are written as lists of true and false (`portable_bools`): their hex form differs
between the MLIR of these bindings and tosa-opt's. A flatbuffer holds the program with its layout
ops simplified (`fold_layout`: exact data movement only), so that consumers such as Arm's Vela
see constant weights in the layout their op reads (docs/vela.md).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import sympy
import torch
from mlir import ir

from ..errors import InvalidFile, ToolError, Unsupported
from ..execute.native import TensorSpec
from ..importer import target
from ..lower import irutil
from ..lower.irutil import find_ops
from ..lower.layout import fold_layout
from . import tosa_tools

if TYPE_CHECKING:
    from ..importer.graph import Program

NAME = "tosa.tensor_name"
DTYPE = "torchtosa.dtype"
SUFFIXES = {".mlir": "MLIR text", ".tosa": "a TOSA flatbuffer"}

# the torch dtype an MLIR element type holds unless `torchtosa.dtype` says otherwise
_DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
    "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "i1": torch.bool,
}


def save(program: Program, path: str | os.PathLike[str]) -> None:
    """Write `program` to `path`: MLIR text if it ends in `.mlir`, a TOSA flatbuffer if `.tosa`."""
    path = Path(path)
    if _suffix(path, "save") == ".mlir":
        path.write_text(annotated(program))
    else:
        serialize(program, path)


def load(path: str | os.PathLike[str]) -> Program:
    """The Program a `.mlir` or `.tosa` file holds: its one public func.func, with the names
    and torch dtypes of its inputs and outputs (a `.tosa` file's from its TOSA types)."""
    path = Path(path)
    suffix = _suffix(path, "load")
    if not path.is_file():
        raise InvalidFile(f"can't load {path}: no such file")
    if suffix == ".mlir":
        return _program(path.read_text(errors="replace"), path)
    with tempfile.TemporaryDirectory(prefix="torchtosa-") as tmp:
        out = Path(tmp) / "program.mlir"
        done = tosa_tools.run("tosa-opt", [f"--tosa-deserialize=tosa-flatbuffer-filename={path.resolve()}",
                                           "-o", out], check=False)
        if done.returncode != 0:
            raise InvalidFile(f"can't load {path}: tosa-opt does not read it as a TOSA flatbuffer\n"
                              + tosa_tools.failure(done))
        return _program(out.read_text(), path)


def annotated(program: Program, distinct: bool = False) -> str:
    """The program's module as MLIR text, the function's inputs and results named (and their
    torch dtypes given where the element type doesn't say them). `program` stays untouched.

    `distinct`: for a flatbuffer: layout ops simplified (`fold_layout`), and every result a
    value of its own, as a flatbuffer needs (it names tensors, not results): a result that is an
    argument or another result is a `tosa.identity` of it."""
    with program.context, ir.Location.unknown():
        module = target.printable(program.module, program.target)
        fn = _function(module, program.name)
        if distinct:
            fold_layout(fn.regions[0].blocks[0])
            _distinct_results(fn)
        signature = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
        for key, names, specs, types in (("arg_attrs", program.input_names, program.inputs, signature.inputs),
                                         ("res_attrs", program.output_names, program.outputs, signature.results)):
            fn.attributes[key] = _attributes(_dicts(fn, key, len(types)), names, specs, types)
        return portable_bools(str(module))


# a bool (i1) tensor constant in hex: MLIR 22 (these bindings) writes and reads one bit per
# element, the newer MLIR of tosa-tools' tosa-opt one byte per element; neither reads the other's
_I1_HEX = re.compile(r'dense<"0x([0-9A-Fa-f]*)">(\s*:\s*tensor<((?:\d+x)*)i1>)')


def portable_bools(text: str) -> str:
    """`text` with each hex i1 constant (of either layout) written as a list of true and false,
    which every MLIR version reads."""

    def literal(m: re.Match[str]) -> str:
        data, shape = bytes.fromhex(m[1]), [int(d) for d in m[3].split("x") if d]
        n = math.prod(shape)
        if len(data) == n:  # a byte per element
            bits = [b != 0 for b in data]
        elif len(data) == (n + 7) // 8:  # a bit per element, the first in the low bit
            bits = [bool(data[i >> 3] >> (i & 7) & 1) for i in range(n)]
        else:
            return m[0]
        words = ["true" if b else "false" for b in bits]
        for size in reversed(shape[1:]):
            words = ["[" + ", ".join(words[i:i + size]) + "]" for i in range(0, len(words), size)]
        return f"dense<[{', '.join(words)}]>{m[2]}"

    return _I1_HEX.sub(literal, text)


def serialize(program: Program, path: Path) -> None:
    """Write the program as a TOSA flatbuffer with tosa-opt: TOSA ops only, no f64."""
    with program.context:
        ops = find_ops(_function(program.module, program.name), lambda op: True)
        other = sorted({op.name for op in ops if not op.name.startswith("tosa.")} - {"func.func", "func.return"})
        f64 = any(isinstance(v.type, ir.ShapedType) and str(v.type.element_type) == "f64"
                  for op in ops for v in [*op.operands, *op.results])
    if other:
        raise Unsupported(f"can't write {path.name}: the program has ops that are not TOSA ({', '.join(other)}; "
                          "program.report() says which registry lowered each aten op); save it as .mlir instead")
    if f64:
        raise Unsupported(f"can't write {path.name}: the program computes in float64, which TOSA has not "
                          "(tosa-opt would write it as float32); save it as .mlir or convert the model to float32")
    with tempfile.TemporaryDirectory(prefix="torchtosa-") as tmp:
        source, out = Path(tmp) / "program.mlir", Path(tmp) / "program.tosa"
        source.write_text(annotated(program, distinct=True))
        tosa_tools.run("tosa-opt", [f"--tosa-serialize=tosa-flatbuffer-filename={out} "
                                    "retain-graph-input-output-names", source, "-o", Path(tmp) / "echo.mlir"])
        if not out.is_file():
            raise ToolError(f"tosa-opt --tosa-serialize wrote no flatbuffer for {path.name}")
        shutil.move(out, path)


def _distinct_results(fn: ir.OpView) -> None:
    """Return a `tosa.identity` of each result that is an argument or an earlier result."""
    ret = fn.regions[0].blocks[0].operations[-1]
    seen: set[ir.Value] = set()
    for i, value in enumerate(list(ret.operands)):
        if isinstance(value, ir.BlockArgument) or value in seen:
            with ir.InsertionPoint(ret):
                ret.operands[i] = ir.Operation.create("tosa.identity", results=[value.type], operands=[value]).result
        seen.add(value)


def element_types(program: Program) -> tuple[list[str], list[str]]:
    """The MLIR element types of the function's inputs and results: (["f32", "i32"], ["f32"])."""
    with program.context:
        fn = _function(program.module, program.name)
        signature = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
        return [str(t.element_type) for t in signature.inputs], [str(t.element_type) for t in signature.results]


def _suffix(path: Path, verb: str) -> str:
    if path.suffix not in SUFFIXES:
        kinds = ", ".join(f"{s} ({kind})" for s, kind in SUFFIXES.items())
        raise InvalidFile(f"can't {verb} {path}: torchtosa's files end in {kinds}")
    return path.suffix


def _function(module: ir.Module, name: str | None) -> ir.OpView:
    """The func.func called `name` (None: the one public function) of `module`."""
    funcs = [op for op in module.body.operations if op.operation.name == "func.func"]
    if name is not None:
        found = [op for op in funcs if ir.StringAttr(op.attributes["sym_name"]).value == name]
    else:
        found = [op for op in funcs if "sym_visibility" not in op.attributes]
    if len(found) != 1:
        names = [ir.StringAttr(op.attributes["sym_name"]).value for op in funcs]
        wanted = f"func.func @{name}" if name else "one public func.func"
        raise InvalidFile(f"the module has no {wanted} (its functions: {names or 'none'})")
    return found[0]


def _dicts(fn: ir.OpView, key: str, count: int) -> list[dict[str, ir.Attribute]]:
    """The attributes of each argument (`arg_attrs`) or result (`res_attrs`) of a function."""
    if key not in fn.attributes:
        return [{} for _ in range(count)]
    dicts = [ir.DictAttr(a) for a in ir.ArrayAttr(fn.attributes[key])]
    return [{a.name: a.attr for a in (d[j] for j in range(len(d)))} for d in dicts]


def _attributes(old: list[dict[str, ir.Attribute]], names: list[str], specs: list[TensorSpec],
                types: list[ir.Type]) -> ir.ArrayAttr:
    """The attributes `old` of each argument or result with its name, and its torch dtype where
    the element type does not say it."""
    dicts = []
    for attrs, name, spec, t in zip(old, names, specs, types, strict=True):
        attrs = {**attrs, NAME: ir.StringAttr.get(name)}
        if _DTYPES.get(str(t.element_type)) != spec.dtype:
            attrs[DTYPE] = ir.StringAttr.get(str(spec.dtype).removeprefix("torch."))
        dicts.append(ir.DictAttr.get(attrs))
    return ir.ArrayAttr.get(dicts)


def _program(text: str, path: Path) -> Program:
    """The Program of a module's text; names and dtype attributes move into the Program."""
    from ..importer.graph import Program

    context = irutil.context()
    with context, ir.Location.unknown():
        try:
            module = ir.Module.parse(portable_bools(text))
        except ir.MLIRError as err:
            raise InvalidFile(f"can't load {path}: it is not an MLIR module ({err})") from None
        try:
            fn = _function(module, None)
        except InvalidFile as err:
            raise InvalidFile(f"can't load {path}: {err}") from None
        signature = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
        symbols = (sympy.Symbol(f"s{i}", integer=True, positive=True) for i in itertools.count())
        inputs, input_names = _specs(fn, "arg_attrs", signature.inputs, "input", symbols, path)
        outputs, output_names = _specs(fn, "res_attrs", signature.results, "output", symbols, path)
        name = ir.StringAttr(fn.attributes["sym_name"]).value
        try:
            aim = target.restore(module)
        except ValueError as err:
            raise InvalidFile(f"can't load {path}: {err}") from None
    return Program(module, context, inputs, outputs, name=name, arguments=list(range(len(inputs))),
                   input_names=input_names, output_names=output_names, target=aim)


def _specs(fn: ir.OpView, key: str, types: list[ir.Type], kind: str, symbols: Iterator[sympy.Symbol],
           path: Path) -> tuple[list[TensorSpec], list[str]]:
    """The TensorSpecs and names of a function's arguments or results, read from (and then
    removed from) its `arg_attrs`/`res_attrs`; a `?` dim becomes a fresh size symbol."""
    specs, names, kept = [], [], []
    for i, (attrs, t) in enumerate(zip(_dicts(fn, key, len(types)), types, strict=True)):
        if not isinstance(t, ir.RankedTensorType):
            raise InvalidFile(f"can't load {path}: {kind} {i} is a {t}, not a ranked tensor")
        element = str(t.element_type)
        dtype = _DTYPES.get(element)
        if DTYPE in attrs:
            dtype = getattr(torch, ir.StringAttr(attrs[DTYPE]).value, None)
            if not isinstance(dtype, torch.dtype):
                raise InvalidFile(f"can't load {path}: {kind} {i} has {DTYPE} = {attrs[DTYPE]}, not a torch dtype")
        if dtype is None:
            raise InvalidFile(f"can't load {path}: {kind} {i} has element type {element}, which torchtosa "
                              "has no torch dtype for")
        shape = [next(symbols) if t.is_dynamic_dim(d) else t.get_dim_size(d) for d in range(t.rank)]
        specs.append(TensorSpec(tuple(shape), dtype))
        names.append(ir.StringAttr(attrs[NAME]).value if NAME in attrs else f"{kind}_{i}")
        kept.append({k: v for k, v in attrs.items() if k not in (NAME, DTYPE)})
    if any(kept):
        fn.attributes[key] = ir.ArrayAttr.get([ir.DictAttr.get(k) for k in kept])
    elif key in fn.attributes:
        del fn.attributes[key]
    return specs, names
