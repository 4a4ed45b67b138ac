"""The native code's buffers of run-time sizes, kept for the next call.

A buffer the scratch arena can't hold (a size known at run time only: torch.compile(dynamic=True),
or one allocated inside a loop) is a `memref.alloc` that MLIR lowers to a call of
`_mlir_memref_to_llvm_alloc` (finalize-memref-to-llvm's generic allocation functions, pipeline.py).
`SOURCE` defines them: a freed buffer is kept (up to KEPT_BYTES in all, SLOTS buffers, the oldest
given back first) and handed out again for a request of at least half its size. Without it each
call's buffers were malloc'd anew, and glibc maps large blocks from the kernel, which zeroes every
page on first touch: a dynamic attention layer spent half its time in page faults (4.6 ms per call
instead of 9.2 on a Zen 4 core).

One copy serves the process: `library()` builds `SOURCE` into a shared library (once, in the
disk cache's `runtime/` folder or a temporary one) and loads it with RTLD_GLOBAL before any
compiled library, which leaves the two functions undefined; the JIT is given their addresses
(`addresses`). An exported library (library.py) compiles `SOURCE` into itself instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import tempfile
from pathlib import Path

from ..errors import CompileError
from . import disk_cache, toolchain

__all__ = ["SOURCE", "SYMBOLS", "addresses", "library"]

SYMBOLS = ("_mlir_memref_to_llvm_alloc", "_mlir_memref_to_llvm_free")
KEPT_BYTES = 256 << 20
SLOTS = 64

SOURCE = f"""/* torchtosa: buffers of run-time sizes, kept for the next call (runtime/execute/buffers.py). */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#define TT_SLOTS {SLOTS}
#define TT_KEPT_BYTES ((size_t){KEPT_BYTES})
#define TT_HEADER 64 /* before each buffer: its block's size; keeps any alignment up to 64 */

static struct {{ char *block; size_t size; uint64_t age; }} tt_kept[TT_SLOTS];
static size_t tt_kept_bytes;
static uint64_t tt_clock;
static pthread_mutex_t tt_lock = PTHREAD_MUTEX_INITIALIZER;

/* A kept block of at least `size` bytes and at most twice as many (the smallest), or NULL. */
static char *tt_take(size_t size)
{{
    int best = -1;
    for (int i = 0; i < TT_SLOTS; ++i)
        if (tt_kept[i].block && tt_kept[i].size >= size && tt_kept[i].size / 2 <= size
            && (best < 0 || tt_kept[i].size < tt_kept[best].size))
            best = i;
    if (best < 0)
        return NULL;
    char *block = tt_kept[best].block;
    tt_kept[best].block = NULL;
    tt_kept_bytes -= tt_kept[best].size;
    return block;
}}

void *_mlir_memref_to_llvm_alloc(size_t size)
{{
    pthread_mutex_lock(&tt_lock);
    char *block = tt_take(size);
    pthread_mutex_unlock(&tt_lock);
    if (!block) {{
        if (!(block = aligned_alloc(TT_HEADER, TT_HEADER + ((size + TT_HEADER - 1) / TT_HEADER) * TT_HEADER)))
            return NULL;
        *(size_t *)block = size;
    }}
    return block + TT_HEADER;
}}

void _mlir_memref_to_llvm_free(void *pointer)
{{
    if (!pointer)
        return;
    char *block = (char *)pointer - TT_HEADER;
    size_t size = *(size_t *)block;
    if (size > TT_KEPT_BYTES) {{
        free(block);
        return;
    }}
    char *evicted[TT_SLOTS];
    int n = 0;
    pthread_mutex_lock(&tt_lock);
    for (;;) {{ /* the oldest blocks go until there is a slot and room for this one */
        int open = -1, oldest = -1;
        for (int i = 0; i < TT_SLOTS; ++i) {{
            if (!tt_kept[i].block)
                open = open < 0 ? i : open;
            else if (oldest < 0 || tt_kept[i].age < tt_kept[oldest].age)
                oldest = i;
        }}
        if (open >= 0 && tt_kept_bytes + size <= TT_KEPT_BYTES) {{
            tt_kept[open].block = block;
            tt_kept[open].size = size;
            tt_kept[open].age = ++tt_clock;
            tt_kept_bytes += size;
            break;
        }}
        evicted[n++] = tt_kept[oldest].block;
        tt_kept[oldest].block = NULL;
        tt_kept_bytes -= tt_kept[oldest].size;
    }}
    pthread_mutex_unlock(&tt_lock);
    while (n > 0)
        free(evicted[--n]);
}}
"""


@functools.cache
def library() -> ctypes.CDLL | None:
    """`SOURCE` built for this machine (kept in the disk cache's `runtime/` folder when the cache
    is on) and loaded for the whole process (RTLD_GLOBAL), once; None without a C compiler."""
    try:
        compiler = toolchain.c_compiler()
    except CompileError:  # then the cache is off too: the JIT gets the C library's malloc and free
        return None
    name = f"buffers-{hashlib.sha256(SOURCE.encode()).hexdigest()[:16]}.so"
    root = disk_cache.folder()
    path = root / "runtime" / name if root is not None else None
    if path is not None and path.is_file():
        return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    with tempfile.TemporaryDirectory(prefix="torchtosa-rt-") as tmp:
        built = Path(tmp) / name
        (built.parent / "buffers.c").write_text(SOURCE)
        toolchain.run([compiler, "-shared", "-fPIC", "-O2", "-std=c11", "-o", name, "buffers.c", "-lpthread"],
                      cwd=tmp, what="build the buffer runtime (cc)")
        if path is not None:
            with contextlib.suppress(OSError):  # a read-only folder: loaded from here (mapped, the file may go)
                disk_cache.write(path, built.read_bytes())
                built = path
        return ctypes.CDLL(str(built), mode=ctypes.RTLD_GLOBAL)


def addresses() -> dict[str, int]:
    """The address of each of SYMBOLS, for the JIT: `library()`'s, else the C library's malloc and free."""
    lib = library()
    if lib is None:
        libc = ctypes.CDLL(None)
        return {SYMBOLS[0]: _address(libc.malloc), SYMBOLS[1]: _address(libc.free)}
    return {name: _address(getattr(lib, name)) for name in SYMBOLS}


def _address(function: ctypes._CFuncPtr) -> int:
    return ctypes.cast(function, ctypes.c_void_p).value or 0
