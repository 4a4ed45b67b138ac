"""Lookup of generated lowerings: the primary (tosa) registry first, then fallbacks."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

from ..errors import TorchTosaError

PRIMARY = "tosa"
ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Entry:
    """One lowering of one aten overload, from one YAML entry."""

    op: str  # "aten.permute.default"
    registry: str  # "tosa" or a fallback's name
    where: str  # "opdefs/shape.yaml:3"
    fn: Callable


@dataclass(frozen=True)
class Eager:
    """Why an overload has no lowering and runs with PyTorch, from opdefs/eager.yaml."""

    reason: str
    where: str  # "opdefs/eager.yaml:12"


@dataclass(frozen=True)
class Pattern:
    """A node group one torchtosa op replaces, from an entry's `match` (runtime/quant/passes/patterns.py)."""

    op: str  # "torchtosa.qlinear.default"
    where: str
    root: str  # the node whose value the op computes
    nodes: dict[str, tuple[str, list[tuple]]]  # name -> (overload, [("node", n) | ("bind", arg) | ...])
    fixed: dict[str, object]  # op arguments the pattern sets


@cache
def patterns() -> list[Pattern]:
    """Every node-group pattern, in opdefs order."""
    return list(_generated().PATTERNS)


def generator_inputs(root: Path = ROOT) -> list[Path]:
    """Every file the generated registry depends on."""
    files = [*root.glob("opdefs/*.yaml"), *root.glob("generator/*.py"), *root.glob("generator/*.lark"),
             *root.glob("generator/templates/*.j2"), root / "runtime" / "importer" / "rules.py",
             *root.glob("runtime/quant/*.py")]
    return sorted(p for p in files if p.is_file())



def source_hash(paths: list[Path], root: Path = ROOT) -> str:
    """A hash of the generator's inputs, stored in the generated registry."""
    h = hashlib.sha256()
    for path in sorted(paths):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@cache
def registry() -> dict[str, list[Entry]]:
    """aten overload name -> its lowerings, primary first; checks the registry is there and fresh."""
    generated = _generated()
    table: dict[str, list[Entry]] = {}
    for entry in generated.ENTRIES:
        table.setdefault(entry.op, []).append(entry)
    for entries in table.values():
        entries.sort(key=lambda e: e.registry != PRIMARY)
    return table


@cache
def eager_reasons() -> dict[str, Eager]:
    """Overloads left to PyTorch on purpose -> why."""
    return _generated().EAGER


def _generated() -> ModuleType:
    try:
        from .._generated import registry as generated
    except ImportError as err:
        raise TorchTosaError("the generated op registry is missing: run `make gen` "
                             f"(it renders opdefs/*.yaml into runtime/_generated) [{err}]") from None
    if (ROOT / "opdefs").is_dir() and (ROOT / "generator").is_dir():
        current = source_hash(generator_inputs())
        if current != generated.SOURCE_HASH:
            raise TorchTosaError("the generated op registry is stale: opdefs/ or generator/ changed since "
                                 "the last `make gen`; run `make gen`")
    return generated
