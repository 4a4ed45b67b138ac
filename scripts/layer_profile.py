"""Per-layer-kind profile of a convolutional network on one thread: torchtosa, Inductor and eager.

Each distinct convolution layer of the model (a transformers MobileNetV2ConvLayer: TF-style pad,
convolution, BatchNorm, ReLU6; or an nn.Conv2d of another model) is timed in isolation on its
own input shape, interleaved across backends as scripts/bench.py times whole models. The layer
runs between permutes to and from NHWC, so torchtosa's layout transposes cancel as they do
inside the network (and eager / Inductor get a channels-last tensor, as Inductor's code of the
whole network does). A layer that pads its input itself (F.pad, TensorFlow's way) gets it, for
torchtosa, from a ReLU6, as from the previous layer's epilogue in the network: torchtosa writes
the padded buffer in place from such a producer (`convolutions.pads_in_place`) but copies a
function argument element by element. Inductor and eager copy the input into the padded
tensor in one pass (in the network, fused with the previous epilogue), so both sides pay one
elementwise pass over the input. Times are summed per kind, weighted by how often each shape occurs.

    PYTHONPATH=.pkg python scripts/layer_profile.py --batch 1 [--repeats 11] [--kinds depthwise]
        [--model resnet50]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
from collections.abc import Callable
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from bench import Backend, build_mobilenet_v2, build_resnet50, prepare, time_interleaved
from torch import nn

import torchtosa


class ChannelsLast(nn.Module):
    """`layer` on an NHWC tensor (through a ReLU6 if `produced`), returning NHWC."""

    def __init__(self, layer: nn.Module, produced: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.produced = produced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 3, 1, 2)
        return self.layer(nn.functional.relu6(x) if self.produced else x).permute(0, 2, 3, 1)


def _conv_of(layer: nn.Module) -> nn.Conv2d:
    return layer if isinstance(layer, nn.Conv2d) else next(m for m in layer.modules() if isinstance(m, nn.Conv2d))


def kind_of(conv: nn.Conv2d, channels: int) -> str:
    """The layer kind, for the table: what the schedule treats differently."""
    k, s = conv.kernel_size[0], conv.stride[0]
    if conv.groups > 1:
        return f"depthwise {k}x{k} s{s}"
    if k == 1:
        return "1x1 expand" if conv.out_channels > channels else "1x1 project"
    return f"dense {k}x{k} s{s}"


def layers(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    """(kind, layer, input shape) of each convolution layer as the model calls it, and its pooler."""
    leaves = [m for m in model.modules() if type(m).__name__ == "MobileNetV2ConvLayer"] or \
        [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    found: list[tuple[str, nn.Module, tuple[int, ...]]] = []
    hooks = [m.register_forward_hook(lambda m, args, out: found.append(
        (kind_of(_conv_of(m), args[0].shape[1]), m, tuple(args[0].shape)))) for m in leaves]
    pools = [m for m in model.modules() if isinstance(m, (nn.AdaptiveAvgPool2d, nn.MaxPool2d, nn.AvgPool2d))]
    hooks += [m.register_forward_hook(lambda m, args, out: found.append(
        (type(m).__name__, m, tuple(args[0].shape)))) for m in pools]
    with torch.no_grad():
        model(*inputs)
    for h in hooks:
        h.remove()
    return found


def flops(layer: nn.Module, shape: tuple[int, ...]) -> int:
    """Multiply-adds x 2 of the layer's convolution (0 for a pooling)."""
    if not any(isinstance(m, nn.Conv2d) for m in layer.modules()):
        return 0
    conv = _conv_of(layer)
    with torch.no_grad():
        out = layer(torch.zeros(shape))
    per_output = conv.in_channels // conv.groups * conv.kernel_size[0] * conv.kernel_size[1]
    return 2 * out.numel() * per_output


