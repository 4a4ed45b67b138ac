"""FX graph → TOSA module: a symbol table over the graph and a registry lookup per node."""

from __future__ import annotations

import dataclasses
import operator
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from mlir import ir
from mlir.dialects import func
from mlir.passmanager import PassManager

from ..capture import symbolic
from ..errors import InvalidInput, LoweringError, TorchTosaError, Unsupported
from ..execute.native import TensorSpec
from ..internal import internal_error
from ..lower import irutil
from ..lower.layout import optimize_layout
from . import target
from .registry import registry
from .support import is_size, schema_arguments, used_results
from .target import Target
from .tosa import Builder, Tensor, storage_layout, tensor_type

_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)

_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)\n\s*(?P<code>.*)')


@dataclass
class Program:
    """A TOSA module for one graph, with the signature of its function."""

    module: ir.Module
    context: ir.Context
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    served: Counter = field(default_factory=Counter)  # (aten op, registry) -> nodes lowered
    name: str = "forward"
    # positions of the graph's placeholders that are the function's arguments (the others are
    # sizes: symbolic ints the native code reads from its tensors' shapes)
    arguments: list[int] = field(default_factory=list)
    # the values each size symbol may take: (low, high or None)
    ranges: dict[Any, tuple[int, int | None]] = field(default_factory=dict)
    # inputs that hold a size symbol's value (rank-0 i64 tensors): input position -> symbol
    scalars: dict[int, Any] = field(default_factory=dict)
    # graph outputs that are sizes, not tensors: (position among the outputs, value)
    sizes: list[tuple[int, Any]] = field(default_factory=list)
    # the TOSA target the module conforms to (validated), or None: the native pipeline's flavour
    # (bools as i8, int64 as i64, fallback dialects)
    target: Target | None = None
    # the names of the function's arguments and results in TOSA files (`input_0`, `output_0`... by default)
    input_names: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    # node groups a pattern fitted (runtime/quant/passes/patterns.py) and the path each took: integer or float
    groups: list[Any] = field(default_factory=list)
    # integer edges of a quantized model under an INT-only target (runtime/quant/passes/edges.py):
    # how each int8 input and output encodes floats (None: a plain tensor)
    input_quantization: list[Any] = field(default_factory=list)
    output_quantization: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.input_names = self.input_names or [f"input_{i}" for i in range(len(self.inputs))]
        self.output_names = self.output_names or [f"output_{i}" for i in range(len(self.outputs))]

    def __str__(self) -> str:
        return str(self.module)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the program as MLIR text (`.mlir`) or a TOSA flatbuffer (`.tosa`); see tosa_files."""
        from ..artifacts.tosa_files import save

        save(self, path)

    def reference(self, *tensors: torch.Tensor, **named: torch.Tensor) -> list[torch.Tensor]:
        """The outputs of TOSA's reference model run on this program; see reference.py."""
        from ..artifacts.reference import run_reference

        return run_reference(self, *tensors, **named)

    def serves(self) -> str:
        """The sizes the program's symbolic dims may take: "s0 >= 2, 2 <= s1 <= 64"."""
        return ", ".join(f"{sym} >= {low}" if high is None else f"{low} <= {sym} <= {high}"
                         for sym, (low, high) in self.ranges.items())

    def report(self) -> str:
        """Which registry lowered each aten op, and how many nodes."""
        rows = [f"{op:40s} {reg:8s} x{n}" for (op, reg), n in sorted(self.served.items())]
        rows += [f"group {g}" for g in self.groups]
        for names, edges in ((self.input_names, self.input_quantization),
                             (self.output_names, self.output_quantization)):
            rows += [f"{name}: {q}" for name, q in zip(names, edges, strict=False) if q is not None]
        return "\n".join(rows)


def user_frame(node: torch.fx.Node) -> tuple[str, int, str] | None:
    """The innermost user source frame of a node: (file, line, code). Frames in torch (the
    Python of `F.rms_norm` or of an `nn.Linear`, which Dynamo traces into) and in torchtosa are
    not the user's, unless every frame is."""
    trace = node.meta.get("stack_trace") or ""
    frames = [m for m in _FRAME.finditer(trace)]
    if not frames:
        return None
    last = next((m for m in reversed(frames) if not m["file"].startswith(_LIBRARIES)), frames[-1])
    return last["file"], int(last["line"]), last["code"].strip()


# Where torch's and torchtosa's own source files are.
_LIBRARIES = tuple(os.path.dirname(m.__file__) + os.sep for m in (torch, sys.modules[__package__.rpartition(".")[0]]))


def where(node: torch.fx.Node) -> str:
    """`file:line` of the user's source for a node, or its graph name."""
    frame = user_frame(node)
    if frame is None:
        return f"graph node {node.name}"
    return f"{frame[0]}:{frame[1]}: {frame[2]}"


