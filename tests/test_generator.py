"""The generator on good and bad specs.

Every kind of mistake is a SpecError whose message is one header line
`file:line:col: what is wrong; what to write`, the source line, and a caret under
the column; nothing in a spec is ever executed (at load, render, or import and
call of the generated code); the output is deterministic and the repo's
generated files are up to date.

Specs live in temporary opdefs directories: a copy of the real opdefs/tosa.yaml
and one small family file. In the YAML texts below, `‸` marks the character an
error must point at (it is removed before the file is written).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import generator.__main__ as gen_main
import generator.spec
from generator.render import render_catalogue, render_family, render_registry
from generator.source import SpecError
from generator.spec import load_specs
from torchtosa import Unsupported

ROOT = Path(__file__).resolve().parent.parent
MARK = "‸"

GOOD = """\
# A small family: one entry, every section used.
aten.add.Tensor:
  schema: add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor
  doc: a test entry
  let: {dt: "result_type(self, other)"}
  requires: [{"self.rank >= 0": "never fails: rank {self.rank}"}]
  limits:
    - "alpha != 1": "alpha {alpha} is not lowered here"
  shape: broadcast(self.shape, other.shape)
  dtype: dt
  emit:
    - "a = tosa.cast(self) {to: dt} if self.dtype != dt"
    - "c = tosa.cast(other) {to: dt} if other.dtype != dt"
    - "out = tosa.add(a, c)"
  sample_dtypes: [f32, i32]
  samples:
    - {self: "T[3, 4]", other: "T[3, 4]"}
    - {self: "f32[3]", other: 2.5}
    - {self: "f32[3]", other: "f32[3]", alpha: 2, unsupported: "alpha"}
"""


_CATALOGUES: dict[str, Any] = {}


@pytest.fixture(autouse=True)
def _reuse_catalogues(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse each distinct tosa.yaml text once: most tests only change the family file."""
    load = generator.spec.load_catalogue

    def cached(path: Path) -> Any:
        if ROOT in path.resolve().parents:
            return load(path)  # the repo's: its locations matter
        key = path.read_text()
        if key not in _CATALOGUES:
            _CATALOGUES[key] = load(path)
        return _CATALOGUES[key]

    monkeypatch.setattr(generator.spec, "load_catalogue", cached)


@pytest.fixture
def opdefs(tmp_path: Path) -> Path:
    """A temporary opdefs directory holding a copy of the real TOSA catalogue."""
    d = tmp_path / "opdefs"
    d.mkdir()
    shutil.copy(ROOT / "opdefs" / "tosa.yaml", d / "tosa.yaml")
    return d


def edit(old: str | tuple[str, ...], new: str | tuple[str, ...], text: str = GOOD) -> str:
    """GOOD with `old` replaced by `new` (or each of several)."""
    for o, n in zip(*((old, new) if isinstance(old, tuple) else ((old,), (new,))), strict=True):
        assert text.count(o) == 1, f"{o!r} must occur once in the base spec"
        text = text.replace(o, n)
    return text


def write(path: Path, marked: str) -> tuple[int, int]:
    """Write `marked` without its mark; return the mark's 1-based (line, col)."""
    assert marked.count(MARK) == 1
    before = marked[: marked.index(MARK)]
    path.write_text(marked.replace(MARK, ""))
    return before.count("\n") + 1, len(before) - (before.rfind("\n") + 1) + 1


def check_message(message: str, path: Path, line: int, col: int, *hints: str) -> str:
    """One header line at path:line:col, the source line, a caret under col; the header holds `hints`."""
    header, source, caret = message.split("\n")
    assert header.startswith(f"{path}:{line}:{col}: "), message
    assert source == "    " + path.read_text().splitlines()[line - 1], message
    assert caret == "    " + " " * (col - 1) + "^", message
    for hint in hints:
        assert hint in header, f"{hint!r} not in: {header}"
    return header


def spec_error(opdefs: Path, marked: str, *hints: str, file: str = "fam.yaml") -> str:
    path = opdefs / file
    line, col = write(path, marked)
    with pytest.raises(SpecError) as err:
        load_specs(opdefs)
    return check_message(str(err.value), path, line, col, *hints)


