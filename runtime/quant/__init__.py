"""Quantized models: the `torchtosa` group ops that replace PT2E's dequantize -> op -> quantize
groups (one module per op family, each registering its ops with `library.group_op`) and the
matcher that applies the `match` tables of their YAML entries (patterns.py)."""

from . import (
    eltwise,  # noqa: F401  registers torch.ops.torchtosa.qadd / qsub / qmul / qclamp / qcat
    matmul,  # noqa: F401  registers torch.ops.torchtosa.qlinear / qconv2d
    pool,  # noqa: F401  registers the pooling and shape group ops (qmax_pool2d, qview, ...)
    rescale,  # noqa: F401  registers torch.ops.torchtosa.qclone / qmul_scalar (one RESCALE)
    table,  # noqa: F401  registers torch.ops.torchtosa.qunary / qmatmul / qsoftmax / qlayernorm
)
