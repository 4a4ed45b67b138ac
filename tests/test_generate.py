"""Greedy generation with HF models whose forward runs through the torchtosa backend:
the default (dynamic) KV cache, empty at the first step, and StaticCache, written in place
one token per layer per step by the native code. Token for token equal to eager; with the dynamic cache and
dynamic=True, one graph for the prefill and one with symbolic sizes for every later step."""

from __future__ import annotations

import re
import warnings
from collections import Counter

import pytest
import torch
from torch._guards import CompileContext

from torchtosa import FallbackWarning, torchtosa_backend

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 32


def tiny_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


def tiny_gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_greedy_generate_matches_eager(make, cache: str) -> None:
    torch.manual_seed(0)
    model = make().eval()
    ids = torch.randint(1, 128, (1, 5))
    options = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0, "min_new_tokens": NEW_TOKENS}
    if cache == "static":
        options["cache_implementation"] = "static"
    with torch.no_grad():
        want = model.generate(ids, **options)
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compile_id = CompileContext.current_compile_id()  # (frame, compile of that frame)
        graphs.append((compile_id.frame_id, compile_id.frame_compile_id))
        return torchtosa_backend(gm, example_inputs)

    model.forward = torch.compile(model.forward, backend=backend, dynamic=cache == "dynamic")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        got = model.generate(ids, **options)
    assert got.shape == (1, 5 + NEW_TOKENS)
    assert torch.equal(got, want)
    if cache == "dynamic":  # the prefill (an empty cache: size 0 is specialised), then every step
        compiles = Counter(frame for frame, _ in set(graphs))  # compiles of each frame (graph breaks make frames)
        assert max(compiles.values()) <= 2, f"compiles per frame: {dict(compiles)}"
    # every graph ran natively: with the dynamic cache the prefill's cat of the empty cache and
    # the new keys drops the empty tensor, the cache positions (an arange between symbolic sizes)
    # are computed by the program; StaticCache's writes run in native code, in place
    for w in caught:
        text = str(w.message)
        assert "internal error" not in text, text
        assert not re.search(r"\d+ of \d+ ops( of [^:]*)? run eagerly", text), text
    torch._dynamo.reset()
