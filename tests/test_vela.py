"""Arm's Vela on torchtosa's int8 programs (docs/vela.md; `make vela` installs it in .vela/).

A PT2E-quantized MLP and conv net without their float edges (int8 in, int8 out, TOSA-1.0+INT)
are saved as TOSA flatbuffers and compiled by Vela for Ethos-U85-256: every op lands on the NPU.
The flatbuffer holds the program with its layout ops folded (`tosa_files.fold_layout`): the
conv's OHWI weight is a constant (not a transpose of the OIHW one, which Vela took for a feature
map: each conv became dozens of matmuls), and the NHWC -> NCHW -> NHWC transposes between layers
are gone. The folded flatbuffer gives native code's bits on TOSA's reference model.
"""

from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from test_quantized import MLP, ConvNet, int8_edges, quantized

import torchtosa
from torchtosa import vela
from torchtosa.artifacts.tosa_files import _function
from torchtosa.execute.native import NativeFunction
from torchtosa.importer.graph import Program
from torchtosa.lower.irutil import find_ops

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # torchao's optional CUDA extensions warn on import
    pytest.importorskip("torchao.quantization.pt2e.quantize_pt2e")

# What Vela 5.2.0 places on the NPU (its op kinds, after its own rewrites): the MLP's two
# linears, compiled for an NPU (vela.compile's npu=True: 1x1 convs, bias and rescale fused in);
# the conv net's two convs and the transposes of its NCHW input and output.
MODELS = {"mlp": (MLP, (64, 16), {"Conv2D": 2}),
          "convnet": (ConvNet, (1, 3, 16, 16), {"Conv2D": 2, "Transpose": 2})}
# the MLP as to_tosa wrote it (npu=False): matmuls with their i32 bias adds and rescales (Vela
# runs a matmul of two feature maps, adding a transpose to each)
MATMULS = {"MatMul": 2, "Add": 2, "Rescale": 2, "Transpose": 2}
QD = torch.ops.quantized_decomposed


@pytest.fixture(scope="module", params=list(MODELS))
def int8_model(request: pytest.FixtureRequest) -> tuple[str, Program, torch.export.ExportedProgram, tuple]:
    """A quantized model's int8 program (TOSA-1.0+INT), its int8 exported program, and the
    arguments of the float input's quantize (after the float tensor)."""
    cls, shape, _ = MODELS[request.param]
    torch.manual_seed(0)
    ep, x = quantized(cls(), shape)
    first = next(n for n in ep.graph.nodes if n.target == QD.quantize_per_tensor.default)
    ep8, _ = int8_edges(ep, x)
    program = torchtosa.to_tosa(ep8, target="TOSA-1.0+INT", freeze=True)
    assert [g.path for g in program.groups] == ["integer", "integer"]
    return request.param, program, ep8, (shape, *first.args[1:])


def test_int8_models_compile_on_the_npu(int8_model: tuple, tmp_path: Path) -> None:
    name, program, _, _ = int8_model
    report = vela.compile(program, output_dir=tmp_path)
    assert report.network == program.name and report.accelerator == "Ethos_U85_256"
    assert report.all_on_npu and report.cpu_ops == []
    assert Counter(report.npu_ops) == MODELS[name][2]
    assert report.cycles > 0 and report.npu_cycles > 0 and report.macs > 0
    assert report.inference_time == pytest.approx(report.cycles / 1e9)  # at the default 1 GHz clock
    assert report.sram_used > 0 or report.dram_used > 0
    assert report.weights_original > 0 and report.weights_encoded > 0  # constants Vela encodes
    if name == "mlp":
        matmuls = vela.compile(program, npu=False)
        assert Counter(matmuls.npu_ops) == MATMULS and matmuls.weights_encoded == 0
        assert report.cycles < matmuls.cycles
    assert report.output == tmp_path / f"{program.name}_vela.tflite" and report.output.stat().st_size > 0
    assert list(tmp_path.glob(f"{program.name}_summary_*.csv"))
    assert torchtosa.load(tmp_path / f"{program.name}.tosa").inputs == program.inputs


