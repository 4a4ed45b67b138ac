"""`make bench`: time torchtosa's native code against eager PyTorch, Inductor and (if installed) IREE.

Workloads (float32, random weights and inputs, eval mode, under torch.no_grad):
an MLP, a torch.nn TransformerEncoderLayer, a conv block, a 1024^3 matmul, a small
`transformers` BertModel, and `transformers` ResNetModel (ResNet-50) and MobileNetV2Model (1.0)
on 224x224 images at batch 1 and 8, ConvNeXt-T and ViT-B/16 (197 tokens) at batch 1, two
r3d_18 blocks (3-D convolutions, 128 channels, 8x28x28) and one decoding step's linear of a
~0.25B Llama (1x1024 -> 2816, memory bound) (all built from configs: nothing is downloaded; the
CNNs' BatchNorms get random running statistics and affine parameters, as the conv block's).

Backends:
- torchtosa opt="default" (one thread), opt="parallel" (large matmuls' column panels on OpenMP
  threads, one per core: 2 here; after each of its batches the bench pauses until its idle
  workers stop spinning, KMP_BLOCKTIME, so that they take no core from the next backend) and
  opt="none" (the reference lowering to plain loops). By default the reference is timed only on
  the workloads marked `reference=True` below: all but the 1024^3 matmul, where one reference
  call takes several seconds, and the 224x224 CNNs (each workload's reference compiled in under
  10 s on a 2-core EPYC); `--reference` times it on every workload.
- eager PyTorch with 1 and with 2 intra-op threads (torch.set_num_threads around its batches);
- torch.compile with Inductor, compiled and run with 1 thread (fresh cache dir: a cold compile
  unless --warm; torchtosa's disk cache is fresh too);
- IREE (llvm-cpu, local-sync: 1 thread) if `iree-base-compiler` and `iree-base-runtime` are
  installed (optional: `.venv/bin/pip install -e ".[iree]"`; else the header says "not
  installed"). It gets the TOSA module torchtosa imports (generic op form, so the two MLIR
  versions agree on the syntax); where IREE's TOSA validation rejects it, it gets that module
  lowered to linalg by MLIR's standard tosa-to-linalg passes. iree-compile runs as a subprocess:
  its MLIR Python bindings cannot be loaded next to ours.

Timing is interleaved: after every backend of a workload is compiled and warmed up, the timing
batches go round-robin across the backends (the order rotating each round), so drift in machine
load hits all of them alike. A batch is enough calls to last about 50 ms; each backend gets
`--repeats` batches (fewer, at least 3, for one so slow that they would take over a minute; the
224x224 CNNs at most `Workload.repeats`).
Reported per call: the median, and the spread as the interquartile range in
% of the median. GF/s counts FLOPs with torch.utils.flop_counter on the eager model (matmuls,
linears, convolutions and attention; elementwise ops are not counted). Compile time includes the
first call. "peak RSS" is how much the process's peak resident memory rose while compiling and
making the first call (VmHWM, reset through /proc/self/clear_refs).

The header gives one core's f32 FMA peak (`scripts/peak.py`), the ceiling of any one-thread GF/s.

Then (unless --no-int8) an int8 table: the MLP and the conv block quantized with PT2E (torchao,
torchtosa's TosaQuantizer), frozen to integer TOSA and run natively (one and two threads), against
torchtosa's float32 compile, eager float32 and PyTorch running the quantized model.

Then (unless --no-training) a training table: a step (forward, backward, eager SGD update) of the
MLP, the conv block with batch norm and two encoder layers in train mode, through torch.compile with
torchtosa's backend and with Inductor, against eager; one thread. And (unless --no-cache) compile
time of the small workloads, ResNet-50 and MobileNetV2 in a first process and a second one sharing
the on-disk caches, torchtosa's and Inductor's (through torchtosa.compile, and for the encoder
layer, BERT and the tiny models' first generate through torch.compile).

Then (unless --no-dynamic) a dynamic-shape table: for the MLP, the encoder layer and BERT, one
torch.compile(dynamic=True) with the torchtosa backend (opt "default", one thread, and
"parallel") serving 3 sizes, against torchtosa compiled for each size, eager (one thread) and
Inductor with dynamic=True; the notes say how many graphs each compiled and what ran eagerly.

Then (unless --only or --no-decode) greedy decoding of a ~0.25B Llama with a static KV cache, float32
and bfloat16, per token against eager, Inductor and the memory-bandwidth bound (`decode_section`;
--decode-only: that table alone).

Then (unless --only or --no-scaling) a further table: torchtosa's compile time, split into capture,
import and lowering + JIT, for BertModel of 1, 2, 4, 8 and 12 layers, to show how it grows with depth
(--scaling-only: that table alone; --no-outline: with every layer traced, to compare).

Prints the tables and writes them to docs/benchmarks.md (unless --no-write). Nothing here asserts on
time: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import copy
import datetime
import gc
import importlib.metadata
import importlib.util
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
os.environ["HF_HUB_OFFLINE"] = "1"  # never download: BERT is built from a config
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count  # noqa: E402

import torchtosa  # noqa: E402
from torchtosa.capture.trace import capture  # noqa: E402
from torchtosa.cpu import select  # noqa: E402
from torchtosa.execute.native import NativeFunction  # noqa: E402
from torchtosa.importer.graph import import_graph  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peak import fma_peak_gflops  # noqa: E402

Inputs = tuple[Any, ...]
# What limits eager's kernels to an ISA, as on an AVX2 host (PyTorch, oneDNN, MKL): `make bench` under
# them and TORCHTOSA_CPU=x86-64-v3 compares what an AVX2 machine would run.
EAGER_ISA_LIMITS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
BATCH_S = 0.05  # target duration of one timing batch
BACKEND_S = 60.0  # a backend slower than BACKEND_S / repeats per call gets fewer batches (at least 3)
OPENMP_SETTLE_S = 0.25  # libiomp5 workers spin KMP_BLOCKTIME (200 ms by default) once idle
REFERENCE = "torchtosa none"
EAGER = "eager 1t"


# ---------------------------------------------------------------- workloads


class MatMul(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.mm(a, b)


def build_mlp() -> tuple[nn.Module, Inputs]:
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 512))
    return model, (torch.randn(64, 512),)


def build_encoder() -> tuple[nn.Module, Inputs]:
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    return layer, (torch.randn(4, 64, 256),)


def build_conv() -> tuple[nn.Module, Inputs]:
    model = nn.Sequential(
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
    )
    bn = model[1]
    with torch.no_grad():  # eval BatchNorm with non-trivial running statistics and affine parameters
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 1.5)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    return model, (torch.randn(1, 16, 56, 56),)


def build_matmul() -> tuple[nn.Module, Inputs]:
    return MatMul(), (torch.randn(1024, 1024), torch.randn(1024, 1024))


def build_bert(layers: int = 2) -> tuple[nn.Module, Inputs]:
    # As tests/test_models.py: random weights from a config object, the hub switched off above.
    from transformers import BertConfig, BertModel

    vocab, seq = 1000, 64
    config = BertConfig(vocab_size=vocab, hidden_size=256, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=1024, max_position_embeddings=128)
    ids = torch.randint(1, vocab, (1, seq))
    mask = torch.ones(1, seq, dtype=torch.long)  # a tokenizer's mask for an unpadded sequence
    return BertModel(config), (ids, mask)


def _randomize_bn(model: nn.Module) -> nn.Module:
    """Non-trivial running statistics and affine parameters, so eval BatchNorm is not the identity."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
    return model


