"""torchtosa.capture.trace: graph shape, bindings, specs and errors of the captured aten graphs."""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from torchtosa.capture.trace import Captured, capture, capture_exported, make_backend
from torchtosa.errors import InvalidInput, Unsupported


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.seq(x), dim=-1)


class Scaled(nn.Module):
    """A parameter, a persistent and a non-persistent buffer, a plain tensor attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.register_buffer("b", torch.randn(4))
        self.register_buffer("c", torch.randn(4), persistent=False)
        self.k = torch.tensor([2.0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.w + self.b - self.c * self.k


def mul_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * y + x


def tuple_and_dict(x: torch.Tensor, y: torch.Tensor) -> Any:
    return (x + y, x - y), {"a": x * y, "b": [x.sum(), y.relu()], "n": None, "k": 3}


def run(c: Captured) -> Any:
    with torch.no_grad():
        flat = c.gm(*c.params, *c.example_inputs)
    assert isinstance(flat, tuple) and all(isinstance(t, torch.Tensor) for t in flat)
    return pytree.tree_unflatten(list(flat), c.out_spec)


def assert_same(got: Any, want: Any) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec
    for g, w in zip(got_leaves, want_leaves, strict=True):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w)
        else:
            assert g == w


def placeholders(c: Captured) -> list[torch.fx.Node]:
    return c.gm.graph.find_nodes(op="placeholder")


def call_targets(c: Captured) -> set[Any]:
    return {n.target for n in c.gm.graph.nodes if n.op == "call_function"}


def check_graph(c: Captured) -> None:
    """Placeholders match the bindings; every node has a value; only aten ops and getitem."""
    assert len(placeholders(c)) == len(c.params) + len(c.example_inputs)
    for node in c.gm.graph.nodes:
        if node.op in ("placeholder", "call_function"):
            assert "val" in node.meta, node
        if node.op == "call_function":
            assert node.target is operator.getitem or str(node.target).startswith(("aten.", "prims.")), node
            assert not str(node.target).startswith("aten._assert"), node
    for p, node in zip(c.params + c.example_inputs, placeholders(c), strict=True):
        assert tuple(p.shape) == tuple(node.meta["val"].shape) and p.dtype == node.meta["val"].dtype


CASES: list[tuple[str, Callable[..., Any], tuple[Any, ...], dict[str, Any]]] = [
    ("mul_add", mul_add, (torch.randn(3, 4), torch.randn(3, 4)), {}),
    ("mlp", MLP().eval(), (torch.randn(2, 5, 16),), {}),
    ("tuple_and_dict", tuple_and_dict, (torch.randn(3), torch.randn(3)), {}),
    ("scaled", Scaled(), (torch.randn(2, 4),), {}),
    ("kwargs", lambda x, *, s=1.0, y=None: x * s + y, (torch.randn(3),), {"s": 2.0, "y": torch.randn(3)}),
]


@pytest.mark.parametrize(("fn", "args", "kwargs"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_capture_reproduces_eager(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    c = capture(fn, args, kwargs)
    check_graph(c)
    with torch.no_grad():
        assert_same(run(c), fn(*args, **kwargs))
    assert c.in_spec == pytree.tree_flatten((args, kwargs))[1]


def test_params_are_the_module_tensors_in_order() -> None:
    m = MLP().eval()
    x = torch.randn(2, 16)
    c = capture(m, (x,))
    assert len(c.params) == len(list(m.parameters()))
    for got, want in zip(c.params, m.parameters(), strict=True):
        assert got is want and got.data_ptr() == want.data_ptr()
    assert len(c.example_inputs) == 1 and c.example_inputs[0] is x


def test_buffers_and_tensor_attributes_are_lifted() -> None:
    m = Scaled()
    c = capture(m, (torch.randn(2, 4),))
    assert c.params[:3] == [m.w, m.b, m.c]
    assert len(c.params) == 4 and c.params[3] is m.k


def test_placeholders_are_named_for_the_state_and_the_arguments() -> None:
    m, x = Scaled(), torch.randn(2, 4)
    c = capture(m, (x,))
    targets = [n.target for n in placeholders(c)]
    assert targets[:3] == ["p_w", "b_b", "b_c"] and targets[4] == "x" and c.params[3] is m.k
    w = torch.randn(3)
    # a closed-over tensor keeps Dynamo's name; an argument named like an aten op keeps its own
    c = capture(lambda y, add: y * w + add, (torch.randn(3), torch.randn(3)))
    assert [n.target for n in placeholders(c)][1:] == ["y", "add"] and c.params[0] is w
    check_graph(c)


def test_graph_only_has_aten_nodes() -> None:
    c = capture(MLP().eval(), (torch.randn(2, 16),))
    assert torch.ops.aten.addmm.default in call_targets(c)
    assert all(n.meta.get("stack_trace") for n in c.gm.graph.nodes if n.op == "call_function")


def test_out_spec_round_trip_keeps_none_and_constants() -> None:
    x, y = torch.randn(3), torch.randn(3)
    c = capture(tuple_and_dict, (x, y))
    assert c.out_spec.num_leaves == 5
    out = run(c)
    assert out[1]["n"] is None and out[1]["k"] == 3
    assert_same(out, tuple_and_dict(x, y))


def test_single_tensor_output_is_a_leaf() -> None:
    c = capture(mul_add, (torch.randn(2), torch.randn(2)))
    assert c.out_spec == pytree.tree_flatten(torch.ones(1))[1]


def test_unused_duplicate_and_non_tensor_inputs_keep_their_places() -> None:
    x, y = torch.randn(3), torch.randn(3)
    c = capture(lambda a, b, unused, n: a * b * n, (x, x, y, 2))
    assert c.example_inputs == [x, x, y] and len(placeholders(c)) == 3
    assert_same(run(c), x * x * 2)


def test_outputs_that_are_inputs_or_params() -> None:
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3)
    c = capture(lambda a: (a, lin(a), lin.weight, a.t()), (x,))
    with torch.no_grad():
        assert_same(run(c), (x, lin(x), lin.weight, x.t()))


def test_capturing_the_same_function_repeatedly() -> None:
    for i in range(9):  # more than Dynamo's per-function recompile limit (8)
        x = torch.full((2,), float(i))
        assert_same(run(capture(mul_add, (x, x))), x * x + x)


def test_graph_break_raises_unsupported_with_reason_and_line() -> None:
    def breaks(x: torch.Tensor) -> torch.Tensor:
        print("side effect")
        return x

    with pytest.raises(Unsupported, match=r"print") as info:
        capture(breaks, (torch.randn(2),))
    assert "test_capture.py" in str(info.value) and 'print("side effect")' in str(info.value)


def test_data_dependent_branch_is_unsupported() -> None:
    def branch(x: torch.Tensor) -> torch.Tensor:
        return x if x.sum() > 0 else -x

    with pytest.raises(Unsupported, match=r"(?s)branching.*x.sum\(\) > 0"):
        capture(branch, (torch.randn(2),))


def test_shape_error_raises_invalid_input() -> None:
    with pytest.raises(InvalidInput, match="same reduction dim"):
        capture(lambda a, b: a @ b, (torch.randn(2, 3), torch.randn(4, 5)))


def test_in_place_updates_are_unsupported_and_not_applied() -> None:
    x = torch.zeros(2)
    with pytest.raises(Unsupported, match="in place"):
        capture(lambda a: a.add_(1), (x,))
    assert torch.equal(x, torch.zeros(2))
    with pytest.raises(Unsupported, match="in place"):
        capture(nn.BatchNorm1d(2).train(), (torch.randn(4, 2),))


def test_data_dependent_shapes_are_unsupported() -> None:
    with pytest.raises(Unsupported, match="nonzero"):
        capture(lambda a: torch.nonzero(a > 0), (torch.randn(4),))


def test_higher_order_ops_are_unsupported() -> None:
    def cond(x: torch.Tensor) -> torch.Tensor:
        return torch.cond(x.sum() > 0, lambda t: t + 1, lambda t: t - 1, (x,))

    with pytest.raises(Unsupported, match="higher-order operator cond"):
        capture(cond, (torch.randn(3),))


def test_transformer_layer_avoids_the_fused_fastpath() -> None:
    layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    c = capture(layer, (x,))
    assert torch.backends.mha.get_fastpath_enabled()
    assert not any("transformer_encoder_layer" in str(t) for t in call_targets(c))
    with torch.no_grad():
        assert_same(run(c), layer(x))


def test_attention_output_view_after_decomposition() -> None:
    """GPT-2's pattern; `run_decompositions` of an export of it fails in torch 2.13."""

    def attention(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.view(2, 7, 2, 16).transpose(1, 2) for t in x.split(32, dim=2))
        o = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).contiguous()
        return o.reshape(2, 7, 32).view(-1, 32)

    x = torch.randn(2, 7, 96)
    assert_same(run(capture(attention, (x,))), attention(x))


