"""Run a graph natively where the registries can lower it and with PyTorch where they can't.

`split(gm, compile_region, min_ops)` asks `support.unsupported_reason` about every node,
groups the supported ones into regions without cycles in two passes over the graph (`_regions`:
multi-output ops stay with their `getitem`s), compiles each region of at
least `min_ops` aten ops to native code and leaves the rest of the graph as it is: the
outer GraphModule calls the native regions and the eager ops in order, passing tensors
without copies; an update of an input is written in place (`state.py`). A node the
importer rejects although its rules accepted it is moved to eager and the graph is split
again, so such a mismatch costs speed, never a failure. So does torchtosa's own failure
(`InternalError`: an exception of its lowering, scheduling or JIT): a node the importer failed
on runs eagerly, and a region that failed later in its compile runs eagerly as the graph of
aten ops it is; the compile's one FallbackWarning and `explain()` name the error, the op and
source line, and ask for a report. An eager op that reads the storage beneath its input
(as_strided) reads it through views that run eagerly too. A whole-tensor update of an input
(`copy_(buffer, new_value)`, batch norm's running statistics in training) is a write-back, not
an op: it runs after the regions, as AOTAutograd's own epilogue would copy the value, unless
the region computing the value writes it into the input itself (`state.native_writes`).
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import os
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.passes.infra.partitioner import Partition
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from .errors import InternalError, TorchTosaError, Unsupported
from .execute.state import drop_copies, in_place_writes, native_writes, update_in_place, writes_natively
from .importer.graph import Program, where
from .importer.support import is_size, unsupported_reason
from .internal import internal_error, is_internal

CompileRegion = Callable[[fx.GraphModule], tuple[Program, Callable[..., list[torch.Tensor]]]]
# why a view runs eagerly that the registries could lower (`_eager_views_of_eager_values`)
EAGER_VIEW = "a view only eager ops read (eagerly free, natively a copy)"


class FallbackWarning(UserWarning):
    """Some ops of a compiled graph run eagerly: `explain()` lists them and why."""


@dataclass
class EagerOp:
    """An aten op that runs with PyTorch, why, and where the user wrote it."""

    op: str
    reason: str
    where: str
    failure: InternalError | None = None  # torchtosa's own error that left it to PyTorch
    graph: str = ""  # which graph of a compile ("forward graph 0"), if it has several
    node: str = ""  # its node in the graph


@dataclass
class NativeRegion:
    """Consecutive ops compiled together: their aten ops and the TOSA program."""

    name: str
    ops: Counter
    program: Program
    graph: str = ""
    nodes: list[str] = field(default_factory=list)  # its nodes in the graph
    writes: list[str] = field(default_factory=list)  # inputs it updates in the caller's tensor


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
    # torchtosa's own errors (bugs to report) whose ops run eagerly instead, in graph order
    failures: list[InternalError] = field(default_factory=list)
    cpu: str | None = None  # the CPU table's entry native code was compiled for (`Cpu.describe`)

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
        if self.cpu is not None and any(isinstance(p, NativeRegion) for p in self.parts):
            lines.append(f"native code for {self.cpu}")
        lines += [f"internal error {f.short()} — its ops run eagerly; please report this torchtosa bug"
                  for f in self.failures]
        graphs, current = self.graphs(), ""
        for failed, parts in itertools.groupby(self.parts, key=_failed_region):
            group = list(parts)
            for part in group if failed is None else group[:1]:
                if part.graph and part.graph != current:  # a training step's forward, then backward
                    current = part.graph
                    native, eager = graphs[current]
                    ran = f"all {native} ops native" if not eager else f"{native} ops native, {eager} eager"
                    lines.append(f"{current}: {ran}")
                if failed is not None:  # one line for the ops of a region that failed to compile
                    lines.append(f"eager  {len(group)} ops of a native region that failed to compile "
                                 f"({_counted(p.op for p in group)}): the internal error above")
                elif isinstance(part, NativeRegion):
                    ops = _counted(part.ops.elements())
                    lines.append(f"native {part.name}: {sum(part.ops.values())} ops ({ops})")
                    if part.program.ranges:
                        lines.append(f"       serves sizes {part.program.serves()}")
                    for name in part.writes:
                        lines.append(f"       writes {name} in place, in the caller's tensor")
                elif isinstance(part, WriteBack):
                    lines.append(f"write  {part.input}: its new value, copied into the caller's tensor "
                                 f"— at {part.where}")
                else:
                    lines.append(f"eager  {part.op}: {part.reason} — at {part.where}")
        return "\n".join(lines)

    def summary(self) -> str:
        """One line: how many ops fell back and why."""
        total = self.native_ops + len(self.eager)
        graphs = [g for g, (_, eager) in self.graphs().items() if eager]
        scope = f" of the {' and '.join(graphs)}" if graphs else ""
        failed = [f"internal error {f.short()} (a torchtosa bug: please report it)" for f in self.failures]
        why = Counter(f"{e.op} ({e.reason})" for e in self.eager if e.failure is None)
        causes = sorted(why.items(), key=lambda item: (EAGER_VIEW in item[0], -item[1]))[:4]  # views last
        listed = "; ".join([*failed, *(f"{w} x{n}" if n > 1 else w for w, n in causes)])
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
        self.failures += other.failures
        self.cpu = self.cpu or other.cpu


def split(gm: fx.GraphModule, compile_region: CompileRegion,
          min_ops: int) -> tuple[Callable[..., Any], Explanation]:
    """A callable running `gm` (its flat outputs as a sequence) with its supported regions
    as native code, and what runs where."""
    failures: dict[str, InternalError] = {}  # node -> torchtosa's own error on it
    checked = {n.name: _checked(n, failures) for n in gm.graph.nodes
               if n.op == "call_function" and n.target is not operator.getitem}
    native = writes_natively(gm)
    for src, copy in in_place_writes(gm).items():
        if src not in native:
            checked[src.name] = f"writes into input {copy.args[0].name} in place"
    forced: dict[str, str] = {}  # node -> reason, for nodes the importer rejected or failed on
    while True:
        try:  # _attempt adds reasons of its own (small regions): a fresh dict each time
            return _attempt(gm, {**checked, **forced}, compile_region, min_ops, dict(failures))
        except TorchTosaError as err:
            node = getattr(err, "node", None)
            if node is None or node in forced:
                raise
            if isinstance(err, InternalError):
                failures[node] = err
                forced[node] = f"internal error lowering it: {err.detail}"
            else:
                forced[node] = str(err).rsplit(" — ", 1)[-1]


def _checked(node: fx.Node, failures: dict[str, InternalError]) -> str | None:
    """`unsupported_reason` of a node; an exception of its rules is torchtosa's bug (in `failures`)."""
    try:
        return unsupported_reason(node)
    except Exception as err:
        if not is_internal(err):
            raise
        failures[node.name] = internal_error(err, node=node, stage="checking its rules")
        return f"internal error checking its rules: {failures[node.name].detail}"


