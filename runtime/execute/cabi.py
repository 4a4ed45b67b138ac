"""The C side of an exported library: its header, the C glue that calls the compiled function,
and the assembly that embeds the parameters.

The compiled function is `_mlir_ciface_<function>(in0..inN, out0..outM, arena...)`, each tensor
a pointer to a memref descriptor {allocated, aligned, offset, sizes[rank], strides[rank]}
(execute.py's calling convention). The glue's `<prefix>_run` takes plain pointers instead,
fills the descriptors of contiguous row-major arrays, points the parameters' descriptors into
the embedded read-only data and gives the function its scratch arena.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .native import TensorSpec, _contiguous_strides

ALIGNMENT = 64  # bytes: of the scratch arena (pipeline._ALIGNMENT) and of each embedded parameter

# C element type and the dtype's name in the header, per dtype
C_TYPES: dict[torch.dtype, tuple[str, str]] = {
    torch.float32: ("float", "float32"),
    torch.float64: ("double", "float64"),
    torch.float16: ("uint16_t", "float16 (IEEE half-precision bits)"),
    torch.bfloat16: ("uint16_t", "bfloat16 (bits)"),
    torch.int64: ("int64_t", "int64"),
    torch.int32: ("int32_t", "int32"),
    torch.int16: ("int16_t", "int16"),
    torch.int8: ("int8_t", "int8"),
    torch.uint8: ("uint8_t", "uint8"),
    torch.bool: ("uint8_t", "bool (one byte, 0 or 1)"),
}

_C_KEYWORDS = frozenset({
    "auto", "break", "case", "char", "const", "continue", "default", "do", "double", "else", "enum", "extern",
    "float", "for", "goto", "if", "inline", "int", "long", "register", "restrict", "return", "short", "signed",
    "sizeof", "static", "struct", "switch", "typedef", "union", "unsigned", "void", "volatile", "while", "bool",
    "true", "false", "NULL", "_Bool", "_Complex", "_Imaginary", "_Alignas", "_Alignof", "_Atomic", "_Generic",
    "_Noreturn", "_Static_assert", "_Thread_local",
})
# argument names that would clash with the header's own names
_RESERVED = frozenset({"scratch", "status", "ok", "err", "num"})


@dataclass(frozen=True)
class Port:
    """One tensor argument of the compiled function: a caller's array (`offset` None) or a
    parameter embedded in the library at byte `offset` of the constants."""

    name: str
    spec: TensorSpec
    offset: int | None = None

    @property
    def rank(self) -> int:
        return len(self.spec.shape)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.spec.shape:
            n *= int(d)
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * element_size(self.spec.dtype)

    @property
    def c_type(self) -> str:
        return C_TYPES[self.spec.dtype][0]

    @property
    def shape_text(self) -> str:
        return f"[{', '.join(str(d) for d in self.spec.shape)}]"

    def describe(self) -> str:
        return f"{C_TYPES[self.spec.dtype][1]} {self.shape_text}{' (a scalar)' if not self.rank else ''}"


@dataclass(frozen=True)
class Interface:
    """What the header and the glue say: the entry points' prefix, the compiled function, its
    tensors in argument order, its scratch arenas (bytes each) and notes for the header."""

    prefix: str
    function: str
    inputs: Sequence[Port]
    outputs: Sequence[Port]
    arenas: Sequence[int] = ()
    memref_copy: bool = False  # the compiled code calls memrefCopy (a strided copy): the glue defines it
    notes: Sequence[str] = field(default_factory=list)  # header comment lines: source, target, linking

    @property
    def args(self) -> list[Port]:
        """The caller's arrays: inputs that are not embedded, then outputs."""
        return [p for p in self.inputs if p.offset is None] + list(self.outputs)

    @property
    def scratch_bytes(self) -> int:
        return sum(_aligned(n) for n in self.arenas)

    @property
    def macro(self) -> str:
        return self.prefix.upper()

    def signature(self, scratch: bool = False) -> str:
        params = [f"const {p.c_type} *{p.name}" for p in self.inputs if p.offset is None]
        params += [f"{p.c_type} *{p.name}" for p in self.outputs]
        if scratch:
            params.append("void *scratch")
        suffix = "_with_scratch" if scratch else ""
        return f"int {self.prefix}_run{suffix}({', '.join(params)})"

    @property
    def exported(self) -> list[str]:
        """The symbols the library exports: its entry points only."""
        return [f"{self.prefix}_run", f"{self.prefix}_run_with_scratch"]


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def identifier(name: str) -> str:
    """`name` made a C identifier: other characters become `_`, a leading digit or a C keyword
    gets a `_` prefix or suffix."""
    ident = re.sub(r"\W", "_", name, flags=re.ASCII) or "_"
    if ident[0].isdigit():
        ident = "_" + ident
    return ident + "_" if ident in _C_KEYWORDS or keyword.iskeyword(ident) else ident


