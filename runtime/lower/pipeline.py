"""The MLIR pass pipeline that lowers a TOSA module to the LLVM dialect.

Lowering runs as named stages (`PIPELINES`, in order) so that a failure names
the stage it happened in. Booleans (i1) must never be stored in memory: MLIR's
MemRef-to-LLVM conversion asserts on sub-byte elements and would abort the
whole process. So before "linalg" every use of an elementwise i1 result gets
its own producer (which elementwise fusion then inlines into the consumer), and
before "llvm" a guard raises CompileError on any remaining i1 buffer.

TOSA's folders are not IEEE-exact: `tosa.mul` by a splat zero folds to zero (inf * 0 and
NaN * 0 are NaN) and `tosa.add` of a splat zero folds to the other operand (-0.0 + 0.0
is +0.0). Every greedy pass and the dialect conversion apply folders, and a zero can
appear by folding anywhere upstream (a cast of a constant, an integer `i * 0`). So before
"tosa-to-linalg" every float `tosa.mul`/`tosa.add` becomes the `linalg.generic` that
tosa-to-linalg would make of it, whose `arith.mulf`/`arith.addf` fold exactly.

With opt="default"/"parallel", int8 matmuls and convolutions lose their zero points before
"tosa-to-linalg" (`zero_points`): plain i8 contractions, which are then computed as exact f32
contractions (`float_int8`: int8 products summed over at most 1024 terms are exact in f32), so
that they run on the schedule's f32 FMA kernel, or, for a constant second operand on a CPU
whose entry has an int8 dot product (`vpdpbusd`, `vpmaddwd`), become a call of a kernel on it
(`int8_dot`; the instruction is a placeholder call until "llvm", as buffer deallocation rejects
the intrinsic, an op of unknown effects).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from mlir import ir
from mlir.dialects import arith, func, linalg, memref, tensor

from .. import progress
from ..cpu import Cpu, select
from ..errors import CompileError, NotInPlace
from ..internal import blame
from . import amx, int8_dot
from .convolutions import rewrite_convolutions
from .copies import row_copies
from .float_int8 import fast_int8_contractions
from .fusion import fuse_elementwise
from .half import round_bf16_in_integers
from .irutil import find_ops, is_sub_byte, iterator_types, producer, run_passes, top_level
from .partition import partition
from .reduction_identities import infinite_identities
from .schedule import schedule
from .sink import sink_transposes
from .static_args import constant_fields, private_arg_types, unoptimized_glue
from .zero_points import separate_zero_points

PIPELINES: dict[str, str] = {
    # TOSA -> linalg/tensor/arith/scf on tensors. Decompositions and shape
    # passes first, as in MLIR's own tosa-to-linalg-pipeline (minus validation).
    # tosa-to-scf (cond_if, while_loop, scatter) must precede tosa-to-linalg,
    # which rejects scatter. No canonicalize while TOSA ops remain: TOSA's
    # folders are not IEEE-exact (x * 0.0 folds to 0 even for x = inf or NaN);
    # float mul/add are already linalg.generic here (_exact_float_arith).
    # Ops of fallback dialects applied to tensors (math.atan, ...: ElementwiseMappable)
    # become linalg.generic like the TOSA ones.
    "tosa-to-linalg": "builtin.module(func.func("
    "tosa-optional-decompositions,tosa-infer-shapes,"
    "tosa-make-broadcastable,tosa-to-scf,tosa-to-linalg-named,"
    "tosa-to-linalg,tosa-to-arith{include-apply-rescale=true},"
    "convert-elementwise-to-linalg))",
    # Fuse elementwise ops while reshapes are still tosa.reshape (opaque to fusion): once
    # they are tensor.collapse/expand_shape, fusion moves them between an i1 producer
    # and its consumer (a broadcast operand blocks the expansion that would rejoin
    # them), and the i1 result is materialized. Only shape ops of TOSA remain here,
    # whose folders are exact. Folding a tosa.reshape of a constant (an int8 weight of a
    # frozen quantized model) makes a new tosa.const: tosa-to-arith again turns it into arith.
    "fuse-before-reshapes": "builtin.module(linalg-fuse-elementwise-ops,func.func(tosa-to-tensor,tosa-to-arith))",
    # Tensor-level cleanup. Fusing elementwise ops removes most intermediate
    # buffers, including i1 comparison results; detensorizing turns rank-0
    # ops (e.g. a cond_if predicate) into scalars, so they need no buffer.
    "linalg": "builtin.module(canonicalize,linalg-fuse-elementwise-ops,"
    "func.func(linalg-detensorize{aggressive-mode}),canonicalize,cse)",
    # Dynamic shapes only (`_DYNAMIC_STAGES`): tosa-to-tensor reshapes a dynamic tensor by
    # collapsing it to 1-D and expanding that, which stops elementwise fusion (a bias add and
    # the activation after it stayed two loops). Canonicalize has made such pairs one reshape
    # by now; fusion moves it, and once size queries of the producer's result are answered
    # from its operands (resolve-...-dims) and dropped, fuses the two.
    "fuse-dynamic": "builtin.module(" + ",".join(["func.func(resolve-ranked-shaped-type-result-dims),canonicalize,"
                                                  "linalg-fuse-elementwise-ops,canonicalize,cse"] * 2) + ")",
    # opt="default" only: 1x1 convolutions become matmuls and depthwise ones lose the channel
    # multiplier (`convolutions`); then drop unit dimensions so that broadcasts such as a bias add become
    # projected permutations the schedule can tile, and fuse the elementwise loops that now have
    # one shape (`fusion.fuse_elementwise`, after the passes); then `schedule.schedule` tiles and
    # vectorizes (a Python stage, running MLIR's transform interpreter).
    "unit-dims": "builtin.module(func.func(linalg-fold-unit-extent-dims),canonicalize,cse)",
    "schedule": "",
    # Tensors -> memrefs. Loops (tosa.while_loop) may yield new buffers. First, sizes of dynamic
    # tensors are answered from the operands they derive from and min/max of loop-bound indices
    # inside loops are folded: one-shot analysis compares every tensor.insert_slice with the
    # extract_slices of its destination through ValueBounds (Presburger sets), and
    # chains of loop-carried dynamic sizes made that most of a dynamic module's compile time.
    "bufferize": "builtin.module("
    "func.func(resolve-shaped-type-result-dims,scf-for-loop-canonicalization),"
    "one-shot-bufferize{bufferize-function-boundaries allow-return-allocs-from-loops "
    "function-boundary-type-conversion=identity-layout-map})",
    # The calling convention. First a part's result that is its argument's buffer is dropped, the
    # call's operand used instead (of a dynamic shape, computed into a buffer its caller passes:
    # `partition._destinations`; a layer's KV cache updated in place: `_returned_arguments`), and
    # an update of the caller's tensor is no result (`_written_in_place`); the others become
    # caller-allocated out-params, hence modify-public-functions (without it the pass silently
    # does nothing). Buffers of a loop-invariant size allocated in a loop (a packed matmul
    # panel) are allocated once, before it.
    "out-params": "builtin.module("
    "buffer-results-to-out-params{hoist-static-allocs=true modify-public-functions=true},"
    "func.func(buffer-loop-hoisting),buffer-deallocation-pipeline)",
    # opt="parallel" only: the column-panel loops of matmuls and the per-thread chunks of other
    # large ops (scf.forall, `schedule.thread_split`) become OpenMP worksharing loops (statically
    # scheduled: a contiguous block of iterations per thread), run by the OpenMP
    # runtime of the `intel-openmp` package (libiomp5), whose idle workers spin a while before
    # sleeping: a region starts in microseconds instead of waking a sleeping thread pool.
    "openmp": "builtin.module(func.func(scf-forall-to-parallel),convert-scf-to-openmp)",
    # Loops, vectors and memrefs -> LLVM dialect. Vector transfers are fully unrolled (a partial
    # unroll leaves stack allocations inside loops). Math ops without an LLVM intrinsic (erf, ...)
    # become libm calls (vector ones one element at a time), before the vector lowering. A buffer
    # left outside the arena (a run-time size) comes from torchtosa's `_mlir_memref_to_llvm_alloc`
    # (execute/buffers.py: freed buffers kept for the next call), not from malloc.
    "llvm": "builtin.module("
    "convert-vector-to-scf{full-unroll=true},convert-linalg-to-loops,expand-strided-metadata,lower-affine,"
    "convert-scf-to-cf,convert-math-to-llvm,convert-math-to-libm,"
    "convert-vector-to-llvm{enable-x86vector=true enable-amx=true},"
    "convert-ub-to-llvm,"
    "finalize-memref-to-llvm{use-generic-functions=true},convert-arith-to-llvm,convert-func-to-llvm,"
    "convert-cf-to-llvm,convert-openmp-to-llvm,reconcile-unrealized-casts)",
}

OPT_LEVELS = ("none", "default", "parallel")
_OPTIMIZING_STAGES = ("unit-dims", "schedule")  # skipped by opt="none"
_PARALLEL_STAGES = ("openmp",)  # run by opt="parallel" only
_DYNAMIC_STAGES = ("fuse-dynamic",)  # optimizing stages run on modules with dynamic shapes only


def check_opt(opt: str) -> str:
    """`opt` if it names an optimization level, else ValueError listing them."""
    if opt not in OPT_LEVELS:
        raise ValueError(f"unknown optimization level {opt!r}; choose one of {', '.join(map(repr, OPT_LEVELS))}")
    return opt


Scratch = tuple[tuple[int, ...], int]  # (shape, bytes per element) of a buffer the caller provides


def lower(module: ir.Module, opt: str = "default", stop_before: str | None = None,
          on_stage: Callable[[str, float], None] | None = None, cpu: Cpu | None = None) -> list[Scratch]:
    """Lower a TOSA module in place to the LLVM dialect (or up to the stage `stop_before`), for
    `cpu` (an entry of the CPU table; by default `cpu.select()`: $TORCHTOSA_CPU or the host's).

    With opt="default" or "parallel", a long function is first cut into parts (`partition`),
    and the function's intermediate buffers are carved out of one
    extra trailing byte-buffer argument (after the outputs, `_promote_allocations`): the caller
    allocates it once and reuses it for every call, instead of the native code allocating and
    freeing (and the kernel zeroing) each buffer each time. Returns the shape and element size
    of each such argument, in argument order (none with opt="none").
    `on_stage(stage, seconds)` is called after each stage that ran ("partition" first).
    Raises CompileError naming the failing stage, with MLIR's diagnostics.
    """
    check_opt(opt)
    cpu = cpu or select()
    scratch: list[Scratch] = []
    results: dict[str, int] = {}
    start = time.perf_counter()

    def done(stage: str) -> None:
        nonlocal start
        if on_stage is not None:
            now = time.perf_counter()
            on_stage(stage, now - start)
            start = now

    stage = "partition"  # the stage running: an exception of torchtosa's own is blamed on it
    try:
        if opt != "none":
            progress.stage("partition")
            sink_transposes(module)  # consecutive convolutions stay NHWC, across part boundaries too
            partition(module)
            done("partition")
        for stage, pipeline in PIPELINES.items():
            if stage == stop_before:
                break
            if (stage in _OPTIMIZING_STAGES and opt == "none") or (stage in _PARALLEL_STAGES and opt != "parallel"):
                continue
            if stage in _DYNAMIC_STAGES and (opt == "none" or not _dynamic_shapes(module)):
                continue
            progress.stage(stage)
            if stage == "schedule":
                try:
                    schedule(module, parallel=opt == "parallel", cpu=cpu)
                except ir.MLIRError as e:
                    raise CompileError(f"stage {stage!r} failed: {e}") from e
                done(stage)
                continue
            if stage == "tosa-to-linalg":
                if opt != "none":
                    separate_zero_points(module)
                    fast_int8_contractions(module, cpu)
                _exact_float_arith(module)
            if stage == "fuse-before-reshapes":
                infinite_identities(module)  # tosa-to-linalg's maxima start from the lowest finite value
                _no_dynamic_broadcasts(module)
            if stage in ("fuse-before-reshapes", "linalg"):
                _split_boolean_producers(module)
            if stage == "unit-dims":
                rewrite_convolutions(module, cpu)  # 1x1 as matmuls, depthwise without the multiplier
            if stage == "bufferize":
                results = _result_counts(module)
                _distinct_results(module)
                _private_empty_tensors(module)
            if stage == "out-params":
                _returned_arguments(module)
                run_passes(module, "builtin.module(drop-equivalent-buffer-results)")
                _written_in_place(module)
            if stage == "llvm":
                _reject_sub_byte_buffers(module)
                if cpu.bf16_round == "integer":
                    round_bf16_in_integers(module)
                if opt != "none":
                    row_copies(module)
                    int8_dot.lower_calls(module)
                    amx.lower(module)
                    _results_in_place(module, results)
                    scratch = _promote_allocations(module)
            _verify(module, f"the input of stage {stage!r}")
            private = private_arg_types(module) if stage == "llvm" and opt != "none" else {}
            try:
                run_passes(module, pipeline)
            except ir.MLIRError as e:
                raise CompileError(f"stage {stage!r} failed: {e}") from e
            if private:
                constant_fields(module, private)
                unoptimized_glue(module)
            if stage == "unit-dims":
                fuse_elementwise(module)
                run_passes(module, "builtin.module(canonicalize,cse)")
            if stage == "llvm":
                target(module, cpu)
            done(stage)
        _verify(module, "the lowered module")
    except Exception as err:
        blame(err, stage=f"stage {stage!r}")
        raise
    return scratch


def target(module: ir.Module, cpu: Cpu) -> None:
    """Mark the LLVM functions of `module` as code for `cpu`'s LLVM CPU (`target-cpu`, and empty
    `target-features`: the CPU's own), unless `cpu` is the host's entry: then LLVM generates for
    the host, every feature it detects, as `-mcpu=native`. Such code is compiled by LLVM for that
    CPU (`execute.native._load`, `export_library`), not by the JIT, whose target machine is the host's."""
    if cpu.native:
        return
    with module.context:
        for op in module.body.operations:
            if op.operation.name == "llvm.func" and op.regions[0].blocks:
                op.attributes["target_cpu"] = ir.StringAttr.get(cpu.llvm_cpu)
                op.attributes["target_features"] = ir.Attribute.parse("#llvm.target_features<[]>")


def _dynamic_shapes(module: ir.Module) -> bool:
    """Whether a function of `module` takes or returns a tensor with a dynamic dimension."""
    for op in module.body.operations:
        if op.operation.name == "func.func":
            signature = ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value)
            if any(isinstance(t, ir.RankedTensorType) and not ir.RankedTensorType(t).has_static_shape
                   for t in [*signature.inputs, *signature.results]):
                return True
    return False