def _attempt(gm: fx.GraphModule, reasons: dict[str, str | None], compile_region: CompileRegion,
             min_ops: int, failures: dict[str, InternalError]) -> tuple[Callable[..., Any], Explanation]:
    if not any(reasons.values()):  # all native: one function, no outer graph
        try:
            program, native = compile_region(gm)
        except (InternalError, Unsupported) as err:
            return gm, all_eager(gm, _region_failure(err, gm))  # the captured graph itself runs eagerly
        return native, all_native(gm, program)
    outer = _copy(gm)
    while True:  # until no eager op reads the storage beneath a native view
        _eager_views_of_eager_values(outer, reasons)
        partitions = _regions(outer, reasons)
        for p in partitions:
            if _size(p) < min_ops:
                for node in p.nodes:
                    if node.target is not operator.getitem:
                        reasons[node.name] = f"in a native region of {_size(p)} op(s), under min_region_ops={min_ops}"
        if not _eager_storage_views(outer, reasons):
            break
    _lay_out_storage_bases(outer, reasons)
    big = [p for p in partitions if _size(p) >= min_ops]
    fused = fuse_by_partitions(outer, [p.nodes for p in big]) if big else outer
    writes = native_writes(fused)
    regions = _compile_regions(fused, compile_region, failures)
    gone, written = set(), {}
    for call, planned in writes.items():  # the copies a native region wrote itself go
        region = getattr(fused, call.target)
        honored = getattr(region.native, "writes", {}) if isinstance(region, _NativeCall) else {}
        done = [w for w in planned if honored.get(w[1]) == w[2]]
        written[call.target] = [_input_name(copy.args[0]) for copy, _, _ in done]
        gone |= drop_copies(fused, done)
    gone |= update_in_place(fused)
    for name in gone:
        reasons.pop(name, None)
    _views_as_reshapes(fused)
    return fused, _explain(gm, reasons, regions, failures, written)


