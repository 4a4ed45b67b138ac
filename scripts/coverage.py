"""`make coverage`: write docs/coverage.md — core ATen coverage of the generated registry, and models.

Every fact in the page is computed here: the core ATen overloads are those of `torch.ops.aten`
tagged `torch.Tag.core`; an overload is lowered when the generated registry
(`torchtosa.importer.registry.registry()`) has an entry for it; the reason given for one that is not
is derived from torch's own metadata (schema, tags, the decomposition table capture applies).
The models are `MODELS` of tests/test_models.py: each is captured, compiled to native code and
compared with eager exactly as the test does (pass --no-run to only capture their graphs).
The OpInfo section is read from docs/opinfo.json, which tests/test_opinfo.py writes when run with
TORCHTOSA_OPINFO_JSON=1 (PyTorch's OpInfo samples through `torchtosa.compile`, against eager).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "coverage.md"
OPINFO = ROOT / "docs" / "opinfo.json"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

from torchtosa.capture.decompositions import DECOMPOSITIONS  # noqa: E402
from torchtosa.errors import TorchTosaError  # noqa: E402
from torchtosa.importer.registry import Entry, eager_reasons, registry  # noqa: E402
from torchtosa.importer.target import Target  # noqa: E402
from torchtosa.testing import lower_op  # noqa: E402

# The conformance columns: which samples of an entry each target is asked about.
TARGETS = {"TOSA-1.0+FP": "samples with a float tensor (f32/f16; indices and masks may be int/bool)",
           "TOSA-1.0+INT": "samples with only integer and bool tensors"}


def _load_models() -> Any:
    return _load_test_module("test_models")


def _load_test_module(name: str) -> Any:
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # test_ops imports the generator's spec loader
    path = ROOT / "tests" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"torchtosa_{name}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def aten_overloads() -> list[torch._ops.OpOverload]:
    """Every overload of every torch.ops.aten packet."""
    ops = []
    for name in dir(torch.ops.aten):
        try:
            packet = getattr(torch.ops.aten, name)
        except (AttributeError, RuntimeError):
            continue
        if isinstance(packet, torch._ops.OpOverloadPacket):
            ops.extend(getattr(packet, overload) for overload in packet.overloads())
    return sorted(ops, key=str)


def why_not(op: torch._ops.OpOverload, decomposed: set[Any]) -> tuple[str, str]:
    """(category, explanation) for an overload without an entry: opdefs/eager.yaml's reason, or
    one derived from torch's own metadata."""
    schema = op._schema
    tags = set(op.tags)
    known = eager_reasons().get(str(op))
    if known is not None:
        path, _, line = known.where.partition(":")
        return "left to eager", f"{known.reason} ([{known.where}](../{path}#L{line}))"
    if op in decomposed:
        return "decomposed before lowering", ("in capture's decomposition table (core ATen's and "
                                              "`capture/decompositions.py`'s), which it passes to AOTAutograd: "
                                              "captured graphs hold its decomposition instead")
    if schema.name.endswith("_backward"):
        return "backward op", ("only in autograd backward graphs, which torchtosa compiles like forward ones: "
                               "with no entry, it runs eagerly there")
    if schema.is_mutable:
        return "mutates an argument", ("schema has a write alias: functionalized graphs never hold it, and "
                                       "capture rejects in-place updates of inputs/buffers")
    if not any(isinstance(r.type, torch.TensorType) for r in schema.returns):
        kinds = ", ".join(str(r.type) for r in schema.returns)
        return "returns no tensor", (f"returns {kinds}: torchtosa compiles static-shape tensor programs "
                                     "(no entry)")
    notes = []
    if torch.Tag.nondeterministic_seeded in tags:
        notes.append("random: tagged `nondeterministic_seeded`")
    if torch.Tag.dynamic_output_shape in tags:
        notes.append("tagged `dynamic_output_shape`: its output shape can depend on data")
    if torch.Tag.data_dependent_output in tags:
        notes.append("tagged `data_dependent_output`")
    return "no entry", "; ".join(notes)