def build_resnet50(batch: int) -> tuple[nn.Module, Inputs]:
    # ResNetConfig's defaults are ResNet-50 (bottleneck layers, depths 3-4-6-3, widths 256-2048)
    from transformers import ResNetConfig, ResNetModel

    return _randomize_bn(ResNetModel(ResNetConfig())), (torch.randn(batch, 3, 224, 224),)


def build_mobilenet_v2(batch: int) -> tuple[nn.Module, Inputs]:
    # MobileNetV2Config's defaults are MobileNetV2 1.0 at 224x224
    from transformers import MobileNetV2Config, MobileNetV2Model

    return _randomize_bn(MobileNetV2Model(MobileNetV2Config())), (torch.randn(batch, 3, 224, 224),)


def build_convnext_tiny(batch: int) -> tuple[nn.Module, Inputs]:
    # ConvNextConfig's defaults are ConvNeXt-T (depths 3-3-9-3, widths 96-768, 7x7 depthwise convs)
    from transformers import ConvNextConfig, ConvNextModel

    return ConvNextModel(ConvNextConfig()), (torch.randn(batch, 3, 224, 224),)


def build_vit_b16() -> tuple[nn.Module, Inputs]:
    # ViTConfig's defaults are ViT-B/16 at 224x224 (12 layers, 12 heads of 64, 197 tokens): attention
    # over more tokens than the encoder layer's and BERT's 64
    from transformers import ViTConfig, ViTModel

    return ViTModel(ViTConfig(), add_pooling_layer=False), (torch.randn(1, 3, 224, 224),)


class _Block3d(nn.Module):
    """r3d_18's basic block: two 3x3x3 convolutions with batch norm, a residual connection."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm3d(channels),
                                  nn.ReLU(), nn.Conv3d(channels, channels, 3, padding=1, bias=False),
                                  nn.BatchNorm3d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + x)


def build_r3d_block() -> tuple[nn.Module, Inputs]:
    # r3d_18's second stage at its real size: 128 channels, 8 frames of 28x28 (a 16x112x112 clip)
    model = nn.Sequential(_Block3d(128), _Block3d(128))
    return _randomize_bn(model), (torch.randn(1, 128, 8, 28, 28),)


def build_llama_prefill_bf16() -> tuple[nn.Module, Inputs]:
    # the decoding table's Llama (DECODE_CONFIG) cut to 4 layers, in bfloat16: a 32-token prompt
    # without a KV cache (the products AMX tiles and vdpbf16ps take where the CPU has them)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{**DECODE_CONFIG, "num_hidden_layers": 4}, use_cache=False)
    return LlamaForCausalLM(config).to(torch.bfloat16), (torch.randint(1, DECODE_CONFIG["vocab_size"], (1, 32)),)


def build_decode_linear() -> tuple[nn.Module, Inputs]:
    # one decoding step of a ~0.25B Llama's MLP up-projection: one token, 1024 -> 2816, no bias
    return nn.Linear(1024, 2816, bias=False), (torch.randn(1, 1024),)


# ---------------------------------------------------------------- dynamic shapes

# Per workload of the dynamic section: the model and its inputs at each size (the MLP's batch,
# the encoder layer's and BERT's sequence length), built with the same weights.
DYNAMIC_SIZES = {
    "mlp": (20, 64, 100),
    "encoder layer": (33, 64, 100),
    "BERT": (33, 64, 100),
}


def dynamic_inputs(name: str, n: int) -> Inputs:
    if name == "mlp":
        return (torch.randn(n, 512),)
    if name == "encoder layer":
        return (torch.randn(4, n, 256),)
    return (torch.randint(1, 1000, (1, n)), torch.ones(1, n, dtype=torch.long))


DYNAMIC_BUILD = {"mlp": build_mlp, "encoder layer": build_encoder, "BERT": build_bert}


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], tuple[nn.Module, Inputs]]
    reference: bool  # time torchtosa opt="none" by default (else only with --reference)
    repeats: int | None = None  # at most this many timing batches per backend (slow workloads)


WORKLOADS = [
    Workload("mlp 512-2048-512 [64x512]", build_mlp, reference=True),
    Workload("encoder layer d256 h4 ff1024 [4x64x256]", build_encoder, reference=True),
    Workload("conv block 16-32-32 [1x16x56x56]", build_conv, reference=True),
    Workload("matmul 1024^3", build_matmul, reference=False),
    Workload("BERT 2 layers h256 [1x64 tokens]", build_bert, reference=True),
    Workload("ResNet-50 [1x3x224x224]", lambda: build_resnet50(1), reference=False, repeats=10),
    Workload("ResNet-50 [8x3x224x224]", lambda: build_resnet50(8), reference=False, repeats=5),
    Workload("MobileNetV2 [1x3x224x224]", lambda: build_mobilenet_v2(1), reference=False, repeats=10),
    Workload("MobileNetV2 [8x3x224x224]", lambda: build_mobilenet_v2(8), reference=False, repeats=5),
    Workload("ConvNeXt-T [1x3x224x224]", lambda: build_convnext_tiny(1), reference=False, repeats=10),
    Workload("ViT-B/16 [1x3x224x224]", build_vit_b16, reference=False, repeats=10),
    Workload("r3d_18 stage 2 blocks [1x128x8x28x28]", build_r3d_block, reference=False, repeats=10),
    Workload("Llama 4 layers h1024 bf16 [1x32 tokens]", build_llama_prefill_bf16, reference=False, repeats=10),
    Workload("decode linear 1x1024 -> 2816", build_decode_linear, reference=False),
]


def count_flops(model: nn.Module, inputs: Inputs) -> int:
    """FLOPs of one eager call. The encoder layer's fused fast path is switched off (it hides its
    matmuls from the counter); CPU attention's op is counted with torch's own SDPA formula."""

    def sdpa_cpu(query: Any, key: Any, value: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
        return sdpa_flop_count(query, key, value)

    mapping = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: sdpa_cpu}
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=mapping) as counter:
            model(*inputs)
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    return counter.get_total_flops()


# ---------------------------------------------------------------- IREE (optional)


def iree_version() -> str | None:
    """The installed IREE version, or None unless both the compiler and the runtime are importable."""
    try:
        if importlib.util.find_spec("iree.compiler") is None or importlib.util.find_spec("iree.runtime") is None:
            return None
        return importlib.metadata.version("iree-base-compiler")
    except (ImportError, ValueError, importlib.metadata.PackageNotFoundError):
        return None


# MLIR's standard TOSA -> linalg passes, for when IREE's TOSA validation rejects the module.
_TOSA_TO_LINALG = ("builtin.module(func.func(tosa-optional-decompositions,tosa-infer-shapes,"
                   "tosa-make-broadcastable,tosa-to-scf,tosa-to-linalg-named,tosa-to-linalg,"
                   "tosa-to-arith{include-apply-rescale=true},tosa-to-tensor))")


def _iree_compile(source: str, input_type: str, out: Path) -> str | None:
    """Compile MLIR text to a .vmfb with the iree-compile executable; the error text, or None."""
    spec = importlib.util.find_spec("iree.compiler")
    assert spec and spec.submodule_search_locations
    exe = Path(spec.submodule_search_locations[0]) / "_mlir_libs" / "iree-compile"
    cmd = [str(exe), "-", f"--iree-input-type={input_type}", "--iree-hal-target-device=local",
           "--iree-hal-local-target-device-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host", "-o", str(out)]
    proc = subprocess.run(cmd, input=source.encode(), capture_output=True, check=False)
    if proc.returncode == 0:
        return None
    errors = [line for line in proc.stderr.decode().splitlines() if "error:" in line]
    return (errors or proc.stderr.decode().splitlines() or ["iree-compile failed"])[0]


def make_iree(model: nn.Module, inputs: Inputs, notes: list[str]) -> Callable[..., Any]:
    """Compile the model's TOSA with IREE; a function of the inputs returning its flat outputs."""
    import iree.runtime as iree_rt
    from mlir import ir as mlir_ir
    from mlir.passmanager import PassManager

    captured = capture(model, inputs, {})
    program = import_graph(captured.gm)
    with tempfile.TemporaryDirectory(prefix="torchtosa-bench-iree-") as tmp:
        vmfb = Path(tmp) / "module.vmfb"
        error = _iree_compile(program.module.operation.get_asm(print_generic_op_form=True), "tosa", vmfb)
        if error is not None:
            linalg = mlir_ir.Module.parse(str(program.module), context=program.context)
            PassManager.parse(_TOSA_TO_LINALG, context=program.context).run(linalg.operation)
            second = _iree_compile(linalg.operation.get_asm(print_generic_op_form=True), "none", vmfb)
            if second is not None:
                raise RuntimeError(f"iree-compile: {error}; after tosa-to-linalg: {second}")
            notes.append("IREE rejected the TOSA (" + error.split("error:", 1)[-1].strip()[:60] +
                         "...); it compiled MLIR's tosa-to-linalg output")
        flatbuffer = vmfb.read_bytes()
    config = iree_rt.Config("local-sync")
    context = iree_rt.SystemContext(config=config)
    context.add_vm_module(iree_rt.VmModule.copy_buffer(context.instance, flatbuffer))
    function = context.modules.module[program.name]
    device = config.device
    params = [iree_rt.asdevicearray(device, _numpy(p)) for p in captured.params]

    def call(*args: Any) -> list[np.ndarray]:
        flat = [x for x in pytree.tree_leaves((args, {})) if isinstance(x, torch.Tensor)]
        out = function(*params, *[iree_rt.asdevicearray(device, _numpy(x)) for x in flat])
        return [np.asarray(o.to_host()) for o in (out if isinstance(out, (tuple, list)) else [out])]

    return call


