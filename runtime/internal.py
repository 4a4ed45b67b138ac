"""torchtosa's own failures: which op and step an exception of a compile was working on.

An exception that is not the user's (`InvalidInput`, `InputMismatch`), not valid PyTorch left to
eager (`Unsupported`) and not a missing installation (`MissingRuntime`) is torchtosa's bug:
`internal_error` makes it an `InternalError` naming the step (a pipeline stage, "JIT") and the
aten op and source line it was working on. Those come from the exception itself: a lowering
step marks it with the MLIR op it was rewriting (`blaming(op)`), whose location names the
graph node (`loc("sum_1"("model.py":12:0))`), MLIR's diagnostics carry locations, and
`lower()` marks the stage it was in (`blame`). With none, the region's ops are named.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.fx as fx

from .errors import InputMismatch, InternalError, InvalidInput, MissingRuntime, Unsupported

_LOCATION = "torchtosa_location"  # attributes `blame` sets on an exception
_STAGE = "torchtosa_stage"
_NAME = re.compile(r'"([^"]+)"(?!:)')  # a NameLoc's name: a quoted string that is not a file


def blame(err: BaseException, location: Any = None, stage: str | None = None) -> None:
    """Record on `err` the MLIR location of the op and the step it was raised in, unless an inner
    step recorded them first."""
    if location is not None and getattr(err, _LOCATION, None) is None:
        setattr(err, _LOCATION, str(location))
    if stage is not None and getattr(err, _STAGE, None) is None:
        setattr(err, _STAGE, stage)


@contextmanager
def blaming(op: Any) -> Iterator[None]:
    """Exceptions raised while rewriting the MLIR op `op` are blamed on its location."""
    try:
        yield
    except Exception as err:
        blame(err, location=op.location)
        raise


def is_internal(err: BaseException) -> bool:
    """Whether an exception of a compile is torchtosa's own failure, not yet an InternalError.
    A node-blaming error (`err.node`) is the partitioner's to move to eager."""
    return (isinstance(err, Exception) and getattr(err, "node", None) is None
            and not isinstance(err, (InvalidInput, InputMismatch, Unsupported, MissingRuntime, InternalError)))


def internal_error(err: Exception, gm: fx.GraphModule | None = None, node: fx.Node | None = None,
                   stage: str | None = None) -> InternalError:
    """`err` as the InternalError a user sees: what failed, in which step, on which op of `gm`
    (`node` if known), and a request for a report."""
    from .importer.graph import where  # the importer imports this module's users

    stage = getattr(err, _STAGE, None) or stage
    if node is None and gm is not None:
        node = _blamed_node(err, gm)
    if node is not None:
        op, at = str(node.target), where(node)
    elif gm is not None:
        ops = Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "." in str(n.target))
        op = f"{sum(ops.values())} ops (" + ", ".join(f"{o} x{k}" for o, k in sorted(ops.items())) + ")"
        first = next((n for n in gm.graph.nodes if n.op == "call_function"), None)
        at = where(first) if first is not None else None
    else:
        op, at = None, None
    text = str(err).strip().splitlines()
    detail = f"{type(err).__name__}: {text[0][:300]}" if text else type(err).__name__
    return InternalError(detail, op=op, where=at, stage=stage)


def _blamed_node(err: BaseException, gm: fx.GraphModule) -> fx.Node | None:
    """The first call of `gm` that a location recorded on `err` (or its causes) names."""
    nodes = {n.meta.get("source_name", n.name): n for n in gm.graph.nodes if n.op == "call_function"}
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        locations = [getattr(err, _LOCATION, None)]
        locations += [str(d.location) for d in getattr(err, "error_diagnostics", None) or []]
        for location in filter(None, locations):
            for name in _NAME.findall(location):
                if name in nodes:
                    return nodes[name]
        err = err.__cause__ or err.__context__
    return None