# Ops that read the storage beneath their input, not only its elements.
_STORAGE_READERS = {torch.ops.aten.as_strided.default, torch.ops.aten.as_strided_scatter.default}


def _storage_chain(node: fx.Node) -> list[fx.Node]:
    """The views `node` reads its first argument through, outermost last (getitems with their
    multi-output view), ending before the value that owns their storage."""
    chain: list[fx.Node] = []
    src = node.args[0]
    while isinstance(src, fx.Node) and src.op == "call_function":
        producer = src.args[0] if src.target is operator.getitem else src
        if not _is_view(producer):
            break  # a fresh tensor owns its storage
        chain.append(src)
        src = producer.args[0]
    return chain


def _is_view(node: Any) -> bool:
    """Whether a node is an aten view: its result aliases its first argument, which it does not write."""
    schema = getattr(node.target, "_schema", None) if isinstance(node, fx.Node) else None
    return (schema is not None and not schema.is_mutable and bool(schema.arguments)
            and schema.arguments[0].alias_info is not None)


def _eager_views_of_eager_values(gm: fx.GraphModule, reasons: dict[str, str | None]) -> None:
    """Make eager each view (or chain of views) of a value no native op makes (a graph input, a
    parameter, an eager op's result) that only eager ops read: eagerly it is free, its input's
    storage seen another way; natively it was a copy made at every call (a mixture of experts'
    weights transposed for the eager grouped matmul: 21 MB a call, 4x eager's time)."""
    free: dict[fx.Node, None] = {}  # views of such values, in graph order
    for node in gm.graph.nodes:
        source = node.args[0] if node.op == "call_function" and node.args else None
        if (_is_view(node) and reasons.get(node.name) is None and isinstance(source, fx.Node)
                and (source.op in ("placeholder", "get_attr") or reasons.get(source.name) is not None
                     or source in free)):
            free[node] = None
    for node in reversed(free):  # readers first
        if node.users and all(user.op == "call_function" and reasons.get(user.name) is not None
                              for user in node.users):
            reasons[node.name] = EAGER_VIEW


def _eager_storage_views(gm: fx.GraphModule, reasons: dict[str, str | None]) -> bool:
    """Make eager the views beneath an eager op that reads its input's storage (as_strided):
    eagerly, a view shares its base's storage, where a native region returns a fresh tensor
    (an empty slice of an expanded view, whose storage offset lies beyond its own elements, then
    read elements the fresh tensor does not have). Whether any reason was added."""
    added = False
    for node in gm.graph.nodes:
        if node.target not in _STORAGE_READERS or reasons.get(node.name) is None:
            continue
        for view in _storage_chain(node):
            name = view.name if view.target is not operator.getitem else view.args[0].name
            if reasons.get(name) in (None, EAGER_VIEW):  # the storage is the reason that matters
                reasons[name] = f"a view whose storage an eager {node.target} reads"
                added = True
    return added


