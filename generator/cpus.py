"""The CPU table, opdefs/cpus.yaml: entries checked, `base` refinements resolved.

Each entry is checked as an op entry is: unknown keys, features a CPU of its arch can't report,
widths that are not whole vectors, an int8 or bf16 dot product, bf16 matrix multiply,
vector-math library or bf16 rounding the entry's features don't provide, are errors at `make gen` with file:line:col.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .source import Located, load_yaml

KEYS = {
    "doc": "what the entry stands for",
    "base": "the entry this one refines",
    "arch": "x86_64 or aarch64",
    "llvm_cpu": "LLVM's CPU name (llc -mcpu)",
    "features": "instruction set flags as /proc/cpuinfo spells them (added to the base's)",
    "vector": "{bits, registers}",
    "fma_units": "vector FMAs issued per cycle",
    "cache": "{l1d, l2} in KiB per core",
    "int8_dot": "the int8 dot product of native int8 contractions",
    "vecmath": "libmvec's vector ABI variant, or none",
    "bf16_round": "how vectors of f32 round to bf16: an instruction set's, or integer",
    "bf16_dot": "the bf16 dot product of bf16 products read as stored, or none",
    "bf16_matmul": "the bf16 matrix multiply of bf16 products of 4 rows or more (amx), or none",
}
REQUIRED = ("doc", "arch", "llvm_cpu", "features", "vector", "fma_units", "cache", "int8_dot", "vecmath", "bf16_round",
            "bf16_dot", "bf16_matmul")

# The flags an entry may name, per arch (/proc/cpuinfo's spelling), and what each other choice needs.
FEATURES = {
    "x86_64": {"sse4_2", "sse4a", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "avx512f", "avx512bw",
               "avx512cd", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx512ifma",
               "avx512vbmi", "avx512_vp2intersect", "avx_vnni", "movdiri", "movdir64b", "gfni", "vaes", "vpclmulqdq",
               "amx_tile", "amx_int8", "amx_bf16"},
    "aarch64": {"asimd", "asimddp", "asimdhp", "fphp", "sve", "sve2", "i8mm", "bf16", "svei8mm", "svebf16"},
}
INT8_DOT = {"none": {"x86_64": set(), "aarch64": set()}, "avx512_vnni": {"x86_64": {"avx512_vnni"}},
            "avx_vnni": {"x86_64": {"avx_vnni"}}, "avx512bw": {"x86_64": {"avx512bw"}},
            "avx2": {"x86_64": {"avx2"}}, "asimddp": {"aarch64": {"asimddp"}}}
VECMATH = {"none": {"x86_64": set(), "aarch64": set()}, "avx2": {"x86_64": {"avx2"}},
           "avx512": {"x86_64": {"avx512f"}}}
BF16_ROUND = {"integer": {"x86_64": set(), "aarch64": set()}, "avx512_bf16": {"x86_64": {"avx512_bf16"}},
              "bf16": {"aarch64": {"bf16"}}}
BF16_DOT = {"none": {"x86_64": set(), "aarch64": set()}, "avx512_bf16": {"x86_64": {"avx512_bf16"}}}
BF16_MATMUL = {"none": {"x86_64": set(), "aarch64": set()}, "amx": {"x86_64": {"amx_tile", "amx_bf16"}}}
VECTOR_BITS = {"x86_64": (128, 256, 512), "aarch64": (128,)}  # the schedule's fixed-width vectors


@dataclass(frozen=True)
class CpuEntry:
    """One resolved entry: its own keys over its base's."""

    name: str
    doc: str
    arch: str
    llvm_cpu: str
    features: tuple[str, ...]
    vector_bits: int
    vector_registers: int
    fma_units: int
    l1d_kib: int
    l2_kib: int
    int8_dot: str
    vecmath: str
    bf16_round: str
    bf16_dot: str
    bf16_matmul: str
    where: str


def load_cpus(path: Path) -> list[CpuEntry]:
    """Every entry of the table, in file order, each checked and resolved against its bases."""
    top = Located("", str(path), 1, 1)
    data = load_yaml(path) or {}
    if not isinstance(data, dict):
        raise top.error("the CPU table is a mapping of entry names to entries")
    raw: dict[str, dict] = {}
    for name, entry in data.items():
        if not isinstance(entry, dict):
            raise _at(name, top).error(f"CPU entry {name!r} must be a mapping")
        for key in entry:
            if key not in KEYS:
                near = difflib.get_close_matches(str(key), KEYS, n=1)
                hint = f"did you mean {near[0]!r}? " if near else ""
                raise _at(key, top).error(f"unknown key {key!r} in {name}; {hint}valid keys: {', '.join(KEYS)}")
        raw[name] = entry
    return [_resolve(name, raw, top, ()) for name in raw]