def _verify(module: ir.Module, what: str) -> None:
    """CompileError if `module` is invalid IR (the passes run without verifying after each
    pass, `run_passes`; a pass given invalid IR may crash rather than fail)."""
    try:
        module.operation.verify()
    except ir.MLIRError as e:
        raise CompileError(f"{what} is invalid: {e}") from e


# Uses that mean deallocation decides at run time who owns a buffer: never hand such a buffer
# to the caller, whose memory the native code must not free.
_OWNERSHIP_OPS = ("memref.extract_aligned_pointer_as_index", "bufferization.dealloc", "memref.realloc",
                  "func.call", "func.return", "scf.yield")


def _promote_allocations(module: ir.Module) -> list[Scratch]:
    """Carve each static memref.alloc at the top of a function out of one trailing byte-buffer
    argument (an arena), at an offset that no buffer live at the same time overlaps.

    One argument rather than one per buffer: each memref argument becomes 3 + 2 * rank scalar
    arguments of the LLVM function, and LLVM's code generation is quadratic in a call with
    thousands of them. Buffers whose lifetimes do not overlap share memory, which keeps the
    working set small and in cache. A private function (a part of a partitioned function) gets
    its arena from its caller, as a buffer live during the call: parts share memory too.
    Returns the arena of each public function.
    """
    functions = {ir.StringAttr(op.attributes["sym_name"]).value: op for op in module.body.operations
                 if op.operation.name == "func.func" and op.regions[0].blocks}
    private = {name for name, f in functions.items()
               if "sym_visibility" in f.attributes and ir.StringAttr(f.attributes["sym_visibility"]).value == "private"}
    arenas: dict[str, int] = {}  # private function -> size of its arena
    scratch: list[Scratch] = []
    for name in sorted(functions, key=lambda name: name not in private):  # callees first
        func = functions[name]
        _pass_arenas(func, arenas)
        total = _carve_arena(func, private)
        if total is None:
            continue
        if name in private:
            arenas[name] = total
        else:
            scratch.append(((total,), 1))
    return scratch