def _location(node: torch.fx.Node) -> ir.Location:
    """`node("file":line:0)`; a frozen parameter is named by its module path."""
    frame = user_frame(node)
    inner = ir.Location.file(frame[0], frame[1], 0) if frame else ir.Location.unknown()
    return ir.Location.name(node.meta.get("source_name", node.name), childLoc=inner)


def _spec(val: Any, node: torch.fx.Node) -> TensorSpec:
    if not isinstance(val, torch.Tensor):
        raise Unsupported(f"{node.name} is a {type(val).__name__}, not a tensor ({where(node)})")
    _nonempty(val, node)
    return TensorSpec(tuple(symbolic.size(d) for d in val.shape), val.dtype)


def _nonempty(val: Any, node: torch.fx.Node) -> None:
    """TOSA tensors have at least one element: zero-size values are Unsupported."""
    for v in val if isinstance(val, (list, tuple)) else [val]:
        if _zero_size(v):
            raise Unsupported(f"{node.name} is an empty tensor of shape {list(v.shape)} ({where(node)}); "
                              "TOSA has no zero-size tensors")


def _zero_size(val: Any) -> bool:
    """Whether `val` is a tensor with a dim statically 0."""
    return isinstance(val, torch.Tensor) and any(symbolic.static(d) == 0 for d in val.shape)


def _unused_empty(node: torch.fx.Node) -> bool:
    """A placeholder of a zero-size tensor that nothing reads: TOSA has no type for it."""
    return not node.users and _zero_size(node.meta.get("val"))


def _is_size(val: Any) -> bool:
    """A symbolic or Python scalar value in the graph (a size), not a tensor."""
    return isinstance(val, (*_SYMBOLIC, int, float, bool))


def _with_layout(value: Any, val: Any) -> Any:
    """A node's Tensor with the storage layout PyTorch gives its value `val` (a FakeTensor;
    the real tensor for constants), for ops that read the storage beneath a value."""
    layout = storage_layout(val)
    return dataclasses.replace(value, layout=layout) if isinstance(value, Tensor) and layout is not None else value


def _flat(x: Any) -> Iterator[Any]:
    if isinstance(x, (list, tuple)):
        for y in x:
            yield from _flat(y)
    else:
        yield x


def build_function(name: str, inputs: list[TensorSpec], body: Callable[[list[Tensor]], list[Tensor]]) -> Program:
    """A module with one func.func whose body `body` emits from the arguments' tensors.

    Inside `body`, `symbolic.current()` knows which argument dim each size symbol is."""
    context = irutil.context()
    with context, ir.Location.unknown():
        module = ir.Module.create()
        with ir.InsertionPoint(module.body):
            fn = func.FuncOp(name, ([tensor_type(s.shape, s.dtype) for s in inputs], []))
            fn.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()
            block = fn.add_entry_block()
        with ir.InsertionPoint(block), symbolic.binding(symbolic.Symbols()):
            args = [Tensor(arg, s.shape, s.dtype) for arg, s in zip(block.arguments, inputs, strict=True)]
            results = body(args)
            func.ReturnOp([t.value for t in results])
        outputs = [TensorSpec(tuple(symbolic.size(d) for d in t.shape), t.dtype) for t in results]
        fn.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(
            [tensor_type(s.shape, s.dtype) for s in inputs], [tensor_type(s.shape, s.dtype) for s in outputs]))
        try:
            module.operation.verify()
        except ir.MLIRError as err:
            raise LoweringError(f"the emitted TOSA does not verify: {err}") from None
        _erase_dead_ops(block)
        PassManager.parse("builtin.module(func.func(cse))").run(module.operation)
    return Program(module, context, inputs, outputs, name=name)


def _erase_dead_ops(block: ir.Block) -> None:
    """Drop ops whose results nothing uses (e.g. an unused alpha constant). All emitted
    ops are side-effect free; `canonicalize` would also do this, but TOSA's folders are
    not IEEE-exact (x * 0.0 folds to 0 for x = inf), so it never runs on TOSA here."""
    changed = True
    while changed:
        changed = False
        for op in reversed(list(block.operations)):
            if op.results and all(not list(r.uses) for r in op.results):
                op.erase()
                changed = True