def time_layer(layer: nn.Module, shape: tuple[int, ...], repeats: int) -> dict[str, float]:
    """Median seconds per call of torchtosa (opt="default"), Inductor and eager on one thread."""
    conv = next((m for m in layer.modules() if isinstance(m, nn.Conv2d)), None)
    pads_itself = conv is not None and conv.kernel_size[0] > 1 and conv.padding[0] == 0
    module = ChannelsLast(copy.deepcopy(layer)).eval()
    produced = ChannelsLast(copy.deepcopy(layer), pads_itself).eval()
    n, c, h, w = shape
    x = (torch.rand(n, h, w, c) * 6,)  # ReLU6 leaves it as it is
    with torch.no_grad():
        expected = module(*x)

        def tosa() -> Callable[..., Any]:
            torchtosa.api.CACHE.clear()
            return torchtosa.compile(produced, *x, opt="default", fallback="error")

        def inductor() -> Callable[..., Any]:
            torch._dynamo.reset()
            return torch.compile(module)

        backends = [Backend("torchtosa", 1, tosa), Backend("inductor", 1, inductor),
                    Backend("eager", 1, lambda: module, compiles=False)]
        for b in backends:
            prepare(b, x, expected, 5, repeats)
            if b.error:
                raise RuntimeError(f"{b.name}: {b.error}")
            if b.diff is not None and b.diff > 1e-3:
                raise RuntimeError(f"{b.name} differs from eager by {b.diff}")
        time_interleaved(backends, x)
    return {b.name: b.median for b in backends}


MODELS = {"mobilenet_v2": build_mobilenet_v2, "resnet50": build_resnet50}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--kinds", default="", help="only kinds containing this text")
    parser.add_argument("--model", choices=sorted(MODELS), default="mobilenet_v2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, inputs = MODELS[args.model](args.batch)
    model.eval()
    distinct: dict[tuple[str, str, tuple[int, ...]], tuple[nn.Module, int]] = {}
    for kind, layer, shape in layers(model, inputs):
        if args.kinds not in kind:
            continue
        key = (kind, repr(_conv_of(layer)) if "Pool" not in kind else repr(layer), shape)
        first, count = distinct.get(key, (layer, 0))
        distinct[key] = (first, count + 1)
    per_kind: dict[str, dict[str, float]] = {}
    counts: dict[str, int] = {}
    gflop: dict[str, float] = {}
    print("| kind | layer | input | count | torchtosa | Inductor | eager | torchtosa GF/s |")
    print("|---|---|---|---|---|---|---|---|")
    for (kind, text, shape), (layer, count) in distinct.items():
        times = time_layer(layer, shape, args.repeats)
        f = flops(layer, shape)
        conv = text.replace("Conv2d", "").replace(", bias=False", "")
        print(f"| {kind} | {conv} | {'x'.join(map(str, shape))} | {count} | "
              + " | ".join(f"{times[b] * 1e6:.0f} us" for b in ("torchtosa", "inductor", "eager"))
              + f" | {f / times['torchtosa'] / 1e9:.1f} |", flush=True)
        totals = per_kind.setdefault(kind, {})
        for b, t in times.items():
            totals[b] = totals.get(b, 0.0) + count * t
        counts[kind] = counts.get(kind, 0) + count
        gflop[kind] = gflop.get(kind, 0.0) + count * f / 1e9
    print("\n| kind | count | torchtosa | Inductor | eager | GF/s torchtosa / Inductor / eager |")
    print("|---|---|---|---|---|---|")
    for kind, totals in per_kind.items():
        rates = " / ".join(f"{gflop[kind] / totals[b]:.1f}" for b in ("torchtosa", "inductor", "eager"))
        print(f"| {kind} | {counts[kind]} | " + " | ".join(f"{totals[b] * 1e3:.2f} ms" for b in
                                                          ("torchtosa", "inductor", "eager")) + f" | {rates} |")
    whole = {b: statistics.fsum(t[b] for t in per_kind.values()) for b in ("torchtosa", "inductor", "eager")}
    print("| sum | | " + " | ".join(f"{whole[b] * 1e3:.2f} ms" for b in ("torchtosa", "inductor", "eager")) + " | |")


if __name__ == "__main__":
    main()
