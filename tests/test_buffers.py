"""Buffers of run-time sizes (execute/buffers.py): a freed buffer is handed out again, within
the runtime's bounds, and compiled code of dynamic shapes takes its buffers from it, with and
without the disk cache, computing what eager does while sizes grow and shrink."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import torchtosa
from torchtosa.api import CACHE
from torchtosa.execute import buffers, disk_cache, toolchain

_PROBE = textwrap.dedent("""
    import ctypes
    from torchtosa.execute import buffers
    lib = buffers.library()
    alloc, free = lib._mlir_memref_to_llvm_alloc, lib._mlir_memref_to_llvm_free
    alloc.restype, alloc.argtypes, free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]

    def reused(size, count):
        first = [alloc(size) for _ in range(count)]
        for p in first:
            free(p)
        again = [alloc(size) for _ in range(count)]
        for p in again:
            free(p)
        return len(set(first) & set(again))

    p = alloc(1 << 20); free(p)
    print(alloc(900_000) == p)  # at least half the kept block: it comes back
    q = alloc(400_000)
    print(q != p)  # less than half: a block of its own
    free(q); free(p)
    print(reused(3 << 20, buffers.SLOTS + 6))  # at most SLOTS kept
    print(reused(100 << 20, 3))  # at most KEPT_BYTES kept
""")


def test_a_freed_buffer_is_handed_out_again_within_bounds(tmp_path: Path) -> None:
    env = {**os.environ, disk_cache.ENV_SWITCH: "1", disk_cache.ENV_DIR: str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True,
                         env=env).stdout.split()
    assert out[:2] == ["True", "True"]
    assert int(out[2]) == buffers.SLOTS
    assert int(out[3]) == buffers.KEPT_BYTES // (100 << 20)
    assert list((tmp_path / "runtime").glob("buffers-*.so"))  # built once, kept with the compiled code


class _Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = torch.nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False)[0].relu()


@pytest.mark.parametrize("cache", [False, True], ids=["jit", "disk-cache"])
def test_dynamic_code_reuses_buffers_as_sizes_change(cache: bool, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Buffers kept from a larger call serve a smaller one and the other way round: the results
    are eager's at every size (a buffer handed out again holds the last call's values)."""
    if cache:
        monkeypatch.setenv(disk_cache.ENV_SWITCH, "1")
        monkeypatch.setenv(disk_cache.ENV_DIR, str(tmp_path))
    CACHE.clear()  # compiled anew (another test may have compiled the same graph)
    torch.manual_seed(0)
    model = _Attention().eval()
    compiled = torchtosa.compile(model, dynamic=True, fallback="error")  # one compile, all native
    with torch.no_grad():
        for batch, tokens in [(2, 40), (3, 75), (2, 41), (1, 9), (3, 75), (2, 20), (3, 77)]:
            x = torch.randn(batch, tokens, 64)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    if cache:
        # its buffers come from the runtime, not malloc; the heads are copied by rows of
        # memcpy (copies.row_copies), not element by element by the runner library's memrefCopy
        undefined = set().union(*(toolchain.undefined_symbols([p]) for p in tmp_path.glob("*.so")))
        assert buffers.SYMBOLS[0] in undefined and not {"malloc", "memrefCopy"} & undefined
    assert "serves sizes" in str(compiled.explain())
    CACHE.clear()
    torch._dynamo.reset()
