"""Python's garbage collector during a compile.

A compile allocates millions of short-lived objects (FX nodes, fake tensors, MLIR handles), so
Python runs full collections in the middle of it, and each walks every object of the process:
after importing torch and transformers ~0.5 million, ~0.3 s a collection, two or more in a
tiny Llama's first `generate`. `compile_objects_only()` freezes the objects that exist when a
compile starts (`gc.freeze`: the collector skips them) and puts them back when it ends
(`gc.unfreeze`), so its collections walk what the compile made. Nothing is kept from
collection: afterwards every object is collectable as before. A process that froze objects of
its own (a server before forking its workers) is left alone.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Iterator

__all__ = ["compile_objects_only"]

_lock = threading.Lock()
_depth = 0  # compiles running (nested or on other threads)
_froze = False  # whether the outermost one froze


@contextlib.contextmanager
def compile_objects_only() -> Iterator[None]:
    """Within: full collections skip the objects older than the outermost compile."""
    global _depth, _froze
    with _lock:
        if _depth == 0:
            _froze = gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _froze:
                gc.unfreeze()
                _froze = False
