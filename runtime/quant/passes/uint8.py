"""uint8 activations as int8: X86InductorQuantizer's graphs quantize activations to uint8
([0, 255]); TOSA's integer ops take int8.

A uint8 quantize followed only by uint8 dequantizes computes the same floats as the int8 pair
with the zero point and the range shifted by -128: q8 = clamp(round(x / s) + zp - 128, lo - 128,
hi - 128) = q_u8 - 128, and (q8 - (zp - 128)) * s = (q_u8 - zp) * s. So `normalize_uint8`
rewrites such pairs in place (the model's input quantize and output dequantize included: their
float values are unchanged), before the pattern matcher looks for int8 groups.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..library import QD

_SHIFT = 128


def _is_u8(node: object, op: torch._ops.OpOverload) -> bool:
    """A `.default` (scalar parameters) per-tensor quantize/dequantize to/from uint8."""
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target == op \
        and len(node.args) == 6 and node.args[5] == torch.uint8 and not node.kwargs


def _as_int8(node: fx.Node) -> None:
    x, scale, zero_point, lo, hi, _ = node.args
    node.args = (x, scale, zero_point - _SHIFT, lo - _SHIFT, hi - _SHIFT, torch.int8)
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.dtype == torch.uint8:
        node.meta["val"] = val.new_empty(val.shape, dtype=torch.int8)


def normalize_uint8(gm: fx.GraphModule) -> int:
    """Rewrite each uint8 quantize_per_tensor whose users are all uint8 dequantize_per_tensor
    with the same parameters into the int8 pair; the number of quantizes rewritten."""
    count = 0
    for node in list(gm.graph.nodes):
        if not _is_u8(node, QD.quantize_per_tensor.default) or not node.users:
            continue
        users = list(node.users)
        if not all(_is_u8(u, QD.dequantize_per_tensor.default) and u.args[0] is node
                   and tuple(u.args[1:]) == tuple(node.args[1:]) for u in users):
            continue  # a uint8 tensor escapes (an output, another op): its values would change
        for n in (node, *users):
            _as_int8(n)
        count += 1
    if count:
        gm.recompile()
    return count