def _pass_arenas(func: ir.OpView, arenas: dict[str, int]) -> None:
    """Give each call in `func`'s body to a function with an arena a new buffer for it."""
    with func.context, ir.Location.unknown():
        for op in list(func.regions[0].blocks[0].operations):
            callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value if op.operation.name == "func.call" else None
            if callee not in arenas:
                continue
            with ir.InsertionPoint(op):
                arena = memref.AllocOp(ir.MemRefType.get([arenas[callee]], ir.IntegerType.get_signless(8)), [], [])
                call = ir.Operation.create("func.call", results=[r.type for r in op.results],
                                           operands=[*op.operands, arena.result],
                                           attributes={n: op.attributes[n] for n in op.operation.attributes})
                memref.DeallocOp(arena.result, ip=ir.InsertionPoint.after(call))
            for old, new in zip(op.results, call.results, strict=True):
                old.replace_all_uses_with(new)
            op.erase()


def _carve_arena(func: ir.OpView, internal: set[str]) -> int | None:
    """Replace `func`'s promotable allocations by views of a new trailing arena argument; its
    size, or None if there is nothing to promote."""
    entry = func.regions[0].blocks[0]
    allocs = [op for op in entry.operations if op.operation.name == "memref.alloc"
              and not op.operands and _plain_memref(op.results[0].type)
              and not _half_float(ir.MemRefType(op.results[0].type).element_type)
              and not any(_owned_elsewhere(u.owner, internal) for u in op.results[0].uses)]
    if not allocs:
        return None
    position = {op.operation: i for i, op in enumerate(entry.operations)}
    buffers = []
    for alloc in allocs:
        t = ir.MemRefType(alloc.results[0].type)
        size = max(1, math.prod(t.shape)) * _element_bytes(t.element_type)
        last = max((position[top_level(user, func.operation)] for user in _alias_users(alloc.results[0])),
                   default=position[alloc.operation])
        buffers.append((position[alloc.operation], last, size))
    offsets, total = _assign_offsets(buffers)
    signature = ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value)
    with func.context, ir.Location.unknown():
        arena_type = ir.MemRefType.get([total], ir.IntegerType.get_signless(8))
        arena = entry.add_argument(arena_type, ir.Location.unknown())
        for alloc, offset in zip(allocs, offsets, strict=True):
            with ir.InsertionPoint(alloc), alloc.location:
                shift = arith.ConstantOp(ir.IndexType.get(), offset).result
                view = memref.ViewOp(alloc.results[0].type, arena, shift, []).result
            for use in list(alloc.results[0].uses):
                if use.owner.name == "memref.dealloc":
                    use.owner.erase()
            alloc.results[0].replace_all_uses_with(view)
            alloc.operation.erase()
        func.attributes["function_type"] = ir.TypeAttr.get(
            ir.FunctionType.get([*signature.inputs, arena_type], signature.results))
        if "arg_attrs" in func.attributes:
            attrs = [*ir.ArrayAttr(func.attributes["arg_attrs"]), ir.DictAttr.get({})]
            func.attributes["arg_attrs"] = ir.ArrayAttr.get(attrs)
    return total


