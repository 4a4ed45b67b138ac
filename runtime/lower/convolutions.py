"""Rewrites of linalg convolutions into the forms the schedule runs fastest (opt="default").

- A 1x1 convolution of stride 1 (NHWC) is a matmul: [N*OH*OW, C] x [C, F], the input's pixels
  as rows. As a linalg.matmul whose second operand is the transposed filter, it gets the
  schedule's packed column panels and a matmul's register tile (`schedule.pack_panels`), like
  nn.Linear. A strided one reads a strided slice of the input, copied into a contiguous tensor
  by a linalg.copy (vectorized along the channels; a bare strided slice would be copied by the
  runtime library's element-by-element memrefCopy): ResNet-50's 1024 -> 2048 stride-2
  convolution on 14 x 14 with x86-64-v3 code ran at 2.6 GF/s direct (16 rows of its 2048 x 1024
  filter per output pixel, from memory), as a copy and a matmul at 40 GF/s (5.2 ms, eager 5.0).
- The schedule runs a 2-D convolution over panels of its output channels, one column tile each,
  its filter panel (every tap and input channel) packed into a contiguous buffer that stays in
  the L2 cache while every output tile passes over it (`schedule.pack_panels`). One whose filter
  panel is larger than half of the L2 (`Tiles.direct_filter_bytes`), in at most MAX_TAPS taps,
  is a sum over its filter taps of matmuls instead (`_taps_as_matmuls`): per tap (i, j), the
  input pixels it reads (a strided slice, copied) times the tap's [C, F] filter, accumulating
  into the output pixels, whose packed panels have a tap's rows only. ResNet-50's 3x3
  convolution of 512 channels on 7 x 7 on Zen 4, x86-64-v3 code (a 295 KiB panel, above half of
  that entry's 256 KiB of L2): 4.3 ms per tap, 5.5 ms direct (eager limited to AVX2: 3.7).
  Unpacked, the panel's rows, a filter row of output channels apart, conflict in the cache: 12.7
  ms with Zen 4's own code (4.2 packed).
- A 3-D convolution (NDHWC, a DHWCF filter) is a sum over its depth taps of 2-D convolutions
  (`_conv3d_as_conv2d`): per batch element and depth tap kd, the input planes od * sd + kd * dd
  for every output plane od are the batch of a linalg.conv_2d_nhwc_hwcf with the tap's HWCF
  filter, accumulating into the output planes. The schedule tiles and vectorizes those as any
  2-D convolution; a 3-D one it would leave as plain loops (100x slower than eager).
- A 3x3 convolution of stride 1 over many channels and output pixels (2-D, or a 3-D one's
  planes) runs by Winograd's F(2x2, 3x3) (`winograd.convolve`: 2.25x fewer multiply-adds, the
  transforms and the 16 products all matmuls). r3d_18's 3x3x3 convolution of 128 channels on 8 x
  28 x 28, one thread on Zen 4: 36.5 ms, direct 53 ms, eager 47 ms.
- A depthwise convolution with channel multiplier 1 (tosa.depthwise_conv2d of a depthwise
  nn.Conv2d: groups == channels) is linalg.depthwise_conv_2d_nhwc_hwc, which the schedule
  tiles over (output column, channel) and vectorizes along the channels (`schedule.plan`).
- A grouped convolution (1 < groups < channels: a depthwise convolution of multiplier O/G whose
  products are summed over each group's C/G channels, as opdefs/conv.yaml writes it in TOSA; a
  1x1 one is an elementwise product by then) is a loop over its filter taps of batched matmuls
  over the groups (`_grouped_as_matmuls`), which the schedule tiles as matmuls: rows of output
  pixels, the group's M outputs as columns.
- A padded input (tensor.pad of a constant: a convolution's or pool's padding) computed by a
  linalg op (the NCHW -> NHWC transpose before a convolution) is a filled buffer whose interior
  that op writes in place. Bufferized as it was, the pad was an element-by-element fill and a
  copy of the input into the interior by the runtime library's generic (element by element)
  memrefCopy, up to a third of a depthwise convolution's time. The same for a max pooling's
  padded input (read by its -inf mask too) and its i8 mask.
"""