def test_a_saved_file_and_other_accelerators(int8_model: tuple, tmp_path: Path) -> None:
    """A .tosa path compiles like the Program; a bigger Ethos-U85 needs no more cycles; with
    the weights in flash (Shared_Sram), the report counts flash and no DRAM."""
    _, program, _, _ = int8_model
    program.save(tmp_path / "model.tosa")
    small = vela.compile(tmp_path / "model.tosa")
    assert small.network == "model" and small.output is None and small.all_on_npu
    assert (small.system_config, small.memory_mode) == ("Ethos_U85_SYS_DRAM_Mid", "Dedicated_Sram_384KB")
    big = vela.compile(str(tmp_path / "model.tosa"), accelerator="ethos-u85-1024")
    assert big.accelerator == "Ethos_U85_1024" and 0 < big.cycles <= small.cycles
    flash = vela.compile(tmp_path / "model.tosa", system_config="Ethos_U85_SYS_Flash_High", memory_mode="Shared_Sram",
                         output_dir=tmp_path / "out")
    assert (flash.system_config, flash.memory_mode) == ("Ethos_U85_SYS_Flash_High", "Shared_Sram")
    assert flash.off_chip_flash_used > 0 and flash.dram_used == 0 and flash.all_on_npu
    again = vela.compile(tmp_path / "model.tosa", output_dir=tmp_path / "out")  # not the earlier summary
    assert again.system_config == "Ethos_U85_SYS_DRAM_Mid" and again.cycles == small.cycles
    with pytest.raises(torchtosa.VelaError, match=r"vela failed \(exit status \d+\).*NoSuchConfig"):
        vela.compile(tmp_path / "model.tosa", system_config="NoSuchConfig")


def test_folded_flatbuffer_is_exact(int8_model: tuple, tmp_path: Path) -> None:
    """The flatbuffer has no transpose or reshape of a constant and no transpose of a
    transpose; TOSA's reference model running it gives native code's int8 bits (on the
    unfolded program), within one of PyTorch's converted model (measured: 4 of 1024 MLP and
    0 of 1568 conv-net outputs one off, on two random inputs)."""
    name, program, ep8, (shape, *quantize) = int8_model
    program.save(tmp_path / "model.tosa")
    loaded = torchtosa.load(tmp_path / "model.tosa")
    with loaded.context:
        ops = find_ops(_function(loaded.module, None), lambda op: op.name in ("tosa.transpose", "tosa.reshape"))
        producers = [op.operands[0].owner for op in ops]
        kinds = [getattr(p, "name", None) for p in producers]
    assert "tosa.const" not in kinds and "tosa.transpose" not in [k for op, k in zip(ops, kinds, strict=True)
                                                                    if op.name == "tosa.transpose"]
    if name == "convnet":  # only the transposes of the NCHW input and output remain
        assert sum(op.name == "tosa.transpose" for op in ops) == 2
    native = NativeFunction(program.module, program.inputs, program.outputs, name=program.name)
    for seed in range(2):
        torch.manual_seed(seed)
        x = QD.quantize_per_tensor.default(torch.randn(shape), *quantize)
        (got,) = native(x)
        (ref,) = program.reference(x)
        (ref_loaded,) = loaded.reference(x)
        assert torch.equal(got, ref) and torch.equal(got, ref_loaded)
        steps = (got.int() - ep8.module()(x).int()).abs()
        assert steps.max().item() <= 1 and (steps > 0).float().mean().item() <= 0.02
        print(f"{name}: {int((steps > 0).sum())} of {steps.numel()} outputs one off PyTorch's")


