"""Dynamic shapes end to end: one compile with symbolic sizes serves every size after it, as
torch.compile(dynamic=True), torchtosa.compile(dynamic=...) and torch.export's Dims ask."""

from __future__ import annotations

import warnings

import pytest
import sympy
import torch
from torch.export import Dim

import torchtosa
from torchtosa.api import CACHE, Guarded, torchtosa_backend
from torchtosa.regions import EAGER_VIEW

transformers = pytest.importorskip("transformers")


class Counting:
    """The torchtosa backend with options, counting the graphs Dynamo hands it."""

    def __init__(self, **options: str) -> None:
        self.options, self.frame_count = options, 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.frame_count += 1
        return torchtosa_backend(gm, example_inputs, options=self.options)


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(24, 40), torch.nn.Linear(40, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.down(torch.nn.functional.gelu(self.up(x))), dim=-1)


@pytest.mark.parametrize("opt", ["default", "parallel"])
def test_one_compile_serves_every_batch_size(opt: str) -> None:
    torch.manual_seed(0)
    model = MLP().eval()
    counter = Counting(opt=opt, fallback="error")
    compiled = torch.compile(model, backend=counter, dynamic=True)
    before = CACHE.compiles
    with torch.no_grad():
        for rows in (2, 3, 7, 16, 33, 100):  # sizes that are and are not multiples of the tiles
            x = torch.randn(rows, 24)
            torch.testing.assert_close(compiled(x), model(x))
    assert counter.frame_count == 1
    assert CACHE.compiles - before <= 1  # 0 if an identical program was compiled before
    torch._dynamo.reset()


def tiny_bert() -> torch.nn.Module:
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=128)
    return transformers.BertModel(config).eval()


def test_bert_one_compile_for_batch_and_sequence_length() -> None:
    torch.manual_seed(0)
    model = tiny_bert()
    compiled = torchtosa.compile(model, dynamic=True)
    shapes = [(2, 16), (8, 128), (3, 5), (5, 77), (4, 9), (7, 64), (6, 33)]
    with torch.no_grad():
        for i, (batch, seq) in enumerate(shapes):
            ids = torch.randint(0, 100, (batch, seq))
            if i == 0:  # BERT's token-type buffer lookup needs static sizes: it runs eagerly
                with pytest.warns(torchtosa.FallbackWarning, match="gather"):
                    got = compiled(ids).last_hidden_state
                compiles = CACHE.compiles
            else:
                got = compiled(ids).last_hidden_state
            torch.testing.assert_close(got, model(ids).last_hidden_state, atol=1e-5, rtol=1e-5)
            assert CACHE.compiles == compiles, f"recompiled at batch {batch}, sequence {seq}"
        # batch 1 follows Dynamo's rule for sizes 0 and 1: a graph of its own, then reused
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torchtosa.FallbackWarning)
            for seq in (5, 128, 40):
                ids = torch.randint(0, 100, (1, seq))
                torch.testing.assert_close(compiled(ids).last_hidden_state, model(ids).last_hidden_state,
                                           atol=1e-5, rtol=1e-5)
    explanation = compiled.explain()
    assert "symbolic sizes" in str(explanation) and "serves sizes" in str(explanation)
    # the buffer's views the gather alone reads run eagerly with it (free there), and so does the
    # slice left a native region of its own
    assert {e.op for e in explanation.eager if e.reason != EAGER_VIEW and "min_region_ops" not in e.reason} == {
        "aten.gather.default"}
    torch._dynamo.reset()


@torch.no_grad()  # inference: signatures of whole-graph captures (with autograd, Dynamo's own)
def test_compile_default_goes_dynamic_after_a_size_change() -> None:
    torch.manual_seed(0)
    model = MLP().eval()
    compiled = torchtosa.compile(model, fallback="error")
    CACHE.clear()  # a test before may have compiled the same programs
    before = CACHE.compiles
    for rows in (4, 6, 9, 50):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(compiled(x), model(x))
    assert CACHE.compiles - before == 2  # the static first signature, then one symbolic compile
    torch._dynamo.reset()
    static = torchtosa.compile(model, fallback="error", dynamic=False)
    for rows in (4, 6, 9):
        static(torch.randn(rows, 24))
    assert len(static.compiled) == 3 and static._dynamo is None


def test_export_with_dim_ranges_keeps_symbolic_dims() -> None:
    torch.manual_seed(0)
    model = MLP().eval()
    batch = Dim("batch", min=2, max=64)
    ep = torch.export.export(model, (torch.randn(4, 24),), dynamic_shapes={"x": {0: batch}})
    program = torchtosa.to_tosa(ep)
    assert "tensor<?x24xf32>" in str(program) and "tensor<?x12xf32>" in str(program)
    compiled = torchtosa.compile(ep, fallback="error")
    assert "serves sizes 2 <= " in str(compiled.explain()) and "<= 64" in str(compiled.explain())
    for rows in (2, 5, 64):
        x = torch.randn(rows, 24)
        torch.testing.assert_close(compiled(x), model(x))
    with pytest.raises(torchtosa.InputMismatch, match="at most 64"):
        compiled(torch.randn(65, 24))
    with pytest.raises(torchtosa.InputMismatch):
        compiled(torch.randn(5, 23))