# (test id, old text of GOOD, new text with the mark, words the message must hold)
MISTAKES = [
    # YAML itself
    ("yaml-colon-in-value", "  doc: a test entry", "  doc: a test‸: entry", "invalid YAML", "quote a value"),
    ("yaml-unclosed-flow", '    - {self: "f32[3]", other: "f32[3]", alpha: 2, unsupported: "alpha"}',
     '    - ‸{self: "f32[3]", other: "f32[3]", alpha: 2, unsupported: "alpha"', "invalid YAML",
     "'{' at line 19 is never closed"),
    ("yaml-unclosed-quote", 'unsupported: "alpha"}', 'unsupported: ‸"alpha}', "invalid YAML",
     "quote at line 19 is never closed"),
    ("yaml-tab", "  dtype: dt", "‸\tdtype: dt", "invalid YAML", "indent with spaces"),
    ("yaml-python-tag", "  dtype: dt", "  dtype: ‸!!python/object/apply:os.system ['true']",
     "invalid YAML", "could not determine a constructor"),
    ("duplicate-key", "  dtype: dt\n", "  dtype: dt\n  ‸dtype: dt\n", "duplicate key 'dtype'", "first at line 10",
     "give each key once"),
    ("unknown-entry-key", "  dtype: dt", "  ‸dtypes: dt", "unknown key 'dtypes'", "did you mean 'dtype'",
     "valid keys: schema, doc"),
    # the aten overload and its schema
    ("unknown-op", "aten.add.Tensor:", "‸aten.addd.Tensor:", "torch has no op aten.addd", "did you mean add"),
    ("unknown-overload", "aten.add.Tensor:", "‸aten.add.Tensr:", "no overload 'Tensr'", "overloads: Tensor, Scalar"),
    ("not-an-overload-name", "aten.add.Tensor:", "‸add.Tensor:", "aten.<op>.<overload>"),
    ("dunder-op", "aten.add.Tensor:", "‸aten.__class__.default:", "torch has no op aten.__class__"),
    ("unknown-namespace", "aten.add.Tensor:", "‸torch.add.Tensor:", "aten.<op>.<overload>", "prims.<op>"),
    ("unknown-prims-op", "aten.add.Tensor:", "‸prims.colapse.default:", "torch has no op prims.colapse",
     "did you mean collapse"),
    ("schema-mismatch", "Scalar alpha=1", "Scalar alpha=‸2", "schema does not match torch's",
     "write: add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> Tensor"),
    ("schema-missing", "aten.add.Tensor:\n  schema: add.Tensor(Tensor self, Tensor other, *, Scalar alpha=1) -> "
     "Tensor\n", "‸aten.add.Tensor:\n", "has no schema", "write: schema: add.Tensor(Tensor self"),
    # rule syntax, columns in plain, quoted and flow YAML scalars
    ("syntax-plain", "broadcast(self.shape, other.shape)", "broadcast(self.shape,‸, other.shape)",
     "unexpected ','", "expected one of: '(', '-', '[', a name"),
    ("syntax-double-quoted", "  shape: broadcast(self.shape, other.shape)",
     '  shape: "broadcast(self.shape,‸, other.shape)"', "unexpected ','"),
    ("syntax-single-quoted", "  shape: broadcast(self.shape, other.shape)",
     "  shape: 'broadcast(self.shape,‸, other.shape)'", "unexpected ','"),
    ("syntax-ends-early", "  dtype: dt", "  dtype: max(dt, 1‸", "the rule ends too early"),
    ("syntax-flow-comma", '{dt: "result_type(self, other)"}', "{dt: result_type(self‸, other)}",
     "ends too early", "a comma ends an unquoted value: quote the rule"),
    ("syntax-multiline", "  shape: broadcast(self.shape, other.shape)",
     "  shape: >-\n    broadcast(self.shape,‸\n      other.shape)", "a rule is one line"),
    ("lambda", "  dtype: dt", '  dtype: "(lambda‸: 1)()"', "unexpected ':'"),
    ("call-a-result", "  dtype: dt", "  dtype: \"__import__('os').system‸('true')\"", "unexpected '('",
     "only rule builtins are called"),
    # names, attributes, builtins
    ("unknown-name", "broadcast(self.shape, other.shape)", "broadcast(self.shape, ‸zz.shape)",
     "unknown name 'zz'", "names in scope: alpha, dt, other, self"),
    ("unknown-name-double-quoted", '{dt: "result_type(self, other)"}', '{dt: "result_type(self, ‸zz)"}',
     "unknown name 'zz'", "names in scope: alpha, other, self"),
    ("unknown-name-after-escapes", "  shape: broadcast(self.shape, other.shape)",
     '  shape: "broadcast(self.shape, \\"x\\" + ‸zz)"', "unknown name 'zz'"),
    ("unknown-name-after-doubled-quote", "  shape: broadcast(self.shape, other.shape)",
     "  shape: 'broadcast(self.shape, ''x'' + ‸zz)'", "unknown name 'zz'"),
    ("unknown-name-folded-line", "  shape: broadcast(self.shape, other.shape)",
     "  shape: broadcast(self.shape,\n    ‸zz.shape)", "unknown name 'zz'"),
    ("unknown-name-flow-rule", '"self.rank >= 0"', '"self.rank >= ‸zz"', "unknown name 'zz'"),
    ("unknown-name-flow-plain-rule", '[{"self.rank >= 0": "never', '[{self.rank >= ‸zz: "never',
     "unknown name 'zz'"),
    ("unknown-name-message-hole", '"never fails: rank {self.rank}"', '"never fails: rank {‸zz}"',
     "unknown name 'zz'"),
    ("unknown-name-block-rule", '    - "alpha != 1":', "    - alpha != ‸zz:", "unknown name 'zz'"),
    ("attribute-data", "broadcast(self.shape,", "broadcast(self.‸data,", "attribute 'data' is not allowed",
     "tensors expose only .shape, .rank, .dtype"),
    ("attribute-class", "broadcast(self.shape,", "broadcast(self.‸__class__,", "attribute '__class__'"),
    ("attribute-of-attribute", "broadcast(self.shape,", "broadcast(self.shape.‸__len__,", "attribute '__len__'"),
    ("builtin-eval", "  dtype: dt", "  dtype: ‸eval('1')", "unknown function 'eval'", "rule builtins are: abs"),
    ("builtin-import", "  dtype: dt", "  dtype: ‸__import__('os')", "unknown function '__import__'"),
    ("builtin-open", "  dtype: dt", "  dtype: ‸open('/etc/passwd')", "unknown function 'open'"),
    ("builtin-getattr", "  dtype: dt", "  dtype: ‸getattr(self, 'data')", "unknown function 'getattr'"),
    ("builtin-arity", "  dtype: dt", "  dtype: ‸len(dt, dt)", "len() takes 1 arguments, got 2"),
    ("dunder-name", "  dtype: dt", "  dtype: ‸__builtins__", "'__builtins__' is not allowed",
     "rules use the schema's arguments"),
    ("dunder-loop-variable", "  dtype: dt", "  dtype: '[x for ‸__x in self.shape]'",
     "__x cannot be a loop variable"),
    ("let-name-not-identifier", '{dt: "result_type', '{"‸x = 1; y": "1", dt: "result_type',
     "a let name 'x = 1; y' must be a plain name"),
    ("let-shadows", '{dt: "result_type', '{‸self: "1", dt: "result_type', "shadows an argument"),
    ("registry-not-a-name", "  dtype: dt\n", "  dtype: dt\n  registry: '‸tosa\", 1, \"'\n",
     "registry 'tosa\", 1, \"' must be a plain name"),
    # emit lines
    ("emit-unknown-tosa-op", '"out = tosa.add(a, c)"', '"out = ‸tosa.addd(a, c)"',
     "tosa.addd is not in the TOSA catalogue", "did you mean tosa.add"),
    ("emit-operand-count", '"out = tosa.add(a, c)"', '"out = ‸tosa.add(a)"',
     "tosa.add takes 2 operand(s) (input1, input2), got 1"),
    ("emit-unknown-attribute", '"out = tosa.add(a, c)"', '"out = tosa.add(a, c) {‸axis: 1}"',
     "tosa.add has no attribute or param 'axis'", "it takes: none"),
    ("emit-missing-attribute", '"a = tosa.cast(self) {to: dt} if', '"a = ‸tosa.cast(self) if',
     "tosa.cast needs to in braces: {to: ...}"),
    ("emit-ssa", '"c = tosa.cast(other)', '"‸a = tosa.cast(other)', "a is already defined at",
     "fam.yaml:12", "each name is assigned once (SSA)"),
    ("emit-shadows-argument", '"c = tosa.cast(other)', '"‸dt = tosa.cast(other)', "dt shadows an argument"),
    ("emit-result-never-defined", ("  emit:\n", '"out = tosa.add(a, c)"'), ("  ‸emit:\n", '"res = tosa.add(a, c)"'),
     "never define result 'out'", "out = tosa.<op>(...)"),
    ("emit-scalar-operand", '"out = tosa.add(a, c)"', '"out = tosa.add(a, ‸alpha)"', "alpha is not a tensor",
     "make one with tosa.const"),
    ("emit-unknown-name", '"out = tosa.add(a, c)"', '"out = tosa.add(a, ‸d)"', "unknown name 'd'"),
    ("emit-syntax", '"out = tosa.add(a, c)"', '"out = tosa.add(a, c) if‸"', "the rule ends too early"),
    # results
    ("wrong-number-of-returns", "  shape: broadcast(self.shape, other.shape)\n  dtype: dt\n",
     "  ‸returns:\n    out: {shape: self.shape, dtype: dt}\n    out2: {shape: self.shape, dtype: dt}\n",
     "returns 1 value(s); the spec declares 2", "give shape: and dtype:"),
    ("shape-and-returns", ("aten.add.Tensor:", "  dtype: dt\n"),
     ("‸aten.add.Tensor:", "  dtype: dt\n  returns: {out: {shape: self.shape, dtype: dt}}\n"), "either shape/dtype"),
    # samples
    ("sample-unknown-key", 'other: 2.5}', 'other: 2.5, ‸bogus: 1}', "sample key 'bogus'",
     "arguments: self, other, alpha"),
    ("sample-missing-argument", '{self: "f32[3]", other: 2.5}', '{‸self: "f32[3]"}',
     "misses required argument 'other'", "add other: <value>"),
    ("sample-bad-tensor", '{self: "f32[3]", other: 2.5}', '{self: "‸f32[3", other: 2.5}', "dtype[dims]"),
    ("sample-unknown-dtype", '{self: "f32[3]", other: 2.5}', '{self: "‸q32[3]", other: 2.5}',
     "unknown dtype 'q32'"),
    ("sample-code-as-tensor", '{self: "f32[3]", other: 2.5}',
     "{self: \"‸f32[3]; __import__('os')\", other: 2.5}", "dtype[dims]"),
    ("sample-range-not-a-tensor", '{self: "f32[3]", other: 2.5}',
     '{self: "f32[3]", other: 2.5, range: {‸alpha: [0, 1]}}', "range names Tensor arguments, not 'alpha'"),
    ("sample-dtypes-unknown", "sample_dtypes: [f32, i32]", "sample_dtypes: [f32, ‸int]", "unknown dtype 'int'"),
    ("sorted-not-a-tensor", "  sample_dtypes: [f32, i32]\n", "  sorted: [‸alpha]\n  sample_dtypes: [f32, i32]\n",
     "sorted names Tensor arguments (self, other), not 'alpha'"),
    ("static-unknown-argument", "  sample_dtypes: [f32, i32]\n",
     "  static: {‸bogus: why}\n  sample_dtypes: [f32, i32]\n",
     "static names arguments with sizes (self, other, alpha), not 'bogus'"),
]


