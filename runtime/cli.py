"""The `torchtosa` command (also `python -m torchtosa`):

    torchtosa export MODULE:CALLABLE --input 1x3x224x224:f32 --input 8:i64:0..1000 --emit so -o model.so

MODULE is an importable module or a path to a .py file. CALLABLE (a dotted attribute path in
it) is an `nn.Module` instance, a function taking the inputs, a zero-argument callable (a class
or a factory function) returning an `nn.Module`, or a `torch.export.ExportedProgram` (which
carries its inputs: no --input then). Modules are put in eval() mode. Each --input is
SHAPE:DTYPE[:LOW..HIGH] (SHAPE like 2x16, or `scalar`); its values are random, seeded by
--seed: floats standard normal (uniform in [LOW, HIGH) if given), integers uniform in
[LOW, HIGH) (default [0, 10)), bools 0 or 1.

Progress goes to stderr, one line per stage with its time. Exit status: 0 on success, 2 for a
usage error (bad arguments, MODULE or CALLABLE not found), 1 when the export fails; the error
is one line, with the traceback only under --verbose.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import torch

from . import api, vela
from .artifacts import tosa_files
from .cpu import Cpu, select
from .errors import InputMismatch, TorchTosaError
from .execute import library, toolchain
from .execute.native import _prepare
from .importer.graph import import_graph
from .lower.pipeline import lower

EMITS = ("tosa", "mlir", "linalg", "llvm", "so")
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64,
          "i64": torch.int64, "i32": torch.int32, "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8,
          "bool": torch.bool}
_NUMBER = r"-?[\d.e+-]+"
_SPEC = re.compile(rf"^(?P<shape>scalar|\d+(?:x\d+)*|):(?P<dtype>\w+)(?::(?P<low>{_NUMBER})\.\.(?P<high>{_NUMBER}))?$")


class UsageError(Exception):
    """A bad command line: exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); the exit status."""
    verbose = "--verbose" in (sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
        return args.run(args)
    except UsageError as e:
        return _fail(str(e), 2, verbose)
    except KeyboardInterrupt:
        return _fail("interrupted", 1, verbose)
    except Exception as e:
        kind = "" if isinstance(e, TorchTosaError | ValueError) else f"{type(e).__name__}: "
        return _fail(kind + str(e), 1, verbose)


def _fail(message: str, status: int, verbose: bool) -> int:
    """Print the error (its lines joined into one, shortened unless `verbose`, which adds the
    traceback) and return the exit status."""
    if verbose:
        traceback.print_exc()
        print(f"torchtosa: error: {message.strip()}", file=sys.stderr)
        return status
    line = " ".join(part.strip() for part in message.strip().splitlines() if part.strip()) or "failed"
    if len(line) > _MAX_ERROR:
        line = line[:_MAX_ERROR].rstrip() + "... (--verbose for all of it)"
    print(f"torchtosa: error: {line}", file=sys.stderr)
    return status


_MAX_ERROR = 600  # characters of an error line without --verbose


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="torchtosa", description="PyTorch -> TOSA -> native code.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    export = commands.add_parser(
        "export", help="export a model as TOSA, MLIR, LLVM IR or a shared library with a C header",
        description=__doc__.split("\n\n", 2)[2].split("\n\nProgress")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_argument("target_fn", metavar="MODULE:CALLABLE", help="the model: see above")
    export.add_argument("--input", action="append", default=[], metavar="SHAPE:DTYPE[:LOW..HIGH]",
                        help=f"an input tensor, e.g. 1x3x224x224:f32 or 8:i64:0..1000 (dtypes: {', '.join(DTYPES)})")
    export.add_argument("--emit", choices=EMITS, required=True,
                        help="tosa: TOSA flatbuffer; mlir: TOSA as MLIR text; linalg: the IR after the "
                        "tosa-to-linalg stages; llvm: LLVM IR; so: shared library + C header")
    export.add_argument("-o", "--output", metavar="PATH",
                        help="output file (default: stdout for mlir, linalg and llvm; required for tosa and so)")
    export.add_argument("--opt", choices=("default", "parallel", "none"), default="default",
                        help="the lowering, as torchtosa.compile's opt= (linalg, llvm, so)")
    export.add_argument("--target", help="TOSA target, passed to torchtosa.to_tosa(target=...)")
    export.add_argument("--freeze", action="store_true", help="passed to torchtosa.to_tosa(freeze=True)")
    export.add_argument("--partition", action="store_true",
                        help="with --target and --emit tosa or mlir: the largest part the target runs "
                             "(to_tosa(partition=True)); what stays on the host is listed on stderr, and with "
                             "-o the host graph, which calls the part as self.delegate, goes to <output>.host.py")
    export.add_argument("--name", help="prefix of the library's C names (default: the file name's stem)")
    export.add_argument("--cpu", help="the entry of the CPU table (opdefs/cpus.yaml) to compile for (llvm, so): "
                        "default $TORCHTOSA_CPU or this machine's; aarch64 ones cross-compile")
    export.add_argument("--vela", nargs="?", const=vela.ACCELERATOR, metavar="ACCELERATOR",
                        help="with --emit tosa: write it for an NPU (to_tosa(npu=True): linear layers as 1x1 "
                        "convolutions), compile the file with Arm's Vela (`make vela`) for ACCELERATOR "
                        f"(default {vela.ACCELERATOR}) and print its estimate")
    export.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    export.add_argument("--verbose", action="store_true", help="tracebacks on errors")
    export.set_defaults(run=_export)
    return parser


def _export(args: argparse.Namespace) -> int:
    if args.output is None and args.emit in ("tosa", "so"):
        raise UsageError(f"--emit {args.emit} writes a file: give -o PATH")
    if args.emit == "so" and args.output is not None and not args.output.endswith(".so"):
        raise UsageError(f"--emit so: -o must name a .so file, not {args.output!r}")
    if args.emit == "tosa" and args.output is not None and not args.output.endswith(".tosa"):
        raise UsageError(f"--emit tosa: -o must name a .tosa file, not {args.output!r}")
    if args.vela and args.emit != "tosa":
        raise UsageError("--vela compiles the TOSA flatbuffer: use it with --emit tosa")
    if args.partition and (args.target is None or args.emit not in ("tosa", "mlir")):
        raise UsageError("--partition delegates part of the model to a TOSA target: use it with --target and "
                         "--emit tosa or mlir")
    if args.cpu is not None and args.emit not in ("llvm", "so"):
        raise UsageError("--cpu picks the CPU native code is compiled for: use it with --emit llvm or so")
    try:
        cpu = select(args.cpu)
    except ValueError as e:
        raise UsageError(f"--cpu: {e}") from None
    inputs = [parse_input(spec, i) for i, spec in enumerate(args.input)]
    fn = load_callable(args.target_fn)
    exported = isinstance(fn, torch.export.ExportedProgram)
    if exported and inputs:
        raise UsageError(f"{args.target_fn} is an ExportedProgram, which carries its own inputs: drop --input")
    if not exported and not inputs:
        raise UsageError("give the model's inputs with --input SHAPE:DTYPE (one per tensor argument)")
    generator = torch.Generator().manual_seed(args.seed)
    tensors = tuple(make_input(spec, generator) for spec in inputs)
    progress = Progress()
    options = {k: v for k, v in (("target", args.target), ("freeze", args.freeze or None),
                                 ("npu", bool(args.vela) or None), ("partition", args.partition or None))
               if v is not None}

    if not exported:
        try:
            api._check_call(fn, tensors, {})
        except InputMismatch as e:
            raise UsageError(f"{e} (give one --input per tensor argument)") from None
    constants: list[torch.Tensor] = []
    outputs: list[str] | None = None
    if options or args.emit in ("mlir", "tosa"):  # TOSA for a target (the most conformant one by default)
        program = progress.run("capture + import to TOSA", lambda: api.to_tosa(fn, *tensors, **options))
        if args.partition:
            print(program.explain(), file=sys.stderr)
            if args.output is not None:
                host = Path(args.output).with_suffix(".host.py")
                _write(str(host), f"# the host part of {args.target_fn}: PyTorch runs it, self.delegate is "
                                  f"{Path(args.output).name}\n{program.host.code}")
            program = program.program
        users = len(tensors) if not exported else len(library.user_inputs(fn))
        if args.emit == "so" and len(program.inputs) != users:
            raise UsageError("--emit so with --target needs --freeze: the library embeds the parameters "
                             "as constants of the TOSA program")
    else:
        captured = progress.run("capture", lambda: api._capture(fn, tensors, {}))
        program = progress.run("import to TOSA", lambda: import_graph(captured.gm))
        constants = captured.params
        outputs = library.output_names(captured.out_spec, len(program.outputs))

    if args.emit == "mlir":
        _write(args.output, tosa_files.annotated(program))
    elif args.emit == "tosa":
        progress.run("serialize", lambda: program.save(args.output))
        if args.vela:
            print(progress.run("vela", lambda: vela.compile(args.output, accelerator=args.vela)).summary())
    elif args.emit in ("linalg", "llvm"):
        _write(args.output, lowered(program, args.opt, args.emit, progress.stage, cpu))
    else:
        names = program.input_names[len(constants):]  # the function's parameter names (capture gives them)
        lib = library.build(program, constants, args.output, opt=args.opt, name=args.name, input_names=names,
                            output_names=outputs, source=f"{args.target_fn} ({library.describe(fn)})",
                            on_stage=progress.stage, cpu=cpu)
        for file in (lib.path, lib.header, *lib.files):
            print(f"wrote {file}", file=sys.stderr)
    progress.total()
    return 0


def lowered(program: Any, opt: str, emit: str, on_stage: Callable[[str, float], None], cpu: Cpu) -> str:
    """The program's IR after the tosa-to-linalg stages (`emit="linalg"`: linalg on tensors,
    before scheduling and bufferization) or as LLVM IR (`emit="llvm"`), for `cpu`."""
    module = _prepare(program.module, program.name, tuple(program.inputs), tuple(program.outputs))
    lower(module, opt, stop_before="unit-dims" if emit == "linalg" else None, on_stage=on_stage, cpu=cpu)
    if emit == "linalg":
        return str(module)
    start = time.perf_counter()
    text = toolchain.llvm_ir(module)
    on_stage("translate to LLVM IR", time.perf_counter() - start)
    return text


class Progress:
    """One stderr line per stage: its name and seconds."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    def stage(self, name: str, seconds: float) -> None:
        print(f"torchtosa: {name:<28} {seconds:8.3f} s", file=sys.stderr, flush=True)

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        start = time.perf_counter()
        result = fn()
        self.stage(name, time.perf_counter() - start)
        return result

    def total(self) -> None:
        self.stage("total", time.perf_counter() - self.start)


