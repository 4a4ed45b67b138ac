"""Does every program run? A corpus of small programs from PyTorch's own examples, through
`torchtosa.compile` with the default eager fallback, each compared with eager.

The corpus: the first sample of every OpInfo in `op_db` (in float32, or the first dtype the
OpInfo supports), the first sample of every ModuleInfo in `module_db` (torch.nn modules in
eval mode), and the models of tests/test_models.py. Each program is classified by what
`explain()` says ran where:

- native: every aten op in native code;
- partly: some ops native, some eager (or graph breaks between native graphs);
- eager: none native (every op is one TOSA cannot hold, e.g. complex or sparse);
- fail: torchtosa raised, a region fell back on torchtosa's own error (`explain().failures`:
  the program runs, but it is a bug), or the result differs from eager (the goal is none).

Programs eager itself rejects are not counted. Results go to docs/corpus.json, which
scripts/coverage.py turns into a section of docs/coverage.md.

    python scripts/corpus.py [--only SUBSTRING] [--limit N]
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
import torch.utils._pytree as pytree

import torchtosa
from torchtosa.regions import EagerOp, NativeRegion

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "corpus.json"
DTYPES = [torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.float16, torch.bfloat16,
          torch.uint8, torch.int8, torch.int16, torch.complex64]

Program = tuple[str, str, Callable[..., Any], tuple[Any, ...]]  # (source, name, fn, inputs)
# factories whose values are uninitialized: only shapes and dtypes are compared
UNINITIALIZED = ("empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided")


def _load(path: Path, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def opinfo_programs() -> Iterator[Program]:
    from torch.testing._internal.common_methods_invocations import op_db

    for o in op_db:
        name = o.name + (f".{o.variant_test_name}" if o.variant_test_name else "")
        supported = o.supported_dtypes("cpu")
        dtype = next((d for d in DTYPES if d in supported), None)
        if dtype is None:
            continue
        torch.manual_seed(0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sample = next(iter(o.sample_inputs("cpu", dtype, requires_grad=False)))
        except Exception:
            continue
        leaves, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
        idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

        def fn(*tensors: torch.Tensor, o=o, leaves=leaves, spec=spec, idx=idx) -> Any:
            new = list(leaves)
            for i, t in zip(idx, tensors, strict=True):
                new[i] = t
            inp, args, kwargs = pytree.tree_unflatten(new, spec)
            return o.op(inp, *args, **kwargs)

        if o.name in UNINITIALIZED:
            fn = _shape_and_dtype(fn)
        yield "OpInfo", f"{name} ({str(dtype).removeprefix('torch.')})", fn, tuple(leaves[i] for i in idx)


def _shape_and_dtype(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` whose tensor results are replaced by zeros of their shape and dtype."""
    return lambda *args: pytree.tree_map(lambda t: torch.zeros_like(t) if isinstance(t, torch.Tensor) else t,
                                         fn(*args))


def module_programs() -> Iterator[Program]:
    from torch.testing._internal.common_modules import module_db

    for m in module_db:
        torch.manual_seed(0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                info = next(iter(m.module_inputs_func(m, device="cpu", dtype=torch.float32, requires_grad=False,
                                                      training=False)))
                if info.forward_input is None:
                    continue
                module = m.module_cls(*info.constructor_input.args, **info.constructor_input.kwargs).eval()
        except Exception:
            continue
        args, kwargs = info.forward_input.args, info.forward_input.kwargs
        if kwargs:
            continue

        yield "ModuleInfo", m.name, module, tuple(args)


def model_programs() -> Iterator[Program]:
    models = _load(ROOT / "tests" / "test_models.py", "torchtosa_test_models")
    for name in models.MODELS:
        model, inputs = models.instantiate(name)
        yield "model", name, model, tuple(inputs)


def classify(fn: Callable[..., Any], inputs: tuple[Any, ...]) -> tuple[str, str, list[str]]:
    """(outcome, detail, eager ops with reasons) of one program."""
    clones = lambda: tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)  # noqa: E731
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = fn(*clones())
    except Exception as err:
        return "skip", f"eager raises {type(err).__name__}", []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torchtosa.compile(fn)
            got = compiled(*clones())
        explanation = compiled.explain()
    except Exception as err:
        return "fail", f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}", []
    try:
        _compare(got, want)
    except AssertionError as err:
        return "fail", f"differs from eager: {str(err).splitlines()[0][:200]}", []
    if explanation.failures:
        return "fail", f"runs eagerly after internal error {explanation.failures[0].short()}"[:200], []
    eager = [f"{p.op}: {p.reason}" for p in explanation.parts if isinstance(p, EagerOp)]
    native = any(isinstance(p, NativeRegion) for p in explanation.parts)
    if not native:
        return "eager", "", eager
    return ("partly" if eager or explanation.notes else "native"), "; ".join(explanation.notes)[:200], eager


def _compare(got: Any, want: Any) -> None:
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    assert g_spec == w_spec, f"output structure {g_spec} != {w_spec}"
    for g, w in zip(g_leaves, w_leaves, strict=True):
        if isinstance(w, torch.Tensor):
            if w.is_sparse or w.layout != torch.strided:
                assert g.layout == w.layout
                continue
            torch.testing.assert_close(g, w, equal_nan=True, rtol=1e-4, atol=1e-4, check_stride=False)
        elif isinstance(w, float):
            assert abs(g - w) <= 1e-4 * max(1.0, abs(w)), f"{g} != {w}"
        else:
            assert g == w, f"{g} != {w}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="only programs whose name contains this")
    parser.add_argument("--limit", type=int, default=0, help="at most this many programs per source")
    args = parser.parse_args(argv)
    # with --only, the other programs' results are kept
    results: dict[str, dict[str, Any]] = json.loads(OUT.read_text())["programs"] if args.only and OUT.exists() else {}
    start = time.perf_counter()
    for source in (model_programs, module_programs, opinfo_programs):
        count = 0
        for kind, name, fn, inputs in source():
            if args.only and args.only not in name:
                continue
            if args.limit and count >= args.limit:
                break
            count += 1
            t0 = time.perf_counter()
            outcome, detail, eager = classify(fn, inputs)
            torch._dynamo.reset()
            results[f"{kind}: {name}"] = {"outcome": outcome, "detail": detail, "eager": eager}
            print(f"[{time.perf_counter() - start:6.0f}s] {kind:10s} {name:50s} {outcome:7s} "
                  f"{time.perf_counter() - t0:5.1f}s {detail[:80]}", flush=True)
    counts = collections.Counter((k.split(":")[0], r["outcome"]) for k, r in results.items())
    results = dict(sorted(results.items()))
    OUT.write_text(json.dumps({"torch": torch.__version__, "programs": results}, indent=1, sort_keys=True) + "\n")
    print(dict(counts))
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