from __future__ import annotations

import functools

from mlir import ir
from mlir.dialects import arith, bufferization, linalg, scf, tensor

from ..cpu import Cpu
from ..internal import blaming
from . import tiles, winograd
from .irutil import (
    collapse,
    constant_int,
    dims_map,
    expand,
    find_ops,
    is_sub_byte,
    iterator_types,
    map_dims,
    positive_zero,
    static_insert,
    static_slice,
)

CONV = "linalg.conv_2d_nhwc_fhwc"  # loops (n, oh, ow, f, kh, kw, c)
CONV_HWCF = "linalg.conv_2d_nhwc_hwcf"  # the same loops; its filter as the schedule's tiles read it
_CONV3D = "linalg.conv_3d_ndhwc_dhwcf"
MAX_UNROLLED = 64  # batch elements x depth taps of a 3-D convolution rewritten as 2-D ones
# taps of a 2-D filter rewritten as matmuls, one each: a model's filters have up to 7x7 (49), and a
# weight gradient's "filter" is the output gradient (56x56 in a conv block's backward: its 3,136
# matmuls and copies took 100 s to bufferize)
MAX_TAPS = 64
DEPTHWISE = "linalg.depthwise_conv_2d_nhwc_hwc"  # loops (n, oh, ow, c, kh, kw)
_DEPTHWISE_M = "linalg.depthwise_conv_2d_nhwc_hwcm"  # loops (n, oh, ow, c, m, kh, kw)


def rewrite_convolutions(module: ir.Module, cpu: Cpu | None = None) -> None:
    """`_taps_as_matmuls` each 1x1 convolution (one tap), `_grouped_as_matmuls` each grouped one,
    `_depthwise_hwc` each depthwise convolution of multiplier 1, `_conv3d_as_conv2d` each 3-D
    convolution and `_taps_as_matmuls` each 2-D one with a filter too large to read directly in
    `module` (static shapes, f32 only). Run before the
    pipeline drops unit dimensions ("unit-dims"), which then drops the multiplier's from the ops
    around. Filters are "too large" for `cpu` (by default `cpu.select()`)."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name == CONV and _pointwise(op)):
            with blaming(op):
                _taps_as_matmuls(op)  # one tap
        for op in find_ops(module, lambda op: op.name == _DEPTHWISE_M or _pointwise_products(op)):
            grouped = _grouped_sum(op)
            if grouped is not None:
                with blaming(op):
                    _grouped_as_matmuls(op, grouped)
        for op in find_ops(module, lambda op: op.name == _DEPTHWISE_M and _multiplier_one(op)):
            with blaming(op):
                _depthwise_hwc(op)
        for op in find_ops(module, lambda op: op.name in (CONV, CONV_HWCF, _CONV3D) and _by_winograd(op)):
            with blaming(op):
                _winograd(op)
        for op in find_ops(module, lambda op: op.name == _CONV3D and static_f32(op)):
            if ir.RankedTensorType(op.results[0].type).shape[0] * ir.RankedTensorType(op.operands[1].type).shape[0] \
                    <= MAX_UNROLLED:
                with blaming(op):
                    _conv3d_as_conv2d(op)
        chosen = tiles.selected(cpu)
        limit, columns = chosen.direct_filter_bytes, chosen.convolution[1]
        for op in find_ops(module, lambda op: op.name in (CONV, CONV_HWCF) and _panel_exceeds(op, limit, columns)):
            with blaming(op):
                _taps_as_matmuls(op)


def pads_in_place(module: ir.Module) -> None:
    """`_pad_in_place` each static constant tensor.pad of a linalg op's result in `module`."""
    with module.context, ir.Location.unknown():
        for op in find_ops(module, lambda op: op.name == "tensor.pad" and _constant_pad(op) is not None):
            with blaming(op):
                producer = _padded_producer(op)
                if producer is not None:
                    _pad_in_place(op, *producer)


