"""Layout as a whole-graph decision: transposes moved through the ops that don't care, and cancelled.

TOSA's convolutions and pooling are NHWC and PyTorch's tensors NCHW, so each convolution (and
each int8 conv or pooling group) transposes its input to NHWC and its result back, while the ops
between two of them (a BatchNorm's mul and add, ReLU's clamp, a residual add, RESCALEs, an
explicit pad, reshapes) run on NCHW. `optimize_layout` decides the layout of each connected set
of ops that don't care about it (a *region*), from the table `LAYOUT` (opdefs/tosa.yaml's
`layout` entries, generated into the catalogue): which ops are elementwise (and which of their
operands follow the result's layout), which attribute names an axis (concat, reductions), which
`!tosa.shape` operands hold values per axis (pad, slice, tile), when the last axis must stay last
(a per-channel RESCALE), and that a reshape moves groups of axes it merges or splits. An op without an entry
(convolutions, pooling, matmul, gather) keeps its own layout.

A region is grown from a transpose, on either side: the ops it feeds, computed in the layout
before it, or the ops computing its input, computed in the layout after it. Each op of the
region takes the layout its table entry implies (an op that can't, or that would need two
layouts, stays outside); at the region's edges a value read in another layout is a transpose
(of a constant: a new constant; of a transpose: one transpose of their composition, none if they
cancel), and a value written for an op outside is transposed back. The region is rewritten only
if that leaves the function with fewer transposes (then fewer transposed elements, then fewer
reshapes: a transpose that moves only axes of size 1 is a reshape), and regions are tried until
none improves it. The function's count is taken again after each rewrite, and the search stops
at one that did not lower it (the region's estimate missed something): without that, regions
whose estimate and outcome differ were rewritten back and forth until the round limit. A
region grows through the other readers of a value only where one of its ops computes it: a
constant or a transpose read by many ops does not tie them into one region (a frozen float
MobileNetV2 grew regions of 481 ops so). A CNN then runs NHWC from its input's transpose to its
output's (none for a 1x1 output), in the TOSA `to_tosa` writes for a target (what an NPU
compiler reads). The native pipeline still runs the narrower `sink.sink_transposes`: on the
test suite's op samples this pass left i1 values in memory between ops. Every rewrite moves
values exactly: the same ops on the same values, in another order in memory.

`fold_layout` (also run by itself on flatbuffers: `artifacts/tosa_files.py`) composes transposes
and reshapes, folds them into constants, and drops the ones that change nothing.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from mlir import ir

from . import irutil
from .irutil import function_bodies


@functools.cache
def _table() -> dict:
    """The generated LAYOUT table (imported when first used: `make gen` imports torchtosa
    before it has written runtime/_generated)."""
    from .._generated.catalogue import LAYOUT

    return LAYOUT


Perm = tuple[int, ...]
Cost = tuple[int, int, int]  # transposes, their elements, reshapes
# MLIR's tosa-validate holds a !tosa.shape's length to the level's MAX_RANK (6 at level 8K), so
# a pad of rank 4 (8 amounts) is not conformant: reshapes do not move a pad above rank 3
MAX_SHAPE = 6
ROUNDS = 8  # rewrites per op of a function at most (each leaves fewer or smaller transposes, or a reshape lower)


def optimize_layout(module: ir.Module) -> None:
    """Decide the layout of every function of `module` (in place; see the module docstring)."""
    with module.context, ir.Location.unknown():
        for block in function_bodies(module):
            fold_layout(block)
            cost = _cost(block)
            for _ in range(ROUNDS * len(block.operations)):
                if _sink_reshape(block):
                    fold_layout(block)
                    cost = _cost(block)
                    continue
                if not _improve(block):
                    break
                fold_layout(block)
                cost, before = _cost(block), cost
                if cost >= before:  # the region's estimate missed something: stop here (exact either way)
                    break


def _cost(block: ir.Block) -> Cost:
    """The block's transposes, their elements, and its reshapes."""
    transposes = [_shape(op.operands[0]) for op in block.operations if op.operation.name == "tosa.transpose"]
    return (len(transposes), sum(math.prod(s or [0]) for s in transposes),
            sum(op.operation.name == "tosa.reshape" for op in block.operations))


