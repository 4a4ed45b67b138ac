"""The `torchtosa` command (`python -m torchtosa`), run as a subprocess: each --emit, the
progress lines, and errors as one line with exit status 2 (usage) or 1 (export failed)."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from torchtosa import cli
from torchtosa.artifacts import tosa_files

MODELS = '''
import torch
from torch import nn


class Tagger(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(100, 8)
        self.fc = nn.Linear(24, 4)

    def forward(self, x, ids):
        return self.fc(torch.cat([x, self.embed(ids)], -1)).softmax(-1)


tagger = Tagger()


def make_tagger():
    return Tagger()


def axpy(a, b):
    return a * b + a


def spectrum(a):
    return torch.fft.rfft(a).abs()


def not_a_model():
    return 3
'''


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "models.py").write_text(MODELS)
    return tmp_path


def torchtosa(workdir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchtosa", *args], cwd=workdir, env=env, capture_output=True,
                          text=True, timeout=300)


def stages(stderr: str) -> list[str]:
    """The stage names of the progress lines `torchtosa: <stage>   <seconds> s`."""
    return [line.removeprefix("torchtosa: ").rsplit(None, 2)[0] for line in stderr.splitlines()
            if line.startswith("torchtosa: ") and line.endswith(" s")]


def test_partition_delegates_all_but_the_embedding(workdir: Path, subprocess_env: dict[str, str]) -> None:
    """--partition: the TOSA file holds the part TOSA-1.0+FP runs; the embedding lookup (int64
    indices) stays on the host, listed on stderr; the host graph calls the part."""
    args = ["export", "models:make_tagger", "--input", "2x16:f32", "--input", "2:i64:0..100", "--target",
            "TOSA-1.0+FP", "--freeze", "--emit", "tosa", "-o", "out/tagger.tosa"]
    done = torchtosa(workdir, subprocess_env, *args, "--partition")
    assert done.returncode == 0, done.stderr
    assert "host   aten.embedding.default: not conformant to TOSA-1.0+FP" in done.stderr
    assert (workdir / "out" / "tagger.tosa").stat().st_size > 0
    assert "self.delegate(" in (workdir / "out" / "tagger.host.py").read_text()
    whole = torchtosa(workdir, subprocess_env, *args)  # without it: one module or an error
    assert whole.returncode == 1 and "not conformant to TOSA-1.0+FP" in whole.stderr
    assert torchtosa(workdir, subprocess_env, *args[:-4], "--emit", "so", "-o", "t.so", "--partition").returncode == 2


def test_emit_so_matches_eager(workdir: Path, subprocess_env: dict[str, str]) -> None:
    """A zero-argument factory (by module name) exported as a library, with one progress line
    per stage; the library computes what the module computes on the same seeded inputs."""
    specs = ["2x16:f32", "2:i64:0..100"]
    done = torchtosa(workdir, subprocess_env, "export", "models:make_tagger", *(f"--input={s}" for s in specs),
                     "--emit", "so", "-o", "out/tagger.so")
    assert done.returncode == 0, done.stderr
    assert stages(done.stderr) == ["capture", "import to TOSA", "partition", "tosa-to-linalg", "fuse-before-reshapes",
                                   "linalg", "unit-dims", "schedule", "bufferize", "out-params", "llvm",
                                   "translate to LLVM IR",
                                   "LLVM code generation", "link (cc)", "total"]
    header = (workdir / "out" / "tagger.h").read_text()
    assert "int tagger_run(const float *x, const int64_t *ids, float *out0);" in header

    generator = torch.Generator().manual_seed(0)
    x, ids = (cli.make_input(cli.parse_input(s, i), generator) for i, s in enumerate(specs))
    assert ids.dtype == torch.int64 and int(ids.min()) >= 0 and int(ids.max()) < 100
    sys.path.insert(0, str(workdir))
    try:
        import models
    finally:
        sys.path.remove(str(workdir))
    with torch.no_grad():
        expected = models.make_tagger().eval()(x, ids)
    out = torch.empty(2, 4)
    so = ctypes.CDLL(str(workdir / "out" / "tagger.so"))
    assert so.tagger_run(*(ctypes.c_void_p(t.data_ptr()) for t in (x, ids, out))) == 0
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_emit_mlir_to_stdout(workdir: Path, subprocess_env: dict[str, str]) -> None:
    """TOSA as MLIR text on stdout, from a function of a .py file."""
    done = torchtosa(workdir, subprocess_env, "export", "models.py:axpy", "--input", "3x5:f32", "--input", "5:f32",
                     "--emit", "mlir")
    assert done.returncode == 0, done.stderr
    assert "tosa.mul" in done.stdout and "tosa.add" in done.stdout and "tensor<3x5xf32>" in done.stdout
    assert 'torchtosa.target = "TOSA-1.0+FP"' in done.stdout  # the most conformant target by default
    assert stages(done.stderr) == ["capture + import to TOSA", "total"]


@pytest.fixture
def in_workdir(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The work directory as the current one, for `cli.main` in this process."""
    monkeypatch.chdir(workdir)
    monkeypatch.delitem(sys.modules, "models", raising=False)
    return workdir