def static_f32(op: ir.Operation) -> bool:
    types = [v.type for v in op.operands] + [r.type for r in op.results]
    return all(isinstance(t, ir.RankedTensorType) and ir.RankedTensorType(t).has_static_shape
               and isinstance(ir.RankedTensorType(t).element_type, ir.F32Type) for t in types)


def _ints(op: ir.Operation, name: str) -> list[int]:
    return [int(x) for x in ir.DenseIntElementsAttr(op.attributes[name])]


def _pointwise(op: ir.Operation) -> bool:
    """A static f32 convolution with a 1x1 filter (no padding: TOSA pads before a convolution)."""
    return static_f32(op) and ir.RankedTensorType(op.operands[1].type).shape[1:3] == [1, 1]


def _multiplier_one(op: ir.Operation) -> bool:
    return static_f32(op) and ir.RankedTensorType(op.operands[1].type).shape[3] == 1


def _panel_exceeds(op: ir.Operation, limit: int, columns: int) -> bool:
    """A static f32 2-D convolution whose filter panel (every tap and input channel, a column tile
    of `columns` output channels: what the schedule packs, `schedule.pack_panels`) has more than
    `limit` bytes (`Tiles.direct_filter_bytes`), in at most MAX_TAPS taps."""
    shape = ir.RankedTensorType(op.operands[1].type).shape
    kh, kw, c, f = shape if op.name == CONV_HWCF else (*shape[1:], shape[0])  # HWCF or FHWC
    return static_f32(op) and 4 * kh * kw * c * min(f, columns) > limit and kh * kw <= MAX_TAPS


def _by_winograd(op: ir.Operation) -> bool:
    """A static f32 2-D or 3-D convolution `winograd.applies` to (per plane), of at most
    MAX_UNROLLED batch elements for a 3-D one."""
    if not static_f32(op):
        return False
    shape = ir.RankedTensorType(op.operands[1].type).shape
    out = ir.RankedTensorType(op.results[0].type).shape
    strides, dilations = _ints(op, "strides"), _ints(op, "dilations")
    if op.name == _CONV3D:
        (_, kh, kw, c, f), strides, dilations = shape, strides[1:], dilations[1:]
        if out[0] > MAX_UNROLLED:
            return False
        planes, out = out[1], out[2:4]  # per batch element
    else:
        kh, kw, c, f = shape if op.name == CONV_HWCF else (*shape[1:], shape[0])
        planes, out = out[0], out[1:3]
    return winograd.applies([kh, kw], strides, dilations, c, f, out, planes)


def _winograd(op: ir.Operation) -> None:
    """Replace convolution `op` by `winograd.convolve`: a 2-D one's batch elements are its
    planes; a 3-D one's depth planes, per batch element."""
    image, weight, init = list(op.operands)[:3]
    with ir.InsertionPoint(op), op.location:
        if op.name == _CONV3D:
            sd, dd = _ints(op, "strides")[0], _ints(op, "dilations")[0]
            n, od, oh, ow, f = ir.RankedTensorType(init.type).shape
            _, d, h, w, c = ir.RankedTensorType(image.type).shape
            result = init
            for b in range(n):
                planes = collapse(static_slice(image, [b, 0, 0, 0, 0], [1, d, h, w, c]), [[0, 1], [2], [3], [4]])
                acc = collapse(static_slice(result, [b, 0, 0, 0, 0], [1, od, oh, ow, f]), [[0, 1], [2], [3], [4]])
                acc = winograd.convolve(planes, weight, acc, sd, dd)
                result = static_insert(expand(acc, [[0, 1], [2], [3], [4]], [1, od, oh, ow, f]), result,
                                       [b, 0, 0, 0, 0])
        else:
            if op.name == CONV:  # FHWC -> HWCF
                f, kh, kw, c = ir.RankedTensorType(weight.type).shape
                weight = linalg.transpose(weight, outs=[tensor.EmptyOp([kh, kw, c, f], ir.F32Type.get()).result],
                                          permutation=[1, 2, 3, 0]).results[0]
            taps = expand(weight, [[0, 1], [2], [3], [4]], [1, *ir.RankedTensorType(weight.type).shape])
            result = winograd.convolve(image, taps, init)
    op.results[0].replace_all_uses_with(result)
    op.erase()