def _link(entry: Entry) -> str:
    path, _, line = entry.where.partition(":")
    return f"[{entry.where}](../{path}#L{line})" if line else entry.where


def _lowered_by(entries: list[Entry]) -> str:
    return ", ".join(f"{e.registry} ({_link(e)})" for e in entries)


@dataclass
class ModelStatus:
    name: str
    family: str
    ops: list[str]
    missing: list[str]
    verified: bool | None  # None: not run
    detail: str
    seconds: float


def check_models(models: Any, run: bool, only: str | None) -> list[ModelStatus]:
    """Capture every model (and, if `run`, compile it and compare with eager like the test does)."""
    table = registry()
    statuses = []
    for name, case in models.MODELS.items():
        if only and only not in name:
            continue
        start = time.perf_counter()
        verified, detail, ops = None, "not run (--no-run)", []
        if run:
            try:
                compiled = models.check_native(name)
                with torch.no_grad():  # the inference capture (with autograd, calls go through torch.compile)
                    captured = compiled.prepare(*models.instantiate(name)[1]).captured
                ops = sorted({str(n.target) for n in captured.gm.graph.nodes
                              if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)})
                verified, detail = True, "native == eager" + (f" (rtol {case.rtol}, atol {case.atol})"
                                                             if case.atol is not None else "")
            except Exception as err:
                verified, detail = False, f"{type(err).__name__}: {str(err).splitlines()[0]}"
        if not ops:
            try:
                ops = models.graph_ops(*models.instantiate(name))
            except Exception as err:
                detail += f"; capture failed: {type(err).__name__}: {str(err).splitlines()[0]}"
        missing = [op for op in ops if op not in table]
        statuses.append(ModelStatus(name, case.family, ops, missing, verified, detail,
                                    time.perf_counter() - start))
        mark = {True: "verified", False: "FAILED", None: "captured"}[verified]
        print(f"  {name:28s} {mark:9s} {len(ops):3d} ops, {len(missing):3d} without entry "
              f"({time.perf_counter() - start:.0f} s) {'' if verified else detail}", flush=True)
    return statuses


def conformance() -> dict[str, dict[str, str]]:
    """For each op and target of TARGETS: "yes (n)", "partly (k of n): why" or "no: why", from
    lowering every sample of its entries for the target and validating it (tosa-validate)."""
    ops = _load_test_module("test_ops")
    table = registry()
    tally: dict[tuple[str, str], list[str | None]] = {}
    for e, s in ops.CASES:
        if s.raises or s.unsupported:
            continue
        torch.manual_seed(0)
        args = ops.make_args(e, s)
        dtypes = {t.dtype for t in pytree.tree_leaves(args) if isinstance(t, torch.Tensor)}
        floats = {d for d in dtypes if d.is_floating_point}
        if floats - {torch.float32, torch.float16} or not dtypes:
            continue
        name = "TOSA-1.0+FP" if floats else "TOSA-1.0+INT"
        outcome: str | None = "no entry"
        for entry in table[e.op]:  # as the importer: the first entry that lowers it
            try:
                lower_op(entry, args, Target.parse(name))
                outcome = None
                break
            except TorchTosaError as err:
                outcome = _md(re.sub(r"\S*/", "", str(err).splitlines()[0] if str(err).strip() else repr(err)))
                if "\n" in str(err).strip():
                    outcome += " " + _md(str(err).strip().splitlines()[1].strip())
        tally.setdefault((e.op, name), []).append(outcome)
    result: dict[str, dict[str, str]] = {}
    for (op, name), outcomes in tally.items():
        bad = [o for o in outcomes if o is not None]
        n = len(outcomes)
        text = f"yes ({n})" if not bad else f"no: {bad[0]}" if len(bad) == n else \
            f"partly ({n - len(bad)} of {n}): {bad[0]}"
        result.setdefault(op, {})[name] = text[:220]
    return result


def _targets(conformant: dict[str, dict[str, str]], name: str) -> str:
    return " | ".join(conformant.get(name, {}).get(t, "—") for t in TARGETS)


