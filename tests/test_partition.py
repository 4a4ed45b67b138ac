"""Partitioning long functions into parts (private functions called in sequence)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from mlir import ir
from torch import nn

import torchtosa
from torchtosa import api
from torchtosa.execute.native import _prepare
from torchtosa.lower import partition, pipeline

MODELS = {
    "encoder": lambda: (nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0), (torch.randn(2, 9, 32),)),
    "conv": lambda: (nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                                   nn.Conv2d(8, 8, 3), nn.Sigmoid()), (torch.randn(2, 3, 12, 12),)),
    "residual_mlp": lambda: (_ResidualMLP(), (torch.randn(6, 24),)),
    "masked_mlp": lambda: (_ResidualMLP(masked=True), (torch.randn(6, 24),)),
}


class _CachedLayers(nn.Module):
    """Decoding-like layers: each grows its cache by one row (`torch.cat`, as HF's DynamicCache)
    and attends over it; the grown caches are outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(4))

    def forward(self, x: torch.Tensor, *caches: torch.Tensor) -> tuple[torch.Tensor, ...]:
        grown = []
        for layer, cache in zip(self.layers, caches, strict=True):
            cache = torch.cat([cache, layer(x).tanh()], 1)
            x = x + (cache.softmax(1) * cache).sum(1, keepdim=True)
            grown.append(cache)
        return x, *grown


class _ResidualMLP(nn.Module):
    """Residual blocks; `masked`: each block's update is masked by one boolean tensor computed
    before them (as a transformer's attention mask is), so a boolean crosses every cut."""

    def __init__(self, masked: bool = False) -> None:
        super().__init__()
        self.masked = masked
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 24))
                                    for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x.abs() > 0.5
        for block in self.blocks:
            x = x + (block(x).masked_fill(mask, 0.0) if self.masked else block(x))
        return x.softmax(-1)


def _functions(module: ir.Module) -> list[str]:
    return [ir.StringAttr(op.attributes["sym_name"]).value for op in module.body.operations
            if op.operation.name == "func.func"]


