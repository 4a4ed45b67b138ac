"""The disk cache: a second process loads the compiled library instead of lowering and
compiling again; the key tells compiles apart; a damaged entry is compiled again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import json, torch, torchtosa
from torchtosa.api import CACHE
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.LayerNorm(128),
                            torch.nn.Linear(128, 10)).eval()
x = torch.randn(8, 64)
diffs = []
with torch.no_grad():
    for opt in ("default", "parallel"):
        diffs.append((torchtosa.compile(model, x, opt=opt)(x) - model(x)).abs().max().item())
print(json.dumps({"cached": [run.native.cached for _, run in CACHE.entries.values()], "diffs": diffs}))
"""


def _compile(folder: Path, env: dict[str, str]) -> dict:
    """Compile the model at opt "default" and "parallel" in a new process using the cache `folder`."""
    env = {**env, "TORCHTOSA_CACHE": "1", "TORCHTOSA_CACHE_DIR": str(folder), "TORCHTOSA_PROGRESS": "0"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_second_process_loads_the_library(tmp_path: Path, subprocess_env: dict[str, str]) -> None:
    """Each opt level its own entry; the second process loads both; a damaged cache is rebuilt."""
    first = _compile(tmp_path, subprocess_env)
    second = _compile(tmp_path, subprocess_env)
    assert first["cached"] == [False, False] and second["cached"] == [True, True]
    assert max(first["diffs"]) < 1e-5 and second["diffs"] == first["diffs"]
    assert len(list(tmp_path.glob("*.so"))) == len(list(tmp_path.glob("*.json"))) == 2
    assert all(json.loads(p.read_text())["scratch"] for p in tmp_path.glob("*.json"))  # the arena each call needs
    for library in tmp_path.glob("*.so"):
        library.unlink()
    again = _compile(tmp_path, subprocess_env)
    assert again["cached"] == [False, False] and again["diffs"] == first["diffs"]
