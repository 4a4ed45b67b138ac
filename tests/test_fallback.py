"""Any program runs: native regions where the registries lower the ops, PyTorch between them.

Every test compares with eager on random data and checks what ran where (explain()), so a
silent fallback of everything would fail as surely as a wrong answer.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import torchtosa
from torchtosa import FallbackWarning, Unsupported
from torchtosa.regions import EagerOp, NativeRegion

STRICT = {"fallback": "error"}


def regions(explanation: torchtosa.Explanation) -> list[str]:
    """'native' or the eager op, in graph order."""
    return ["native" if isinstance(p, NativeRegion) else p.op for p in explanation.parts]


def eager_ops(explanation: torchtosa.Explanation) -> dict[str, str]:
    return {p.op: p.reason for p in explanation.parts if isinstance(p, EagerOp)}


class TopkBetweenLinears(nn.Module):
    """The issue's example: an op without a TOSA lowering between two native regions."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = torch.topk(self.a(x), 4)
        return self.b(values).relu(), indices


def _no_topk_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make sure topk is not lowered (whether or not an entry exists): the test is about fallback."""
    from torchtosa.importer import registry as reg

    table = dict(reg.registry())
    table.pop("aten.topk.default", None)
    monkeypatch.setattr(reg, "registry", lambda: table)
    monkeypatch.setattr("torchtosa.importer.support.registry", lambda: table)
    monkeypatch.setattr("torchtosa.importer.graph.registry", lambda: table)


@torch.no_grad()  # inference graphs (with autograd, see test_training.py)
def test_topk_between_linears_runs_through_both_apis(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_topk_entry(monkeypatch)
    torchtosa.api.CACHE.clear()
    model, x = TopkBetweenLinears().eval(), torch.randn(3, 16)
    want = model(x)
    with pytest.warns(FallbackWarning, match=r"1 of \d+ ops run eagerly: aten.topk.default \(no mapping"):
        compiled = torchtosa.compile(model, x)
    got = compiled(x)
    torch.testing.assert_close(got, want)
    assert regions(compiled.explain()) == ["native", "aten.topk.default", "native"]
    assert "test_fallback.py" in str(compiled.explain())  # the user's source line of topk

    with pytest.warns(FallbackWarning, match="aten.topk.default"):
        got = torch.compile(model, backend="torchtosa")(x)
    torch.testing.assert_close(got, want)

    with pytest.raises(Unsupported, match=r"aten.topk.default .*test_fallback.py:\d+"):
        torchtosa.compile(model, x, **STRICT)
    with pytest.raises(Unsupported, match=r"aten\.topk\.default"):
        torch.compile(model, backend="torchtosa", options=STRICT)(x)
    with pytest.raises(Unsupported, match=r"aten\.topk\.default"):
        torchtosa.to_tosa(model, x)  # one TOSA module or an error: always strict


@torch.no_grad()
def test_explain_lists_regions_with_reasons(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_topk_entry(monkeypatch)
    model, x = TopkBetweenLinears().eval(), torch.randn(3, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        text = str(torchtosa.explain(model, x))
    lines = text.splitlines()
    assert lines[0].startswith("native region 0: 2 ops (aten.addmm.default x1, aten.permute.default x1)")
    assert lines[1].startswith("eager  aten.topk.default: no mapping in any registry — at ")
    assert "torch.topk(self.a(x), 4)" in lines[1]
    assert lines[2].startswith("native region 1: 3 ops (aten.addmm.default x1, aten.permute.default x1, aten.relu")


def test_small_regions_run_eagerly_under_min_region_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    _no_topk_entry(monkeypatch)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.topk(x * 2, 3).values + 1

    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        one = torchtosa.compile(fn, x, min_region_ops=1)
        two = torchtosa.compile(fn, x, min_region_ops=2)
    torch.testing.assert_close(one(x), fn(x))
    torch.testing.assert_close(two(x), fn(x))
    assert regions(one.explain()) == ["native", "aten.topk.default", "native"]
    assert regions(two.explain()) == ["aten.mul.Tensor", "aten.topk.default", "aten.add.Tensor"]
    assert "under min_region_ops=2" in eager_ops(two.explain())["aten.mul.Tensor"]
    with pytest.raises(ValueError, match="min_region_ops"):
        torchtosa.compile(fn, x, min_region_ops=0)
    with pytest.raises(ValueError, match="fallback"):
        torchtosa.compile(fn, x, fallback="maybe")
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=r"unknown torchtosa options \['fallbak'\]"):
        torch.compile(fn, backend="torchtosa", options={"fallbak": "eager"})(x)


def test_a_fully_native_graph_is_one_region_without_a_warning() -> None:
    x = torch.randn(5, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)
        c = torchtosa.compile(lambda a: (a @ a).relu() + 1, x)
    assert regions(c.explain()) == ["native"]
    torch.testing.assert_close(c(x), (x @ x).relu() + 1)


# ------------------------------------------------------------ state: in-place updates


def test_in_place_update_of_an_input_writes_only_the_slice() -> None:
    """An index_copy_ into a large cache (HF StaticCache's write) becomes index_put_ on the
    caller's tensor: no whole-tensor copy_ is left in the graph, the storage is the caller's."""

    def write(cache: torch.Tensor, pos: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(1, pos, k)
        return cache.sum(1) * 2

    cache, pos, k = torch.randn(2, 64, 8), torch.tensor([3]), torch.randn(2, 1, 8)
    eager = cache.clone()
    want = write(eager, pos, k)
    ptr = cache.data_ptr()
    seen: list[torchtosa.Explanation] = []
    compiled = torchtosa.compile(write)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        got = compiled(cache, pos, k)
        seen.append(compiled.explain())
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(cache, eager)
    assert cache.data_ptr() == ptr
    ops = eager_ops(seen[0])
    assert "aten.copy_.default" not in ops  # the write-back became the in-place op itself
    assert ops["aten.index_put.default"].startswith("writes into input")
    assert "native" in regions(seen[0])


def test_in_place_updates_through_torch_compile() -> None:
    def bump(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a.add_(b)
        a[1:3] = b[1:3] * 4
        return a * 2

    a, b = torch.randn(6), torch.randn(6)
    eager = a.clone()
    want = bump(eager, b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        got = torch.compile(bump, backend="torchtosa")(a, b)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(a, eager)


def test_batch_norm_running_stats_in_train_mode() -> None:
    bn = nn.BatchNorm1d(4).train()
    ref = nn.BatchNorm1d(4).train()
    ref.load_state_dict(bn.state_dict())
    x = torch.randn(8, 4) * 3 + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        got = torchtosa.compile(bn)(x)
    with torch.no_grad():
        want = ref(x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(bn.running_mean, ref.running_mean)
    torch.testing.assert_close(bn.running_var, ref.running_var)
    assert bn.num_batches_tracked.item() == ref.num_batches_tracked.item() == 1


# ------------------------------------------------------------ scalars


def test_item_and_python_number_outputs() -> None:
    def stats(x: torch.Tensor) -> tuple[float, torch.Tensor]:
        return (x * 2).sum().item() + 1.0, x.relu()

    x = torch.randn(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        c = torchtosa.compile(stats, x)
        number, tensor = c(x)
    assert isinstance(number, float)
    assert number == pytest.approx(stats(x)[0], rel=1e-5)
    torch.testing.assert_close(tensor, x.relu())
    assert "not one graph" in str(c.explain())


def test_int_and_float_arguments() -> None:
    def scaled(x: torch.Tensor, n: int, s: float) -> torch.Tensor:
        return x.reshape(n, -1) * s + n

    x = torch.randn(6, 4)
    for n, s in ((2, 0.5), (3, -1.5)):
        torch.testing.assert_close(torchtosa.compile(scaled, x, n, s)(x, n, s), scaled(x, n, s))
        compiled = torch.compile(scaled, backend="torchtosa", dynamic=True)  # s arrives as a 0-d f64 tensor
        torch.testing.assert_close(compiled(x, n, s), scaled(x, n, s))


# ------------------------------------------------------------ empties and dtypes


def test_zero_size_tensors_run_eagerly() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x[:, :0].sum(1) + x.sum(1), torch.cat([x, x[:0]]) * 2, x[:, :0] @ w[:0], torch.mm(x, w).relu()

    x, w = torch.randn(4, 5), torch.randn(5, 3)
    with pytest.warns(FallbackWarning, match="zero-size"):
        c = torchtosa.compile(fn, x, w)
    for g, e in zip(c(x, w), fn(x, w), strict=True):
        torch.testing.assert_close(g, e)
    reasons = eager_ops(c.explain())
    assert any("zero-size" in r for r in reasons.values())
    assert "native" in regions(c.explain())


def test_uint8_images_float64_and_complex() -> None:
    def preprocess(img: torch.Tensor, mean: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (img.float() / 255 - mean) * 2, img // 3, img + img  # uint8 wraps around

    img = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    mean = torch.rand(3, 1, 1)
    with pytest.warns(FallbackWarning, match="uint8"):
        c = torchtosa.compile(preprocess, img, mean)
    for g, e in zip(c(img, mean), preprocess(img, mean), strict=True):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e)
    assert "native" in regions(c.explain())

    def double(x: torch.Tensor) -> torch.Tensor:
        return (x * x).sum(0) / 3 + x.exp().mean()

    d = torch.randn(4, 3, dtype=torch.float64)
    torch.testing.assert_close(torchtosa.compile(double, d, **STRICT)(d), double(d))

    def cplx(a: torch.Tensor) -> torch.Tensor:
        z = torch.view_as_complex(a)
        return (z * z).abs() + a.sum(-1).exp()

    a = torch.randn(3, 2)
    with pytest.warns(FallbackWarning, match="complex64"):
        c = torchtosa.compile(cplx, a)
    torch.testing.assert_close(c(a), cplx(a))
    assert "complex64" in eager_ops(c.explain())["aten.view_as_complex.default"]


def test_graph_breaks_compile_graph_by_graph() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.sin() * 2
        print("between graphs")  # a graph break
        return y.cos() + 1

    x = torch.randn(7)
    with pytest.raises(Unsupported, match="print"):
        torchtosa.compile(fn, x, **STRICT)
    with pytest.warns(FallbackWarning, match="not one graph"):
        c = torchtosa.compile(fn, x)
    torch.testing.assert_close(c(x), fn(x))
    assert regions(c.explain()).count("native") == 2


def test_size_outputs_stay_sizes() -> None:
    """A torch.Size in the output comes back as a torch.Size, not a tuple (found by the corpus)."""
    x = torch.randn(2, 3)
    got = torchtosa.compile(lambda a: (a + 1, a.shape), x)(x)
    assert type(got[1]) is torch.Size and got[1] == x.shape
    assert type(torchtosa.compile(lambda: torch.broadcast_shapes((2, 1), (1, 3)))()) is torch.Size


def test_ops_left_to_pytorch_say_why_from_the_eager_table() -> None:
    """opdefs/eager.yaml's reason reaches explain(): random ops follow torch's generator."""

    def noisy(a: torch.Tensor) -> torch.Tensor:
        return (a * 2 + 1) * (torch.rand(3) * 0 + 1)

    x = torch.randn(3)
    with pytest.warns(FallbackWarning, match=r"aten\.rand\.default \(no mapping: random values"):
        c = torchtosa.compile(noisy, x)
    torch.testing.assert_close(c(x), x * 2 + 1)
    assert "opdefs/eager.yaml:" in eager_ops(c.explain())["aten.rand.default"]