# A function attribute: the results it computes into arguments instead, `[result, argument, ...]`
# (an update of the caller's tensor, `native._prepare`); the argument is writable.
WRITES_ATTR = "torchtosa.writes"


def _written_in_place(module: ir.Module) -> None:
    """Drop each result of WRITES_ATTR from its function (a public one, which no call uses): one
    bufferization computed in its argument's buffer (`_buffer_base`) is there already; another is
    copied into it at the end, after every read of the old value (a counter's `+ 1`, computed in a
    buffer of its own). NotInPlace if another result lives in that buffer too: the caller
    compiles the function without the writes instead."""
    for function in module.body.operations:
        if function.operation.name != "func.func" or WRITES_ATTR not in function.attributes:
            continue
        pairs = list(ir.DenseI64ArrayAttr(function.attributes[WRITES_ATTR]))
        del function.attributes[WRITES_ATTR]
        entry = function.regions[0].blocks[0]
        ret = list(entry.operations)[-1]
        written = dict(zip(pairs[::2], pairs[1::2], strict=True))
        bases = [_buffer_base(v) for v in ret.operands]
        with module.context, ret.location:
            for k, i in written.items():
                argument, value = entry.arguments[i], ret.operands[k]
                if bases[k] == argument:
                    continue
                if value.type != argument.type or any(b == argument for b in bases):
                    raise NotInPlace(f"result {k} of @{ir.StringAttr(function.attributes['sym_name']).value} "
                                     f"can't be written into its argument {i}")
                memref.CopyOp(value, argument, ip=ir.InsertionPoint(ret))
            kept = [v for k, v in enumerate(ret.operands) if k not in written]
            func.ReturnOp(kept, ip=ir.InsertionPoint(ret))
            ret.erase()
            signature = ir.FunctionType(ir.TypeAttr(function.attributes["function_type"]).value)
            function.attributes["function_type"] = ir.TypeAttr.get(
                ir.FunctionType.get(signature.inputs, [v.type for v in kept]))