@pytest.mark.parametrize(("old", "new", "hints"), [(*m[1:3], m[3:]) for m in MISTAKES],
                         ids=[m[0] for m in MISTAKES])
def test_mistake_is_located_and_explained(opdefs: Path, old: Any, new: Any, hints: tuple[str, ...]) -> None:
    spec_error(opdefs, edit(old, new), *hints)


def test_good_spec_loads_and_renders(opdefs: Path) -> None:
    (opdefs / "fam.yaml").write_text(GOOD)
    catalogue, entries = load_specs(opdefs)
    (e,) = entries
    assert (e.op, e.family, e.registry, e.where) == ("aten.add.Tensor", "fam", "tosa", f"{opdefs / 'fam.yaml'}:2")
    assert [a.name for a in e.args] == ["self", "other", "alpha"]
    assert [s.dtype for s in e.samples] == ["f32", "i32", None, None]
    assert e.samples[0].args["self"] == ("tensor", "f32", (3, 4))
    assert e.samples[3].unsupported == "alpha"
    src = render_family(entries, "fam.yaml")
    assert f"# {opdefs / 'fam.yaml'}:14" in src  # each line says where it came from
    fn = load_generated(src, "aten_add_Tensor")
    assert fn(None, Desc((3, 1), torch.int32), Desc((4,), torch.float32), 1) == [((3, 4), torch.float32)]
    with pytest.raises(Exception, match="alpha 2 is not lowered here"):
        fn(None, Desc((3,), torch.float32), Desc((3,), torch.float32), 2)
    # deterministic: loading and rendering again gives the same bytes
    catalogue2, entries2 = load_specs(opdefs)
    assert render_family(entries2, "fam.yaml") == src
    assert render_catalogue(catalogue2, "opdefs/tosa.yaml") == render_catalogue(catalogue, "opdefs/tosa.yaml")
    assert render_registry(entries2, [], "0") == render_registry(entries, [], "0")


