"""Typed specs: the TOSA catalogue and the aten op entries, parsed and checked.

`load_catalogue` reads opdefs/tosa.yaml (the target ops); `load_opdefs` reads
every other opdefs/*.yaml (one entry per aten overload) and checks each entry
against torch's schema and against the catalogue. Every rule is compiled here,
so a spec that loads is a spec that renders.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.ao.quantization.fx._decomposed  # registers torch.ops.quantized_decomposed
from lark import Tree

from torchtosa import quant  # noqa: F401  registers torch.ops.torchtosa (quantized group ops)

from .rules import DTYPES, TENSOR_DTYPES, Compiler, Scope, compile_expr, compile_message, parse, py_name, strip_parens
from .source import Located, load_yaml

# ---------------------------------------------------------------- helpers


def _where(value: Any, fallback: Located) -> Located:
    return value if isinstance(value, Located) else fallback


def _expect(value: Any, kind: type | tuple[type, ...], what: str, at: Located) -> Any:
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise _where(value, at).error(f"{what} must be a {names.replace('str', 'string').replace('dict', 'mapping')}")
    return value


def _check_keys(entry: dict, allowed: dict[str, str], name: Located) -> None:
    for key in entry:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            raise _where(key, name).error(f"unknown key {key!r} in {name}; {hint}valid keys: {', '.join(allowed)}")


def _key(entry: dict, key: str, fallback: Located) -> Located:
    """The Located text of `key` in `entry` (to point at it), else `fallback`."""
    return next((k for k in entry if k == key and isinstance(k, Located)), fallback)


def _identifier(name: Any, what: str, at: Located) -> str:
    """A name that generated code uses as a Python identifier."""
    name = _expect(name, str, what, at)
    if not str(name).isidentifier() or str(name).startswith("__"):
        raise _where(name, at).error(f"{what} {str(name)!r} must be a plain name (letters, digits, '_')")
    return str(name)


def _rule(value: Any, what: str, at: Located) -> Located:
    """A rule given as a YAML scalar (numbers and booleans are accepted as text)."""
    if isinstance(value, bool | int | float) and not isinstance(value, Located):
        return Located(str(value), at.file, at.line, at.col, at.source_line)
    return _expect(value, str, what, at)


# ---------------------------------------------------------------- TOSA catalogue

ATTR_KINDS = ("i32", "i64", "f32", "bool", "i32_array", "i64_array", "type", "elem", "dense", "str")
CATALOGUE_KEYS = {
    "doc": "what the op computes",
    "operands": "MLIR operands in order: a tensor name, '*name' (variadic), or 'name = expr' (implicit)",
    "attrs": "attribute name: kind, or kind = default",
    "params": "names the emit line passes that only the shape/dtype rules use",
    "broadcast": "true: tensor operands are reshaped to equal rank first",
    "i1": "operands (and 'out') that are i1 in MLIR while bool tensors live as i8",
    "requires": "list of {rule: message} the lowering must satisfy",
    "shape": "result shape rule",
    "dtype": "result dtype rule",
    "layout": "how the op maps under a permutation of its tensors' axes: elementwise, reshape, or a mapping of "
              + ", ".join(f"{k} ({v})" for k, v in {
                  "follow": "the tensor operands laid out as the result; default all",
                  "axis": "an i32 attribute naming an axis",
                  "per_axis": "{operand: its values for a size-1 axis the op leaves alone} of !tosa.shape "
                              "operands holding values per axis",
                  "channels": "a bool attribute under which the last axis must stay last"}.items()),
}
LAYOUT_KEYS = ("follow", "axis", "per_axis", "channels")


@dataclass
class TosaAttr:
    name: str  # the MLIR attribute name
    kind: str
    default: str | None  # compiled Python source

    @property
    def py(self) -> str:
        return py_name(self.name)


@dataclass
class TosaLayout:
    """How an op maps under a permutation of its tensors' axes (the layout optimizer's table).

    `kind` "elementwise": the result and the `follow` operands (MLIR operand indices; None: all)
    share one layout; an `axis` attribute names an axis, each `per_axis` operand (index, neutral)
    is a !tosa.shape of len(neutral) values per axis, `neutral` those of a size-1 axis the op
    leaves alone; with the bool attribute `channels` true, the last axis carries per-element
    parameters and stays last. `kind` "reshape": the axes it merges or splits move together.
    """

    kind: str
    follow: tuple[int, ...] | None = None
    axis: str | None = None
    per_axis: tuple[tuple[int, tuple[int, ...]], ...] = ()
    channels: str | None = None
    where: str = ""


@dataclass
class TosaOp:
    """One target op from opdefs/tosa.yaml."""

    name: str  # e.g. "tosa.transpose"
    where: str
    doc: str
    operands: list[str]  # tensor operands given by the emit line
    variadic: bool
    mlir_operands: list[tuple[str, str | None]]  # (name, implicit source or None)
    attrs: list[TosaAttr]
    params: list[tuple[str, str | None]]  # (name, default source or None)
    broadcast: bool
    i1: list[str]
    requires: list[tuple[str, str, Located]]
    shape: str
    dtype: str
    layout: TosaLayout | None = None

    @property
    def fn(self) -> str:
        return self.name.replace(".", "_")

    def keywords(self) -> dict[str, bool]:
        """Names an emit line may pass in braces, mapped to whether they are required."""
        out = {a.py: a.default is None for a in self.attrs}
        out.update({p: d is None for p, d in self.params})
        return out


def _parse_binding(text: Located, scope: Scope, builders: bool = False) -> tuple[str, str]:
    """`name = expr`: an implicit operand (with operand builders) or a default."""
    tree = parse(text, "binding")
    name, expr = tree.children
    return str(name), strip_parens(Compiler(text, scope, builders).compile(expr))


def load_catalogue(path: Path) -> dict[str, TosaOp]:
    data = load_yaml(path)
    top = Located("", str(path), 1, 1)
    _expect(data, dict, "the TOSA catalogue", top)
    ops: dict[str, TosaOp] = {}
    for name, entry in data.items():
        name = _expect(name, str, "an op name", top)
        if not re.fullmatch(r"[a-z]+\.[a-z_0-9]+", name):
            raise name.error("catalogue op names are dialect.op, e.g. tosa.add")
        _expect(entry, dict, name, name)
        _check_keys(entry, CATALOGUE_KEYS, name)
        for key in ("operands", "shape", "dtype"):
            if key not in entry:
                raise name.error(f"{name} has no '{key}'")
        declared = [_expect(item, str, "an operand", name) for item in
                    _expect(entry["operands"], list, "operands", name)]
        scope = Scope({})
        tensors: list[str] = []
        for item in declared:
            if "=" not in item:
                plain = item.lstrip("*")
                if not plain.isidentifier():
                    raise item.error("an operand is a name, '*name' or 'name = expr'")
                tensors.append(py_name(plain))
                scope.names[plain] = "tensors" if item.startswith("*") else "tensor"
        params = []
        for item in _expect(entry.get("params", []), list, "params", name):
            item = _expect(item, str, "a param", name)
            pname, default = _parse_binding(item, scope) if "=" in item else (str(item).strip(), None)
            if not pname.isidentifier() or pname.startswith("__"):
                raise item.error(f"a param is a plain name or 'name = default', not {str(item)!r}")
            scope.names[pname] = "value"
            params.append((py_name(pname), default))
        attrs = []
        for attr, spec in _expect(entry.get("attrs", {}), dict, "attrs", name).items():
            _identifier(attr, "an attribute", name)
            spec = _expect(spec, str, "an attribute kind", attr)
            kind, default = (_parse_binding(spec, scope) if "=" in spec else (spec.strip(), None))
            if kind not in ATTR_KINDS:
                raise spec.error(f"unknown attribute kind {kind!r}; kinds: {', '.join(ATTR_KINDS)}")
            attrs.append(TosaAttr(str(attr), kind, default))
        scope.names.update({a.name: "value" for a in attrs})
        # implicit operands see every explicit operand, param and attribute
        mlir_operands = [_parse_binding(item, scope, builders=True) if "=" in item
                         else (py_name(item.lstrip("*")), None) for item in declared]
        i1 = [x if x == "out" else py_name(x) for x in map(str, entry.get("i1", []))]
        for x, given in zip(i1, entry.get("i1", []), strict=True):
            if x != "out" and x not in tensors:
                raise _where(given, name).error(f"i1 names an operand or 'out', not {x!r}")
        requires = [(compile_expr(rule, scope), compile_message(msg, scope), rule)
                    for rule, msg in _rule_map_list(entry.get("requires", []), name)]
        ops[str(name)] = TosaOp(
            name=str(name), where=name.where, doc=str(entry.get("doc", "")), operands=tensors,
            variadic=any(item.startswith("*") for item in declared), mlir_operands=mlir_operands,
            attrs=attrs, params=params,
            broadcast=bool(entry.get("broadcast", False)), i1=i1, requires=requires,
            shape=compile_expr(_rule(entry["shape"], "shape", name), scope),
            dtype=compile_expr(_rule(entry["dtype"], "dtype", name), scope),
            layout=_layout(entry["layout"], name, _key(entry, "layout", name), declared, attrs)
            if "layout" in entry else None)
    return ops


def _layout(spec: Any, name: Located, key: Located, declared: list[Located], attrs: list[TosaAttr]) -> TosaLayout:
    """A catalogue op's `layout` (at `key`), its operand and attribute names checked and resolved
    to MLIR operand indices."""
    at = _where(spec, key)
    if not name.startswith("tosa."):
        raise at.error(f"layout is for TOSA ops, not {name}")
    if spec in ("elementwise", "reshape"):
        spec = {} if spec == "elementwise" else spec
    if spec == "reshape":
        if [str(d) for d in declared if "=" not in d] != ["input1"]:
            raise at.error("a reshape layout is for an op of one tensor operand")
        return TosaLayout("reshape", follow=(0,), where=at.where)
    _expect(spec, dict, "layout (elementwise, reshape or a mapping)", at)
    for key in spec:
        if key not in LAYOUT_KEYS:
            raise _where(key, at).error(f"unknown layout key {key!r}; layout keys: {', '.join(LAYOUT_KEYS)}")
    operands = [str(d).split("=")[0].strip().lstrip("*") for d in declared]
    variadic = any(str(d).startswith("*") for d in declared)

    def index(operand: Any, what: str) -> int:
        operand = _expect(operand, str, what, at)
        if str(operand) not in operands:
            raise _where(operand, at).error(
                f"{what} {str(operand)!r} is not an operand of {name} ({', '.join(operands)})")
        return operands.index(str(operand))

    def attribute(attr: Any, kind: str, what: str) -> str:
        attr = _expect(attr, str, what, at)
        found = next((a for a in attrs if a.name == str(attr)), None)
        if found is None or found.kind != kind:
            raise _where(attr, at).error(f"{what} {str(attr)!r} must be a {kind} attribute of {name}")
        return str(attr)

    follow = None
    if "follow" in spec:
        follow = tuple(index(o, "a followed operand") for o in _expect(spec["follow"], list, "follow", at))
        if any("=" in str(declared[i]) for i in follow):
            raise at.error("follow names tensor operands the emit line passes, not implicit ones")
    elif not variadic:
        follow = tuple(i for i, d in enumerate(declared) if "=" not in str(d))
    per_axis = []
    for operand, neutral in _expect(spec.get("per_axis", {}), dict, "per_axis", at).items():
        i = index(operand, "a per-axis operand")
        if "const_shape(" not in str(declared[i]) or not isinstance(neutral, list) or not neutral \
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in neutral):
            raise _where(operand, at).error("per_axis maps a const_shape operand to its values for an axis of "
                                            "size 1 the op leaves alone, e.g. [0, 0]")
        per_axis.append((i, tuple(int(v) for v in neutral)))
    return TosaLayout("elementwise", follow=follow,
                      axis=attribute(spec["axis"], "i32", "the axis attribute") if "axis" in spec else None,
                      per_axis=tuple(per_axis),
                      channels=attribute(spec["channels"], "bool", "the channels attribute") if "channels" in spec
                      else None, where=at.where)


def _rule_map_list(value: Any, at: Located) -> list[tuple[Located, Located]]:
    """`requires`/`limits`: a list of one-key mappings {rule: message}."""
    out = []
    for item in _expect(value, list, "requires/limits", at):
        if not isinstance(item, dict) or len(item) != 1:
            raise _where(item, at).error('each check is a one-key mapping: - "rule": "message"')
        (rule, msg), = item.items()
        out.append((_rule(rule, "a check", at), _expect(msg, str, "a message", _where(rule, at))))
    return out


# ---------------------------------------------------------------- aten op entries

OPDEF_KEYS = {
    "schema": "the op's schema, as torch prints it without its namespace ('aten::')",
    "doc": "a note for readers",
    "registry": "'tosa' (default) or a fallback registry name",
    "let": "mapping name: rule, evaluated in order",
    "requires": "list of {rule: message}: inputs torch rejects too (InvalidInput)",
    "limits": "list of {rule: message}: valid inputs not lowered (Unsupported)",
    "shape": "result shape rule (single result)",
    "dtype": "result dtype rule (single result)",
    "returns": "mapping result name: {shape, dtype} for several results",
    "emit": "lowering lines: name = dialect.op(operands) {attrs} if guard",
    "samples": "list of argument mappings for tests",
    "sample_dtypes": "dtypes that replace 'T' in sample tensors (default [f32])",
    "tolerance": "{rtol, atol} for the numeric tests",
    "oracle": "what f16/bf16 results are checked against: eager (default) or exact (the op on f64, rounded once)",
    "sorted": "tensor arguments torch requires sorted along their last dim: tests sort their data",
    "static": "why the lowering needs static sizes: a reason (every argument), or {argument: reason}",
    "match": "torchtosa ops only: the node groups this op replaces (list of {root, nodes, set})",
}
SAMPLE_KEYS = ("raises", "unsupported", "range", "tolerance")
TENSOR_RE = re.compile(r"(?P<dtype>\w+)\[(?P<dims>[\d,\s]*)\]")


@dataclass
class Arg:
    name: str  # as in the schema
    py: str  # Python identifier in generated code
    type: str  # as torch prints it, e.g. "Tensor", "int[]", "Scalar?"
    kind: str  # rule scope kind: tensor, tensors, scalar
    default: Any  # the schema default as a Python value, or REQUIRED
    annotation: str


REQUIRED = object()


@dataclass
class Check:
    rule: str
    message: str
    where: str


@dataclass
class Line:
    """One compiled emit line."""

    target: str
    op: TosaOp
    args: list[str]  # Python source of operands (with '*' for variadic)
    kwargs: list[tuple[str, str]]
    guard: str | None
    first: str  # first operand source, the value of a guarded line that does not run
    where: str
    text: str
    loop: str | None = None  # "for x in xs" of a list line: the name is a list of tensors


@dataclass
class Result:
    name: str
    shape: str
    dtype: str
    many: bool = False  # a Tensor[] result: `shape` is a list of shapes, the name a list of tensors


@dataclass
class Sample:
    args: dict[str, Any]
    raises: str | None
    unsupported: str | None
    where: str
    dtype: str | None  # the dtype substituted for T, if any
    range: tuple[float, float] | dict[str, tuple[float, float]] | None  # per tensor argument if a dict
    tolerance: dict[str, float] | None


@dataclass
class OpDef:
    """One aten overload's whole story, from one YAML entry."""

    op: str  # "aten.permute.default"
    where: str  # "opdefs/shape.yaml:3"
    family: str
    schema: str
    doc: str
    registry: str
    args: list[Arg]
    lets: list[tuple[str, str, str]]  # (py name, source, where)
    requires: list[Check]
    limits: list[Check]
    results: list[Result]
    lines: list[Line]
    samples: list[Sample] = field(default_factory=list)
    tolerance: dict[str, float] | None = None
    oracle: str = "eager"  # f16/bf16 results against eager, or "exact": the op on f64 rounded once
    sorted: list[str] = field(default_factory=list)  # tensor arguments whose test data is sorted
    # arguments whose sizes must be static, each with the reason; ("*", reason) for every argument
    static: list[tuple[str, str]] = field(default_factory=list)
    patterns: list[Pattern] = field(default_factory=list)

    @property
    def fn(self) -> str:
        return self.op.replace(".", "_")