def _lay_out_storage_bases(gm: fx.GraphModule, reasons: dict[str, str | None]) -> None:
    """Give the tensor that owns the storage beneath an eager storage reader's views the strides
    the graph's metadata gives it: out of a native region it is contiguous, out of eager ops on
    such tensors it may be laid out otherwise too, where eagerly a permuted result (`x.t() * 2`)
    keeps its input's strides."""
    for node in list(gm.graph.nodes):
        if node.target not in _STORAGE_READERS or reasons.get(node.name) is None:
            continue
        chain = _storage_chain(node)
        first = chain[-1] if chain else node
        base = first.args[0]
        val = base.meta.get("val") if isinstance(base, fx.Node) and base.op == "call_function" else None
        if not isinstance(val, torch.Tensor) or not all(isinstance(t, int) for t in val.stride()):
            continue  # an input's layout is the compiled signature's
        with gm.graph.inserting_before(first):
            laid = gm.graph.call_function(_laid_out, (base, tuple(val.stride())))
        laid.meta["val"] = val
        reasons[laid.name] = f"lays out the storage an eager {node.target} reads"
        first.replace_input_with(base, laid)
    gm.recompile()


def _laid_out(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """`t`, or a copy of it with the strides `stride` (of a fresh tensor: dense, at offset 0)."""
    if t.stride() == stride and t.storage_offset() == 0:
        return t
    out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def _views_as_reshapes(gm: fx.GraphModule) -> None:
    """Eager views become reshapes: native regions return contiguous tensors, where the graph's
    strides (a permuted result, say) may have allowed a view that contiguous ones don't. In a
    functional graph the two compute the same values; reshape copies only when it must."""
    for node in gm.graph.find_nodes(op="call_function", target=torch.ops.aten.view.default):
        node.target = torch.ops.aten.reshape.default
    gm.recompile()


def _regions(gm: fx.GraphModule, reasons: dict[str, str | None]) -> list[Partition]:
    """The supported nodes of `gm` (no reason in `reasons`; a `getitem` goes where its op goes)
    grouped into regions, each of which can run as one call between eager ops.

    A pass in graph order gives every node its earliest stage: a supported node the largest stage
    of its inputs, an eager op the largest of its eager inputs' stages and its supported inputs'
    stages + 1 (an eager op that only reads inputs of the graph or other eager ops runs before
    stage 0). A pass in reverse order then moves each supported node to its latest stage, at most
    its supported users' and below its eager users' (a weight's transpose goes to the region
    of its matmul, not to the first region). A region is the supported nodes of one stage; a path
    that leaves a region of stage k and returns would pass an eager op of stage > k and so end
    beyond k: fusing a region never makes a cycle. (torch's CapabilityBasedPartitioner merges
    pairs and searches for cycles after each merge: seconds on a graph of thousands of nodes.)"""
    support = _Support(reasons)
    nodes = list(gm.graph.nodes)
    native = {n for n in nodes if support.is_node_supported({}, n)}
    stage: dict[fx.Node, int] = {}
    for node in nodes:
        inputs = node.all_input_nodes
        stage[node] = max((stage[p] + (node not in native and p in native) for p in inputs), default=0)
    last = max((stage[n] for n in native), default=0)
    for node in reversed(nodes):
        if node in native:
            stage[node] = min((stage[u] - (u not in native) for u in node.users if u.op != "output"), default=last)
    regions: dict[int, list[fx.Node]] = {}
    for node in nodes:
        if node in native:
            if node.target is operator.getitem:
                stage[node] = stage[node.args[0]]
            regions.setdefault(stage[node], []).append(node)
    return [Partition(i, members) for i, (_, members) in enumerate(sorted(regions.items()))]


class _Support(OperatorSupportBase):
    """The ops `reasons` has no reason for (a `getitem` with its op)."""

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


def _compile_regions(fused: fx.GraphModule, compile_region: CompileRegion,
                     failures: dict[str, InternalError]) -> dict[str, tuple[str, Program]]:
    """Compile every fused submodule; node name -> (region name, program). A submodule whose
    compile failed stays the graph of aten ops it is, run eagerly (its nodes in `failures`)."""
    regions: dict[str, tuple[str, Program]] = {}
    for node in fused.graph.find_nodes(op="call_module"):
        sub = getattr(fused, node.target)
        try:
            program, native = compile_region(sub)
        except (InternalError, Unsupported) as err:
            failure = _region_failure(err, sub)
            _views_as_reshapes(sub)  # its inputs may come from native regions, contiguous
            failures.update(dict.fromkeys((n.name for n in sub.graph.nodes if n.op == "call_function"), failure))
            continue
        single = not isinstance(sub.graph.output_node().args[0], (tuple, list))
        setattr(fused, node.target, _NativeCall(native, single))
        for inner in sub.graph.nodes:
            if inner.op == "call_function":
                regions[inner.name] = (node.target, program)
    return regions


def _region_failure(err: InternalError | Unsupported, region: fx.GraphModule) -> InternalError:
    """The InternalError that makes a region run eagerly; an error that blames a node is the
    partitioner's to move to eager (raised again). The importer rejecting a region the
    partitioner accepted, for no node of it, is torchtosa's bug too."""
    if getattr(err, "node", None) is not None:
        raise err
    return err if isinstance(err, InternalError) else internal_error(err, region, stage="import to TOSA")


def _explain(gm: fx.GraphModule, reasons: dict[str, str | None], regions: dict[str, tuple[str, Program]],
             failures: dict[str, InternalError] | None = None,
             written: dict[str, list[str]] | None = None) -> Explanation:
    failures = failures or {}
    explanation = Explanation(failures=list(dict.fromkeys(failures.values())))
    by_region: dict[str, NativeRegion] = {}
    for node in gm.graph.nodes:
        if (node.op != "call_function" or node.target is operator.getitem or node.name not in reasons
                or is_size(node)):
            continue
        op = str(node.target)
        if _write_back(node):  # where the new value is computed (the copy itself has no source line)
            target, value = node.args[:2]
            explanation.parts.append(WriteBack(_input_name(target),
                                               where(value if isinstance(value, fx.Node) else node)))
        elif node.name in regions:
            name, program = regions[node.name]
            if name not in by_region:
                by_region[name] = NativeRegion(f"region {len(by_region)}", Counter(), program,
                                               writes=(written or {}).get(name, []))
                explanation.parts.append(by_region[name])
            by_region[name].ops[op] += 1
            by_region[name].nodes.append(node.name)
        else:
            failure = failures.get(node.name)
            reason = reasons.get(node.name) or "not lowered"
            if failure is not None and reasons.get(node.name) is None:  # a region that failed to compile
                reason = f"{_REGION_FAILED}: internal error{_in(failure)}: {failure.detail}"
            explanation.parts.append(EagerOp(op, reason, where(node), failure, node=node.name))
    return explanation


def _input_name(placeholder: fx.Node) -> str:
    """What explain() calls a graph input: the user's name Dynamo gave it, else its node's."""
    return placeholder.meta.get("user_input", placeholder.name)


def _in(failure: InternalError) -> str:
    return f" in {failure.stage}" if failure.stage else ""


_REGION_FAILED = "its native region failed to compile"


def _failed_region(part: NativeRegion | EagerOp | WriteBack) -> int | None:
    """The identity of the failure an eager op's region failed to compile with, or None."""
    if isinstance(part, EagerOp) and part.failure is not None and part.reason.startswith(_REGION_FAILED):
        return id(part.failure)
    return None


def _counted(ops: Iterable[str]) -> str:
    """`aten.add.Tensor x1, aten.mul.Tensor x2`: each op and how often, sorted."""
    return ", ".join(f"{op} x{n}" for op, n in sorted(Counter(ops).items()))


def _write_back(node: fx.Node) -> bool:
    """Whether `node` copies a whole new value into a graph input (AOTAutograd's kept mutation)."""
    return node.target is torch.ops.aten.copy_.default and node.args[0].op == "placeholder"


def all_native(gm: fx.GraphModule, program: Program) -> Explanation:
    """The explanation of a graph compiled whole."""
    nodes = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    return _explain(gm, dict.fromkeys(nodes), dict.fromkeys(nodes, ("forward", program)))


def all_eager(gm: fx.GraphModule, failure: InternalError) -> Explanation:
    """The explanation of a graph that runs eagerly as a whole because compiling it failed."""
    nodes = [n.name for n in gm.graph.nodes if n.op == "call_function"]
    return _explain(gm, dict.fromkeys(nodes), {}, dict.fromkeys(nodes, failure))


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
