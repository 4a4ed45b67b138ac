"""Partial delegation (`to_tosa(..., partition=True)`): the largest part a TOSA target runs as one
conformant program, named by its boundary tensors, and the host graph around it; the whole runs
(the delegated part on TOSA's reference model, or natively) as the model does in PyTorch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_quantized_cnn import randomize
from test_quantizer import MLP
from torch import nn

import torchtosa
from torchtosa.execute.native import NativeFunction
from torchtosa.quantizer import TosaQuantizer, quantize


class Tagger(nn.Module):
    """An embedding lookup (int64 indices: not in TOSA-1.0+FP) feeding two linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(ids))))


def _native(program: torchtosa.Program, *inputs: torch.Tensor) -> list[torch.Tensor]:
    return NativeFunction(program.module, program.inputs, program.outputs, name=program.name)(*inputs)


def test_the_embedding_lookup_stays_on_the_host(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, ids = Tagger().eval(), torch.randint(0, 50, (4, 6))
    with pytest.raises(torchtosa.NotConformant, match="embedding"):
        torchtosa.to_tosa(model, ids, target="TOSA-1.0+FP", freeze=True)
    delegation = torchtosa.to_tosa(model, ids, target="TOSA-1.0+FP", freeze=True, partition=True)
    assert [h.op for h in delegation.host_ops] == ["aten.embedding.default"]
    assert "test_delegate.py" in delegation.host_ops[0].where and "not conformant" in delegation.host_ops[0].reason
    program = delegation.program
    assert str(program.target) == "TOSA-1.0+FP"
    assert program.input_names == ["embedding"] and [s.shape for s in program.inputs] == [(4, 6, 16)]
    assert "tosa.gather" not in str(program.module) and str(program.module).count("tosa.matmul") == 2
    program.target.validate(program.module)
    program.save(tmp_path / "part.tosa")
    assert (tmp_path / "part.tosa").stat().st_size > 0
    with torch.no_grad():
        want = model(ids)
        for run in (None, _native):  # the reference model, then native code
            (got,) = delegation(ids, run=run)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert "host   aten.embedding.default" in delegation.explain()


def test_a_quantized_model_keeps_its_float_edges_on_the_host() -> None:
    """TOSA-1.0+INT has no floats: the input quantize and the output dequantize run on the host,
    the int8 rest is delegated; the reference model and native code agree bit for bit, and the
    whole is within a quantum of PyTorch's run of the quantized model."""
    model = randomize(MLP())
    torch.manual_seed(0)
    shape = (64, 16)
    ep = quantize(model, (torch.randn(shape),), [(torch.randn(shape),) for _ in range(4)])
    delegation = torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True, partition=True)
    assert sorted(h.op for h in delegation.host_ops) == ["quantized_decomposed.dequantize_per_tensor.default",
                                                         "quantized_decomposed.quantize_per_tensor.default"]
    program = delegation.program
    assert [s.dtype for s in program.inputs + program.outputs] == [torch.int8, torch.int8]
    assert program.groups and all(g.path == "integer" for g in program.groups)
    x = torch.randn(shape)
    (reference,), (native,) = delegation(x), delegation(x, run=_native)
    assert torch.equal(reference, native)
    scale = float(delegation.host.graph.output_node().args[0][0].args[1])  # the output dequantize's scale
    assert ((reference - ep.module()(x)).abs() <= scale * 1.01).all()


def test_partition_needs_a_target_and_something_to_delegate() -> None:
    ids = torch.randint(0, 50, (4, 6))
    with pytest.raises(ValueError, match="partition=True"):
        torchtosa.to_tosa(lambda t: t * 2, ids, partition=True)
    with pytest.raises(torchtosa.Unsupported, match=r"no op of the graph can run on TOSA-1\.0\+FP"):
        torchtosa.to_tosa(lambda t: t * 2 + 1, ids, target="TOSA-1.0+FP", partition=True)  # int64 math


class _Bert(nn.Module):
    """A tiny BERT encoder (random weights) on token ids: its last hidden state."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=32, attn_implementation="eager")
        self.bert = BertModel(config, add_pooling_layer=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.bert(input_ids=ids).last_hidden_state


# scheme -> (quantizer, target, largest difference from PyTorch in output quanta): a16w8 measured
# 2 (its layer norms int8, requantized from and to the int16 residual stream: INT8_ONLY)
BERT_SCHEMES = {"int8": (TosaQuantizer, "TOSA-1.0+INT", 1), "a16w8": (lambda: TosaQuantizer(a16w8=True),
                                                                   "TOSA-1.0+INT+int16", 3)}


@pytest.mark.parametrize("scheme", list(BERT_SCHEMES))
def test_an_int8_bert_keeps_only_its_embedding_lookup_on_the_host(scheme: str) -> None:
    """Issue 30: a PT2E-quantized BERT encoder under TOSA-1.0+INT (int16 activations: +int16)
    delegates everything after the word embedding lookup (position and type embeddings, layer
    norms, attention, GELU, residuals) as one integer program; the host keeps the lookup and the
    quantize / dequantize at the edges. The reference model and native code agree bit for bit,
    within a quantum of PyTorch (a16w8: the measured quanta)."""
    quantizer, target, quanta = BERT_SCHEMES[scheme]
    torch.manual_seed(0)
    model = _Bert().eval()
    ids = torch.randint(0, 100, (1, 16))
    ep = quantize(model, (ids,), [(torch.randint(0, 100, (1, 16)),) for _ in range(4)], quantizer())
    delegation = torchtosa.to_tosa(ep, target=target, freeze=True, partition=True)
    assert sorted(h.op for h in delegation.host_ops) == ["aten.embedding.default",
                                                         "quantized_decomposed.dequantize_per_tensor.default",
                                                         "quantized_decomposed.quantize_per_tensor.default"]
    program = delegation.program
    assert program.groups and all(g.path == "integer" for g in program.groups)
    program.target.validate(program.module)
    x = torch.randint(0, 100, (1, 16))
    (reference,), (native,) = delegation(x), delegation(x, run=_native)
    assert torch.equal(reference, native)
    scale = float(delegation.host.graph.output_node().args[0][0].args[1])  # the output dequantize's scale
    assert ((reference - ep.module()(x)).abs() <= scale * (quanta + 0.01)).all()


class _BertEncoder(nn.Module):
    """_Bert's encoder layers alone: hidden states in, last hidden state out."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = _Bert().bert.encoder

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.encoder(h).last_hidden_state


def test_an_int8_bert_encoder_is_all_tosa_int() -> None:
    """Issue 30: BERT's encoder layers (hidden states in) lower whole to TOSA-1.0+INT: every group
    integer, only torchtosa's quantized ops served (no float op, no Q/DQ left)."""
    torch.manual_seed(0)
    model = _BertEncoder().eval()
    h = torch.randn(1, 16, 32)
    ep = quantize(model, (h,), [(torch.randn(1, 16, 32),) for _ in range(4)])
    program = torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True)
    assert program.groups and all(g.path == "integer" for g in program.groups)
    assert all(op.startswith("torchtosa.q") for op, _ in program.served), program.served
    program.target.validate(program.module)