@dataclass
class Pattern:
    """A group of graph nodes that one call of a torchtosa op replaces (runtime/quant/passes/patterns.py).

    `nodes` maps a node name to (overload, args): each argument is ("node", name) for a
    producer in the group, ("each", name) for a list argument whose every element is such a
    producer (written `[name, ...]`; the op arguments its subtree binds become lists, one value
    per element), ("bind", arg) for an argument of the op, ("any",) or ("lit", value) (a dtype
    literal is ("dtype", name)). `root` is the node whose value the op computes."""

    op: str
    where: str
    root: str
    nodes: dict[str, tuple[str, list[tuple]]]
    fixed: dict[str, Any]


def _load_patterns(value: Any, name: Located, args: list[Arg]) -> list[Pattern]:
    if not str(name).startswith("torchtosa."):
        raise name.error("only torchtosa ops (runtime/quant/) replace node groups with 'match'")
    arg_names = [a.name for a in args]
    out = []
    for item in _expect(value, list, "match", name):
        _expect(item, dict, "a match", name)
        _check_keys(item, {"root": "the node the op's result replaces", "nodes": "name: [overload, args...]",
                           "set": "op arguments fixed for this pattern"}, name)
        at = _where(item.get("root"), name)
        raw = _expect(item.get("nodes"), dict, "match nodes", at)
        nodes: dict[str, tuple[str, list[tuple]]] = {}
        bound: set[str] = set()
        for node, spec in raw.items():
            node = _identifier(node, "a node name", at)
            if node in DTYPES:
                raise _where(node, at).error(f"node name {node!r} is a dtype name; pick another")
            spec = _expect(spec, list, f"node {node}", _where(node, at))
            target = _expect(spec[0] if spec else None, str, "an overload name", _where(node, at))
            # `getitem`: an element of a multi-output op's result (max_pool2d_with_indices, native_layer_norm)
            count = 2 if str(target) == "getitem" else len(_torch_overload(target)._schema.arguments)
            if len(spec) - 1 > count:
                raise target.error(f"{target} takes {count} arguments")
            parsed: list[tuple] = []
            for a in spec[1:]:
                text = str(a) if isinstance(a, str) else None
                if text is not None and text in raw:
                    parsed.append(("node", text))
                elif isinstance(a, list) and a and str(a[-1]) == "...":
                    if len(a) != 2 or str(a[0]) not in raw:
                        raise _where(a[-1], at).error(f"a list pattern is [node, ...] with one node of this match, "
                                                      f"not {[str(x) for x in a]}")
                    parsed.append(("each", str(a[0])))
                elif text is not None and text.startswith("$"):
                    if text[1:] not in arg_names:
                        raise _where(a, at).error(f"{text} is not an argument of {name}: {', '.join(arg_names)}")
                    parsed.append(("bind", text[1:]))
                    bound.add(text[1:])
                elif text == "_":
                    parsed.append(("any",))
                elif text is not None and text in DTYPES:
                    parsed.append(("dtype", text))
                elif text is not None and len(text) >= 2 and text[0] == text[-1] == "'":
                    parsed.append(("lit", text[1:-1]))  # a string the node must hold: 'tanh'
                elif text is not None:
                    raise _where(a, at).error(f"{text!r} is no node of this match, $argument, _, dtype or 'string'")
                else:
                    parsed.append(("lit", a))
            nodes[node] = (str(target), parsed)
        root = _expect(item.get("root"), str, "root", at)
        if root not in nodes:
            raise root.error(f"root {root!r} is not one of the nodes: {', '.join(nodes)}")
        fixed = dict(_expect(item.get("set", {}), dict, "set", at))
        for key in fixed:
            if key not in arg_names:
                raise _where(key, at).error(f"set {key!r}: not an argument of {name}")
        _check_each(nodes, {a.name: a for a in args}, at)
        missing = [a for a in arg_names if a not in bound and a not in fixed]
        if missing:
            raise at.error(f"the match binds no {', '.join(missing)} ($name in a node, or set:)")
        out.append(Pattern(str(name), at.where, str(root), nodes, {str(k): v for k, v in fixed.items()}))
    return out