def test_static_key_rejects_symbolic_sizes_before_any_rule(opdefs: Path) -> None:
    """`static` names the arguments whose sizes must be static: a symbolic one is Unsupported
    (with the reason and the entry's file:line) before the rules could guard on it."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    static = '  static: {other: "a reason"}\n  sample_dtypes:'
    (opdefs / "fam.yaml").write_text(GOOD.replace("  sample_dtypes:", static))
    _, entries = load_specs(opdefs)
    fn = load_generated(render_family(entries, "fam.yaml"), "aten_add_Tensor")
    assert fn(None, Desc((3,), torch.float32), Desc((3,), torch.float32), 1) == [((3,), torch.float32)]
    env = ShapeEnv()
    s0 = env.create_symintnode(env.create_symbol(5, ConstantSource("n")), hint=5)
    assert fn(None, Desc((s0,), torch.float32), Desc((1,), torch.float32), 1) == [((s0,), torch.float32)]
    with pytest.raises(Unsupported, match=r"aten.add.Tensor needs static sizes \(.*fam.yaml:2\): a reason; other is"):
        fn(None, Desc((3,), torch.float32), Desc((s0,), torch.float32), 1)


PRIMS = """\
prims.collapse.default:
  schema: collapse(Tensor a, int start, int end) -> Tensor
  let: {shp: "list(a.shape[:start]) + [prod(a.shape[start:end + 1])] + list(a.shape[end + 1:])"}
  shape: shp
  dtype: a.dtype
  emit:
    - "out = tosa.reshape(a) {new_shape: shp}"
  samples:
    - {a: "f32[2, 3, 4]", start: 0, end: 1}
