"""Python's collector during a compile (torchtosa.garbage): the objects older than the compile are
frozen while it runs and put back after; a process's own frozen objects are left alone."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch

import torchtosa
from torchtosa import api, garbage


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_older_objects_are_frozen_within_and_back_after(unfrozen: None) -> None:
    old = [object()]
    with garbage.compile_objects_only():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with garbage.compile_objects_only():  # nested (a backend's compile inside a capture)
            assert gc.get_freeze_count() >= frozen
        assert gc.get_freeze_count() == frozen  # still frozen until the outermost ends
    assert gc.get_freeze_count() == 0
    assert gc.is_tracked(old)


def test_the_processes_own_freeze_is_left_alone(unfrozen: None) -> None:
    gc.freeze()
    frozen = gc.get_freeze_count()
    with garbage.compile_objects_only():
        pass
    assert gc.get_freeze_count() == frozen


def test_a_compile_lowers_with_the_older_objects_frozen(unfrozen: None, monkeypatch: pytest.MonkeyPatch) -> None:
    counts: list[int] = []
    lower = api.CACHE.get

    def get(*args: object, **kwargs: object) -> object:
        counts.append(gc.get_freeze_count())
        return lower(*args, **kwargs)

    monkeypatch.setattr(api.CACHE, "get", get)
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()), torch.randn(2, 8)
    compiled = torchtosa.compile(model, x)
    torch.testing.assert_close(compiled(x), model(x))
    assert counts and min(counts) > 0
    assert gc.get_freeze_count() == 0