def _check_each(nodes: dict[str, tuple[str, list[tuple]]], args: dict[str, Arg], at: Located) -> None:
    """The op arguments bound under a `[name, ...]` list pattern take one value per element:
    they must be lists in the op's schema (Tensor[], float[], int[])."""

    def under(name: str) -> set[str]:
        out = {name}
        for a in nodes[name][1]:
            if a[0] in ("node", "each"):
                out |= under(a[1])
        return out

    for _, parsed in nodes.values():
        for a in parsed:
            if a[0] != "each":
                continue
            for n in under(a[1]):
                for b in nodes[n][1]:
                    if b[0] == "bind" and not args[b[1]].type.endswith("[]"):
                        raise at.error(f"${b[1]} is bound once per element of [{a[1]}, ...]: "
                                       f"it must be a list argument, not {args[b[1]].type}")


# Operator namespaces an entry may name: aten, prims (core ATen decompositions leave
# a few prims ops, such as prims.collapse, in graphs) and quantized_decomposed (the
# quantize/dequantize ops of PT2E-quantized graphs; torch registers them on import of
# torch.ao.quantization.fx._decomposed, imported below).
# torchtosa: the group ops of runtime/quant/, which `match` entries put into graphs.
NAMESPACES = ("aten", "prims", "quantized_decomposed", "torchtosa")