class Importer:
    """Walks an FX graph in order, mapping each node to MLIR values."""

    def __init__(self, gm: torch.fx.GraphModule, name: str):
        self.gm, self.name = gm, name
        self.env: dict[torch.fx.Node, Any] = {}
        self.served: Counter = Counter()
        self.sizes: list[tuple[int, Any]] = []

    def run(self) -> Program:
        nodes = list(self.gm.graph.find_nodes(op="placeholder"))
        # sizes, and unused empty tensors (a cat's dropped operand), are not the function's arguments
        arguments = [i for i, n in enumerate(nodes) if not _is_size(n.meta.get("val")) and not _unused_empty(n)]
        placeholders = [nodes[i] for i in arguments]
        inputs = [_spec(n.meta.get("val"), n) for n in placeholders]
        self.env.update((n, n.meta["val"]) for n in nodes if n not in placeholders)
        # sizes torch.compile passes as ints that no tensor argument has as a dim: passed to
        # the native code as rank-0 i64 tensors
        dims = symbolic.free_symbols([s.shape for s in inputs])
        sizes = {i: symbolic.expr(n.meta["val"]) for i, n in enumerate(nodes)
                 if isinstance(n.meta.get("val"), torch.SymInt)}
        scalars = {i: e for i, e in sizes.items() if isinstance(e, sympy.Symbol) and e not in dims}
        arguments += list(scalars)
        inputs += [TensorSpec((), torch.int64)] * len(scalars)

        def body(args: list[Tensor]) -> list[Tensor]:
            symbols = symbolic.current()
            for n, a in zip(placeholders, args[:len(placeholders)], strict=True):
                val = n.meta.get("val")
                symbols.bind(a.value, val.shape)
                self.env[n] = _with_layout(dataclasses.replace(a, shape=tuple(val.shape)), val)
            for a, symbol in zip(args[len(placeholders):], scalars.values(), strict=True):
                symbols.bind_scalar(a.value, symbol)
            return self.body()

        program = build_function(self.name, inputs, body)
        program.scalars = {len(placeholders) + k: sym for k, sym in enumerate(scalars.values())}
        self.readable_sizes(program)
        program.served = self.served
        program.arguments = arguments
        program.input_names = _names([nodes[i] for i in arguments])
        program.sizes = self.sizes
        program.ranges = _ranges(program.inputs + program.outputs, placeholders)
        return program

    def readable_sizes(self, program: Program) -> None:
        """Unsupported, blaming the node that computes it, if an output's size is not
        computable from the input tensors' dims (the native code reads sizes only there)."""
        sources = symbolic.symbol_sources([s.shape for s in program.inputs], program.scalars)
        outs = [o for o in _flat(self.gm.graph.output_node().args[0]) if isinstance(self.env.get(o), Tensor)]
        for node, spec in zip(outs, program.outputs, strict=True):
            missing = symbolic.free_symbols([spec.shape]) - set(sources)
            if missing:
                err = Unsupported(f"{node.name} ({where(node)}) has sizes {sorted(map(str, missing))} that are not "
                                  "dims of any tensor input, so native code can't read them")
                err.node = node.name
                raise err

    def body(self) -> list[Tensor]:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outs = list(_flat(node.args[0]))
                bad = [o for o in outs if not isinstance(self.env.get(o), Tensor | torch.SymInt | int)]
                if bad:
                    raise Unsupported(f"graph output {bad[0]} is not a tensor")
                self.sizes = [(i, symbolic.size(self.env[o])) for i, o in enumerate(outs)
                              if not isinstance(self.env[o], Tensor)]
                return [self.env[o] for o in outs if isinstance(self.env[o], Tensor)]
            with _location(node):
                try:
                    self.env[node] = _with_layout(self.node(node), node.meta.get("val"))
                except TorchTosaError as err:
                    err.node = node.name  # which node failed: the partitioner then leaves it to eager
                    raise
                except Exception as err:  # torchtosa's own bug (a rule builtin, the builder): still the node's
                    failure = internal_error(err, node=node, stage="import to TOSA")
                    failure.node = node.name
                    raise failure from err
        raise LoweringError("the graph has no output node")

    def node(self, node: torch.fx.Node) -> Any:
        if node.op == "get_attr":
            value = operator.attrgetter(node.target)(self.gm)
            if not isinstance(value, torch.Tensor):
                raise Unsupported(f"attribute {node.target} is a {type(value).__name__}, not a tensor")
            const = Builder(f"constant {node.target}").constant(value, value.dtype, tuple(value.shape))
            return _with_layout(const, node.meta.get("val", value))
        if node.op != "call_function":
            raise Unsupported(f"{node.op} node {node.name} ({where(node)}): only aten graphs are supported")
        if node.target is operator.getitem:
            return self.env[node.args[0]][node.args[1]]
        if is_size(node):
            return node.meta["val"]  # size arithmetic (sym_size, operator.mul...): the rules compute it
        if not isinstance(node.target, torch._ops.OpOverload):
            raise Unsupported(f"{node.target} ({where(node)}) is not an aten op; "
                              "capture with torchtosa.to_tosa to get a core ATen graph")
        return self.call(node)

    def call(self, node: torch.fx.Node) -> Any:
        op = str(node.target)
        _nonempty(used_results(node), node)
        entries = registry().get(op)
        if not entries:
            raise Unsupported(f"{op} ({where(node)}) — no mapping in the tosa registry or any fallback")
        args = self.arguments(node)
        reasons = []
        for entry in entries:
            try:
                results = entry.fn(Builder(entry.where), *args)
            except Unsupported as err:
                reasons.append(f"{entry.registry} ({entry.where}): {err}")
                continue
            except InvalidInput as err:
                raise InvalidInput(f"{op} ({where(node)}): {err}") from None
            except TorchTosaError:
                raise
            self.check(node, results, entry.where)
            self.served[(op, entry.registry)] += 1
            returns = [r.type.str() for r in node.target._schema.returns]
            if returns == ["Tensor[]"]:
                return list(results)  # a list result: its tensors, flat
            return results[0] if len(returns) == 1 else tuple(results)
        raise Unsupported(f"{op} ({where(node)}) — " + "; ".join(reasons))

    def arguments(self, node: torch.fx.Node) -> list[Any]:
        """The node's arguments in schema order, defaults filled, nodes replaced by values."""
        try:
            bound = list(schema_arguments(node))
        except KeyError as missing:
            raise LoweringError(f"{node.target} ({where(node)}) misses argument {missing}") from None
        return [Builder(str(node.target)).argument(self.value(value, node), arg) for value, arg in bound]

    def value(self, value: Any, node: torch.fx.Node) -> Any:
        if isinstance(value, torch.fx.Node):
            if value not in self.env:
                raise Unsupported(f"{node.target} ({where(node)}) uses {value.name}, which has no value")
            return self.env[value]
        if isinstance(value, (list, tuple)):
            return [self.value(v, node) for v in value]
        return value

    def check(self, node: torch.fx.Node, results: list[Tensor], at: str) -> None:
        """The emitted types must be those PyTorch's meta function gave the node."""
        expected = node.meta.get("val")
        vals = list(expected) if isinstance(expected, (list, tuple)) else [expected]
        for i, (t, val) in enumerate(zip(results, vals, strict=False)):
            if isinstance(val, torch.Tensor) and (not symbolic.same_shape(t.shape, tuple(val.shape), guard=True)
                                                  or t.dtype != val.dtype):
                raise LoweringError(f"{at}: {node.target} result {i} is {t.dtype}{list(t.shape)} but PyTorch says "
                                    f"{val.dtype}{list(val.shape)} ({where(node)})")