# ---------------------------------------------------------------- permutations


def compose(first: Perm, then: Perm) -> Perm:
    """The permutation of transposing by `first`, then by `then`."""
    return tuple(first[p] for p in then)


def inverse(perm: Perm) -> Perm:
    """The permutation that undoes `perm`."""
    return tuple(perm.index(i) for i in range(len(perm)))


def _identity(perm: Perm) -> bool:
    return all(i == p for i, p in enumerate(perm))


def moves_units_only(shape: list[int], perm: Perm) -> bool:
    """Whether transposing `shape` by `perm` keeps the order of its axes longer than 1 (a reshape)."""
    moved = [p for p in perm if shape[p] != 1]
    return moved == sorted(moved)


def through_reshape(source: list[int], result: list[int], perm: Perm) -> Perm | None:
    """The layout of a reshape's result when its input is laid out by `perm`, if the reshape of
    the transposed input is still a reshape: the axes a reshape merges (or splits) into one group
    stay next to each other and in order under `perm`, and the groups move as wholes (axes of
    size 1 come and go anywhere). None if `perm` separates a group."""
    big_source = [i for i, n in enumerate(source) if n != 1]
    big_result = [i for i, n in enumerate(result) if n != 1]
    groups: list[tuple[list[int], list[int]]] = []  # (source axes, result axes) of equal sizes
    i = j = 0
    while i < len(big_source) and j < len(big_result):
        axes, into = [big_source[i]], [big_result[j]]
        size, size_into = source[big_source[i]], result[big_result[j]]
        i, j = i + 1, j + 1
        while size != size_into:
            if size < size_into and i < len(big_source):
                axes.append(big_source[i])
                size, i = size * source[big_source[i]], i + 1
            elif size > size_into and j < len(big_result):
                into.append(big_result[j])
                size_into, j = size_into * result[big_result[j]], j + 1
            else:
                return None
        groups.append((axes, into))
    if i != len(big_source) or j != len(big_result):
        return None
    position = {axis: k for k, axis in enumerate(p for p in perm if source[p] != 1)}
    placed = []
    for axes, into in groups:
        at = [position[a] for a in axes]
        if at != list(range(at[0], at[0] + len(at))):
            return None
        placed.append((at[0], into))
    moved = [axis for _, into in sorted(placed) for axis in into]
    out = list(range(len(result)))
    for slot, axis in zip(big_result, moved, strict=True):
        out[slot] = axis
    return tuple(out)


# ---------------------------------------------------------------- IR helpers


def _shape(value: ir.Value) -> list[int] | None:
    """The static shape of a ranked tensor value, else None."""
    t = value.type
    if not isinstance(t, ir.RankedTensorType) or not ir.RankedTensorType(t).has_static_shape:
        return None
    return list(ir.RankedTensorType(t).shape)


def _perm(op: ir.Operation) -> Perm:
    return tuple(ir.DenseI32ArrayAttr(op.attributes["perms"]))


def _shape_values(value: ir.Value) -> list[int] | None:
    """The values of a `!tosa.shape` operand made by a tosa.const_shape."""
    owner = irutil.producer(value)
    if owner is None or owner.name != "tosa.const_shape":
        return None
    return [int(v) for v in ir.DenseIntElementsAttr(owner.attributes["values"])]


def _const_shape(values: list[int]) -> ir.Value:
    index = ir.IndexType.get()
    kind = ir.RankedTensorType.get([len(values)], index)
    attr = ir.DenseElementsAttr.get([ir.IntegerAttr.get(index, v) for v in values], type=kind) if values else \
        ir.Attribute.parse(f"dense<> : {kind}")  # a 0-d tensor's shape
    return ir.Operation.create("tosa.const_shape", results=[ir.Type.parse(f"!tosa.shape<{len(values)}>")],
                               attributes={"values": attr}).results[0]


