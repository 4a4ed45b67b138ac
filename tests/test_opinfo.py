"""PyTorch's own OpInfo samples, compiled with torchtosa.compile and compared with eager.

Which OpInfos: those of `op_db` whose aten op we map — `aten_name` names an op of the
registry (any overload), or is one of ALIASES (functional ops whose core-ATen graph is
a mapped op under another name, e.g. conv2d → convolution). Each sample becomes a
small function calling the OpInfo's op on the sample's tensors (the other arguments
are constants), compiled with `torchtosa.compile` and compared with eager
(`torch.testing.assert_close` at default tolerances, NaNs equal; for the `empty`
factories, whose values are unspecified, shapes and dtypes only).

Outcome of a sample: pass; unsupported (torchtosa raises Unsupported: a spec's
`limits`, an op without mapping in the graph); fail (a numeric mismatch,
InvalidInput although eager accepts it, or any other error). Samples eager rejects
are skipped. An OpInfo fails if any sample fails; that fails its test (fix the spec
or turn the case into a `limits` entry, never an xfail).

Bounds: `make test` runs the first OPINFO_SAMPLES samples in float32 (the OpInfo's
first supported dtype we have if it has no float32), all samples of one op in one
compiled function when they all work (one compilation per op), with a time budget of
OPINFO_BUDGET seconds per op after which the remaining samples are not run.
TORCHTOSA_OPINFO_FULL=1 runs every sample in every dtype of DTYPES the OpInfo supports.

Results file (for scripts/coverage.py): with TORCHTOSA_OPINFO_JSON=<path> (or =1 for
docs/opinfo.json) every test merges its OpInfo's result into that JSON file:

    {
      "torch": "2.13.0",                     # torch.__version__ of the run
      "full": false,                         # TORCHTOSA_OPINFO_FULL was set
      "ops": {
        "<OpInfo name>[.<variant>]": {       # e.g. "add", "max.reduction_with_dim"
          "aten": "add",                     # the OpInfo's aten_name
          "overloads": ["aten.add.Tensor"],  # aten overloads in the captured graphs of its samples
          "outcome": "pass",                 # "pass" | "fail" | "unsupported" (no sample passed or failed)
          "samples": {"pass": 3, "fail": 0, "unsupported": 0},
          "dtypes": {"float32": "pass"},     # outcome per dtype run, same words
          "notes": ["float32 #2: unsupported: ..."]   # first few unsupported/fail reasons
        }
      }
    }
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

import torchtosa
from torchtosa import InvalidInput, Unsupported
from torchtosa.capture.trace import capture
from torchtosa.importer.registry import registry

pytest.importorskip("expecttest")
from torch.testing._internal.common_methods_invocations import op_db

ROOT = Path(__file__).resolve().parent.parent
FULL = bool(os.environ.get("TORCHTOSA_OPINFO_FULL"))
OPINFO_SAMPLES = 3
OPINFO_BUDGET = float(os.environ.get("TORCHTOSA_OPINFO_BUDGET", "600" if FULL else "20"))
JSON_PATH = os.environ.get("TORCHTOSA_OPINFO_JSON", "")
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.bool]
# results whose values are unspecified: only their shapes and dtypes are compared
UNINITIALIZED = {"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided"}
# OpInfos whose float sums reassociate beyond assert_close's default tolerance on the samples'
# magnitudes: compared at the tolerance torch's own tests use against their numpy reference
# (TestCommon.test_numpy_refs; addbmm: 25 products of values up to 9 per element)
TOLERANCES = {"addbmm": {torch.float32: {"rtol": 1.3e-5, "atol": 1.3e-5}}}
# aten_name of an OpInfo → the aten op its core-ATen graph uses instead
ALIASES = {
    "conv1d": "convolution", "conv2d": "convolution", "conv3d": "convolution", "conv_transpose1d": "convolution",
    "conv_transpose2d": "convolution", "linear": "addmm", "softmax": "_softmax", "log_softmax": "_log_softmax",
    "layer_norm": "native_layer_norm", "max_pool2d": "max_pool2d_with_indices", "group_norm": "native_group_norm",
    "batch_norm": "_native_batch_norm_legit_no_training", "adaptive_avg_pool2d": "_adaptive_avg_pool2d",
    "matmul": "mm", "transpose": "permute", "t": "permute", "reshape": "view", "flatten": "view",
    "stack": "cat", "zeros_like": "full_like", "ones_like": "full_like", "clone": "clone",
    "cdist": "_cdist_forward", "nn.functional.pdist": "_pdist_forward",
    "nn.functional.embedding_bag": "_embedding_bag_forward_only",
}


def mapped_opinfos() -> list[Any]:
    names = {k.split(".")[1] for k in registry()}
    return [o for o in op_db if o.aten_name in names or ALIASES.get(o.aten_name) in names]


OPINFOS = mapped_opinfos()


def opinfo_id(o: Any) -> str:
    return o.name + (f".{o.variant_test_name}" if o.variant_test_name else "")


def dtypes_for(o: Any) -> list[torch.dtype]:
    supported = o.supported_dtypes("cpu")
    ours = [d for d in DTYPES if d in supported]
    return ours if FULL else ours[:1]


def _split(sample: Any) -> tuple[list[torch.Tensor], Any]:
    """The sample's tensors, and a function rebuilding (input, args, kwargs) from replacements."""
    leaves, spec = pytree.tree_flatten((sample.input, tuple(sample.args), dict(sample.kwargs)))
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def rebuild(tensors: tuple[torch.Tensor, ...]) -> Any:
        new = list(leaves)
        for i, t in zip(idx, tensors, strict=True):
            new[i] = t
        return pytree.tree_unflatten(new, spec)

    return [leaves[i] for i in idx], rebuild


