"""Benchmark runner: quack_kernels against torch eager, torch.compile, Liger and QuACK.

    python -m quack_kernels.bench [--op softmax_fwd,softmax_bwd] [--dtype bf16] [--quick]

Every kernel here is memory bound, so the figure of merit is bandwidth: each case
reports the time, the bandwidth implied by a simple byte model (every input read once,
every output written once) and that bandwidth as a percentage of a device-to-device
copy measured in the same process. The copy is the practical ceiling: a kernel that
reads and writes each byte once cannot go faster than the copy engine of the same GPU.

Without a GPU the runner falls back to ``quack_kernels.report``, which compiles every
kernel for sm_90a and prints their resource usage, so the command is useful anywhere.

Adding an op means adding one :class:`OpBench` entry to ``OPS``; ops whose
``quack_kernels`` API does not exist yet are skipped, so the runner works while ops land.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import functools
import gc
import importlib
import importlib.metadata
import importlib.util
import itertools
import math
import pathlib
import re
import statistics
import sys
import types
import dataclasses
from typing import Callable

import torch

GiB = 1 << 30
MiB = 1 << 20

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# Largest footprint a case may have; bigger cases are skipped rather than risking an
# OOM that would take the rest of the run down with it.
MAX_CASE_BYTES = 40 * GiB
# Copy-ceiling buffer: far larger than L2, so the copy streams from and to DRAM.
COPY_CEILING_BYTES = 2 * GiB
# Inputs smaller than this many L2s are rotated among several copies so that each call
# reads data that the previous calls have pushed out of L2.
COLD_L2_MULTIPLE = 4
MAX_INPUT_COPIES = 32
# H200 has 60 MiB of L2; used when the device properties do not say.
DEFAULT_L2_BYTES = 60 * MiB
# Budgets for one timing, in milliseconds of GPU time.
WARMUP_MS = 25
REP_MS = 100
HOST_SAMPLES = 10
# A case times its implementations in turn, this many rounds of REP_MS / rounds each,
# and keeps each one's median round: a host whose speed drifts during a case (the
# H200 host's moved 2x between calls of one session, and within a run) then weighs on
# every implementation alike instead of on whichever ran in its slow stretch.
TIMING_ROUNDS = 5

OURS = "quack_kernels"

Inputs = dict[str, torch.Tensor]
Builder = Callable[[Inputs], Callable[[], object]]


class Unavailable(Exception):
    """Raised by a builder whose baseline package is not installed: skipped silently."""


@dataclasses.dataclass(frozen=True)
class OpBench:
    """One benchmarked op.

    ``ours`` and each baseline are *builders*: given one set of inputs they do any
    per-input preparation (compiling, precomputing launch settings) and return a
    zero-argument callable that is what gets timed. A builder raises
    :class:`Unavailable` when its package is absent; any other exception is recorded in
    the CSV as that implementation's error and the run continues.
    """

    name: str
    group: str  # CSV file the results go to, one per family of ops
    available: Callable[[], bool]  # whether quack_kernels has the API yet
    make_inputs: Callable[[int, int, torch.dtype], Inputs]
    ours: Builder
    baselines: dict[str, Builder]
    model_bytes: Callable[[int, int, torch.dtype], int]
    shapes: tuple[tuple[int, int], ...]
    quick_shapes: tuple[tuple[int, int], ...]
    dtypes: tuple[str, ...] = tuple(DTYPES)
    # Time back-to-back calls instead of isolated ones, so that host overhead (Python,
    # dispatch, autograd) shows up whenever it exceeds the GPU time.
    host_inclusive: bool = False
    # Outputs of a few bytes per row (a loss alone): isolated calls after an L2 flush
    # that reads, leaving L2 clean. The usual flush writes, and leaves L2 full of dirty
    # lines that the timed call writes back: an op writing its own output leaves as
    # many of its own lines unwritten when it ends, so it pays for its bytes alone, but
    # an op that writes nothing paid for ~50 MB it never wrote (the bf16 loss of
    # 131072x1024 logits: 67.2 us of kernel, 76.6 after the writing flush; H200).
    reads_only: bool = False
    # Baselines that write over their inputs (Liger's cross-entropy stores the gradient
    # in the logits): each gets input sets of its own, so that the others are timed on
    # the data they were given.
    overwrites_inputs: frozenset = frozenset()
    # Implementations timed in turn (TIMING_ROUNDS); False: one after another, each
    # freed before the next is built (a replayed CUDA graph holds its memory pool, and
    # kernels alone need no shelter from the host's drift).
    interleaved: bool = True

    @property
    def timing(self) -> str:
        """How its calls are timed (the CSV's ``timing`` column)."""
        if self.host_inclusive:
            return "back-to-back"
        return "after a reading L2 flush" if self.reads_only else "after a writing L2 flush"


@dataclasses.dataclass
class Result:
    """One (op, dtype, shape, implementation) measurement; ``error`` set on failure."""

    op: str
    dtype: str
    M: int
    N: int
    impl: str
    time_us: float | None = None
    gbps: float | None = None
    pct_of_copy: float | None = None
    speedup_vs_best_baseline: float | None = None
    timing: str = ""  # OpBench.timing
    error: str = ""


# --------------------------------------------------------------------------- helpers


def _quack_kernels():
    """Our package, imported on first use so that ``--help`` and the no-GPU path stay
    free of the DSL import."""
    return importlib.import_module("quack_kernels")


def _has_api(*names: str) -> bool:
    """Whether ``quack_kernels`` exports every name (the op has landed)."""
    qk = _quack_kernels()
    return all(hasattr(qk, name) for name in names)


def _has_torch_op(name: str) -> bool:
    """Whether ``torch.ops.quack_kernels.<name>`` is registered (importing the package
    registers its ops)."""
    _quack_kernels()
    return hasattr(torch.ops.quack_kernels, name)


def _optional_module(module: str):
    """Import a baseline's module; :class:`Unavailable` when its package is not
    installed. An installed package that fails to import raises, which records an
    error: a broken baseline should be visible, an absent one should not."""
    if importlib.util.find_spec(module.split(".")[0]) is None:
        raise Unavailable(module)
    return importlib.import_module(module)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    """torch.compile of an eager reference, made once per function.

    ``dynamic=False`` specialises on each shape and dtype, like a kernel library does;
    the first call of a case (the warm-up in :func:`_prepared`) triggers that
    specialisation, so compile time never lands in a timing. The recompile limit is
    raised because one function sees every shape and dtype of a run, more than the
    default allows before Dynamo silently falls back to eager.
    """
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    return torch.compile(fn, dynamic=False)


def _elem(dtype: torch.dtype) -> int:
    return dtype.itemsize


# ------------------------------------------------------------------- softmax family
#
# Shapes: M*N = 2^27 elements (256 MiB in bf16) for a sweep of row lengths, a few
# model-like shapes, and one very long row that needs a full 16-CTA cluster.

SOFTMAX_SHAPES = tuple((2**27 // n, n) for n in (1024, 4096, 16384, 65536, 262144)) + (
    (4096, 4096),
    (1024, 8192),
    (256, 32000),
    (128, 1048576),
)
SOFTMAX_QUICK_SHAPES = ((4096, 4096), (2**27 // 262144, 262144))


def _eager_softmax(x):
    return torch.softmax(x, -1)


def _eager_log_softmax(x):
    return torch.log_softmax(x, -1)


def _eager_softmax_bwd(y, dy):
    return torch._softmax_backward_data(dy, y, -1, y.dtype)


def _eager_log_softmax_bwd(y, dy):
    return torch._log_softmax_backward_data(dy, y, -1, y.dtype)


def _rows(M: int, N: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(M, N, device="cuda", dtype=dtype)


def _forward_inputs(M, N, dtype) -> Inputs:
    return {"x": _rows(M, N, dtype)}


def _backward_inputs(log: bool) -> Callable[[int, int, torch.dtype], Inputs]:
    """Inputs of a backward: a genuine forward output ``y`` (the kernels rely on its
    range) and a random upstream gradient ``dy``."""
    reference = _eager_log_softmax if log else _eager_softmax

    def make(M, N, dtype) -> Inputs:
        return {"y": reference(_rows(M, N, dtype)), "dy": _rows(M, N, dtype)}

    return make


def _training_inputs(M, N, dtype) -> Inputs:
    return {"x": _rows(M, N, dtype).requires_grad_(), "dy": _rows(M, N, dtype)}


def _unary(resolve: Callable[[], Callable]) -> Builder:
    """Builder timing ``f(x)``; ``resolve`` returns ``f`` and runs at build time so
    that optional imports happen inside the runner's error handling."""
    return lambda inputs: functools.partial(resolve(), inputs["x"])


def _binary(resolve: Callable[[], Callable]) -> Builder:
    """Builder timing ``f(y, dy)``."""
    return lambda inputs: functools.partial(resolve(), inputs["y"], inputs["dy"])


def _training_step(resolve: Callable[[], Callable]) -> Builder:
    """Builder timing one autograd step ``f(x).backward(dy)``, as a training loop runs
    it. ``x.grad`` is dropped first so that backward writes a fresh gradient instead of
    accumulating into the previous one (an extra read-modify-write)."""

    def build(inputs):
        f, x, dy = resolve(), inputs["x"], inputs["dy"]

        def step():
            x.grad = None
            f(x).backward(dy)

        return step

    return build


def _ours_softmax(log: bool) -> Callable:
    return functools.partial(getattr(_quack_kernels(), "log_softmax" if log else "softmax"), dim=-1)


def _ours_softmax_bwd(log: bool) -> Callable:
    op = torch.ops.quack_kernels.softmax_backward
    return lambda y, dy: op(y, dy, log)


def _liger_softmax() -> Callable:
    return _optional_module("liger_kernel.ops.softmax").LigerSoftmaxFunction.apply


def _liger_softmax_bwd(inputs: Inputs) -> Callable[[], object]:
    """Liger's backward kernel alone. Its launch settings come from its forward helper,
    run once here on a tensor of the same shape; only the backward is timed."""
    liger = _optional_module("liger_kernel.ops.softmax")
    y, dy = inputs["y"], inputs["dy"]
    _, *settings = liger._softmax_forward(y)
    return lambda: liger._softmax_backward(dy, y, *settings)


def _quack_softmax() -> Callable:
    """QuACK's autograd softmax. Its package ``__init__`` rebinds ``quack.softmax`` from
    the submodule to the function; take the function either way."""
    fn = _optional_module("quack").softmax
    return fn.softmax if isinstance(fn, types.ModuleType) else fn


def _quack_softmax_bwd() -> Callable:
    quack_softmax = _optional_module("quack.softmax")
    return lambda y, dy: quack_softmax.softmax_bwd(dy, y)


def _softmax_forward_bench(log: bool) -> OpBench:
    eager = _eager_log_softmax if log else _eager_softmax
    baselines = {
        "torch": _unary(lambda: eager),
        "torch_compile": _unary(lambda: _compiled(eager)),
    }
    if not log:  # Liger and QuACK have no log-softmax
        baselines |= {"liger": _unary(_liger_softmax), "quack": _unary(_quack_softmax)}
    return OpBench(
        name="log_softmax_fwd" if log else "softmax_fwd",
        group="softmax",
        available=lambda: _has_api("log_softmax" if log else "softmax"),
        make_inputs=_forward_inputs,
        ours=_unary(lambda: _ours_softmax(log)),
        baselines=baselines,
        # read x, write y: 2 * M * N elements
        model_bytes=lambda M, N, dtype: 2 * M * N * _elem(dtype),
        shapes=SOFTMAX_SHAPES,
        quick_shapes=SOFTMAX_QUICK_SHAPES,
    )


def _softmax_backward_bench(log: bool) -> OpBench:
    eager = _eager_log_softmax_bwd if log else _eager_softmax_bwd
    baselines = {
        "torch": _binary(lambda: eager),
        "torch_compile": _binary(lambda: _compiled(eager)),
    }
    if not log:
        baselines |= {"liger": _liger_softmax_bwd, "quack": _binary(_quack_softmax_bwd)}
    return OpBench(
        name="log_softmax_bwd" if log else "softmax_bwd",
        group="softmax",
        available=lambda: _has_torch_op("softmax_backward"),
        make_inputs=_backward_inputs(log),
        ours=_binary(lambda: _ours_softmax_bwd(log)),
        baselines=baselines,
        # read y and dy, write dx: 3 * M * N elements
        model_bytes=lambda M, N, dtype: 3 * M * N * _elem(dtype),
        shapes=SOFTMAX_SHAPES,
        quick_shapes=SOFTMAX_QUICK_SHAPES,
    )


def _softmax_training_bench() -> OpBench:
    """Forward plus backward through the public API and autograd, timed back to back:
    this is what a model pays per call, host overhead included, which is the point."""
    return OpBench(
        name="softmax_fwdbwd",
        group="softmax",
        available=lambda: _has_api("softmax"),
        make_inputs=_training_inputs,
        ours=_training_step(lambda: _ours_softmax(False)),
        baselines={
            "torch": _training_step(lambda: _eager_softmax),
            "torch_compile": _training_step(lambda: _compiled(_eager_softmax)),
            "liger": _training_step(_liger_softmax),
            "quack": _training_step(_quack_softmax),
        },
        # forward reads x, writes y; backward reads y, dy, writes dx: 5 * M * N elements
        model_bytes=lambda M, N, dtype: 5 * M * N * _elem(dtype),
        shapes=((4096, 4096),),
        quick_shapes=((4096, 4096),),
        dtypes=("bf16",),
        host_inclusive=True,
    )



# ----------------------------------------------------------------------- norm family
#
# RMSNorm and LayerNorm over the last dim, weight (and bias) of x's dtype. Shapes as
# softmax's, up to the N = 262144 the kernels support.

NORM_SHAPES = tuple((M, N) for M, N in SOFTMAX_SHAPES if N <= 262144)
NORM_QUICK_SHAPES = SOFTMAX_QUICK_SHAPES


def _norm_inputs(residual: bool, backward: bool):
    def make(M, N, dtype) -> Inputs:
        inputs = {"x": _rows(M, N, dtype), "w": torch.randn(N, device="cuda", dtype=dtype),
                  "b": torch.randn(N, device="cuda", dtype=dtype)}
        if residual:
            inputs["r"] = _rows(M, N, dtype)
        if backward:
            inputs["dy"] = _rows(M, N, dtype)
        return inputs

    return make


def _eager_norm(rms: bool):
    F = torch.nn.functional

    def fn(x, w, b, r=None):
        if r is not None:
            h = x + r
            return (F.rms_norm(h, (x.shape[-1],), w, 1e-6) if rms
                    else F.layer_norm(h, (x.shape[-1],), w, b, 1e-5)), h
        return F.rms_norm(x, (x.shape[-1],), w, 1e-6) if rms else F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)

    return fn


def _ours_norm(rms: bool):
    def fn(x, w, b, r=None):
        qk = _quack_kernels()
        prenorm = r is not None
        if rms:
            return qk.rms_norm(x, w, residual=r, prenorm=prenorm)
        return qk.layer_norm(x, w, b, residual=r, prenorm=prenorm)

    return fn


def _liger_norm(rms: bool):
    def fn(x, w, b, r=None):
        if r is not None:
            raise Unavailable("liger norms take no residual")
        if rms:
            return _optional_module("liger_kernel.ops.rms_norm").LigerRMSNormFunction.apply(x, w, 1e-6)
        return _optional_module("liger_kernel.ops.layer_norm").LigerLayerNormFunction.apply(x, w, b, 1e-5)

    return fn


def _quack_norm(rms: bool):
    def fn(x, w, b, r=None):
        if rms:
            mod = _optional_module("quack.rmsnorm")
            if r is not None:
                return mod.rmsnorm(x, w, residual=r, prenorm=True, eps=1e-6)
            return mod.rmsnorm(x, w, eps=1e-6)
        if r is not None:
            raise Unavailable("quack layernorm takes no residual")
        # without the bias (QuACK's LayerNorm takes none): no db in its backward
        return _optional_module("quack.layernorm").layernorm(x, w, eps=1e-5)

    return fn


def _norm_forward_builder(resolve: Callable[[], Callable]) -> Builder:
    """Builder timing the forward ``f(x, w, b[, r])``."""

    def build(inputs):
        f = resolve()
        args = [inputs["x"], inputs["w"], inputs["b"]] + ([inputs["r"]] if "r" in inputs else [])
        f(*args)  # raises Unavailable here rather than inside the timing
        return functools.partial(f, *args)

    return build


def _norm_backward_builder(resolve: Callable[[], Callable], with_bias: bool) -> Builder:
    """Builder timing the backward alone: the forward graph is built once, each call
    computes (dx, dw[, db]) from it with ``torch.autograd.grad``."""

    def build(inputs):
        f = resolve()
        x = inputs["x"].detach().requires_grad_()
        w = inputs["w"].detach().requires_grad_()
        b = inputs["b"].detach().requires_grad_() if with_bias else None
        y = f(x, w, b)
        leaves = (x, w, b) if with_bias else (x, w)
        dy = inputs["dy"]
        return lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)

    return build


def _norm_training_builder(resolve: Callable[[], Callable], with_bias: bool) -> Builder:
    """Builder timing one training step ``f(x, w, b).backward(dy)`` through autograd,
    the gradients of x, w (and b) dropped first so that none accumulates."""

    def build(inputs):
        f = resolve()
        x = inputs["x"].detach().requires_grad_()
        w = inputs["w"].detach().requires_grad_()
        b = inputs["b"].detach().requires_grad_() if with_bias else None
        dy = inputs["dy"]

        def step():
            x.grad = w.grad = None
            if b is not None:
                b.grad = None
            f(x, w, b).backward(dy)

        return step

    return build


# Issue 3's training-step shapes: host overhead dominates every implementation there
NORM_TRAINING_SHAPES = ((1024, 8192), (4096, 4096))


def _norm_benches(rms: bool) -> list[OpBench]:
    name = "rms_norm" if rms else "layer_norm"
    eager = _eager_norm(rms)
    with_bias = not rms
    weights = (1 if rms else 2)  # per-column vectors, negligible next to M * N
    resolvers = {"torch": lambda: eager, "torch_compile": lambda: _compiled(eager),
                 "liger": lambda: _liger_norm(rms), "quack": lambda: _quack_norm(rms)}
    fwd_baselines = {impl: _norm_forward_builder(r) for impl, r in resolvers.items()}
    bwd_baselines = {impl: _norm_backward_builder(r, with_bias) for impl, r in resolvers.items()}
    training_baselines = {impl: _norm_training_builder(r, with_bias) for impl, r in resolvers.items()}
    available = lambda: _has_api(name)  # noqa: E731
    return [
        OpBench(
            name=f"{name}_fwd", group="norm", available=available,
            make_inputs=_norm_inputs(residual=False, backward=False),
            ours=_norm_forward_builder(lambda: _ours_norm(rms)), baselines=fwd_baselines,
            # read x, write y: 2 * M * N elements (+ the weights)
            model_bytes=lambda M, N, dtype: (2 * M * N + weights * N) * _elem(dtype),
            shapes=NORM_SHAPES, quick_shapes=NORM_QUICK_SHAPES),
        OpBench(
            name=f"{name}_fwd_res", group="norm", available=available,
            make_inputs=_norm_inputs(residual=True, backward=False),
            ours=_norm_forward_builder(lambda: _ours_norm(rms)), baselines=fwd_baselines,
            # read x and residual, write y and the residual stream x + residual: 4 * M * N
            model_bytes=lambda M, N, dtype: (4 * M * N + weights * N) * _elem(dtype),
            shapes=NORM_SHAPES, quick_shapes=NORM_QUICK_SHAPES),
        OpBench(
            name=f"{name}_bwd", group="norm", available=available,
            make_inputs=_norm_inputs(residual=False, backward=True),
            ours=_norm_backward_builder(lambda: _ours_norm(rms), with_bias),
            baselines=bwd_baselines,
            # read x and dy, write dx: 3 * M * N elements (+ weights and their gradients;
            # the fp32 per-CTA partials of dw/db stay O(#SMs * N))
            model_bytes=lambda M, N, dtype: (3 * M * N + 2 * weights * N) * _elem(dtype),
            shapes=NORM_SHAPES, quick_shapes=NORM_QUICK_SHAPES),
        OpBench(
            name=f"{name}_fwdbwd", group="norm", available=available,
            make_inputs=_norm_inputs(residual=False, backward=True),
            ours=_norm_training_builder(lambda: _ours_norm(rms), with_bias),
            baselines=training_baselines,
            # forward reads x, writes y; backward reads x, dy, writes dx: 5 * M * N
            model_bytes=lambda M, N, dtype: (5 * M * N + 3 * weights * N) * _elem(dtype),
            shapes=NORM_TRAINING_SHAPES, quick_shapes=NORM_TRAINING_SHAPES, dtypes=("bf16",),
            host_inclusive=True),
    ]


# -------------------------------------------------------------- cross-entropy family
#
# Vocabularies of real models (GPT-2 50257, Llama-2 32000, Llama-3 128256, Qwen 151936)
# and one 2^19 row that needs a 16-CTA cluster; M * V ~ 2^27 elements.

# M * V = 2^27 for V = 1K .. 256K, plus two LLM vocabularies at training batch sizes
CROSS_ENTROPY_SHAPES = ((131072, 1024), (32768, 4096), (8192, 16384), (2048, 65536),
                        (512, 262144), (4096, 128256), (8192, 151936))
CROSS_ENTROPY_QUICK_SHAPES = ((32768, 4096), (4096, 128256))
# the "options" case: every extra term switched on
CE_OPTIONS = dict(label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0)


def _cross_entropy_inputs(requires_grad: bool) -> Callable[[int, int, torch.dtype], Inputs]:
    def make(M, N, dtype) -> Inputs:
        x = (_rows(M, N, dtype) * 2).requires_grad_(requires_grad)
        return {"x": x, "target": torch.randint(0, N, (M,), device="cuda")}

    return make


def _eager_cross_entropy(x, target, label_smoothing=0.0, lse_square_scale=0.0, softcap=None):
    """torch's cross-entropy, with softcap and z-loss composed from torch ops."""
    if softcap:
        x = softcap * torch.tanh(x.float() / softcap)
    loss = torch.nn.functional.cross_entropy(x, target, label_smoothing=label_smoothing)
    if lse_square_scale:
        loss = loss + lse_square_scale * torch.logsumexp(x.float(), -1).square().mean()
    return loss


def _ours_cross_entropy(x, target, **options):
    return _quack_kernels().cross_entropy(x, target, **options)


def _liger_cross_entropy() -> Callable:
    fn = _optional_module("liger_kernel.ops.cross_entropy").LigerCrossEntropyFunction.apply

    def call(x, target, label_smoothing=0.0, lse_square_scale=0.0, softcap=None):
        return fn(x, target, None, -100, lse_square_scale, label_smoothing, "mean", softcap)[0]

    return call


def _quack_cross_entropy() -> Callable:
    fn = _optional_module("quack.cross_entropy").cross_entropy
    return lambda x, target: fn(x, target)


def _ce_loss_only(resolve: Callable[[], Callable]) -> Builder:
    """Builder timing the loss of logits that do not require grad."""
    return lambda inputs: functools.partial(resolve(), inputs["x"], inputs["target"])


def _ce_training_step(resolve: Callable[[], Callable], **options) -> Builder:
    """Builder timing loss and gradient: ``f(x, target).backward()``, x.grad dropped first."""

    def build(inputs):
        f, x, target = resolve(), inputs["x"], inputs["target"]

        def step():
            x.grad = None
            f(x, target, **options).backward()

        return step

    return build


def captured(step: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """``step`` captured in a CUDA graph, warmed up on a side stream first, as capture
    asks (compiles, autotunes, fills the allocator); a step that synchronizes fails
    here."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def _graphed(build: Builder) -> Builder:
    """Builder of the same step captured in a CUDA graph and replayed: the GPU time of
    its kernels without the host's gaps between them (what a training loop under CUDA
    graphs pays)."""
    return lambda inputs: captured(build(inputs)).replay


# Liger's cross-entropy writes the gradient over logits that require grad
LIGER = frozenset({"liger"})


def _cross_entropy_benches() -> tuple[OpBench, ...]:
    baselines = {
        "torch": lambda: _eager_cross_entropy,
        "torch_compile": lambda: _compiled(_eager_cross_entropy),
        "liger": _liger_cross_entropy,
        "quack": _quack_cross_entropy,
    }
    loss_only = OpBench(
        name="cross_entropy_fwd",
        group="cross_entropy",
        available=lambda: _has_api("cross_entropy"),
        make_inputs=_cross_entropy_inputs(requires_grad=False),
        ours=_ce_loss_only(lambda: _ours_cross_entropy),
        baselines={name: _ce_loss_only(resolve) for name, resolve in baselines.items()},
        # read the logits once (targets and per-row outputs are negligible)
        model_bytes=lambda M, N, dtype: M * N * _elem(dtype),
        reads_only=True,
        shapes=CROSS_ENTROPY_SHAPES,
        quick_shapes=CROSS_ENTROPY_QUICK_SHAPES,
    )
    with_grad = OpBench(
        name="cross_entropy_fwdbwd",
        group="cross_entropy",
        available=lambda: _has_api("cross_entropy"),
        make_inputs=_cross_entropy_inputs(requires_grad=True),
        ours=_ce_training_step(lambda: _ours_cross_entropy),
        baselines={name: _ce_training_step(resolve) for name, resolve in baselines.items()},
        # the floor of loss + gradient: read the logits once, write the gradient once
        model_bytes=lambda M, N, dtype: 2 * M * N * _elem(dtype),
        overwrites_inputs=LIGER,
        shapes=CROSS_ENTROPY_SHAPES,
        quick_shapes=CROSS_ENTROPY_QUICK_SHAPES,
    )
    with_options = dataclasses.replace(
        with_grad,
        name="cross_entropy_fwdbwd_options",
        ours=_ce_training_step(lambda: _ours_cross_entropy, **CE_OPTIONS),
        # QuACK has none of the options
        baselines={name: _ce_training_step(resolve, **CE_OPTIONS)
                   for name, resolve in baselines.items() if name != "quack"},
    )
    graphed = dataclasses.replace(
        with_grad,
        name="cross_entropy_fwdbwd_graphed",
        ours=_graphed(with_grad.ours),
        baselines={name: _graphed(build) for name, build in with_grad.baselines.items()},
        host_inclusive=False,
        interleaved=False,
    )
    return loss_only, with_grad, with_options, graphed


OPS: dict[str, OpBench] = {
    op.name: op
    for op in (
        _softmax_forward_bench(log=False),
        _softmax_forward_bench(log=True),
        _softmax_backward_bench(log=False),
        _softmax_backward_bench(log=True),
        _softmax_training_bench(),
        *_norm_benches(rms=True),
        *_norm_benches(rms=False),
        *_cross_entropy_benches(),
    )
}


# -------------------------------------------------------------------------- timing


def _triton_do_bench():
    """``triton.testing.do_bench`` when triton is installed, else None."""
    if importlib.util.find_spec("triton") is None:
        return None
    return importlib.import_module("triton.testing").do_bench


def _estimate_ms(fn: Callable[[], object], calls: int = 5) -> float:
    """Mean time of ``calls`` back-to-back calls, from an idle GPU to the last kernel."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return max(start.elapsed_time(end) / calls, 1e-3)


def _isolated_calls_ms(fn: Callable[[], object], reading_flush: bool = False,
                       rep_ms: float = REP_MS) -> float:
    """Median time of isolated calls, each after an L2 flush, each bracketed by its own
    CUDA events: do_bench's method, used when triton is missing (the flush writes, as
    do_bench's ``zero_``) and for ``reading_flush``, which sums the flush buffer
    instead, leaving L2 clean (OpBench.reads_only)."""
    flush = torch.zeros(256 * MiB // 4, dtype=torch.float32, device="cuda")
    per_call = _estimate_ms(fn)
    for _ in range(max(1, int(min(WARMUP_MS, rep_ms) / per_call))):
        fn()
    times = []
    for _ in range(max(1, int(rep_ms / per_call))):
        if reading_flush:
            flush.sum()
        else:
            flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def time_device_ms(fn: Callable[[], object], reading_flush: bool = False,
                   rep_ms: float = REP_MS) -> float:
    """Median GPU time of one call over about ``rep_ms``. Each call follows an L2 flush
    kernel, so its launch overhead is hidden behind the flush and only the kernels' own
    time is measured; ``reading_flush``: see OpBench.reads_only."""
    do_bench = _triton_do_bench()
    if do_bench is None or reading_flush:
        return _isolated_calls_ms(fn, reading_flush, rep_ms)
    return do_bench(fn, warmup=min(WARMUP_MS, rep_ms), rep=rep_ms, return_mode="median")


def time_host_inclusive_ms(fn: Callable[[], object], rep_ms: float = REP_MS) -> float:
    """Median per-call time of back-to-back calls over about ``rep_ms``: the GPU drains
    whenever the host is slower than the kernels, so host overhead counts exactly when
    it matters."""
    per_call = _estimate_ms(fn)
    calls = max(1, int(rep_ms / HOST_SAMPLES / per_call))
    return statistics.median(_estimate_ms(fn, calls) for _ in range(HOST_SAMPLES))


def measure_copy_ceiling_gbps() -> float:
    """Device-to-device copy bandwidth (bytes read + bytes written) on this GPU."""
    src = torch.empty(COPY_CEILING_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    src.fill_(1)
    ms = time_device_ms(lambda: dst.copy_(src))
    src = dst = None  # (freed for empty_cache)
    torch.cuda.empty_cache()
    return 2 * COPY_CEILING_BYTES / (ms * 1e-3) / 1e9


# ------------------------------------------------------------------------ one case


@functools.cache
def _l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES


def _case_bytes(op: OpBench, M: int, N: int, dtype: torch.dtype) -> int:
    """Conservative peak memory of a case: the rotated inputs (at most a few L2s beyond
    one set) plus outputs, doubled for a baseline's temporaries."""
    return 2 * op.model_bytes(M, N, dtype) + COLD_L2_MULTIPLE * _l2_bytes()


def _input_copies(op: OpBench, M: int, N: int, dtype: torch.dtype) -> list[Inputs]:
    """Enough independent input sets that cycling through them never finds the current
    inputs in L2 (one set when a single one is already several L2s)."""
    first = op.make_inputs(M, N, dtype)
    nbytes = sum(t.numel() * t.element_size() for t in first.values())
    count = min(MAX_INPUT_COPIES, max(1, math.ceil(COLD_L2_MULTIPLE * _l2_bytes() / nbytes)))
    return [first] + [op.make_inputs(M, N, dtype) for _ in range(count - 1)]


def _rotating(fns: list[Callable[[], object]]) -> Callable[[], object]:
    if len(fns) == 1:
        return fns[0]
    order = itertools.cycle(fns)
    return lambda: next(order)()


def _error_text(exc: BaseException) -> str:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line}"[:300]


def _prepared(build: Builder, copies: list[Inputs]) -> Callable[[], object]:
    """One callable per input set, in rotation, run once (compiles, autotunes and
    catches failures before timing)."""
    fn = _rotating([build(inputs) for inputs in copies])
    fn()
    torch.cuda.synchronize()
    return fn


def _timed_ms(fn: Callable[[], object], op: OpBench, rep_ms: float) -> float:
    if op.host_inclusive:
        return time_host_inclusive_ms(fn, rep_ms)
    return time_device_ms(fn, op.reads_only, rep_ms)


def _fail(result: Result, exc: BaseException) -> None:
    """One broken implementation must not end the run: its row keeps the error."""
    result.error = _error_text(exc)
    torch.cuda.empty_cache()


def _own_copies(copies: list[Inputs]) -> list[Inputs]:
    """Input sets of the same values in new tensors (OpBench.overwrites_inputs)."""
    return [{name: t.detach().clone().requires_grad_(t.requires_grad)
             for name, t in inputs.items()} for inputs in copies]


def run_case(
    op: OpBench, dtype_name: str, M: int, N: int, ceiling_gbps: float, with_baselines: bool
) -> list[Result]:
    """Time ours and every installed baseline on one shape (ours first): in turn over
    TIMING_ROUNDS rounds, or one after another (OpBench.interleaved)."""
    dtype = DTYPES[dtype_name]
    impls = {OURS: op.ours} | (op.baselines if with_baselines else {})
    copies = _input_copies(op, M, N, dtype)
    model_bytes = op.model_bytes(M, N, dtype)
    rounds = TIMING_ROUNDS if op.interleaved else 1
    results = {}
    for group in [list(impls)] if op.interleaved else [[impl] for impl in impls]:
        ready = {}
        for impl in group:
            result = Result(op.name, dtype_name, M, N, impl, timing=op.timing)
            own = _own_copies(copies) if impl in op.overwrites_inputs else copies
            try:
                ready[impl] = _prepared(impls[impl], own)
            except Unavailable:
                continue
            except Exception as exc:  # noqa: BLE001 (recorded in the CSV)
                _fail(result, exc)
            results[impl] = result
        times = {impl: [] for impl in ready}
        for _ in range(rounds):
            for impl, fn in list(ready.items()):
                try:
                    times[impl].append(_timed_ms(fn, op, REP_MS / rounds))
                except Exception as exc:  # noqa: BLE001 (recorded in the CSV)
                    _fail(results[impl], exc)
                    del ready[impl]
        for impl in ready:
            ms = statistics.median(times[impl])
            result = results[impl]
            result.time_us = ms * 1e3
            result.gbps = model_bytes / (ms * 1e-3) / 1e9
            result.pct_of_copy = 100 * result.gbps / ceiling_gbps
        del ready, own
        gc.collect()
        torch.cuda.empty_cache()
    del copies
    ordered = list(results.values())
    _set_speedup(ordered)
    return ordered


def _set_speedup(results: list[Result]) -> None:
    """Speedup of ours over the fastest baseline that ran, stored on our row."""
    ours = next((r for r in results if r.impl == OURS and r.time_us), None)
    baseline_times = [r.time_us for r in results if r.impl != OURS and r.time_us]
    if ours and baseline_times:
        ours.speedup_vs_best_baseline = min(baseline_times) / ours.time_us


# -------------------------------------------------------------------------- output

CSV_COLUMNS = (
    "op", "dtype", "M", "N", "impl", "time_us", "gbps", "pct_of_copy", "copy_ceiling_gbps",
    "speedup_vs_best_baseline", "gpu", "date", "torch", "triton", "cutlass_dsl",
    "quack_kernels_version", "liger", "quack", "timing", "error",
)  # fmt: skip


def _dist_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return ""


def _version_providing(import_name: str) -> str:
    """Version of whichever distribution provides ``import_name`` ("" when none).

    Needed for QuACK: it is published as ``quack-kernels``, the name this project's
    own distribution may carry, so the distribution name alone is ambiguous.
    """
    dists = importlib.metadata.packages_distributions().get(import_name, [])
    return next((v for v in map(_dist_version, dists) if v), "")


def environment(gpu: str) -> dict[str, str]:
    """The CSV columns that describe the machine and software of this run."""
    return {
        "gpu": gpu,
        "date": datetime.datetime.now().isoformat(timespec="minutes"),
        "torch": torch.__version__,
        "triton": _dist_version("triton"),
        "cutlass_dsl": _dist_version("nvidia-cutlass-dsl"),
        "quack_kernels_version": _quack_kernels().__version__,
        "liger": _dist_version("liger-kernel"),
        "quack": _version_providing("quack"),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


class CsvSink:
    """One CSV per op group, appended and flushed row by row so that a run cut short
    (time limit, crash) still leaves its results on disk. Never overwrites: two runs
    started in the same minute write ``..._HHMM.csv`` and ``..._HHMM-2.csv``."""

    def __init__(self, out_dir: pathlib.Path, gpu_slug: str, stamp: str, columns: dict):
        self.out_dir, self.gpu_slug, self.stamp = out_dir, gpu_slug, stamp
        self.columns = columns  # environment and ceiling, the same on every row
        self.files: dict[str, tuple] = {}
        self.paths: list[pathlib.Path] = []

    def write(self, group: str, result: Result) -> None:
        if group not in self.files:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            name = f"{group}_{self.gpu_slug}_{self.stamp}"
            path = self.out_dir / f"{name}.csv"
            for copy in itertools.count(2):
                if not path.exists():
                    break
                path = self.out_dir / f"{name}-{copy}.csv"
            handle = path.open("w", newline="")
            writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            self.files[group] = (handle, writer)
            self.paths.append(path)
        handle, writer = self.files[group]
        writer.writerow(
            {
                **self.columns,
                "op": result.op,
                "dtype": result.dtype,
                "M": result.M,
                "N": result.N,
                "impl": result.impl,
                "time_us": _fmt(result.time_us, ".2f"),
                "gbps": _fmt(result.gbps, ".1f"),
                "pct_of_copy": _fmt(result.pct_of_copy, ".1f"),
                "speedup_vs_best_baseline": _fmt(result.speedup_vs_best_baseline, ".3f"),
                "timing": result.timing,
                "error": result.error,
            }
        )
        handle.flush()

    def close(self) -> None:
        for handle, _ in self.files.values():
            handle.close()


TABLE_FORMAT = "{:<16} {:<5} {:>7} {:>8} {:<14} {:>10} {:>8} {:>7} {:>8}"


def print_table_header() -> None:
    header = ("op", "dtype", "M", "N", "impl", "time_us", "GB/s", "%copy", "speedup")
    print(TABLE_FORMAT.format(*header))


def print_row(r: Result) -> None:
    if r.error:
        print(TABLE_FORMAT.format(r.op, r.dtype, r.M, r.N, r.impl, "ERROR", "", "", ""), r.error)
    else:
        speedup = _fmt(r.speedup_vs_best_baseline, ".2f")
        print(
            TABLE_FORMAT.format(
                r.op, r.dtype, r.M, r.N, r.impl, f"{r.time_us:.1f}", f"{r.gbps:.0f}",
                f"{r.pct_of_copy:.1f}", speedup and f"{speedup}x",
            )
        )  # fmt: skip
    sys.stdout.flush()


def print_summary(cases: list[list[Result]]) -> None:
    """Last lines of the run: per case, our %copy and whether we beat every baseline."""
    print("\nsummary (ours vs fastest baseline)")
    for results in cases:
        ours = next(r for r in results if r.impl == OURS)
        case = f"{ours.op:<16} {ours.dtype:<5} {ours.M:>7}x{ours.N:<8}"
        if ours.error:
            print(f"{case} ERROR {ours.error}")
            continue
        timed = [r for r in results if r.impl != OURS and r.time_us]
        if not timed:
            print(f"{case} {ours.pct_of_copy:5.1f}% of copy  (no baseline)")
            continue
        best = min(timed, key=lambda r: r.time_us)
        verdict = "beats" if ours.speedup_vs_best_baseline > 1 else "LOSES to"
        print(
            f"{case} {ours.pct_of_copy:5.1f}% of copy  {verdict} {best.impl} "
            f"({ours.speedup_vs_best_baseline:.2f}x, {best.impl} at {best.pct_of_copy:.1f}%)"
        )


# ----------------------------------------------------------------------------- CLI


def _comma_list(values: list[str] | None) -> list[str]:
    return [item.strip() for value in values or [] for item in value.split(",") if item.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m quack_kernels.bench",
        description="Time quack_kernels ops and their baselines against the GPU's copy "
        "bandwidth. Without a GPU, print the kernel resource report instead.",
    )
    parser.add_argument(
        "--op",
        action="append",
        metavar="NAME[,NAME...]",
        help=f"op(s) to run, repeatable (default: every op whose API exists): {', '.join(OPS)}",
    )
    parser.add_argument(
        "--dtype", default="bf16,fp32", help=f"comma list of {', '.join(DTYPES)} (default: both)"
    )
    parser.add_argument("--quick", action="store_true",
                        help="a couple of shapes per op (without a GPU: the quick resource report)")
    parser.add_argument("--shape", action="append", metavar="MxN[,MxN...]",
                        help="shapes to run instead of each op's grid (e.g. 4096x128256)")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=pathlib.Path("benchmarks/results"),
        help="directory for the CSV files (default: benchmarks/results)",
    )
    parser.add_argument(
        "--no-baselines", action="store_true", help="time quack_kernels only"
    )
    args = parser.parse_args(argv)
    args.op = _comma_list(args.op) or list(OPS)
    args.dtype = _comma_list([args.dtype])
    shapes = _comma_list(args.shape)
    bad = [shape for shape in shapes if not re.fullmatch(r"[1-9]\d*x[1-9]\d*", shape)]
    if bad:
        parser.error(f"--shape takes MxN[,MxN...] with M, N >= 1, got {', '.join(bad)}")
    args.shape = [tuple(int(v) for v in shape.split("x")) for shape in shapes]
    for kind, chosen, known in (("op", args.op, OPS), ("dtype", args.dtype, DTYPES)):
        unknown = [name for name in chosen if name not in known]
        if unknown:
            parser.error(f"unknown {kind} {', '.join(unknown)}; known: {', '.join(known)}")
    return args


def _available_ops(names: list[str]) -> list[OpBench]:
    ops = []
    for name in names:
        if OPS[name].available():
            ops.append(OPS[name])
        else:
            print(f"skipping {name}: its quack_kernels API does not exist yet")
    return ops


def _cases(op: OpBench, dtypes: list[str], quick: bool, shapes: list[tuple[int, int]]):
    for dtype_name in (d for d in dtypes if d in op.dtypes):
        for M, N in shapes or (op.quick_shapes if quick else op.shapes):
            yield dtype_name, M, N


def run(args: argparse.Namespace) -> int:
    """The GPU path: ceiling, then every case; returns 1 if any of ours failed."""
    ops = _available_ops(args.op)
    gpu = torch.cuda.get_device_name()
    ceiling = measure_copy_ceiling_gbps()
    timer = "triton do_bench" if _triton_do_bench() else "CUDA events"
    print(f"{gpu}: copy ceiling {ceiling:.0f} GB/s ({COPY_CEILING_BYTES // GiB} GiB D2D, {timer})")

    env = environment(gpu)
    print(", ".join(f"{k} {v}" for k, v in env.items() if k not in ("gpu", "date") and v))
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    sink = CsvSink(args.out, slug, stamp, {**env, "copy_ceiling_gbps": f"{ceiling:.1f}"})

    print_table_header()
    cases = []
    try:
        for op in ops:
            for dtype_name, M, N in _cases(op, args.dtype, args.quick, args.shape):
                estimate = _case_bytes(op, M, N, DTYPES[dtype_name])
                if estimate > MAX_CASE_BYTES:
                    print(f"skipping {op.name} {dtype_name} {M}x{N}: ~{estimate / GiB:.0f} GiB")
                    continue
                results = run_case(op, dtype_name, M, N, ceiling, not args.no_baselines)
                for result in results:
                    print_row(result)
                    sink.write(op.group, result)
                cases.append(results)
    finally:
        sink.close()
    for path in sink.paths:
        print(f"wrote {path}")
    print_summary(cases)
    return int(any(r.error for results in cases for r in results if r.impl == OURS))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("No CUDA device: compiling every kernel for sm_90a and printing the resource report.")
        from quack_kernels import report

        return report.main(["--quick"] if args.quick else [])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
