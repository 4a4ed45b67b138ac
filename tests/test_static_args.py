"""Private functions take only the pointers of static memref arguments (runtime/lower/static_args.py)."""

from __future__ import annotations

import pytest
import torch
from mlir import ir
from torch import nn

import torchtosa
from torchtosa import api
from torchtosa.execute.native import _prepare
from torchtosa.lower import partition, pipeline
from torchtosa.lower.static_args import _constant_fields, _width, constant_fields


def test_constant_fields_of_each_argument_kind() -> None:
    """Offsets, sizes and strides of static memrefs (identity or strided layout) are constants at
    their LLVM argument positions; a dynamic memref's fields and scalars are not."""
    with ir.Context():
        types = [ir.Type.parse(t) for t in ("memref<2x3xf32>", "index", "memref<4xf32, strided<[2], offset: 1>>",
                                            "memref<?x5xf32>", "memref<f32>")]
        # memref<2x3xf32>: 0-6; index: 7; strided: 8-12; memref<?x5xf32>: 13-19; memref<f32>: 20-22
        assert _width(types) == 23
        assert _constant_fields(types) == [(2, 0), (3, 2), (4, 3), (5, 3), (6, 1),
                                           (10, 1), (11, 4), (12, 2),
                                           (22, 0)]
        assert _constant_fields([ir.Type.parse("memref<*xf32>")]) is None


def _residual_mlp() -> nn.Module:
    class ResidualMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(24), nn.Linear(24, 48), nn.GELU(),
                                                      nn.Linear(48, 24)) for _ in range(4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(x)
            return x.softmax(-1)

    return ResidualMLP().eval()


def _lowered(program: torchtosa.Program) -> ir.Module:
    module = _prepare(program.module, "forward", tuple(program.inputs), tuple(program.outputs))
    pipeline.lower(module, "default")
    return module


@pytest.mark.parametrize("rewrite", [True, False])
def test_parts_use_no_descriptor_fields(rewrite: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """After lowering, every private part is internal and uses none of its static memrefs' offset,
    size and stride arguments (so LLVM drops them from the calls); without the rewrite, MLIR's
    convention rebuilds each descriptor from them. Both compute what eager does."""
    monkeypatch.setattr(partition, "PART_OPS", 8)
    model, x = _residual_mlp(), torch.randn(6, 24)
    program = torchtosa.to_tosa(model, x, target=None)
    types: dict[str, list[ir.Type]] = {}

    def record(module: ir.Module, private: dict[str, list[ir.Type]]) -> None:
        """The types as the "llvm" stage sees them (after the arenas are passed)."""
        types.update(private)
        if rewrite:
            constant_fields(module, private)

    monkeypatch.setattr(pipeline, "constant_fields", record)
    module = _lowered(program)
    assert len(types) >= 2  # the blocks, merged into one, and what follows them
    parts = {ir.StringAttr(op.attributes["sym_name"]).value: op for op in module.body.operations
             if op.operation.name == "llvm.func" and "__part" in str(op.attributes["sym_name"])}
    assert sorted(parts) == sorted(types)
    for name, op in parts.items():
        arguments = op.regions[0].blocks[0].arguments
        fields = _constant_fields(types[name])
        assert fields
        used = [position for position, _ in fields if list(arguments[position].uses)]
        internal = "linkage" in op.attributes and str(op.attributes["linkage"]) == "#llvm.linkage<internal>"
        if rewrite:
            assert internal and not used, name
        else:
            assert not internal and used, name
    api.CACHE.clear()
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(model, x)(x), model(x), rtol=1e-5, atol=1e-5)
    api.CACHE.clear()


def _passthrough(op: ir.Operation) -> list[str]:
    return [ir.StringAttr(a).value for a in ir.ArrayAttr(op.attributes["passthrough"])] \
        if "passthrough" in op.attributes else []


@pytest.mark.parametrize("partitioned", [True, False])
def test_glue_is_compiled_without_optimization(partitioned: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The C-interface wrapper of a partitioned function, which only unpacks descriptors and calls
    the parts, is optnone (the function itself internal and always inlined into it); an
    unpartitioned function's wrapper holds the model's loops and keeps -O3. Both compute what
    eager does. (The model's four identical layers are parts by default: `partition.LAYER_OPS`.)"""
    if partitioned:
        monkeypatch.setattr(partition, "PART_OPS", 8)
    else:
        monkeypatch.setattr(partition, "LAYER_OPS", 10**6)
    model, x = _residual_mlp(), torch.randn(6, 24)
    module = _lowered(torchtosa.to_tosa(model, x, target=None))  # owns the ops below
    functions = {ir.StringAttr(op.attributes["sym_name"]).value: op for op in module.body.operations
                 if op.operation.name == "llvm.func"}
    assert str(functions["forward"].attributes["linkage"]) == "#llvm.linkage<internal>"
    assert "alwaysinline" in _passthrough(functions["forward"])
    assert any("__part" in name for name in functions) == partitioned
    assert ("optnone" in _passthrough(functions["_mlir_ciface_forward"])) == partitioned
    api.CACHE.clear()
    with torch.no_grad():
        torch.testing.assert_close(torchtosa.compile(model, x)(x), model(x), rtol=1e-5, atol=1e-5)
    api.CACHE.clear()
