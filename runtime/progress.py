"""A progress line on stderr for a compile that takes longer than `DELAY` seconds.

    with progress.reporting("forward"):      # silent if done within DELAY
        progress.stage("import to TOSA")     # what the compile is doing now
        ...

Once DELAY has passed, each stage prints `torchtosa: compiling forward: <stage> (<seconds> s)`
as it starts, and the end prints `torchtosa: compiled forward in <seconds> s`.
`TORCHTOSA_PROGRESS=0` turns it off.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

DELAY = 2.0


class _Progress:
    def __init__(self, what: str) -> None:
        self.what, self.current, self.shown = what, "starting", False
        self.start = time.perf_counter()
        self.lock = threading.Lock()

    def stage(self, name: str) -> None:
        with self.lock:
            self.current = name
            if self.shown:
                self._line()

    def show(self) -> None:
        with self.lock:
            self.shown = True
            self._line()

    def _line(self) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"torchtosa: compiling {self.what}: {self.current} ({elapsed:.1f} s)", file=sys.stderr, flush=True)


_ACTIVE: ContextVar[_Progress | None] = ContextVar("torchtosa_progress", default=None)


@contextmanager
def reporting(what: str) -> Iterator[None]:
    """Report the stages of compiling `what` if it takes longer than DELAY seconds."""
    if os.environ.get("TORCHTOSA_PROGRESS", "1") == "0" or _ACTIVE.get() is not None:
        yield
        return
    progress = _Progress(what)
    timer = threading.Timer(DELAY, progress.show)
    timer.daemon = True
    token = _ACTIVE.set(progress)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        _ACTIVE.reset(token)
        with progress.lock:
            if progress.shown:
                print(f"torchtosa: compiled {what} in {time.perf_counter() - progress.start:.1f} s",
                      file=sys.stderr, flush=True)


def stage(name: str) -> None:
    """Name what the current compile does now (nothing outside `reporting`)."""
    progress = _ACTIVE.get()
    if progress is not None:
        progress.stage(name)