def _torch_overload(name: Located) -> Any:
    parts = str(name).split(".")
    if len(parts) != 3 or parts[0] not in NAMESPACES:
        raise name.error("an entry's key is aten.<op>.<overload> (or prims.<op>.<overload>, "
                         "quantized_decomposed.<op>.<overload>), e.g. aten.add.Tensor")
    ns = parts[0]
    # a dunder name (aten.__lshift__) is looked up only if torch registers that op, so that
    # Python's own attributes of the namespace object (__class__, __dict__) are never reached
    registered = not parts[1].startswith("_" * 2) or any(
        n.split(".")[0] == f"{ns}::{parts[1]}" for n in torch._C._dispatch_get_all_op_names())
    packet = getattr(getattr(torch.ops, ns), parts[1], None) if registered else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        names = torch._C._dispatch_get_all_op_names()
        known = {n.split("::", 1)[1].split(".")[0] for n in names if n.startswith(f"{ns}::")}
        near = difflib.get_close_matches(parts[1], known, n=3)
        raise name.error(f"torch has no op {ns}.{parts[1]}" + (f"; did you mean {', '.join(near)}?" if near else ""))
    if parts[2] not in packet.overloads():
        raise name.error(f"{ns}.{parts[1]} has no overload {parts[2]!r}; overloads: {', '.join(packet.overloads())}")
    return getattr(packet, parts[2])