def _at(value: Any, fallback: Located) -> Located:
    return value if isinstance(value, Located) else fallback


def _merged(name: str, raw: dict[str, dict], top: Located, seen: tuple[str, ...]) -> dict:
    """An entry's keys over its base's (features added to the base's)."""
    entry = raw[name]
    if name in seen:
        raise _at(name, top).error(f"CPU entry {name!r} is its own base ({' -> '.join([*seen, name])})")
    if "base" not in entry:
        return dict(entry)
    base = entry["base"]
    if base not in raw:
        near = difflib.get_close_matches(str(base), raw, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise _at(base, top).error(f"unknown base {base!r}{hint}")
    merged = _merged(str(base), raw, top, (*seen, name))
    for key, value in entry.items():
        merged[key] = [*merged.get(key, []), *value] if key == "features" else value
    return merged


def _resolve(name: str, raw: dict[str, dict], top: Located, seen: tuple[str, ...]) -> CpuEntry:
    at = next(k for k in raw if k == name)
    at = _at(at, top)
    e = _merged(name, raw, top, seen)
    missing = [k for k in REQUIRED if k not in e]
    if missing:
        raise at.error(f"CPU entry {name!r} lacks {', '.join(missing)} (its own or its base's)")
    arch = e["arch"]
    if arch not in FEATURES:
        raise _at(arch, at).error(f"unknown arch {arch!r}; one of {', '.join(FEATURES)}")
    features = e["features"]
    if not isinstance(features, list):
        raise at.error("features is a list of /proc/cpuinfo flags")
    for f in features:
        if f not in FEATURES[arch]:
            near = difflib.get_close_matches(str(f), FEATURES[arch], n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise _at(f, at).error(f"{f!r} is not an {arch} feature this table knows{hint}")
    vector, cache = e["vector"], e["cache"]
    if not (isinstance(vector, dict) and set(vector) == {"bits", "registers"}):
        raise at.error("vector is {bits: <width of a register>, registers: <how many>}")
    if vector["bits"] not in VECTOR_BITS[arch]:
        raise at.error(f"vector bits {vector['bits']} on {arch}: one of {VECTOR_BITS[arch]}")
    if not (isinstance(vector["registers"], int) and vector["registers"] >= 8):
        raise at.error("vector registers: at least 8 (accumulators and operands of a register tile)")
    if not (isinstance(cache, dict) and set(cache) == {"l1d", "l2"}
            and all(isinstance(v, int) and v > 0 for v in cache.values())):
        raise at.error("cache is {l1d: <KiB>, l2: <KiB>}, positive integers")
    if not (isinstance(e["fma_units"], int) and e["fma_units"] > 0):
        raise at.error("fma_units is a positive integer")
    for key, table in (("int8_dot", INT8_DOT), ("vecmath", VECMATH), ("bf16_round", BF16_ROUND),
                       ("bf16_dot", BF16_DOT), ("bf16_matmul", BF16_MATMUL)):
        choice = e[key]
        if choice not in table or arch not in table[choice]:
            valid = [c for c, archs in table.items() if arch in archs]
            raise _at(choice, at).error(f"{key} {choice!r} on {arch}: one of {', '.join(valid)}")
        lacking = table[choice][arch] - set(features)
        if lacking:
            raise _at(choice, at).error(f"{key} {choice!r} needs the features {sorted(lacking)}")
    return CpuEntry(name=str(name), doc=" ".join(str(e["doc"]).split()), arch=str(arch),
                    llvm_cpu=str(e["llvm_cpu"]), features=tuple(sorted(set(map(str, features)))),
                    vector_bits=vector["bits"], vector_registers=vector["registers"], fma_units=e["fma_units"],
                    l1d_kib=cache["l1d"], l2_kib=cache["l2"], int8_dot=str(e["int8_dot"]),
                    vecmath=str(e["vecmath"]), bf16_round=str(e["bf16_round"]), bf16_dot=str(e["bf16_dot"]),
                    bf16_matmul=str(e["bf16_matmul"]), where=at.where)