def _returned_arguments(module: ir.Module) -> None:
    """A private function's result that is one of its arguments' buffers (`_buffer_base`: a
    layer's KV cache, updated in place through reshapes and a scatter's loop) returns that
    argument itself, for drop-equivalent-buffer-results to drop (which sees no further)."""
    for function in module.body.operations:
        if (function.operation.name != "func.func" or not function.regions[0].blocks
                or "sym_visibility" not in function.attributes):
            continue
        entry = function.regions[0].blocks[0]
        ret = list(entry.operations)[-1]
        for k, value in enumerate(ret.operands):
            base = _buffer_base(value)
            if base != value and isinstance(base, ir.BlockArgument) and base.owner == entry and base.type == value.type:
                ret.operands[k] = base


_VIEWS = ("memref.expand_shape", "memref.collapse_shape", "memref.cast")


def _buffer_base(value: ir.Value) -> ir.Value:
    """The buffer `value` is, seen through views (`_VIEWS`) and loops that yield the buffer
    they carry (a scatter's loop, in place)."""
    while isinstance(value, ir.OpResult):
        op = value.owner
        if op.name in _VIEWS:
            value = op.operands[0]
        elif op.name == "scf.for":
            body = op.regions[0].blocks[0]
            carried = body.arguments[1 + value.result_number]
            if list(body.operations)[-1].operands[value.result_number] != carried:
                break
            value = op.operands[3 + value.result_number]
        else:
            break
    return value