# ---------------------------------------------------------------- memory


def _status(key: str) -> int:
    """A /proc/self/status field in KiB."""
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{key}:\s+(\d+)", text, re.M)[1])


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


# ---------------------------------------------------------------- measuring


@dataclass
class Backend:
    name: str
    threads: int
    make: Callable[[], Callable[..., Any]]  # compiles; the result is called with the inputs
    compiles: bool = True
    settle_s: float = 0.0  # pause after each of its batches (idle threads of its own that spin)
    fn: Callable[..., Any] | None = None
    compile_s: float | None = None
    peak_rss_mib: float | None = None
    diff: float | None = None
    number: int = 1  # calls per timing batch
    repeats: int = 0  # timing batches
    samples: list[float] = field(default_factory=list)  # seconds per call, one per batch
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    @property
    def iqr_pct(self) -> float | None:
        if len(self.samples) < 2:
            return None
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return 100 * (q3 - q1) / statistics.median(self.samples)


def _numpy(x: torch.Tensor) -> np.ndarray:
    """`x` as a numpy array; bfloat16, which numpy lacks, as ml_dtypes' (IREE's runtime depends on it)."""
    x = x.detach().contiguous()
    if x.dtype == torch.bfloat16:
        import ml_dtypes

        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def _leaves(out: Any) -> list[np.ndarray]:
    """The output's tensors as arrays to compare (bfloat16 widened to float32, exactly)."""
    return [(x.detach().float() if x.dtype == torch.bfloat16 else x.detach()).numpy() if isinstance(x, torch.Tensor)
            else np.asarray(x) for x in pytree.tree_leaves(out) if isinstance(x, (torch.Tensor, np.ndarray))]


def max_diff(got: Any, want: Any) -> float:
    """Largest |got - want| over corresponding floating-point output tensors."""
    pairs = [(g, w) for g, w in zip(_leaves(got), _leaves(want), strict=False)
             if np.issubdtype(w.dtype, np.floating)]
    if not pairs:
        raise ValueError("no floating-point output to compare")
    return max(float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64)))) for g, w in pairs)


def _error(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0][:200] if text else ''}"


def prepare(backend: Backend, inputs: Inputs, expected: Any, warmup: int, repeats: int) -> None:
    """Compile (+ first call, timed together), check against eager, warm up, size the timing batch."""
    torch.set_num_threads(backend.threads)
    gc.collect()
    can_peak = _reset_peak()
    before = _status("VmRSS")
    try:
        start = time.perf_counter()
        fn = backend.make()
        out = fn(*inputs)  # torch.compile compiles on the first call: count it as compile time
        elapsed = time.perf_counter() - start
        if can_peak:
            backend.peak_rss_mib = (_status("VmHWM") - before) / 1024
        backend.compile_s = elapsed if backend.compiles else None
        backend.diff = max_diff(out, expected)
        start = time.perf_counter()
        for _ in range(warmup):
            fn(*inputs)
            if time.perf_counter() - start > BACKEND_S / 10:  # enough warming for a slow backend
                break
        start = time.perf_counter()
        fn(*inputs)
        one = max(time.perf_counter() - start, 1e-7)
        backend.number = max(1, round(BATCH_S / one))
        backend.repeats = min(repeats, max(3, int(BACKEND_S / (one * backend.number))))
        if backend.repeats < repeats:
            backend.notes.append(f"{backend.repeats} batches, not {repeats}: {_fmt_time(one)} per call")
        backend.fn = fn
    except Exception as err:
        backend.error = _error(err)
        if os.environ.get("TORCHTOSA_BENCH_TRACE"):
            traceback.print_exc()


def time_interleaved(backends: list[Backend], inputs: Inputs) -> None:
    """Rounds of one timing batch per backend, the order rotating per round, until each backend has its
    `repeats` batches (a slow one may have fewer than the others: it drops out of the later rounds)."""
    live = [b for b in backends if b.fn is not None]
    for r in range(max((b.repeats for b in live), default=0)):
        k = r % len(live)
        for backend in live[k:] + live[:k]:
            if len(backend.samples) >= backend.repeats:
                continue
            torch.set_num_threads(backend.threads)
            fn, number = backend.fn, backend.number
            start = time.perf_counter()
            for _ in range(number):
                fn(*inputs)
            backend.samples.append((time.perf_counter() - start) / number)
            time.sleep(backend.settle_s)
    torch.set_num_threads(1)


def backends_for(workload: Workload, model: nn.Module, inputs: Inputs, args: argparse.Namespace,
                 iree: str | None) -> list[Backend]:
    def inductor() -> Callable[..., Any]:
        torch._dynamo.reset()  # torchtosa captures with dynamo too: start inductor from a clean cache
        return torch.compile(model)

    backends = [
        Backend("torchtosa default", 1, lambda: torchtosa.compile(model, *inputs, opt="default", fallback="error")),
        Backend("torchtosa parallel", 2, lambda: torchtosa.compile(model, *inputs, opt="parallel", fallback="error"),
                settle_s=OPENMP_SETTLE_S),
    ]
    if args.reference or workload.reference:
        backends.append(Backend(REFERENCE, 1, lambda: torchtosa.compile(model, *inputs, opt="none", fallback="error")))
    backends += [
        Backend(EAGER, 1, lambda: model, compiles=False),
        Backend("eager 2t", 2, lambda: model, compiles=False),
    ]
    if iree:
        iree_notes: list[str] = []
        backends.append(Backend("iree 1t", 1, lambda: make_iree(model, inputs, iree_notes), notes=iree_notes))
    backends.append(Backend("inductor 1t", 1, inductor))  # last: nothing captures with dynamo after it
    return backends


# ---------------------------------------------------------------- reporting