def argument_names(names: Sequence[str]) -> list[str]:
    """C parameter names, distinct even in upper case (the macros), none a name of the header."""
    taken: set[str] = set()
    result = []
    for name in names:
        ident = identifier(name)
        if ident.lower() in _RESERVED:
            ident += "_"
        base, n = ident, 1
        while ident.upper() in taken:
            ident, n = f"{base}_{n}", n + 1
        taken.add(ident.upper())
        result.append(ident)
    return result


def _aligned(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def constants_layout(tensors: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of parameters laid out one after another, each 64-byte aligned; total size."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end = _aligned(end + t.numel() * t.element_size())
    return offsets, end


def constants_blob(tensors: Sequence[torch.Tensor], offsets: Sequence[int], size: int) -> bytearray:
    """The parameters' bytes (contiguous, row-major), at `offsets`."""
    blob = bytearray(size)
    for t, offset in zip(tensors, offsets, strict=True):
        data = t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes()
        blob[offset:offset + len(data)] = data
    return blob


def constants_assembly(symbol: str, blob_file: str) -> str:
    """An assembly file embedding `blob_file` as the read-only, 64-byte aligned `symbol`
    (hidden: the library does not export it)."""
    return f"""/* The parameters of the model, embedded read-only (written by torchtosa.export_library). */
    .section .rodata.{symbol},"a",@progbits
    .balign {ALIGNMENT}
    .globl {symbol}
    .hidden {symbol}
    .type {symbol}, @object
{symbol}:
    .incbin "{blob_file}"
    .size {symbol}, . - {symbol}
    .section .note.GNU-stack,"",@progbits
"""


def header(iface: Interface, guard: str) -> str:
    """The C header: the entry points, and each array's dtype, shape, rank, dims and element
    count as comments, macros and `static const` shapes."""
    m = iface.macro
    table = [(p.name, f"{kind} {i}", p.shape_text, C_TYPES[p.spec.dtype][1])
             for kind, ports in (("input", [p for p in iface.inputs if p.offset is None]), ("output", iface.outputs))
             for i, p in enumerate(ports)]
    widths = [max(len(row[c]) for row in table) for c in range(3)]
    rows = [f" *   {a:<{widths[0]}}  {b:<{widths[1]}}  {c:<{widths[2]}}  {d}" for a, b, c, d in table]
    embedded = [p for p in iface.inputs if p.offset is not None]
    lines = ["/* C interface of a model compiled by torchtosa.export_library.", " *"]
    lines += [f" * {note}" for note in iface.notes]
    lines += [
        " *",
        f" *   {iface.signature()};",
        " *",
        " * Arguments: the inputs, then the outputs, each a contiguous row-major (C order) array of the",
        " * element type and shape below. The caller allocates the outputs; no array may overlap another.",
        *rows,
    ]
    if embedded:
        total = sum(p.nbytes for p in embedded)
        lines.append(f" * The model's {len(embedded)} parameter tensors ({total:,} bytes) are embedded in the library.")
    lines += [
        " *",
        f" * Returns {m}_OK (0) on success, {m}_ERR_NULL if an array (or the scratch buffer) is NULL,",
        f" * {m}_ERR_NOMEM if {iface.prefix}_run could not allocate its scratch buffer.",
        " *",
        f" * Threads: {iface.prefix}_run allocates a scratch buffer of {m}_SCRATCH_BYTES bytes per call and",
        " * frees it before returning, so calls from several threads at once are safe (the library has no",
        f" * mutable global state). {iface.prefix}_run_with_scratch uses the caller's buffer instead: 64-byte",
        f" * aligned, {m}_SCRATCH_BYTES bytes (NULL if that is 0), one per concurrent call, reusable.",
        " */",
        f"#ifndef {guard}",
        f"#define {guard}",
        "",
        "#include <stdint.h>",
        "",
        "#ifdef __cplusplus",
        'extern "C" {',
        "#endif",
        "",
        f"#define {m}_OK 0",
        f"#define {m}_ERR_NULL 1",
        f"#define {m}_ERR_NOMEM 2",
        f"#define {m}_NUM_INPUTS {len(iface.args) - len(iface.outputs)}",
        f"#define {m}_NUM_OUTPUTS {len(iface.outputs)}",
        f"#define {m}_SCRATCH_BYTES {iface.scratch_bytes}",
    ]
    for kind, ports in (("input", [p for p in iface.inputs if p.offset is None]), ("output", iface.outputs)):
        for i, p in enumerate(ports):
            name = f"{m}_{p.name.upper()}"
            lines += ["", f"/* {kind} {i}: {p.name}, {p.describe()} */", f"#define {name}_RANK {p.rank}"]
            lines += [f"#define {name}_DIM{d} {size}" for d, size in enumerate(p.spec.shape)]
            lines += [f"#define {name}_NUMEL {p.numel}", f"#define {name}_BYTES {p.nbytes}"]
            if p.rank:
                lines.append(f"static const int64_t {name}_SHAPE[{p.rank}] = {{{', '.join(map(str, p.spec.shape))}}};")
    lines += [
        "",
        f"/* Runs the model; returns {m}_OK (0) on success. */",
        f"{iface.signature()};",
        "",
        f"/* The same with a caller's scratch buffer of {m}_SCRATCH_BYTES bytes, 64-byte aligned. */",
        f"{iface.signature(scratch=True)};",
        "",
        "#ifdef __cplusplus",
        "}",
        "#endif",
        "",
        f"#endif /* {guard} */",
        "",
    ]
    return "\n".join(lines)


def glue(iface: Interface, header_file: str, constants: str | None) -> str:
    """The C source of the entry points: descriptors in, the compiled function called."""
    m = iface.macro
    ranks = sorted({p.rank for p in [*iface.inputs, *iface.outputs]} | ({1} if iface.arenas else set()))
    structs = []
    for r in ranks:
        dims = f" int64_t sizes[{r}]; int64_t strides[{r}];" if r else ""
        structs.append(f"struct tt_memref_{r} {{ void *allocated; void *aligned; int64_t offset;{dims} }};")
    arena_ports = ["struct tt_memref_1 *" for _ in iface.arenas]
    params = [f"struct tt_memref_{p.rank} *" for p in [*iface.inputs, *iface.outputs]] + arena_ports
    lines = [
        "/* Entry points of a model compiled by torchtosa.export_library: each array becomes the memref",
        " * descriptor {allocated, aligned, offset, sizes, strides} the compiled function takes. */",
        "#include <stdint.h>",
        "#include <stdlib.h>",
        "#include <string.h>",
        "",
        f'#include "{header_file}"',
        "",
        *structs,
        "",
        f"void _mlir_ciface_{iface.function}({', '.join(params)});",
    ]
    if constants is not None:
        lines.append(f"extern const unsigned char {constants}[];")
    if iface.memref_copy:
        lines += ["", _MEMREF_COPY]
    nonnull = " || ".join(f"!{p.name}" for p in iface.args)
    lines += [
        "",
        f"{iface.signature(scratch=True)}",
        "{",
        f"    if ({nonnull} || ({m}_SCRATCH_BYTES > 0 && !scratch))",
        f"        return {m}_ERR_NULL;",
    ]
    names = []
    for i, p in enumerate([*iface.inputs, *iface.outputs]):
        pointer = f"(void *)({constants} + {p.offset})" if p.offset is not None else f"(void *){p.name}"
        shape = [int(d) for d in p.spec.shape]
        dims = f", {{{', '.join(map(str, shape))}}}, {{{', '.join(map(str, _contiguous_strides(tuple(shape))))}}}" \
            if shape else ""
        lines.append(f"    struct tt_memref_{p.rank} a{i} = {{{pointer}, {pointer}, 0{dims}}};")
        names.append(f"&a{i}")
    offset = 0
    for j, size in enumerate(iface.arenas):
        pointer = f"(void *)((char *)scratch + {offset})"
        lines.append(f"    struct tt_memref_1 s{j} = {{{pointer}, {pointer}, 0, {{{size}}}, {{1}}}};")
        names.append(f"&s{j}")
        offset += _aligned(size)
    if not iface.arenas:
        lines.append("    (void)scratch;")
    args = ", ".join(p.name for p in iface.args)
    lines += [
        f"    _mlir_ciface_{iface.function}({', '.join(names)});",
        f"    return {m}_OK;",
        "}",
        "",
        f"{iface.signature()}",
        "{",
        "    void *scratch = NULL;",
        f"    if ({m}_SCRATCH_BYTES > 0 && !(scratch = aligned_alloc({ALIGNMENT}, {m}_SCRATCH_BYTES)))",
        f"        return {m}_ERR_NOMEM;",
        f"    int status = {iface.prefix}_run_with_scratch({args}, scratch);",
        "    free(scratch);",
        "    return status;",
        "}",
        "",
    ]
    return "\n".join(lines)


def version_script(iface: Interface) -> str:
    """A linker version script exporting only the entry points."""
    return "{\n  global:\n" + "".join(f"    {s};\n" for s in iface.exported) + "  local:\n    *;\n};\n"


# The strided copy MLIR's lowering of memref.copy calls for non-contiguous buffers (its
# runtime library is not linked into an exported library): element size, then the source and
# target as unranked memrefs {rank, descriptor}.
_MEMREF_COPY = """struct tt_unranked { int64_t rank; void *descriptor; };
struct tt_strided { char *allocated; char *aligned; int64_t offset; int64_t dims[]; };

static void tt_copy_dim(int64_t dim, int64_t rank, int64_t size, const int64_t *sizes,
                        const int64_t *from_strides, const int64_t *to_strides, const char *from, char *to)
{
    int64_t n = sizes[dim];
    if (dim == rank - 1 && from_strides[dim] == 1 && to_strides[dim] == 1) {
        memcpy(to, from, (size_t)(n * size));
        return;
    }
    for (int64_t i = 0; i < n; ++i) {
        const char *f = from + i * from_strides[dim] * size;
        char *t = to + i * to_strides[dim] * size;
        if (dim == rank - 1)
            memcpy(t, f, (size_t)size);
        else
            tt_copy_dim(dim + 1, rank, size, sizes, from_strides, to_strides, f, t);
    }
}

void memrefCopy(int64_t size, struct tt_unranked *from, struct tt_unranked *to);

void memrefCopy(int64_t size, struct tt_unranked *from, struct tt_unranked *to)
{
    const struct tt_strided *f = from->descriptor;
    const struct tt_strided *t = to->descriptor;
    int64_t rank = from->rank;
    const char *src = f->aligned + f->offset * size;
    char *dst = t->aligned + t->offset * size;
    if (rank == 0) {
        memcpy(dst, src, (size_t)size);
        return;
    }
    for (int64_t d = 0; d < rank; ++d)
        if (f->dims[d] == 0)
            return;
    tt_copy_dim(0, rank, size, f->dims, f->dims + rank, t->dims + rank, src, dst);
}"""