LAYOUT = """module {
  func.func @forward(%x: tensor<2x3x4xf32> {tosa.tensor_name = "x"}, %q: tensor<3x4xi8> {tosa.tensor_name = "q"})
      -> (tensor<2x3x4xf32> {tosa.tensor_name = "a"}, tensor<3x4xi8> {tosa.tensor_name = "b"},
          tensor<2x3x4xf32> {tosa.tensor_name = "c"}) {
    %w = "tosa.const"() <{values = dense<[[1.5, -2.0, 3.25], [4.0, 5.5, -6.0], [7.0, 8.0, 9.0], [0.5, 0.25, -1.0]]>
      : tensor<4x3xf32>}> : () -> tensor<4x3xf32>
    %wt = tosa.transpose %w {perms = array<i32: 1, 0>} : (tensor<4x3xf32>) -> tensor<3x4xf32>
    %s = tosa.const_shape {values = dense<[1, 3, 4]> : tensor<3xindex>} : () -> !tosa.shape<3>
    %wr = tosa.reshape %wt, %s : (tensor<3x4xf32>, !tosa.shape<3>) -> tensor<1x3x4xf32>
    %t1 = tosa.transpose %x {perms = array<i32: 2, 0, 1>} : (tensor<2x3x4xf32>) -> tensor<4x2x3xf32>
    %t2 = tosa.transpose %t1 {perms = array<i32: 1, 2, 0>} : (tensor<4x2x3xf32>) -> tensor<2x3x4xf32>
    %a = tosa.add %t2, %wr : (tensor<2x3x4xf32>, tensor<1x3x4xf32>) -> tensor<2x3x4xf32>
    %k = "tosa.const"() <{values = dense<[[1, -2, 3], [4, 5, -6], [7, 8, 9], [127, -128, 0]]> : tensor<4x3xi8>}>
      : () -> tensor<4x3xi8>
    %kt = tosa.transpose %k {perms = array<i32: 1, 0>} : (tensor<4x3xi8>) -> tensor<3x4xi8>
    %b = tosa.bitwise_xor %q, %kt : (tensor<3x4xi8>, tensor<3x4xi8>) -> tensor<3x4xi8>
    %m = "tosa.const"() <{values = dense<[[true, false, true], [false, false, true], [true, true, false],
      [false, true, true]]> : tensor<4x3xi1>}> : () -> tensor<4x3xi1>
    %mt = tosa.transpose %m {perms = array<i32: 1, 0>} : (tensor<4x3xi1>) -> tensor<3x4xi1>
    %mr = tosa.reshape %mt, %s : (tensor<3x4xi1>, !tosa.shape<3>) -> tensor<1x3x4xi1>
    %s12 = tosa.const_shape {values = dense<[2, 12]> : tensor<2xindex>} : () -> !tosa.shape<2>
    %s234 = tosa.const_shape {values = dense<[2, 3, 4]> : tensor<3xindex>} : () -> !tosa.shape<3>
    %r1 = tosa.reshape %x, %s12 : (tensor<2x3x4xf32>, !tosa.shape<2>) -> tensor<2x12xf32>
    %r2 = tosa.reshape %r1, %s234 : (tensor<2x12xf32>, !tosa.shape<3>) -> tensor<2x3x4xf32>
    %c = tosa.select %mr, %r2, %a : (tensor<1x3x4xi1>, tensor<2x3x4xf32>, tensor<2x3x4xf32>) -> tensor<2x3x4xf32>
    return %a, %b, %c : tensor<2x3x4xf32>, tensor<3x4xi8>, tensor<2x3x4xf32>
  }
}
"""


