"""The `approx` registry (opdefs/math_tosa.yaml) emits TOSA only, and TOSA 1.0 accepts it.

Its entries exist for modules that may contain nothing but TOSA ops: for every float32 sample
of every entry, the lowered function holds only `tosa.*` ops (and its return), and MLIR's
TOSA validation (profiles pro_fp and pro_int, level 8K, strict alignment with the spec)
accepts the module. Their numerics against eager are checked by tests/test_ops.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from mlir import ir
from mlir.passmanager import PassManager
from test_ops import entry_for, make_args

from generator.spec import OpDef, Sample, load_specs
from torchtosa.testing import lower_op

ROOT = Path(__file__).resolve().parent.parent
VALIDATE = ("builtin.module(tosa-attach-target{profiles=pro_fp,pro_int level=8k},"
            "tosa-validate{strict-op-spec-alignment})")


def _f32_only(s: Sample) -> bool:
    tensors = [v for v in s.args.values() if isinstance(v, tuple) and v and v[0] == "tensor"]
    return bool(tensors) and all(t[1] == "f32" and 0 not in t[2] for t in tensors)


CASES = [(e, s) for e in load_specs(ROOT / "opdefs")[1] if e.registry == "approx"
         for s in e.samples if not (s.raises or s.unsupported) and _f32_only(s)]


def test_every_approx_entry_has_f32_samples() -> None:
    entries = {e.op for e in load_specs(ROOT / "opdefs")[1] if e.registry == "approx"}
    assert entries and entries == {e.op for e, _ in CASES}


@pytest.mark.parametrize(("e", "s"), CASES, ids=[f"{e.op}-{s.where.rsplit('/', 1)[-1]}" for e, s in CASES])
def test_emits_only_valid_tosa(e: OpDef, s: Sample) -> None:
    program = lower_op(entry_for(e), make_args(e, s))
    with program.module.context:
        module = ir.Module.parse(str(program.module))
        (fn,) = module.body.operations
        names = {op.operation.name for op in fn.regions[0].blocks[0].operations}
        assert {n for n in names if not n.startswith("tosa.")} == {"func.return"}, names
        PassManager.parse(VALIDATE).run(module.operation)  # raises MLIRError naming the op otherwise