def test_tiny_bert_with_attention_mask() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37
    )
    bert = transformers.BertModel(config).eval()
    ids = torch.randint(0, 99, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    c = capture(bert, (), {"input_ids": ids, "attention_mask": mask})
    check_graph(c)
    assert c.example_inputs == [ids, mask]
    assert all(any(p is q for q in c.params) for p in bert.parameters())
    with torch.no_grad():
        got, want = run(c), bert(input_ids=ids, attention_mask=mask)
    torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state)
    torch.testing.assert_close(got.pooler_output, want.pooler_output)


def test_capture_exported() -> None:
    m = Scaled()
    x = torch.randn(2, 4)
    c = capture_exported(torch.export.export(m, (x,)))
    check_graph(c)
    assert c.params[:3] == [m.w, m.b, m.c] and c.params[0].data_ptr() == m.w.data_ptr()
    assert len(c.example_inputs) == 1 and torch.equal(c.example_inputs[0], x)
    with torch.no_grad():
        assert_same(run(c), m(x))


def test_capture_exported_keeps_none_outputs_in_spec() -> None:
    class NoneOut(nn.Module):
        def forward(self, x: torch.Tensor, n: int) -> Any:
            return x * n, None

    x = torch.randn(3)
    c = capture_exported(torch.export.export(NoneOut(), (x, 2)))
    assert len(placeholders(c)) == 1
    assert_same(run(c), (x * 2, None))