def _taps_as_matmuls(op: ir.Operation) -> None:
    """Replace 2-D convolution `op` by a sum over its filter taps of matmuls: per tap, the input
    pixels it reads (a strided slice, copied; the input itself for a 1x1 convolution that reads
    every pixel) times the tap's [C, F] filter, accumulating into the output's pixels."""
    image, weight, init = list(op.operands)[:3]
    n, oh, ow, f = ir.RankedTensorType(init.type).shape
    _, h, w, c = ir.RankedTensorType(image.type).shape
    hwcf = op.name == CONV_HWCF
    kh, kw = ir.RankedTensorType(weight.type).shape[:2] if hwcf else ir.RankedTensorType(weight.type).shape[1:3]
    (sh, sw), (dh, dw) = _ints(op, "strides"), _ints(op, "dilations")
    with ir.InsertionPoint(op), op.location:
        acc = collapse(init, [[0, 1, 2], [3]])
        for i in range(kh):
            for j in range(kw):
                if (kh, kw, h, w) == (1, 1, oh, ow):
                    pixels = image
                else:
                    read = static_slice(image, [0, i * dh, j * dw, 0], [n, oh, ow, c], [1, sh, sw, 1])
                    pixels = linalg.copy(read, outs=[tensor.EmptyOp([n, oh, ow, c], ir.F32Type.get()).result])
                if hwcf:
                    taps = collapse(static_slice(weight, [i, j, 0, 0], [1, 1, c, f]), [[0, 1, 2], [3]])
                else:
                    tap_fc = collapse(static_slice(weight, [0, i, j, 0], [f, 1, 1, c]), [[0, 1, 2], [3]])
                    taps = linalg.transpose(tap_fc, outs=[tensor.EmptyOp([c, f], ir.F32Type.get()).result],
                                            permutation=[1, 0])
                acc = linalg.matmul(collapse(pixels, [[0, 1, 2], [3]]), taps, outs=[acc])
        result = expand(acc, [[0, 1, 2], [3]], [n, oh, ow, f])
    op.results[0].replace_all_uses_with(result)
    op.erase()


def _grouped_sum(op: ir.Operation) -> ir.Operation | None:
    """The sum over each group's input channels of grouped convolution `op` (a static f32
    depthwise convolution of channel multiplier M > 1, from a zero fill, whose [.., C, M] result
    is only expanded to [.., G, C/G, M] and summed over C/G: opdefs/conv.yaml's grouped
    convolution), else None."""
    weight, init = list(op.operands)[1:3]
    c, m = ir.RankedTensorType(weight.type).shape[-2:]
    if not static_f32(op) or m < 2 or len(list(op.results[0].uses)) != 1:
        return None
    if op.name == _DEPTHWISE_M and not _zero_fill(init):
        return None
    expand_op = next(iter(op.results[0].uses)).owner
    if expand_op.name != "tensor.expand_shape" or len(list(expand_op.results[0].uses)) != 1:
        return None
    groups = [[int(ir.IntegerAttr(d).value) for d in ir.ArrayAttr(g)]
              for g in ir.ArrayAttr(expand_op.attributes["reassociation"])]
    shape = ir.RankedTensorType(expand_op.results[0].type).shape
    if groups[:3] != [[0], [1], [2]] or len(groups[3]) != 2 or shape[3] * shape[4] != c or shape[3] in (1, c):
        return None
    total = next(iter(expand_op.results[0].uses)).owner
    if total.name != "linalg.generic" or len(total.operands) != 2 or not _sums_axis(total, 4):
        return None
    return total


