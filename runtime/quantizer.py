"""TosaQuantizer: a PT2E quantizer (torchao) for TOSA's integer profile.

int8 activations per tensor (asymmetric, [-128, 127]), int8 weights per output channel
(symmetric, [-127, 127], axis 0 of conv and linear weights, depthwise too), float bias (the
integer lowering quantizes it to int32 at input_scale * weight_scale). Or int16 activations
(symmetric, [-32768, 32767]) with those int8 weights: `TosaQuantizer(a16w8=True)`, for
`TOSA-1.0+INT+int16` (an i48 accumulator and bias); the ops of `INT8_ONLY` (softmax, layer
norm, table activations) stay int8 there, requantized at their edges. What is quantized is
data: `OPS` maps each aten overload (as `torch.export.export(...).module()` has it) to an
annotation kind, and one small annotator per kind writes the QuantizationAnnotations:

- "weighted" (conv, linear): input and weight quantized; the output, or that of a fused
  activation (`FUSED`) that is the op's only user, so the graph reads DQ -> conv -> relu -> Q.
- "binary" (add, sub, mul) and "matmul" (matmul, bmm of two activations): every tensor input
  and the output (binary: after a fused relu) quantized.
- "output" (sigmoid, tanh, hardswish, gelu, silu, softmax, layer_norm): input and output
  quantized, each with its own parameters (TABLE-style ops).
- "shared" (pooling, mean, shape ops, standalone relu/hardtanh/clamp, dropout in eval mode,
  clone): the output shares the input's parameters, so the op runs on the int8 values
  unchanged; annotated only where the input is already quantized, so no Q/DQ pair appears
  around an op on a float tensor.
- "split" (chunk, split, unbind): each piece (a getitem of the op) shares the input's parameters.
- "cat": every input and the output share one set of parameters (the first input's).

    quantizer = TosaQuantizer()                      # the TOSA config everywhere
    quantizer.set_operator_type(torch.ops.aten.gelu.default, None)   # keep gelu float
    prepared = prepare_pt2e(torch.export.export(model, args).module(), quantizer)

`quantize(model, args, calibration)` runs the whole recipe (export, prepare, calibrate,
convert, export) and returns the ExportedProgram that `to_tosa(..., freeze=True)` takes.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch
import torch.fx as fx

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torchao's optional CUDA extensions warn on import
    from torchao.quantization.pt2e import HistogramObserver, MinMaxObserver, PerChannelMinMaxObserver
    from torchao.quantization.pt2e.quantizer import (
        QuantizationAnnotation,
        QuantizationSpec,
        Quantizer,
        SharedQuantizationSpec,
    )
    from torchao.quantization.pt2e.quantizer.utils import QuantizationConfig, get_module_name_filter

__all__ = ["FUSED", "INT8_ONLY", "OPS", "TosaQuantizer", "decompose_attention", "get_tosa_quantization_config",
           "quantize"]

aten = torch.ops.aten
_KEY = "quantization_annotation"

# The annotation kind of each op TOSA's integer profile runs.
OPS: dict[torch._ops.OpOverload, str] = {
    **dict.fromkeys([aten.conv1d.default, aten.conv2d.default, aten.linear.default], "weighted"),
    **dict.fromkeys([aten.matmul.default, aten.bmm.default], "matmul"),
    **dict.fromkeys([aten.add.Tensor, aten.add_.Tensor, aten.sub.Tensor, aten.sub_.Tensor,
                     aten.mul.Tensor, aten.mul_.Tensor], "binary"),
    **dict.fromkeys([aten.sigmoid.default, aten.tanh.default, aten.hardswish.default, aten.hardswish_.default,
                     aten.hardsigmoid.default, aten.gelu.default, aten.silu.default, aten.silu_.default,
                     aten.softmax.int, aten.layer_norm.default], "output"),
    **dict.fromkeys([aten.max_pool2d.default, aten.avg_pool2d.default, aten.adaptive_avg_pool2d.default,
                     aten.mean.dim, aten.view.default, aten.reshape.default, aten.flatten.using_ints,
                     aten.permute.default, aten.transpose.int, aten.t.default, aten.squeeze.dim,
                     aten.squeeze.dims, aten.unsqueeze.default, aten.relu.default, aten.relu_.default,
                     aten.hardtanh.default, aten.hardtanh_.default, aten.relu6.default, aten.clamp.default,
                     aten.dropout.default, aten.clone.default],
                    "shared"),
    **dict.fromkeys([aten.slice.Tensor, aten.select.int, aten.expand.default], "shared"),
    **dict.fromkeys([aten.chunk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int],
                    "split"),
    aten.cat.default: "cat",
}

# Ops whose integer lowerings are int8 only (softmax's and layer norm's fixed-point arithmetic,
# the 256-entry TABLEs of activations): under a16w8 they keep the int8 config, so their int16
# inputs are requantized to int8 and their outputs back (torchtosa.qrequantize: one RESCALE).
INT8_ONLY: frozenset[torch._ops.OpOverload] = frozenset([
    aten.softmax.int, aten.layer_norm.default, aten.sigmoid.default, aten.tanh.default, aten.hardswish.default,
    aten.hardswish_.default, aten.hardsigmoid.default, aten.gelu.default, aten.silu.default, aten.silu_.default])

# Activations fused into the op before them: the group's output is the activation's.
FUSED: dict[str, frozenset[torch._ops.OpOverload]] = {
    "weighted": frozenset([aten.relu.default, aten.relu_.default, aten.hardtanh.default, aten.hardtanh_.default,
                           aten.relu6.default]),
    "binary": frozenset([aten.relu.default, aten.relu_.default]),
}


def get_tosa_quantization_config(per_channel: bool = True, activation_observer: type = HistogramObserver,
                                 activation_dtype: torch.dtype = torch.int8) -> QuantizationConfig:
    """TOSA INT's scheme: int8 activations per tensor, asymmetric in [-128, 127]; int8
    weights symmetric in [-127, 127], per output channel (axis 0) or per tensor; bias float.
    `activation_dtype=torch.int16`: int16 activations with int8 weights (a16w8, for the
    `TOSA-1.0+INT+int16` target), symmetric (TOSA's int16 zero points are 0) over the whole int16
    range [-32768, 32767], so RESCALE's saturation is the quantize's clamp (no CLAMP ops)."""
    if activation_dtype not in (torch.int8, torch.int16):
        raise ValueError(f"TOSA's activations are int8 or int16, not {activation_dtype}")
    eps = 2.0 ** -12 if activation_dtype == torch.int8 else 2.0 ** -20  # the smallest scale
    if activation_dtype == torch.int8:
        low, high, scheme = -128, 127, torch.per_tensor_affine
    else:
        low, high, scheme = -32768, 32767, torch.per_tensor_symmetric
    activation = QuantizationSpec(
        dtype=activation_dtype, quant_min=low, quant_max=high, qscheme=scheme, is_dynamic=False,
        observer_or_fake_quant_ctr=activation_observer.with_args(eps=eps))
    if per_channel:
        weight_observer, qscheme = PerChannelMinMaxObserver, torch.per_channel_symmetric
    else:
        weight_observer, qscheme = MinMaxObserver, torch.per_tensor_symmetric
    weight = QuantizationSpec(
        dtype=torch.int8, quant_min=-127, quant_max=127, qscheme=qscheme, ch_axis=0 if per_channel else None,
        is_dynamic=False, observer_or_fake_quant_ctr=weight_observer.with_args(eps=eps))
    return QuantizationConfig(activation, activation, weight, None)


def _annotated(node: fx.Node) -> bool:
    annotation = node.meta.get(_KEY)
    return annotation is not None and annotation._annotated


def _quantized(node: object) -> bool:
    """Whether the node's output is quantized (its annotation has an output spec)."""
    annotation = node.meta.get(_KEY) if isinstance(node, fx.Node) else None
    return annotation is not None and annotation.output_qspec is not None


def _is_float(node: object) -> bool:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return isinstance(val, torch.Tensor) and val.dtype.is_floating_point


def _annotate(node: fx.Node, inputs: dict[fx.Node, object], output: object = None) -> None:
    node.meta[_KEY] = QuantizationAnnotation(input_qspec_map=inputs, output_qspec=output, _annotated=True)


def _fused(node: fx.Node, kind: str) -> fx.Node:
    """The activation fused into `node` (its only user, of a kind FUSED allows), or node."""
    users = list(node.users)
    if len(users) == 1 and users[0].op == "call_function" and users[0].target in FUSED.get(kind, ()) \
            and not _annotated(users[0]):
        return users[0]
    return node


def _weighted(node: fx.Node, config: QuantizationConfig) -> None:
    x, w = node.args[0], node.args[1]
    out = _fused(node, "weighted")
    inputs = {x: config.input_activation, w: config.weight}
    _annotate(node, inputs, None if out is not node else config.output_activation)
    if out is not node:
        _annotate(out, {}, config.output_activation)


def _matmul(node: fx.Node, config: QuantizationConfig) -> None:
    _annotate(node, {a: config.input_activation for a in node.args[:2] if _is_float(a)}, config.output_activation)


def _binary(node: fx.Node, config: QuantizationConfig) -> None:
    inputs = {a: config.input_activation for a in node.args[:2] if _is_float(a)}
    if not inputs:
        return
    out = _fused(node, "binary")
    _annotate(node, inputs, None if out is not node else config.output_activation)
    if out is not node:
        _annotate(out, {}, config.output_activation)


def _output(node: fx.Node, config: QuantizationConfig) -> None:
    if _is_float(node.args[0]):
        _annotate(node, {node.args[0]: config.input_activation}, config.output_activation)


def _shared(node: fx.Node, config: QuantizationConfig) -> None:
    x = node.args[0]
    if _quantized(x) and _is_float(x):  # the producer's observer serves both (implicit sharing)
        _annotate(node, {x: config.input_activation}, SharedQuantizationSpec((x, node)))


def _split(node: fx.Node, config: QuantizationConfig) -> None:
    x = node.args[0]
    if not (_quantized(x) and _is_float(x)):
        return
    _annotate(node, {x: config.input_activation})
    for piece in node.users:
        if piece.op == "call_function" and piece.target.__name__ == "getitem":
            _annotate(piece, {}, SharedQuantizationSpec((x, node)))


def _cat(node: fx.Node, config: QuantizationConfig) -> None:
    tensors = [t for t in dict.fromkeys(node.args[0]) if isinstance(t, fx.Node)]
    if not tensors or not all(_is_float(t) for t in tensors):
        return
    first, shared = tensors[0], SharedQuantizationSpec((tensors[0], node))
    _annotate(node, {first: config.input_activation, **dict.fromkeys(tensors[1:], shared)}, shared)


ANNOTATORS: dict[str, Callable[[fx.Node, QuantizationConfig], None]] = {
    "weighted": _weighted, "matmul": _matmul, "binary": _binary, "output": _output, "shared": _shared, "split": _split,
    "cat": _cat}


def _all_true(mask: object) -> bool:
    """Whether an attention mask is none, or a boolean one computed from constants alone with
    every element True (what transformers builds, exported, for attention without padding:
    arange >= 0, expanded)."""
    if mask is None:
        return True
    values: dict[fx.Node, object] = {}

    def value(a: object) -> object:
        if not isinstance(a, fx.Node):
            return a
        if a not in values:
            if a.op != "call_function" or not isinstance(a.target, torch._ops.OpOverload):
                raise LookupError(a.name)  # an input, parameter or buffer: not a constant
            values[a] = a.target(*fx.node.map_aggregate(a.args, value), **fx.node.map_aggregate(a.kwargs, value))
        return values[a]

    try:
        mask = value(mask)
    except LookupError:
        return False
    return isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and bool(mask.all())


def decompose_attention(gm: fx.GraphModule) -> fx.GraphModule:
    """Each `scaled_dot_product_attention` without dropout, causal mask or grouped heads,
    unmasked (or masked by a constant all-True mask), becomes transformers' eager attention:
    q @ k^T * scale, softmax over the last dim, @ v. The quantizer then annotates its matmuls,
    scale and softmax, where it would leave the one op float. In place; returns `gm`."""
    sdpa = aten.scaled_dot_product_attention.default
    names = [a.name for a in sdpa._schema.arguments]
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != sdpa:
            continue
        args = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
        q, k, v = args["query"], args["key"], args["value"]
        size = q.meta["val"].shape[-1] if "val" in q.meta else None
        if args.get("dropout_p") or args.get("is_causal") or args.get("enable_gqa") or not isinstance(size, int) \
                or not _all_true(args.get("attn_mask")):
            continue
        scale = args.get("scale") or size ** -0.5

        def call(target: torch._ops.OpOverload, *operands: object, node: fx.Node = node) -> fx.Node:
            new = gm.graph.call_function(target, operands)
            new.meta = {key: node.meta[key] for key in ("stack_trace", "nn_module_stack", "source_fn_stack")
                        if key in node.meta}
            new.meta["val"] = target(*fx.node.map_arg(operands, lambda a: a.meta["val"]))
            return new

        with gm.graph.inserting_before(node):
            scores = call(aten.mul.Tensor, call(aten.matmul.default, q, call(aten.transpose.int, k, -2, -1)), scale)
            out = call(aten.matmul.default, call(aten.softmax.int, scores, -1), v)
        node.replace_all_uses_with(out)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return gm


class TosaQuantizer(Quantizer):
    """Annotates a `torch.export(...).module()` graph for TOSA's integer profile (see module
    docstring). A config is looked up by module name (`set_module_name`), then by operator
    (`set_operator_type`), then the global one (`set_global`); None leaves an op float."""

    def __init__(self, config: QuantizationConfig | None = None, a16w8: bool = False) -> None:
        super().__init__()
        if config is None:
            config = get_tosa_quantization_config(activation_dtype=torch.int16 if a16w8 else torch.int8)
        elif a16w8:
            raise ValueError("TosaQuantizer: give a config or a16w8=True, not both")
        self.global_config = config
        self.operator_type_config: dict[torch._ops.OpOverload, QuantizationConfig | None] = {}
        self.module_name_config: dict[str, QuantizationConfig | None] = {}
        if a16w8:
            int8 = get_tosa_quantization_config()
            self.operator_type_config.update(dict.fromkeys(INT8_ONLY, int8))

    def set_global(self, config: QuantizationConfig | None) -> TosaQuantizer:
        self.global_config = config
        return self

    def set_operator_type(self, op: torch._ops.OpOverload | torch._ops.OpOverloadPacket,
                          config: QuantizationConfig | None) -> TosaQuantizer:
        """`config` for an overload, or for every overload of a packet (torch.ops.aten.add)."""
        overloads = [getattr(op, o) for o in op.overloads()] if isinstance(op, torch._ops.OpOverloadPacket) else [op]
        for overload in overloads:
            self.operator_type_config[overload] = config
        return self

    def set_module_name(self, name: str, config: QuantizationConfig | None) -> TosaQuantizer:
        """`config` for the ops of the submodule at this path ("blocks.0.fc")."""
        self.module_name_config[name] = config
        return self

    def config_for(self, node: fx.Node) -> QuantizationConfig | None:
        for name, config in self.module_name_config.items():
            if get_module_name_filter(name)(node):
                return config
        return self.operator_type_config.get(node.target, self.global_config)

    def transform_for_annotation(self, model: fx.GraphModule) -> fx.GraphModule:
        """Attention as the ops `OPS` annotates (`decompose_attention`)."""
        return decompose_attention(model)

    def annotate(self, model: fx.GraphModule) -> fx.GraphModule:
        """Annotate each op of `OPS` in graph order (a fused activation or a shared op after
        an annotated producer sees its producer's annotation)."""
        for node in model.graph.nodes:
            kind = OPS.get(node.target) if node.op == "call_function" else None
            if kind is None or _annotated(node):
                continue
            config = self.config_for(node)
            if config is not None:
                ANNOTATORS[kind](node, config)
        return model

    def validate(self, model: fx.GraphModule) -> None:
        """Per-channel specs are symmetric: TOSA's integer ops take weights with zero point 0."""
        for node in model.graph.nodes:
            annotation = node.meta.get(_KEY)
            specs = [] if annotation is None else list(annotation.input_qspec_map.values())
            for spec in specs:
                if isinstance(spec, QuantizationSpec) and spec.qscheme == torch.per_channel_affine:
                    raise ValueError(f"{node.name}: per-channel weights must be symmetric for TOSA ({spec.qscheme})")


def quantize(model: torch.nn.Module, example_inputs: tuple, calibration: Iterable[tuple],
             quantizer: Quantizer | None = None) -> torch.export.ExportedProgram:
    """The PT2E recipe in one call: export `model` (in eval mode) for `example_inputs`, prepare
    it with `quantizer` (a TosaQuantizer by default), run it on each tuple of `calibration`
    inputs, convert (weights folded to int8) and export the result, ready for
    `torchtosa.to_tosa(ep, target="TOSA-1.0+INT", freeze=True)`."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    model = model.eval()
    prepared = prepare_pt2e(torch.export.export(model, tuple(example_inputs)).module(),
                            TosaQuantizer() if quantizer is None else quantizer)
    batches = 0
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
            batches += 1
    if not batches:
        raise ValueError("quantize: no calibration batches (the observers need data to set the scales)")
    return torch.export.export(convert_pt2e(prepared), tuple(example_inputs))