"""


def test_prims_entry_loads_and_renders(opdefs: Path) -> None:
    """An entry may name a prims overload: its schema is checked without 'prims::'."""
    (opdefs / "fam.yaml").write_text(PRIMS)
    _, entries = load_specs(opdefs)
    (e,) = entries
    assert (e.op, e.schema, [a.name for a in e.args]) == (
        "prims.collapse.default", "collapse(Tensor a, int start, int end) -> Tensor", ["a", "start", "end"])
    fn = load_generated(render_family(entries, "fam.yaml"), "prims_collapse_default")
    assert fn(None, Desc((2, 3, 4), torch.int32), 0, 1) == [((6, 4), torch.int32)]
    spec_error(opdefs, PRIMS.replace("  schema: collapse(Tensor a", "  schema: col‸apse(Tensor a"),
               "schema does not match torch's", "write: collapse(Tensor a, int start, int end) -> Tensor")


def test_eager_table_names_real_overloads_without_entries(opdefs: Path) -> None:
    """opdefs/eager.yaml: overload -> why it runs with PyTorch; checked against torch and the entries."""
    (opdefs / "fam.yaml").write_text(GOOD)
    _, entries = load_specs(opdefs)
    eager = opdefs / "eager.yaml"
    eager.write_text("aten.nonzero.default: >-\n  data-dependent\n  shape\n")
    (reason,) = generator.spec.load_eager(eager, entries)
    assert (reason.op, reason.reason, reason.where) == ("aten.nonzero.default", "data-dependent shape",
                                                         f"{eager}:1")
    src = render_registry(entries, [reason], "0")
    assert "'aten.nonzero.default': Eager('data-dependent shape', " in src
    for marked, hint in (("‸aten.nonzeroo.default: x\n", "torch has no op aten.nonzeroo"),
                         ("‸aten.add.Tensor: x\n", "has an entry at"),
                         ("‸aten.nonzero.default: [1]\n", "a reason must be a string")):
        line, col = write(eager, marked)
        with pytest.raises(SpecError) as err:
            generator.spec.load_eager(eager, entries)
        check_message(str(err.value), eager, line, col, hint)


DUNDER = """\
aten.__lshift__.Scalar:
  schema: __lshift__.Scalar(Tensor self, Scalar other) -> Tensor
  shape: self.shape
  dtype: self.dtype
  emit:
    - "c = tosa.const() {values: other, dtype: self.dtype}"
    - "out = tosa.logical_left_shift(self, c)"
  samples:
    - {self: "i32[2, 3]", other: 2}
