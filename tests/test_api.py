"""The user-facing API: torchtosa.to_tosa, torchtosa.compile and torch.compile(backend="torchtosa").

Programs use a few ops that have specs (add, mul, sub with alpha and Python numbers);
anything else must fail with a clear torchtosa error, never a crash or a wrong answer.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from mlir import ir

import torchtosa
import torchtosa._generated
from torchtosa import InputMismatch, TorchTosaError, Unsupported
from torchtosa.api import CACHE
from torchtosa.execute.native import NativeFunction
from torchtosa.importer import registry as registry_module
from torchtosa.regions import NativeRegion, WriteBack


def foo(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return x * y + x  # the README's example


def line_of(fn: object, text: str) -> int:
    """The line number of the first source line of `fn` containing `text`."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


@pytest.fixture(scope="module")
def xy() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(10), torch.randn(10)


@pytest.fixture(scope="module")
def compiled_foo(xy: tuple[torch.Tensor, torch.Tensor]) -> torchtosa.CompiledFunction:
    return torchtosa.compile(foo, *xy)


# ------------------------------------------------------------ the README example, three ways


def test_readme_example(xy: tuple[torch.Tensor, torch.Tensor], compiled_foo: torchtosa.CompiledFunction) -> None:
    x, y = xy
    prog = torchtosa.to_tosa(foo, x, y)
    text = str(prog)
    assert "func.func @forward" in text and "tosa.add" in text and "tosa.mul" in text
    assert isinstance(prog.module, ir.Module)
    torch.testing.assert_close(compiled_foo(x, y), foo(x, y))
    torch.testing.assert_close(torch.compile(foo, backend="torchtosa")(x, y), foo(x, y))


