"""outline.py: a model's repeated layers are traced once, results match eager, the model is left as it was."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchtosa
from torchtosa.api import torchtosa_backend
from torchtosa.capture.outline import INVOKE_SUBGRAPH, inline_subgraphs, outlined, repeated_layers
from torchtosa.capture.trace import capture
from torchtosa.errors import InvalidInput


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(d, 2 * d), nn.Linear(2 * d, d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.relu(self.fc1(x))))


class InPlace(Block):
    """Updates its input in place: TorchDynamo refuses that inside a nested compile region."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return super().forward(x)


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], d: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * 1.5  # the blocks get an intermediate, which InPlace may update
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class KeywordBlock(Block):
    """Called with keyword operands, as a transformer block gets its mask."""

    def forward(self, x: torch.Tensor, scale: float = 1.0, *, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = super().forward(x) * scale
        return y if mask is None else y.masked_fill(mask, 0.0)


class KeywordStack(Stack):
    def __init__(self, n: int, scales: list[float]) -> None:
        super().__init__([KeywordBlock() for _ in range(n)])
        self.scales = scales

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        for block, scale in zip(self.blocks, self.scales, strict=True):
            x = block(x, mask=mask) if scale == 1.0 else block(x, scale=scale, mask=mask)
        return self.head(x)


def _stack(n: int, cls: type[nn.Module] = Block) -> Stack:
    torch.manual_seed(0)
    return Stack([cls() for _ in range(n)]).eval()


def _aten_ops(gm: torch.fx.GraphModule, name: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))


def test_identical_blocks_are_traced_once_and_match_eager() -> None:
    model, x = _stack(4), torch.randn(2, 8, 16)
    captured = capture(model, (x,))
    assert list(captured.outlined.values()) == [4]  # one subgraph, called once per block
    assert _aten_ops(captured.gm, "native_layer_norm") == 4  # inlined back: one flat aten graph
    assert not any("subgraph" in n.name for n in captured.gm.graph.nodes)
    with torch.no_grad():
        got = captured.gm(*captured.params, x)[0]
        torch.testing.assert_close(got, model(x))
    # each block's own weights: the blocks differ, and so would a result computed with block 0's
    assert len({id(p) for p in captured.params}) == len(list(model.parameters()))


def test_outline_off_traces_every_block() -> None:
    model, x = _stack(3), torch.randn(2, 16)
    captured = capture(model, (x,), outline=False)
    assert captured.outlined == {}
    with torch.no_grad():
        torch.testing.assert_close(captured.gm(*captured.params, x)[0], model(x))


def test_compiled_model_of_identical_blocks_matches_eager() -> None:
    model, x = _stack(3), torch.randn(4, 16)
    compiled = torchtosa.compile(model, x, fallback="error")
    y = torch.randn(4, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(y), model(y), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scales", [[1.0] * 4, [1.0, 0.5, 1.0, 0.5]])
def test_blocks_called_with_keywords_are_traced_once_per_distinct_call(scales: list[float]) -> None:
    torch.manual_seed(0)
    model, x = KeywordStack(4, scales).eval(), torch.randn(2, 8, 16)
    mask = torch.rand(2, 8, 16) > 0.7
    captured = capture(model, (x, mask))
    # a keyword's value is an operand of the region: blocks called with another scale are traced apart
    assert sorted(captured.outlined.values()) == ([4] if set(scales) == {1.0} else [2, 2])
    with torch.no_grad():
        torch.testing.assert_close(captured.gm(*captured.params, x, mask)[0], model(x, mask))
        with outlined(model):  # the marked forward keeps the block's signature and results in eager
            torch.testing.assert_close(model(x, mask), model.head(_eager_blocks(model, x, mask)))


def _eager_blocks(model: KeywordStack, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    for block, scale in zip(model.blocks, model.scales, strict=True):
        x = KeywordBlock.forward(block, x, scale, mask=mask)
    return x


def test_blocks_that_differ_in_shape_are_not_grouped() -> None:
    torch.manual_seed(0)
    mixed = Stack([Block(16), Block(16), Block(16)])
    mixed.blocks[1].fc1 = nn.Linear(16, 32, bias=False)  # same type, other state
    groups = repeated_layers(mixed)
    assert [[list(mixed.blocks).index(b) for b in g] for g in groups] == [[0, 2]]
    assert repeated_layers(nn.Sequential(nn.ModuleList([Block(8), Block(16)]))) == []
    layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])  # single layers: nothing to gain
    assert repeated_layers(layers) == []


def test_a_block_with_its_own_forward_or_no_weights_is_not_grouped() -> None:
    model = _stack(2)
    model.blocks[0].forward = model.blocks[0].forward  # set on the instance
    assert repeated_layers(model) == []
    assert repeated_layers(nn.Sequential(nn.ReLU(), nn.ReLU())) == []


def test_the_model_is_unchanged_after_compile_and_after_an_error() -> None:
    model = _stack(3)
    before = [(type(b), sorted(vars(b))) for b in model.blocks]
    noted = dict(vars(Block.forward))  # nested_compile_region notes its options on the function
    torchtosa.compile(model, torch.randn(2, 16))
    assert [(type(b), sorted(vars(b))) for b in model.blocks] == before
    with pytest.raises(InvalidInput):
        capture(model, (torch.randn(2, 7),))  # a shape error inside a block
    assert [(type(b), sorted(vars(b))) for b in model.blocks] == before
    with outlined(model) as marked:
        assert marked == 3 and all(type(b) is not Block and isinstance(b, Block) for b in model.blocks)
    assert all(type(b) is Block for b in model.blocks)
    assert vars(Block.forward) == noted


def test_a_region_dynamo_refuses_falls_back_to_tracing_every_block() -> None:
    model, x = _stack(2, InPlace), torch.randn(2, 16)
    captured = capture(model, (x,))
    assert captured.outlined == {}  # traced without regions
    with torch.no_grad():
        torch.testing.assert_close(captured.gm(*captured.params, x)[0], model(x))
    assert all(type(b) is InPlace for b in model.blocks)


def test_user_marked_regions_import_through_torch_compile_and_export() -> None:
    region = torch.compiler.nested_compile_region(lambda x, w: torch.tanh(x @ w))

    class Marked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(8, 8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return region(region(x, self.w1), self.w2)

    marked: list[int] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        marked.append(len(gm.graph.find_nodes(op="call_function", target=INVOKE_SUBGRAPH)))
        return torchtosa_backend(gm, example_inputs, options={"fallback": "error"})

    model, x = Marked().eval(), torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(torch.compile(model, backend=backend)(x), expected, rtol=1e-4, atol=1e-5)
        assert marked == [2]  # Dynamo kept the regions; the backend inlined them
        program = torchtosa.to_tosa(torch.export.export(model, (x,)))  # torch.export inlines them itself
    assert str(program).count("tosa.matmul") == 2


def test_inline_subgraphs_leaves_a_plain_graph_alone() -> None:
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    code = gm.code
    assert inline_subgraphs(gm) == {} and gm.code == code
