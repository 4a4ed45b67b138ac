"""Partial delegation: the largest part of a graph a TOSA target runs, and the host part around it.

`to_tosa(..., target=..., partition=True)` returns a `Delegation` instead of failing when some
op can't be in the target's TOSA: an op no registry lowers, a value of a type the target lacks,
an op its profiles don't have (float arithmetic under TOSA-1.0+INT, int64 index math under
TOSA-1.0+FP). Those stay on the host, run by PyTorch; the largest connected part left becomes
one TOSA program, its inputs and outputs named by the graph's tensors that cross the boundary.

The part is found as the native partitioner finds regions (`regions.py`): the ops each check
rejects are host ops, the partitioner proposes the connected parts of the others, and the
largest is imported for the target. When the target's validation rejects ops of that part
(the profiles are checked on the TOSA, not the graph), they join the host ops and the parts are
proposed again, until the largest part validates.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner

from .capture import symbolic
from .errors import NotConformant, Unsupported
from .importer.graph import Program, import_graph, where
from .importer.support import is_size, unsupported_reason
from .importer.target import Target
from .regions import _copy, _size, _Support

Runner = Callable[..., list[torch.Tensor]]  # (program, *inputs) -> outputs


@dataclass
class HostOp:
    """An op left to the host, why, and where the user wrote it."""

    op: str
    reason: str
    where: str


@dataclass
class Delegation:
    """A graph split for a TOSA target: `program`, the largest part the target runs (its inputs
    and outputs named by the boundary tensors), and `host`, the whole graph with that part a call
    of its submodule `delegate`, which PyTorch runs around it."""

    program: Program
    host: fx.GraphModule
    host_ops: list[HostOp] = field(default_factory=list)

    def explain(self) -> str:
        """What the target runs and what stays on the host, and why."""
        ops = Counter(op for (op, _), n in self.program.served.items() for _ in range(n))
        lines = [f"delegated to {self.program.target}: {sum(ops.values())} ops "
                 f"({', '.join(f'{op} x{n}' for op, n in sorted(ops.items()))})",
                 f"  inputs {', '.join(self.program.input_names)}; outputs {', '.join(self.program.output_names)}"]
        lines += [f"host   {h.op}: {h.reason} — at {h.where}" for h in self.host_ops]
        return "\n".join(lines)

    def __call__(self, *args: torch.Tensor, run: Runner | None = None) -> list[Any]:
        """The graph's outputs (a list) for its inputs (as the program's function takes them: parameters
        first unless frozen): host ops by PyTorch, the delegated part by `run(program, *inputs)`,
        by default TOSA's reference model."""
        self.host.delegate.run = run or (lambda program, *inputs: program.reference(*inputs))
        out = self.host(*args)
        return list(out) if isinstance(out, (tuple, list)) else [out]


class _Delegate(torch.nn.Module):
    """The delegated part in the host graph: the program, run by `run`."""

    def __init__(self, program: Program, single: bool) -> None:
        super().__init__()
        self.program, self.single = program, single
        self.run: Runner = lambda program, *inputs: program.reference(*inputs)

    def forward(self, *inputs: torch.Tensor) -> Any:
        outputs = self.run(self.program, *inputs)
        return outputs[0] if self.single else tuple(outputs)