def test_fold_layout_moves_constants_exactly(tmp_path: Path) -> None:
    """Transposes and reshapes of f32 and i8 constants become constants, an inverse transpose
    pair and a reshape pair that restores the shape vanish; a bool constant (bit-packed in MLIR)
    keeps its transpose. The reference model's results are PyTorch's, bit for bit."""
    (tmp_path / "layout.mlir").write_text(LAYOUT)
    program = torchtosa.load(tmp_path / "layout.mlir")
    program.save(tmp_path / "layout.tosa")
    folded = torchtosa.load(tmp_path / "layout.tosa")
    with folded.context:
        names = [op.name for op in find_ops(_function(folded.module, None), lambda op: True)]
    assert names.count("tosa.transpose") == 1 and names.count("tosa.reshape") == 1  # the bool mask's
    assert names.count("tosa.const") == 3
    w = torch.tensor([[1.5, -2.0, 3.25], [4.0, 5.5, -6.0], [7.0, 8.0, 9.0], [0.5, 0.25, -1.0]])
    k = torch.tensor([[1, -2, 3], [4, 5, -6], [7, 8, 9], [127, -128, 0]], dtype=torch.int8)
    m = torch.tensor([[1, 0, 1], [0, 0, 1], [1, 1, 0], [0, 1, 1]], dtype=torch.bool)
    torch.manual_seed(0)
    x, q = torch.randn(2, 3, 4), torch.randint(-128, 128, (3, 4), dtype=torch.int8)
    a = x + w.t()
    for got in (program.reference(x, q), folded.reference(x, q)):
        for g, want in zip(got, (a, q ^ k.t(), torch.where(m.t(), x, a)), strict=True):
            assert g.dtype == want.dtype and torch.equal(g, want)


def test_vela_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vela.ENV, str(tmp_path / "no-vela"))
    with pytest.raises(torchtosa.VelaError, match=r"Vela is not installed .* run `make vela`"):
        vela.executable()


def test_vela_rejects_float_programs(tmp_path: Path) -> None:
    """Ethos-U85 has no float: Vela's validation error, with the ops it could not place."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Tanh()).eval()
    program = torchtosa.to_tosa(model, torch.randn(4, 16), target="TOSA-1.0+FP")
    with pytest.raises(torchtosa.VelaError, match=r"Vela rejected forward.tosa for ethos-u85-256") as err:
        vela.compile(program)
    assert {"MatMul", "Tanh"} <= set(err.value.ops)
    assert "Unsupported operation" in str(err.value) and "Traceback" not in str(err.value)


def test_not_a_tosa_file(tmp_path: Path) -> None:
    (tmp_path / "model.mlir").write_text(LAYOUT)
    with pytest.raises(torchtosa.VelaError, match=r"Vela reads TOSA flatbuffers: .*model.mlir is not a .tosa file"):
        vela.compile(tmp_path / "model.mlir")


CLI_MODELS = """
import torch


def gray(x):
    return torch.bitwise_xor(x, x >> 1)


def squash(x):
    return torch.tanh(x)
"""


@pytest.mark.parametrize(("args", "status", "printed"), [
    (["m:gray", "--input", "4x16:i32:-100..100", "--target", "TOSA-1.0+INT", "--emit", "tosa", "-o", "g.tosa",
      "--vela"], 0, "ops: 2 on the NPU (1 Asr, 1 Xor), 0 on the CPU"),
    (["m:gray", "--input", "4x16:i32", "--emit", "tosa", "-o", "g.tosa", "--vela", "ethos-u85-2048"], 0,
     "Vela: g on Ethos_U85_2048"),
    (["m:squash", "--input", "4x16:f32", "--emit", "tosa", "-o", "s.tosa", "--vela"], 1,
     "Vela rejected s.tosa for ethos-u85-256 (ops it can't place: Tanh)"),
    (["m:gray", "--input", "4x16:i32", "--emit", "mlir", "--vela"], 2, "use it with --emit tosa"),
])
def test_cli_export_vela(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                         args: list[str], status: int, printed: str) -> None:
    """`torchtosa export ... --emit tosa --vela [ACCELERATOR]` prints Vela's estimate."""
    from torchtosa import cli

    (tmp_path / "m.py").write_text(CLI_MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    got = cli.main(["export", *args])
    out, err = capsys.readouterr()
    assert got == status, err
    assert printed in (out if status == 0 else err)
