"""Greedy generation with HF models whose forward runs through the torchtosa backend:
the default (dynamic) KV cache, empty at the first step, and StaticCache, written in place
one token per layer per step. Token for token equal to eager."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from torchtosa import FallbackWarning

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 16


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
    model.forward = torch.compile(model.forward, backend="torchtosa")
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        got = model.generate(ids, **options)
    assert got.shape == (1, 5 + NEW_TOKENS)
    assert torch.equal(got, want)
    # most of every graph ran natively: the warnings count what fell back
    for w in caught:
        if m := re.search(r"(\d+) of (\d+) ops run eagerly", str(w.message)):
            assert int(m[1]) * 4 < int(m[2]), str(w.message)
    torch._dynamo.reset()