"""


def test_dunder_entry_loads_when_torch_registers_it(opdefs: Path) -> None:
    """aten.__lshift__ (what `x << y` captures as) is a registered op: its entry loads and
    renders; a dunder name torch does not register (__class__) stays an unknown op."""
    (opdefs / "fam.yaml").write_text(DUNDER)
    _, entries = load_specs(opdefs)
    (e,) = entries
    assert (e.op, [a.name for a in e.args]) == ("aten.__lshift__.Scalar", ["self", "other"])
    fn = load_generated(render_family(entries, "fam.yaml"), "aten___lshift___Scalar")
    assert fn(None, Desc((2, 3), torch.int32), 2) == [((2, 3), torch.int32)]
    spec_error(opdefs, DUNDER.replace("aten.__lshift__.Scalar:", "‸aten.__lshift__.Scalr:"),
               "aten.__lshift__ has no overload 'Scalr'", "Scalar")
    spec_error(opdefs, DUNDER.replace("aten.__lshift__.Scalar:", "‸aten.__dict__.Scalar:"),
               "torch has no op aten.__dict__")


def test_family_file_names_are_module_names(opdefs: Path) -> None:
    path = opdefs / "bad-name.yaml"
    path.write_text(GOOD)
    with pytest.raises(SpecError, match=r"bad-name\.yaml:1:1: a family file is named like a Python module"):
        load_specs(opdefs)


def test_catalogue_names_are_checked(opdefs: Path) -> None:
    (opdefs / "fam.yaml").write_text(GOOD)
    tosa = opdefs / "tosa.yaml"
    base = tosa.read_text()
    op = "\ntosa.evil:\n  operands: [input1]\n{}  shape: input1.shape\n  dtype: input1.dtype\n"
    for body, hint in [
        ("  attrs: {\"‸x=__import__('os').system('true')\": i32}\n", "an attribute"),
        ("  params: [\"‸x; import os\"]\n", "a param is a plain name"),
        ("  params: [\"x = __import__('os').system‸('true')\"]\n", "unexpected '('"),
        ("  attrs: {x: ‸float}\n", "unknown attribute kind 'float'"),
        ("  i1: [‸nothing]\n", "i1 names an operand"),
        ("  layout: {follow: [‸nothing]}\n", "'nothing' is not an operand of tosa.evil"),
        ("  layout: {‸axes: [0]}\n", "unknown layout key 'axes'"),
        ("  layout: {axis: ‸nothing}\n", "must be a i32 attribute of tosa.evil"),
    ]:
        line, col = write(tosa, base + op.format(body))
        with pytest.raises(SpecError) as err:
            load_specs(opdefs)
        check_message(str(err.value), tosa, line, col, hint)


# ------------------------------------------------------------ nothing in a spec runs


class Desc:
    """What a rule sees of a tensor."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, wrapped: bool = False):
        self.shape, self.dtype, self.rank, self.wrapped = shape, dtype, len(shape), wrapped


def load_generated(src: str, name: str) -> Any:
    """Execute rendered code as a module of torchtosa._generated; return one function."""
    namespace = {"__name__": "torchtosa._generated._test", "__package__": "torchtosa._generated"}
    exec(compile(src, "<generated>", "exec"), namespace)
    return namespace[name]


SMUGGLE = "__import__('os').system('touch {x}')"


# (old text of GOOD, new text with {s} for the smuggled call, None if the spec loads else the error)
SMUGGLED = [
    ("  dtype: dt", '  dtype: "{s}"', "unexpected '\\('"),
    ('{dt: "result_type(self, other)"}', '{{dt: "{s}"}}', "unexpected '\\('"),
    ('"self.rank >= 0"', '"{s}"', "unexpected '\\('"),
    ('"never fails: rank {self.rank}"', '"x {{{s}}}"', "unexpected '\\('"),
    ('"out = tosa.add(a, c)"', '"out = tosa.add(a, c) if {s}"', "unexpected '\\('"),
    ('"out = tosa.add(a, c)"', '"out = tosa.add(a, c) {{values: {s}}}"', "unexpected '\\('"),
    ('{dt: "result_type', '{{"x = {s}; y": "1", dt: "result_type', "must be a plain name"),
    ("  dtype: dt\n", "  dtype: dt\n  registry: \"tosa', {s}, '\"\n", "must be a plain name"),
    ("  dtype: dt\n", '  dtype: dt\n  registry: "tosa\\", {s}, \\""\n', "must be a plain name"),
    ('{self: "f32[3]", other: 2.5}', '{{self: "{s}", other: 2.5}}', "dtype\\[dims\\]"),
    ("  dtype: dt", "  dtype: !!python/object/apply:os.system ['touch {x}']", "could not determine a constructor"),
    # free text lands in generated docstrings: it must stay text
    ("  doc: a test entry", '  doc: "x\\"\\"\\"; {s}; \\"\\"\\""', None),
    ("  doc: a test entry", '  doc: |\n    x\n    """\n    {s}\n    """', None),
    ("  doc: a test entry", '  doc: "x\\\\"', None),
]


