"""Integer edges: a quantized model's float input quantize and output dequantize taken out of
the graph, so the program takes and returns the int8 values (TOSA's INT profile has no float
tensors). Each edge keeps its quantization, so callers convert at the boundary themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from ..library import QD

aten = torch.ops.aten
_Q = QD.quantize_per_tensor.default
_DQ = QD.dequantize_per_tensor.default


@dataclass(frozen=True)
class Quantization:
    """How a program's int8 input or output encodes floats: x ≈ (q - zero_point) * scale."""

    scale: float
    zero_point: int
    quant_min: int
    quant_max: int
    dtype: torch.dtype

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """The integer tensor of a float one, as the model's quantize computes it."""
        return _Q(x, self.scale, self.zero_point, self.quant_min, self.quant_max, self.dtype)

    def dequantize(self, q: torch.Tensor) -> torch.Tensor:
        """The float values of an integer tensor, as the model's dequantize computes them."""
        return _DQ(q, self.scale, self.zero_point, self.quant_min, self.quant_max, self.dtype)

    def __str__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')} (scale {self.scale:.6g}, zero point {self.zero_point})"


def integer_edges(gm: fx.GraphModule) -> tuple[list[Quantization | None], list[Quantization | None]]:
    """Rewrite `gm` so that each float input used only by identical per-tensor quantizes
    (directly, or through ops that only move or pad values) is the quantized tensor itself,
    and each output that is a per-tensor dequantize (used only there) is the integer tensor;
    the quantization of each input and output (None: unchanged)."""
    inputs: list[Quantization | None] = []
    for node in gm.graph.find_nodes(op="placeholder"):
        inputs.append(_input_edge(node))
    output = gm.graph.output_node()
    outs = list(output.args[0]) if isinstance(output.args[0], (list, tuple)) else [output.args[0]]
    outputs: list[Quantization | None] = []
    for k, node in enumerate(outs):
        if isinstance(node, fx.Node) and node.target == _DQ and len(node.users) == 1 and outs.count(node) == 1:
            outputs.append(Quantization(*node.args[1:5], node.args[5]))
            outs[k] = node.args[0]
        else:
            outputs.append(None)
    output.args = (type(output.args[0])(outs) if isinstance(output.args[0], (list, tuple)) else outs[0],)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return inputs, outputs


# Ops that only move or pad values: quantizing before them computes what quantizing after them
# does (quantization is elementwise), with a pad value quantized as well.
_MOVES = {aten.constant_pad_nd.default, aten.view.default, aten.reshape.default, aten.permute.default,
          aten.unsqueeze.default, aten.squeeze.dim, aten.clone.default}


def _input_edge(node: fx.Node) -> Quantization | None:
    """Quantize `node` (a float input) at the input if everything it reaches goes through the
    same per-tensor quantize, directly or after ops that only move or pad values."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not val.is_floating_point():
        return None
    chain = []
    end = node
    while len(end.users) == 1 and next(iter(end.users)).target in _MOVES:
        end = next(iter(end.users))
        chain.append(end)
    users = list(end.users)
    if not users or any(u.target != _Q or u.args[0] is not end for u in users):
        return None
    if len({tuple(u.args[1:]) for u in users}) != 1:
        return None
    quantization = Quantization(*users[0].args[1:5], users[0].args[5])
    for moved in [node, *chain]:  # each value now holds the quantized tensor: same shape, int8
        moved.meta["val"] = moved.meta["val"].to(quantization.dtype)
        if moved.target == aten.constant_pad_nd.default and len(moved.args) > 2:
            value = quantization.quantize(torch.tensor([float(moved.args[2])])).item()
            moved.args = (*moved.args[:2], value)
    for user in users:
        user.replace_all_uses_with(end)
        end.graph.erase_node(user)
    return quantization
