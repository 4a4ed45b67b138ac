"""as_strided end to end: it reads the storage beneath its input, whose layout the importer (and the
partitioner's check-only calls) take from PyTorch's metadata of each graph value (Tensor.layout),
and the compiled signature holds for graph inputs. Views of inputs (permutes, slices), fresh
intermediates, inputs that are views themselves, and the layouts that are not lowered. The
lowered cases compile with the default eager fallback: tests make a FallbackWarning an error, so
they also check that the partitioner finds as_strided native."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import torchtosa

X = torch.arange(24.0).reshape(4, 6)

CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "input-window": lambda x: x.as_strided((3, 3), (1, 1)) * 2,
    "input-contiguous-view": lambda x: x.as_strided((3, 6), (6, 1), 6) + 1,
    "permute": lambda x: x.t().as_strided((2, 2), (1, 2)) * 2,
    "permute-transposed-back": lambda x: x.t().as_strided((4, 6), (6, 1)) + 0,
    "fresh-intermediate": lambda x: (x + 1).as_strided((2, 2), (1, 2), 3) * 2,
    "slice-with-offset": lambda x: x[1:].as_strided((2, 2), (1, 2)) * 2,
    "slice-explicit-offset": lambda x: x[1:].as_strided((5,), (3,), 7) * 2,
    "view-then-window": lambda x: x.view(24).as_strided((6, 5), (3, 1)).sum(1),
}


@pytest.mark.parametrize("name", CASES)
def test_as_strided_of_graph_values_matches_eager(name: str) -> None:
    fn = CASES[name]
    torch.testing.assert_close(torchtosa.compile(fn, X)(X), fn(X), rtol=0, atol=0)


def test_as_strided_of_a_non_contiguous_input_reads_its_storage() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.as_strided((3, 4), (4, 1), 2) * 1

    base = torch.arange(24.0).reshape(4, 6)
    compiled = torchtosa.compile(fn, base.t())
    torch.testing.assert_close(compiled(base.t()), fn(base.t()), rtol=0, atol=0)
    # the same shape laid out contiguously is another signature: compiled again, not reused
    dense = base.t().contiguous()
    torch.testing.assert_close(compiled(dense), fn(dense), rtol=0, atol=0)
    assert not torch.equal(fn(dense), fn(base.t()))


def test_as_strided_of_a_view_with_gaps_is_unsupported() -> None:
    with pytest.raises(torchtosa.Unsupported, match="does not fill its storage densely"):
        torchtosa.compile(lambda x: x[:, :2].as_strided((2, 2), (1, 6)) * 2, X, fallback="error")


def test_as_strided_reading_outside_its_input_is_unsupported() -> None:
    with pytest.raises(torchtosa.Unsupported, match="outside its"):
        torchtosa.compile(lambda x: x[:2].as_strided((3, 6), (6, 1)) * 2, X, fallback="error")


def _issue_31(x: torch.Tensor) -> torch.Tensor:
    """An empty slice of an expanded view: its storage offset (4) lies beyond its own elements."""
    base = torch.ops.aten.as_strided(x, (4,), (1,), 0)
    return torch.ops.aten.as_strided(base.expand(1, 4)[1:1], (1,), (1,))


EAGER_READS = {
    "empty-slice-of-expand": _issue_31,
    "permuted-base": lambda x: (x.t() * 2)[1:].as_strided((2, 2), (1, 2), 0) + 1,
    "permuted-base-empty-slice": lambda x: (x.t() * 2)[1:1].as_strided((2, 2), (1, 2), 3) + 1,
    "native-base-viewed": lambda x: (x * 2).view(2, 12)[:, 0:0].as_strided((3,), (2,), 5) * 3,
}


@pytest.mark.parametrize("name", EAGER_READS)
def test_eager_as_strided_reads_the_storage_eager_would(name: str) -> None:
    """An as_strided that runs eagerly (its input is empty, or not a dense block) reads the storage
    beneath its input: the views it reads through run eagerly too, on a base laid out as the graph
    says (a native region returns a fresh contiguous tensor). Issue 31: a native expand gave the
    empty slice a 4-element storage, and as_strided at offset 4 read out of bounds."""
    fn = EAGER_READS[name]
    x = torch.arange(8.0) if name == "empty-slice-of-expand" else X
    with pytest.warns(torchtosa.FallbackWarning, match="eagerly"):
        compiled = torchtosa.compile(fn, x)
    torch.testing.assert_close(compiled(x), fn(x), rtol=0, atol=0)
    with pytest.warns(torchtosa.FallbackWarning, match="eagerly"):
        torch.testing.assert_close(torch.compile(fn, backend="torchtosa")(x), fn(x), rtol=0, atol=0)
    views = [p for p in compiled.explain().eager if "storage an eager aten.as_strided" in p.reason]
    assert views or name == "permuted-base-empty-slice"  # there the eager slice is the only view
