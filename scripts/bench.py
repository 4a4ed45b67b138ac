"""`make bench`: time eager, torch.compile (inductor) and torchtosa native code in one run.

For each model: compile time, time per call (median over repeats, after warmup) and the peak
resident memory that compiling and running added (VmHWM after, minus VmRSS before, with the
peak reset in between through /proc/self/clear_refs). Inductor gets a fresh cache directory
per run, so its compile time is a cold compile (pass --warm to reuse its default on-disk cache);
one-time library loading is paid by a throwaway compile before the first model.
Nothing here asserts on time: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import torchtosa  # noqa: E402


def _load(name: str, path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


demo = _load("torchtosa_demo", ROOT / "scripts" / "demo.py")
models = _load("torchtosa_test_models", ROOT / "tests" / "test_models.py")


def build_mlp_block() -> tuple[nn.Module, tuple]:
    return demo.MLPBlock(), (torch.randn(32, 64),)


# name -> builder of (model, inputs); BERT and the CNN are the verified models of tests/test_models.py.
BENCH_MODELS: dict[str, Callable[[], tuple[nn.Module, tuple]]] = {
    "demo MLPBlock [32x64]": build_mlp_block,
    "tiny BERT [2x8 tokens]": models.MODELS["bert"].build,
    "LeNet+BN CNN [2x1x32x32]": models.MODELS["lenet_bn"].build,
}


# ---------------------------------------------------------------- memory


def _status(key: str) -> int:
    """A /proc/self/status field in KiB."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+)", text, re.M)[1])


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- measuring


@dataclass
class Result:
    compile_s: float | None = None
    per_call_s: float | None = None
    peak_rss_mib: float | None = None
    error: str | None = None
    notes: list[str] = field(default_factory=list)


def time_per_call(fn: Callable[[], Any], warmup: int, repeats: int, min_batch_s: float = 0.02) -> float:
    """Median seconds per call over `repeats` batches; a batch is enough calls to last ~min_batch_s."""
    for _ in range(warmup):
        fn()
    start = time.perf_counter()
    fn()
    one = max(time.perf_counter() - start, 1e-7)
    number = max(1, int(min_batch_s / one))
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(number):
            fn()
        samples.append((time.perf_counter() - start) / number)
    return statistics.median(samples)


def measure(make: Callable[[], Callable[..., Any]], inputs: tuple, expected: Any, warmup: int,
            repeats: int) -> Result:
    """Compile with `make()` (+ first call), check the output, time calls; memory from before make()."""
    result = Result()
    gc.collect()
    can_peak = _reset_peak()
    before = _status("VmRSS")
    try:
        start = time.perf_counter()
        fn = make()
        out = fn(*inputs)  # torch.compile compiles on the first call: count it as compile time
        result.compile_s = time.perf_counter() - start
        got, want = _first_tensor(out), _first_tensor(expected)
        diff = (got - want).abs().max().item()
        result.notes.append(f"max|diff vs eager|={diff:.1e}")
        result.per_call_s = time_per_call(lambda: fn(*inputs), warmup, repeats)
    except Exception as err:
        result.error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if os.environ.get("TORCHTOSA_BENCH_TRACE"):
            traceback.print_exc()
    if can_peak:
        result.peak_rss_mib = (_status("VmHWM") - before) / 1024
    return result


def _first_tensor(out: Any) -> torch.Tensor:
    leaves = torch.utils._pytree.tree_leaves(out)
    return next(x for x in leaves if isinstance(x, torch.Tensor))


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def _fmt(x: float | None, unit: str, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}{unit}"


def _ratio(a: Result, b: Result) -> str:
    if a.per_call_s is None or b.per_call_s is None:
        return "-"
    return f"{a.per_call_s / b.per_call_s:.2f}x"


def _tiny(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warm", action="store_true", help="reuse inductor's default on-disk cache")
    parser.add_argument("--only", help="substring of a model name to run")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads for eager and inductor (torchtosa's native code runs "
                             "on one thread, so 1 compares like with like)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if not args.warm:
        cache = tempfile.mkdtemp(prefix="torchtosa-bench-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads, {os.cpu_count()} CPUs, "
          f"load average {load:.1f}; warmup {args.warmup}, median of {args.repeats} repeats; "
          f"inductor cache: {'default (warm)' if args.warm else 'fresh (cold compile)'}")
    if load > (os.cpu_count() or 1):
        print(f"warning: the machine is busy (load {load:.1f} > {os.cpu_count()} CPUs): times are noisy")

    # One-time costs (importing inductor, loading the MLIR libraries) go to a throwaway compile of a
    # tiny function first, so the first model's compile time and memory are not charged with them.
    with torch.no_grad():
        x = torch.randn(4)
        torch.compile(_tiny)(x)
        torchtosa.compile(_tiny, x)(x)
    torch._dynamo.reset()

    rows = []
    for name, build in BENCH_MODELS.items():
        if args.only and args.only not in name:
            continue
        torch.manual_seed(0)
        model, inputs = build()
        model.eval()
        results: dict[str, Result] = {}
        with torch.no_grad():
            expected = model(*inputs)
            results["eager"] = measure(lambda m=model: m, inputs, expected, args.warmup, args.repeats)
            torch._dynamo.reset()
            results["inductor"] = measure(lambda m=model: torch.compile(m), inputs, expected, args.warmup,
                                          args.repeats)
            torch._dynamo.reset()
            results["torchtosa"] = measure(lambda m=model, i=inputs: torchtosa.compile(m, *i), inputs,
                                           expected, args.warmup, args.repeats)
        results["eager"].compile_s = None  # nothing to compile
        rows.append((name, results))
        for backend, r in results.items():
            status = r.error or ", ".join(r.notes)
            print(f"  {name:26s} {backend:9s} compile {_fmt(r.compile_s, ' s', 2):>9s}  "
                  f"call {_fmt_time(r.per_call_s):>10s}  peak RSS +{_fmt(r.peak_rss_mib, ' MiB')}  {status}",
                  flush=True)

    print()
    print("| model | eager | inductor | torchtosa | torchtosa/eager | torchtosa/inductor "
          "| compile inductor | compile torchtosa | peak RSS +MiB eager / inductor / torchtosa |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        e, i, t = r["eager"], r["inductor"], r["torchtosa"]
        print(f"| {name} | {_fmt_time(e.per_call_s)} | {_fmt_time(i.per_call_s) if not i.error else 'failed'} "
              f"| {_fmt_time(t.per_call_s) if not t.error else 'failed'} | {_ratio(t, e)} | {_ratio(t, i)} "
              f"| {_fmt(i.compile_s, ' s', 2)} | {_fmt(t.compile_s, ' s', 2)} "
              f"| {_fmt(e.peak_rss_mib, '')} / {_fmt(i.peak_rss_mib, '')} / {_fmt(t.peak_rss_mib, '')} |")
    failures = [(name, backend, res.error) for name, r in rows for backend, res in r.items() if res.error]
    for name, backend, error in failures:
        print(f"{backend} failed on {name}: {error}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