def _result_counts(module: ir.Module) -> dict[str, int]:
    """The number of results of each function of `module` that become output arguments, the
    last ones (on tensors: before bufferization; one materialized in or written into an
    argument, which is dropped, is not one)."""
    counts = {}
    for op in module.body.operations:
        if op.operation.name != "func.func" or not op.regions[0].blocks:
            continue
        entry = op.regions[0].blocks[0]
        ret = list(entry.operations)[-1]
        written = len(ir.DenseI64ArrayAttr(op.attributes[WRITES_ATTR])) // 2 if WRITES_ATTR in op.attributes else 0
        counts[ir.StringAttr(op.attributes["sym_name"]).value] = sum(
            1 for v in ret.operands if not (isinstance(v, ir.OpResult)
                                            and v.owner.name == "bufferization.materialize_in_destination"
                                            and isinstance(v.owner.operands[1], ir.BlockArgument)
                                            and v.owner.operands[1].owner == entry)) - written
    return counts


def _results_in_place(module: ir.Module, results: dict[str, int]) -> None:
    """Compute each result in the caller's output buffer where bufferization left a copy.

    buffer-results-to-out-params hoists static allocations that are returned as they are to the
    caller; a result of a dynamic size, a reshape of a buffer (dropping unit dims made a
    `[1, H, W, C]` result an expanded `[H, W, C]` buffer) or a loop's result (every tiled op's:
    the loop's initial buffer is not what is returned) is computed into a buffer of its own,
    then copied into the output argument: a whole extra pass over the output (`x + 1` on 4.8 MB
    ran at half eager's speed). Where that buffer is allocated in the function's entry block and
    the copy is its last use but a deallocation, the output argument replaces it, reshaped back
    (`_view_of`) if the copy read it through reshapes.
    """
    for function in module.body.operations:
        if function.operation.name != "func.func" or not function.regions[0].blocks:
            continue
        entry = function.regions[0].blocks[0]
        first_output = len(entry.arguments) - results.get(ir.StringAttr(function.attributes["sym_name"]).value, 0)
        ops = list(entry.operations)
        position = {op.operation: i for i, op in enumerate(ops)}
        for copy in [op for op in ops if op.operation.name == "memref.copy"]:  # (deallocs are erased below)
            source, target = copy.operands
            reshapes = _reshapes(source)
            buffer = reshapes[-1].operands[0] if reshapes else source
            alloc = producer(buffer)
            if (alloc is None or alloc.name != "memref.alloc" or alloc.parent != function.operation
                    or not isinstance(target, ir.BlockArgument) or target.owner != entry
                    or target.arg_number < first_output or source.type != target.type
                    or len(list(target.uses)) != 1 or (reshapes and list(alloc.operands))):
                # a dynamic buffer is taken only without reshapes (`_view_of` rebuilds static shapes)
                continue
            later = [u.owner for u in buffer.uses
                     if position.get(top_level(u.owner, function.operation), -1) > position[copy.operation]]
            if any(user.name != "memref.dealloc" for user in later):
                continue
            for user in later:
                user.erase()
            copy.operation.erase()
            with ir.InsertionPoint.at_block_begin(entry), alloc.location:
                view = _view_of(target, reshapes)
            for reshape in reshapes:
                reshape.erase()
            buffer.replace_all_uses_with(view)
            alloc.erase()


def _reshapes(value: ir.Value) -> list[ir.Operation]:
    """The chain of memref.expand_shape / collapse_shape ops (each with that one use) that
    `value` is a view of, outermost first."""
    chain: list[ir.Operation] = []
    while True:
        op = producer(value)
        if op is None or op.name not in ("memref.expand_shape", "memref.collapse_shape") or len(list(value.uses)) != 1:
            return chain
        chain.append(op)
        value = op.operands[0]


def _view_of(target: ir.Value, reshapes: list[ir.Operation]) -> ir.Value:
    """`target` reshaped by the inverse of each of `reshapes` (outermost first, static shapes):
    the buffer whose view through `reshapes` is `target`."""
    value = target
    for op in reshapes:
        source = ir.MemRefType(op.operands[0].type)
        groups = [[int(ir.IntegerAttr(d).value) for d in ir.ArrayAttr(g)]
                  for g in ir.ArrayAttr(op.attributes["reassociation"])]
        if op.name == "memref.expand_shape":
            value = memref.CollapseShapeOp(source, value, groups).result
        else:
            value = memref.ExpandShapeOp(source, value, groups, [], list(source.shape)).result
    return value


def _owned_elsewhere(user: ir.OpView, internal: set[str]) -> bool:
    """Whether `user` means deallocation decides at run time who owns a buffer (a call to a
    function of this module does not: the caller keeps it)."""
    if user.name == "func.call":
        return ir.FlatSymbolRefAttr(user.attributes["callee"]).value not in internal
    return user.name in _OWNERSHIP_OPS


def _half_float(t: ir.Type) -> bool:
    """f16 and bf16 stay in their own allocations: viewed in the arena, LLVM's x86 backend
    aborts on some of their loads and stores ("Unexpected illegal type")."""
    return isinstance(t, ir.F16Type | ir.BF16Type)