def _fmt_time(s: float | None) -> str:
    if s is None:
        return "-"
    value, unit = (s, "s") if s >= 1 else (s * 1e3, "ms") if s >= 1e-3 else (s * 1e6, "us")
    return f"{value:.3g} {unit}"


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


HEADER = ["workload", "backend", "time/call (median)", "IQR", "vs eager 1t", "GF/s", "compile (+1st call)",
          "max abs diff vs eager", "peak RSS +MiB"]


def rows_of(name: str, flops: int, backends: list[Backend]) -> list[list[str]]:
    eager = next((b for b in backends if b.name == EAGER), None)
    base = eager.median if eager else None
    rows = []
    for b in backends:
        med = b.median
        if b.error:
            rows.append([name, b.name, "failed", "-", "-", "-", _fmt(b.compile_s, ".2f", " s"), "-", "-"])
            continue
        ratio = f"{base / med:.2f}x faster" if base and med and med <= base else (
            f"{med / base:.2f}x slower" if base and med else "-")
        if b.name == EAGER:
            ratio = "1.00x"
        gflops = flops / med / 1e9 if med and flops else None
        rows.append([name, b.name, _fmt_time(med), _fmt(b.iqr_pct, ".1f", "%"), ratio, _fmt(gflops, ".1f"),
                     _fmt(b.compile_s, ".2f", " s"), _fmt(b.diff, ".1e"), _fmt(b.peak_rss_mib, ".1f")])
    return rows


def markdown(rows: list[list[str]], header: list[str] = HEADER) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


SCALING_LAYERS = (1, 2, 4, 8, 12)


def compile_scaling(outline: bool = True) -> str:
    """A table of torchtosa's compile time (opt="default") for BertModel of 1 to 12 layers: capture
    (Dynamo + AOTAutograd; with `outline`, each distinct layer traced once), import to TOSA, and
    lowering + JIT + the first call."""
    header = ["layers", "layers traced", "TOSA ops", "parts", "capture", "import", "lower + JIT + 1st call",
              "per layer", "total", "total vs 2 layers"]
    rows: list[list[str]] = []
    previous: tuple[int, float] | None = None
    two: float | None = None  # the 2-layer model's total compile time
    for layers in SCALING_LAYERS:
        torch.manual_seed(0)
        torch._dynamo.reset()
        model, inputs = build_bert(layers)
        model.eval()
        gc.collect()  # the last depth's garbage: its collection (~0.3 s) would land in this one at random
        with torch.no_grad():
            start = time.perf_counter()
            captured = capture(model, inputs, {}, outline=outline)
            captured_at = time.perf_counter()
            program = import_graph(captured.gm)
            imported_at = time.perf_counter()
            # compiled, not loaded from the disk cache (the main table compiled the 2-layer model);
            # the cache-less path keeps the lowered module, whose parts are counted below
            with mock.patch.dict(os.environ, {"TORCHTOSA_CACHE": "0"}):
                native = NativeFunction(program.module, program.inputs, program.outputs)
            native(*captured.params, *inputs)
            done = time.perf_counter()
        ops = len(list(program.module.body.operations[0].regions[0].blocks[0].operations))
        parts = sum(1 for op in native._module.body.operations if "__part" in str(op.attributes["sym_name"]))
        lowered = done - imported_at
        slope = f"{(lowered - previous[1]) / (layers - previous[0]):.2f} s" if previous else "-"
        previous = (layers, lowered)
        total = done - start
        two = two if layers != 2 else total
        traced = layers - sum(captured.outlined.values()) + len(captured.outlined)
        rows.append([str(layers), str(traced), str(ops), str(parts or 1), f"{captured_at - start:.2f} s",
                     f"{imported_at - captured_at:.2f} s", f"{lowered:.2f} s", slope, f"{total:.2f} s",
                     _ratio(total, two)])
        print("  " + "  ".join(rows[-1]), flush=True)
    return markdown(rows, header)


def command_line() -> str:
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)  # never an absolute path of this machine
    return shlex.join(["python", str(script), *sys.argv[1:]])


def write_doc(doc: Path, env: dict[str, str], table: str, notes: list[str], scaling: str | None,
              dynamic: str | None = None, generation: str | None = None, int8: str | None = None,
              training: str | None = None, cached: str | None = None, decode: str | None = None) -> None:
    text = ["# Benchmarks", "",
            "Written by `scripts/bench.py` (`make bench`); regenerate rather than edit. The method (backends, "
            "interleaved timing, FLOP counting, what compile time and peak RSS include) is described in the "
            "script's docstring.", ""]
    text += [f"- {key}: {value}" for key, value in env.items()]
    text += ["", table, ""]
    if int8:
        text += ["## int8", "",
                 "A PT2E-quantized model (docs/quantization.md) frozen to integer TOSA and run natively "
                 "(\"torchtosa int8\", one thread; \"parallel\", two), against torchtosa's float32 compile of the "
                 "float model, eager float32, and PyTorch running the quantized model (\"eager quantized\": its "
                 "quantize/dequantize ops around float ops, the reference the int8 results are checked against). "
                 "Ratios above 1x are slower.", "", int8, ""]
    if training:
        text += ["## Training", "",
                 "One step of a model in train mode: forward, a mean squared error, backward and an eager SGD "
                 "update, with the model through `torch.compile` (torchtosa's backend: native forward and backward "
                 "graphs; Inductor), one thread. \"1st loss vs eager\" is the first step's loss against eager's; "
                 "the notes say what ran eagerly.", "", training, ""]
    if cached:
        text += ["## Compile time, first and second process", "",
                 "`torchtosa.compile` (and `torch.compile` with Inductor) plus the first call in a new process "
                 "with fresh on-disk caches, then in a second process sharing them (torchtosa's "
                 "TORCHTOSA_CACHE_DIR, Inductor's TORCHINDUCTOR_CACHE_DIR); one thread each, Python's bytecode "
                 "cache on (torchtosa's sources compiled first, as installing a wheel does). Both include what "
                 "a new process pays once on its first compile (lazy imports). torchtosa's second process checks "
                 "the guards of the kept capture instead of tracing with Dynamo and AOTAutograd "
                 "(runtime/capture/captures.py), imports its graph to TOSA (the key of the compiled code) and "
                 "loads the library; Inductor's runs Dynamo and loads AOTAutograd's and its own cached "
                 "results. The \"(torch.compile)\" rows compile with `torch.compile(model, backend=\"torchtosa\")`: "
                 "its second process runs Dynamo too and takes AOTAutograd's results from PyTorch's "
                 "AOTAutogradCache (runtime/capture/aot_cache.py); the \"generate\" rows are a tiny model's first "
                 "greedy generate with `dynamic=True` (the dynamic KV cache).", "", cached, ""]
    if dynamic:
        text += ["## Dynamic shapes", "",
                 "One `torch.compile(model, backend=\"torchtosa\", dynamic=True)` per workload serves every size "
                 "(the MLP's batch, the encoder layer's and BERT's sequence length); \"vs static\" compares it with "
                 "`torchtosa.compile` for that size (the parallel rows with the parallel static compile, 2 threads), "
                 "\"vs eager 1t\" with eager PyTorch on one thread (above 1x is slower). Inductor is compiled "
                 "with `dynamic=True` once too. Compile time is shown where a size compiled.", "", dynamic, ""]
    if generation:
        text += ["### Greedy generation with the dynamic KV cache", "",
                 "`model.forward = torch.compile(model.forward, backend=\"torchtosa\", dynamic=True)`, then "
                 "`model.generate` as in eager; one thread.", "", generation, ""]
    if decode:
        text += ["### Decoding a 0.25B Llama", "",
                 "Greedy decoding, batch 1, static KV cache (`cache_implementation=\"static\"`), one thread: "
                 "`model.forward` through `torch.compile` with torchtosa's backend and with Inductor, against "
                 "eager; the bound is what one step reads (every weight but the embedding table) at one thread's "
                 "read bandwidth (`decode_section` in the script says how each number is measured).", "", decode, ""]
    if scaling:
        text += ["## Compile time against depth", "",
                 "torchtosa (opt=\"default\") on BertModel h256 of 1 to 12 layers, [1x64 tokens]; \"per layer\" is "
                 "the growth of lowering + JIT + first call per added layer since the row above; \"total\" includes "
                 "capture (TorchDynamo and AOTAutograd trace each distinct layer once: "
                 "runtime/capture/outline.py; \"layers traced\" counts them) and is compared with the 2-layer "
                 "model's.", "", scaling, ""]
    if notes:
        text += ["Notes:", ""] + [f"- {note}" for note in notes] + [""]
    doc.write_text("\n".join(text))


