"""Run a graph natively where the registries can lower it and with PyTorch where they can't.

`split(gm, compile_region, min_ops)` asks `support.unsupported_reason` about every node,
lets torch's `CapabilityBasedPartitioner` group the supported ones into maximal regions
without cycles (multi-output ops stay with their `getitem`s), compiles each region of at
least `min_ops` aten ops to native code and leaves the rest of the graph as it is: the
outer GraphModule calls the native regions and the eager ops in order, passing tensors
without copies; an update of an input is written in place (`state.py`). A node the
importer rejects although its rules accepted it is moved to eager and the graph is split
again, so such a mismatch costs speed, never a failure. A whole-tensor update of an input
(`copy_(buffer, new_value)`, batch norm's running statistics in training) is a write-back, not
an op: it runs after the regions, as AOTAutograd's own epilogue would copy the value.
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner, Partition
from torch.fx.passes.operator_support import OperatorSupportBase

from .errors import TorchTosaError
from .execute.state import in_place_writes, update_in_place
from .importer.graph import Program, where
from .importer.support import is_size, unsupported_reason

CompileRegion = Callable[[fx.GraphModule], tuple[Program, Callable[..., list[torch.Tensor]]]]


class FallbackWarning(UserWarning):
    """Some ops of a compiled graph run eagerly: `explain()` lists them and why."""


@dataclass
class EagerOp:
    """An aten op that runs with PyTorch, why, and where the user wrote it."""

    op: str
    reason: str
    where: str
    graph: str = ""  # which graph of a compile ("forward graph 0"), if it has several


@dataclass
class NativeRegion:
    """Consecutive ops compiled together: their aten ops and the TOSA program."""

    name: str
    ops: Counter
    program: Program
    graph: str = ""


@dataclass
class WriteBack:
    """A graph input updated as a whole (`copy_`): its new value copied into the caller's tensor."""

    input: str
    where: str
    graph: str = ""


@dataclass
class Explanation:
    """What ran where, in graph order: native regions, eager ops and write-backs, each labelled
    with its graph where a compile has several (a training step's forward and backward)."""

    parts: list[NativeRegion | EagerOp | WriteBack] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # whole-graph facts (graph breaks)

    @property
    def eager(self) -> list[EagerOp]:
        return [p for p in self.parts if isinstance(p, EagerOp)]

    @property
    def native_ops(self) -> int:
        return sum(sum(p.ops.values()) for p in self.parts if isinstance(p, NativeRegion))

    def graphs(self) -> dict[str, tuple[int, int]]:
        """Each labelled graph's (native ops, eager ops), in the order they were compiled."""
        counts: dict[str, tuple[int, int]] = {}
        for p in self.parts:
            native, eager = counts.get(p.graph, (0, 0))
            if isinstance(p, NativeRegion):
                native += sum(p.ops.values())
            elif isinstance(p, EagerOp):
                eager += 1
            counts[p.graph] = (native, eager)
        return {g: c for g, c in counts.items() if g}

    def label(self, graph: str) -> Explanation:
        """This explanation with every part marked as one of `graph`'s."""
        for p in self.parts:
            p.graph = graph
        return self

    def __str__(self) -> str:
        lines = list(self.notes)
        graphs, current = self.graphs(), None
        for part in self.parts:
            if part.graph and part.graph != current:
                current = part.graph
                native, eager = graphs[current]
                ran = f"all {native} ops native" if not eager else f"{native} ops native, {eager} eager"
                lines.append(f"{current}: {ran}")
            if isinstance(part, NativeRegion):
                ops = ", ".join(f"{op} x{n}" for op, n in sorted(part.ops.items()))
                lines.append(f"native {part.name}: {sum(part.ops.values())} ops ({ops})")
                if part.program.ranges:
                    lines.append(f"       serves sizes {part.program.serves()}")
            elif isinstance(part, WriteBack):
                lines.append(f"write  {part.input}: its new value, copied into the caller's tensor — at {part.where}")
            else:
                lines.append(f"eager  {part.op}: {part.reason} — at {part.where}")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: how many ops fell back and why."""
        total = self.native_ops + len(self.eager)
        graphs = [g for g, (_, eager) in self.graphs().items() if eager]
        scope = f" of the {' and '.join(graphs)}" if graphs else ""
        why = Counter(f"{e.op} ({e.reason})" for e in self.eager)
        listed = "; ".join(f"{w} x{n}" if n > 1 else w for w, n in why.most_common(4))
        more = f"; and {len(why) - 4} more" if len(why) > 4 else ""
        return f"torchtosa: {len(self.eager)} of {total} ops{scope} run eagerly: {listed}{more} (see explain())"

    def extend(self, other: Explanation) -> None:
        """Add another graph's parts (a function compiled graph by graph), regions numbered on."""
        count = sum(isinstance(p, NativeRegion) for p in self.parts)
        for p in other.parts:
            if isinstance(p, NativeRegion):
                p.name = f"region {count}"
                count += 1
        self.parts += other.parts
        self.notes += other.notes


def split(gm: fx.GraphModule, compile_region: CompileRegion,
          min_ops: int) -> tuple[Callable[..., Any], Explanation]:
    """A callable running `gm` (its flat outputs as a sequence) with its supported regions
    as native code, and what runs where."""
    checked = {n.name: unsupported_reason(n) for n in gm.graph.nodes
               if n.op == "call_function" and n.target is not operator.getitem}
    for src, copy in in_place_writes(gm).items():
        checked[src.name] = f"writes into input {copy.args[0].name} in place"
    forced: dict[str, str] = {}  # node -> reason, for nodes the importer rejected
    while True:
        try:  # _attempt adds reasons of its own (small regions): a fresh dict each time
            return _attempt(gm, {**checked, **forced}, compile_region, min_ops)
        except TorchTosaError as err:
            node = getattr(err, "node", None)
            if node is None or node in forced:
                raise
            forced[node] = str(err).rsplit(" — ", 1)[-1]