def _call(o: Any, sample: Any, rebuild: Any, tensors: tuple[torch.Tensor, ...]) -> Any:
    inp, args, kwargs = rebuild(tensors)
    return o.op(inp, *args, **kwargs)


def _compare(got: Any, want: Any, values: bool = True, tolerances: dict | None = None) -> None:
    g_leaves, g_spec = pytree.tree_flatten(got)
    w_leaves, w_spec = pytree.tree_flatten(want)
    assert g_spec == w_spec, f"output structure {g_spec} != {w_spec}"
    for g, w in zip(g_leaves, w_leaves, strict=True):
        if isinstance(w, torch.Tensor) and not values:
            assert (g.shape, g.dtype) == (w.shape, w.dtype), f"{g.dtype}{list(g.shape)} != {w.dtype}{list(w.shape)}"
        elif isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w, equal_nan=True, **(tolerances or {}).get(w.dtype, {}))
        else:
            assert g == w


def _graph_overloads(gm: torch.fx.GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)}


def run_samples(o: Any, samples: list[Any], hits: set[str] | None = None) -> list[tuple[str, str]]:
    """(outcome, reason) of each sample, compiled together: one function returning every result.

    `hits` collects the aten overloads of the captured graph (captured again when compiling fails).
    """
    parts = [_split(s) for s in samples]
    tensors = [t for ts, _ in parts for t in ts]
    counts = [len(ts) for ts, _ in parts]

    def fn(*flat: torch.Tensor) -> Any:
        out, k = [], 0
        for (_, rebuild), n, s in zip(parts, counts, samples, strict=True):
            out.append(_call(o, s, rebuild, flat[k:k + n]))
            k += n
        return tuple(out)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            want = fn(*[t.clone() for t in tensors])
        except Exception as err:
            return [("skip", f"eager raises {type(err).__name__}: {err}")] * len(samples)
        compiled = torchtosa.CompiledFunction(fn, fallback="error")  # the op itself, never eager
        try:
            compiled.prepare(*tensors)
            got = compiled(*tensors)
        except Exception as err:
            if hits is not None and not compiled.compiled:
                with contextlib.suppress(Exception):  # capture itself may be what failed
                    hits |= _graph_overloads(capture(fn, tuple(tensors), {}).gm)
            if isinstance(err, Unsupported):
                return [("unsupported", str(err).splitlines()[0][:300])] * len(samples)
            if isinstance(err, InvalidInput):
                return [("fail", f"InvalidInput although eager accepts it: {str(err)[:500]}")] * len(samples)
            return [("fail", f"{type(err).__name__}: {str(err)[:500]}")] * len(samples)
        if hits is not None:
            for hit in compiled.compiled.values():
                hits |= _graph_overloads(hit.captured.gm)
    out = []
    for g, w in zip(got, want, strict=True):
        try:
            _compare(g, w, values=o.name not in UNINITIALIZED, tolerances=TOLERANCES.get(opinfo_id(o)))
            out.append(("pass", ""))
        except AssertionError as err:
            out.append(("fail", f"differs from eager: {str(err)[:500]}"))
    return out