def test_capture_exported_rejects_buffer_mutation() -> None:
    class Counter(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("n", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.n.add_(1)
            return x + self.n

    with pytest.raises(Unsupported, match="BUFFER_MUTATION"):
        capture_exported(torch.export.export(Counter(), (torch.randn(2),)))


def test_make_backend_inference_and_training() -> None:
    seen: list[Captured] = []

    def compile_graph(c: Captured, opt: str) -> Callable[..., Any]:
        seen.append(c)
        return c.gm

    backend = make_backend(compile_graph)
    m = MLP()
    x = torch.randn(2, 16)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(m, backend=backend)(x), m(x))
    assert len(seen) == 1 and seen[0].params == [] and len(seen[0].example_inputs) == len(placeholders(seen[0]))

    torch.compile(m, backend=backend)(x).sum().backward()
    grads = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m(x).sum().backward()
    # under no_grad one inference graph; with autograd the forward and the backward graph
    assert [c.graph.split()[0] for c in seen] == ["inference", "forward", "backward"]
    for got, p in zip(grads, m.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad)


class Rolls(nn.Module):
    """torch.roll over two dims (a negative shift, one past the size), and over the flattened tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.roll(x, (2, -7), (1, 2)) * 2 + torch.roll(x, 5)


def test_roll_is_slices_and_a_cat() -> None:
    """Static rolls capture as slices and cats (core ATen's decomposition gathers with integer
    indices, not TOSA-1.0+FP): no index op in the graph, and the program is TOSA-1.0+FP with
    eager's values on the reference model and natively; the gradient flows through it."""
    import torchtosa

    x = torch.randn(2, 5, 4)
    targets = {str(n.target) for n in capture(Rolls(), (x,)).gm.graph.nodes if n.op == "call_function"}
    assert "aten.cat.default" in targets and not {t for t in targets if "index" in t or "gather" in t}, targets
    program = torchtosa.to_tosa(Rolls(), x, target="TOSA-1.0+FP")
    want = Rolls()(x)
    (ref,) = program.reference(x)
    assert torch.equal(ref, want)
    assert torch.equal(torchtosa.compile(Rolls(), x)(x), want)
    y = x.clone().requires_grad_()
    torch.compile(Rolls(), backend="torchtosa")(y).sum().backward()
    assert torch.equal(y.grad, torch.full_like(x, 3.0))


def test_capture_skips_dynamos_guard_latency_profile(monkeypatch: pytest.MonkeyPatch) -> None:
    """capture doesn't let Dynamo measure its guards' latency (a CPU cache flush, ~22 ms a
    capture); torch.compile, which is the user's, still does, and Dynamo's function is restored."""
    from torch._dynamo import guards

    calls: list[object] = []
    profile = guards.profile_guard_manager

    def counted(*args: Any) -> float:
        calls.append(args)
        return profile(*args)

    monkeypatch.setattr(guards, "profile_guard_manager", counted)
    torch._dynamo.reset()
    capture(MLP().eval(), (torch.randn(2, 16),))
    assert calls == [] and guards.profile_guard_manager is counted
    torch._dynamo.reset()
    torch.compile(MLP().eval(), backend="eager")(torch.randn(2, 16))
    assert len(calls) == 1