@pytest.mark.parametrize(("old", "new", "rejected"), SMUGGLED, ids=[f"smuggle{i}" for i in range(len(SMUGGLED))])
def test_specs_never_execute_anything(opdefs: Path, tmp_path: Path, old: str, new: str, rejected: str | None) -> None:
    """Load, render, import the generated module and call the lowering: no spec text runs."""
    x = tmp_path / "X"
    smuggled = SMUGGLE.format(x=x)
    (opdefs / "fam.yaml").write_text(edit(old, new.format(s=smuggled, x=x)))
    if rejected is not None:
        with pytest.raises(SpecError, match=rejected):
            load_specs(opdefs)
        assert not x.exists()
        return
    _, entries = load_specs(opdefs)
    fn = load_generated(render_family(entries, "fam.yaml"), "aten_add_Tensor")
    fn(None, Desc((3,), torch.float32), Desc((3,), torch.float32), 1)
    assert not x.exists()
    assert entries[0].doc.strip() in fn.__doc__.replace("\n    ", "\n")  # the doc is the docstring's text


def test_catalogue_doc_never_executes(opdefs: Path, tmp_path: Path) -> None:
    x = tmp_path / "X"
    tosa = opdefs / "tosa.yaml"
    tosa.write_text(tosa.read_text() + f'\ntosa.evil:\n  doc: |\n    a"""; {SMUGGLE.format(x=x)}; """\n'
                    "  operands: [input1]\n  shape: input1.shape\n  dtype: input1.dtype\n")
    catalogue, _ = load_specs(opdefs)
    fn = load_generated(render_catalogue(catalogue, "opdefs/tosa.yaml"), "tosa_evil")
    with pytest.raises(AttributeError):  # runs the function body up to b.create (b is None here)
        fn(None, Desc((3,), torch.float32))
    assert not x.exists()
    assert SMUGGLE.format(x=x) in fn.__doc__


# ------------------------------------------------------------ the repo's own specs


def test_repo_generated_files_are_fresh_and_deterministic() -> None:
    first = gen_main.outputs()
    assert gen_main.outputs() == first  # rendering twice gives identical text
    stale = [str(p.relative_to(ROOT)) for p, text in first.items() if not p.exists() or p.read_text() != text]
    assert not stale, f"run `make gen`: {stale}"