def _md(text: str) -> str:
    """Table-safe text without this machine's paths (repo-relative, site-packages-relative)."""
    text = re.sub(r"\S*/site-packages/", "", text.replace(f"{ROOT}/", ""))
    return text.replace("|", "\\|").replace("\n", " ")


def load_opinfo(path: Path = OPINFO) -> dict[str, Any] | None:
    """docs/opinfo.json as tests/test_opinfo.py writes it, or None if it was never written."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None


def opinfo_headline(data: dict[str, Any] | None) -> str:
    if not data or not data.get("ops"):
        return ""
    ops = data["ops"].values()
    count = {k: sum(1 for r in ops if r["outcome"] == k) for k in ("pass", "fail", "unsupported")}
    samples = sum(sum(r["samples"].values()) for r in ops)
    return (f"PyTorch's OpInfo samples of the {len(data['ops'])} OpInfos whose op torchtosa maps: "
            f"{count['pass']} pass, {count['fail']} fail, {count['unsupported']} unsupported "
            f"({samples} samples compiled and compared with eager; "
            + ("every sample in every tested dtype" if data.get("full") else "first 3 samples in one dtype each")
            + ").")


def opinfo_section(data: dict[str, Any] | None) -> list[str]:
    lines = ["", "## PyTorch OpInfo samples", ""]
    if not data or not data.get("ops"):
        return [*lines, "No results: run `TORCHTOSA_OPINFO_JSON=1 .venv/bin/python -m pytest tests/test_opinfo.py` "
                        "(writes `docs/opinfo.json`), then `make coverage`."]
    table = registry()
    ran = data.get("torch", "?")
    lines += [
        "`tests/test_opinfo.py` compiles the samples of every OpInfo of `torch.testing._internal."
        "common_methods_invocations.op_db` whose aten op the registry maps with `torchtosa.compile` and",
        "compares each result with eager (`assert_close`, NaNs equal). Read from `docs/opinfo.json` "
        f"(torch {ran}; "
        + ("full run: every sample in every tested dtype" if data.get("full") else
           "bounded run as in `make test`: the first 3 samples in float32, or the OpInfo's first tested dtype")
        + "; regenerate it with `TORCHTOSA_OPINFO_JSON=1 .venv/bin/python -m pytest tests/test_opinfo.py`, "
        "`TORCHTOSA_OPINFO_FULL=1` for every sample and dtype).",
        "",
        "Result: **pass** when no sample fails and at least one passes; **fail** when a sample's "
        "result differs from eager or compiling it errs (the test then fails); **unsupported** when "
        "every sample run raised `torchtosa.Unsupported` (a spec's `limits`, an empty tensor, an op "
        "without entry). \"aten overloads\" are those in the captured graphs of its samples "
        "(*italic*: no registry entry).",
        "",
    ]
    if ran.split("+")[0] != torch.__version__.split("+")[0]:
        lines += [f"Note: these results are from torch {ran}, this page from torch {torch.__version__}.", ""]
    lines += ["| OpInfo | aten overloads | result | samples run | note |", "|---|---|---|---|---|"]
    for name, r in data["ops"].items():
        hits = " ".join(f"`{op}`" if op in table else f"*`{op}`*" for op in r.get("overloads", [])) or "—"
        counts = r["samples"]
        run = ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "none"
        result = {"fail": "**fail**"}.get(r["outcome"], r["outcome"])
        note = r["notes"][0] if r["notes"] else ""  # the first sample that did not pass, and why
        note = _md(note if len(note) <= 240 else note[:239] + "…")
        lines.append(f"| `{name}` | {hits} | {result} | {run} | {note} |")
    return lines


CORPUS = ROOT / "docs" / "corpus.json"


def corpus_section(path: Path = CORPUS) -> tuple[str, list[str]]:
    """Headline and section from docs/corpus.json (scripts/corpus.py): every program of the
    corpus run with the eager fallback, by outcome, and the ops that still run eagerly."""
    lines = ["", "## Programs: native, partly native, eager", ""]
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return "", [*lines, "No results: run `make corpus` (writes `docs/corpus.json`), then `make coverage`."]
    programs = data["programs"]
    kinds = sorted({k.split(":")[0] for k in programs}, key=lambda k: ("model", "ModuleInfo", "OpInfo").index(k))
    outcomes = ("native", "partly", "eager", "fail")
    count = {(kind, o): 0 for kind in kinds for o in outcomes}
    for key, r in programs.items():
        if r["outcome"] in outcomes:
            count[(key.split(":")[0], r["outcome"])] += 1
    total = {o: sum(count[(k, o)] for k in kinds) for o in outcomes}
    headline = (f"Of {sum(total.values())} programs (test models, torch.nn ModuleInfo and OpInfo samples) with the "
                f"default eager fallback: {total['native']} run fully native, {total['partly']} partly, "
                f"{total['eager']} only eagerly, {total['fail']} fail.")
    lines += [
        "`scripts/corpus.py` (`make corpus`) runs a corpus of small programs from PyTorch's own examples",
        "through `torchtosa.compile` with the default `fallback=\"eager\"` and compares each with eager: the",
        "first sample of every OpInfo of `op_db` (float32, or the OpInfo's first dtype), the first sample of",
        "every ModuleInfo of `module_db` (eval mode) and the test models. **native**: every op in native",
        "code; **partly**: some ops eager (or graph breaks between native graphs); **eager**: nothing",
        "native; **fail**: an error or a result that differs from eager. Programs eager rejects are not",
        f"counted. Read from `docs/corpus.json` (torch {data.get('torch', '?')}).",
        "",
        "| source | native | partly | eager | fail |",
        "|---|---|---|---|---|",
        *(f"| {k} | " + " | ".join(str(count[(k, o)]) for o in outcomes) + " |" for k in kinds),
        "| **all** | " + " | ".join(f"**{total[o]}**" for o in outcomes) + " |",
        "",
    ]
    reasons: dict[str, int] = {}
    for r in programs.values():
        for eager in set(r["eager"]):
            reasons[eager] = reasons.get(eager, 0) + 1
    lines += ["Why ops ran eagerly (op: reason, and in how many programs):", "",
              "| eager op: reason | programs |", "|---|---|"]
    lines += [f"| {_md(reason)} | {n} |" for reason, n in sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))]
    failed = {k: r for k, r in programs.items() if r["outcome"] == "fail"}
    if failed:
        lines += ["", "Failures:", "", "| program | error |", "|---|---|"]
        lines += [f"| {_md(k)} | {_md(r['detail'])} |" for k, r in sorted(failed.items())]
    return headline, lines


def render(models: list[ModelStatus], ran: bool, conformant: dict[str, dict[str, str]]) -> tuple[str, str]:
    table = registry()
    decomposed = set(DECOMPOSITIONS)
    all_ops = aten_overloads()
    core = [op for op in all_ops if torch.Tag.core in op.tags]
    core_names = {str(op) for op in core}
    used_by: dict[str, list[str]] = {}
    for m in models:
        for op in m.ops:
            used_by.setdefault(op, []).append(m.name)

    lowered = [op for op in core if str(op) in table]
    pct = 100 * len(lowered) / len(core)
    verified = [m for m in models if m.verified]
    if ran:
        model_part = f"{len(verified)} of {len(models)} test models run as native code and match eager"
    else:
        model_part = f"{len(models)} models captured (not run)"
    headline = (f"torchtosa lowers {len(lowered)} of {len(core)} core ATen overloads ({pct:.1f}%) "
                f"in torch {torch.__version__.split('+')[0]}; {model_part}.")

    opinfo = load_opinfo()
    opinfo_line = opinfo_headline(opinfo)
    corpus_line, corpus_lines = corpus_section()
    lines = [
        "# Coverage",
        "",
        "Generated by `make coverage` (`scripts/coverage.py`) from torch's operator registry, the",
        "generated op registry (`torchtosa.importer.registry.registry()`, rendered from `opdefs/*.yaml`), the",
        "models of `tests/test_models.py`, the OpInfo results of `tests/test_opinfo.py`",
        "(`docs/opinfo.json`) and the corpus run of `scripts/corpus.py` (`docs/corpus.json`). Do not edit by hand.",
        "",
        f"**{headline}**",
        "",
        *([f"**{opinfo_line}**", ""] if opinfo_line else []),
        *([f"**{corpus_line}**", ""] if corpus_line else []),
        "## Models",
        "",
        "Each model is built with random weights from a tiny config, captured, compiled to native code",
        "and compared with eager (same check as `tests/test_models.py::test_native`).",
        "",
        "| model | family | aten overloads in graph | without entry | native vs eager |",
        "|---|---|---|---|---|",
    ]
    for m in models:
        status = {True: "verified", False: "**failed**", None: "not run"}[m.verified]
        missing = " ".join(f"`{op}`" for op in m.missing) or "—"
        detail = "" if m.verified is not False else f": {_md(m.detail)}"
        lines.append(f"| `{m.name}` | {m.family} | {len(m.ops)} | {missing} | {status}{detail} |")

    by_reason: dict[str, int] = {}
    rows = []
    for op in core:
        name = str(op)
        entries = table.get(name, [])
        if entries:
            status, how = "lowered", _lowered_by(entries)
            if op in decomposed:
                how += "; unreachable through capture: in its decomposition table"
        else:
            reason, explanation = why_not(op, decomposed)
            status, how = "—", f"{reason}" + (f": {explanation}" if explanation else "")
            by_reason[reason] = by_reason.get(reason, 0) + 1
        models_using = ", ".join(used_by.get(name, [])) or ""
        rows.append(f"| `{name}` | {status} | {how} | {models_using} | {_targets(conformant, name)} |")

    lines += [
        "",
        f"## Core ATen overloads ({len(core)})",
        "",
        f"Overloads of `torch.ops.aten` tagged `torch.Tag.core` in torch {torch.__version__}: "
        f"**{len(lowered)} lowered ({pct:.1f}%)**, {len(core) - len(lowered)} not: "
        + ", ".join(f"{n} {reason}" for reason, n in sorted(by_reason.items(), key=lambda kv: -kv[1])) + ".",
        "",
        "The last columns say whether the op's samples (`opdefs/*.yaml`) lower to TOSA that MLIR's",
        "`tosa-validate` accepts for each target (" + "; ".join(f"{t}: {w}" for t, w in TARGETS.items()) + ").",
        "",
        "| overload | status | lowered by (registry, spec) / why not | in models | " + " | ".join(TARGETS) + " |",
        "|---|---|---|---|" + "---|" * len(TARGETS),
        *rows,
    ]

    extra = sorted(name for name in table if name not in core_names)
    lines += [
        "",
        f"## Non-core aten overloads with entries ({len(extra)})",
        "",
        "Entries for overloads not tagged core (graphs from `torch.export` or other decomposition tables",
        "can hold them). The note says when capture's own decomposition table removes the overload",
        "first; \"in models\" lists the models above whose captured graph holds it.",
        "",
        "| overload | lowered by (registry, spec) | note | in models | " + " | ".join(TARGETS) + " |",
        "|---|---|---|---|" + "---|" * len(TARGETS),
    ]
    overloads = {str(op): op for op in all_ops}
    for name in extra:
        op = overloads.get(name)
        if op is None:
            note = "not an overload of torch.ops.aten in this torch"
        elif op in decomposed:
            note = "in capture's decomposition table: capture decomposes it, so this entry is unreachable"
        else:
            note = ""
        lines.append(f"| `{name}` | {_lowered_by(table[name])} | {note} | {', '.join(used_by.get(name, []))} | "
                     f"{_targets(conformant, name)} |")
    lines += corpus_lines
    lines += opinfo_section(opinfo)
    return "\n".join(lines) + "\n", " ".join(x for x in (headline, opinfo_line, corpus_line) if x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true", help="only capture the models (no native run)")
    parser.add_argument("--only", help="substring of a model name (the page then lists only those)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    models = _load_models()
    statuses = check_models(models, run=not args.no_run, only=args.only)
    text, headline = render(statuses, ran=not args.no_run, conformant=conformance())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")
    print(headline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