class _Counted:
    """The torchtosa backend, counting the graphs it compiles and the ops of them that ran eagerly."""

    def __init__(self) -> None:
        self.graphs = 0
        self.fallbacks: list[str] = []

    def __call__(self, gm: torch.fx.GraphModule, example: list[Any], **kwargs: Any) -> Callable[..., Any]:
        self.graphs += 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", torchtosa.FallbackWarning)
            compiled = torchtosa.torchtosa_backend(gm, example, **kwargs)
        self.fallbacks += [str(w.message).splitlines()[0] for w in caught
                           if issubclass(w.category, torchtosa.FallbackWarning)]
        return compiled


DYNAMIC_HEADER = ["workload", "size", "backend", "time/call (median)", "IQR", "vs static", "vs eager 1t",
                  "compile (+1st call)", "max abs diff vs eager"]


def dynamic_section(args: argparse.Namespace, notes: list[str]) -> str | None:
    """The dynamic-shape table: per workload, one torch.compile(dynamic=True) serving 3 sizes,
    against torchtosa compiled for each size (static), eager and Inductor with dynamic=True."""
    rows: list[list[str]] = []
    for name, sizes in DYNAMIC_SIZES.items():
        if not args.only or args.only.lower() in name.lower():
            rows += _dynamic_workload(name, sizes, args, notes)
    return markdown(rows, DYNAMIC_HEADER) if rows else None


def _dynamic_workload(name: str, sizes: tuple[int, ...], args: argparse.Namespace, notes: list[str]
                      ) -> list[list[str]]:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model, _ = DYNAMIC_BUILD[name]()
    model.eval()
    counters = {"default": _Counted(), "parallel": _Counted()}
    shared: dict[str, Callable[..., Any]] = {}

    def dynamic(opt: str) -> Callable[..., Any]:
        if opt not in shared:
            shared[opt] = torch.compile(model, backend=counters[opt], dynamic=True, options={"opt": opt})
        return shared[opt]

    def inductor() -> Callable[..., Any]:
        if "inductor" not in shared:
            shared["inductor"] = torch.compile(model, dynamic=True)
        return shared["inductor"]

    print(f"\ndynamic {name}: sizes {', '.join(map(str, sizes))}", flush=True)
    rows: list[list[str]] = []
    for n in sizes:
        torch.manual_seed(1)
        inputs = dynamic_inputs(name, n)
        with torch.no_grad():
            torch.set_num_threads(1)
            expected = model(*inputs)
            backends = [
                Backend("torchtosa dynamic", 1, lambda: dynamic("default")),
                Backend("torchtosa static", 1, lambda inputs=inputs: torchtosa.compile(model, *inputs)),
                Backend("torchtosa parallel dynamic", 2, lambda: dynamic("parallel"), settle_s=OPENMP_SETTLE_S),
                Backend("torchtosa parallel static", 2,
                        lambda inputs=inputs: torchtosa.compile(model, *inputs, opt="parallel"),
                        settle_s=OPENMP_SETTLE_S),
                Backend(EAGER, 1, lambda: model, compiles=False),
                Backend("inductor dynamic 1t", 1, inductor),
            ]
            for backend in backends:
                prepare(backend, inputs, expected, args.warmup, args.repeats)
                print(f"  [{n}] {backend.name:28s} {backend.error or _fmt_time(backend.compile_s)}", flush=True)
            time_interleaved(backends, inputs)
        times = {b.name: b.median for b in backends}
        for b in backends:
            if b.error:
                notes.append(f"dynamic {name} [{n}]: {b.name} failed: {b.error}")
                rows.append([name, str(n), b.name, "failed", "-", "-", "-", "-", "-"])
                continue
            static = times["torchtosa parallel static" if "parallel" in b.name else "torchtosa static"]
            rows.append([name, str(n), b.name, _fmt_time(b.median), _fmt(b.iqr_pct, ".1f", "%"),
                         _ratio(b.median, static), _ratio(b.median, times[EAGER]),
                         _fmt(b.compile_s, ".2f", " s"), _fmt(b.diff, ".1e")])
            print("  " + "  ".join(rows[-1][1:]), flush=True)
    for opt, counter in counters.items():
        fallback = f"; eager fallback: {'; '.join(dict.fromkeys(counter.fallbacks))}" if counter.fallbacks else ""
        notes.append(f"dynamic {name}: torchtosa {opt} compiled {counter.graphs} graph(s) for {len(sizes)} sizes"
                     + fallback)
    return rows


GENERATE_TOKENS = 32


GENERATE_OPTIONS = {"max_new_tokens": GENERATE_TOKENS, "min_new_tokens": GENERATE_TOKENS, "do_sample": False,
                    "pad_token_id": 0}


def tiny_generators() -> dict[str, Callable[[], nn.Module]]:
    """Builders of the tiny Llama and GPT-2 (random weights) that `generate_section` times."""
    import transformers

    return {
        "LlamaForCausalLM": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)),
        "GPT2LMHeadModel": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)),
    }


def generate_section(notes: list[str]) -> str:
    """Greedy generation of GENERATE_TOKENS tokens with the default (dynamic) KV cache on tiny
    Llama and GPT-2 models: eager against the forward compiled once with dynamic=True (one
    thread; best of 5 generations after the compiling one)."""
    options = GENERATE_OPTIONS
    rows = []
    for name, make in tiny_generators().items():
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = make().eval()
        ids = torch.randint(1, 128, (1, 5))

        def generate(model: nn.Module = model, ids: torch.Tensor = ids) -> tuple[float, torch.Tensor]:
            start = time.perf_counter()
            out = model.generate(ids, **options)
            return time.perf_counter() - start, out

        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            generate()
            eager, want = min(generate() for _ in range(5))
            counter = _Counted()
            model.forward = torch.compile(model.forward, backend=counter, dynamic=True)
            first, got = generate()
            compiled = min(generate()[0] for _ in range(5))
        same = "yes" if torch.equal(got, want) else "NO"
        rows.append([name, f"{eager * 1e3:.1f} ms", f"{compiled * 1e3:.1f} ms", _ratio(compiled, eager),
                     f"{first:.1f} s", str(counter.graphs), same])
        print("  " + "  ".join(rows[-1]), flush=True)
    notes.append(f"generate: {GENERATE_TOKENS} new tokens from a 5-token prompt; the compiled column is the "
                 "whole generate() with the forward compiled (HF's Python loop included)")
    return markdown(rows, ["model", "eager generate", "torchtosa generate", "vs eager", "first generate (compiles)",
                           "graphs compiled", "tokens equal"])


# a ~0.25B Llama (16 layers, hidden 1024): what one decoding step reads is its weights
DECODE_CONFIG = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 16,
                 "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 512}