_ALIGNMENT = 64  # bytes: a cache line, and what torch's CPU allocator guarantees for the arena


def _assign_offsets(buffers: list[tuple[int, int, int]]) -> tuple[list[int], int]:
    """Byte offsets for buffers given as (first, last position where live, size), such that
    buffers live at the same time never overlap (first fit, largest first); and the arena size."""
    offsets = [0] * len(buffers)
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    for i in sorted(range(len(buffers)), key=lambda i: (-buffers[i][2], i)):
        first, last, size = buffers[i]
        size = -(-size // _ALIGNMENT) * _ALIGNMENT
        offset = 0
        for start, end, other_first, other_last in sorted(placed):
            if other_last < first or last < other_first or end <= offset:
                continue  # not live at the same time, or below the candidate offset
            if start >= offset + size:
                break
            offset = end
        offsets[i] = offset
        placed.append((offset, offset + size, first, last))
    return offsets, max((end for _, end, _, _ in placed), default=0) or _ALIGNMENT


def _alias_users(value: ir.Value) -> list[ir.Operation]:
    """Every op that uses `value` or a view of it (subview, reshape, cast...), transitively."""
    users: list[ir.Operation] = []
    pending = [value]
    while pending:
        for use in list(pending.pop().uses):
            users.append(use.owner)
            if use.owner.name.startswith("memref."):
                pending += [r for r in use.owner.results if isinstance(r.type, ir.MemRefType)]
    return users


def _plain_memref(t: ir.Type) -> bool:
    """A static, contiguous memref in the default memory space (no layout or space printed)."""
    return isinstance(t, ir.MemRefType) and t.has_static_shape and ", " not in str(t)


def _element_bytes(t: ir.Type) -> int:
    """The bytes an element takes in memory: LLVM's alloc size, a power of two (an i48, TOSA's
    accumulator of int16 convolutions, takes 8)."""
    if isinstance(t, ir.IndexType):
        return 8
    width = t.width if isinstance(t, ir.IntegerType) else ir.FloatType(t).width
    return 1 << max(0, (width - 1).bit_length() - 3)


_FLOAT_ARITH = {"tosa.mul": arith.MulFOp, "tosa.add": arith.AddFOp}


def _exact_float_arith(module: ir.Module) -> None:
    """Replace each float tosa.mul / tosa.add by a broadcasting linalg.generic of arith.mulf / addf.

    The generic is what tosa-to-linalg makes of the op (a size-1 operand dimension is read
    at index 0); only no TOSA folder sees it, so `x * 0.0` stays NaN for x = inf or NaN and
    `-0.0 + 0.0` stays +0.0. arith's folders are IEEE-exact (mulf x, 1 and addf x, -0 only).
    """
    found = find_ops(module, lambda op: (
        op.name in _FLOAT_ARITH and len(op.results) == 1
        and isinstance(op.results[0].type, ir.RankedTensorType)
        and isinstance(ir.RankedTensorType(op.results[0].type).element_type, ir.FloatType)))
    with module.context:
        _generic_float_arith(found)


def _generic_float_arith(found: list[ir.Operation]) -> None:
    for op in found:
        result = ir.RankedTensorType(op.results[0].type)
        shape, elem = list(result.shape), result.element_type
        operands = list(op.operands)[:2]  # tosa.mul's third operand is its (integer-only) shift
        if not result.has_static_shape or any(ir.RankedTensorType(v.type).rank != len(shape) for v in operands):
            continue  # not what the importer emits; leave it to tosa-to-linalg
        maps = []
        for v in operands:
            dims = ir.RankedTensorType(v.type).shape
            exprs = [ir.AffineExpr.get_constant(0) if d != n else ir.AffineDimExpr.get(i)
                     for i, (d, n) in enumerate(zip(dims, shape, strict=True))]
            maps.append(ir.AffineMapAttr.get(ir.AffineMap.get(len(shape), 0, exprs)))
        maps.append(ir.AffineMapAttr.get(ir.AffineMap.get_identity(len(shape))))
        with ir.InsertionPoint(op), op.location:
            empty = tensor.EmptyOp(shape, elem).result
            generic = linalg.GenericOp([result], operands, [empty], ir.ArrayAttr.get(maps),
                                       iterator_types(len(shape)))
            body = generic.regions[0].blocks.append(elem, elem, elem)
            with ir.InsertionPoint(body):
                linalg.YieldOp([_FLOAT_ARITH[op.name](body.arguments[0], body.arguments[1]).result])
        op.results[0].replace_all_uses_with(generic.results[0])
        op.erase()


def _no_dynamic_broadcasts(module: ir.Module) -> None:
    """Drop tosa-to-linalg's run-time broadcast of dynamic dims: `scf.if (dim == 1)` choosing
    between an operand and its broadcast copy becomes the operand.

    TOSA can't say that two `?` dims are the same size, so upstream checks at run time whether
    one of them is 1 and copies the operand broadcast if so; the copies also stop elementwise
    fusion. The importer knows more: every dynamic dim of an elementwise operand is the same
    symbol as the result's (`Builder.equal_rank` checks it; torch broadcasts only static 1s in
    a symbolic graph), so where it is 1 at run time both sides are 1 and broadcasting changes
    nothing."""
    found = find_ops(module, lambda op: (
        op.name == "scf.if" and len(op.regions[1].blocks) == 1 and _is_size_one_test(op.operands[0])
        and all(isinstance(r.type, ir.RankedTensorType) for r in op.results)))
    for op in reversed(found):
        else_yield = list(op.regions[1].blocks[0].operations)[-1]
        if any(producer(v) is not None and producer(v).parent == op for v in else_yield.operands):
            continue  # the else branch computes something: not a broadcast choice
        for result, value in zip(op.results, list(else_yield.operands), strict=True):
            result.replace_all_uses_with(value)
        op.erase()


def _is_size_one_test(cond: ir.Value) -> bool:
    """Whether `cond` is `arith.cmpi eq, (tensor.dim ...), 1`."""
    op = producer(cond)
    if op is None or op.name != "arith.cmpi" or ir.IntegerAttr(op.attributes["predicate"]).value != 0:
        return False
    defs = [producer(v) for v in op.operands]
    names = sorted(d.name if d is not None else "" for d in defs)
    one = [d for d in defs if d is not None and d.name == "arith.constant"]
    return names == ["arith.constant", "tensor.dim"] and ir.IntegerAttr(one[0].attributes["value"]).value == 1


def _split_boolean_producers(module: ir.Module) -> None:
    """Clone each all-parallel linalg.generic with an i1 result once per extra use.

    Elementwise fusion only inlines producers with a single use, so a boolean
    mask used twice would otherwise be materialized as an i1 buffer.
    """
    producers = find_ops(module, lambda op: (
        op.name == "linalg.generic"
        and "reduction" not in str(op.attributes["iterator_types"])
        and any(is_sub_byte(ir.ShapedType(r.type).element_type) for r in op.results)))
    # Consumers first: their clones add uses to the producers they read.
    for op in reversed(producers):
        _clone_per_extra_use(op)


def _private_empty_tensors(module: ir.Module) -> None:
    """Give each use of a tensor.empty its own: CSE merges them, and bufferization then makes
    ops that only share an uninitialized destination conflict, resolved with buffer copies."""
    for op in find_ops(module, lambda op: op.name == "tensor.empty" and not op.operands):
        _clone_per_extra_use(op)


def _clone_per_extra_use(op: ir.Operation) -> None:
    """Give every use of `op`'s results after the first its own clone of `op`."""
    for i, result in enumerate(op.results):
        for use in list(result.uses)[1:]:
            clone = op.clone(ip=ir.InsertionPoint(op))
            use.owner.operands[use.operand_number] = clone.results[i]


def _distinct_results(module: ir.Module) -> None:
    """Give each func.return operand after its first occurrence its own copy.

    buffer-results-to-out-params crashes the process (a segfault) when one buffer is
    returned twice, as for `return y, y` or two results folded into one by CSE.
    """
    for ret in find_ops(module, lambda op: op.name == "func.return"):
        seen: list[ir.Value] = []
        for i, value in enumerate(list(ret.operands)):
            if value in seen and isinstance(value.type, ir.RankedTensorType):
                with ir.InsertionPoint(ret), ret.location:
                    kind = ir.RankedTensorType(value.type)
                    sizes = [tensor.dim(value, arith.constant(ir.IndexType.get(), i))
                             for i in range(kind.rank) if kind.is_dynamic_dim(i)]
                    dest = ir.Operation.create("tensor.empty", results=[value.type], operands=sizes).result
                    copy = ir.Operation.create("bufferization.materialize_in_destination",
                                               results=[value.type], operands=[value, dest])
                ret.operands[i] = copy.result
            seen.append(value)


def _reject_sub_byte_buffers(module: ir.Module) -> None:
    """Raise CompileError if any memref has elements narrower than a byte."""
    found: list[str] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        types = [r.type for r in op.results]
        types += [a.type for region in op.regions for block in region.blocks for a in block.arguments]
        if op.name == "memref.global":
            types.append(ir.TypeAttr(op.attributes["type"]).value)
        for t in types:
            if isinstance(t, ir.MemRefType) and is_sub_byte(t.element_type):
                found.append(f"{op.name} at {op.location}: {t}")
                return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    if found:
        raise CompileError(
            "stage 'bufferize' produced a buffer of sub-byte elements, which the "
            f"LLVM lowering cannot handle (booleans must be i8 in memory): {found[0]}"
        )