@pytest.mark.parametrize("opt", ["default", "parallel"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_parts_agree_with_eager(name: str, opt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cut into parts of 8 to 12 ops, models compute what eager does."""
    monkeypatch.setattr(partition, "PART_OPS", 8)
    model, inputs = MODELS[name]()
    model.eval()
    program = torchtosa.to_tosa(model, *inputs, target=None)
    module = _prepare(program.module, "forward", tuple(program.inputs), tuple(program.outputs))
    pipeline.lower(module, opt, stop_before="tosa-to-linalg")
    assert _functions(module)[-1] == "forward"
    # parts of 8 to 12 ops, or one function called per repeated layer (residual_mlp's blocks)
    assert sum(op.name == "func.call" for op in module.body.operations[-1].regions[0].blocks[0].operations) >= 3
    api.CACHE.clear()  # compile it partitioned, not reuse what another test compiled
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(model, *inputs, opt=opt)(*inputs), model(*inputs),
                                   rtol=1e-5, atol=1e-5)
    api.CACHE.clear()


@pytest.mark.parametrize("name", ["residual_mlp", "masked_mlp"])
def test_parts_pass_few_values_and_share_one_arena(name: str) -> None:
    """Cuts fall where few values are live (near the residual stream between blocks), a boolean
    crossing them as i8, and the parts of the lowered module get their memory from the caller's
    one arena."""
    model, inputs = MODELS[name]()
    program = torchtosa.to_tosa(model.eval(), *inputs, target=None)
    module = _prepare(program.module, "forward", tuple(program.inputs), tuple(program.outputs))
    body = list(next(op for op in module.body.operations).regions[0].blocks[0].operations)[:-1]
    partition.partition(module, len(body) // 4)
    assert _functions(module)[-1] == "forward"
    calls = [op for op in module.body.operations[-1].regions[0].blocks[0].operations if op.name == "func.call"]
    callees = [ir.FlatSymbolRefAttr(call.attributes["callee"]).value for call in calls]
    # the blocks are identical (the constants CSE left in the first are cloned into each, the mask
    # they all read moved before them): one function, called once per block
    assert max(callees.count(c) for c in callees) == 4, callees
    assert sum(len(call.results) for call in calls) <= 12
    signatures = [str(ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value))
                  for op in module.body.operations if op.operation.name == "func.func"]
    assert not any("xi1>" in s for s in signatures[:-1]), signatures  # no boolean crosses a call as i1
    assert len(pipeline.lower(module, "default")) == 1  # one arena, for the caller


class _ConvBlocks(nn.Module):
    """Two identical residual blocks of 3x3 convolutions (a small r3d_18 stage, in 2-D)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                                  nn.Conv2d(8, 8, 3, padding=1)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.relu(x + block(x))
        return x


@pytest.mark.parametrize(("layer_ops", "merged"), [(partition.LAYER_OPS, True), (10**6, False)])
def test_short_functions_of_repeated_convolution_layers_compile_each_layer_once(
        layer_ops: int, merged: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A function far shorter than PART_OPS that repeats a layer of LAYER_OPS ops or more with a
    convolution in it is cut between the layers, and each layer between its two convolutions
    (`partition._halves`: halves LLVM compiles in parallel): two functions called once per
    layer each; without that rule it stays whole. Both agree with eager."""
    monkeypatch.setattr(partition, "LAYER_OPS", layer_ops)
    model, x = _randomize(_ConvBlocks().eval()), torch.randn(1, 8, 10, 10)
    program = torchtosa.to_tosa(model, x, target=None)
    module = _prepare(program.module, "forward", tuple(program.inputs), tuple(program.outputs))
    body = list(next(op for op in module.body.operations).regions[0].blocks[0].operations)
    assert len(body) < partition.PART_OPS
    partition.partition(module)
    calls = [ir.FlatSymbolRefAttr(op.attributes["callee"]).value
             for op in module.body.operations[-1].regions[0].blocks[0].operations if op.name == "func.call"]
    halves = len(calls) == 4 and calls[:2] == calls[2:] and calls[0] != calls[1]
    assert halves == merged and (not calls) == (not merged)
    api.CACHE.clear()
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(model, x)(x), model(x), rtol=1e-5, atol=1e-5)
    api.CACHE.clear()


class _SharedTable(nn.Module):
    """Layers that each compute the same table from a position input, as a Llama's layers each
    apply the rotary tables: CSE leaves the one copy in the first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(24, 24) for _ in range(4))

    def forward(self, x: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(x)
            table = torch.cos(position * 0.5).reshape(1, -1)  # in the middle of the layer, as a Llama's
            x = x + torch.tanh(h * table)
        return x


@pytest.mark.parametrize("shared_first", [True, False])
def test_values_every_layer_shares_move_before_the_layers(shared_first: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The table all four layers read is computed once, in the first layer's stretch of ops; moved
    to the front (`_shared_first`), the four layers are alike and one function is called four
    times. Left where it is, the first layer differs and only the other three are merged."""
    if not shared_first:
        monkeypatch.setattr(partition, "_shared_first", lambda function, body, shortest: body)
    model, args = _SharedTable().eval(), (torch.randn(3, 24), torch.randn(24))
    program = torchtosa.to_tosa(model, *args, target=None)
    module = _prepare(program.module, "forward", tuple(program.inputs), tuple(program.outputs))
    partition.partition(module)
    module.operation.verify()
    calls = [ir.FlatSymbolRefAttr(op.attributes["callee"]).value
             for op in module.body.operations[-1].regions[0].blocks[0].operations if op.name == "func.call"]
    assert max(calls.count(c) for c in calls) == (4 if shared_first else 3), calls
    api.CACHE.clear()
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(model, *args, fallback="error")(*args), model(*args),
                                   rtol=1e-5, atol=1e-5)
    api.CACHE.clear()


def _randomize(model: nn.Module) -> nn.Module:
    """`model` with random batch-norm statistics and affine parameters."""
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model


def _forward_ops(monkeypatch: pytest.MonkeyPatch, stop_before: str) -> list[list[str]]:
    """With PART_OPS = 8, record for every module compiled the top-level ops of its @forward once
    lowered up to `stop_before` ("call @callee" for a call)."""
    seen: list[list[str]] = []
    lower = pipeline.lower

    def spy(module: ir.Module, *args: object, **kwargs: object) -> object:
        copy = ir.Module.parse(str(module), context=module.context)
        lower(copy, "default", stop_before=stop_before)
        forward = next(f for f in copy.body.operations if ir.StringAttr(f.attributes["sym_name"]).value == "forward")
        seen.append([f"call @{ir.FlatSymbolRefAttr(op.attributes['callee']).value}" if op.name == "func.call"
                     else op.name for op in forward.regions[0].blocks[0].operations])
        return lower(module, *args, **kwargs)

    monkeypatch.setattr(partition, "PART_OPS", 8)
    monkeypatch.setattr("torchtosa.execute.native.lower", spy)
    return seen


def test_layers_growing_a_dynamic_cache_are_cut_and_merged(monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoding step with a cache of a symbolic length: the grown caches (dynamic results, which
    a part can't return) are concatenated again by the caller from the part's static values, so
    the layers are still cut apart and the identical ones compiled once; the results agree with
    eager at every length."""
    seen = _forward_ops(monkeypatch, "tosa-to-linalg")  # partitioned
    api.CACHE.clear()
    torch.manual_seed(0)
    model = _CachedLayers().eval()
    compiled = torchtosa.compile(model)
    with torch.no_grad():
        for length in (5, 7, 11):  # the second length compiles the symbolic one
            x, caches = torch.randn(1, 1, 24), [torch.randn(1, length, 24) for _ in range(4)]
            for got, want in zip(compiled(x, *caches), model(x, *caches), strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    api.CACHE.clear()
    assert len(seen) == 2, seen  # the first length, then the symbolic one
    callees = [name for name in seen[-1] if name.startswith("call @")]
    assert max(callees.count(c) for c in callees) >= 3, callees  # the repeated layer: one function


class _SequenceLayers(nn.Module):
    """Residual attention layers over a sequence, whose length becomes symbolic: every value
    between two layers is of a dynamic shape, and the attention's reshapes and matmuls have
    dynamic dims for the shadows' dims to fold through."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 24)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(x)
            b, s, _ = h.shape
            q = h.view(b, s, 2, 12).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(b, s, 24)
            x = x + torch.tanh(a)
        return x.softmax(-1)


def test_layers_of_a_symbolic_length_compute_into_their_callers_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A part can't return a buffer of a size its caller doesn't know: each part writes a result
    of a dynamic shape into an empty tensor the caller passes, sized by `tensor.dim`s of a shadow
    copy of the part's ops that folds into index arithmetic on the part's operands (so the caller
    computes no layer twice). The layers are cut, merged into one function called per layer, and
    agree with eager at every length."""
    seen = _forward_ops(monkeypatch, "unit-dims")  # partitioned, shadows folded
    api.CACHE.clear()
    torch.manual_seed(0)
    model = _SequenceLayers().eval()
    compiled = torchtosa.compile(model, fallback="error")
    with torch.no_grad():
        for length in (5, 7, 11):  # the second length compiles the symbolic one
            x = torch.randn(1, length, 24)
            torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    api.CACHE.clear()
    assert len(seen) == 2, seen
    callees = [name for name in seen[-1] if name.startswith("call @")]
    assert max(callees.count(c) for c in callees) == 4, callees  # the layer: one function
    computed = [name for name in seen[-1] if name.startswith("linalg.")]
    assert not computed, computed  # the shadows are gone


def test_a_dynamic_result_after_the_last_cut_stays_in_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """Static layers, then a result of a symbolic size computed from them: the ops after the last
    cut are not made a part (which would return a buffer the caller can't allocate; bufferization
    failed and the whole graph ran eagerly)."""
    def fn(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        for _ in range(6):
            x = torch.tanh(x @ w) + x
        return rows @ x.t()

    monkeypatch.setattr(partition, "PART_OPS", 8)
    api.CACHE.clear()
    x, w = torch.randn(4, 24), torch.randn(24, 24) / 5
    compiled = torchtosa.compile(fn, fallback="error")
    for length in (5, 7, 11):  # the second length compiles the symbolic one
        rows = torch.randn(length, 24)
        torch.testing.assert_close(compiled(x, rows, w), fn(x, rows, w), rtol=1e-5, atol=1e-5)
    api.CACHE.clear()