def _pointwise_products(op: ir.Operation) -> bool:
    """Whether `op` is what a 1x1 depthwise convolution of multiplier M is by the time convolutions
    are rewritten: a generic of loops (n, h, w, c, m) multiplying the input [N, H, W, C, 1] by
    the filter [1, 1, 1, C, M]."""
    if op.name != "linalg.generic" or len(op.operands) != 3 or not static_f32(op):
        return False
    kinds = [str(k) for k in ir.ArrayAttr(op.attributes["iterator_types"])]
    maps = [ir.AffineMapAttr(m).value for m in ir.ArrayAttr(op.attributes["indexing_maps"])]
    if len(kinds) != 5 or not all(k.endswith("parallel>") for k in kinds):
        return False
    dims = [[e.position if isinstance(e, ir.AffineDimExpr) else None for e in m.results] for m in maps]
    if dims[0] != [0, 1, 2, 3, None] or len(dims[1]) != 5 or dims[1][3:] != [3, 4] or dims[2] != [0, 1, 2, 3, 4]:
        return False
    image, weight = (ir.RankedTensorType(v.type).shape for v in list(op.operands)[:2])
    if image[4] != 1 or weight[:3] != [1, 1, 1]:
        return False
    block = op.regions[0].blocks[0]
    body = list(block.operations)
    return len(body) == 2 and body[0].name == "arith.mulf" \
        and set(body[0].operands) == set(list(block.arguments)[:2]) and body[1].operands[0] == body[0].results[0]


def _zero_fill(value: ir.Value) -> bool:
    """A linalg.fill of +0.0."""
    return isinstance(value, ir.OpResult) and value.owner.name == "linalg.fill" \
        and positive_zero(value.owner.operands[0])


def _sums_axis(op: ir.Operation, axis: int) -> bool:
    """Whether generic `op` sums its one input over loop `axis` into its output, indexed by
    every other loop in order (a tosa.reduce_sum: `out + in`, or `out + (in + 0.0)`)."""
    kinds = [str(k) for k in ir.ArrayAttr(op.attributes["iterator_types"])]
    if [k.endswith("reduction>") for k in kinds] != [d == axis for d in range(len(kinds))]:
        return False
    ins, outs = map_dims(op)
    if ins != list(range(len(kinds))) or outs != [d for d in range(len(kinds)) if d != axis]:
        return False
    block = op.regions[0].blocks[0]
    x, acc = block.arguments
    body = list(block.operations)
    added = body[-1].operands[0]
    if len(body) not in (2, 3) or not isinstance(added, ir.OpResult) or added.owner.name != "arith.addf":
        return False
    terms = list(added.owner.operands)
    if acc not in terms:
        return False
    term = terms[1 - terms.index(acc)]
    if term == x:
        return len(body) == 2
    if not isinstance(term, ir.OpResult) or term.owner.name != "arith.addf" or x not in list(term.owner.operands):
        return False
    other = [v for v in term.owner.operands if v != x]
    return len(body) == 3 and len(other) == 1 and positive_zero(other[0])


