"""Run a TOSA function natively: lower it, JIT it, call it on torch tensors.

Calling convention: after lowering, `@name(in0..inN, out0..outM)` takes each
tensor as a pointer to a memref descriptor {allocated, aligned, offset,
sizes[rank], strides[rank]} (64-bit words). Outputs are allocated by torch, so
no tensor is copied across the boundary. Booleans are bytes (i8) in memory.
"""

from __future__ import annotations

import _ctypes
import ctypes
import functools
import glob
import importlib.metadata
import math
import operator
import os
import tempfile
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import sympy
import torch
from mlir import ir
from mlir.execution_engine import ExecutionEngine

from .. import debug, progress
from ..capture.symbolic import Bound, Size, evaluator, free_symbols, symbol_sources
from ..cpu import Cpu, runnable, select
from ..errors import CompileError, InputMismatch, MissingRuntime, Unsupported
from ..internal import blame
from ..lower import amx
from ..lower.pipeline import WRITES_ATTR, Scratch, lower
from . import buffers, disk_cache, toolchain

# Element type of each supported dtype at the boundary, as the TOSA builder
# (tosa.py) types it; bool is a byte holding 0 or 1.
_ELEMENT_TYPES: dict[torch.dtype, str] = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "ui8",
    torch.bool: "i8",
}