@pytest.mark.parametrize("emit", ["linalg", "llvm"])
def test_emit_lowered(in_workdir: Path, capsys: pytest.CaptureFixture[str], emit: str) -> None:
    """linalg on tensors (after tosa-to-linalg, before bufferization) and LLVM IR, to files."""
    status = cli.main(["export", "models:axpy", "--input", "3x5:f32", "--input", "5:f32", "--emit", emit,
                       "--opt", "none", "-o", f"axpy.{emit}"])
    err = capsys.readouterr().err
    assert status == 0, err
    text = (in_workdir / f"axpy.{emit}").read_text()
    if emit == "linalg":
        assert "linalg.generic" in text and "tosa." not in text and "memref" not in text
        assert stages(err)[-2] == "linalg"
    else:
        assert "define void @_mlir_ciface_forward(ptr" in text and "fmul" in text
        assert stages(err)[-2] == "translate to LLVM IR"


def test_emit_llvm_for_another_cpu(in_workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--cpu: LLVM IR whose functions are marked for that entry's CPU (aarch64's Neoverse N1 here)."""
    status = cli.main(["export", "models:axpy", "--input", "3x5:f32", "--input", "5:f32", "--emit", "llvm",
                       "--cpu", "neoverse-n1", "-o", "axpy.ll"])
    assert status == 0, capsys.readouterr().err
    assert '"target-cpu"="neoverse-n1"' in (in_workdir / "axpy.ll").read_text()


def test_emit_tosa(in_workdir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A TOSA flatbuffer (Program.save) of the frozen model, for the target asked for."""
    status = cli.main(["export", "models:tagger", "--input", "2x16:f32", "--input", "2:i64:0..100",
                       "--emit", "tosa", "--freeze", "--target", "TOSA-1.0+FP+INT", "-o", "tagger.tosa"])
    err = capsys.readouterr().err
    assert status == 0, err
    assert stages(err) == ["capture + import to TOSA", "serialize", "total"]
    assert (in_workdir / "tagger.tosa").read_bytes()[4:8] == b"TOSA"
    loaded = tosa_files.load(in_workdir / "tagger.tosa")
    assert len(loaded.inputs) == 2  # the weights are constants of the file


@pytest.mark.parametrize(("args", "message"), [
    (["models:axpy", "--input", "3x5:q7", "--emit", "mlir"], "unknown dtype 'q7'"),
    (["models:axpy", "--input", "3,5:f32", "--emit", "mlir"], "expected SHAPE:DTYPE"),
    (["nowhere:axpy", "--input", "3:f32", "--emit", "mlir"], "no module named 'nowhere'"),
    (["missing.py:axpy", "--input", "3:f32", "--emit", "mlir"], "no such file: missing.py"),
    (["models:missing", "--input", "3:f32", "--emit", "mlir"], "models has no attribute 'missing'"),
    (["models:not_a_model", "--input", "3:f32", "--emit", "mlir"], "returned a int"),
    (["models:axpy", "--input", "3:f32", "--emit", "so"], "give -o PATH"),
    (["models:axpy", "--input", "3:f32", "--emit", "so", "-o", "x.dll"], "must name a .so file"),
    (["models:axpy", "--emit", "mlir"], "give the model's inputs with --input"),
    (["models:axpy", "--input", "3:f32", "--emit", "wasm"], "invalid choice: 'wasm'"),
    (["models:axpy", "--input", "3:f32", "--emit", "llvm", "--cpu", "pentium"], "--cpu: unknown CPU 'pentium'"),
    (["models:axpy", "--input", "3:f32", "--emit", "mlir", "--cpu", "zen4"], "use it with --emit llvm or so"),
])
def test_usage_errors(in_workdir: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert cli.main(["export", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchtosa: error: ") and message in err
    assert len(err.strip().splitlines()) == 1, err


def test_usage_error_exit_status(workdir: Path, subprocess_env: dict[str, str]) -> None:
    done = torchtosa(workdir, subprocess_env, "export", "models:axpy", "--input", "3x5:f32", "--emit", "so")
    assert done.returncode == 2
    assert done.stderr == "torchtosa: error: --emit so writes a file: give -o PATH\n"


def test_export_error_is_one_line(workdir: Path, subprocess_env: dict[str, str]) -> None:
    """An op that can't be lowered: exit status 1, one line naming it; --verbose adds the traceback."""
    args = ["export", "models:spectrum", "--input", "8:f32", "--emit", "so", "-o", "spectrum.so"]
    done = torchtosa(workdir, subprocess_env, *args)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("torchtosa: error: aten._fft_r2c.default") and "Traceback" not in done.stderr
    assert stages(done.stderr) == ["capture"]
    verbose = torchtosa(workdir, subprocess_env, *args, "--verbose")
    assert verbose.returncode == 1 and "Traceback (most recent call last)" in verbose.stderr
    assert not (workdir / "spectrum.so").exists()


def test_parse_input() -> None:
    assert cli.parse_input("1x3x224x224:f32", 0) == ((1, 3, 224, 224), torch.float32, None)
    assert cli.parse_input("scalar:bool", 0) == ((), torch.bool, None)
    assert cli.parse_input("8:i64:-5..5", 0) == ((8,), torch.int64, (-5.0, 5.0))
    with pytest.raises(cli.UsageError, match="empty range"):
        cli.parse_input("8:f32:1..1", 0)
    generator = torch.Generator().manual_seed(3)
    values = cli.make_input(((1000,), torch.float16, (2.0, 4.0)), generator)
    assert values.dtype == torch.float16 and float(values.min()) >= 2 and float(values.max()) <= 4
    ints = cli.make_input(((1000,), torch.int8, (-5.0, 5.0)), generator)
    assert set(ints.tolist()) == set(range(-5, 5))


def test_console_script_declared() -> None:
    """pyproject's `torchtosa` script is cli.main."""
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"] == {"torchtosa": "torchtosa.cli:main"}
