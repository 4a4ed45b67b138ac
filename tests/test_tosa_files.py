"""TOSA files (.mlir text, .tosa flatbuffer) and TOSA's reference model as a runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import torchtosa
from torchtosa.artifacts.tosa_files import portable_bools
from torchtosa.artifacts.tosa_tools import ENV
from torchtosa.execute.native import NativeFunction
from torchtosa.importer.graph import Program


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x).relu())


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.fc = nn.Conv2d(8, 4, 3, stride=2), nn.Linear(4, 5)
        with torch.no_grad():  # statistics that are not the identity
            self.bn.running_mean.normal_()
            self.bn.running_var.uniform_(0.5, 2.0)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        h = nn.functional.max_pool2d(self.bn(self.conv1(image)).relu(), 2)
        return self.fc(self.conv2(h).mean(dim=(2, 3)))


MODELS = {"mlp": (MLP, (3, 8), "x"), "convnet": (ConvNet, (2, 3, 16, 16), "image")}
NAMES = {
    "mlp": ["p_fc1_weight", "p_fc1_bias", "p_fc2_weight", "p_fc2_bias", "x"],
    "convnet": ["p_conv1_weight", "p_conv1_bias", "p_bn_weight", "p_bn_bias", "p_conv2_weight", "p_conv2_bias",
                "p_fc_weight", "p_fc_bias", "b_bn_running_mean", "b_bn_running_var", "image"],
}


@pytest.fixture(scope="module", params=list(MODELS))
def case(request: pytest.FixtureRequest) -> tuple[str, nn.Module, Program, dict[str, torch.Tensor]]:
    """A model, its program and the program's inputs by name (parameters and buffers included)."""
    torch.manual_seed(0)
    cls, shape, name = MODELS[request.param]
    model = cls().eval()
    x = torch.randn(shape)
    program = torchtosa.to_tosa(model, x)
    state = {f"p_{k}": v for k, v in model.named_parameters()} | {f"b_{k}": v for k, v in model.named_buffers()}
    by_name = {k.replace(".", "_"): v.detach() for k, v in state.items()} | {name: x}
    return request.param, model, program, {n: by_name[n] for n in program.input_names}


def eager(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(list(inputs.values())[-1])


def test_inputs_and_outputs_are_named(case: tuple) -> None:
    key, _, program, _ = case
    assert program.input_names == NAMES[key]
    assert program.output_names == ["output_0"]


def test_names_of_function_arguments() -> None:
    def f(input_ids: torch.Tensor, masks: list[torch.Tensor], *, scale: torch.Tensor) -> torch.Tensor:
        return input_ids * masks[0] * masks[1] * scale, input_ids + 1

    x = torch.randn(4)
    program = torchtosa.to_tosa(f, x, [x + 1, x + 2], scale=x + 3)
    assert program.input_names == ["input_ids", "masks_0", "masks_1", "scale"]
    assert program.output_names == ["output_0", "output_1"]


@pytest.mark.parametrize("suffix", [".mlir", ".tosa"])
def test_round_trip_keeps_names_shapes_and_dtypes(case: tuple, suffix: str, tmp_path: Path) -> None:
    _, model, program, inputs = case
    path = tmp_path / f"model{suffix}"
    before = str(program.module)
    program.save(path)
    assert str(program.module) == before  # the names went into the file only
    loaded = torchtosa.load(path)
    assert loaded.input_names == program.input_names
    assert loaded.output_names == program.output_names
    assert loaded.inputs == program.inputs
    assert loaded.outputs == program.outputs
    if suffix == ".mlir":
        assert f'{{tosa.tensor_name = "{program.input_names[-1]}"}}' in path.read_text()
        assert str(loaded.module) == str(program.module)  # names back in the Program, the module as it was
    else:
        assert path.read_bytes()[4:8] == b"TOSA"  # the flatbuffer's file identifier
        # tosa-opt's deserializer gives back the same computation: compile it natively
        native = NativeFunction(loaded.module, loaded.inputs, loaded.outputs, name=loaded.name)
        torch.testing.assert_close(native(*inputs.values())[0], eager(model, inputs))


def test_reference_model_matches_eager(case: tuple) -> None:
    _, model, program, inputs = case
    (got,) = program.reference(**inputs)
    want = eager(model, inputs)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got, want)  # float32: rtol 1.3e-6, atol 1e-5
    assert program.reference(*inputs.values())[0].equal(got)  # positional, the same