DECODE_PROMPT, DECODE_SHORT, DECODE_LONG = 8, 8, 24  # prompt tokens; new tokens of the two timed generates


def read_bandwidth() -> float:
    """One thread's memory read bandwidth in bytes/s: the best of 5 sums of a 1 GiB tensor and 5
    products of it, as a matrix, by a vector (what a decoding step's linears read: MKL's gemv
    read 20-30% faster than torch.sum on a Sapphire Rapids-class host, where the sum's bound was
    below what decoding reached)."""
    x = torch.ones(1 << 28)
    matrix, vector = x.view(1 << 14, 1 << 14), torch.ones(1 << 14)
    best = min(min(_timed(x.sum), _timed(lambda: torch.mv(matrix, vector))) for _ in range(5))
    return x.numel() * x.element_size() / best


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_section(notes: list[str]) -> str:
    """Greedy decoding of a ~0.25B Llama (DECODE_CONFIG, random weights) with a static KV cache,
    batch 1, one thread, in float32 and bfloat16: per-token latency (the difference of a
    DECODE_LONG- and a DECODE_SHORT-token generate from the same DECODE_PROMPT-token prompt, over
    the difference in tokens; best of 3) against eager, Inductor and the memory-bandwidth bound (the
    bytes of every weight but the embedding table, which a step reads one row of, over one thread's
    read bandwidth, `read_bandwidth`). "first generate" includes compiling prefill and decode."""
    import transformers

    bandwidth = read_bandwidth()
    notes.append(f"decode: one thread's read bandwidth {bandwidth / 1e9:.1f} GB/s (the best of a 1 GiB torch.sum "
                 "and torch.mv)")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**DECODE_CONFIG)).eval().to(dtype)
        weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                      if "embed_tokens" not in name)
        bound = weights / bandwidth
        ids = torch.randint(1, DECODE_CONFIG["vocab_size"], (1, DECODE_PROMPT))
        forward = model.forward
        eager_tokens = None
        for backend in ("eager", "torchtosa", "inductor"):
            torch._dynamo.reset()
            model.forward = forward if backend == "eager" else torch.compile(forward, backend=backend)

            def generate(new: int, model: nn.Module = model, ids: torch.Tensor = ids) -> tuple[float, torch.Tensor]:
                start = time.perf_counter()
                out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                                     cache_implementation="static")
                return time.perf_counter() - start, out

            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                first, _ = generate(DECODE_LONG)
                short = min(generate(DECODE_SHORT)[0] for _ in range(3))
                long, tokens = min((generate(DECODE_LONG) for _ in range(3)), key=lambda r: r[0])
            per_token = (long - short) / (DECODE_LONG - DECODE_SHORT)
            if backend == "eager":
                eager_token, eager_tokens = per_token, tokens
            same = "yes" if torch.equal(tokens, eager_tokens) else "NO"
            rows.append([str(dtype).removeprefix("torch."), backend, f"{per_token * 1e3:.1f} ms",
                         _ratio(per_token, eager_token), f"{bound * 1e3:.1f} ms", f"{bound / per_token:.0%}",
                         "-" if backend == "eager" else f"{first:.1f} s", same])
            print("  " + "  ".join(rows[-1]), flush=True)
        model.forward = forward
    return markdown(rows, ["dtype", "backend", "per token", "vs eager", "bandwidth bound", "of the bound",
                           "first generate (compiles)", "tokens equal eager's"])


# ---------------------------------------------------------------- training


def _train_mlp() -> tuple[nn.Module, Inputs]:
    model, (x,) = build_mlp()
    return model, (x, torch.randn(64, 512))


def _train_conv() -> tuple[nn.Module, Inputs]:
    model, _ = build_conv()
    return model, (torch.randn(4, 16, 56, 56), torch.randn(4, 32, 28, 28))


def _train_encoder() -> tuple[nn.Module, Inputs]:
    layers = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layers, 2, enable_nested_tensor=False), (torch.randn(4, 64, 256),
                                                                          torch.randn(4, 64, 256))


TRAINING = {"mlp 512-2048-512 [64x512]": _train_mlp,
            "conv block + batch norm [4x16x56x56]": _train_conv,
            "2 encoder layers d256 [4x64x256]": _train_encoder}
LEARNING_RATE = 0.01


