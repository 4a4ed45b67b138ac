"""`export_library`: a model as a native shared library with a C header, needing neither
Python nor MLIR at run time.

The TOSA module is lowered by the pipeline `torchtosa.compile` uses (`pipeline.lower`), the
LLVM-dialect module translated to LLVM IR and compiled for the host CPU by LLVM -O2
(`toolchain`), and linked by the system C compiler with a small generated C glue (`cabi`)
that turns the plain pointers of `<name>_run` into memref descriptors. The model's parameters
are embedded read-only in the library.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree

from ..api import _capture, _check_call
from ..cpu import Cpu, host_arch, select
from ..errors import CompileError, Unsupported
from ..importer.graph import Program, import_graph
from ..lower import amx
from ..lower.pipeline import check_opt, lower
from . import buffers, cabi, toolchain
from .native import TensorSpec, _prepare, openmp_runtime

OnStage = Callable[[str, float], None]


@dataclass(frozen=True)
class Library:
    """An exported library: the files written and the C interface they declare."""

    path: Path  # the shared library
    header: Path  # its C header
    name: str  # the entry points are `<name>_run` and `<name>_run_with_scratch`
    inputs: tuple[tuple[str, TensorSpec], ...]  # the C arguments, in order: inputs...
    outputs: tuple[tuple[str, TensorSpec], ...]  # ...then outputs
    scratch_bytes: int
    needs: tuple[str, ...]  # the shared libraries it loads (DT_NEEDED)
    files: tuple[Path, ...] = ()  # files written next to it that it needs at run time (libiomp5.so)


def export_library(fn: Callable | torch.nn.Module | torch.export.ExportedProgram, *args: Any,
                   path: str | Path = "model.so", opt: str = "default", name: str | None = None,
                   cpu: str | None = None, **kwargs: Any) -> Library:
    """Compile `fn` for these example inputs into a shared library `path` and a C header next
    to it (`model.so` and `model.h`), declaring `int <name>_run(inputs..., outputs...)`.

    `fn` is a function, an `nn.Module` (its parameters and buffers are embedded in the library)
    or a `torch.export.ExportedProgram`. Every op must lower natively (no eager fallback:
    `Unsupported` names the op otherwise) and shapes are static: the library runs the example
    inputs' shapes and dtypes. `opt` is `torchtosa.compile`'s; with "parallel" the library needs
    the OpenMP runtime `libiomp5.so`, copied next to it. `name` (default: the file's stem
    without "lib") prefixes the C names; keyword arguments are `fn`'s, as for `to_tosa`. `cpu`
    names the entry of the CPU table (opdefs/cpus.yaml) the code is for: by default
    $TORCHTOSA_CPU, else this machine's; any entry, whether this machine runs it or not. An
    entry of another architecture (aarch64: "neoverse-n1", "cortex-a76", "neoverse-v1") is
    cross-compiled, linked by its cross C compiler (Debian's gcc-aarch64-linux-gnu; `make
    cross-tools` installs it), without opt="parallel" (the OpenMP runtime is x86-64's).
    """
    check_opt(opt)
    if not isinstance(fn, torch.export.ExportedProgram):
        _check_call(fn, args, kwargs)
    captured = _capture(fn, args, kwargs)
    program = import_graph(captured.gm)
    outputs = output_names(captured.out_spec, len(program.outputs))
    return build(program, captured.params, path, opt=opt, name=name,
                 input_names=program.input_names[len(captured.params):], output_names=outputs, source=describe(fn),
                 cpu=select(cpu))


def _compiled_for(cpu: Cpu) -> str:
    """The header's note of what CPU the code needs."""
    if cpu.native:
        return f"Compiled for this machine's CPU ({cpu.name}: LLVM's {cpu.llvm_cpu}) and every extension it has."
    return (f"Compiled for the CPU table's {cpu.name} (LLVM's {cpu.llvm_cpu}): it needs "
            f"{', '.join(cpu.features)}.")


def build(program: Program, constants: Sequence[torch.Tensor], path: str | Path, opt: str = "default",
          name: str | None = None, input_names: Sequence[str] | None = None,
          output_names: Sequence[str] | None = None, source: str = "", on_stage: OnStage | None = None,
          cpu: Cpu | None = None) -> Library:
    """Write the library `path` and its header for `program`, whose first `len(constants)`
    inputs are `constants` (embedded in the library) and the others the caller's arrays.
    `on_stage(stage, seconds)` hears of each step: the pipeline's stages, translate, LLVM code generation,
    link. `cpu`: the entry of the CPU table to compile for (by default `cpu.select()`)."""
    check_opt(opt)
    cpu = cpu or select()
    if cpu.arch != host_arch() and opt == "parallel":
        raise Unsupported(f"export_library for {cpu.name} ({cpu.arch}): opt='parallel' needs the OpenMP runtime "
                          f"of the intel-openmp package, which is {host_arch()}'s; use opt='default'")
    path = Path(path)
    if path.suffix != ".so":
        raise ValueError(f"a shared library's path ends in .so, not {path.name!r}")
    if not sys.platform.startswith("linux"):
        raise Unsupported(f"export_library builds ELF shared libraries on Linux, not on {sys.platform}")
    prefix = name if name is not None else path.stem.removeprefix("lib") or "model"
    if cabi.identifier(prefix) != prefix:
        raise ValueError(f"name {prefix!r} is not a C identifier; pass name=")
    _check_static(program)
    embedded, callers, outputs = _ports(program, constants, input_names, output_names)

    module = _prepare(program.module, program.name, tuple(program.inputs), tuple(program.outputs))
    arenas = [_bytes(shape, width) for shape, width in lower(module, opt, on_stage=on_stage, cpu=cpu)]
    clock = _Clock(on_stage)
    text = toolchain.llvm_ir(module)
    clock("translate to LLVM IR")
    with tempfile.TemporaryDirectory(prefix="torchtosa-lib-") as tmp:
        work = Path(tmp)
        objects = [str(o.relative_to(work)) for o in toolchain.machine_code(text, work, cpu)]
        clock("LLVM code generation")
        undefined = toolchain.undefined_symbols([work / o for o in objects])
        link, shipped, needs_note = _runtime_libraries(undefined, work, path.name)
        notes = [f"Model: {source or 'a TOSA program'}, opt={opt!r}.",
                 _compiled_for(cpu),
                 f"Link: cc app.c {path.name} -Wl,-rpath,'$ORIGIN'. At run time it needs no Python or MLIR, only",
                 needs_note]
        iface = cabi.Interface(prefix, program.name, [*embedded, *callers], outputs, arenas,
                               memref_copy="memrefCopy" in undefined, notes=notes)
        header_file = path.with_suffix(".h").name
        (work / header_file).write_text(cabi.header(iface, cabi.identifier(header_file).upper()))
        sources = ["glue.c", *objects, *map(str, toolchain.builtins_object(undefined, work, cpu))]
        if undefined & set(buffers.SYMBOLS):  # buffers allocated in loops: kept for the next call
            (work / "buffers.c").write_text(buffers.SOURCE)
            sources.append("buffers.c")
        if amx.INSTRUCTION in text:  # the library asks Linux for AMX's state when it is loaded
            (work / "amx.c").write_text(amx.PERMISSION_C)
            sources.append("amx.c")
        symbol = None
        if constants:
            symbol = f"{prefix}_tt_constants"
            offsets, size = cabi.constants_layout(constants)
            (work / "constants.bin").write_bytes(cabi.constants_blob(constants, offsets, size))
            (work / "constants.S").write_text(cabi.constants_assembly(symbol, "constants.bin"))
            sources.append("constants.S")
        (work / "glue.c").write_text(cabi.glue(iface, header_file, symbol))
        (work / "exports.map").write_text(cabi.version_script(iface))
        toolchain.run([toolchain.c_compiler(cpu), "-shared", "-fPIC", "-O2", "-std=c11", "-Wall", "-o", path.name,
                       *sources, "-Wl,--version-script=exports.map", f"-Wl,-soname,{path.name}",
                       "-Wl,--no-undefined", "-Wl,-z,noexecstack", *link], cwd=work, what="link (cc)")
        clock("link (cc)")
        needs = toolchain.needed_libraries(work / path.name)
        path.parent.mkdir(parents=True, exist_ok=True)
        for file in [path.name, header_file, *shipped]:
            shutil.copyfile(work / file, path.parent / file)
    return Library(path, path.with_suffix(".h"), prefix,
                   tuple((p.name, p.spec) for p in callers), tuple((p.name, p.spec) for p in outputs),
                   iface.scratch_bytes, tuple(needs), tuple(path.parent / f for f in shipped))


def _ports(program: Program, constants: Sequence[torch.Tensor], input_names: Sequence[str] | None,
           output_names: Sequence[str] | None) -> tuple[list[cabi.Port], list[cabi.Port], list[cabi.Port]]:
    """The program's tensors: its embedded parameters, the caller's inputs and the outputs."""
    if len(constants) > len(program.inputs):
        raise CompileError(f"{len(constants)} constants for a program of {len(program.inputs)} inputs")
    users = len(program.inputs) - len(constants)
    names = cabi.argument_names([*(input_names or [f"in{i}" for i in range(users)]),
                                 *(output_names or [f"out{i}" for i in range(len(program.outputs))])])
    offsets, _ = cabi.constants_layout(constants)
    embedded = []
    for i, (t, spec, offset) in enumerate(zip(constants, program.inputs, offsets, strict=False)):
        if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
            raise CompileError(f"constant {i}: {t.dtype} {list(t.shape)} does not match the program's input "
                               f"{spec.dtype} {list(spec.shape)}")
        embedded.append(cabi.Port(f"param{i}", spec, offset))
    callers = [cabi.Port(n, s) for n, s in zip(names[:users], program.inputs[len(constants):], strict=True)]
    outputs = [cabi.Port(n, s) for n, s in zip(names[users:], program.outputs, strict=True)]
    return embedded, callers, outputs


def _runtime_libraries(undefined: set[str], work: Path, library: str) -> tuple[list[str], list[str], str]:
    """What the compiled code calls besides itself: the link flags, the files to ship next to
    the library (the OpenMP runtime, copied into `work`) and the header's sentence about them."""
    system, link, shipped, extra = ["libc", "libm"], ["-lm"], [], ""
    if any(s.startswith("_ZGV") for s in undefined):  # glibc's vector math (vecmath.py)
        system.append("libmvec")
        link.insert(0, "-lmvec")
    if any(s.startswith(("__kmpc_", "omp_")) for s in undefined):  # opt="parallel"
        runtime = Path(openmp_runtime())
        shutil.copy2(runtime, work / runtime.name)
        shipped.append(runtime.name)
        extra = f" and the OpenMP runtime {runtime.name}, copied next to {library}: keep them together"
        link = [f"-L{work}", "-l" + runtime.stem.removeprefix("lib"), "-Wl,-rpath,$ORIGIN", *link]
    return link, shipped, f"the C library ({', '.join(system)}){extra}."


class _Clock:
    """Calls `on_stage(stage, seconds since the previous call)`."""

    def __init__(self, on_stage: OnStage | None) -> None:
        self.on_stage = on_stage
        self.start = time.perf_counter()

    def __call__(self, stage: str) -> None:
        now = time.perf_counter()
        if self.on_stage is not None:
            self.on_stage(stage, now - self.start)
        self.start = now


def _bytes(shape: tuple[int, ...], width: int) -> int:
    n = width
    for d in shape:
        n *= d
    return max(n, 1)


def _check_static(program: Program) -> None:
    """Unsupported for symbolic sizes: a library runs one static signature."""
    for kind, specs in (("input", program.inputs), ("output", program.outputs)):
        for i, spec in enumerate(specs):
            if not spec.static:
                shape = ", ".join(map(str, spec.shape))
                raise Unsupported(f"export_library: {kind} {i} has the symbolic shape [{shape}]; libraries have "
                                  "static shapes only for now: export with example inputs of the sizes to run "
                                  "(no torch.export Dim, no dynamic=True)")
    if program.scalars or program.sizes:
        raise Unsupported("export_library: the program takes or returns sizes (symbolic shapes); "
                          "libraries have static shapes only for now")


def user_inputs(ep: torch.export.ExportedProgram) -> list[str]:
    """The names of an ExportedProgram's tensor inputs that its caller passes (not its state)."""
    placeholders = {n.name: n for n in ep.graph.find_nodes(op="placeholder")}
    return [s.arg.name for s in ep.graph_signature.input_specs
            if s.kind == torch.export.graph_signature.InputKind.USER_INPUT
            and isinstance(placeholders[s.arg.name].meta.get("val"), torch.Tensor)]


def output_names(out_spec: pytree.TreeSpec, count: int) -> list[str]:
    """Names for the outputs: the keys of a returned dict (or attributes of a dataclass-like
    output) as `logits`, `past_key` for nested ones, else `out0`, `out1`..."""
    generic = [f"out{i}" for i in range(count)]
    try:
        paths = [path for path, _ in pytree.tree_flatten_with_path(pytree.tree_unflatten(generic, out_spec))[0]]
    except (ValueError, TypeError):
        return generic
    names = []
    for i, path in enumerate(paths):
        keys = [k.key if isinstance(k, pytree.MappingKey) else getattr(k, "name", None) for k in path]
        names.append("_".join(keys) if keys and all(isinstance(k, str) for k in keys) else f"out{i}")
    return names if len(names) == count else generic


def describe(fn: Any) -> str:
    """A short name of what was exported, for the header."""
    if isinstance(fn, torch.export.ExportedProgram):
        return "a torch.export.ExportedProgram"
    if isinstance(fn, torch.nn.Module):
        return f"{type(fn).__qualname__} (nn.Module)"
    return f"{getattr(fn, '__qualname__', type(fn).__qualname__)} (function)"
