"""The rule language: parse with lark, check every name, compile to Python source.

A rule is a side-effect-free Python expression over the op's arguments. Tensors
expose only `.shape`, `.rank` and `.dtype`; calls are limited to the builtins in
`runtime/importer/rules.py`. The compiled source refers to builtins as `R.<name>`, so a
spec can never reach anything else. Nothing is `eval`ed at generation time.
"""

from __future__ import annotations

import inspect
import keyword
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from torchtosa.importer import rules as rule_runtime

from .source import Located, SpecError

TENSOR_ATTRS = ("shape", "rank", "dtype")
DTYPES = ("f16", "bf16", "f32", "f64", "i8", "i16", "i32", "i48", "i64", "u8", "bool")
TENSOR_DTYPES = tuple(d for d in DTYPES if d != "i48")  # i48 (TOSA's int16 accumulator) is no torch dtype
CONSTANTS = {"None": "None", "True": "True", "False": "False", "inf": "R.inf"}

# Python builtins the rule language re-exports (runtime/importer/rules.py): name -> (min, max) arity.
PY_BUILTINS: dict[str, tuple[int, int]] = {
    "len": (1, 1), "range": (1, 3), "min": (1, 2), "max": (1, 2), "abs": (1, 1), "sum": (1, 1),
    "all": (1, 1), "any": (1, 1), "int": (1, 1), "float": (1, 1), "list": (1, 1), "sorted": (1, 1),
    "enumerate": (1, 1), "zip": (2, 3), "reversed": (1, 1),
}


def _rule_functions() -> dict[str, tuple[int, int]]:
    """The functions defined in runtime/importer/rules.py, with their arities: the one list of builtins."""
    out = dict(PY_BUILTINS)
    for name, fn in vars(rule_runtime).items():
        if (inspect.isfunction(fn) and fn.__module__ == rule_runtime.__name__ and not name.startswith("_")
                and name not in PY_BUILTINS):
            params = inspect.signature(fn).parameters.values()
            out[name] = (sum(p.default is p.empty for p in params), len(params))
    return out


BUILTINS = _rule_functions()

COMPARISONS = ("compare", "in_", "not_in")

# Operand constructors, allowed only in the catalogue's implicit operands; they
# compile to Builder methods: name -> arity.
OPERAND_BUILDERS = {"const_shape": 1, "scalar": 2, "zero_point": 1}


@cache
def parser() -> Lark:
    """The rule-language parser (LALR, so a syntax error names the exact column)."""
    grammar = (Path(__file__).parent / "rules.lark").read_text()
    return Lark(grammar, parser="lalr", start=["start", "emit_line", "binding"], propagate_positions=True)


# Names generated code uses itself; spec names equal to one get a trailing '_'.
RESERVED = {"b", "R", "T", "torch", "types", "Builder", "Tensor", "InvalidInput", "Unsupported"}


def py_name(name: str) -> str:
    """A spec name as a Python identifier (aten arguments may be Python keywords)."""
    return name + "_" if keyword.iskeyword(name) or name in RESERVED else name


def parse(text: Located, start: str = "start") -> Tree:
    """Parse one rule, reporting syntax errors at the spec's file:line:col."""
    try:
        return parser().parse(str(text), start=start)
    except UnexpectedInput as err:
        ends = isinstance(err, UnexpectedEOF) or (isinstance(err, UnexpectedToken) and err.token.type == "$END")
        offset = len(str(text)) if ends else err.pos_in_stream or 0
        raise text.error(_syntax_message(err, text, ends), offset) from None


# How an expected token reads in a message.
_TOKEN_WORDS = {"NAME": "a name", "NUMBER": "a number", "STRING": "a string", "OPNAME": "dialect.op",
                "COMPOP": "a comparison", "ADDOP": "'+', '-'", "MULOP": "'*', '/', '//', '%'"}