def _names(placeholders: list[torch.fx.Node]) -> list[str]:
    """The placeholders' names as capture gave them (`x`, `p_fc_weight`), unique."""
    given = [str(n.target) for n in placeholders]
    return given if len(set(given)) == len(given) else [n.name for n in placeholders]


def _ranges(specs: list[TensorSpec], placeholders: list[torch.fx.Node]) -> dict[Any, tuple[int, int | None]]:
    """The range of each size symbol of `specs`, from the graph's ShapeEnv."""
    symbols = symbolic.free_symbols([s.shape for s in specs])
    if not symbols:
        return {}
    shape_env = symbolic.shape_env_of(n.meta["val"] for n in placeholders)
    return {sym: symbolic.value_range(sym, shape_env) for sym in sorted(symbols, key=str)}


def import_graph(gm: torch.fx.GraphModule, name: str = "forward", aim: Target | None = None) -> Program:
    """Translate an aten-level FX graph (with node.meta["val"]) into a TOSA module; for a TOSA
    target `aim`, one that conforms to it (else NotConformant or Unsupported naming the op),
    its layout decided for the whole graph (`lower.layout.optimize_layout`)."""
    if aim is None:
        return Importer(gm, name).run()
    _check_for_target(gm, aim)
    with target.using(aim):
        program = Importer(gm, name).run()
    optimize_layout(program.module)  # NHWC from a CNN's input transpose to its end (lower/layout.py)
    aim.validate(program.module)
    program.target = aim
    return program


def _check_for_target(gm: torch.fx.GraphModule, aim: Target) -> None:
    """Static shapes and dtypes that TOSA has, before any op is lowered."""
    for node in gm.graph.nodes:
        vals = node.meta.get("val")
        for v in vals if isinstance(vals, (list, tuple)) else [vals]:
            if not isinstance(v, torch.Tensor):
                continue
            if not symbolic.is_static(v.shape):
                raise Unsupported(f"{node.name} ({where(node)}) has the symbolic shape {symbolic.show(v.shape)}: "
                                  f"a TOSA target ({aim}) needs static shapes")
            problem = aim.dtype_problem(v.dtype)
            if problem:
                raise Unsupported(f"{node.name} ({where(node)}) is {problem}")
