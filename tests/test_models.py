"""Real models compiled to native code, checked against eager PyTorch.

Every model is built with random weights from a tiny config (nothing is downloaded:
`transformers` builds from a config object, and the hub is switched off below), put in
`eval()` and run under `torch.no_grad()`, then compiled two ways:

- `torchtosa.compile(model, *inputs)` (TorchDynamo + AOTAutograd capture, our lowering);
- `torch.compile(model, backend="torchtosa", fullgraph=True)` (the torch.compile backend;
  `fullgraph` so a graph break cannot hide eager fallbacks, and the test checks that native
  code actually ran).

`MODELS` is the single list of verified model families: `scripts/coverage.py` reads it too
(`scripts/bench.py` builds its larger BERT the same way).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # never download: every model below is built from a config
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

import torchtosa
from torchtosa.execute.native import NativeFunction
from torchtosa.importer.registry import registry

Inputs = tuple[Any, ...]


@dataclass(frozen=True)
class ModelCase:
    """A model family: how to build a tiny instance and its inputs, and how close native must be."""

    name: str
    family: str  # what the README/coverage table shows
    build: Callable[[], tuple[nn.Module, Inputs]]
    # assert_close tolerances. None = torch's float32 defaults (rtol 1.3e-6, atol 1e-5).
    rtol: float | None = None
    atol: float | None = None
    why: str = ""  # the reason for any loosening


# ---------------------------------------------------------------- torch.nn models


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LeNet(nn.Module):
    """LeNet-5 with BatchNorm after each convolution (eval: running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 5), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
                                        nn.Linear(84, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def _randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial running statistics and affine parameters, so eval BatchNorm is not the identity."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
                if m.affine:
                    m.weight.uniform_(0.5, 1.5)
                    m.bias.uniform_(-0.5, 0.5)
    return model


def build_mlp() -> tuple[nn.Module, Inputs]:
    return MLP(), (torch.randn(8, 32),)


def build_lenet() -> tuple[nn.Module, Inputs]:
    return _randomize_bn(LeNet()), (torch.randn(2, 1, 32, 32),)


def build_encoder_layer() -> tuple[nn.Module, Inputs]:
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    return layer, (torch.randn(2, 8, 32),)


# ---------------------------------------------------------------- transformers models

VOCAB, SEQ = 100, 8


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ))


def _padding_mask() -> torch.Tensor:
    """A tokenizer's attention mask for a batch of 2: the second sequence is padded (last 3 tokens)."""
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 5:] = 0
    return mask


def build_bert() -> tuple[nn.Module, Inputs]:
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64)
    return BertModel(config), (_ids(), _padding_mask())


def build_gpt2() -> tuple[nn.Module, Inputs]:
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, use_cache=False,
                        bos_token_id=0, eos_token_id=0)
    return GPT2Model(config), (_ids(), None, _padding_mask())  # (input_ids, past_key_values, attention_mask)


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    # Grouped-query attention (2 key/value heads shared by 4 query heads) and rotary embeddings.
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         use_cache=False)
    assert config.num_key_value_heads < config.num_attention_heads
    return LlamaForCausalLM(config)


def build_llama() -> tuple[nn.Module, Inputs]:
    return _llama(), (_ids(), _padding_mask())  # (input_ids, attention_mask)


def build_llama_no_mask() -> tuple[nn.Module, Inputs]:
    # Without an attention mask (and without a cache) transformers looks for packed sequences in the
    # position ids: an int64 cumsum over (position_diff != 1) enters the graph.
    return _llama(), (_ids(),)


def build_vit() -> tuple[nn.Module, Inputs]:
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       image_size=32, patch_size=8, num_channels=3)
    return ViTModel(config), (torch.randn(2, 3, 32, 32),)


def build_resnet() -> tuple[nn.Module, Inputs]:
    from transformers import ResNetConfig, ResNetModel

    config = ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                          layer_type="basic")
    return _randomize_bn(ResNetModel(config)), (torch.randn(2, 3, 32, 32),)


def build_mobilenet_v2() -> tuple[nn.Module, Inputs]:
    from transformers import MobileNetV2Config, MobileNetV2Model

    # The architecture's 17 inverted-residual blocks are fixed; the width multiplier keeps it small.
    config = MobileNetV2Config(num_channels=3, image_size=32, depth_multiplier=0.25)
    return _randomize_bn(MobileNetV2Model(config)), (torch.randn(2, 3, 32, 32),)


# Why loosen: a deep stack of float32 matmuls/convolutions whose reduction order differs between
# the native code and oneDNN/MKL accumulates rounding error of a few ulps per layer. atol 1e-4 on
# activations of magnitude ~1 is ~1000 ulps and still catches every real bug (a wrong mask, head
# order, rotary sign or epsilon moves results by 1e-2 or more).
_DEEP = dict(rtol=1e-4, atol=1e-4, why="float32 reduction order over several matmul/conv layers")