def _syntax_message(err: UnexpectedInput, text: Located, ends: bool) -> str:
    if ends:
        after = text.source_line[text.col - 1 + len(text):].lstrip()[:1] if text.positions is None else ""
        if after == ",":  # a plain YAML scalar inside [ ] or { } stops at a comma
            return "the rule ends too early; inside YAML [ ] or { }, a comma ends an unquoted value: quote the rule"
        return "the rule ends too early"
    if isinstance(err, UnexpectedCharacters):
        if err.char == "\n":
            return "a rule is one line: use a quoted or plain YAML value (folded lines keep equal indentation)"
        return f"unexpected character {err.char!r}; the rule language is a Python expression subset"
    if isinstance(err, UnexpectedToken):
        terminals = {t.name: t.pattern for t in parser().terminals}
        words = sorted({_TOKEN_WORDS.get(e) or (repr(terminals[e].value) if e in terminals else e)
                        for e in err.expected})
        call = "; only rule builtins are called, by name: len(x)" if err.token.type == "LPAR" else ""
        return f"unexpected {err.token.value!r}{call}; expected one of: {', '.join(words)}"
    return "the rule ends too early"


@dataclass
class Scope:
    """The names a rule may use: kind is 'tensor', 'tensors', 'scalar' or 'value' (unknown)."""

    names: dict[str, str]

    def child(self, **more: str) -> Scope:
        return Scope({**self.names, **more})