def test_generator_check_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m generator --check`, in this process (a fresh interpreter spends ~10 s importing torch)."""
    assert gen_main.main(["--check"]) == 0
    assert capsys.readouterr().err == ""


def test_make_gen_prints_one_header_line_source_and_caret(opdefs: Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    line, col = write(opdefs / "fam.yaml", edit("broadcast(self.shape,", "broadcast(self.‸data,"))
    monkeypatch.setattr(gen_main, "ROOT", opdefs.parent)
    assert gen_main.main([]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 3, err
    assert lines[0].startswith(f"error: {opdefs / 'fam.yaml'}:{line}:{col}: attribute 'data' is not allowed")
    assert lines[1] == "    " + (opdefs / "fam.yaml").read_text().splitlines()[line - 1]
    assert lines[2].index("^") == 4 + col - 1
    assert lines[1][lines[2].index("^"):].startswith("data")


# ------------------------------------------------------------ list lines and Tensor[] results

SPLIT = """\
aten.split_with_sizes.default:
  schema: split_with_sizes(Tensor(a -> *) self, SymInt[] split_sizes, int dim=0) -> Tensor(a)[]
  let:
    starts: "[sum(split_sizes[:i]) for i in range(len(split_sizes))]"
    tail: "list(self.shape[1:])"
  shape: "[[s] + tail for s in split_sizes]"
  dtype: self.dtype
  emit:
    - "c = [tosa.cast(t) {to: f32} if t.dtype != f32 for t in [self, self]]"
    - "out = [tosa.slice(self) {start: [st] + [0] * len(tail), size: [s] + tail} for st, s in zip(starts, split_sizes)]"
  samples:
    - {self: "f32[6, 4]", split_sizes: [2, 4]}
"""


def test_list_lines_and_list_results_render(opdefs: Path) -> None:
    (opdefs / "fam.yaml").write_text(SPLIT)
    _, entries = load_specs(opdefs)
    (e,) = entries
    assert e.results[0].many and e.lines[1].loop == "for st, s in R.zip(starts, split_sizes)"
    src = render_family(entries, "fam.yaml")
    assert "c = [T.tosa_cast(b, t, to=R.f32) if t.dtype != R.f32 else t for t in [self, self]]" in src
    fn = load_generated(src, "aten_split_with_sizes_default")
    assert fn(None, Desc((6, 4), torch.float16), [2, 4], 0) == [((2, 4), torch.float16), ((4, 4), torch.float16)]


@pytest.mark.parametrize(("old", "new", "hints"), [
    ('    - "out = [tosa.slice', '    - "out = [tosa.slice(self) {start: [0, 0], size: [6, 4]} for ‸self in [1]]"\n'
     '    - "unused = [tosa.slice', "self cannot be a loop variable here"),
], ids=["list-loop-shadows-argument"])
def test_list_line_mistakes(opdefs: Path, old: str, new: str, hints: str) -> None:
    spec_error(opdefs, edit(old, new, SPLIT), hints)


def test_list_result_must_be_a_list_line(opdefs: Path) -> None:
    text = SPLIT.replace('    - "out = [tosa.slice', '    - "out = tosa.identity(self)"\n    - "unused = [tosa.slice')
    (opdefs / "fam.yaml").write_text(text)
    with pytest.raises(SpecError, match="result 'out' must be a list line"):
        load_specs(opdefs)


@pytest.mark.parametrize(("rule", "expected"), [
    ("(x == y) != z", "(x == y) != z"),  # a comparison of comparisons, not the chain x == y != z
    ("x == y != z", "x == y != z"),
    ("(x) + (y)", "x + y"),
])
def test_parentheses_group_comparisons(rule: str, expected: str) -> None:
    from generator.rules import Scope, compile_expr
    from generator.source import Located
    assert compile_expr(Located(rule, "x.yaml", 1, 1), Scope({"x": "value", "y": "value", "z": "value"})) == expected


# the qlinear entry of opdefs/quantize_int.yaml
QUANT_INT = (ROOT / "opdefs" / "quantize_int.yaml").read_text().split("\ntorchtosa.qconv2d.default:")[0]


def test_match_patterns_load_and_render(opdefs: Path) -> None:
    """A torchtosa entry's `match`: node trees rendered into the registry's PATTERNS."""
    (opdefs / "fam.yaml").write_text(QUANT_INT)
    _, entries = load_specs(opdefs)
    patterns = [(p.op, p.root, sorted(p.nodes), p.fixed) for e in entries for p in e.patterns]
    assert patterns[1] == ("torchtosa.qlinear.default", "q", ["mm", "q", "r", "w", "wt", "x"],
                           {"min_val": 0.0, "max_val": None})
    assert len(patterns) == 12 and patterns[0][3] == {"min_val": None, "max_val": None}
    assert patterns[2][3] == {} and entries[0].patterns[2].nodes["r"][1][2] == ("bind", "max_val")  # hardtanh
    q = entries[0].patterns[1].nodes["q"]
    assert q == ("quantized_decomposed.quantize_per_tensor.default",
                 [("node", "r"), ("bind", "output_scale"), ("bind", "output_zero_point"), ("bind", "quant_min"),
                  ("bind", "quant_max"), ("bind", "dtype")])
    assert "PATTERNS: list[Pattern] = [" in render_registry(entries, [], "0")


@pytest.mark.parametrize(("old", "new", "hint"), [
    ("$output_scale, $output_zero_point, $quant_min, $quant_max, $dtype]\n        r:",
     "‸$output_scal, $output_zero_point, $quant_min, $quant_max, $dtype]\n        r:",
     "$output_scal is not an argument"),
    ("[aten.relu.default, mm]", "[aten.relu.default, ‸nm]", "'nm' is no node of this match"),
    ("[aten.relu.default, mm]", "[‸aten.relu.defaults, mm]", "has no overload"),
])
def test_match_mistakes_are_located(opdefs: Path, old: str, new: str, hint: str) -> None:
    spec_error(opdefs, QUANT_INT.replace(old, new, 1), hint)  # in the first pattern


def test_match_must_bind_every_argument_and_name_a_torchtosa_op(opdefs: Path) -> None:
    relu = "    - root: q\n      set: {min_val: 0.0, max_val: null}"
    spec_error(opdefs, QUANT_INT.replace(relu, "    - root: ‸q", 1), "the match binds no min_val, max_val")
    aten = GOOD.replace("  doc: a test entry", "  doc: a test entry\n  match: []")
    with pytest.raises(SpecError, match="only torchtosa ops"):
        (opdefs / "fam.yaml").write_text(aten)
        load_specs(opdefs)