def parse_input(spec: str, index: int) -> tuple[tuple[int, ...], torch.dtype, tuple[float, float] | None]:
    """(shape, dtype, value range or None) of an --input SHAPE:DTYPE[:LOW..HIGH]."""
    match = _SPEC.match(spec.strip())
    if match is None:
        raise UsageError(f"--input {spec!r} (input {index}): expected SHAPE:DTYPE[:LOW..HIGH], e.g. 2x16:f32, "
                         "8:i64:0..1000 or scalar:f32")
    dtype = DTYPES.get(match["dtype"])
    if dtype is None:
        raise UsageError(f"--input {spec!r}: unknown dtype {match['dtype']!r}; choose one of {', '.join(DTYPES)}")
    text = match["shape"]
    shape = () if text in ("", "scalar") else tuple(int(d) for d in text.split("x"))
    bounds = None
    if match["low"] is not None:
        try:
            bounds = (float(match["low"]), float(match["high"]))
        except ValueError:
            raise UsageError(f"--input {spec!r}: the range LOW..HIGH must be two numbers") from None
        if not bounds[0] < bounds[1]:
            raise UsageError(f"--input {spec!r}: empty range {match['low']}..{match['high']}")
    return shape, dtype, bounds


def make_input(spec: tuple[tuple[int, ...], torch.dtype, tuple[float, float] | None],
               generator: torch.Generator) -> torch.Tensor:
    """A random tensor for a parsed --input."""
    shape, dtype, bounds = spec
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    if dtype.is_floating_point:
        if bounds is None:
            return torch.randn(shape, generator=generator).to(dtype)
        low, high = bounds
        return (torch.rand(shape, generator=generator) * (high - low) + low).to(dtype)
    low, high = (int(b) for b in bounds) if bounds is not None else (0, 10)
    if high <= low:
        raise UsageError(f"integer range {low}..{high} is empty")
    info = torch.iinfo(dtype)
    if low < info.min or high - 1 > info.max:
        raise UsageError(f"range {low}..{high} does not fit {dtype}")
    return torch.randint(low, high, shape, generator=generator, dtype=torch.int64).to(dtype)