class Compiler:
    """Compiles a checked rule tree to Python source."""

    def __init__(self, text: Located, scope: Scope, builders: bool = False):
        self.text, self.scope, self.builders = text, scope, builders

    def error(self, node: Tree | Token, message: str) -> SpecError:
        offset = node.start_pos if isinstance(node, Token) else node.meta.start_pos
        return self.text.error(message, offset or 0)

    def compile(self, node: Tree | Token) -> str:
        return getattr(self, "c_" + node.data)(node)

    def kind(self, node: Tree | Token) -> str:
        """The kind of a name expression, 'value' for anything else."""
        if isinstance(node, Tree) and node.data == "paren":
            return self.kind(node.children[0])
        if isinstance(node, Tree) and node.data == "name":
            return self.scope.names.get(str(node.children[0]), "value")
        return "value"

    def c_number(self, node: Tree) -> str:
        return str(node.children[0])

    def c_string(self, node: Tree) -> str:
        return repr(str(node.children[0])[1:-1])

    def c_name(self, node: Tree) -> str:
        name = str(node.children[0])
        if name.startswith("__"):
            raise self.error(node, f"name {name!r} is not allowed in a rule; rules use the schema's "
                             "arguments, let names, dtypes and the rule builtins")
        if name in self.scope.names:
            return py_name(name)
        if name in DTYPES:
            return f"R.{name}_" if name == "bool" else f"R.{name}"
        if name in CONSTANTS:
            return CONSTANTS[name]
        known = ", ".join(sorted(self.scope.names)) or "none"
        raise self.error(node, f"unknown name {name!r}; names in scope: {known}")

    def c_getattr(self, node: Tree) -> str:
        base, attr = node.children
        if str(attr) not in TENSOR_ATTRS:
            raise self.error(attr, f"attribute {str(attr)!r} is not allowed; tensors expose only "
                             + ", ".join("." + a for a in TENSOR_ATTRS))
        kind = self.kind(base)
        if kind in ("tensors", "scalar"):
            what = "a list of tensors" if kind == "tensors" else "not a tensor"
            raise self.error(attr, f"'.{attr}' needs a tensor; this is {what}")
        return f"{self.compile(base)}.{attr}"

    def c_paren(self, node: Tree) -> str:
        # Kept in the tree so that "(a == b) != c" is not read as the chain "a == b != c";
        # every compound expression compiles to its own parentheses already.
        return self.compile(node.children[0])

    def c_getitem(self, node: Tree) -> str:
        base, index = node.children
        return f"{self.compile(base)}[{self.compile(index)}]"

    def c_slice(self, node: Tree) -> str:
        lo, hi = node.children
        return f"{self.compile(lo) if lo is not None else ''}:{self.compile(hi) if hi is not None else ''}"

    def c_call(self, node: Tree) -> str:
        fn, *args = node.children
        args = [a for a in args if a is not None]
        name = str(fn)
        if self.builders and name in OPERAND_BUILDERS:
            if len(args) != OPERAND_BUILDERS[name]:
                raise self.error(fn, f"{name}() takes {OPERAND_BUILDERS[name]} arguments, got {len(args)}")
            return f"b.{name}({', '.join(self.compile(a) for a in args)})"
        if name not in BUILTINS:
            raise self.error(fn, f"unknown function {name!r}; rule builtins are: {', '.join(sorted(BUILTINS))}")
        lo, hi = BUILTINS[name]
        if not lo <= len(args) <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}"
            raise self.error(fn, f"{name}() takes {want} arguments, got {len(args)}")
        return f"R.{name}({', '.join(self.compile(a) for a in args)})"

    def c_list_(self, node: Tree) -> str:
        return "[" + ", ".join(self.compile(c) for c in node.children if c is not None) + "]"

    def c_tuple_(self, node: Tree) -> str:
        items = [self.compile(c) for c in node.children if c is not None]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"

    def c_listcomp(self, node: Tree) -> str:
        elem, targets, iterable, cond = node.children
        names = [str(t) for t in targets.children]
        for var, name in zip(targets.children, names, strict=True):
            if name.startswith("__") or name in DTYPES or name in BUILTINS:
                raise self.error(var, f"{name} cannot be a loop variable")
        it = self.compile(iterable)
        inner = Compiler(self.text, self.scope.child(**dict.fromkeys(names, "value")), self.builders)
        out = f"[{inner.compile(elem)} for {', '.join(py_name(n) for n in names)} in {it}"
        return out + (f" if {inner.compile(cond)}]" if cond is not None else "]")

    def c_ternary(self, node: Tree) -> str:
        a, cond, b = node.children
        return f"({self.compile(a)} if {self.compile(cond)} else {self.compile(b)})"

    def c_or_(self, node: Tree) -> str:
        return f"({self.compile(node.children[0])} or {self.compile(node.children[1])})"

    def c_and_(self, node: Tree) -> str:
        return f"({self.compile(node.children[0])} and {self.compile(node.children[1])})"

    def c_not_(self, node: Tree) -> str:
        return f"(not {self.compile(node.children[0])})"

    def c_compare(self, node: Tree) -> str:
        return f"({self.chain(node)})"

    def c_in_(self, node: Tree) -> str:
        return f"({self.chain(node)})"

    c_not_in = c_in_

    def chain(self, node: Tree) -> str:
        """A comparison chain, compiled as Python chains it: `0 <= d < n`."""
        left, *rest = node.children
        op = {"in_": "in", "not_in": "not in"}.get(node.data) or str(rest[0])
        right = rest[-1]
        inner = self.chain(left) if isinstance(left, Tree) and left.data in COMPARISONS else self.compile(left)
        return f"{inner} {op} {self.compile(right)}"

    def c_binop(self, node: Tree) -> str:
        a, op, b = node.children
        return f"({self.compile(a)} {op} {self.compile(b)})"

    def c_neg(self, node: Tree) -> str:
        return f"(-{self.compile(node.children[0])})"

    def c_pow(self, node: Tree) -> str:
        return f"({self.compile(node.children[0])} ** {self.compile(node.children[1])})"


def strip_parens(src: str) -> str:
    """Drop one pair of redundant outer parentheses for readable output."""
    if not (src.startswith("(") and src.endswith(")")):
        return src
    depth = 0
    for i, ch in enumerate(src):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and i < len(src) - 1:
            return src
    return src[1:-1]


def compile_expr(text: Located, scope: Scope) -> str:
    """Compile one rule expression to Python source."""
    return strip_parens(Compiler(text, scope).compile(parse(text)))


def compile_message(text: Located, scope: Scope) -> str:
    """Compile a message with `{rule}` holes to a Python `str.format` call."""
    raw = str(text)
    parts, args, i = [], [], 0
    while i < len(raw):
        ch = raw[i]
        if ch == "{":
            end = raw.find("}", i)
            if end < 0:
                raise text.error("unclosed '{' in message", i)
            hole = text.sub(i + 1, end)
            args.append(compile_expr(hole, scope))
            parts.append("{}")
            i = end + 1
        elif ch == "}":
            raise text.error("unmatched '}' in message", i)
        else:
            parts.append(ch)
            i += 1
    fmt = repr("".join(parts))
    return f"{fmt}.format({', '.join(args)})" if args else fmt