def _schema_text(overload: Any) -> str:
    """The schema as torch prints it, without the namespace ('aten::', 'prims::')."""
    return str(overload._schema).split("::", 1)[1]


def _arg_kind(type_str: str) -> tuple[str, str]:
    base = type_str.rstrip("?")
    if base == "Tensor":
        return "tensor", "Tensor | None" if type_str.endswith("?") else "Tensor"
    if base in ("Tensor[]", "Tensor?[]"):
        return "tensors", "list[Tensor]"
    ints = "list[int]"
    py = {"int": "int", "SymInt": "int", "number": "float", "Scalar": "float", "float": "float", "bool": "bool",
          "int[]": ints, "SymInt[]": ints, "int[1]": ints, "int[2]": ints, "int[3]": ints, "SymInt[1]": ints,
          "SymInt[2]": ints, "SymInt[3]": ints, "ScalarType": "torch.dtype", "str": "str",
          "float[]": "list[float]", "Scalar[]": "list[float]", "bool[]": "list[bool]"}.get(base, "object")
    return "scalar", py + (" | None" if type_str.endswith("?") else "")


def _schema_type(text: str) -> str:
    """A type as schemas spell it (Tensor?, int[], ScalarType?): torch prints argument
    types typing-style (Optional[Tensor], List[int]), and `type` says int for ScalarType."""
    for wrapper, suffix in (("Optional[", "?"), ("List[", "[]")):
        if text.startswith(wrapper) and text.endswith("]"):
            return _schema_type(text[len(wrapper):-1]) + suffix
    return text


def _schema_args(overload: Any) -> list[Arg]:
    out = []
    for a in overload._schema.arguments:
        kind, annotation = _arg_kind(a.real_type.str())
        default = a.default_value if a.has_default_value() else REQUIRED
        out.append(Arg(a.name, py_name(a.name), a.real_type.str(), kind, default, annotation))
    return out