def load_callable(target: str) -> Any:
    """The model MODULE:CALLABLE names: a module in eval() mode, a function or an ExportedProgram."""
    module_name, sep, attribute = target.rpartition(":")
    if not sep or not module_name or not attribute:
        raise UsageError(f"{target!r}: expected MODULE:CALLABLE (a module or .py file, then a name in it)")
    module = _import(module_name)
    obj: Any = module
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{module_name} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if isinstance(obj, torch.nn.Module | torch.export.ExportedProgram):
        return _ready(obj)
    if not callable(obj):
        raise UsageError(f"{target} is a {type(obj).__name__}, not an nn.Module, function or ExportedProgram")
    if inspect.isclass(obj) or _takes_no_arguments(obj):
        made = obj()
        if not isinstance(made, torch.nn.Module | torch.export.ExportedProgram):
            raise UsageError(f"{target}() returned a {type(made).__name__}; a zero-argument CALLABLE must "
                             "return an nn.Module (a function of the inputs takes arguments)")
        return _ready(made)
    return obj


def _ready(obj: Any) -> Any:
    return obj.eval() if isinstance(obj, torch.nn.Module) else obj


def _takes_no_arguments(fn: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters) \
        and not any(p.kind is p.VAR_POSITIONAL for p in parameters)


def _import(name: str) -> Any:
    """A module by import name, or from a .py file path."""
    if name.endswith(".py") or os.sep in name:
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"no such file: {name}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        if spec is None or spec.loader is None:
            raise UsageError(f"can't import {name}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[path.stem] = module
        sys.path.insert(0, str(path.resolve().parent))
        spec.loader.exec_module(module)
        return module
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name is not None and name.startswith(e.name):
            raise UsageError(f"no module named {name!r} (give an importable module or a path to a .py file)") from None
        raise


def _write(output: str | None, text: str) -> None:
    if output is None or output == "-":
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    Path(output).write_text(text)
    print(f"wrote {output}", file=sys.stderr)
