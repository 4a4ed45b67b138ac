"""Training: AOTAutograd's forward and backward graphs, both native, give eager's gradients.

- The decomposition table capture hands AOTAutograd is valid for the joint graph: with it, the
  joint graph run by PyTorch alone gives eager's gradients, for attention and convolutions of
  every kind and for every test model in train mode (core ATen's SDPA decomposition gave
  relative errors of 10-455 here, with the forward right).
- 20 SGD steps through `torch.compile(backend="torchtosa")` lose what eager loses, step by step,
  and the backward graph runs as native code.
- `torchtosa.compile` keeps autograd: its outputs require grad and backward gives eager's gradients.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from test_models import MODELS, instantiate
from torch import nn
from torch._functorch.aot_autograd import aot_module_simplified, make_boxed_func

import torchtosa
from torchtosa import FallbackWarning
from torchtosa.capture.decompositions import DECOMPOSITIONS
from torchtosa.execute.native import NativeFunction
from torchtosa.regions import EagerOp

# ---------------------------------------------------------------- the decomposition table


def _pytorch_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """AOTAutograd with torchtosa's decompositions, both graphs run by PyTorch: no native code."""
    def run(g: torch.fx.GraphModule, _: Any) -> Callable[..., Any]:
        return make_boxed_func(g)

    return aot_module_simplified(gm, example_inputs, fw_compiler=run, bw_compiler=run,
                                 decompositions=DECOMPOSITIONS)


def _gradients(fn: Callable[..., torch.Tensor], *shapes: tuple[int, ...]) -> None:
    """fn's gradients through the decomposed joint graph equal eager's."""
    xs = [torch.randn(s, requires_grad=True) for s in shapes]
    torch._dynamo.reset()
    out = torch.compile(fn, backend=_pytorch_backend)(*xs)
    weight = torch.randn_like(out)
    got = torch.autograd.grad(out, xs, weight)
    want = torch.autograd.grad(fn(*xs), xs, weight)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"gradient {i}: {m}")
    torch._dynamo.reset()


_MASK = torch.rand(8, 8) > 0.3
_MASK[2] = False  # a query that sees no key: output 0, gradient 0
_BIAS = torch.randn(2, 1, 8, 8)
QKV = (2, 4, 8, 16)
ATTENTION = {
    "plain": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), QKV, QKV, QKV),
    "causal": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), QKV, QKV, QKV),
    "causal, cross": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),  # top-left aligned
                      (2, 4, 5, 16), QKV, QKV),
    "scale, cross": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3),
                     (2, 4, 5, 16), QKV, (2, 4, 8, 12)),
    "bool mask": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_MASK), QKV, QKV, QKV),
    "float mask": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_BIAS), QKV, QKV, QKV),
    "grouped query": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                      QKV, (2, 2, 8, 16), (2, 2, 8, 16)),
}


@pytest.mark.parametrize("case", list(ATTENTION))
def test_attention_gradients_through_the_decomposition_table(case: str) -> None:
    fn, *shapes = ATTENTION[case]
    _gradients(fn, *shapes)


# (the input gradient: a transposed convolution for the first three, a spread grid convolved by the
# flipped kernel for dilated, grouped and depthwise ones and padding not below the kernel)
@pytest.mark.parametrize(("stride", "padding", "dilation", "groups"),
                         [(1, 0, 1, 1), (2, 1, 1, 1), (2, 0, 1, 1), (3, 2, 2, 1), (1, 1, 1, 2), (2, 1, 1, 4),
                          (2, 3, 1, 1), (1, 2, 2, 2)])