def _parse_emit(text: Located, scope: Scope, catalogue: dict[str, TosaOp], defined: dict[str, str]) -> Line:
    tree = parse(text, "emit_line")
    target, opname, *rest = tree.children
    loop = None
    if tree.data == "emit_list":  # [op(...) {...} if guard for targets in iterable]
        *rest, targets, iterable = rest
        names = [str(t) for t in targets.children]
        for var, vname in zip(targets.children, names, strict=True):
            if vname.startswith("__") or vname in DTYPES or vname in scope.names:
                raise Compiler(text, scope).error(var, f"{vname} cannot be a loop variable here")
        loop = (f"for {', '.join(py_name(n) for n in names)} in "
                f"{strip_parens(Compiler(text, scope).compile(iterable))}")
        scope = scope.child(**dict.fromkeys(names, "value"))
    attrs_tree = next((c for c in rest if isinstance(c, Tree) and c.data == "attrs"), None)
    guard_tree = rest[-1] if rest and rest[-1] is not None and rest[-1] is not attrs_tree else None
    operands = [c for c in rest if c is not None and c is not attrs_tree and c is not guard_tree]
    comp = Compiler(text, scope)
    op = catalogue.get(str(opname))
    if op is None:
        near = [n for n in catalogue if n.split(".")[1].startswith(str(opname).split(".")[-1][:3])]
        hint = f"; did you mean {', '.join(near[:4])}?" if near else "; add it to opdefs/tosa.yaml first"
        raise comp.error(opname, f"{opname} is not in the TOSA catalogue{hint}")
    if str(target) in defined:
        raise comp.error(target, f"{target} is already defined at {defined[str(target)]}; "
                         "each name is assigned once (SSA)")
    if str(target) in scope.names:
        raise comp.error(target, f"{target} shadows an argument or let binding; pick a new name")
    args = []
    for operand in operands:
        star = isinstance(operand, Tree) and operand.data == "star"
        inner = operand.children[0] if star else operand
        if comp.kind(inner) == "scalar":
            raise comp.error(inner.children[0], f"{inner.children[0]} is not a tensor; operands are tensors "
                             "(pass scalars as attributes, or make one with tosa.const)")
        if star and comp.kind(inner) not in ("tensors", "value"):
            raise comp.error(inner.children[0], f"'*' spreads a list of tensors; {inner.children[0]} is a tensor")
        args.append(("*" if star else "") + strip_parens(comp.compile(inner)))
    if not op.variadic and len(args) != len(op.operands):
        raise comp.error(opname, f"{op.name} takes {len(op.operands)} operand(s) "
                         f"({', '.join(op.operands)}), got {len(args)}")
    kwargs = []
    wanted = op.keywords()
    for attr in attrs_tree.children if attrs_tree is not None else []:
        if attr is None:
            continue
        key, value = attr.children
        if str(key) not in wanted:
            raise comp.error(key, f"{op.name} has no attribute or param {str(key)!r}; it takes: "
                             + (", ".join(wanted) or "none"))
        kwargs.append((str(key), strip_parens(comp.compile(value))))
    missing = [k for k, req in wanted.items() if req and k not in dict(kwargs)]
    if missing:
        raise comp.error(opname, f"{op.name} needs {', '.join(missing)} in braces: {{{missing[0]}: ...}}")
    guard = strip_parens(comp.compile(guard_tree)) if guard_tree is not None else None
    if guard is not None and not args:
        raise comp.error(opname, "a guarded line needs an operand: when the guard fails, "
                         "the name takes its first operand's value")
    return Line(py_name(str(target)), op, args, kwargs, guard, args[0].lstrip("*") if args else "",
                text.where, str(text), loop)


def _parse_sample(item: Any, entry: OpDef, at: Located, dtypes: list[str]) -> list[Sample]:
    item = _expect(item, dict, "a sample", at)
    where = _where(next(iter(item), at), at)
    names = {a.name: a for a in entry.args}
    for key in item:
        if key not in names and key not in SAMPLE_KEYS:
            raise _where(key, at).error(f"sample key {key!r} is not an argument of {entry.op}; arguments: "
                                        f"{', '.join(names)}; sample options: {', '.join(SAMPLE_KEYS)}")
    for a in entry.args:
        if a.default is REQUIRED and a.name not in item:
            raise where.error(f"sample misses required argument {a.name!r} of {entry.op}; add {a.name}: <value>")
    uses_t = any("T[" in str(v) for v in item.values())
    out = []
    for dt in (dtypes if uses_t else [None]):
        args = {k: _sample_value(v, names[k], dt, _where(v, where)) for k, v in item.items() if k in names}
        out.append(Sample(args, item.get("raises"), item.get("unsupported"), where.where, dt,
                          _range(item.get("range"), names, where), _tolerance(item.get("tolerance"), where)))
    return out


def _range(value: Any, names: dict[str, Arg], at: Located) -> Any:
    """`range`: [lo, hi] for every tensor's random values, or {argument: [lo, hi]} per tensor
    argument (a quantization scale in [0.01, 0.1], its input in [-4, 4])."""
    if value is None:
        return None
    if isinstance(value, dict):
        for name in value:
            if str(name) not in names or names[str(name)].kind != "tensor":
                raise _where(name, at).error(f"range names Tensor arguments, not {str(name)!r}")
        return {str(k): tuple(_expect(v, list, f"range of {k}", _where(k, at))) for k, v in value.items()}
    return tuple(_expect(value, list, "range", at))


def _sorted_args(value: Any, args: list[Arg], at: Located) -> list[str]:
    """`sorted`: names of Tensor arguments (torch leaves results undefined for unsorted data)."""
    tensors = [a.name for a in args if a.kind == "tensor"]
    for name in _expect(value, list, "sorted", at):
        if name not in tensors:
            raise _where(name, at).error(f"sorted names Tensor arguments ({', '.join(tensors)}), not {str(name)!r}")
    return [str(n) for n in value]


def _static_args(value: Any, args: list[Arg], at: Located) -> list[tuple[str, str]]:
    """`static`: a reason (every argument's sizes must be static) or {argument: reason} (those
    arguments' sizes: tensor dims, ints and int lists)."""
    if value is None:
        return []
    if isinstance(value, str):
        if not value.strip():
            raise _where(value, at).error("static gives the reason the lowering needs static sizes")
        return [("*", " ".join(value.split()))]
    sized = {a.name: a for a in args if a.kind != "scalar" or a.annotation.startswith(("int", "list[int]", "float"))}
    out = []
    for name, reason in _expect(value, dict, "static", at).items():
        if str(name) not in sized:
            raise _where(name, at).error(f"static names arguments with sizes ({', '.join(sized)}), not {str(name)!r}")
        reason = _expect(reason, str, f"the reason {name} must be static", _where(name, at))
        if not reason.strip():
            raise _where(reason, at).error("static gives the reason the lowering needs static sizes")
        out.append((str(name), " ".join(reason.split())))
    return out