# MLIR's packed wrapper of `_mlir_ciface_<name>`: void(void **args). ctypes
# releases the GIL around the call.
_PACKED = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_WORD = ctypes.sizeof(ctypes.c_uint64)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor crossing the native boundary. A dim is an int or, for a
    size known at run time only, a sympy expression of the graph's size symbols (`?` in MLIR)."""

    shape: tuple[Size, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        shape = tuple(d if isinstance(d, sympy.Expr) and not d.is_Integer else operator.index(d) for d in self.shape)
        if any(isinstance(d, int) and d < 0 for d in shape):
            raise Unsupported(f"a tensor can't have the negative shape {list(self.shape)}")
        object.__setattr__(self, "shape", shape)
        if self.dtype not in _ELEMENT_TYPES:
            supported = ", ".join(str(d) for d in _ELEMENT_TYPES)
            raise Unsupported(f"dtype {self.dtype} is not supported (supported: {supported})")

    @property
    def static(self) -> bool:
        return all(isinstance(d, int) for d in self.shape)

    def mlir_type_str(self) -> str:
        """The MLIR tensor type: "tensor<4x?xf32>"; bool is i8; rank 0 is "tensor<f32>"."""
        dims = "".join(f"{d}x" if isinstance(d, int) else "?x" for d in self.shape)
        return f"tensor<{dims}{_ELEMENT_TYPES[self.dtype]}>"


class NativeFunction:
    """A TOSA function compiled to native code, callable on CPU torch tensors."""

    def __init__(
        self,
        module: ir.Module,
        inputs: Sequence[TensorSpec],
        outputs: Sequence[TensorSpec],
        name: str = "forward",
        opt: str = "default",
        ranges: dict[sympy.Symbol, tuple[int, int | None]] | None = None,
        scalars: dict[int, sympy.Symbol] | None = None,
        cpu: Cpu | None = None,
        artifacts: debug.Artifacts | None = None,
        written: dict[int, int] | None = None,
    ) -> None:
        """Lower a clone of `module` (which stays untouched) and compile `@name`: with the JIT, or,
        where the disk cache is on (`disk_cache`), by LLVM (`toolchain`) into a shared library kept
        there, which a later compile of the same module loads instead (`self.cached`).

        `module` holds `func.func @name` taking and returning tensors of types
        `inputs` and `outputs` (see TensorSpec.mlir_type_str). Raises
        CompileError if the signature differs or lowering or the JIT fails.
        `opt` names the lowering (`pipeline.OPT_LEVELS`). A symbolic dim of the specs is `?` in
        the module; its value comes from the inputs at each call (within `ranges`, per symbol):
        from a dim, or from an input that holds it (`scalars`: input position -> symbol). `cpu` is
        the entry of the CPU table the code is for (by default `cpu.select()`); this machine must
        run it. With `artifacts` (TORCHTOSA_DEBUG), the module after each stage, the LLVM IR and
        the time of each step are written there. `written` maps outputs that the code writes
        into an input instead (output position -> input position; same shape and dtype): the
        caller's tensor is updated in place and is that output of each call (`state.py`).
        """
        self.written = dict(sorted((written or {}).items()))
        for k, i in self.written.items():
            if outputs[k] != inputs[i]:
                raise CompileError(f"output {k} ({outputs[k]}) can't be written into input {i} ({inputs[i]})")
        self.inputs = tuple(inputs)
        self.outputs = tuple(s for k, s in enumerate(outputs) if k not in self.written)
        self.name = name
        self.cpu = runnable(cpu or select())
        if opt == "parallel":
            _load_openmp_runtime()
        if self.cpu.bf16_matmul == "amx":  # code from the disk cache, compiled in another process, too
            amx.request_permission()
        entry = None
        if disk_cache.folder() is not None:
            entry = disk_cache.key(str(module), repr((name, self.inputs, self.outputs, self.written)), opt, self.cpu)
        cached = disk_cache.load(entry) if entry is not None else None
        self.cached = cached is not None
        if cached is not None:
            path, meta = cached
            scratch = [(tuple(shape), width) for shape, width in meta["scratch"]]
            self._library, address = _open(path, name)
        else:
            self._module = _prepare(module, name, self.inputs, tuple(outputs), self.written)
            on_stage = None if artifacts is None else lambda stage, s: artifacts.stage(stage, s, self._module)
            scratch = lower(self._module, opt, cpu=self.cpu, on_stage=on_stage)
            if artifacts is not None:
                artifacts.write("kernel.ll", toolchain.llvm_ir(self._module))
            started = time.perf_counter()
            progress.stage("LLVM code generation")
            try:
                # the JIT's IR has no packed wrapper (it makes its own): sized without it
                jit = self.cpu.native and entry is None and _jit_is_faster(toolchain.llvm_ir(self._module))
                if jit:
                    self._engine = _jit(self._module)
                    address = self._engine.raw_lookup("_mlir_ciface_" + name)
                    if not address:
                        raise CompileError(f"JIT could not link @{name} (unresolved symbols are reported on stderr)")
                else:
                    self._library, address = _load(library_ir(self._module, name), name, self.cpu, entry, scratch)
                    weakref.finalize(self, _unload, self._library).atexit = False  # exit unmaps all
            except Exception as err:
                blame(err, stage="LLVM code generation")
                raise
            if artifacts is not None:
                how = "JIT" if jit else "LLVM -O2, cc"
                artifacts.note(f"LLVM code generation ({how}): {time.perf_counter() - started:.3f} s")
        self._fn = _PACKED(address)
        self._layout = _FrameLayout([s.shape for s in self.inputs + self.outputs], scratch)
        self._free_frames: list[_Frame] = []
        self.dynamic = not all(s.static for s in self.inputs + self.outputs)
        if self.dynamic:
            self._sizes = _SizeRules(self.inputs, self.outputs, ranges or {}, scalars or {})
        else:
            self._checks = [(torch.Size(s.shape), s.dtype) for s in self.inputs]
            self._results = [(s.shape, s.dtype) for s in self.outputs]

    def __call__(self, *args: torch.Tensor, known: int = 0) -> list[torch.Tensor]:
        """Run on `args`, checked before native code runs but for the last `known`, which the
        caller knows to match (it keyed them by shape, dtype, device and layout); return new
        output tensors."""
        if self.dynamic:
            return self._call_dynamic(args)
        if len(args) != len(self._checks):
            raise InputMismatch(f"@{self.name} takes {len(self._checks)} tensors, got {len(args)}")
        for i in range(len(args) - known):
            t, (shape, dtype) = args[i], self._checks[i]
            if not (
                isinstance(t, torch.Tensor)
                and t.shape == shape
                and t.dtype is dtype
                and t.is_cpu
                and t.layout is torch.strided
            ):
                raise InputMismatch(_mismatch(i, t, self.inputs[i]))
        tensors = [t if t.is_contiguous() else t.contiguous() for t in args]
        results = [torch.empty(shape, dtype=dtype) for shape, dtype in self._results]
        return self._call(args, tensors, results, with_sizes=False)

    def _call_dynamic(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """A call with sizes known at run time: the descriptors get each tensor's sizes too."""
        if len(args) != len(self.inputs):
            raise InputMismatch(f"@{self.name} takes {len(self.inputs)} tensors, got {len(args)}")
        for i, (t, spec) in enumerate(zip(args, self.inputs, strict=True)):
            if not (isinstance(t, torch.Tensor) and t.dtype is spec.dtype and t.dim() == len(spec.shape)
                    and t.is_cpu and t.layout is torch.strided):
                raise InputMismatch(_mismatch(i, t, spec))
        shapes = self._sizes.output_shapes(self._sizes.values(args), args)
        tensors = [t if t.is_contiguous() else t.contiguous() for t in args]
        results = [torch.empty(shape, dtype=spec.dtype) for shape, spec in zip(shapes, self.outputs, strict=True)]
        return self._call(args, tensors, results, with_sizes=True)

    def _call(self, args: Sequence[torch.Tensor], tensors: list[torch.Tensor], results: list[torch.Tensor],
              with_sizes: bool) -> list[torch.Tensor]:
        """Run on the contiguous `tensors` of `args` into `results`; the outputs. An input an
        output is written into (`written`) is the caller's tensor, or, where that one is not
        contiguous, a contiguous copy copied back after the call; it is that output too."""
        if not self.written:
            self._run(tensors + results, with_sizes)
            return results
        private = {i: tensors[i] for i in self.written.values() if tensors[i] is not args[i]}
        self._run(tensors + results, with_sizes)
        for i, copy in private.items():
            args[i].copy_(copy)
        for k, i in self.written.items():
            results.insert(k, args[i])
        return results

    def size_values(self, args: Sequence[torch.Tensor]) -> dict[sympy.Symbol, int]:
        """The value of each size symbol for these arguments (none for static code)."""
        return self._sizes.values(args) if self.dynamic else {}

    def _run(self, tensors: list[torch.Tensor], with_sizes: bool) -> None:
        """Call the native code on contiguous `tensors` (inputs, then outputs); `with_sizes`
        writes each tensor's sizes and strides into its descriptor too (dynamic shapes)."""
        # A frame per concurrent call: list.pop/append are atomic, so threads
        # (and re-entrant calls) never share one.
        try:
            frame = self._free_frames.pop()
        except IndexError:
            frame = self._layout.new_frame()
        words = frame.words
        for index, t in zip(frame.descriptors, tensors, strict=True):
            words[index] = words[index + 1] = t.data_ptr()
            if with_sizes and (rank := t.dim()):
                words[index + 3:index + 3 + rank] = list(t.shape)
                words[index + 3 + rank:index + 3 + 2 * rank] = _contiguous_strides(tuple(t.shape))
        self._fn(frame.args)
        self._free_frames.append(frame)


class _SizeRules:
    """Run-time sizes of a function with symbolic dims: each symbol read from the first input dim
    that is exactly it, every other input dim checked against its expression and each symbol
    against its range, the output shapes computed from the symbols."""

    def __init__(self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec],
                 ranges: dict[sympy.Symbol, tuple[int, int | None]], scalars: dict[int, sympy.Symbol]) -> None:
        self.inputs = inputs
        sources = symbol_sources([s.shape for s in inputs], scalars)
        missing = free_symbols([s.shape for s in (*inputs, *outputs)]) - set(sources)
        if missing:
            names = ", ".join(sorted(map(str, missing)))
            raise Unsupported(f"the sizes {names} are not dims of any tensor input, so native code can't read them")
        self.sources = [(sym, b.arg, b.dim) for sym, b in sources.items()]
        self.ranges = [(sym, *ranges[sym]) for sym in sources if sym in ranges]
        self.checks = [(i, d, evaluator(s)) for i, spec in enumerate(inputs) for d, s in enumerate(spec.shape)
                       if not (isinstance(s, sympy.Symbol) and sources[s] == Bound(i, d))]
        self.outputs = [[evaluator(s) for s in spec.shape] for spec in outputs]

    def values(self, args: Sequence[torch.Tensor]) -> dict[sympy.Symbol, int]:
        """Each symbol's value: an input's dim, or the number a rank-0 input holds."""
        return {sym: args[i].shape[d] if d is not None else int(args[i]) for sym, i, d in self.sources}

    def output_shapes(self, values: dict[sympy.Symbol, int], args: Sequence[torch.Tensor]) -> list[list[int]]:
        """The output shapes for these symbol values, after checking the inputs against them."""
        for i, d, fn in self.checks:
            if args[i].shape[d] != fn(values):
                raise InputMismatch(_mismatch(i, args[i], self.inputs[i]) + f" (dim {d} must be {fn(values)})")
        for sym, low, high in self.ranges:
            v = values[sym]
            if v < low or (high is not None and v > high):
                upper = "" if high is None else f", at most {high}"
                raise InputMismatch(f"size {sym} = {v} is outside the range this code was compiled for "
                                    f"(at least {low}{upper})")
        return [[fn(values) for fn in shape] for shape in self.outputs]


class _Frame:
    """Argument memory of one call: descriptors, pointers to them, then the packed args.

    `descriptors` indexes the descriptors of the per-call tensors (inputs, then outputs); the
    frame's own scratch buffers follow them, their pointers set once.
    """

    def __init__(self, words: ctypes.Array, descriptors: list[int], n_args: int,
                 scratch: list[torch.Tensor]) -> None:
        self.words = words
        self.descriptors = descriptors
        self.args = ctypes.addressof(words) + _WORD * (len(words) - n_args)
        self.scratch = scratch  # kept alive with the frame


class _FrameLayout:
    """Makes frames for contiguous memrefs of fixed shapes; only data pointers vary per call."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], scratch: Sequence[Scratch] = ()) -> None:
        self._template: list[int] = []
        self._descriptors: list[int] = []
        self._scratch = list(scratch)
        all_shapes = [*shapes, *(shape for shape, _ in self._scratch)]
        for shape in all_shapes:
            self._descriptors.append(len(self._template))
            static = tuple(d if isinstance(d, int) else 0 for d in shape)  # dynamic ones are set per call
            self._template += [0, 0, 0, *static, *_contiguous_strides(static)]
        self._n_tensors = len(shapes)
        self._type = ctypes.c_uint64 * (len(self._template) + 2 * len(all_shapes))

    def new_frame(self) -> _Frame:
        words = self._type()
        base = ctypes.addressof(words)
        pointers = [base + _WORD * i for i in self._descriptors]
        first_pointer = len(self._template)
        packed = [base + _WORD * (first_pointer + i) for i in range(len(pointers))]
        words[:] = self._template + pointers + packed
        scratch = [torch.empty(max(1, math.prod(shape)) * width, dtype=torch.uint8) for shape, width in self._scratch]
        for index, buffer in zip(self._descriptors[self._n_tensors:], scratch, strict=True):
            words[index] = words[index + 1] = buffer.data_ptr()
        return _Frame(words, self._descriptors[: self._n_tensors], len(pointers), scratch)


def _contiguous_strides(shape: tuple[int, ...]) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return strides[::-1]


def _mismatch(i: int, t: object, spec: TensorSpec) -> str:
    shape = "[" + ", ".join(map(str, spec.shape)) + "]"
    expected = f"a strided CPU tensor of shape {shape} and dtype {spec.dtype}"
    if not isinstance(t, torch.Tensor):
        return f"argument {i}: expected {expected}, got {type(t).__name__}"
    got = f"shape {list(t.shape)}, dtype {t.dtype}, device {t.device}, layout {t.layout}"
    return f"argument {i}: expected {expected}, got {got}"


def _prepare(
    module: ir.Module, name: str, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
    written: dict[int, int] | None = None,
) -> ir.Module:
    """Clone `module`, check @name's signature, set what the calling convention needs: inputs
    read-only, but for those `written` maps an output into (output -> input position), whose
    buffer bufferization must compute that result in (`pipeline.WRITES_ATTR`)."""
    with module.context, ir.Location.unknown():
        clone = ir.Module.create()
        for key in module.operation.attributes:  # iterating the attributes yields their names
            clone.operation.attributes[key] = module.operation.attributes[key]
        for op in module.body.operations:
            op.clone(ip=ir.InsertionPoint(clone.body))
        func = next(
            (
                op
                for op in clone.body.operations
                if op.operation.name == "func.func" and ir.StringAttr(op.attributes["sym_name"]).value == name
            ),
            None,
        )
        if func is None:
            raise CompileError(f"module has no func.func @{name}")
        signature = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
        got = [str(t) for t in signature.inputs], [str(t) for t in signature.results]
        want = [s.mlir_type_str() for s in inputs], [s.mlir_type_str() for s in outputs]
        if got != want:
            raise CompileError(f"@{name} has signature {got}, but the specs say {want}")
        func.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
        # Inlined into its C-interface wrapper, which would otherwise call it with every
        # memref descriptor spread into scalars: LLVM's instruction selection takes time
        # quadratic in a call's arguments (5.6 s for the ~1000 of BERT's 12 layers of weights).
        func.attributes["passthrough"] = ir.ArrayAttr.get([ir.StringAttr.get("alwaysinline")])
        # Internal, so once inlined it is gone: the JIT would otherwise also compile it on its
        # own and a packed `_mlir_<name>` wrapper of it, each a copy of its body.
        func.attributes["llvm.linkage"] = ir.Attribute.parse("#llvm.linkage<internal>")
        # Inputs are read-only: never bufferize in place into a caller's tensor (tosa.scatter
        # would otherwise write into its values_in argument), but for those `written` updates.
        written = written or {}
        old = ir.ArrayAttr(func.attributes["arg_attrs"]) if "arg_attrs" in func.attributes else None
        func.attributes["arg_attrs"] = ir.ArrayAttr.get(
            [_writable(ir.DictAttr(old[i]) if old else None, i in written.values()) for i in range(len(inputs))]
        )
        if written:
            func.attributes[WRITES_ATTR] = ir.DenseI64ArrayAttr.get([n for pair in written.items() for n in pair])
    return clone


def _writable(attrs: ir.DictAttr | None, writable: bool) -> ir.DictAttr:
    entries = {a.name: a.attr for a in (attrs[i] for i in range(len(attrs)))} if attrs else {}
    entries["bufferization.writable"] = ir.BoolAttr.get(writable)
    return ir.DictAttr.get(entries)


def _jit_is_faster(text: str) -> bool:
    """Whether the JIT compiles this LLVM IR sooner than LLVM's code generation into a library
    (`_load`, in a temporary directory): below JIT_MAX_IR_BYTES, or where no C compiler links one.

    The JIT costs less to start (no `cc` process, no files), but generates code with LLVM's
    default options (the MLIR bindings' LLVM takes no command-line options), which schedule
    instructions twice (`toolchain.CODEGEN_OPTIONS` turns that off for a library): on 60 op
    samples of opdefs/ (Emerald Rapids-class VM), from about 24 KB of IR the library was the
    sooner, and 1.3-1.7x sooner from 50 KB (an encoder layer's 690 KB: 1.9 against 0.8 s).
    """
    if len(text) < JIT_MAX_IR_BYTES:
        return True
    try:
        toolchain.c_compiler()
    except CompileError:
        return True
    return False


JIT_MAX_IR_BYTES = 24_000


def _load(text: str, name: str, cpu: Cpu, entry: str | None, scratch: list[Scratch]) -> tuple[ctypes.CDLL, int]:
    """Compile the LLVM IR of `library_ir` as `export_library` does (LLVM -O2 for the entry's
    CPU, then `cc -shared`), keep it in the disk cache under `entry` (with its `scratch`) if not
    None, and load it: the library, and the address of `@name`'s packed wrapper.

    Code for another entry of the CPU table than the host's is always compiled so, not by the
    JIT: the JIT's target machine is the host's, and functions compiled for a narrower CPU within
    it (target-cpu attributes) were seen to compute wrong results (an int64 topk with AVX2 code
    on an AVX-512 host) that the same code compiled for that CPU (`toolchain`) does not.
    """
    with tempfile.TemporaryDirectory(prefix="torchtosa-") as tmp:
        path = shared_object(text, cpu, Path(tmp))
        if entry is not None:
            path = disk_cache.store(entry, path, {"scratch": scratch})
        return _open(path, name)  # mapped: the temporary file may go


def _open(path: Path, name: str) -> tuple[ctypes.CDLL, int]:
    """A library of `shared_object`, loaded, and the address of `@name`'s packed wrapper."""
    buffers.library()  # what its buffers of run-time sizes come from
    library = ctypes.CDLL(str(path))
    return library, ctypes.cast(getattr(library, PACKED_PREFIX + name), ctypes.c_void_p).value


def _unload(library: ctypes.CDLL) -> None:
    """Unmap a library `_open` loaded, once its NativeFunction is gone (each load of a path counts
    once: a library two functions loaded stays until both are gone)."""
    _ctypes.dlclose(library._handle)


PACKED_PREFIX = "torchtosa_packed_"


def library_ir(module: ir.Module, name: str) -> str:
    """The LLVM IR of an LLVM-dialect module with a packed wrapper of `@name` (`PACKED_PREFIX +
    name`), which a library's caller calls; the JIT calls `_mlir_ciface_<name>` instead."""
    _packed_wrapper(module, name, PACKED_PREFIX + name)
    return toolchain.llvm_ir(module)


def shared_object(text: str, cpu: Cpu, work: Path) -> Path:
    """`work`/kernel.so: the LLVM IR of `library_ir` compiled for `cpu`, linked with the runtime
    libraries its code calls."""
    objects = toolchain.machine_code(text, work, cpu)
    runtime = [_runner_utils()]
    undefined = toolchain.undefined_symbols(objects)
    if any(s.startswith(("__kmpc_", "omp_")) for s in undefined):
        runtime.append(openmp_runtime())
    link = [f for lib in runtime for f in (lib, f"-Wl,-rpath,{os.path.dirname(lib)}")]
    objects = [*map(str, objects), *map(str, toolchain.builtins_object(undefined, work, cpu))]
    toolchain.run([toolchain.c_compiler(), "-shared", "-o", "kernel.so", *objects, *link, "-lmvec", "-lm"],
                  cwd=work, what="link (cc)")
    return work / "kernel.so"


def _packed_wrapper(module: ir.Module, name: str, wrapper: str) -> None:
    """Add `void wrapper(void **args)` calling `_mlir_ciface_<name>` with `*args[i]`, as the JIT's
    packed wrappers do, compiled for the same CPU."""
    ciface = next(op for op in module.body.operations if op.operation.name == "llvm.func"
                  and ir.StringAttr(op.attributes["sym_name"]).value == f"_mlir_ciface_{name}")
    # internal: inlined into the wrapper (it inherits `alwaysinline`), it is gone; public, it was a
    # second copy of the whole body through opt and llc (an encoder layer's 0.45 + 0.99 s instead
    # of 0.32 + 0.48). (Left a call, x86-64-v3 code computed a wrong int64 topk: test_cpu.)
    ciface.attributes["linkage"] = ir.Attribute.parse("#llvm.linkage<internal>", context=module.context)
    n = len(ciface.regions[0].blocks[0].arguments)
    target = "".join(f", {key} = {ciface.attributes[key]}" for key in ("target_cpu", "target_features")
                     if key in ciface.attributes)
    lines = [f"llvm.func @{wrapper}(%args: !llvm.ptr) attributes {{sym_visibility = \"public\"{target}}} {{"]
    for i in range(n):
        lines += [f"  %p{i} = llvm.getelementptr %args[{i}] : (!llvm.ptr) -> !llvm.ptr, !llvm.ptr",
                  f"  %a{i} = llvm.load %p{i} : !llvm.ptr -> !llvm.ptr",
                  f"  %d{i} = llvm.load %a{i} : !llvm.ptr -> !llvm.ptr"]
    operands, types = ", ".join(f"%d{i}" for i in range(n)), ", ".join(["!llvm.ptr"] * n)
    lines += [f"  llvm.call @_mlir_ciface_{name}({operands}) : ({types}) -> ()", "  llvm.return", "}",
              f"llvm.func @_mlir_ciface_{name}({types})"]  # declared for the parser only
    parsed = ir.Module.parse("\n".join(lines), context=module.context)
    op = parsed.body.operations[0]
    op.detach_from_parent()
    module.body.append(op)


def _jit(module: ir.Module) -> ExecutionEngine:
    """Compile an LLVM-dialect module; CompileError carries MLIR's diagnostics."""
    diagnostics: list[str] = []

    def record(d: ir.Diagnostic) -> bool:
        diagnostics.append(f"{d.location}: {d.message}")
        return True

    handler = module.context.attach_diagnostic_handler(record)
    try:
        engine = ExecutionEngine(module, opt_level=toolchain.OPT_LEVEL, shared_libs=[_runner_utils()],
                                 enable_object_dump=False)
        for symbol, address in buffers.addresses().items():
            engine.raw_register_runtime(symbol, ctypes.c_void_p(address))
        engine.initialize()
    except RuntimeError as e:
        raise CompileError("\n".join([f"JIT failed: {e}", *diagnostics])) from e
    finally:
        handler.detach()
    return engine


@functools.cache
def _load_openmp_runtime() -> None:
    """Load the OpenMP runtime (libiomp5, of the `intel-openmp` package) into the process, once,
    with global symbols, for the JIT to resolve the `__kmpc_*` calls of OpenMP regions.

    torch's own OpenMP runtime (libgomp) lacks those entry points; the two keep separate thread
    pools. The worker count follows OMP_NUM_THREADS (default: one per core), and idle workers
    spin for KMP_BLOCKTIME (default 200 ms) before they sleep.

    A libiomp5 already in the process (a library `export_library` wrote, loaded with its copy of
    the runtime) is the one used: a second copy would abort the process ("OMP: Error #15").
    """
    path = openmp_runtime()
    try:  # by its soname, only if loaded: its symbols become global
        ctypes.CDLL(os.path.basename(path), mode=ctypes.RTLD_GLOBAL | os.RTLD_NOLOAD)
        return
    except OSError:
        pass
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        raise MissingRuntime(f"opt='parallel': loading the OpenMP runtime failed: {e}") from e


def openmp_runtime() -> str:
    """The path of the OpenMP runtime opt="parallel" code calls (libiomp5.so of `intel-openmp`)."""
    try:
        files = importlib.metadata.files("intel-openmp") or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    found = [f for f in files if f.name == "libiomp5.so"]
    if not found:
        raise MissingRuntime("opt='parallel' needs the OpenMP runtime of the intel-openmp package (libiomp5.so): "
                           "pip install intel-openmp")
    return str(found[0].locate())


def _runner_utils() -> str:
    """Path of MLIR's C runner utils library (memrefCopy for strided copies)."""
    lib_dir = os.path.join(os.path.dirname(ir.__file__), "lib")
    found = sorted(glob.glob(os.path.join(lib_dir, "libmlir_c_runner_utils.*")))
    if not found:
        raise MissingRuntime(f"libmlir_c_runner_utils not found in {lib_dir}; MLIR package incomplete?")
    return found[0]