def _with_shape(value: ir.Value, shape: list[int]) -> ir.Type:
    return ir.RankedTensorType.get(shape, ir.RankedTensorType(value.type).element_type)


def transpose(value: ir.Value, perm: Perm) -> ir.Value:
    """`value` transposed by `perm` (a new tosa.transpose; `value` itself for the identity)."""
    if _identity(perm):
        return value
    shape = _shape(value)
    assert shape is not None
    return ir.Operation.create("tosa.transpose", results=[_with_shape(value, [shape[p] for p in perm])],
                               operands=[value], attributes={"perms": ir.DenseI32ArrayAttr.get(list(perm))}).results[0]


def reshape(value: ir.Value, shape: list[int]) -> ir.Value:
    """`value` reshaped (a new tosa.reshape)."""
    return ir.Operation.create("tosa.reshape", results=[_with_shape(value, shape)],
                               operands=[value, _const_shape(shape)]).results[0]


def _follow(op: ir.Operation, entry: dict) -> tuple[int, ...]:
    """The operands of `op` laid out as its result."""
    return tuple(range(len(op.operands))) if entry["follow"] is None else entry["follow"]


def _entry(op: ir.Operation) -> dict | None:
    """The layout entry of `op` if it may move into a region: one result, of a static shape, and
    no i48 value (an int16 convolution's accumulator, which TOSA transposes and reshapes don't
    take: its RESCALE stays where it is)."""
    entry = _table().get(op.name)
    if entry is None or len(op.results) != 1 or _shape(op.results[0]) is None:
        return None
    if any(_element(v) == "i48" for v in (*op.operands, op.results[0])):
        return None
    return entry


def _element(value: ir.Value) -> str | None:
    """The element type of a tensor value (None for a `!tosa.shape`)."""
    try:
        return str(ir.RankedTensorType(value.type).element_type)
    except ValueError:
        return None


# ---------------------------------------------------------------- folding