def test_bert_at_batch_one_keeps_the_sequence_symbolic() -> None:
    """No rule may fix a symbolic size to its value (arange's bounds once did: float(s0))."""
    torch.manual_seed(0)
    model = tiny_bert()
    counter = Counting()
    compiled = torch.compile(model, backend=counter, dynamic=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torchtosa.FallbackWarning)
        for seq in (33, 64, 100):
            ids, mask = torch.randint(0, 100, (1, seq)), torch.ones(1, seq, dtype=torch.long)
            torch.testing.assert_close(compiled(ids, mask).last_hidden_state, model(ids, mask).last_hidden_state,
                                       atol=1e-5, rtol=1e-5)
            if seq == 33:
                compiles, graphs = CACHE.compiles, counter.frame_count
            assert (CACHE.compiles, counter.frame_count) == (compiles, graphs), f"recompiled at sequence {seq}"
    torch._dynamo.reset()


def _positions(x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
    """Cache positions as HF computes them (arange(past, past + n)), and a countdown by 2."""
    n = x.shape[1]
    return x * torch.arange(past.shape[0], past.shape[0] + n) + torch.arange(n, 0, -2).sum()


def test_an_arange_between_symbolic_sizes_is_computed_natively() -> None:
    """An integer torch.arange whose bounds are symbolic sizes (rules.Range, opdefs/creation.yaml)
    is computed by the native program at every size, with no op run eagerly; a float one between
    symbolic bounds runs eagerly and says why. Values and dtypes equal eager's."""
    compiled = torch.compile(_positions, backend="torchtosa", dynamic=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", torchtosa.FallbackWarning)
        for n, past in ((5, 3), (8, 2), (11, 7)):
            x, cache = torch.randn(2, n), torch.randn(past)
            got, want = compiled(x, cache), _positions(x, cache)
            assert got.dtype == want.dtype and torch.equal(got, want), (n, past)
    def floats(x: torch.Tensor) -> torch.Tensor:
        return x * torch.arange(1, x.shape[0] + 1, dtype=torch.float32)

    with torch.no_grad(), pytest.warns(torchtosa.FallbackWarning, match="float32 values between symbolic bounds"):
        x = torch.randn(6)
        torch.testing.assert_close(torch.compile(floats, backend="torchtosa", dynamic=True)(x), floats(x))
    torch._dynamo.reset()


def test_guards_the_lowering_added_are_checked_per_call() -> None:
    s0 = sympy.Symbol("s0", positive=True, integer=True)
    guarded = Guarded(lambda *args: "native", [sympy.Le(s0, 8)], {s0: (0, 0)})
    assert guarded(torch.zeros(5)) == "native"
    with pytest.raises(torchtosa.InputMismatch, match="s0 <= 8"):
        guarded(torch.zeros(9))
    # a torch.compile graph compiles for the sizes of a call that breaks one instead
    again = Guarded(lambda *args: "native", [sympy.Le(s0, 8)], {s0: (0, 0)}, otherwise=lambda *args: "specialised")
    assert again(torch.zeros(9)) == "specialised"


class Scaled(torch.nn.Module):
    """Floats of its own: an attention scale (an SDPA argument, which Dynamo guards on) and an
    eps (tensor math)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.scaling, self.eps = torch.nn.Linear(16, 48), 0.3, 1e-5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.proj(x).chunk(3, dim=-1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.scaling)
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)


def test_floats_of_modules_become_constants_before_aotautograd_traces(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._dynamo.exc import TensorifyScalarRestartAnalysis
    from torch._functorch._aot_autograd import graph_compile

    late = []  # restarts AOTAutograd asked for, after tracing the whole graph

    def tensorify(*args: object) -> None:
        try:
            original(*args)
        except TensorifyScalarRestartAnalysis:
            late.append(args)
            raise

    original = graph_compile.tensorify_python_scalars
    monkeypatch.setattr(graph_compile, "tensorify_python_scalars", tensorify)
    torch.manual_seed(0)
    model = Scaled().eval()
    counter = Counting(fallback="error")
    compiled = torch.compile(model, backend=counter, dynamic=True)
    with torch.no_grad():
        for n in (5, 9):
            x = torch.randn(2, n, 16)
            torch.testing.assert_close(compiled(x), model(x))
        assert not late
        assert counter.frame_count == 2  # the first trace, ended by the backend, and the one compiled
        model.scaling = 0.7  # a constant of the compiled graph, guarded: compiled again
        torch.testing.assert_close(compiled(x), model(x))
    assert counter.frame_count == 3
    torch._dynamo.reset()