ORACLES = ("eager", "exact")


def _oracle(value: Any, at: Located) -> str:
    if value not in ORACLES:
        raise _where(value, at).error(f"oracle {value!r}: one of {', '.join(ORACLES)}")
    return str(value)


def _tolerance(value: Any, at: Located) -> dict[str, float] | None:
    """{rtol, atol} as floats (YAML reads 1e-4 as a string: accept it)."""
    if value is None:
        return None
    value = _expect(value, dict, "tolerance", at)
    if set(value) != {"rtol", "atol"}:
        raise _where(next(iter(value), at), at).error("tolerance is {rtol: x, atol: y}")
    try:
        return {str(k): float(v) for k, v in value.items()}
    except ValueError:
        raise _where(value["rtol"], at).error("tolerance values are numbers, e.g. 1.0e-4") from None


def _sample_value(value: Any, arg: Arg, dt: str | None, at: Located) -> Any:
    if arg.kind == "tensor" and value is not None and not isinstance(value, bool | int | float):
        return _tensor_sample(_expect(value, str, f"sample {arg.name}", at), dt)
    if arg.kind == "tensors":
        items = _expect(value, list, arg.name, at)
        return [None if v is None and arg.type == "Tensor?[]" else
                _tensor_sample(_expect(v, str, f"sample {arg.name}", at), dt) for v in items]
    if arg.type.rstrip("?") == "ScalarType" and value is not None:
        if str(value) not in TENSOR_DTYPES:
            raise at.error(f"a dtype sample is one of {', '.join(TENSOR_DTYPES)}")
        return ("dtype", str(value))
    return value if not isinstance(value, Located) else str(value)


def _tensor_sample(text: Located, dt: str | None) -> tuple[str, str, tuple[int, ...]]:
    m = TENSOR_RE.fullmatch(str(text).strip())
    if not m:
        raise text.error("a tensor sample is written dtype[dims], e.g. f32[2, 3] (T[...] for each sample_dtype)")
    dtype = m["dtype"]
    if dtype == "T":
        dtype = dt or "f32"
    if dtype not in TENSOR_DTYPES:
        raise text.error(f"unknown dtype {dtype!r}; dtypes: {', '.join(TENSOR_DTYPES)}")
    dims = tuple(int(d) for d in m["dims"].replace(" ", "").split(",") if d)
    return ("tensor", dtype, dims)


