"""Elementwise loops fused once unit dimensions are dropped (runtime/lower/fusion.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from mlir import ir
from test_schedule import _linalg

import torchtosa
from torchtosa.lower import fusion
from torchtosa.lower.irutil import context, find_ops


def _batch_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    mean, var = torch.zeros(x.shape[1]), torch.ones(x.shape[1])
    return F.relu(F.batch_norm(x, mean, var, weight, bias, training=True))


def _full_size_loops(module: ir.Module, elements: int) -> list[ir.Operation]:
    """The linalg.generic ops of `module` with an operand of `elements` elements."""
    def full(op: ir.Operation) -> bool:
        return op.name == "linalg.generic" and any(
            isinstance(v.type, ir.RankedTensorType) and math.prod(ir.RankedTensorType(v.type).shape) == elements
            for v in op.operands)
    return find_ops(module, full)


@pytest.mark.parametrize("shape", [(4, 32, 14, 14), (2, 8, 5, 3, 4)])
def test_a_training_batch_norm_reads_its_input_in_three_loops(shape: tuple[int, ...]) -> None:
    # its f64 sums read the input converted (once a buffer twice its size, written then read
    # twice), and its normalization over [N, C, HW] and its scale and shift over the input's
    # shape are one loop: the sum, the squared deviations' sum, the output
    x, weight, bias = torch.randn(*shape), torch.rand(shape[1]) + 0.5, torch.randn(shape[1])
    module = _linalg(_batch_norm, x, weight, bias, stop_before="schedule")
    loops = _full_size_loops(module, x.numel())
    assert len(loops) == 3, [str(op) for op in loops]
    wide = [op for op in find_ops(module, lambda op: op.name == "tensor.empty")
            if math.prod(ir.RankedTensorType(op.results[0].type).shape) == x.numel()
            and isinstance(ir.RankedTensorType(op.results[0].type).element_type, ir.F64Type)]
    assert not wide
    compiled = torchtosa.compile(_batch_norm, x, weight, bias)
    y = torch.randn(*shape) * 3 + 1
    torch.testing.assert_close(compiled(y, weight, bias), _batch_norm(y, weight, bias), rtol=1e-5, atol=1e-5)


def _module(source: str) -> ir.Module:
    return ir.Module.parse(source, context())


# the sum over the last dimension of the loop `x` (a [2, 8, 16] tensor)
_SUM = """  %sum_{x} = linalg.generic
      {{indexing_maps = [#id, #r], iterator_types = ["parallel", "parallel", "reduction"]}}
      ins(%{x} : tensor<2x8x16xf32>) outs(%z : tensor<2x8xf32>) {{
  ^bb0(%i: f32, %o: f32):
    %s = arith.addf %i, %o : f32
    linalg.yield %s : f32
  }} -> tensor<2x8xf32>"""

_BROADCAST_THEN_SUM = """
#id = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
#c = affine_map<(d0, d1, d2) -> (d1)>
#r = affine_map<(d0, d1, d2) -> (d0, d1)>
#a = affine_map<(d0, d1, d2) -> (d0, d2)>
#w = affine_map<(d0, d1, d2) -> (d1, d2)>
func.func @f(%b: tensor<8xf32>, %x: tensor<2x8x16xf32>, %p: tensor<2x16xf32>, %q: tensor<8x16xf32>)
    -> (tensor<2x8xf32>, tensor<2x8xf32>, tensor<2x8xf32>) {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<2x8x16xf32>
  %sq = linalg.generic {indexing_maps = [#c, #id], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%b : tensor<8xf32>) outs(%e : tensor<2x8x16xf32>) {
  ^bb0(%i: f32, %o: f32):
    %s = arith.mulf %i, %i : f32
    linalg.yield %s : f32
  } -> tensor<2x8x16xf32>
  %ex = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%x : tensor<2x8x16xf32>) outs(%e : tensor<2x8x16xf32>) {
  ^bb0(%i: f32, %o: f32):
    %s = math.exp %i : f32
    linalg.yield %s : f32
  } -> tensor<2x8x16xf32>
  %pq = linalg.generic {indexing_maps = [#a, #w, #id], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%p, %q : tensor<2x16xf32>, tensor<8x16xf32>) outs(%e : tensor<2x8x16xf32>) {
  ^bb0(%i: f32, %j: f32, %o: f32):
    %s = arith.subf %i, %j : f32
    linalg.yield %s : f32
  } -> tensor<2x8x16xf32>
  %z0 = tensor.empty() : tensor<2x8xf32>
  %z = linalg.fill ins(%zero : f32) outs(%z0 : tensor<2x8xf32>) -> tensor<2x8xf32>
{sums}
  return %sum_sq, %sum_ex, %sum_pq : tensor<2x8xf32>, tensor<2x8xf32>, tensor<2x8xf32>
}
""".replace(
    "{sums}", "\n".join(_SUM.format(x=x) for x in ("sq", "ex", "pq")))


def test_a_reduction_fuses_a_producer_only_where_it_stays_a_reduction_of_a_tensor() -> None:
    # a [8] broadcast over [2, 8, 16] summed over the 16 is not fused (no operand would bound
    # that loop), nor a difference of [2, 16] and [8, 16] broadcasts summed (a contraction of
    # broadcasts: the schedule's tiling of _trilinear's three-operand one aborted the process);
    # exponentials of a [2, 8, 16] tensor summed are
    module = _module(_BROADCAST_THEN_SUM)
    fusion.fuse_elementwise(module)
    assert module.operation.verify()
    bodies = [[o.name for o in op.regions[0].blocks[0].operations]
              for op in find_ops(module, lambda op: op.name == "linalg.generic")]
    assert ["math.exp", "arith.addf", "linalg.yield"] in bodies  # the exponentials summed: one loop
    assert ["arith.mulf", "linalg.yield"] in bodies  # the broadcast square stays a loop of its own
    assert ["arith.subf", "linalg.yield"] in bodies  # so does the difference of broadcasts


_CONVERSION_READ_TWICE = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#a = affine_map<(d0, d1, d2) -> (d0, d2)>
#b = affine_map<(d0, d1, d2) -> (d2, d1)>
#c = affine_map<(d0, d1, d2) -> (d0, d1)>
func.func @f(%x: tensor<4x8xbf16>, %w: tensor<8x8xf32>) -> (tensor<4x8xf32>, tensor<4x8xf32>) {
  %e = tensor.empty() : tensor<4x8xf32>
  %wide = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<4x8xbf16>) outs(%e : tensor<4x8xf32>) {
  ^bb0(%i: bf16, %o: f32):
    %s = arith.extf %i : bf16 to f32
    linalg.yield %s : f32
  } -> tensor<4x8xf32>
  %neg = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%wide : tensor<4x8xf32>) outs(%e : tensor<4x8xf32>) {
  ^bb0(%i: f32, %o: f32):
    %s = arith.negf %i : f32
    linalg.yield %s : f32
  } -> tensor<4x8xf32>
  %prod = linalg.generic {indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction"]}
      ins(%wide, %w : tensor<4x8xf32>, tensor<8x8xf32>) outs(%e : tensor<4x8xf32>) {
  ^bb0(%i: f32, %j: f32, %o: f32):
    %m = arith.mulf %i, %j : f32
    %s = arith.addf %m, %o : f32
    linalg.yield %s : f32
  } -> tensor<4x8xf32>
  return %neg, %prod : tensor<4x8xf32>, tensor<4x8xf32>
}
"""


def test_a_conversion_is_cloned_for_loops_reading_it_element_for_element_only() -> None:
    # the negation gets its own conversion, fused; the product, which would convert each
    # element once per column, reads the converted tensor
    module = _module(_CONVERSION_READ_TWICE)
    fusion.fuse_elementwise(module)
    assert module.operation.verify()
    bodies = sorted([o.name for o in op.regions[0].blocks[0].operations]
                    for op in find_ops(module, lambda op: op.name == "linalg.generic"))
    assert bodies == [["arith.extf", "arith.negf", "linalg.yield"], ["arith.extf", "linalg.yield"],
                      ["arith.mulf", "arith.addf", "linalg.yield"]]
