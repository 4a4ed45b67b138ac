"""TORCHTOSA_DEBUG=<directory>: every compile writes what it saw and made, in folders named by keys.

Each graph a compile lowers (torch.compile hands over one per graph break, a training step a
forward and a backward) gets a folder `graph-<key>`, its key the graph's code and input specs:

    graph-<key>/graph.py     the aten-level FX graph, as Python (TorchDynamo + AOTAutograd's capture)
    graph-<key>/repro.py     the graph as a module that runs: eagerly and through torchtosa.compile,
                             on random inputs of its shapes, compared (`python repro.py`)
    graph-<key>/explain.txt  what runs where (`explain()`): native regions, eager ops and why
    graph-<key>/graph.html   the graph, each node coloured by its native region or as eager, the
                             reason and source line on hover, each region linked to its folder

Each native region's compile gets a folder `<key>`, its key what decides the code (the TOSA
module, the input and output specs, the optimization level and the CPU table's entry), so the
same compile always writes to the same folder:

    <key>/graph.py          the region's FX graph
    <key>/tosa.mlir         the TOSA module imported from it
    <key>/NN-<stage>.mlir   the module after each stage of the pass pipeline (lower/pipeline.py)
    <key>/kernel.ll         the LLVM IR compiled to native code
    <key>/compile.txt       the options, the signature and the seconds each step took
"""

from __future__ import annotations

import hashlib
import html
import operator
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from .cpu import Cpu
    from .execute.native import TensorSpec
    from .importer.graph import Program
    from .regions import Explanation

ENV = "TORCHTOSA_DEBUG"
_DTYPES = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
           torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
           torch.bool: "bool"}


def key(*parts: object) -> str:
    """A compile's key: 16 hex digits of the SHA-256 of its parts' text."""
    return hashlib.sha256("\0".join(map(str, parts)).encode()).hexdigest()[:16]


class Artifacts:
    """The folder one compile writes to."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.stages = 0
        self.log: list[str] = []

    def write(self, name: str, text: str) -> None:
        (self.folder / name).write_text(text)

    def stage(self, name: str, seconds: float, module: object) -> None:
        """After a pipeline stage: the module's text, and the time the stage took."""
        self.stages += 1
        self.write(f"{self.stages:02d}-{re.sub(r'[^A-Za-z0-9_-]+', '-', name)}.mlir", str(module))
        self.note(f"{name}: {seconds:.3f} s")

    def note(self, line: str) -> None:
        self.log.append(line)
        self.write("compile.txt", "\n".join(self.log) + "\n")


def signature(specs: Sequence[TensorSpec]) -> str:
    """Tensor specs as `f32[2, 16], i64[?]`."""
    return ", ".join(f"{_DTYPES.get(s.dtype, str(s.dtype))}[{', '.join(map(str, s.shape))}]" for s in specs)


def region_key(program: Program, opt: str, cpu: Cpu) -> str:
    """The folder name of a native region's compile."""
    return key(str(program.module), tuple(program.inputs), tuple(program.outputs), opt, cpu)


def artifacts(program: Program, opt: str, cpu: Cpu) -> Artifacts | None:
    """The folder of a native region's compile, created, if TORCHTOSA_DEBUG is set."""
    root = os.environ.get(ENV)
    if not root:
        return None
    folder = Path(root) / region_key(program, opt, cpu)
    folder.mkdir(parents=True, exist_ok=True)
    return Artifacts(folder)