def _attempt(gm: fx.GraphModule, reasons: dict[str, str | None], compile_region: CompileRegion,
             min_ops: int) -> tuple[Callable[..., Any], Explanation]:
    if not any(reasons.values()):  # all native: one function, no outer graph
        program, native = compile_region(gm)
        return native, all_native(gm, program)
    outer = _copy(gm)
    partitioner = CapabilityBasedPartitioner(outer, _Support(reasons), allows_single_node_partition=True)
    partitions = partitioner.propose_partitions()
    for p in partitions:
        if _size(p) < min_ops:
            for node in p.nodes:
                if node.target is not operator.getitem:
                    reasons[node.name] = f"in a native region of {_size(p)} op(s), under min_region_ops={min_ops}"
    big = [p for p in partitions if _size(p) >= min_ops]
    fused = partitioner.fuse_partitions(big) if big else outer
    regions = _compile_regions(fused, compile_region)
    for gone in update_in_place(fused):
        reasons.pop(gone)
    _views_as_reshapes(fused)
    return fused, _explain(gm, reasons, regions)


def _views_as_reshapes(gm: fx.GraphModule) -> None:
    """Eager views become reshapes: native regions return contiguous tensors, where the graph's
    strides (a permuted result, say) may have allowed a view that contiguous ones don't. In a
    functional graph the two compute the same values; reshape copies only when it must."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        node.target = torch.ops.aten.reshape.default
    gm.recompile()


class _Support(OperatorSupportBase):
    def __init__(self, reasons: dict[str, str | None]) -> None:
        self.reasons = reasons

    def is_node_supported(self, _submodules: Any, node: fx.Node) -> bool:
        if node.op != "call_function":
            return False
        if node.target is operator.getitem:
            return self.reasons.get(node.args[0].name) is None
        return self.reasons.get(node.name) is None


def _size(p: Partition) -> int:
    return sum(1 for n in p.nodes if n.target is not operator.getitem and not is_size(n))


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


class _NativeCall(torch.nn.Module):
    """A fused submodule's replacement: its native code, returning what the submodule returned."""

    def __init__(self, native: Callable[..., list[torch.Tensor]], single: bool) -> None:
        super().__init__()
        self.native, self.single = native, single

    def forward(self, *args: torch.Tensor) -> Any:
        outs = self.native(*args)
        return outs[0] if self.single else tuple(outs)


def _compile_regions(fused: fx.GraphModule, compile_region: CompileRegion) -> dict[str, tuple[str, Program]]:
    """Compile every fused submodule; node name -> (region name, program)."""
    regions: dict[str, tuple[str, Program]] = {}
    for node in fused.graph.find_nodes(op="call_module"):
        sub = getattr(fused, node.target)
        program, native = compile_region(sub)
        single = not isinstance(sub.graph.output_node().args[0], (tuple, list))
        setattr(fused, node.target, _NativeCall(native, single))
        for inner in sub.graph.nodes:
            if inner.op == "call_function":
                regions[inner.name] = (node.target, program)
    return regions


def _explain(gm: fx.GraphModule, reasons: dict[str, str | None],
             regions: dict[str, tuple[str, Program]]) -> Explanation:
    explanation = Explanation()
    by_region: dict[str, NativeRegion] = {}
    for node in gm.graph.nodes:
        if (node.op != "call_function" or node.target is operator.getitem or node.name not in reasons
                or is_size(node)):
            continue
        op = str(node.target)
        if _write_back(node):  # where the new value is computed (the copy itself has no source line)
            target, value = node.args[:2]
            explanation.parts.append(WriteBack(target.meta.get("user_input", target.name),
                                               where(value if isinstance(value, fx.Node) else node)))
        elif node.name in regions:
            name, program = regions[node.name]
            if name not in by_region:
                by_region[name] = NativeRegion(f"region {len(by_region)}", Counter(), program)
                explanation.parts.append(by_region[name])
            by_region[name].ops[op] += 1
        else:
            explanation.parts.append(EagerOp(op, reasons.get(node.name) or "not lowered", where(node)))
    return explanation


def _write_back(node: fx.Node) -> bool:
    """Whether `node` copies a whole new value into a graph input (AOTAutograd's kept mutation)."""
    return node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder"


def all_native(gm: fx.GraphModule, program: Program) -> Explanation:
    """The explanation of a graph compiled whole."""
    nodes = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    return _explain(gm, dict.fromkeys(nodes), dict.fromkeys(nodes, ("forward", program)))


def warn_fallbacks(explanation: Explanation) -> None:
    """One warning per compile that ran any op eagerly."""
    if explanation.eager or explanation.notes:
        message = explanation.summary() if explanation.eager else explanation.notes[0]
        frame = sys._getframe(1)
        while frame.f_back is not None and _internal(frame.f_code.co_filename):
            frame = frame.f_back
        warnings.warn_explicit(message, FallbackWarning, frame.f_code.co_filename, frame.f_lineno,
                               module=frame.f_globals.get("__name__"), registry=frame.f_globals.setdefault(
                                   "__warningregistry__", {}))


# Frames a warning skips, to point at the user's line: torch, torchtosa, the standard
# library and generated code (no file).
_INTERNAL = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__package__], contextlib))


def _internal(filename: str) -> bool:
    return filename.startswith(_INTERNAL) or not os.path.isfile(filename)