def test_backend_by_name_without_importing_torchtosa() -> None:
    """torch finds the installed backend through its entry point and imports the package itself."""
    script = ("import torch\n"
              "x = torch.randn(3, 4)\n"
              "out = torch.compile(lambda a: a.sin() * 2, backend='torchtosa')(x)\n"
              "torch.testing.assert_close(out, x.sin() * 2)\n"
              "import torchtosa\n"
              "print(torchtosa.explain(lambda a: a.sin() * 2, x).native_ops)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-2000:]


def test_python_numbers_alpha_and_promotion() -> None:
    x, b, i = torch.randn(3, 4), torch.randn(3, 4), torch.randint(-5, 5, (3, 4), dtype=torch.int32)

    def numbers(a: torch.Tensor, b: torch.Tensor, i: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # float number, int number on the left, alpha, int32 + float32, int tensor * float number
        return a + 2.5, 1 + i, torch.add(a, b, alpha=2), i + a, i * 2.5, a - b

    got, want = torchtosa.compile(numbers, x, b, i)(x, b, i), numbers(x, b, i)
    assert [g.dtype for g in got] == [w.dtype for w in want]
    torch.testing.assert_close(got, want)


def test_compile_without_examples_compiles_on_first_call(xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    lazy = torchtosa.compile(foo)
    with pytest.raises(InputMismatch, match="nothing compiled yet"):
        _ = lazy.program
    torch.testing.assert_close(lazy(*xy), foo(*xy))
    assert "tosa.add" in str(lazy.program)


def test_keyword_arguments(xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = xy
    c = torchtosa.compile(foo, x, y=y)
    torch.testing.assert_close(c(x, y=y), foo(x, y))
    torch.testing.assert_close(c(x, y), foo(x, y))  # another structure: compiled again, still right


# ------------------------------------------------------------ modules, outputs, exported programs


class Affine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("shift", torch.randn(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.weight + self.shift


@torch.no_grad()  # inference: one whole-graph capture (with autograd, calls go through torch.compile)
def test_module_parameters_are_passed_without_copies() -> None:
    model, x = Affine(), torch.randn(3, 4)
    c = torchtosa.compile(model, x)
    captured = c.prepare(x).captured
    assert [p.data_ptr() for p in captured.params] == [model.weight.data_ptr(), model.shift.data_ptr()]
    torch.testing.assert_close(c(x), model(x))
    model.weight.add_(1.0)  # updated in place: the compiled function sees it
    torch.testing.assert_close(c(x), model(x))


def test_several_outputs_keep_their_structure() -> None:
    x, y = torch.randn(2, 3), torch.randn(2, 3)

    def many(a: torch.Tensor, b: torch.Tensor) -> object:
        return a + b, {"s": a + 1, "t": [b + 2.0, a]}, None, 3

    got, want = torchtosa.compile(many, x, y)(x, y), many(x, y)
    assert got[2:] == (None, 3)
    assert set(got[1]) == {"s", "t"} and isinstance(got[1]["t"], list)
    torch.testing.assert_close(got[:2], want[:2])

    def tup(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (a + 1, a + 2)

    got = torchtosa.compile(tup, x)(x)
    assert isinstance(got, tuple)
    torch.testing.assert_close(got, tup(x))


def test_exported_program() -> None:
    model, x = Affine(), torch.randn(3, 4)
    ep = torch.export.export(model, (x,))
    assert "tosa.add" in str(torchtosa.to_tosa(ep))
    c = torchtosa.compile(ep)
    other = torch.randn(3, 4)
    torch.testing.assert_close(c(other), model(other).detach())
    with pytest.raises(InputMismatch):
        c(torch.randn(5, 4))
    with pytest.raises(TypeError, match="carries its own example inputs"):
        torchtosa.to_tosa(ep, x)


# ------------------------------------------------------------ errors


def uses_bessel(x: torch.Tensor) -> torch.Tensor:
    return torch.special.bessel_j0(x) + 1


STRICT = {"fallback": "error"}


def test_unsupported_op_names_overload_and_user_line() -> None:
    """to_tosa and fallback="error" are strict: the error names the overload and the user's line."""
    x = torch.randn(4)
    where = f"{__file__}:{line_of(uses_bessel, 'bessel_j0')}"
    for attempt in (lambda: torchtosa.to_tosa(uses_bessel, x), lambda: torchtosa.compile(uses_bessel, x, **STRICT),
                    lambda: torch.compile(uses_bessel, backend="torchtosa", options=STRICT)(x)):
        with pytest.raises(Unsupported) as err:
            attempt()
        assert "aten.special_bessel_j0.default" in str(err.value)
        assert where in str(err.value)


def test_unsupported_op_falls_back_to_eager_and_says_where() -> None:
    """By default an op without a lowering runs eagerly: same result, one warning, explain() says why."""
    x = torch.randn(4)
    where = f"{__file__}:{line_of(uses_bessel, 'bessel_j0')}"
    with pytest.warns(torchtosa.FallbackWarning, match=r"1 of 2 ops run eagerly: aten.special_bessel_j0"):
        c = torchtosa.compile(uses_bessel, x, min_region_ops=1)
    torch.testing.assert_close(c(x), uses_bessel(x))
    text = str(c.explain())
    assert f"eager  aten.special_bessel_j0.default: no mapping in any registry — at {where}" in text
    assert "native region 0: 1 ops (aten.add.Tensor x1)" in text
    with pytest.warns(torchtosa.FallbackWarning, match="aten.special_bessel_j0"):
        torch.testing.assert_close(torch.compile(uses_bessel, backend="torchtosa")(x), uses_bessel(x))


def test_unsupported_in_a_dynamic_graph_names_user_line() -> None:
    compiled = torch.compile(uses_bessel, backend="torchtosa", dynamic=True, options=STRICT)
    with pytest.raises(Unsupported, match=rf"aten.special_bessel_j0.default.*{line_of(uses_bessel, 'bessel_j0')}"):
        compiled(torch.randn(6))
    with pytest.warns(torchtosa.FallbackWarning, match="aten.special_bessel_j0"):
        x = torch.randn(7)
        torch.testing.assert_close(torch.compile(uses_bessel, backend="torchtosa", dynamic=True)(x), uses_bessel(x))


def test_wrong_arguments_raise_input_mismatch(compiled_foo: torchtosa.CompiledFunction,
                                              xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    x, y = xy
    with pytest.raises(InputMismatch, match="missing a required argument"):
        compiled_foo(x)
    with pytest.raises(InputMismatch, match="too many positional arguments"):
        compiled_foo(x, y, x)
    with pytest.raises(InputMismatch, match="meta"):
        torchtosa.compile(foo, **STRICT)(x.to("meta"), y.to("meta"))
    # by default, inputs native code can't take (meta, sparse) run the function with PyTorch
    with pytest.warns(torchtosa.FallbackWarning, match="runs eagerly: tensor input 0 is on meta"):
        got = compiled_foo(x.to("meta"), y.to("meta"))
    assert got.device.type == "meta" and got.shape == x.shape
    sparse = x.to_sparse()
    with pytest.warns(torchtosa.FallbackWarning, match="sparse_coo"):
        torch.testing.assert_close(compiled_foo(sparse, y), foo(sparse, y))
    # the native code of one signature checks count, shape, dtype and device before running
    native = compiled_foo.prepare(x, y).run
    for args in [(x,), (x, y, y), (torch.randn(11), y), (x.double(), y), (x.to("meta"), y), (x, 1.0),
                 (x.to_sparse(), y)]:
        with pytest.raises(InputMismatch):
            native(*args)
    # through torch.compile, meta tensors reach the native code's checks too
    with pytest.raises(InputMismatch):
        torch.compile(foo, backend="torchtosa")(x.to("meta"), y.to("meta"))


def test_incompatible_shapes_are_invalid_input(compiled_foo: torchtosa.CompiledFunction) -> None:
    with pytest.raises(torchtosa.InvalidInput, match=r"broadcast|must match the size"):
        compiled_foo(torch.randn(3), torch.randn(4))


def test_noncontiguous_inputs(compiled_foo: torchtosa.CompiledFunction) -> None:
    base = torch.randn(10, 4)
    for x in (base[:, 1], base.t()[2], torch.randn(1).expand(10), torch.randn(20)[::2]):
        y = torch.randn(10)
        assert not x.is_contiguous()
        torch.testing.assert_close(compiled_foo(x, y), foo(x, y))
        torch.testing.assert_close(compiled_foo(y, x), foo(y, x))


def test_torch_compile_takes_a_transposed_input_as_stored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A permuted input (a transposed weight) reaches native code as the contiguous memory it
    views, permuted back inside the graph (`layouts.permute_inputs`), not copied; the same
    compiled graph given a contiguous tensor copies it and is right too."""
    received: list[torch.Tensor] = []
    native_call = NativeFunction.__call__

    def recording(self: NativeFunction, *args: torch.Tensor, known: int = 0) -> list[torch.Tensor]:
        received.extend(args)
        return native_call(self, *args, known=known)

    monkeypatch.setattr(NativeFunction, "__call__", recording)

    def affine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b + 1

    torch._dynamo.reset()
    compiled = torch.compile(affine, backend="torchtosa")
    a, w = torch.randn(8, 12), torch.randn(20, 12)
    torch.testing.assert_close(compiled(a, w.t()), affine(a, w.t()))
    assert [r.shape for r in received] == [(8, 12), (20, 12)] and received[1].data_ptr() == w.data_ptr()
    b = torch.randn(12, 20)
    torch.testing.assert_close(compiled(a, b), affine(a, b))
    torch._dynamo.reset()


def test_torch_compile_updates_a_transposed_input_in_place() -> None:
    """A permuted input the graph writes into stays as it is (the write goes to its memory)."""
    def bump(x: torch.Tensor) -> torch.Tensor:
        x.add_(1)
        return x * 2

    torch._dynamo.reset()
    w = torch.randn(6, 4)
    want_w = w.clone()
    want = bump(want_w.t())
    got = torch.compile(bump, backend="torchtosa")(w.t())
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(w, want_w)
    torch._dynamo.reset()


def test_torch_compile_outputs_that_are_views_of_inputs_are_views() -> None:
    """Outputs that are an input, views of one or another output again are PyTorch's views and
    the same tensor (`layouts.split_alias_outputs`); a graph of nothing else compiles nothing."""
    def views(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.t(), x.unsqueeze(0)

    def mixed(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = torch.relu(x)
        return y, x.t(), y

    torch._dynamo.reset()
    x = torch.randn(3, 5)
    for fn in (views, mixed):
        got = torch.compile(fn, backend="torchtosa")(x)
        for g, w in zip(got, fn(x), strict=True):
            torch.testing.assert_close(g, w)
    got = torch.compile(views, backend="torchtosa")(x)
    assert all(g.data_ptr() == x.data_ptr() for g in got)
    y, xt, again = torch.compile(mixed, backend="torchtosa")(x)
    assert xt.data_ptr() == x.data_ptr() and again is y
    torch._dynamo.reset()


def test_zero_size_inputs_are_a_clear_error_in_strict_mode_and_run_eagerly_otherwise() -> None:
    z = torch.randn(0, 4)
    with pytest.raises(Unsupported, match="zero-size"):
        torchtosa.compile(foo, z, z, **STRICT)
    with pytest.warns(torchtosa.FallbackWarning, match="zero-size"):
        c = torchtosa.compile(foo, z, z)
    assert c(z, z).shape == (0, 4)


def test_a_cat_drops_its_empty_operands() -> None:
    """torch.cat's operands that add nothing (empty along its dim, or torch's legacy 1-D [0], as
    HF's DynamicCache starts each layer's keys) are dropped: the rest runs natively, and the empty
    input is no argument of the native code (TOSA has no zero-size tensors)."""
    def grow(cache: torch.Tensor, legacy: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([cache, x], dim=-2) * 2, torch.cat([legacy, x], dim=-2) + 1

    args = (torch.randn(1, 2, 0, 8), torch.tensor([]), torch.randn(1, 2, 3, 8))
    compiled = torchtosa.compile(grow, *args, **STRICT)
    for got, want in zip(compiled(*args), grow(*args), strict=True):
        torch.testing.assert_close(got, want)


def test_an_empty_constant_a_cat_drops_is_no_constant_of_the_native_code() -> None:
    """An empty tensor the function makes itself (a constant of the graph, as in a Llama's
    prefill) is left unread once its cat drops it, and is not imported: TOSA has no zero-size
    constant, and the graph used to fail its first, whole-graph attempt on it."""
    def grow(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.tensor([]), x], dim=-2) * 2

    x = torch.randn(1, 2, 3, 8)
    torch.testing.assert_close(torchtosa.compile(grow, x, **STRICT)(x), grow(x))
    torch.testing.assert_close(torch.compile(grow, backend="torchtosa", options=STRICT)(x), grow(x))
    torch._dynamo.reset()


# (start, step, dtype) of aranges of RUN_TIME_ARANGE elements and more: a negative step, int32,
# floats whose values round (computed in double, then rounded once, as the constant's are)
LONG_ARANGES = [(5, 3, torch.int64), (100_000, -7, torch.int32), (0.5, 0.37, torch.float32),
                (1e7, 0.1, torch.float32), (-3.0, 1e-4, torch.float64)]


@pytest.mark.parametrize(("start", "step", "dtype"), LONG_ARANGES, ids=str)
def test_a_long_arange_is_computed_by_the_code_not_embedded(start: float, step: float, dtype: torch.dtype) -> None:
    """An arange of `rules.RUN_TIME_ARANGE` elements or more is computed by the native code (a
    2^20-element int64 constant took 5 s to compile), with the values the constant had: start +
    i * step in int64, or in double rounded once. One element fewer stays a constant, and so do
    long ones under a TOSA target (TOSA has no iota)."""
    from torchtosa.importer.rules import RUN_TIME_ARANGE

    for n in (RUN_TIME_ARANGE - 1, RUN_TIME_ARANGE + 3):
        end = start + step * (n - 0.5)
        want = torch.tensor([start + step * i for i in range(n)], dtype=torch.float64 if dtype.is_floating_point
                            else torch.int64).to(dtype)
        assert torch.arange(start, end, step).numel() == n

        def add(x: torch.Tensor, end: float = end) -> torch.Tensor:
            return x + torch.arange(start, end, step, dtype=dtype)

        x = (torch.randn(n) * 100).to(dtype)
        got = torchtosa.compile(add, x, **STRICT)(x)
        assert got.dtype == dtype and torch.equal(got, x + want), n  # one rounding of the same sum
        native = str(torchtosa.to_tosa(add, x, target=None).module)
        assert ("linalg.index" in native) == (n >= RUN_TIME_ARANGE) and len(native) < 30 * n, n
        if dtype != torch.float64:  # TOSA has no f64
            aim = "TOSA-1.1+FP+INT+int64" if dtype == torch.int64 else "TOSA-1.0+FP+INT"
            conformant = str(torchtosa.to_tosa(add, x, target=aim).module)
            assert "linalg" not in conformant and len(conformant) > 4 * n, n


@pytest.mark.parametrize("setting", [True, False])
def test_concurrent_calls_leave_the_mha_fast_path_as_the_user_set_it(setting: bool) -> None:
    """A compiled function keeps PyTorch's MHA fast path off while it runs (capture.trace.
    mha_fastpath_disabled); calls from several threads at once restore the user's setting when
    the last one leaves. Each call saving and restoring it alone left it off for the process."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU()).eval()
    x = torch.randn(4, 16)
    compiled = torchtosa.compile(model, x)
    before = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(setting)
    try:
        start = threading.Barrier(8)

        def calls(_: int) -> None:
            start.wait()
            for _ in range(200):
                compiled(x)

        with torch.no_grad(), concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(calls, range(8)))
        assert torch.backends.mha.get_fastpath_enabled() is setting
    finally:
        torch.backends.mha.set_fastpath_enabled(before)


def test_data_dependent_shapes() -> None:
    x, mask = torch.randn(5, 4), torch.randn(5, 4) > 0

    def masked(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return a[m] + 1

    def nonzero(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return torch.nonzero(m) + 1

    for fn in (masked, nonzero):
        with pytest.raises(Unsupported, match="data-dependent"):
            torchtosa.compile(fn, x, mask, **STRICT)
        with pytest.warns(torchtosa.FallbackWarning, match="not one graph"):
            torch.testing.assert_close(torchtosa.compile(fn, x, mask)(x, mask), fn(x, mask))
        # torch.compile breaks the graph there and runs the rest natively: same answer as eager
        torch.testing.assert_close(torch.compile(fn, backend="torchtosa")(x, mask), fn(x, mask))


def test_in_place_updates_of_inputs() -> None:
    x = torch.randn(3)

    def bump(a: torch.Tensor) -> torch.Tensor:
        a.add_(1)
        return a + 1

    before = x.clone()
    with pytest.raises(Unsupported, match="in place"):
        torchtosa.compile(bump, x, **STRICT)
    assert torch.equal(x, before)  # a failed compile leaves the input alone
    with pytest.warns(torchtosa.FallbackWarning, match="in place"):
        c = torchtosa.compile(bump, x)
    assert torch.equal(x, before)  # so does compiling: the update happens when it is called
    torch.testing.assert_close(c(x), bump(before.clone()))  # the add is native and writes its result
    torch.testing.assert_close(x, before + 1)  # into the caller's tensor, as eager does
    parts = c.explain().parts
    assert not c.explain().eager and not any(isinstance(p, WriteBack) for p in parts)
    (writes,) = [p.writes for p in parts if isinstance(p, NativeRegion)]
    assert len(writes) == 1 and "a" in writes[0]  # Dynamo's name of the input: l_a_

    eager, compiled = x.clone(), x.clone()
    want = bump(eager)
    torch.testing.assert_close(torch.compile(bump, backend="torchtosa")(compiled), want)
    torch.testing.assert_close(compiled, eager)  # torch.compile applies the update like eager

    def local(a: torch.Tensor) -> torch.Tensor:
        b = a + 1
        b.add_(2)
        return b

    torch.testing.assert_close(torchtosa.compile(local, x)(x), local(x))


def test_complex_values_are_a_clear_error_in_strict_mode_and_run_eagerly_otherwise() -> None:
    c = torch.randn(3, dtype=torch.complex64)
    with pytest.raises(Unsupported, match="complex64"):
        torchtosa.compile(foo, c, c, **STRICT)
    with pytest.warns(torchtosa.FallbackWarning, match="complex64"):
        torch.testing.assert_close(torchtosa.compile(foo, c, c)(c, c), foo(c, c))


# ------------------------------------------------------------ caching, recompiles, threads, memory


def test_same_function_reuses_native_code(xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    CACHE.clear()
    first = torchtosa.compile(foo, *xy)
    assert len(CACHE.entries) == 1
    second = torchtosa.compile(foo, *xy)
    assert len(CACHE.entries) == 1
    assert first.prepare(*xy).run is second.prepare(*xy).run


def test_new_shape_recompiles_and_old_shape_still_works() -> None:
    c = torchtosa.compile(foo)
    shapes = [(3, 4), (5, 6), (3, 4), (1,), (5, 6)]
    for shape in shapes:
        x, y = torch.randn(shape), torch.randn(shape)
        torch.testing.assert_close(c(x, y), foo(x, y))
    assert len(c.compiled) == 3
    ints = torch.randint(0, 9, (3, 4), dtype=torch.int64)
    torch.testing.assert_close(c(ints, ints + 1), foo(ints, ints + 1))


def test_same_tensor_twice_is_its_own_signature() -> None:
    a, b = torch.randn(3), torch.randn(3)
    c = torchtosa.compile(foo, a, a)  # traced as one input used twice
    torch.testing.assert_close(c(a, a), foo(a, a))
    torch.testing.assert_close(c(a, b), foo(a, b))  # must not reuse the graph of foo(a, a)
    torch.testing.assert_close(c(b, b), foo(b, b))
    unused = torchtosa.compile(lambda p, q: p + 1, a, b)  # an input the graph never reads
    torch.testing.assert_close(unused(a, b), a + 1)


def test_repeated_calls_skip_the_general_path_and_stay_right(monkeypatch: pytest.MonkeyPatch) -> None:
    """A signature called again goes straight to its native code (`_FastCall`): no `prepare`.
    Calls it can't serve as it was compiled take the general path and are right: another
    layout of the same sizes, a tensor passed twice, an input that requires grad; a module's
    parameters are read at every call, so their new values count."""
    prepared = []
    prepare = torchtosa.CompiledFunction.prepare
    monkeypatch.setattr(torchtosa.CompiledFunction, "prepare",
                        lambda self, *a, **k: prepared.append(1) or prepare(self, *a, **k))

    def affine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b + a.sum()

    a, b = torch.randn(6, 6), torch.randn(6, 6)
    compiled = torchtosa.compile(affine)
    for _ in range(3):
        torch.testing.assert_close(compiled(a, b), affine(a, b))
    assert len(prepared) == 1 and len(compiled._fast) == 1
    torch.testing.assert_close(compiled(a, b.t()), affine(a, b.t()))  # strides differ
    torch.testing.assert_close(compiled(a, a), affine(a, a))  # the same tensor twice
    assert len(prepared) == 3
    x = a.clone().requires_grad_()
    out = compiled(x, b)  # with autograd: as torch.compile
    assert out.requires_grad
    out.sum().backward()
    ref = a.clone().requires_grad_()
    affine(ref, b).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad)

    model = torch.nn.Linear(6, 3).eval()
    module = torchtosa.compile(model)
    with torch.no_grad():
        module(a)
        model.weight.mul_(-2.0)
        torch.testing.assert_close(module(a), model(a))
        model.weight.data = torch.randn(4, 6)  # sizes the native code was not compiled for
        with pytest.raises(torchtosa.InputMismatch):
            module(a)


@pytest.mark.parametrize("dynamic", [None, True])
def test_torch_compile_with_changing_shapes(dynamic: bool | None) -> None:
    torch._dynamo.reset()
    compiled = torch.compile(foo, backend="torchtosa", dynamic=dynamic)
    for shape in [(3, 4), (5, 6), (7, 2), (3, 4)]:
        x, y = torch.randn(shape), torch.randn(shape)
        torch.testing.assert_close(compiled(x, y), foo(x, y))


def test_concurrent_calls() -> None:
    c = torchtosa.compile(lambda a: a + 1.5, torch.randn(64, 64))
    failures: list[int] = []

    def work(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(100):
            a = torch.randn(64, 64, generator=g)
            if not torch.equal(c(a), a + 1.5):
                failures.append(seed)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_many_calls_do_not_grow_memory() -> None:
    a = torch.randn(128, 128)  # each call returns a new 64 KiB tensor
    c = torchtosa.compile(lambda t: t + 1.0, a)
    for _ in range(200):
        c(a)
    before = rss()
    for _ in range(10_000):
        c(a)
    assert rss() - before < 64 * 1024 * 10_000 // 20  # leaking every output would be 625 MiB


# ------------------------------------------------------------ the generated registry


@pytest.fixture
def fresh_registry() -> object:
    registry_module.registry.cache_clear()
    yield
    registry_module.registry.cache_clear()


def test_stale_registry_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, fresh_registry: object,
                                         xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    monkeypatch.setattr(registry_module, "source_hash", lambda *_: "not-the-hash")
    with pytest.raises(TorchTosaError, match=r"stale.*make gen"):
        torchtosa.to_tosa(foo, *xy)


def test_missing_registry_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, fresh_registry: object,
                                           xy: tuple[torch.Tensor, torch.Tensor]) -> None:
    monkeypatch.delattr(torchtosa._generated, "registry", raising=False)
    monkeypatch.setitem(sys.modules, "torchtosa._generated.registry", None)  # importing it fails
    with pytest.raises(TorchTosaError, match=r"missing.*make gen"):
        torchtosa.to_tosa(foo, *xy)


@pytest.mark.parametrize("front", ["torchtosa.compile", "torch.compile"])
def test_a_debug_repro_runs_a_graph_with_infinite_constants(front: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph's code names an infinity as `inf` (an attention mask's -inf): its repro defines it.
    The graphs torch.compile's AOTAutograd makes are classes named "<lambda>": the repro's is not."""
    from torchtosa import debug
    from torchtosa.api import CACHE

    monkeypatch.setenv(debug.ENV, str(tmp_path))

    def masked_softmax(x: torch.Tensor) -> torch.Tensor:
        return x.masked_fill(x > 1, float("-inf")).softmax(-1)

    CACHE.clear()
    torch._dynamo.reset()
    x = torch.randn(3, 8)
    compiled = (torchtosa.compile(masked_softmax, x) if front == "torchtosa.compile"
                else torch.compile(masked_softmax, backend="torchtosa"))
    compiled(x)
    (graph,) = (p for p in tmp_path.iterdir() if p.name.startswith("graph-"))
    assert "-inf" in (graph / "repro.py").read_text()
    repro = subprocess.run([sys.executable, "repro.py"], cwd=graph, capture_output=True, text=True, check=False)
    assert repro.returncode == 0, repro.stderr
    diffs = [float(line.rsplit(" ", 1)[1]) for line in repro.stdout.splitlines() if line.startswith("max |")]
    assert len(diffs) == 1 and diffs[0] < 1e-6


def test_debug_artifacts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """TORCHTOSA_DEBUG: each native compile writes its graph, TOSA, the module after every stage,
    the LLVM IR and its timings to a folder named by its key; an equal compile, the same folder.
    Each graph gets a folder too: its code, explain(), a picture and a repro that runs."""
    from torchtosa import debug
    from torchtosa.api import CACHE

    monkeypatch.setenv(debug.ENV, str(tmp_path))
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()
    x = torch.randn(2, 16)
    CACHE.clear()
    with torch.no_grad():
        compiled = torchtosa.compile(model, x)
        compiled(x)
        written = sorted(p.name for p in tmp_path.iterdir())
        CACHE.clear()
        torchtosa.compile(model, x)(x)
    assert sorted(p.name for p in tmp_path.iterdir()) == written
    (graph,) = (tmp_path / n for n in written if n.startswith("graph-"))
    (folder,) = (tmp_path / n for n in written if not n.startswith("graph-"))
    assert (graph / "explain.txt").read_text() == f"graph\n{compiled.explain()}\n"
    picture = (graph / "graph.html").read_text()
    assert f'href="../{folder.name}/tosa.mlir"' in picture and "addmm = addmm.default(" in picture
    repro = subprocess.run([sys.executable, "repro.py"], cwd=graph, capture_output=True, text=True, check=False)
    assert repro.returncode == 0, repro.stderr
    diffs = [float(line.rsplit(" ", 1)[1]) for line in repro.stdout.splitlines() if line.startswith("max |")]
    assert len(diffs) == 1 and diffs[0] < 1e-5
    names = sorted(p.name for p in folder.iterdir())
    assert {"graph.py", "tosa.mlir", "kernel.ll", "compile.txt"} <= set(names)
    assert "aten.addmm" in (folder / "graph.py").read_text() and "tosa.matmul" in (folder / "tosa.mlir").read_text()
    stages = [n for n in names if n.endswith(".mlir") and n[:2].isdigit()]
    assert stages[0] == "01-partition.mlir" and stages[-1].endswith("-llvm.mlir")
    log = (folder / "compile.txt").read_text()
    assert "inputs f32[32, 16]" in log and "schedule: " in log and "LLVM code generation" in log