def run_opinfo(o: Any) -> dict[str, Any]:
    start = time.monotonic()
    counts = {"pass": 0, "fail": 0, "unsupported": 0}
    per_dtype: dict[str, str] = {}
    notes: list[str] = []
    hits: set[str] = set()
    for dtype in dtypes_for(o):
        if time.monotonic() - start > OPINFO_BUDGET:
            break
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            samples = list(o.sample_inputs("cpu", dtype, requires_grad=False))
        if not FULL:
            samples = samples[:OPINFO_SAMPLES]
        results = run_samples(o, samples, hits) if samples else []
        if len(samples) > 1 and any(k != "pass" for k, _ in results):
            results = []  # attribute each outcome to its sample
            for s in samples:
                if time.monotonic() - start > OPINFO_BUDGET:
                    break
                results += run_samples(o, [s], hits)
        name = str(dtype).removeprefix("torch.")
        for i, (kind, why) in enumerate(results):
            if kind == "skip":
                continue
            counts[kind] += 1
            if kind != "pass" and len(notes) < 5:
                notes.append(f"{name} #{i}: {kind}: {why}")
        kinds = {k for k, _ in results}
        per_dtype[name] = "fail" if "fail" in kinds else "pass" if "pass" in kinds else "unsupported"
    if not dtypes_for(o):
        notes.append("no sample run: the OpInfo supports none of the dtypes tested on CPU ("
                     + ", ".join(str(d).removeprefix("torch.") for d in DTYPES) + ")")
    outcome = "fail" if counts["fail"] else "pass" if counts["pass"] else "unsupported"
    return {"aten": o.aten_name, "overloads": sorted(hits), "outcome": outcome, "samples": counts,
            "dtypes": per_dtype, "notes": notes}


def _record(name: str, result: dict[str, Any]) -> None:
    """Merge one OpInfo's result into the JSON file (locking its folder: xdist workers share it)."""
    path = ROOT / "docs" / "opinfo.json" if JSON_PATH == "1" else Path(JSON_PATH)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(path.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data: dict[str, Any] = {}
        with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
            data = json.loads(path.read_text())
        if data.get("torch") != torch.__version__ or data.get("full") != FULL:
            data = {"torch": torch.__version__, "full": FULL, "ops": {}}
        result["notes"] = [n.replace(f"{ROOT}/", "") for n in result["notes"]]  # paths relative to the repo
        data["ops"][name] = result
        data["ops"] = dict(sorted(data["ops"].items()))
        path.write_text(json.dumps(data, indent=1) + "\n")
    finally:
        os.close(lock)  # releases the lock


@pytest.mark.parametrize("o", OPINFOS, ids=[opinfo_id(o) for o in OPINFOS])
def test_opinfo_samples_match_eager(o: Any) -> None:
    result = run_opinfo(o)
    if JSON_PATH:
        _record(opinfo_id(o), result)
    assert result["outcome"] != "fail", f"{opinfo_id(o)}: {result['samples']}\n" + "\n".join(result["notes"])