MODELS: dict[str, ModelCase] = {c.name: c for c in [
    ModelCase("mlp", "torch.nn MLP (Linear, ReLU, GELU)", build_mlp),
    ModelCase("lenet_bn", "torch.nn LeNet CNN with BatchNorm (eval)", build_lenet, **_DEEP),
    ModelCase("transformer_encoder_layer", "torch.nn TransformerEncoderLayer (batch_first)", build_encoder_layer,
              **_DEEP),
    ModelCase("bert", "transformers BertModel (padding attention mask)", build_bert, **_DEEP),
    ModelCase("gpt2", "transformers GPT2Model (padding attention mask)", build_gpt2, **_DEEP),
    ModelCase("llama", "transformers LlamaForCausalLM (grouped-query attention, rotary, padding mask)",
              build_llama, **_DEEP),
    ModelCase("llama_no_mask", "transformers LlamaForCausalLM called without an attention mask",
              build_llama_no_mask, **_DEEP),
    ModelCase("vit", "transformers ViTModel", build_vit, **_DEEP),
    ModelCase("resnet", "transformers ResNetModel", build_resnet, **_DEEP),
    ModelCase("mobilenet_v2", "transformers MobileNetV2Model", build_mobilenet_v2, **_DEEP),
]}


def instantiate(name: str, seed: int = 0) -> tuple[nn.Module, Inputs]:
    """The model `name` in eval mode with seeded random weights, and its example inputs."""
    torch.manual_seed(seed)
    model, inputs = MODELS[name].build()
    return model.eval(), inputs


def graph_ops(model: nn.Module, inputs: Inputs) -> list[str]:
    """The aten overloads of the captured core-ATen graph, sorted."""
    from torchtosa.capture.trace import capture

    gm = capture(model, inputs).gm
    return sorted({str(n.target) for n in gm.graph.nodes
                   if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)})


def missing_ops(model: nn.Module, inputs: Inputs) -> list[str]:
    """The graph's aten overloads that no registry has an entry for."""
    table = registry()
    return [op for op in graph_ops(model, inputs) if op not in table]


def assert_same(got: Any, want: Any, case: ModelCase) -> None:
    """Same output structure; every tensor leaf close at the case's tolerance."""
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec, f"output structure {got_spec} != eager {want_spec}"
    assert any(isinstance(w, torch.Tensor) for w in want_leaves)
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        if isinstance(w, torch.Tensor):
            torch.testing.assert_close(g, w, rtol=case.rtol, atol=case.atol,
                                       msg=lambda m, i=i: f"output leaf {i}: {m}")
        else:
            assert g == w


def _note_missing(err: torchtosa.Unsupported, model: nn.Module, inputs: Inputs) -> None:
    """Add every op of the model without an entry to the error (the first one is its message)."""
    try:
        missing = missing_ops(model, inputs)
    except Exception as e:
        missing = [f"<could not list: {e}>"]
    if missing:
        err.add_note(f"aten ops of this model with no entry: {' '.join(missing)}")


def check_native(name: str) -> torchtosa.CompiledFunction:
    """torchtosa.compile(model, *inputs) matches eager on the same inputs and on fresh ones."""
    case = MODELS[name]
    model, inputs = instantiate(name)
    with torch.no_grad():
        expected = model(*inputs)
        try:
            native = torchtosa.compile(model, *inputs, fallback="error")  # all native, or fail
        except torchtosa.Unsupported as err:
            _note_missing(err, model, inputs)
            raise
        assert_same(native(*inputs), expected, case)
        # Fresh data of the same signature reuses the native code and is still right.
        fresh = tuple(_like(x) for x in inputs)
        assert_same(native(*fresh), model(*fresh), case)
    return native


def check_torch_compile(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile(model, backend="torchtosa") matches eager, and its graph ran as native code."""
    case = MODELS[name]
    model, inputs = instantiate(name)
    calls = []
    native_call = NativeFunction.__call__

    def counting(self: NativeFunction, *args: torch.Tensor, known: int = 0) -> list[torch.Tensor]:
        calls.append(self)
        return native_call(self, *args, known=known)

    monkeypatch.setattr(NativeFunction, "__call__", counting)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            expected = model(*inputs)
            compiled = torch.compile(model, backend="torchtosa", fullgraph=True, options={"fallback": "error"})
            try:
                got = compiled(*inputs)
            except torchtosa.Unsupported as err:
                _note_missing(err, model, inputs)
                raise
            assert calls, "torch.compile ran no native code"
            assert_same(got, expected, case)
    finally:
        torch._dynamo.reset()


def _like(x: Any) -> Any:
    """New random data shaped like `x` (token ids stay in the vocabulary; masks stay masks)."""
    if not isinstance(x, torch.Tensor):
        return x
    if x.dtype.is_floating_point:
        return torch.randn_like(x)
    return x.clone() if x.max() <= 1 else torch.randint_like(x, 0, VOCAB)


@pytest.mark.parametrize("name", list(MODELS))
def test_native(name: str) -> None:
    check_native(name)


@pytest.mark.parametrize("name", list(MODELS))
def test_torch_compile_backend(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check_torch_compile(name, monkeypatch)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_fast_path_decomposed(norm_first: bool, activation: str) -> None:
    """Under no_grad, Dynamo puts nn.TransformerEncoderLayer's fused kernel in the graph; the backend
    decomposes it (checked here on the aten graph itself, independent of the lowerings)."""
    from torchtosa.capture.trace import make_backend

    graphs = []

    def run_graph(captured: Any, opt: str) -> Callable[..., Any]:
        graphs.append(captured.gm)
        return lambda *args: captured.gm(*args)

    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, norm_first=norm_first,
                                       activation=activation).eval()
    x = torch.randn(2, 8, 32)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(layer, backend=make_backend(run_graph), fullgraph=True)(x)
        torch.testing.assert_close(got, layer(x))
    targets = {str(n.target) for n in graphs[0].graph.nodes}
    assert "aten._transformer_encoder_layer_fwd.default" not in targets
    assert "aten._softmax.default" in targets, sorted(t for t in targets if "aten" in t)
    torch._dynamo.reset()