def _grouped_as_matmuls(op: ir.Operation, total: ir.Operation) -> None:
    """Replace grouped convolution `op` and its sum over each group's channels (`_grouped_sum`)
    by a loop over its filter taps of batched matmuls, one batch element per group: per tap, the
    input pixels it reads (a strided slice, in place) as [N, OH, OW, G, C/G] times the tap's
    [G, C/G, M] filter, accumulating into the output as [G, N, OH, OW, M]. The depthwise form
    computed C x M products per pixel into a buffer M times the output's, summed apart, in
    plain loops: a RegNet's 3x3 of 56 channels in groups of 8 on 28 x 28 took 8x eager's time,
    now about eager's (Zen 4; 0.8x with x86-64-v3 code, whose registers are 8 lanes). A loop,
    not a matmul per tap: one kernel's code instead of nine (RegNetY-200MF's LLVM IR: 99k ->
    67k lines, its compile 13 -> 9.7 s)."""
    image, weight = list(op.operands)[:2]
    out = total.operands[1]
    out_shape = ir.RankedTensorType(out.type).shape
    n, oh, ow, groups = out_shape[:4]
    f32, dynamic = ir.F32Type.get(), ir.ShapedType.get_dynamic_size()
    per_group = [[0], [1], [2], [3], list(range(4, len(out_shape)))]  # [N, OH, OW, G, .. M] <-> [.., G, M]
    with ir.InsertionPoint(total), op.location:
        if op.name == _DEPTHWISE_M:
            (sh, sw), (dh, dw) = _ints(op, "strides"), _ints(op, "dilations")
        else:  # `_pointwise_products`: [N, H, W, C, 1] x [1, 1, 1, C, M]
            (sh, sw), (dh, dw) = (1, 1), (1, 1)
            image = collapse(image, [[0], [1], [2], [3, 4]])
            weight = collapse(weight, [[0, 1], [2], [3], [4]])
        kh, kw, c, m = ir.RankedTensorType(weight.type).shape
        acc = linalg.transpose(collapse(out, per_group), outs=[tensor.EmptyOp([groups, n, oh, ow, m], f32).result],
                               permutation=[3, 0, 1, 2, 4]).results[0]
        constant = functools.partial(arith.constant, ir.IndexType.get())
        loop = scf.ForOp(constant(0), constant(kh * kw), constant(1), [acc])
        with ir.InsertionPoint(loop.body):
            tap = loop.induction_variable
            i, j = arith.divui(tap, constant(kw)), arith.remui(tap, constant(kw))
            read = tensor.ExtractSliceOp(ir.RankedTensorType.get([n, oh, ow, c], f32), image,
                                         [arith.muli(i, constant(dh)), arith.muli(j, constant(dw))], [], [],
                                         [0, dynamic, dynamic, 0], [n, oh, ow, c], [1, sh, sw, 1]).result
            taps = tensor.ExtractSliceOp(ir.RankedTensorType.get([c, m], f32), weight, [i, j], [], [],
                                         [dynamic, dynamic, 0, 0], [1, 1, c, m], [1, 1, 1, 1]).result
            summed = _group_products(expand(read, [[0], [1], [2], [3, 4]], [n, oh, ow, groups, c // groups]),
                                     expand(taps, [[0, 1], [2]], [groups, c // groups, m]), loop.inner_iter_args[0])
            scf.YieldOp([summed])
        result = linalg.transpose(loop.results[0], outs=[tensor.EmptyOp([n, oh, ow, groups, m], f32).result],
                                  permutation=[1, 2, 3, 0, 4]).results[0]
        result = expand(result, per_group, out_shape)
    total.results[0].replace_all_uses_with(result)
    expand_op = total.operands[0].owner
    total.erase()
    expand_op.erase()
    op.erase()


def _group_products(pixels: ir.Value, taps: ir.Value, acc: ir.Value) -> ir.Value:
    """acc[g, n, h, w, m] + sum over k of pixels[n, h, w, g, k] * taps[g, k, m]: a batched matmul
    (loops g, n, h, w, m, k; rows w) that reads the pixels of every group in place."""
    maps = ir.ArrayAttr.get([dims_map(6, dims) for dims in ([1, 2, 3, 0, 5], [0, 5, 4], [0, 1, 2, 3, 4])])
    generic = linalg.GenericOp([acc.type], [pixels, taps], [acc], maps, iterator_types(6, [5]))
    f32 = ir.F32Type.get()
    body = generic.regions[0].blocks.append(f32, f32, f32)
    contract = ir.Attribute.parse("#arith.fastmath<contract>")
    with ir.InsertionPoint(body):
        product = arith.MulFOp(body.arguments[0], body.arguments[1], fastmath=contract).result
        linalg.YieldOp([arith.AddFOp(body.arguments[2], product, fastmath=contract).result])
    return generic.results[0]


def _conv3d_as_conv2d(op: ir.Operation) -> None:
    """Replace 3-D convolution `op` by, for each batch element and depth tap, a 2-D convolution
    of the input planes the tap reads (a strided slice along depth: the 2-D convolution's batch)
    with the tap's filter, each accumulating into the previous one's result."""
    image, weight, init = list(op.operands)[:3]
    n, od, oh, ow, f = ir.RankedTensorType(init.type).shape
    _, _, h, w, c = ir.RankedTensorType(image.type).shape
    kd, kh, kw, _, _ = ir.RankedTensorType(weight.type).shape
    (sd, *strides), (dd, *dilations) = _ints(op, "strides"), _ints(op, "dilations")
    planes = [[0, 1], [2], [3], [4]]
    with ir.InsertionPoint(op), op.location:
        result = init
        for b in range(n):
            acc = collapse(static_slice(result, [b, 0, 0, 0, 0], [1, od, oh, ow, f]), planes)
            for tap in range(kd):
                read = static_slice(image, [b, tap * dd, 0, 0, 0], [1, od, h, w, c], [1, sd, 1, 1, 1])
                inputs = collapse(read, planes)
                taps = collapse(static_slice(weight, [tap, 0, 0, 0, 0], [1, kh, kw, c, f]), planes)
                acc = linalg.conv_2d_nhwc_hwcf(inputs, taps, outs=[acc], strides=strides, dilations=dilations)
            result = static_insert(expand(acc, planes, [1, od, oh, ow, f]), result, [b, 0, 0, 0, 0])
    op.results[0].replace_all_uses_with(result)
    op.erase()


def _depthwise_hwc(op: ir.Operation) -> None:
    """Replace depthwise convolution `op` of channel multiplier 1 by its form without the multiplier."""
    image, weight, init = list(op.operands)[:3]
    shape = ir.RankedTensorType(init.type).shape
    with ir.InsertionPoint(op), op.location:
        conv = linalg.depthwise_conv_2d_nhwc_hwc(
            image, collapse(weight, [[0], [1], [2, 3]]), outs=[collapse(init, [[0], [1], [2], [3, 4]])],
            strides=_ints(op, "strides"), dilations=_ints(op, "dilations"))
        result = expand(conv, [[0], [1], [2], [3, 4]], shape)
    op.results[0].replace_all_uses_with(result)
    op.erase()


def _border(buffer: ir.Value, value: ir.Value, low: list[int], interior: list[int]) -> ir.Value:
    """`buffer` (the padded shape) with `value` written around the box of `interior`'s shape at
    `low`, in place: per padded dimension, the slabs before and after the box, whole along the
    others. A fill of the whole tensor wrote the interior twice (at batch 8, MobileNetV2's padded
    inputs were memsets of up to 39 MB a call)."""
    shape = ir.RankedTensorType(buffer.type).shape
    for d, (before, inner) in enumerate(zip(low, interior, strict=True)):
        for start, size in ((0, before), (before + inner, shape[d] - before - inner)):
            if size:
                offsets = [start if i == d else 0 for i in range(len(shape))]
                sizes = [size if i == d else n for i, n in enumerate(shape)]
                slab = linalg.fill(value, outs=[static_slice(buffer, offsets, sizes)])
                buffer = static_insert(slab, buffer, offsets)
    return buffer


def _static_low(op: ir.Operation) -> list[int] | None:
    """tensor.pad `op`'s low padding amounts if all are static or arith.constant operands (as
    tosa-to-tensor makes them; canonicalize folds them into the op only where dropping unit
    dimensions rebuilds it, i.e. for batch 1), else None."""
    dynamic = iter(list(op.operands)[1:])  # low's dynamic amounts, then high's
    low = []
    for amount in ir.DenseI64ArrayAttr(op.attributes["static_low"]):
        if amount == ir.ShapedType.get_dynamic_size():
            value = next(dynamic, None)
            amount = None if value is None else constant_int(value)
            if amount is None:
                return None
        low.append(amount)
    return low


def _constant_pad(op: ir.Operation) -> ir.Value | None:
    """The padding value of a static tensor.pad of floats or integers of 8 bits or more (a max
    pooling's i8 mask too; no i1 buffers) by a value defined outside it, else None."""
    types = [ir.RankedTensorType(t) for t in (op.operands[0].type, op.results[0].type)]
    if _static_low(op) is None or not all(t.has_static_shape and _byte_element(t.element_type) for t in types):
        return None
    block = op.regions[0].blocks[0]
    value = list(block.operations)[-1].operands[0]
    if isinstance(value, ir.BlockArgument) or value.owner.parent == op:
        return None
    return value


def _byte_element(element: ir.Type) -> bool:
    """An integer of a byte or more, or a float: an element type buffers can hold."""
    return isinstance(element, (ir.IntegerType, ir.F32Type, ir.F16Type, ir.BF16Type, ir.F64Type)) \
        and not is_sub_byte(element)


def _padded_producer(op: ir.Operation) -> tuple[ir.Operation, list[list[int]] | None] | None:
    """The linalg op computing tensor.pad `op`'s input (through one tensor.collapse_shape, whose
    reassociation is returned too) if it is a transpose or an elementwise generic with one result
    and does not read its init; else None. Other readers of that input (a max pooling's -inf
    mask) then read the padded buffer's interior: in place if they come before the pad, else
    bufferization copies the interior for them."""
    value, groups = op.operands[0], None
    owner = value.owner if isinstance(value, ir.OpResult) else None
    if owner is not None and owner.name == "tensor.collapse_shape":
        groups = [[int(ir.IntegerAttr(d).value) for d in ir.ArrayAttr(g)]
                  for g in ir.ArrayAttr(owner.attributes["reassociation"])]
        value = owner.operands[0]
        owner = value.owner if isinstance(value, ir.OpResult) else None
    if owner is None or owner.name not in ("linalg.transpose", "linalg.generic"):
        return None
    iterators = str(owner.attributes["iterator_types"]) if "iterator_types" in owner.attributes else ""
    if len(owner.results) != 1 or "reduction" in iterators:
        return None
    block = owner.regions[0].blocks[0]
    if list(block.arguments[len(block.arguments) - 1].uses):
        return None  # reads its init
    return owner.operation, groups


def _pad_in_place(op: ir.Operation, producer: ir.Operation, groups: list[list[int]] | None) -> None:
    """Replace tensor.pad `op` by a tensor of the padded shape, its border filled (`_border`),
    whose interior `producer` (whose result, collapsed by `groups` if given, is the pad's input)
    computes in place."""
    value = _constant_pad(op)
    shape = ir.RankedTensorType(op.operands[0].type).shape
    low = _static_low(op)
    assert low is not None
    padded = ir.RankedTensorType(op.results[0].type)
    with ir.InsertionPoint(producer), op.location:
        buffer = bufferization.AllocTensorOp(padded, []).result  # not a tensor.empty: slices of one fold to new ones
        filled = _border(buffer, value, low, shape)
        interior = static_slice(filled, low, shape)
        if groups is not None:
            interior = expand(interior, groups, ir.RankedTensorType(producer.results[0].type).shape)
    producer.operands[len(producer.operands) - 1] = interior
    with ir.InsertionPoint(op), op.location:
        result = tensor.InsertSliceOp(op.operands[0], filled, [], [], [], low, shape, [1] * len(shape)).result
    op.results[0].replace_all_uses_with(result)
    op.erase()