def test_convolution_gradients_through_the_decomposition_table(stride: int, padding: int, dilation: int,
                                                               groups: int) -> None:
    def conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, w, b, stride, padding, dilation, groups)

    _gradients(conv, (2, 4, 9, 10), (8, 4 // groups, 3, 3), (8,))
    _gradients(lambda x, w: F.conv1d(x, w, None, stride, padding, dilation, groups), (2, 4, 11), (8, 4 // groups, 3))


@pytest.mark.parametrize(("kernel", "stride", "padding", "dilation", "ceil_mode"),
                         [(2, 2, 0, 1, False), (3, 2, 1, 1, False), (3, 1, 1, 1, False), (2, 1, 0, 2, False),
                          (3, 2, 0, 1, True), ((2, 3), (1, 2), (1, 0), 1, False),
                          # tiling windows (one select), rows and columns left over; ceil_mode's partial windows
                          (3, 3, 0, 1, False), ((2, 3), (2, 3), 0, 1, False), (2, 2, 0, 1, True)])
def test_max_pool_gradients_through_the_decomposition_table(kernel: Any, stride: Any, padding: Any, dilation: int,
                                                            ceil_mode: bool) -> None:
    def pool(x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)

    _gradients(pool, (2, 3, 9, 8))
    _gradients(pool, (3, 7, 6))  # no batch dim
    # ties (values rounded, gradient straight through): overlapping windows share a max
    _gradients(lambda x: pool(x + (x.detach().round() - x.detach())), (2, 3, 9, 8))


@pytest.mark.parametrize(("kernel", "shape"), [(2, (4, 8, 12, 10)), (3, (2, 3, 11, 9)), ((2, 3), (3, 7, 6))])
def test_max_pool_gradient_of_tiling_windows_runs_natively(kernel: Any, shape: tuple[int, ...]) -> None:
    """The gradient of a pooling whose windows tile the input (one select over the windows' grid,
    rows and columns no window covers padded with zeros) compiles to native code alone and
    equals eager's, ties included (every tie goes to the index eager chose)."""
    x = torch.randn(shape).round()  # ties in most windows
    out, indices = torch.ops.aten.max_pool2d_with_indices(x, kernel, kernel)
    grad = torch.randn_like(out)

    def backward(g: torch.Tensor, x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.max_pool2d_with_indices_backward(g, x, kernel, kernel, [0, 0], [1, 1], False, i)

    compiled = torchtosa.compile(backward, grad, x, indices, fallback="error")
    torch.testing.assert_close(compiled(grad, x, indices), backward(grad, x, indices), rtol=0, atol=0)


def _without_dropout(model: nn.Module) -> nn.Module:
    """Dropout off everywhere (nn.Dropout, nn.MultiheadAttention, transformers' attention)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        if isinstance(m, nn.MultiheadAttention):
            m.dropout = 0.0
        if isinstance(getattr(m, "attention_dropout", None), float):
            m.attention_dropout = 0.0
    return model


def _loss(out: Any) -> torch.Tensor:
    """A scalar of every float output, each weighted by fixed random weights."""
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    gen = torch.Generator().manual_seed(1)
    return sum((t * torch.randn(t.shape, generator=gen)).sum() for t in leaves)


# `make training`: the test below compiles each model's training step natively (about 160 s for
# the ten; every op of every forward and backward graph is native), not only its joint graph
NATIVE = bool(os.environ.get("TORCHTOSA_TRAINING_NATIVE"))


@pytest.mark.parametrize("name", list(MODELS))
def test_every_test_model_in_train_mode_gets_eager_gradients(name: str) -> None:
    """One step of each test model in train mode (dropout off, so that both are deterministic): the
    joint graph, decomposed as torchtosa decomposes it and run by PyTorch (natively with
    TORCHTOSA_TRAINING_NATIVE=1), gives eager's gradients. Each is within 2e-3 of eager's norm,
    plus 1e-6 of all gradients' norm: train-mode batch norm over few values makes gradients of
    1e6, and a bias before batch norm has an exact gradient of 0 that both compute as rounding
    noise. (Native code of such graphs in every run: the steps below.)"""
    model, inputs = instantiate(name)
    model = _without_dropout(model.train())
    reference = copy.deepcopy(model)
    torch._dynamo.reset()
    _loss(torch.compile(model, backend="torchtosa" if NATIVE else _pytorch_backend)(*inputs)).backward()
    _loss(reference(*inputs)).backward()
    torch._dynamo.reset()
    pairs = [(n, p.grad, q.grad) for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True)
             if q.grad is not None]
    total = torch.stack([w.norm() for _, _, w in pairs]).norm()
    for n, g, w in pairs:
        assert (g - w).norm() <= 2e-3 * w.norm() + 1e-6 * total, \
            f"{n}: |grad - eager| = {(g - w).norm():.3g}, |eager| = {w.norm():.3g}"


# ---------------------------------------------------------------- training steps, native


class CNN(nn.Module):
    """Convolutions with batch norm (running statistics updated), max pooling and dropout."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(4, 8, 3, stride=2), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(p), nn.Linear(8 * 3 * 3, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _mlp() -> tuple[nn.Module, torch.Tensor]:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 10)), \
        torch.randn(8, 16)


def _encoder(layers: int) -> tuple[nn.Module, torch.Tensor]:
    """The issue's model (one layer), or a stack of `layers` encoder layers with the same head."""
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    body = layer if layers == 1 else nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    return nn.Sequential(body, nn.Flatten(), nn.Linear(8 * 32, 10)), torch.randn(4, 8, 32)


# name: (build, loss tolerance (rtol, atol), why)
STEPS = {
    "mlp": (_mlp, (1e-5, 1e-6), "float32 rounding"),
    "cnn_batch_norm": (lambda: (CNN(0.0), torch.randn(8, 1, 16, 16)), (1e-5, 1e-6), "float32 rounding"),
    # native_dropout runs eagerly (random), drawing from torch's generator as eager's dropout does
    "cnn_batch_norm_dropout": (lambda: (CNN(0.3), torch.randn(8, 1, 16, 16)), (1e-5, 1e-6), "float32 rounding"),
    "issue_encoder": (lambda: _encoder(1), (1e-4, 1e-6), "reduction order in attention, 20 steps"),
    "encoder_2_layers": (lambda: _encoder(2), (1e-4, 1e-6), "reduction order in attention, 20 steps"),
}


@pytest.mark.parametrize("name", list(STEPS))
def test_twenty_steps_match_eager(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGD (lr 0.05) on cross-entropy: the loss of every step equals eager's at the stated
    tolerance, and so do the parameters and buffers after 20 steps; native code runs in the
    backward pass, and no op of a backward graph runs eagerly (a FallbackWarning is an error)."""
    build, (rtol, atol), _why = STEPS[name]
    torch.manual_seed(0)
    model, x = build()
    reference = copy.deepcopy(model)
    target = torch.arange(x.shape[0]) % 10
    calls: list[str] = []
    native_call = NativeFunction.__call__

    def counting(self: NativeFunction, *args: torch.Tensor, known: int = 0) -> list[torch.Tensor]:
        calls.append("native")
        return native_call(self, *args, known=known)

    monkeypatch.setattr(NativeFunction, "__call__", counting)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="torchtosa")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    eager_optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
    for step in range(20):
        torch.manual_seed(step)  # the same dropout masks
        optimizer.zero_grad()
        if step == 0 and "dropout" in name:
            with pytest.warns(FallbackWarning, match=r"1 of \d+ ops of the forward graph \d+ run eagerly: "
                                                     r"aten.native_dropout.default \(.*is random"):
                loss = F.cross_entropy(compiled(x), target)
        else:
            loss = F.cross_entropy(compiled(x), target)
        calls.clear()
        loss.backward()
        assert calls, f"step {step}: the backward pass ran no native code"
        optimizer.step()
        torch.manual_seed(step)
        eager_optimizer.zero_grad()
        eager_loss = F.cross_entropy(reference(x), target)
        eager_loss.backward()
        eager_optimizer.step()
        torch.testing.assert_close(loss, eager_loss, rtol=rtol, atol=atol, msg=lambda m, s=step: f"step {s}: {m}")
    for (key, got), want in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")
    torch._dynamo.reset()


def test_saved_views_of_weights_are_not_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """AOTAutograd's forward graph saves each weight transposed for backward, and returns its
    input and relu's output twice: native code writes only the graph's own results (the saved
    views are PyTorch's views of the inputs, `layouts.split_alias_outputs`), and the backward
    graph takes the transposed weight in its memory's order (`layouts.permute_inputs`), so no
    native call gets an argument it must copy to contiguous. Losses equal eager's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 48), nn.ReLU(), nn.Linear(48, 8))
    reference = copy.deepcopy(model)
    x, target = torch.randn(4, 16), torch.randn(4, 8)
    calls: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    native_call = NativeFunction.__call__

    def recording(self: NativeFunction, *args: torch.Tensor, known: int = 0) -> list[torch.Tensor]:
        outputs = native_call(self, *args, known=known)
        calls.append((list(args), list(outputs)))
        return outputs

    monkeypatch.setattr(NativeFunction, "__call__", recording)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="torchtosa")
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for _ in range(3):
        losses = []
        for m, optimizer in zip((compiled, reference), optimizers, strict=True):
            optimizer.zero_grad()
            loss = F.mse_loss(m(x), target)
            loss.backward()
            optimizer.step()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=1e-7)
    forward, backward = calls[0], calls[1]
    assert sorted(o.shape for o in forward[1]) == [(4, 8), (4, 48)]  # the output and relu's, once each
    assert any(a.shape == (8, 48) for a in backward[0])  # the second weight transposed, taken as stored
    assert all(a.is_contiguous() for args, _ in calls for a in args if isinstance(a, torch.Tensor))
    torch._dynamo.reset()


# ---------------------------------------------------------------- torchtosa.compile with autograd


def test_compile_keeps_autograd_with_native_forward_and_backward() -> None:
    torch.manual_seed(0)
    model, x = CNN(0.0), torch.randn(8, 1, 16, 16)  # the graphs of test_twenty_steps_match_eager
    reference = copy.deepcopy(model)
    compiled = torchtosa.compile(model)  # parameters require grad, grad mode on: compiled with autograd
    out = compiled(x)
    assert out.requires_grad and out.grad_fn is not None
    _loss(out).backward()
    _loss(reference(x)).backward()
    for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    for (n, b), r in zip(model.named_buffers(), reference.buffers(), strict=True):
        torch.testing.assert_close(b, r, msg=lambda m, n=n: f"{n}: {m}")  # batch norm's running statistics
    explanation = compiled.explain()
    graphs = explanation.graphs()
    assert list(graphs) == ["forward graph 0", "backward graph 0"]
    assert all(eager == 0 and native > 0 for native, eager in graphs.values()), str(explanation)
    text = str(explanation)
    assert "forward graph 0: all" in text and "backward graph 0: all" in text
    assert "in place, in the caller" in text  # the running statistics: written natively, not ops run eagerly

    with torch.no_grad():  # inference: the whole-graph capture, no autograd
        model.eval()
        inference = compiled(x)
        assert not inference.requires_grad
        torch.testing.assert_close(inference, reference.eval()(x))
    assert compiled.explain().graphs() == {}


def test_compile_gradients_of_inputs_and_closed_over_tensors() -> None:
    torch.manual_seed(0)
    x = torch.randn(6, 5, requires_grad=True)
    w = torch.randn(5, 3, requires_grad=True)

    def fn(a: torch.Tensor) -> torch.Tensor:
        return torch.tanh(a @ w).sum(-1) * a[:, 0]

    compiled = torchtosa.compile(fn)
    compiled(x).sum().backward()
    got = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    fn(x).sum().backward()
    torch.testing.assert_close(got, (x.grad, w.grad))
    assert not any(isinstance(p, EagerOp) for p in compiled.explain().parts)


def test_compile_with_autograd_says_what_ran_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """An op of the backward graph without a lowering runs eagerly there, and the warning names the graph."""
    from torchtosa.importer import registry as reg

    table = dict(reg.registry())
    table.pop("aten.mm.default")
    monkeypatch.setattr(reg, "registry", lambda: table)
    monkeypatch.setattr("torchtosa.importer.support.registry", lambda: table)
    monkeypatch.setattr("torchtosa.importer.graph.registry", lambda: table)
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(4, 8)
    compiled = torchtosa.compile(model)
    out = compiled(x)
    with pytest.warns(FallbackWarning, match=r"ops of the backward graph 0 run eagerly: aten.mm.default"):
        out.sum().backward()
    graphs = compiled.explain().graphs()
    assert graphs["forward graph 0"][1] == 0 and graphs["backward graph 0"][1] > 0


# ---------------------------------------------------------------- module paths


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.add_module("1x1", nn.Conv2d(4, 4, 1))
        self.proj = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, "1x1")(x).relu() + self.proj(x)


def test_module_paths_that_are_not_identifiers() -> None:
    """torchvision's regnet names submodules `block1-0`; a path may start with a digit (`1x1`), and
    two paths may only differ where the placeholder names them both `_` (`block1-0`, `block1_0`)."""
    model = nn.Sequential()
    for name in ("block1-0", "block1_0"):
        model.add_module(name, Block())
    x = torch.randn(2, 4, 6, 6)
    with torch.no_grad():
        compiled = torchtosa.compile(model, x, fallback="error")
        torch.testing.assert_close(compiled(x), model(x))
    assert compiled.program.input_names == [
        "p_block1_0_1x1_weight", "p_block1_0_1x1_bias", "p_block1_0_proj_weight", "p_block1_0_proj_bias",
        "p_block1_0_1x1_weight_1", "p_block1_0_1x1_bias_1", "p_block1_0_proj_weight_1", "p_block1_0_proj_bias_1",
        "input"]