def write_graph(gm: fx.GraphModule, explanation: Explanation, opt: str, cpu: Cpu, label: str = "") -> Path | None:
    """If TORCHTOSA_DEBUG is set: the folder `graph-<key>` of a graph a compile lowered, with its
    code, a runnable repro, `explain()` and a coloured picture of its regions."""
    root = os.environ.get(ENV)
    if not root:
        return None
    placeholders = [_spec(n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder")]
    folder = Path(root) / f"graph-{key(gm.code, placeholders)}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "graph.py").write_text(gm.code)
    (folder / "repro.py").write_text(_repro(gm, label))
    constants = {n.target: operator.attrgetter(n.target)(gm) for n in gm.graph.find_nodes(op="get_attr")}
    if constants:
        torch.save(constants, folder / "constants.pt")
    (folder / "explain.txt").write_text(f"{label or 'graph'}\n{explanation}\n")
    (folder / "graph.html").write_text(_picture(gm, explanation, opt, cpu, label))
    return folder



def _hint(size: Any) -> int:
    """A size's value in the example the graph was captured with."""
    return int(size.node.hint) if isinstance(size, torch.SymInt) and size.node.hint is not None else int(size)


def _spec(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        return f"{_DTYPES.get(val.dtype, str(val.dtype))}[{', '.join(map(str, val.shape))}]"
    return type(val).__name__ if not isinstance(val, torch.SymInt | int) else "int"


def _example(val: Any) -> str:
    """Python building a random value like `val` (a tensor of its shape and dtype, an int)."""
    if isinstance(val, torch.SymInt | int) and not isinstance(val, bool):
        return str(_hint(val))
    if not isinstance(val, torch.Tensor):
        return repr(val)
    shape = [_hint(d) for d in val.shape]
    if val.dtype.is_floating_point or val.dtype.is_complex:
        return f"torch.randn({shape}, generator=g, dtype={val.dtype})"
    if val.dtype == torch.bool:
        return f"torch.randint(0, 2, {shape}, generator=g).bool()"
    return f"torch.randint(0, 4, {shape}, generator=g, dtype={val.dtype})"  # small: indices stay in range


def _repro(gm: fx.GraphModule, label: str) -> str:
    # the class is named as FX named the graph's: AOTAutograd's graphs are "<lambda>"
    code = re.sub(r"^class [^\n]*?\(torch\.nn\.Module\):", "class Graph(torch.nn.Module):",
                  gm.print_readable(print_output=False, include_stride=False, include_device=False),
                  count=1, flags=re.M)
    inputs = ",\n        ".join(_example(n.meta.get("val")) for n in gm.graph.find_nodes(op="placeholder"))
    return f'''"""A graph torchtosa compiled{f" ({label})" if label else ""}, as a module: `python repro.py` runs it
eagerly and through torchtosa.compile on random inputs of its shapes (integers in [0, 4)) and
compares them. Written by TORCHTOSA_DEBUG (runtime/debug.py); edit the inputs at will."""

import os
from math import inf, nan  # noqa: F401 (the graph's code may name infinities and NaNs)

import torch
from torch import device  # noqa: F401 (the graph's code may name devices)

import torchtosa

{code}

def inputs() -> list:
    g = torch.Generator().manual_seed(0)
    return [
        {inputs}
    ]


if __name__ == "__main__":
    module = Graph()
    here = os.path.dirname(os.path.abspath(__file__))
    if os.path.exists(os.path.join(here, "constants.pt")):  # the graph's own tensors (get_attr)
        for target, value in torch.load(os.path.join(here, "constants.pt")).items():
            *path, last = target.split(".")
            owner = module
            for part in path:
                owner = getattr(owner, part)
            setattr(owner, last, value)
    args = inputs()
    with torch.no_grad():
        want = module(*args)
        got = torchtosa.compile(module, *args)(*args)
    for w, r in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got), strict=True):
        if isinstance(w, torch.Tensor):
            print("max |torchtosa - eager|:", (r.double() - w.double()).abs().max().item() if w.numel() else 0.0)
'''


_COLOURS = ("#cfe8fc", "#d4f4dd", "#fff1c1", "#e8dcfa", "#d0f0f0", "#fde2c8", "#e2e8c0", "#f8d7ea")
_EAGER = "#f9c9c3"


def _picture(gm: fx.GraphModule, explanation: Explanation, opt: str, cpu: Cpu, label: str) -> str:
    """An HTML page of the graph: a box per node in graph order, coloured by its native region
    (each region in the legend, linked to its compile's folder) or red for an eager op."""
    from .regions import EagerOp, NativeRegion

    colour: dict[str, tuple[str, str]] = {}  # node -> (colour, hover text)
    legend = []
    regions = [p for p in explanation.parts if isinstance(p, NativeRegion)]
    for i, region in enumerate(regions):
        c = _COLOURS[i % len(_COLOURS)]
        folder = region_key(region.program, opt, cpu)
        legend.append(f'<li><span class="box" style="background:{c}">{html.escape(region.name)}</span> '
                      f'{sum(region.ops.values())} ops, native: <a href="../{folder}/tosa.mlir">TOSA</a>, '
                      f'<a href="../{folder}/compile.txt">compile</a>, '
                      f'<a href="../{folder}/kernel.ll">LLVM IR</a></li>')
        colour.update((n, (c, f"{region.name} (native)")) for n in region.nodes)
    eager = [p for p in explanation.parts if isinstance(p, EagerOp)]
    if eager:
        legend.append(f'<li><span class="box" style="background:{_EAGER}">eager</span> {len(eager)} ops run by '
                      "PyTorch (hover for why)</li>")
    colour.update((e.node, (_EAGER, f"eager: {e.reason} — at {e.where}")) for e in eager)
    rows = []
    for node in gm.graph.nodes:
        if node.target is operator.getitem:  # where its producer runs
            colour[node.name] = colour.get(node.args[0].name, ("#eeeeee", node.op))
        c, why = colour.get(node.name, ("#eeeeee", node.op))
        val = node.meta.get("val")
        spec = f" : {_spec(val)}" if isinstance(val, torch.Tensor) else ""
        if node.op == "call_function":
            args = ", ".join(str(a) for a in node.args)
            text = f"{node.name} = {getattr(node.target, '__name__', node.target)}({args}){spec}"
        else:
            text = f"{node.op} {node.name}{spec}" if node.op != "output" else f"return {node.args[0]}"
        rows.append(f'<div class="node" style="background:{c}" title="{html.escape(why)}">{html.escape(text)}</div>')
    title = html.escape(f"torchtosa: {label or 'graph'}")
    summary = html.escape(f"{explanation.native_ops} ops native in {len(regions)} regions, {len(eager)} eager")
    return "\n".join([
        "<!doctype html>", '<html><head><meta charset="utf-8">', f"<title>{title}</title>",
        "<style>body{font:13px monospace;margin:1em}.node{padding:2px 6px;margin:1px 0;white-space:pre;"
        "border-radius:3px}.box{padding:1px 6px;border-radius:3px}li{margin:2px 0}</style></head><body>",
        f"<h2>{title}</h2><p>{summary}; native code for {html.escape(explanation.cpu or cpu.describe())}</p>",
        f"<ul>{''.join(legend)}</ul>", *rows, "</body></html>", ""])