def load_entry(name: Located, entry: Any, family: str, catalogue: dict[str, TosaOp]) -> OpDef:
    _expect(entry, dict, str(name), name)
    _check_keys(entry, OPDEF_KEYS, name)
    overload = _torch_overload(name)
    schema = _schema_text(overload)
    given = _expect(entry.get("schema"), str, "schema", name) if "schema" in entry else None
    if given is None:
        raise name.error(f"{name} has no schema; write: schema: {schema}")
    if " ".join(given.split()) != schema:
        pairs = enumerate(zip(given, schema, strict=False))
        diff = next((i for i, (a, b) in pairs if a != b), min(len(given), len(schema)))
        raise given.error(f"schema does not match torch's; write: {schema}", diff)
    args = _schema_args(overload)
    scope = Scope({a.name: a.kind for a in args})
    lets = []
    for key, rule in _expect(entry.get("let", {}), dict, "let", name).items():
        _identifier(key, "a let name", name)
        if key in scope.names:
            raise _where(key, name).error(f"let {key!r} shadows an argument or an earlier let; pick a new name")
        rule = _rule(rule, f"let {key}", _where(key, name))
        lets.append((py_name(str(key)), compile_expr(rule, scope), rule.where))
        scope.names[str(key)] = "value"

    def checks(key: str) -> list[Check]:
        return [Check(compile_expr(r, scope), compile_message(m, scope), r.where)
                for r, m in _rule_map_list(entry.get(key, []), name)]

    requires, limits = checks("requires"), checks("limits")
    if "returns" in entry and ("shape" in entry or "dtype" in entry):
        raise name.error("give either shape/dtype (one result) or returns (several), not both")
    if "returns" in entry:
        spec = _expect(entry["returns"], dict, "returns", name)
    else:
        for key in ("shape", "dtype"):
            if key not in entry:
                raise name.error(f"{name} has no '{key}' rule")
        spec = {Located("out", name.file, name.line, name.col): {"shape": entry["shape"], "dtype": entry["dtype"]}}
    results = []
    for rname, rs in spec.items():
        _expect(rs, dict, f"returns.{rname}", _where(rname, name))
        for key in ("shape", "dtype"):
            if key not in rs:
                raise _where(rname, name).error(f"result {rname} has no '{key}' rule")
        results.append(Result(py_name(str(rname)), compile_expr(_rule(rs["shape"], "shape", name), scope),
                              compile_expr(_rule(rs["dtype"], "dtype", name), scope)))
    n_returns = len(overload._schema.returns)
    if [r.type.str() for r in overload._schema.returns] == ["Tensor[]"]:
        results[0].many = True  # one list result: its shape rule gives one shape per tensor
    elif any(r.type.str() != "Tensor" for r in overload._schema.returns):
        raise name.error(f"{name} returns {overload._schema.returns}; only Tensors or one Tensor[] are supported")
    if len(results) != n_returns:
        how = "shape: and dtype:" if n_returns == 1 else f"returns: with {n_returns} results in torch's order"
        at = _key(entry, "returns", _key(entry, "shape", name))
        raise at.error(f"torch's {name} returns {n_returns} value(s); the spec declares {len(results)}: give {how}")
    lines: list[Line] = []
    defined: dict[str, str] = {}
    emit_scope = scope.child()
    for text in _expect(entry.get("emit", []), list, "emit", name):
        line = _parse_emit(_expect(text, str, "an emit line", name), emit_scope, catalogue, defined)
        lines.append(line)
        defined[line.target] = line.where
        emit_scope.names[line.target] = "tensors" if line.loop else "tensor"
    if not lines:
        raise name.error(f"{name} has no emit lines")
    for r in results:
        if r.name not in defined:
            raise _key(entry, "emit", name).error(f"the emit lines never define result {r.name!r}; "
                                                  f"assign it in the last line: {r.name} = tosa.<op>(...)")
        if r.many != (emit_scope.names[r.name] == "tensors"):
            raise _key(entry, "emit", name).error(
                f"result {r.name!r} must be " + ("a list line [tosa.op(...) for ...]" if r.many else
                                                 "a single tensor, not a list line"))
    opdef = OpDef(
        op=str(name), where=name.where, family=family, schema=schema, doc=str(entry.get("doc", "")),
        registry=_identifier(entry.get("registry", "tosa"), "registry", name), args=args, lets=lets, requires=requires,
        limits=limits, results=results, lines=lines, tolerance=_tolerance(entry.get("tolerance"), name),
        oracle=_oracle(entry.get("oracle", "eager"), name),
        sorted=_sorted_args(entry.get("sorted", []), args, name),
        static=_static_args(entry.get("static"), args, name),
        patterns=_load_patterns(entry["match"], name, args) if "match" in entry else [])
    dtypes = _expect(entry.get("sample_dtypes", ["f32"]), list, "sample_dtypes", name)
    for d in dtypes:
        if d not in TENSOR_DTYPES:
            raise _where(d, name).error(f"unknown dtype {str(d)!r}; dtypes: {', '.join(TENSOR_DTYPES)}")
    dtypes = [str(d) for d in dtypes]
    samples = _expect(entry.get("samples", []), list, "samples", name)
    if not samples:
        raise name.error(f"{name} has no samples; every op is tested from its samples")
    for item in samples:
        opdef.samples.extend(_parse_sample(item, opdef, name, dtypes))
    return opdef


def load_opdefs(paths: list[Path], catalogue: dict[str, TosaOp]) -> list[OpDef]:
    """Every aten entry of the given files, in file then entry order."""
    out: list[OpDef] = []
    seen: dict[tuple[str, str], str] = {}
    for path in paths:
        data = load_yaml(path) or {}
        top = Located("", str(path), 1, 1)
        if not path.stem.isidentifier():
            raise top.error(f"a family file is named like a Python module (e.g. shape_ops.yaml), not {path.name!r}")
        for name, entry in _expect(data, dict, path.name, top).items():
            name = _expect(name, str, "an op name", top)
            opdef = load_entry(name, entry, path.stem, catalogue)
            key = (opdef.op, opdef.registry)
            if key in seen:
                raise name.error(f"{opdef.op} already has a {opdef.registry} entry at {seen[key]}")
            seen[key] = opdef.where
            out.append(opdef)
    return out



@dataclass
class EagerReason:
    """An overload with no lowering, and why it runs with PyTorch (opdefs/eager.yaml)."""

    op: str
    reason: str
    where: str


TABLES = ("tosa.yaml", "eager.yaml", "cpus.yaml")  # files of opdefs/ that are not families of entries


def load_eager(path: Path, entries: list[OpDef]) -> list[EagerReason]:
    """`overload: reason` pairs; each overload exists in torch and has no entry."""
    if not path.exists():
        return []
    lowered = {e.op: e.where for e in entries}
    top = Located("", str(path), 1, 1)
    out = []
    for name, reason in _expect(load_yaml(path) or {}, dict, path.name, top).items():
        name = _expect(name, str, "an op name", top)
        _torch_overload(name)
        if str(name) in lowered:
            raise name.error(f"{name} has an entry at {lowered[str(name)]}: it is not left to eager")
        reason = _expect(reason, str, "a reason", name)
        if not reason.strip():
            raise name.error("the reason is empty")
        out.append(EagerReason(str(name), " ".join(reason.split()), name.where))
    return out


def load_specs(opdefs_dir: Path) -> tuple[dict[str, TosaOp], list[OpDef]]:
    """The catalogue (tosa.yaml) and every aten entry of the other files in `opdefs_dir`."""
    catalogue = load_catalogue(opdefs_dir / "tosa.yaml")
    families = sorted(p for p in opdefs_dir.glob("*.yaml") if p.name not in TABLES)
    return catalogue, load_opdefs(families, catalogue)