def _trainer(model: nn.Module, compiled: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """One SGD step of `compiled` (the model or its compile) on a mean squared error; the loss."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)

    def step(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = (compiled(x) - target).pow(2).mean()
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


def training_section(args: argparse.Namespace, notes: list[str]) -> str | None:
    """The training table: a step (forward, backward, SGD update in eager) of a model in train mode,
    eager against the model compiled by torch.compile with torchtosa's backend and with Inductor, one
    thread; the diff column is the first step's loss against eager's."""
    rows: list[list[str]] = []
    for name, build in TRAINING.items():
        if args.only and args.only.lower() not in name.lower():
            continue
        torch.manual_seed(0)
        torch._dynamo.reset()
        model, inputs = build()
        model.train()
        reference = copy.deepcopy(model)
        expected = _trainer(reference, reference)(*inputs)

        def backend(compiler: str | None, model: nn.Module = model) -> Callable[..., Any]:
            twin = copy.deepcopy(model)
            return _trainer(twin, twin if compiler is None else torch.compile(twin, backend=compiler))

        backends = [Backend("torchtosa 1t", 1, lambda: backend("torchtosa")),
                    Backend(EAGER, 1, lambda: backend(None), compiles=False),
                    Backend("inductor 1t", 1, lambda: backend("inductor"))]
        print(f"\ntraining {name}", flush=True)
        with warnings.catch_warnings(record=True) as caught:  # the backward graph compiles at the first step
            warnings.simplefilter("always", torchtosa.FallbackWarning)
            for b in backends:
                prepare(b, inputs, expected, args.warmup, args.repeats)
                print(f"  {b.name:18s} {b.error or _fmt_time(b.compile_s)}", flush=True)
        time_interleaved(backends, inputs)
        rows += rows_of(name, 0, backends)
        eager = [str(w.message).splitlines()[0] for w in caught if issubclass(w.category, torchtosa.FallbackWarning)]
        notes.append(f"training {name}: ran eagerly in torchtosa's forward and backward graphs: "
                     f"{'; '.join(dict.fromkeys(eager)) or 'nothing'}")
        notes += [f"training {name}: {b.name} failed: {b.error}" for b in backends if b.error]
    return markdown(rows, TRAINING_HEADER) if rows else None


TRAINING_HEADER = ["workload", "backend", "time/step (median)", "IQR", "vs eager 1t", "-", "compile (+1st step)",
                   "1st loss vs eager", "peak RSS +MiB"]


# ---------------------------------------------------------------- compile time, first and second process

CACHED = ("mlp", "encoder layer", "conv block", "BERT", "ResNet-50 [1x", "MobileNetV2 [1x")
# through torch.compile with torchtosa's backend (AOTAutograd's results kept: capture/aot_cache.py);
# "<model> generate": the first greedy generate of a tiny model (dynamic=True, dynamic KV cache)
DYNAMO_CACHED = ("encoder layer", "BERT", "LlamaForCausalLM generate", "GPT2LMHeadModel generate")
GENERATE_SUFFIX = " generate"


def compile_child(name: str, backend: str) -> None:
    """In a child process: compile workload `name` with `backend` ("torchtosa": torchtosa.compile;
    "torchtosa-dynamo": torch.compile with torchtosa's backend; "inductor") and make the first call
    (a tiny model's generate: its first generate); print the seconds it took as `compile_s <seconds>`."""
    torch.manual_seed(0)
    start = time.perf_counter()
    dynamo_backend = "torchtosa" if backend == "torchtosa-dynamo" else backend
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name.endswith(GENERATE_SUFFIX):
            model = tiny_generators()[name.removesuffix(GENERATE_SUFFIX)]().eval()
            model.forward = torch.compile(model.forward, backend=dynamo_backend, dynamic=True)
            start = time.perf_counter()
            model.generate(torch.randint(1, 128, (1, 5)), **GENERATE_OPTIONS)
        else:
            model, inputs = next(w for w in WORKLOADS if w.name == name).build()
            model.eval()
            start = time.perf_counter()
            compiled = (torchtosa.compile(model, *inputs) if backend == "torchtosa"
                        else torch.compile(model, backend=dynamo_backend))
            compiled(*inputs)
    print(f"compile_s {time.perf_counter() - start:.3f}", flush=True)


def _child_compile_s(name: str, backend: str, cache: Path) -> float | None:
    """A child process's `compile_child`, with on-disk caches in `cache` and Python's bytecode
    cache on (as a user's Python has it; PYTHONDONTWRITEBYTECODE would make every process compile
    the sources of an editable install again, ~0.05 s of a second process)."""
    env = dict(os.environ, TORCHTOSA_CACHE_DIR=str(cache / "torchtosa"),
               TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"), OMP_NUM_THREADS="1")
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    proc = subprocess.run([sys.executable, __file__, "--compile-child", name, "--backend", backend],
                          capture_output=True, text=True, env=env, check=False)
    found = re.search(r"^compile_s ([\d.]+)$", proc.stdout, re.M)
    return float(found[1]) if found else None


def cache_section(args: argparse.Namespace, notes: list[str]) -> str | None:
    """Compile time (+ first call) of a workload in a first process and in a second one sharing
    its on-disk caches (torchtosa's and Inductor's, both fresh for the first), each process
    one thread."""
    compileall.compile_dir(Path(torchtosa.__file__).parent, quiet=1)  # as installing a wheel does
    names = [(w.name, "torchtosa") for w in WORKLOADS if any(w.name.startswith(prefix) for prefix in CACHED)]
    names += [(w.name, "torchtosa-dynamo") for w in WORKLOADS if any(w.name.startswith(p) for p in DYNAMO_CACHED)]
    names += [(name, "torchtosa-dynamo") for name in DYNAMO_CACHED if name.endswith(GENERATE_SUFFIX)]
    rows: list[list[str]] = []
    for name, ours in names:
        if args.only and args.only.lower() not in name.lower():
            continue
        times: dict[str, tuple[float | None, float | None]] = {}
        for backend in (ours, "inductor"):
            with tempfile.TemporaryDirectory(prefix="torchtosa-bench-cache-") as tmp:
                first = _child_compile_s(name, backend, Path(tmp))
                times[backend] = (first, _child_compile_s(name, backend, Path(tmp)))
        (tt1, tt2), (in1, in2) = times[ours], times["inductor"]
        label = f"{name} (torch.compile)" if ours == "torchtosa-dynamo" else name
        rows.append([label, _fmt(tt1, ".2f", " s"), _fmt(tt2, ".2f", " s"), _ratio(tt2, tt1),
                     _fmt(in1, ".2f", " s"), _fmt(in2, ".2f", " s"), _ratio(in2, in1), _ratio(tt1, in1)])
        print("  " + "  ".join(rows[-1]), flush=True)
        if None in (tt1, tt2, in1, in2):
            notes.append(f"compile cache {label}: a child process failed")
    return markdown(rows, ["workload", "torchtosa 1st process", "2nd process", "2nd vs 1st", "inductor 1st process",
                           "2nd process", "2nd vs 1st", "torchtosa vs inductor (1st)"]) if rows else None


INT8_WORKLOADS = {"mlp 512-2048-512 [64x512]": build_mlp, "conv block 16-32-32 [1x16x56x56]": build_conv}
INT8_HEADER = ["workload", "backend", "time/call (median)", "IQR", "vs torchtosa f32", "vs eager quantized",
               "compile (+1st call)", "max diff vs eager quantized (quanta)"]


def pt2e_int8(model: nn.Module, inputs: Inputs) -> torch.export.ExportedProgram:
    """The model quantized with PT2E and torchtosa's TosaQuantizer (int8 activations per tensor,
    int8 weights per channel), calibrated on 8 random batches like `inputs`, exported."""
    from torchtosa.quantizer import quantize

    return quantize(model, inputs, [tuple(torch.randn_like(x) for x in inputs) for _ in range(8)])


def int8_section(args: argparse.Namespace, notes: list[str]) -> str | None:
    """The int8 table: per workload, a PT2E-quantized model frozen to integer TOSA and run natively
    against torchtosa's float32 compile, eager float32 and PyTorch running the quantized model."""
    rows: list[list[str]] = []
    for name, build in INT8_WORKLOADS.items():
        if not args.only or args.only.lower() in name.lower():
            rows += _int8_workload(name, build, args, notes)
    notes.append("int8: quantized with PT2E (torchao 0.18, torchtosa.quantizer.TosaQuantizer: int8 activations per "
                 "tensor, int8 weights per channel) after 8 random calibration batches; the diff column is in quanta "
                 "of the output (the float rows differ by the quantization error itself)")
    return markdown(rows, INT8_HEADER) if rows else None


def _int8_workload(name: str, build: Callable[[], tuple[nn.Module, Inputs]], args: argparse.Namespace,
                   notes: list[str]) -> list[list[str]]:
    """`to_tosa(freeze=True)` for TOSA-1.0+FP+INT (the float input's quantize and the output's
    dequantize stay float, so every backend takes the same inputs)."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model, inputs = build()
    model.eval()

    def int8(opt: str) -> Callable[..., Any]:
        program = torchtosa.to_tosa(ep, target="TOSA-1.0+FP+INT", freeze=True)
        floats = [g for g in program.groups if g.path != "integer"]
        if floats and opt == "default":
            notes.append(f"int8 {name}: float path for {'; '.join(map(str, floats))}")
        return NativeFunction(program.module, program.inputs, program.outputs, opt=opt)

    with torch.no_grad():
        ep = pt2e_int8(model, inputs)
        quantized = ep.module()
        torch.set_num_threads(1)
        expected = quantized(*inputs)
        scale = next(n for n in ep.graph.nodes if n.op == "output").args[0][0].args[1]
        backends = [
            Backend("torchtosa int8", 1, lambda: int8("default")),
            Backend("torchtosa int8 parallel", 2, lambda: int8("parallel"), settle_s=OPENMP_SETTLE_S),
            Backend("torchtosa f32", 1, lambda: torchtosa.compile(model, *inputs, fallback="error")),
            Backend("eager f32", 1, lambda: model, compiles=False),
            Backend("eager quantized", 1, lambda: quantized, compiles=False),
        ]
        print(f"\nint8 {name}", flush=True)
        for backend in backends:
            prepare(backend, inputs, expected, args.warmup, args.repeats)
            print(f"  {backend.name:24s} {backend.error or _fmt_time(backend.compile_s)}", flush=True)
        time_interleaved(backends, inputs)
    times = {b.name: b.median for b in backends}
    rows = []
    for b in backends:
        if b.error:
            notes.append(f"int8 {name}: {b.name} failed: {b.error}")
            rows.append([name, b.name, "failed", "-", "-", "-", "-", "-"])
            continue
        rows.append([name, b.name, _fmt_time(b.median), _fmt(b.iqr_pct, ".1f", "%"),
                     _ratio(b.median, times["torchtosa f32"]), _ratio(b.median, times["eager quantized"]),
                     _fmt(b.compile_s, ".2f", " s"), _fmt(None if b.diff is None else b.diff / scale, ".2f")])
        print("  " + "  ".join(rows[-1][1:]), flush=True)
    return rows


def _ratio(time: float | None, base: float | None) -> str:
    """`time` against `base` as a factor: above 1 is slower."""
    return f"{time / base:.2f}x" if time and base else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per backend before timing")
    parser.add_argument("--repeats", type=int, default=30, help="timing batches per backend")
    parser.add_argument("--only", help="substring of a workload name to run")
    parser.add_argument("--reference", action="store_true",
                        help='time torchtosa opt="none" on every workload (by default only on the small ones)')
    parser.add_argument("--warm", action="store_true", help="reuse inductor's and torchtosa's default on-disk caches")
    parser.add_argument("--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    parser.add_argument("--doc", type=Path, default=DOC,
                        help="the file the tables go to (docs/benchmarks.md; e.g. a second file for another CPU entry)")
    parser.add_argument("--no-scaling", action="store_true", help="skip the compile time against depth table")
    parser.add_argument("--no-dynamic", action="store_true", help="skip the dynamic-shape table")
    parser.add_argument("--no-int8", action="store_true", help="skip the int8 table")
    parser.add_argument("--dynamic-only", action="store_true",
                        help="only the dynamic-shape table (printed, docs/benchmarks.md left alone)")
    parser.add_argument("--scaling-only", action="store_true",
                        help="only the compile time against depth table (printed, docs/benchmarks.md left alone)")
    parser.add_argument("--no-training", action="store_true", help="skip the training table")
    parser.add_argument("--no-decode", action="store_true", help="skip the 0.25B Llama decoding table")
    parser.add_argument("--decode-only", action="store_true", help="the 0.25B Llama decoding table alone")
    parser.add_argument("--no-cache", action="store_true",
                        help="skip the compile time table of a first and a second process")
    parser.add_argument("--compile-child", metavar="WORKLOAD", help=argparse.SUPPRESS)  # cache_section's processes
    parser.add_argument("--backend", default="torchtosa", help=argparse.SUPPRESS)
    parser.add_argument("--no-outline", action="store_true",
                        help="the compile time table with every layer traced (torchtosa.compile(outline=False))")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.compile_child:
        compile_child(args.compile_child, args.backend)
        return 0
    if args.scaling_only:
        print(compile_scaling(outline=not args.no_outline))
        return 0
    if args.decode_only:
        notes: list[str] = []
        print(decode_section(notes), *notes, sep="\n")
        return 0

    if not args.warm:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchtosa-bench-inductor-")
        os.environ["TORCHTOSA_CACHE_DIR"] = tempfile.mkdtemp(prefix="torchtosa-bench-cache-")
    loads = os.getloadavg()
    cpus = os.cpu_count() or 1
    iree = iree_version()
    env = {
        "date (UTC)": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M"),
        "CPU": f"{cpu_model()}, {cpus} cores",
        "torchtosa's CPU entry": select().describe() + " (opdefs/cpus.yaml; TORCHTOSA_CPU picks another)",
        "eager's ISA limits": " ".join(f"{k}={os.environ[k]}" for k in EAGER_ISA_LIMITS if k in os.environ) or "none",
        "torch": torch.__version__,
        "IREE": iree or "not installed",
        "load average at start (1/5/15 min)": " / ".join(f"{x:.2f}" for x in loads),
        "command": f"`{command_line()}`",
        "one core's f32 FMA peak": f"{fma_peak_gflops():.0f} GF/s (`scripts/peak.py` for the entry: independent "
                                   "vector FMAs, no memory traffic, JIT-compiled like torchtosa's code): the ceiling "
                                   "of the GF/s column on one thread",
        "timing": f"{args.warmup} warmup calls, median of {args.repeats} interleaved batches of ~{BATCH_S * 1e3:.0f} "
                  f"ms per backend; inductor's and torchtosa's caches "
                  f"{'default (warm)' if args.warm else 'fresh (cold compile)'}",
    }
    for key, value in env.items():
        print(f"{key}: {value.strip('`')}")
    notes: list[str] = []
    if loads[0] > cpus / 2:
        notes.append(f"the machine was busy (load {loads[0]:.1f} on {cpus} cores): times are noisy")
        print(f"warning: {notes[-1]}")

    # One-time costs (importing inductor, loading the MLIR libraries) go to a throwaway compile of a
    # tiny function first, so the first workload's compile time and memory are not charged with them.
    with torch.no_grad():
        x = torch.randn(4)
        torch.compile(lambda t: t * 2 + 1)(x)
        torchtosa.compile(lambda t: t * 2 + 1, x)(x)
    torch._dynamo.reset()

    rows: list[list[str]] = []
    for workload in WORKLOADS:
        if args.dynamic_only or (args.only and args.only.lower() not in workload.name.lower()):
            continue
        torch.manual_seed(0)
        torch._dynamo.reset()
        model, inputs = workload.build()
        model.eval()
        with torch.no_grad():
            flops = count_flops(model, inputs)
            torch.set_num_threads(1)
            expected = model(*inputs)
            backends = backends_for(workload, model, inputs, args, iree)
            print(f"\n{workload.name}: {flops / 1e9:.3f} GFLOP per call", flush=True)
            repeats = min(args.repeats, workload.repeats or args.repeats)
            for backend in backends:
                prepare(backend, inputs, expected, args.warmup, repeats)
                status = backend.error or (f"compile {_fmt(backend.compile_s, '.2f', ' s')}, "
                                           f"max abs diff {_fmt(backend.diff, '.1e')}, "
                                           f"{backend.repeats} batches of {backend.number} calls")
                print(f"  {backend.name:18s} {status}", flush=True)
            time_interleaved(backends, inputs)
        for backend in backends:
            if backend.error:
                notes.append(f"{backend.name} failed on {workload.name}: {backend.error}")
            notes += [f"{backend.name} on {workload.name}: {note}" for note in backend.notes]
        if not any(b.name == REFERENCE for b in backends):
            notes.append(f'{REFERENCE} skipped on {workload.name} (slow to compile and run; pass --reference)')
        new = rows_of(workload.name, flops, backends)
        rows += new
        for row in new:
            print("  " + "  ".join(row[1:]), flush=True)

    int8 = None if args.no_int8 or args.dynamic_only else int8_section(args, notes)
    training = None if args.no_training or args.dynamic_only else training_section(args, notes)
    cached = None
    if not args.no_cache and not args.dynamic_only:
        print("\ncompile time, first and second process:", flush=True)
        cached = cache_section(args, notes)
    dynamic = None if args.no_dynamic else dynamic_section(args, notes)
    generation = None
    if not args.no_dynamic and not args.only:
        print("\ngreedy generate, dynamic KV cache:", flush=True)
        generation = generate_section(notes)
    decode = None
    if not args.no_decode and not args.only and not args.dynamic_only:
        print("\ngreedy decoding of a 0.25B Llama, static KV cache:", flush=True)
        decode = decode_section(notes)
    scaling = None
    if not args.no_scaling and not args.only and not args.dynamic_only:
        print("\ncompile time against depth (BertModel h256):", flush=True)
        scaling = compile_scaling(outline=not args.no_outline)
    table = markdown(rows)
    if rows:
        print()
        print(table)
    if int8:
        print()
        print(int8)
    if training:
        print()
        print(training)
    if cached:
        print()
        print(cached)
    if dynamic:
        print()
        print(dynamic)
    if generation:
        print()
        print(generation)
    if decode:
        print()
        print(decode)
    if scaling:
        print()
        print(scaling)
    for note in notes:
        print(note)
    if not args.no_write and rows:
        write_doc(args.doc, env, table, notes, scaling, dynamic, generation, int8, training, cached, decode)
        print(f"\nwrote {args.doc}")
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
