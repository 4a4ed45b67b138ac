"""AOTAutograd's results kept across processes for torch.compile(backend="torchtosa")
(torchtosa.capture.aot_cache): a second process takes every graph from PyTorch's AOTAutogradCache
instead of running AOTAutograd, and computes what eager does, for inference (symbolic sizes too)
and training; other options, or the disk cache off, keep nothing for it. With PyTorch's caching
precompile, Dynamo's work is kept too."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.fx as fx
from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

from torchtosa.capture import aot_cache

SCRIPT = '''
import sys
import torch
import torchtosa
from torch import nn
from torch._dynamo.utils import counters

options = {"opt": sys.argv[1]}
torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True).eval()
infer = torch.compile(layer, backend="torchtosa", dynamic=True, options=options)
diffs = []
with torch.no_grad():
    for tokens in (5, 9):
        x = torch.randn(2, tokens, 32)
        diffs.append(float((infer(x) - layer(x)).abs().max()))
mlp = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
twin = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
twin.load_state_dict(mlp.state_dict())
x = torch.randn(8, 16)
torch.compile(mlp, backend="torchtosa", options=options)(x).square().sum().backward()
twin(x).square().sum().backward()
diffs += [float((a.grad - b.grad).abs().max()) for a, b in zip(mlp.parameters(), twin.parameters())]
c = counters["aot_autograd"]
print(c["autograd_cache_saved"], c["autograd_cache_hit"], c["autograd_cache_miss"], max(diffs))
'''


def test_a_second_process_takes_aot_autograds_results_from_the_cache(tmp_path: Path,
                                                                      subprocess_env: dict[str, str]) -> None:
    """Two graphs (a dynamic encoder layer's inference graph, an MLP's forward and backward):
    saved by the first process, hits in the second, misses for other options; nothing kept
    with TORCHTOSA_CACHE=0. Every run agrees with eager."""
    (tmp_path / "run.py").write_text(textwrap.dedent(SCRIPT))
    env = dict(subprocess_env, TORCHTOSA_CACHE="1", TORCHTOSA_CACHE_DIR=str(tmp_path / "code"),
               TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "aot"))

    def run(opt: str, **changes: str) -> tuple[int, int, int, float]:
        done = subprocess.run([sys.executable, "run.py", opt], capture_output=True, text=True, check=False,
                              cwd=tmp_path, env=dict(env, **changes))
        assert done.returncode == 0, done.stderr[-3000:]
        out = done.stdout.split()
        saved, hits, misses, diff = out[-4:]
        assert float(diff) < 1e-4, out
        return int(saved), int(hits), int(misses), float(diff)

    # saved and hits (misses are not counted: the encoder's first trace restarts once its float
    # scalars are made tensors, AOTAutograd having looked its graph up, in every process)
    assert run("default")[:2] == (2, 0)
    assert run("default")[:2] == (0, 2)
    assert run("parallel")[:2] == (2, 0)  # the options are part of the key
    assert run("none", TORCHTOSA_CACHE="0")[:3] == (0, 0, 0)  # not even looked up


PRECOMPILED = '''
import sys
import torch
import torchtosa
from torch import nn
from torch._dynamo.utils import counters
from torchtosa.capture import aot_cache

loaded = []
post_compile = aot_cache.GraphCode.post_compile
aot_cache.GraphCode.post_compile = lambda self, *a: loaded.append(1) or post_compile(self, *a)
torch.manual_seed(int(sys.argv[1]))  # other weights in every process: they are the graph's inputs
mlp = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).eval()
x = torch.randn(int(sys.argv[2]), 16)
with torch.no_grad():
    diff = float((torch.compile(mlp, backend="torchtosa")(x) - mlp(x)).abs().max())
torch.compiler.save_cache_artifacts()  # what PyTorch asks of a user of caching precompile
print(counters["stats"]["unique_graphs"], len(loaded), diff)
'''


def test_pytorchs_caching_precompile_skips_dynamo_in_a_second_process(tmp_path: Path,
                                                                      subprocess_env: dict[str, str]) -> None:
    """With PyTorch's caching precompile on (TORCH_CACHING_PRECOMPILE=1) and its cache saved, a
    second process (other weights) neither traces with Dynamo nor runs AOTAutograd: it loads the
    kept graph (its native code from the disk cache) and agrees with eager; with torchtosa's
    cache off the kept graph still loads and compiles afresh. (A recompile after such a load
    fails inside torch 2.13, with Inductor too: aot_cache.py's docstring.)"""
    (tmp_path / "run.py").write_text(textwrap.dedent(PRECOMPILED))
    env = dict(subprocess_env, TORCH_CACHING_PRECOMPILE="1", TORCHTOSA_CACHE="1",
               TORCHTOSA_CACHE_DIR=str(tmp_path / "code"), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "aot"))

    def run(seed: int, rows: int, **changes: str) -> tuple[int, int]:
        done = subprocess.run([sys.executable, "run.py", str(seed), str(rows)], capture_output=True, text=True,
                              check=False, cwd=tmp_path, env=dict(env, **changes))
        assert done.returncode == 0, done.stderr[-3000:]
        traced, loaded, diff = done.stdout.split()[-3:]
        assert float(diff) < 1e-5, done.stdout
        return int(traced), int(loaded)

    assert run(0, 8) == (1, 0)  # traced by Dynamo, compiled
    assert run(1, 8) == (0, 1)  # Dynamo's bytecode and guards loaded, the graph with them
    assert run(2, 8, TORCHTOSA_CACHE="0") == (0, 1)


def test_a_graph_that_does_not_pickle_runs_uncached() -> None:
    """A graph GraphPickler can't take (here a node's value is a function) still compiles and
    runs; the cache is told to save nothing for it."""
    gm = fx.symbolic_trace(lambda x: torch.tanh(x) * 2)
    next(iter(gm.graph.nodes)).meta["val"] = lambda: None
    code = aot_cache.GraphCode(lambda g: lambda args: g(*args), gm)
    x = torch.randn(3)
    torch.testing.assert_close(code([x]), torch.tanh(x) * 2)
    with pytest.raises(BypassAOTAutogradCache, match="could not pickle"):
        code.prepare_for_serialization()


def test_a_graph_holding_a_tensor_is_not_kept(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A Dynamo graph with a tensor attribute of its own is not kept (the cache's key would have
    its sizes, not its values); one without is, while the disk cache is on."""
    monkeypatch.setenv("TORCHTOSA_CACHE", "1")
    monkeypatch.setenv("TORCHTOSA_CACHE_DIR", str(tmp_path))

    class Holding(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.randn(3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.table

    holding = fx.symbolic_trace(Holding())
    plain = fx.symbolic_trace(lambda x: torch.tanh(x) * 2)
    assert [aot_cache.enabled(g) for g in (holding, plain)] == [False, True]
    monkeypatch.setenv("TORCHTOSA_CACHE", "0")
    assert not aot_cache.enabled(plain)
