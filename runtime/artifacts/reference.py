"""Run a Program on TOSA's reference model (`tosa_reference_model` of tosa-tools).

The program is serialized to a TOSA flatbuffer, each input written as a `.npy` file of its
MLIR element type, and a test descriptor (JSON: the flatbuffer, input and output names and
files) tells the model what to read; it evaluates the graph with the TOSA specification's
semantics and writes one `.npy` per output, read back as torch tensors of the program's dtypes.
It checks the graph at its default TOSA level (EIGHTK: rank <= 6...) and stops at the first
failed REQUIRE of the specification (`--terminate_early`: the result is UNPREDICTABLE, e.g. an
integer division by zero); either raises ToolError with the model's message.

tosa-tools' `tosa_verify` is not used: it checks one operator's result against per-operator
error bounds (ULP, dot-product bounds) that the conformance tests' descriptors carry; a whole
graph has no such bounds, and tosa-tools itself compares networks with plain tolerances.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.lib import format as npy

from ..errors import InputMismatch, ToolError, Unsupported
from ..execute.native import TensorSpec
from . import tosa_tools
from .tosa_files import element_types, serialize

if TYPE_CHECKING:
    from ..importer.graph import Program

# how the reference model stores each TOSA element type in a .npy file (bf16: raw 16-bit words,
# numpy descr '<V2')
_NUMPY: dict[str, np.dtype] = {
    "f32": np.dtype(np.float32), "f16": np.dtype(np.float16), "i64": np.dtype(np.int64),
    "i32": np.dtype(np.int32), "i16": np.dtype(np.int16), "i8": np.dtype(np.int8), "i1": np.dtype(np.bool_),
}
_STATUS = {
    1: "the TOSA reference model finds the result UNPREDICTABLE: for these inputs an operator's REQUIRE of "
       "the TOSA specification fails",
    2: "the TOSA reference model rejects the graph (ERROR): an ERROR_IF rule of the TOSA specification fails, "
       "e.g. for a type the operator does not take in TOSA (such as int64)",
}


def run_reference(program: Program, *tensors: torch.Tensor, **named: torch.Tensor) -> list[torch.Tensor]:
    """The program's outputs from the TOSA reference model, for these inputs (positional, in the
    function's order, or by name: `x=...`, `p_fc_weight=...`), as tensors of its output dtypes."""
    if not all(s.static for s in program.inputs + program.outputs):
        raise Unsupported("the TOSA reference model runs static shapes only, and this program has symbolic "
                          "sizes (?); make the program for fixed sizes (torchtosa.to_tosa with example inputs)")
    args = _bind(program, tensors, named)
    ins, outs = element_types(program)
    with tempfile.TemporaryDirectory(prefix="torchtosa-") as tmp:
        folder = Path(tmp)
        serialize(program, folder / "program.tosa")
        ifm = [f"input_{i}.npy" for i in range(len(args))]
        for file, t, name, element in zip(ifm, args, program.input_names, ins, strict=True):
            _write(folder / file, _stored(t, element, name))
        ofm = [f"output_{i}.npy" for i in range(len(program.outputs))]
        desc = {"tosa_file": "program.tosa", "ifm_name": program.input_names, "ifm_file": ifm,
                "ofm_name": program.output_names, "ofm_file": ofm}
        (folder / "desc.json").write_text(json.dumps(desc, indent=1))
        done = tosa_tools.run("tosa_reference_model", ["--test_desc", folder / "desc.json", "--terminate_early"],
                              check=False)
        if done.returncode != 0:
            status = _STATUS.get(done.returncode)
            raise ToolError(f"{status}\n{tosa_tools.failure(done)}" if status else tosa_tools.failure(done))
        return [_read(folder / file, element, spec)
                for file, element, spec in zip(ofm, outs, program.outputs, strict=True)]


def _bind(program: Program, tensors: tuple[torch.Tensor, ...], named: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The function's arguments in order, each checked against its spec."""
    names = program.input_names
    unknown = sorted(set(named) - set(names))
    if unknown:
        raise InputMismatch(f"the program has no input {unknown[0]}; its inputs are {', '.join(names)}")
    given = dict(zip(names, tensors, strict=False)) | named
    if len(tensors) > len(names) or len(given) != len(names) or set(named) & set(names[:len(tensors)]):
        raise InputMismatch(f"the program takes {len(names)} tensors ({', '.join(names)}); got {len(tensors)} "
                            f"positional and {sorted(named)} by name")
    args = [given[n] for n in names]
    for t, spec, name in zip(args, program.inputs, names, strict=True):
        if not isinstance(t, torch.Tensor) or t.dtype != spec.dtype or tuple(t.shape) != spec.shape:
            got = f"{t.dtype}{list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputMismatch(f"input {name} must be a {spec.dtype}{list(spec.shape)} tensor, got {got}")
    return args


def _stored(t: torch.Tensor, element: str, name: str) -> np.ndarray:
    """`t` as the reference model reads an input of MLIR element type `element`."""
    t = t.detach().cpu().contiguous()
    if element == "bf16":
        return t.to(torch.bfloat16).view(torch.int16).numpy().view("<V2")
    if element not in _NUMPY:
        raise Unsupported(f"input {name} is {element}, which the TOSA reference model does not take")
    target = _NUMPY[element]
    if t.dtype == torch.int64 and target != np.int64:
        info = np.iinfo(target)
        low, high = (int(t.min()), int(t.max())) if t.numel() else (0, 0)
        if low < info.min or high > info.max:
            raise InputMismatch(f"input {name} holds values in [{low}, {high}], outside the {element} the program "
                                f"takes it as ([{info.min}, {info.max}])")
    if t.dtype == torch.bool and target != np.bool_:
        t = t.to(torch.uint8)
    return t.numpy().astype(target, copy=False)


def _write(path: Path, array: np.ndarray) -> None:
    """A .npy file; bf16 words get the descr '<V2' the reference model expects."""
    with path.open("wb") as f:
        descr = "<V2" if array.dtype.kind == "V" else npy.dtype_to_descr(array.dtype)
        npy.write_array_header_1_0(f, {"descr": descr, "fortran_order": False, "shape": array.shape})
        f.write(np.ascontiguousarray(array).tobytes())


def _read(path: Path, element: str, spec: TensorSpec) -> torch.Tensor:
    """An output file as a tensor of the program's torch dtype and shape (the reference model
    writes a rank-0 tensor with shape (1,))."""
    array = np.load(path, allow_pickle=False)
    if array.size != math.prod(spec.shape):
        raise ToolError(f"the TOSA reference model wrote {path.name} with shape {list(array.shape)}, "
                        f"expected {list(spec.shape)}")
    array = np.ascontiguousarray(array).reshape(spec.shape)
    if element == "bf16":
        t = torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    else:
        t = torch.from_numpy(array)
    return t != 0 if spec.dtype == torch.bool else t.to(spec.dtype)
