"""AOTAutograd's results kept across processes for `torch.compile(backend="torchtosa")`.

In a second process torch.compile still runs TorchDynamo (its guards pick the graph a call takes)
and then AOTAutograd (functionalization, decompositions, partitioning) before the disk cache
(execute/disk_cache.py) hands back compiled code: on a 16-layer Llama's first `generate`,
AOTAutograd was two fifths of the second process. PyTorch's AOTAutogradCache keeps AOTAutograd's
result (the graphs, the metadata its runtime wrappers need, the guards on symbolic sizes), keyed
by Dynamo's graph and its example inputs; Inductor uses it with its own compiled code. The
backend uses its bundled form: what it returns for a graph is a `GraphCode`, an `OutputCode`
that pickles to the aten graph (torch.fx's GraphPickler: fake tensors and symbolic sizes
included) and the function that compiles it; loaded, it compiles the graph as a first process
would, its native code then coming from the disk cache.

torchtosa's fingerprint (its sources, torch's and LLVM's versions) and the backend's options
join the key through `torch.compiler.config.cache_key_tag` (PyTorch's own tag for that), so an
entry serves only the torchtosa and the options that made it. Entries live in PyTorch's cache
folder (TORCHINDUCTOR_CACHE_DIR, `aotautograd/`), written atomically by PyTorch. TORCHTOSA_CACHE=0
turns it off, as does `torch.compiler.config.force_disable_caches`; a Dynamo graph holding a
tensor of its own is not kept (`enabled`).

Dynamo's own work is skipped in a second process only by PyTorch's caching precompile
(`TORCH_CACHING_PRECOMPILE=1` and `torch.compiler.save_cache_artifacts()`, experimental in torch
2.13), which keeps Dynamo's bytecode and guards with these bundled entries; the backend works
with it as it is (an encoder layer's second process 3.9 -> 0.3 s), and a loaded graph compiles
with the torchtosa at hand, under the first process's backend options. torchtosa does not turn
it on or save for the user: in torch 2.13 a recompile after such a load fails ("Name
'__builtins_dict___0' already exists in scope", Inductor's too), and so does loading a
transformers model's `forward` (a guard on a decorator's closure).
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache
from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler
from torch._guards import detect_fake_mode
from torch._inductor.output_code import OutputCode
from torch.fx._graph_pickler import GraphPickler, Options

from ..execute import disk_cache
from ..options import Options as BackendOptions

__all__ = ["GraphCode", "compiler", "enabled", "tagged"]

# what the backend reads of a node's meta (its value, the user's source line, names), all a cached
# graph keeps of it
KEPT_META = frozenset({"val", "tensor_meta", "stack_trace", "source_name", "user_input"})
_PICKLED = Options(ops_filter=None, node_metadata_key_filter=KEPT_META.__contains__)
Build = Callable[[fx.GraphModule], Callable[[list[Any]], Any]]  # the backend's compile of one graph


def enabled(gm: fx.GraphModule) -> bool:
    """Whether the graphs AOTAutograd makes of Dynamo's graph `gm` are kept: the disk cache is on
    and `gm` holds no tensor of its own (a `get_attr`: AOTAutogradCache's key has only the sizes
    and dtype of such a tensor, not its values, which the kept graph would keep)."""
    return disk_cache.folder() is not None and not any(
        isinstance(operator.attrgetter(n.target)(gm), torch.Tensor) for n in gm.graph.find_nodes(op="get_attr"))


@dataclasses.dataclass
class GraphCode(OutputCode):
    """One graph as the backend compiled it: `build(gm)`'s boxed callable, and, for the cache,
    `gm` as it was before `build` changed it."""

    _build: Build | None = None
    _graph: bytes | None = None
    _run: Callable[[list[Any]], Any] | None = None
    _unpicklable: str = ""

    def __init__(self, build: Build, gm: fx.GraphModule) -> None:
        super().__init__()
        self._build = build
        start = time.time_ns()
        try:
            self._graph = GraphPickler.dumps(gm, _PICKLED)
        except Exception as e:  # anything the pickler can't take: the graph runs, uncached
            self._graph, self._unpicklable = None, f"torchtosa could not pickle the graph: {e}"
        self._run = build(gm)
        self._boxed_call = True
        self._time_taken_ns = time.time_ns() - start  # AOTAutograd reports the time a hit saved

    def __call__(self, inputs: Sequence[Any]) -> Any:
        if self._run is None:
            raise RuntimeError("GraphCode called before post_compile loaded its graph")
        return self._run(inputs)  # type: ignore[arg-type]

    def prepare_for_serialization(self) -> None:
        if self._graph is None:
            raise BypassAOTAutogradCache(self._unpicklable)  # AOTAutogradCache saves nothing
        self._run = None  # the graph's pickle and `build` remain

    def post_compile(self, example_inputs: Sequence[Any], constants: Any, graph_kwargs: Any) -> None:
        if self._run is not None:
            return
        fake_mode = detect_fake_mode(example_inputs)
        if fake_mode is None or self._graph is None or self._build is None:
            raise RuntimeError("a cached torchtosa graph needs its fake inputs to load")
        gm = GraphPickler.loads(self._graph, fake_mode)
        assert isinstance(gm, fx.GraphModule)
        gm.recompile()
        self._run = self._build(gm)

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass


def compiler(build: Build) -> SerializableAOTDispatchCompiler:
    """An AOTAutograd compiler returning `GraphCode(build, gm)`: one AOTAutogradCache keeps."""
    return SerializableAOTDispatchCompiler(GraphCode, lambda gm, _args: GraphCode(build, gm))


@contextlib.contextmanager
def tagged(options: BackendOptions) -> Iterator[None]:
    """AOTAutograd's cache in its bundled form, its keys tagged with torchtosa's fingerprint and
    `options`, for the calls inside."""
    tag = f"torchtosa:{disk_cache.fingerprint()}:{options!r}"
    # a backward graph handed over at once (its native code still compiles on its first call):
    # AOTAutograd saves an entry when both graphs are there, and a lazy backward's would be
    # saved outside this context, unbundled
    bundled = {"bundled_autograd_cache": True, "force_non_lazy_backward_lowering": True}
    with torch._functorch.config.patch(bundled), torch.compiler.config.patch(cache_key_tag=tag):
        yield