def delegate(gm: fx.GraphModule, target: Target) -> Delegation:
    """Split `gm` (an aten graph with meta values, shapes static) for `target`."""
    reasons = {n.name: _host_reason(n, target) for n in _ops(gm)}
    while True:
        outer = _copy(gm)
        partitioner = CapabilityBasedPartitioner(outer, _Support(reasons), allows_single_node_partition=True)
        parts = [p for p in partitioner.propose_partitions() if _size(p) > 0]
        if not parts:
            first = next((f"{n.target}: {r}" for n in _ops(gm) if (r := reasons[n.name])), "no ops")
            raise Unsupported(f"no op of the graph can run on {target} (first: {first})")
        order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
        largest = max(parts, key=lambda p: (_size(p), -min(order[n.name] for n in p.nodes)))
        fused = partitioner.fuse_partitions([largest])
        (call,) = fused.graph.find_nodes(op="call_module")
        part = getattr(fused, call.target)
        _constants_inside(fused, call, part)
        try:
            program = import_graph(part, name="delegate", aim=target)
        except NotConformant as err:
            blamed = _blamed(part, err)
            if not blamed:
                raise
            for name, problem in blamed.items():
                reasons[name] = f"not conformant to {target}: {problem}"
            continue
        except Unsupported as err:
            node = getattr(err, "node", None)
            if node is None or reasons.get(node) is not None:
                raise
            reasons[node] = str(err).rsplit(" — ", 1)[-1]
            continue
        break
    inside = {n.name for n in largest.nodes}
    program.input_names = [n.name for n in part.graph.find_nodes(op="placeholder")]
    results = part.graph.output_node().args[0]
    single = not isinstance(results, (tuple, list))
    program.output_names = [n.name for n in ([results] if single else results)]
    fused.delete_submodule(call.target)
    fused.add_submodule("delegate", _Delegate(program, single))
    call.target = "delegate"
    fused.recompile()
    host = [HostOp(str(n.target), reasons[n.name] or f"outside the delegated part (it has {_size(largest)} ops)",
                   where(n)) for n in _ops(gm) if n.name not in inside]
    return Delegation(program, fused, host)


def _constants_inside(outer: fx.GraphModule, call: fx.Node, part: fx.GraphModule) -> None:
    """The frozen constants a part reads (get_attr nodes outside it) become its own, so the
    program holds its weights and takes only the boundary tensors."""
    placeholders = part.graph.find_nodes(op="placeholder")
    kept = []
    for arg, placeholder in zip(call.args, placeholders, strict=True):
        if not (isinstance(arg, fx.Node) and arg.op == "get_attr"):
            kept.append(arg)
            continue
        part.register_buffer(arg.target.replace(".", "_"), operator.attrgetter(arg.target)(outer))
        with part.graph.inserting_before(placeholder):
            constant = part.graph.get_attr(arg.target.replace(".", "_"))
        constant.meta = dict(placeholder.meta)
        constant.meta.update({k: v for k, v in arg.meta.items() if k == "source_name"})
        placeholder.replace_all_uses_with(constant)
        part.graph.erase_node(placeholder)
    call.args = tuple(kept)
    part.recompile()
    outer.graph.eliminate_dead_code()
    outer.recompile()



def _ops(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's op nodes (not getitems, not size arithmetic)."""
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and n.target is not operator.getitem and not is_size(n)]


def _host_reason(node: fx.Node, target: Target) -> str | None:
    """Why `node` stays on the host before any TOSA is built, or None."""
    if (reason := unsupported_reason(node)) is not None:
        return reason
    values = [node.meta.get("val"), *(a.meta.get("val") for a in node.all_input_nodes)]
    for v in pytree.tree_leaves(values):
        if isinstance(v, torch.Tensor):
            if not symbolic.is_static(v.shape):
                return f"a symbolic shape {symbolic.show(v.shape)}: {target} needs static shapes"
            if (problem := target.dtype_problem(v.dtype)) is not None:
                return problem
    return None


def _blamed(part: fx.GraphModule, err: NotConformant) -> dict[str, str]:
    """The op nodes of `part` a validation error names, each with its first problem: the nodes
    themselves, or the users of a named parameter or input."""
    by_name = {n.meta.get("source_name", n.name): n for n in part.graph.nodes}
    problems = [line.strip() for line in str(err).splitlines()[1:]]
    blamed: dict[str, str] = {}
    for name in err.names:
        node = by_name.get(name)
        if node is None:
            continue
        problem = next((p.split("): ", 1)[-1] for p in problems if p.startswith(f"{name} (") or
                        p.startswith(f"{name}:")), "")
        ops = [node] if node.op == "call_function" else list(node.users)
        for op in ops:
            if op.op == "call_function" and op.target is not operator.getitem:
                blamed.setdefault(op.name, problem.split(": ", 1)[-1] if problem.startswith(name) else problem)
    return blamed