# numpy's dtype of each element type whose constants are moved (not i1: bit-packed; not bf16)
_NUMPY = {"i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64, "f16": np.float16, "f32": np.float32}


def fold_layout(block: ir.Block) -> None:
    """Simplify the layout ops of `block` in place, exactly (values are only moved, never
    computed): a `tosa.transpose` or `tosa.reshape` of a `tosa.const` becomes a constant; a
    transpose of a transpose is one transpose, a reshape of a reshape one reshape; one that keeps
    the order (identity perms) or the shape is dropped, and a transpose that moves only axes of
    size 1 is a reshape; only ops of a static shape are dropped or folded. Ops left unused are
    erased.

    TOSA's own folders are not used: MLIR's greedy driver would fold arithmetic too, which is not
    IEEE-exact (x * 0.0 to 0). Without this an int8 conv's OHWI weight is a transpose of the
    OIHW constant, which Vela takes for a feature map (the conv becomes many matmuls)."""
    for op in list(block.operations):
        op = op.operation
        name = op.name
        if name not in ("tosa.transpose", "tosa.reshape"):
            continue
        source = op.operands[0]
        producer = irutil.producer(source)
        perms: Perm = ()
        if name == "tosa.transpose":
            perms = _perm(op)
            if producer is not None and producer.name == "tosa.transpose":  # z[i] = y[p[i]] = x[q[p[i]]]
                perms = compose(_perm(producer), perms)
                op.attributes["perms"] = ir.DenseI32ArrayAttr.get(list(perms))
                source = producer.operands[0]
                op.operands[0] = source
                producer = irutil.producer(source)
        elif producer is not None and producer.name == "tosa.reshape":
            source = producer.operands[0]
            op.operands[0] = source
            producer = irutil.producer(source)
        result = op.results[0]
        shape = _shape(result)
        if shape is None or _shape(source) is None:  # two `?` sizes may swap their values
            continue
        if source.type == result.type and (name == "tosa.reshape" or _identity(perms)):
            result.replace_all_uses_with(source)
        elif producer is not None and producer.name == "tosa.const":
            folded = _moved(producer.attributes["values"], ir.RankedTensorType(result.type),
                            perms if name == "tosa.transpose" else None)
            if folded is not None:  # named as the constant it moves (a parameter's module path)
                with ir.InsertionPoint(op), producer.location:
                    const = ir.Operation.create("tosa.const", results=[result.type], attributes={"values": folded})
                result.replace_all_uses_with(const.result)
        elif name == "tosa.transpose" and moves_units_only(_shape(source), perms):
            with ir.InsertionPoint(op), op.location:
                result.replace_all_uses_with(reshape(source, shape))
    _erase_unused(block)


def rewrite_each(module: ir.Module, names: tuple[str, ...], rewrite: Callable[[ir.Operation], bool],
                 fold_first: bool = False) -> int:
    """Call `rewrite` on each op named in `names` of `module`'s function bodies, then simplify
    each body's layout ops (`fold_layout`; before too with `fold_first`); the number of ops
    `rewrite` rewrote (returned True for)."""
    count = 0
    with module.context, ir.Location.unknown():
        for block in function_bodies(module):
            if fold_first:
                fold_layout(block)
            count += sum(rewrite(op.operation) for op in list(block.operations) if op.operation.name in names)
            fold_layout(block)
    return count


def _erase_unused(block: ir.Block) -> None:
    """Erase the layout ops and constants nothing uses (they have no effects)."""
    changed = True
    while changed:
        changed = False
        for op in reversed(list(block.operations)):
            if op.operation.name in ("tosa.transpose", "tosa.reshape", "tosa.const", "tosa.const_shape") \
                    and all(not list(r.uses) for r in op.results):
                op.erase()
                changed = True


def _moved(attr: ir.Attribute, result: ir.RankedTensorType, perms: Perm | None) -> ir.DenseElementsAttr | None:
    """The constant `attr` transposed by `perms` (None: reshaped) to type `result`; None if it
    is not a dense elements attribute (a `dense_resource`) or its element type is one
    fold_layout leaves alone."""
    try:
        values = ir.DenseElementsAttr(attr)
    except ValueError:
        return None
    if values.is_splat:
        return ir.DenseElementsAttr.get_splat(result, values.get_splat_value())
    dtype = _NUMPY.get(str(result.element_type))
    if dtype is None:
        return None
    array = np.array(values, copy=False).astype(dtype, copy=False)
    array = array.transpose(perms) if perms is not None else array.reshape(list(result.shape))
    return ir.DenseElementsAttr.get(np.ascontiguousarray(array), type=result.element_type, shape=list(result.shape))


def _foldable(op: ir.Operation) -> bool:
    """Whether a transpose of constant `op` folds into a constant."""
    try:
        values = ir.DenseElementsAttr(op.attributes["values"])
    except ValueError:
        return False
    return values.is_splat or str(ir.RankedTensorType(op.results[0].type).element_type) in _NUMPY


# ---------------------------------------------------------------- reshapes


def _sink_reshape(block: ir.Block) -> bool:
    """Move the first reshape that only adds or drops axes of size 1 below the op of the table it
    alone feeds (its other operands constants), if that op keeps those axes as they are: an
    explicit pad between reshapes to rank 3 and back, or a per-channel RESCALE after a reshaped
    convolution, then runs on the convolution's tensor, and the reshapes meet and fold."""
    for op in block.operations:
        op = op.operation
        if op.name == "tosa.reshape" and _sink(op):
            return True
    return False


def _sink(op: ir.Operation) -> bool:
    source, result = op.operands[0], op.results[0]
    x, y = _shape(source), _shape(result)
    uses = list(result.uses)
    if x is None or y is None or len(uses) != 1 or [n for n in x if n != 1] != [n for n in y if n != 1]:
        return False
    user, at = irutil.user(uses[0]), uses[0].operand_number
    entry = _entry(user)
    if entry is None or entry["kind"] != "elementwise" or entry["axis"] or at not in _follow(user, entry):
        return False
    out = _shape(user.results[0])
    if len(out) != len(y) or any((a == 1) != (b == 1) for a, b in zip(y, out, strict=True)):
        return False
    big_x, big_y = [i for i, n in enumerate(x) if n != 1], [i for i, n in enumerate(y) if n != 1]

    def to_x(shape: list[int]) -> list[int]:
        """A shape laid out as `y` (1 where y has 1), laid out as `x` instead."""
        moved = [1] * len(x)
        for i, j in zip(big_x, big_y, strict=True):
            moved[i] = shape[j]
        return moved

    follow = _follow(user, entry)
    for k in follow:
        value = user.operands[k]
        if value == result:
            continue
        const, shape = irutil.producer(value), _shape(value)
        if const is None or const.name != "tosa.const" or not _foldable(const) or shape is None \
                or len(shape) != len(y) or any(shape[j] != 1 for j, n in enumerate(y) if n == 1):
            return False
    channels = entry["channels"]
    if channels and ir.BoolAttr(user.attributes[channels]).value and x[-1] != y[-1]:
        return False
    per_axis = {}
    for k, neutral in entry["per_axis"]:
        values, n = _shape_values(user.operands[k]), len(neutral)
        if values is None or any(tuple(values[n * j:n * j + n]) != neutral for j, d in enumerate(y) if d == 1):
            return False
        moved = [list(neutral) for _ in x]
        for i, j in zip(big_x, big_y, strict=True):
            moved[i] = values[n * j:n * j + n]
        per_axis[k] = [v for axis in moved for v in axis]
        if len(per_axis[k]) > MAX_SHAPE:
            return False
    with ir.InsertionPoint(user), user.location:
        operands = []
        for k, value in enumerate(user.operands):
            if k in per_axis:
                operands.append(_const_shape(per_axis[k]))
            elif k in follow:
                operands.append(source if value == result else reshape(value, to_x(_shape(value))))
            else:
                operands.append(value)
        moved = ir.Operation.create(user.name, results=[_with_shape(user.results[0], to_x(out))], operands=operands,
                                    attributes={name: user.attributes[name] for name in user.attributes})
        user.results[0].replace_all_uses_with(reshape(moved.results[0], out))
    user.erase()
    op.erase()
    return True


# ---------------------------------------------------------------- regions


@dataclass
class _Region:
    """Ops that move together, and the layout each value they read or write takes in them."""

    perms: dict[ir.Value, Perm] = field(default_factory=dict)
    ops: list[ir.Operation] = field(default_factory=list)
    members: set[ir.Operation] = field(default_factory=set)

    def add(self, op: ir.Operation) -> None:
        self.ops.append(op)
        self.members.add(op)

    def produced(self, value: ir.Value) -> bool:
        owner = irutil.producer(value)
        return owner is not None and owner in self.members

    def inside(self, use: ir.OpOperand) -> bool:
        """A use that reads its value in the region's layout: a followed operand of a region op."""
        owner = irutil.user(use)
        return owner in self.members and use.operand_number in _follow(owner, _table()[owner.name])


def _implied(op: ir.Operation, entry: dict, at: int, perm: Perm) -> dict[int, Perm] | None:
    """The layout of `op`'s result (-1) and followed operands if the one at `at` (-1: the
    result) takes `perm`; None if the op can't take it."""
    result = _shape(op.results[0])
    if entry["kind"] == "reshape":
        source = _shape(op.operands[0])
        if source is None or _shape_values(op.operands[1]) is None:
            return None
        other = through_reshape(result, source, perm) if at == -1 else through_reshape(source, result, perm)
        return None if other is None else {-1: perm, 0: other} if at == -1 else {0: perm, -1: other}
    follow = _follow(op, entry)
    if any(_shape(op.operands[k]) is None or len(_shape(op.operands[k])) != len(perm) for k in follow):
        return None
    if len(result) != len(perm):
        return None
    channels = entry["channels"]
    if channels and ir.BoolAttr(op.attributes[channels]).value and perm[-1] != len(perm) - 1:
        return None
    if any(_shape_values(op.operands[k]) is None for k, _ in entry["per_axis"]):
        return None
    return {-1: perm, **{k: perm for k in follow}}


def _grow(seed: ir.Value, perm: Perm) -> _Region:
    """The region reached from value `seed` laid out by `perm`."""
    region = _Region({seed: perm})
    queue = [seed]
    while queue:
        value = queue.pop()
        perm = region.perms[value]
        if _identity(perm):
            continue  # its ops would stay as they are
        candidates: list[tuple[ir.Operation, int]] = []
        producer = irutil.producer(value)
        if producer is not None and _entry(producer) is not None:
            candidates.append((producer, -1))
        # the other readers of a value computed outside (a constant, a transpose) read it as they do
        for use in value.uses if value == seed or region.produced(value) else ():
            user = irutil.user(use)
            entry = _entry(user)
            if entry is not None and use.operand_number in _follow(user, entry):
                candidates.append((user, use.operand_number))
        for op, at in candidates:
            if op in region.members:
                continue
            implied = _implied(op, _table()[op.name], at, perm)
            if implied is None:
                continue
            values = {(op.results[0] if k == -1 else op.operands[k]): p for k, p in implied.items()}
            if any(region.perms.get(v, p) != p for v, p in values.items()):
                continue  # it would need two layouts: it stays outside
            region.add(op)
            for v, p in values.items():
                if v not in region.perms:
                    region.perms[v] = p
                    queue.append(v)
    return region


def _transpose_cost(shape: list[int], perm: Perm) -> Cost:
    if _identity(perm):
        return (0, 0, 0)
    return (0, 0, 1) if moves_units_only(shape, perm) else (1, math.prod(shape), 0)


def _delta(region: _Region) -> Cost:
    """How the function's transposes change if `region` is rewritten (negative: fewer)."""
    new, removed = [0, 0, 0], [0, 0, 0]

    def add(total: list[int], cost: Cost) -> None:
        for i, c in enumerate(cost):
            total[i] += c

    def read(value: ir.Value, perm: Perm) -> None:
        """The cost of reading `value` laid out by `perm`."""
        producer = irutil.producer(value)
        if region.produced(value):
            stored = region.perms[value]  # the new value is the old one transposed by it
            add(new, _transpose_cost([_shape(value)[p] for p in stored], compose(inverse(stored), perm)))
        elif producer is not None and producer.name == "tosa.transpose":
            read(producer.operands[0], compose(_perm(producer), perm))
        elif producer is not None and producer.name == "tosa.const" and _foldable(producer):
            pass
        else:
            add(new, _transpose_cost(_shape(value), perm))

    changed: set[ir.Operation] = set()
    for value, perm in region.perms.items():
        if region.produced(value):
            back = False
            for use in value.uses:
                if region.inside(use):
                    continue
                user = irutil.user(use)
                if user.name == "tosa.transpose" and user not in changed:
                    changed.add(user)
                    add(removed, _transpose_cost(_shape(value), _perm(user)))
                    if not all(region.inside(u) for u in user.results[0].uses):
                        add(new, _transpose_cost([_shape(value)[p] for p in perm],
                                                 compose(inverse(perm), _perm(user))))
                elif user.name != "tosa.transpose":
                    back = True
            if back:
                add(new, _transpose_cost([_shape(value)[p] for p in perm], inverse(perm)))
        elif not _identity(perm):
            if any(not region.inside(u) for u in value.uses) or irutil.producer(value) is None:
                read(value, perm)
                continue
            producer = irutil.producer(value)
            if producer.name == "tosa.transpose" and producer not in changed:
                changed.add(producer)
                add(removed, _transpose_cost(_shape(producer.operands[0]), _perm(producer)))
            read(value, perm)
    return tuple(n - r for n, r in zip(new, removed, strict=True))


def _improve(block: ir.Block) -> bool:
    """Rewrite the first region, grown from a transpose, that makes the function better."""
    for op in list(block.operations):
        op = op.operation
        if op.name != "tosa.transpose" or _shape(op.results[0]) is None:
            continue
        perm = _perm(op)
        best: tuple[Cost, _Region] | None = None
        # the ops it feeds, in the layout before it; the ops computing its input, in the layout after it
        for seed, layout in ((op.results[0], inverse(perm)), (op.operands[0], perm)):
            region = _grow(seed, layout)
            if not region.ops:
                continue
            delta = _delta(region)
            if delta < (0, 0, 0) and (best is None or delta < best[0]):
                best = (delta, region)
        if best is not None:
            _rewrite(best[1])
            return True
    return False


def _rewrite(region: _Region) -> None:
    """Compute the region's ops in their layouts; transposes at its edges."""
    index = {op: i for i, op in enumerate(o.operation for o in region.ops[0].block.operations)}
    ops = sorted(region.ops, key=index.__getitem__)
    new: dict[ir.Value, ir.Value] = {}  # a region op's result -> its result laid out by region.perms
    back: dict[ir.Value, ir.Value] = {}  # ... -> the same in the original layout, where an op outside reads it
    reads: dict[tuple[ir.Value, Perm], ir.Value] = {}

    def read(value: ir.Value, perm: Perm) -> ir.Value:
        """`value` laid out by `perm`, built before the op being rewritten."""
        key = (value, perm)
        if key not in reads:
            producer = irutil.producer(value)
            if value in new:
                reads[key] = transpose(new[value], compose(inverse(region.perms[value]), perm))
            elif producer is not None and producer.name == "tosa.transpose":
                reads[key] = read(producer.operands[0], compose(_perm(producer), perm))
            else:
                reads[key] = transpose(value, perm)  # of a constant: fold_layout folds it
        return reads[key]

    for op in ops:
        entry = _table()[op.name]
        follow = _follow(op, entry)
        result = op.results[0]
        perm = region.perms[result]
        shape = [_shape(result)[p] for p in perm]
        with ir.InsertionPoint(op), op.location:
            operands = []
            for k, value in enumerate(op.operands):
                if k in follow:
                    operands.append(read(value, region.perms[value]))
                else:
                    operands.append(back.get(value, value))
            for k, neutral in entry["per_axis"]:
                values, n = _shape_values(op.operands[k]), len(neutral)
                operands[k] = _const_shape([v for p in perm for v in values[n * p:n * p + n]])
            if entry["kind"] == "reshape":
                operands[1] = _const_shape(shape)
            attributes = {name: op.attributes[name] for name in op.attributes}
            if entry["axis"]:
                axis = ir.IntegerAttr(attributes[entry["axis"]]).value
                attributes[entry["axis"]] = ir.IntegerAttr.get(ir.IntegerType.get_signless(32), perm.index(axis))
            moved = ir.Operation.create(op.name, results=[_with_shape(result, shape)], operands=operands,
                                        attributes=attributes).results[0]
            new[result] = moved
            if any(not region.inside(u) for u in result.uses):
                back[result] = transpose(moved, inverse(perm))
    for op in ops:
        result = op.results[0]
        for use in list(result.uses):
            user = irutil.user(use)
            if user in region.members:
                continue
            if user.name == "tosa.transpose":  # one transpose from the new layout, or none
                user.operands[0] = new[result]
                user.attributes["perms"] = ir.DenseI32ArrayAttr.get(
                    list(compose(inverse(region.perms[result]), _perm(user))))
            else:
                user.operands[use.operand_number] = back[result]
    block = ops[0].block
    for op in reversed(ops):
        op.erase()
    _erase_unused(block)