def test_reference_model_of_a_loaded_tosa_file(case: tuple, tmp_path: Path) -> None:
    _, _, program, inputs = case
    program.save(tmp_path / "model.tosa")
    loaded = torchtosa.load(tmp_path / "model.tosa")
    assert loaded.reference(**inputs)[0].equal(program.reference(**inputs)[0])


def test_outputs_that_are_inputs_or_repeated(tmp_path: Path) -> None:
    def f(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x, x * x, x * x

    x = torch.randn(5)
    program = torchtosa.to_tosa(f, x)
    for got, want in zip(program.reference(x), f(x), strict=True):
        assert got.equal(want)
    program.save(tmp_path / "f.tosa")
    assert torchtosa.load(tmp_path / "f.tosa").output_names == ["output_0", "output_1", "output_2"]


def test_bool_inputs_and_outputs(tmp_path: Path) -> None:
    def f(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.masked_fill(mask, 0.0), mask & (x > 0)

    x, mask = torch.randn(4, 5), torch.rand(4, 5) > 0.5
    for target in ("auto", None):  # bools as i1 (a TOSA target), as i8 (the native flavour)
        program = torchtosa.to_tosa(f, x, mask, target=target)
        for got, want in zip(program.reference(x, mask), f(x, mask), strict=True):
            assert got.dtype == want.dtype and got.equal(want)
        program.save(tmp_path / "f.mlir")
        assert ('torchtosa.dtype = "bool"' in (tmp_path / "f.mlir").read_text()) == (target is None)
        assert [s.dtype for s in torchtosa.load(tmp_path / "f.mlir").inputs] == [torch.float32, torch.bool]
        program.save(tmp_path / "f.tosa")  # a flatbuffer has no place for the torch dtype: an i8 is int8
        loaded = torchtosa.load(tmp_path / "f.tosa").inputs[1].dtype
        assert loaded == (torch.int8 if target is None else torch.bool)


# int64 tensors held as i32, as a TOSA target types them
INT64_AS_I32 = """
func.func @forward(%a: tensor<4xi32> {tosa.tensor_name = "a", torchtosa.dtype = "int64"},
                   %b: tensor<4xi32> {tosa.tensor_name = "b", torchtosa.dtype = "int64"})
    -> (tensor<4xi32> {tosa.tensor_name = "quotient", torchtosa.dtype = "int64"}) {
  %0 = tosa.intdiv %a, %b : (tensor<4xi32>, tensor<4xi32>) -> tensor<4xi32>
  return %0 : tensor<4xi32>
}
"""


def test_int64_held_as_int32(tmp_path: Path) -> None:
    (tmp_path / "div.mlir").write_text(INT64_AS_I32)
    program = torchtosa.load(tmp_path / "div.mlir")
    assert [s.dtype for s in program.inputs + program.outputs] == [torch.int64] * 3
    assert program.input_names == ["a", "b"] and program.output_names == ["quotient"]
    a, b = torch.tensor([7, -7, 2**31 - 1, -(2**31)]), torch.tensor([2, 2, 3, 5])
    (got,) = program.reference(a, b)
    assert got.dtype == torch.int64
    assert got.equal(torch.div(a, b, rounding_mode="trunc"))
    with pytest.raises(torchtosa.InputMismatch, match=r"input a holds values in \[-7, 4294967296\], outside the i32"):
        program.reference(torch.tensor([7, -7, 2**32, 1]), b)
    with pytest.raises(torchtosa.ToolError, match=r"UNPREDICTABLE(.|\n)*divisor must be non-zero"):
        program.reference(a, torch.tensor([2, 0, 3, 5]))


def test_wrong_arguments(case: tuple) -> None:
    _, _, program, inputs = case
    values = list(inputs.values())
    with pytest.raises(torchtosa.InputMismatch, match=r"takes 5 tensors|takes 11 tensors"):
        program.reference(*values[:-1])
    with pytest.raises(torchtosa.InputMismatch, match=r"must be a torch.float32"):
        program.reference(*values[:-1], values[-1][:1])
    with pytest.raises(torchtosa.InputMismatch, match=r"has no input y; its inputs are p_"):
        program.reference(*values, y=values[-1])


def test_missing_tools(case: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, program, inputs = case
    monkeypatch.setenv(ENV, str(tmp_path))
    message = r"tosa-tools are not installed: .*tosa-opt is not an executable. Run `make tosa-tools`"
    with pytest.raises(torchtosa.ToolError, match=message):
        program.save(tmp_path / "model.tosa")
    with pytest.raises(torchtosa.ToolError, match=message):
        program.reference(**inputs)
    program.save(tmp_path / "model.mlir")  # MLIR text needs no tools
    assert torchtosa.load(tmp_path / "model.mlir").input_names == program.input_names


def test_file_errors(case: tuple, tmp_path: Path) -> None:
    _, _, program, _ = case
    with pytest.raises(torchtosa.InvalidFile, match=r"can't save .*model.onnx: torchtosa's files end in .mlir"):
        program.save(tmp_path / "model.onnx")
    with pytest.raises(torchtosa.InvalidFile, match=r"can't load .*model.txt"):
        torchtosa.load(tmp_path / "model.txt")
    with pytest.raises(torchtosa.InvalidFile, match="no such file"):
        torchtosa.load(tmp_path / "absent.tosa")
    (tmp_path / "bad.mlir").write_text("func.func @forward(%x: tensor<2xf32>) -> tensor<2xf32> { tosa.bogus }")
    with pytest.raises(torchtosa.InvalidFile, match=r"bad.mlir: it is not an MLIR module"):
        torchtosa.load(tmp_path / "bad.mlir")
    program.save(tmp_path / "good.tosa")
    (tmp_path / "cut.tosa").write_bytes((tmp_path / "good.tosa").read_bytes()[:300])
    unreadable = r"(?s){}: tosa-opt does not read it as a TOSA flatbuffer.*{}"
    with pytest.raises(torchtosa.InvalidFile, match=unreadable.format("cut.tosa", "failed flatbuffer verification")):
        torchtosa.load(tmp_path / "cut.tosa")
    (tmp_path / "text.tosa").write_text("not a flatbuffer")
    with pytest.raises(torchtosa.InvalidFile, match=unreadable.format("text.tosa", "should start with TOSA")):
        torchtosa.load(tmp_path / "text.tosa")


def test_programs_a_flatbuffer_cannot_hold(tmp_path: Path) -> None:
    x = torch.randn(6)
    with pytest.raises(torchtosa.Unsupported, match="float64, which TOSA has not"):
        torchtosa.to_tosa(lambda t: t * 2, x.double()).save(tmp_path / "f64.tosa")
    with pytest.raises(torchtosa.Unsupported, match=r"ops that are not TOSA \(math.sinh"):
        torchtosa.to_tosa(torch.sinh, x, target=None).save(tmp_path / "sinh.tosa")


def test_reference_needs_static_shapes() -> None:
    model, x = MLP().eval(), torch.randn(3, 8)
    batch = torch.export.Dim("batch", min=2, max=64)
    program = torchtosa.to_tosa(torch.export.export(model, (x,), dynamic_shapes=({0: batch},)))
    inputs = [p.detach() for p in model.parameters()] + [x]
    with pytest.raises(torchtosa.Unsupported, match="static shapes only"):
        program.reference(*inputs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_text_keeps_the_target(tmp_path: Path, dtype: torch.dtype) -> None:
    """A saved module names its target and loads conformant to it, also with no extensions
    (whose `tosa.target_env` MLIR prints as `extensions = []` and cannot parse back)."""
    model, x = MLP().eval().to(dtype), torch.randn(3, 8, dtype=dtype)
    program = torchtosa.to_tosa(model, x, freeze=True)
    assert str(program.target) == ("TOSA-1.0+FP" if dtype == torch.float32 else "TOSA-1.0+FP+bf16")
    program.save(tmp_path / "m.mlir")
    loaded = torchtosa.load(tmp_path / "m.mlir")
    assert loaded.target == program.target
    assert "tosa.target_env" in str(loaded.module)
    loaded.target.validate(loaded.module)
    if dtype == torch.float32:  # and computes what the model does
        native = NativeFunction(loaded.module, loaded.inputs, loaded.outputs, name=loaded.name)
        torch.testing.assert_close(native(x)[0], model(x))


def test_bool_constants_in_hex_of_either_mlir(tmp_path: Path) -> None:
    """MLIR prints a bool constant of over 100 elements in hex: these bindings (MLIR 22) a bit
    per element, tosa-opt's newer MLIR a byte per element, and neither parses the other's. Files
    and tosa-opt get them as lists of true and false."""
    assert portable_bools('dense<"0x0D"> : tensor<2x2xi1>') == "dense<[[true, false], [true, true]]> : tensor<2x2xi1>"
    assert portable_bools('dense<"0x01000101"> : tensor<4xi1>') == "dense<[true, false, true, true]> : tensor<4xi1>"
    assert portable_bools('dense<"0x0D"> : tensor<2xi8>') == 'dense<"0x0D"> : tensor<2xi8>'
    x = torch.randn(2, 20)
    program = torchtosa.to_tosa(lambda t: torch.logcumsumexp(t, 1), x, target="TOSA-1.0+FP+INT+bf16")
    assert 'dense<"0x' in str(program.module) and "x20xi1>" in str(program.module)  # its triangular mask
    (got,) = program.reference(x)
    torch.testing.assert_close(got, torch.logcumsumexp(x, 1))
    for suffix in (".tosa", ".mlir"):
        program.save(tmp_path / f"f{suffix}")
        assert torchtosa.load(tmp_path / f"f{suffix}").reference(x)[0].equal(got)


# An int16 convolution as TOSA's EXT-INT16 has it (int16 activations, int8 weights): an i48
# accumulator and bias, and a RESCALE of the i48 values (scale32 false: 16-bit multipliers).
INT16_CONV = """
func.func @forward(%x: tensor<1x8x8x4xi16>) -> tensor<1x6x6x6xi16> {
  %w = "tosa.const"() <{values = dense<WEIGHT> : tensor<6x3x3x4xi8>}> : () -> tensor<6x3x3x4xi8>
  %b = "tosa.const"() <{values = dense<[100000, -200, 300, 0, 5, -70000]> : tensor<6xi48>}> : () -> tensor<6xi48>
  %xz = "tosa.const"() <{values = dense<0> : tensor<1xi16>}> : () -> tensor<1xi16>
  %wz = "tosa.const"() <{values = dense<0> : tensor<1xi8>}> : () -> tensor<1xi8>
  %c = tosa.conv2d %x, %w, %b, %xz, %wz {acc_type = i48, dilation = array<i64: 1, 1>, pad = array<i64: 0, 0, 0, 0>,
      stride = array<i64: 1, 1>} : (tensor<1x8x8x4xi16>, tensor<6x3x3x4xi8>, tensor<6xi48>, tensor<1xi16>, tensor<1xi8>)
      -> tensor<1x6x6x6xi48>
  %m = "tosa.const"() <{values = dense<[23170, 16384, 30000, 20000, 12345, 32767]> : tensor<6xi16>}>
      : () -> tensor<6xi16>
  %s = "tosa.const"() <{values = dense<[20, 21, 22, 19, 20, 23]> : tensor<6xi8>}> : () -> tensor<6xi8>
  %az = "tosa.const"() <{values = dense<0> : tensor<1xi48>}> : () -> tensor<1xi48>
  %r = tosa.rescale %c, %m, %s, %az, %xz {input_unsigned = false, output_unsigned = false, per_channel = true,
      rounding_mode = SINGLE_ROUND, scale32 = false} : (tensor<1x6x6x6xi48>, tensor<6xi16>, tensor<6xi8>, tensor<1xi48>,
      tensor<1xi16>) -> tensor<1x6x6x6xi16>
  return %r : tensor<1x6x6x6xi16>
}
"""


@pytest.mark.parametrize("opt", ["default", "none"])
def test_int16_convolution_runs_natively(opt: str, tmp_path: Path) -> None:
    """A TOSA file's int16 convolution (i48 accumulator) runs natively with the reference model's
    bits: an i48 buffer takes 8 bytes an element (LLVM's alloc size), and ops on i48 are not
    vectorized (LLVM packs vectors of i48 in 6 bytes an element)."""
    torch.manual_seed(0)
    weight = torch.randint(-127, 128, (6, 3, 3, 4)).tolist()
    path = tmp_path / "int16_conv.mlir"
    path.write_text(INT16_CONV.replace("WEIGHT", str(weight)))
    program = torchtosa.load(path)
    native = NativeFunction(program.module, program.inputs, program.outputs, name=program.name, opt=opt)
    x = torch.randint(-32768, 32768, (1, 8, 8, 4), dtype=torch.int16)
    (got,), (want,) = native(x), program.reference(x)
    assert got.dtype == torch.int16 and torch.equal(got, want)
    assert (got.abs() < 32767).float().mean().item() > 0.05  # not all saturated
