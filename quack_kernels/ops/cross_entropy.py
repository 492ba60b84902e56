"""Cross-entropy as torch custom ops: CPU reference, CUDA kernel, fake kernels, autograd,
and the public ``cross_entropy`` function.

Two ops compute the per-row loss (with each row's weight in a mean beside it, as (2, M)
stats), lse and (optionally) the gradient of sum_i grad_scale_i loss_i wrt the logits
in one pass over the logits:

  quack_kernels::cross_entropy_forward          functional; the gradient in a new buffer
  quack_kernels::cross_entropy_forward_inplace  writes the gradient over the logits

grad_scale is the upstream gradient each row is expected to receive (1 / count for a
mean). The autograd function (which also reduces the row losses, saving the host
autograd nodes) saves the gradient and, in the backward,
``quack_kernels::cross_entropy_rescale_grad_`` rescales in place only the rows whose
actual upstream gradient differs: the expected case moves no gradient bytes, and any
other (non-uniform per-row gradients, scaled losses) is still exact. fp16 logits
(config.ce_gradient_in_backward) get their gradient in the backward instead, for the
actual upstream gradient. (The functional op also has an autograd of its own, over the
torch reference, for callers that differentiate through it directly.) Without a
gradient a mean is one reduction of the stats (losses and row weights). Eagerly, where
config.ce_reduces_in_kernel, the kernel reduces the loss itself, with or without the
gradient (reduced_loss_cuda).

Bad targets (outside [0, C) and not ignore_index): the CPU op raises ValueError; the
CUDA op does not synchronize to check them and gives that row loss NaN and a NaN
gradient row instead (so a "mean" or "sum" is NaN). Pass ``check_targets=True`` to the
public function for a synchronizing check with a clear error on any device.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..kernels.cross_entropy import CrossEntropyForward
from ..kernels.mean_denominator import MeanDenominator
from ..native import module as native_module
from ..primitives.compile_cache import (
    SUPPORTED_DTYPES,
    compile_kernel,
    fake_rows,
    fake_strided_vector,
    fake_vector,
    kernel_handle,
)
from ..primitives.config import (
    MEAN_DENOMINATOR_MAX_CTAS,
    MEAN_DENOMINATOR_THREADS,
    MEAN_TARGETS_IN_FLIGHT,
    SHIFTED_STREAMED_LOSS_MIN_COLS,
    MeanDenominatorConfig,
    RowConfig,
    ce_fixed_max,
    ce_gradient_in_backward,
    ce_prefetches_past_buffers,
    ce_reduces_in_kernel,
    grid_sum_slots,
    holds_cap_shares,
    shifted_row_share,
    streamed_loss_row_config,
    mean_denominator_ctas,
    cross_entropy_row_config,
    loop_grid_rows,
    loops_over_row_blocks,
    with_l2_prefetch,
    with_prefetch,
)
from .rescale import compile_rescale, rescale_config, rescale_kernel, rescale_launch
from .common import (
    alignment_key,
    as_rows,
    check_gpu,
    compiled,
    cutlass_dtype,
    eager_cuda,
    kernel_key,
    resident_row_blocks,
    shiftable,
    vector_limit,
)

REDUCTIONS = ("none", "mean", "sum")
GPU_DTYPES = SUPPORTED_DTYPES
# fp64 logits are accepted by the CPU reference (gradcheck); the CUDA kernel takes the rest
CPU_DTYPES = GPU_DTYPES + (torch.float64,)
TARGET_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- configs
@functools.lru_cache(maxsize=None)
def forward_config(n_cols: int, dtype: torch.dtype, stage_weight: bool, write_grad: bool,
                   max_vec: int | None = None, softcap: bool = False,
                   shifted: bool = False, smoothing: bool = False,
                   held_shares: bool = False) -> RowConfig:
    """config.cross_entropy_row_config; rows one CTA holds loop with two staging buffers
    where they fit (prefetch of the next row block), and ask L2 for one block more where
    config.ce_prefetches_past_buffers says so. ``shifted`` (shifts_rows): odd 16-bit rows
    read from the 16-byte boundary before each (config.shifted_row_share): the loss alone
    without softcap or ``smoothing`` streamed on the span's streamed share
    (config.SHIFTED_STREAMED_LOSS_MIN_COLS), else on the gradient's share where that
    stages the span. ``held_shares``: config.holds_cap_shares of the launch's options;
    not for the spans of shifted rows (RowTiles stages a shifted span)."""
    elem_bytes = dtype.itemsize
    cfg = cross_entropy_row_config(n_cols, elem_bytes, stage_weight, write_grad, max_vec,
                                   softcap, held_shares)
    if shifted:
        assert not stage_weight, "the weight row is not shifted with the logits"
        streams = not (write_grad or softcap or smoothing) \
            and n_cols >= SHIFTED_STREAMED_LOSS_MIN_COLS
        if streams:
            span_share = functools.partial(streamed_loss_row_config, elem=elem_bytes)
        else:
            span_share = functools.partial(forward_config, dtype=dtype, stage_weight=False,
                                           write_grad=True, softcap=softcap and write_grad)
        shifted_cfg = shifted_row_share(span_share, cfg, elem_bytes, elem_bytes, streams)
        if shifted_cfg is not None:
            return shifted_cfg
    if not loops_over_row_blocks(cfg, write_grad):
        return cfg
    # sized for the variant with the most reduced values (every option on)
    cfg = with_prefetch(cfg, lambda c: forward_kernel_object(
        c, dtype, weighted=stage_weight, smoothing=True, zloss=True, softcap=True,
        write_grad=True))
    if not ce_prefetches_past_buffers(cfg, elem_bytes, stage_weight):
        return cfg
    return with_l2_prefetch(cfg, elem_bytes, past_two_buffers=True)


@functools.lru_cache(maxsize=None)  # on every call
def forward_kernel_object(cfg: RowConfig, dtype: torch.dtype, **flags) -> CrossEntropyForward:
    return CrossEntropyForward(cfg, cutlass_dtype(dtype), **flags)


def forward_kernel(cfg: RowConfig, dtype: torch.dtype, target_dtype: torch.dtype, *,
                   weighted: bool, smoothing: bool, zloss: bool, softcap: bool,
                   write_grad: bool, reduce: str = "none", fixed_max: bool = False):
    """(kernel object, *fake arguments it compiles against)."""
    import cutlass
    import cutlass.cute as cute

    dt = cutlass_dtype(dtype)
    tt = cutlass.Int32 if target_dtype == torch.int32 else cutlass.Int64
    kernel = forward_kernel_object(cfg, dtype, weighted=weighted, smoothing=smoothing,
                                   zloss=zloss, softcap=softcap, write_grad=write_grad,
                                   reduce=reduce, fixed_max=fixed_max)
    stage_weight = kernel.stage_weight
    rows = cute.sym_int()
    return (
        kernel,
        fake_rows(dt, cfg.n_cols, cfg.vec, rows, shifted=cfg.row_shift),
        fake_vector(tt, rows),
        fake_vector(cutlass.Float32, cute.sym_int(), cfg.vec if stage_weight else 1),
        fake_vector(cutlass.Float32, rows),
        fake_vector(cutlass.Float32, rows),
        fake_vector(cutlass.Float32, rows),
        fake_rows(dt, cfg.n_cols, cfg.vec, rows, shifted=cfg.row_shift),
        fake_strided_vector(cutlass.Float32, rows),
        fake_vector(cutlass.Float32, cute.sym_int()),
        fake_vector(cutlass.Int64, cute.sym_int()),
        cutlass.Int64(-100),
        cutlass.Float32(0.0),
        cutlass.Float32(0.0),
        cutlass.Float32(1.0),
        cutlass.Int32(1),
    )


@functools.lru_cache(maxsize=None)  # on every call: skip building the key
def compile_forward(cfg: RowConfig, dtype: torch.dtype, target_dtype: torch.dtype, *,
                    weighted: bool, smoothing: bool, zloss: bool, softcap: bool,
                    write_grad: bool, reduce: str = "none", fixed_max: bool = False):
    flags = dict(weighted=weighted, smoothing=smoothing, zloss=zloss, softcap=softcap,
                 write_grad=write_grad, reduce=reduce, fixed_max=fixed_max)

    def build():
        return compile_kernel(*forward_kernel(cfg, dtype, target_dtype, **flags))

    key = kernel_key("cross_entropy_fwd", dtype, target_dtype, cfg, tuple(sorted(flags.items())))
    return compiled(key, build)


def mean_denominator_kernel(weighted: bool, target_dtype: torch.dtype):
    """(kernel object, *fake arguments it compiles against)."""
    import cutlass
    import cutlass.cute as cute

    return (
        MeanDenominator(MeanDenominatorConfig(weighted)),
        fake_vector(cutlass.Int32 if target_dtype == torch.int32 else cutlass.Int64,
                    cute.sym_int()),
        fake_vector(cutlass.Float32, cute.sym_int()),
        fake_vector(cutlass.Float32, 2),
        fake_vector(cutlass.Int64, cute.sym_int()),
        cutlass.Int64(-100),
        cutlass.Int32(1),
    )


@functools.lru_cache(maxsize=None)  # on every call: skip building the key
def compile_mean_denominator(weighted: bool, target_dtype: torch.dtype):
    return compiled(kernel_key("cross_entropy_mean_denominator", weighted, target_dtype),
                    lambda: compile_kernel(*mean_denominator_kernel(weighted, target_dtype)))


def kernel_flags(cfg: RowConfig, *, weighted: bool, smoothing: bool, zloss: bool,
                 softcap: float, write_grad: bool, reduce: str = "none") -> dict:
    """The compile-time switches of the forward kernel launched with these options
    (``softcap`` the value, 0 for none) on rows of config ``cfg``."""
    return dict(weighted=weighted, smoothing=smoothing, zloss=zloss, softcap=softcap != 0.0,
                write_grad=write_grad, reduce=reduce,
                fixed_max=ce_fixed_max(softcap, cfg, weighted and smoothing, write_grad))


def shifts_rows(rows: Tensor, grad_out: Tensor, stage_weight: bool) -> bool:
    """Whether the forward may read these logits (and write ``grad_out``) shifted
    (forward_config): ops.common.shiftable, without the weight row staged beside them."""
    return not stage_weight and shiftable(rows, grad_out)


def variant(n_cols: int, dtype: torch.dtype, shifted: bool = False,
            **options) -> tuple[RowConfig, dict]:
    """(config, kernel flags) of the forward launched with ``options`` (kernel_flags'
    keywords) on rows of ``n_cols`` ``dtype`` logits (``shifted``: where shifts_rows)."""
    stage_weight = options["weighted"] and options["smoothing"]
    cfg = forward_config(n_cols, dtype, stage_weight, options["write_grad"],
                         softcap=options["softcap"] != 0.0, shifted=shifted,
                         smoothing=options["smoothing"], held_shares=holds_cap_shares(
                             options["softcap"], stage_weight, options["write_grad"]))
    return cfg, kernel_flags(cfg, **options)


# option sets in the resource report, by name: plain loss + gradient, every option on
# (the weight row staged), every option but class weights (the capped values kept in
# registers, config.KEPT_CAPPED_VALUES, or on long 16-bit rows the logits held with their
# cap shares staged, config.HELD_SHARES_MIN_COLS), smoothing + softcap without the gradient,
# with Gemma's softcap 30 (a fixed max, config.CE_FIXED_MAX_SOFTCAP), and the mean reduced
# in the kernel (the weighted loss alone; the plain loss alone, held to
# config.STREAM_LOSS_REGISTERS on long rows; the plain loss + gradient; "_capped" + gradient,
# a Gemma training step; label smoothing alone + gradient, the set-aside target without
# softcap, also unreduced as fp16's gradient in the backward runs it); "_capped_wide"
# with a softcap past that bound (the running max)
REPORT_OPTIONS = {
    "_grad": dict(weighted=False, smoothing=False, zloss=False, softcap=0.0, write_grad=True),
    "_all": dict(weighted=True, smoothing=True, zloss=True, softcap=30.0, write_grad=True),
    "_capped": dict(weighted=False, smoothing=True, zloss=True, softcap=30.0, write_grad=True),
    "_capped_wide": dict(weighted=False, smoothing=True, zloss=True, softcap=50.0,
                         write_grad=True),
    "_loss": dict(weighted=False, smoothing=True, zloss=False, softcap=30.0, write_grad=False),
    "_mean": dict(weighted=True, smoothing=False, zloss=False, softcap=0.0, write_grad=False,
                  reduce="mean"),
    "_plain_mean": dict(weighted=False, smoothing=False, zloss=False, softcap=0.0,
                        write_grad=False, reduce="mean"),
    "_grad_mean": dict(weighted=False, smoothing=False, zloss=False, softcap=0.0,
                       write_grad=True, reduce="mean"),
    "_capped_mean": dict(weighted=False, smoothing=True, zloss=True, softcap=30.0,
                         write_grad=True, reduce="mean"),
    "_smooth": dict(weighted=False, smoothing=True, zloss=False, softcap=0.0, write_grad=True),
    "_smooth_mean": dict(weighted=False, smoothing=True, zloss=False, softcap=0.0,
                         write_grad=True, reduce="mean"),
}


# ... and those also run on shifted rows (the odd 16-bit rows of the grid): the training
# step's, the loss alone with softcap (its placeholders counted on the shifted row), the
# plain mean of the loss alone (streamed), label smoothing (its sum of z over the row's
# values alone) and the capped gradient where its share stages the span
SHIFTED_REPORT_OPTIONS = ("_grad", "_loss", "_plain_mean", "_grad_mean", "_smooth",
                          "_smooth_mean", "_capped", "_capped_wide")


def report_variants(n_grid, dtypes):
    """Kernel variants for the sm_90a resource report: (name, n, dtype, cfg, build);
    "_shifted" ones where the shifted rows' share applies. Not the gradient with the
    loss reduced in the kernel where the gradient is the backward's
    (config.ce_gradient_in_backward: no call launches it)."""
    for dtype in dtypes:
        for n in n_grid:
            for suffix, options in REPORT_OPTIONS.items():
                if options["write_grad"] and options.get("reduce", "none") != "none" \
                        and ce_gradient_in_backward(dtype):
                    continue
                for shifted in (False, True) if suffix in SHIFTED_REPORT_OPTIONS else (False,):
                    cfg, flags = variant(n, dtype, shifted, **options)
                    if shifted and not cfg.row_shift:
                        continue
                    yield (f"xent_fwd{suffix}{'_shifted' if shifted else ''}", n, dtype, cfg,
                           lambda n=n, dtype=dtype, cfg=cfg, flags=flags:
                           forward_kernel(cfg, dtype, torch.int64, **flags))
    for weighted in (False, True):  # (no row length or logits dtype of its own)
        yield (f"xent_mean_den{'_w' if weighted else ''}", 0, torch.int64,
               MeanDenominatorConfig(weighted),
               lambda weighted=weighted: mean_denominator_kernel(weighted, torch.int64))


# -------------------------------------------------------------------------- reference
def cross_entropy_reference(logits: Tensor, target: Tensor, weight: Optional[Tensor],
                            ignore_index: int, label_smoothing: float, lse_square_scale: float,
                            softcap: float, compute_grad: bool = True,
                            grad_scale: Optional[Tensor] = None):
    """Per-row loss, lse and the gradient of sum_i grad_scale_i loss_i (grad_scale 1 when
    None) wrt the logits, from the formulas in kernels/cross_entropy.py, in fp32 (fp64 for
    fp64 logits). Bad targets give NaN rows here (the CPU op raises before calling this)."""
    math_dtype = torch.promote_types(logits.dtype, torch.float32)
    x = logits.to(math_dtype)
    n_cols = x.shape[-1]
    eps = label_smoothing
    z = softcap * torch.tanh(x / softcap) if softcap else x
    lse = torch.logsumexp(z, -1)
    ignored = target == ignore_index
    inside = (target >= 0) & (target < n_cols)
    valid = inside & ~ignored
    t = torch.where(valid, target, torch.zeros_like(target)).long()
    z_t = z.gather(-1, t[:, None])[:, 0]
    w = None if weight is None else weight.to(math_dtype)
    w_t = torch.ones_like(lse) if w is None else w[t]
    total_w = float(n_cols) if w is None else w.sum()
    loss = (1 - eps) * w_t * (lse - z_t)
    if eps:
        wz = z.sum(-1) if w is None else (z * w).sum(-1)
        loss = loss + eps / n_cols * (total_w * lse - wz)
    if lse_square_scale:
        loss = loss + lse_square_scale * lse * lse
    nan = torch.full_like(loss, math.nan)
    scale = torch.ones_like(loss) if grad_scale is None else grad_scale.to(math_dtype)
    row_keep = torch.where(valid, scale, torch.where(inside | ignored, 0.0, nan))
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    loss = torch.where(inside | ignored, loss, nan)
    if not compute_grad:
        return loss, lse, None
    p = torch.exp(z - lse[:, None])
    coef_p = (1 - eps) * w_t + eps / n_cols * total_w + 2 * lse_square_scale * lse
    g = coef_p[:, None] * p
    if eps:
        g = g - eps / n_cols * (1.0 if w is None else w)
    g = g.scatter_add(-1, t[:, None], -((1 - eps) * w_t)[:, None])
    if softcap:
        g = g * (1 - (z / softcap) ** 2)
    g = g * row_keep[:, None]
    return loss, lse, g.to(logits.dtype)


# -------------------------------------------------------------------------- checks
def check_target_rows(target: Tensor, num_rows: int, op: str) -> None:
    """Class indices, one per row, for the ops of rows (M, C)."""
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"quack_kernels: {op} target has dtype {target.dtype}; class indices "
                        "must be torch.int64 or torch.int32 (probability targets are not "
                        "supported)")
    if target.shape != (num_rows,):
        raise ValueError(f"quack_kernels: {op} target shape {tuple(target.shape)} does not "
                         f"match the rows (expected ({num_rows},))")


def _check_op_inputs(logits: Tensor, target: Tensor, weight: Optional[Tensor],
                     grad_scale: Optional[Tensor], cuda: bool) -> None:
    dtypes = GPU_DTYPES if cuda else CPU_DTYPES
    if logits.dtype not in dtypes:
        raise TypeError(f"quack_kernels: cross_entropy logits have dtype {logits.dtype}; "
                        f"supported: {', '.join(map(str, dtypes))}")
    if logits.dim() != 2:
        raise ValueError(f"quack_kernels: cross_entropy ops take (M, C) logits, got {tuple(logits.shape)}")
    if logits.shape[1] < 1:
        raise ValueError("quack_kernels: cross_entropy needs at least one class")
    check_target_rows(target, logits.shape[0], "cross_entropy")
    if weight is not None:
        if weight.shape != (logits.shape[1],):
            raise ValueError(f"quack_kernels: weight must have shape ({logits.shape[1]},), "
                             f"got {tuple(weight.shape)}")
        if not weight.is_floating_point():
            raise TypeError(f"quack_kernels: weight must be floating point, got {weight.dtype}")
    devices = {t.device for t in (logits, target, weight) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"quack_kernels: logits, target and weight must be on one device, "
                         f"got {', '.join(str(d) for d in devices)}")
    _check_grad_scale(grad_scale, logits)


def _valid_targets(target: Tensor, n_cols: int, ignore_index: int) -> Tensor:
    """Per row: is its target a class, in [0, n_cols), and not ignore_index?"""
    return (target != ignore_index) & (target >= 0) & (target < n_cols)


def _raise_on_bad_targets(target: Tensor, n_cols: int, ignore_index: int) -> None:
    """Synchronizing check: every target is ignore_index or inside [0, n_cols)."""
    bad = (target != ignore_index) & ~_valid_targets(target, n_cols, ignore_index)
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"quack_kernels: cross_entropy target {int(target[index])} at row {index} is "
            f"outside [0, {n_cols}) and is not ignore_index ({ignore_index})")


def _check_grad_scale(grad_scale: Optional[Tensor], logits: Tensor, name: str = "grad_scale") -> None:
    """Per-row scales come in the loss dtype (fp32; fp64 for the CPU path's fp64 logits)."""
    dtype = _loss_dtype(logits)
    if grad_scale is not None and (grad_scale.dtype != dtype
                                   or grad_scale.shape != logits.shape[:1]
                                   or grad_scale.device != logits.device):
        raise ValueError(f"quack_kernels: {name} must be {dtype} of shape ({logits.shape[0]},) "
                         f"on {logits.device}; got {grad_scale.dtype} "
                         f"{tuple(grad_scale.shape)} on {grad_scale.device}")


# ----------------------------------------------------------------------------- CUDA
# Launch plans and the reduction's partials, looked up by what decides them: a repeated
# call skips the config, flag, compile-cache and residency lookups (about 50 us of
# Python per call on the H200's host, where a training step is host-bound up to
# M x C = 2^27).
_forward_plans: dict = {}
_partials: dict = {}
_units: dict = {}


def _forward_plan(rows: Tensor, target: Tensor, grad_out: Tensor, weighted: bool,
                  stage_weight: bool, smoothing: bool, zloss: bool, softcap: float,
                  write_grad: bool, reduce: str):
    """(compiled kernel, its config, the resident row blocks of a looping kernel or None
    for one row block per CTA)."""
    shifted = shifts_rows(rows, grad_out, stage_weight)
    key = (rows.shape[1], rows.dtype, target.dtype, rows.device.index, *alignment_key(rows),
           *alignment_key(grad_out), shifted, weighted, stage_weight, smoothing, zloss,
           softcap, write_grad, reduce)
    plan = _forward_plans.get(key)
    if plan is None:
        cfg = forward_config(rows.shape[1], rows.dtype, stage_weight, write_grad,
                             vector_limit(rows, grad_out), softcap != 0.0, shifted, smoothing,
                             holds_cap_shares(softcap, stage_weight, write_grad))
        flags = kernel_flags(cfg, weighted=weighted, smoothing=smoothing, zloss=zloss,
                             softcap=softcap, write_grad=write_grad, reduce=reduce)
        fn = compile_forward(cfg, rows.dtype, target.dtype, **flags)
        kernel = forward_kernel_object(cfg, rows.dtype, **flags)
        plan = (fn, cfg, resident_row_blocks(kernel, rows.device) if kernel.loops else None)
        _forward_plans[key] = plan
    return plan


def _grid_partials(device: torch.device, words: int) -> Tensor:
    """The zeroed int64 words a reducing launch adds its CTAs' sums in
    (GridSum.grid_sum): one buffer per stream, reused (the gathering CTA zeroes the
    words again) and replaced by a larger one when a launch needs more. A graph being
    captured gets its own, so that no replay shares one with eager launches (a tensor
    made during the capture is zeroed by each replay)."""
    make = functools.partial(torch.zeros, words, dtype=torch.int64, device=device)
    if torch.cuda.is_current_stream_capturing():
        return make()
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    partials = _partials.get(key)
    if partials is None or partials.numel() < words:
        # (the stream orders the old buffer's last use before any reuse of its memory)
        partials = _partials[key] = make()
    return partials


def unit_scale(dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 0-d 1 of ``dtype`` on ``device``: the upstream gradient a gradient is computed
    for (expanded to one per row), made once per CUDA device for plain eager calls: not
    under torch.compile or a dispatch mode (a fake tensor must not reach later real
    calls, nor a real one a fake call), nor during CUDA-graph capture (a tensor made
    then is filled only by its replays)."""
    cached = device.type == "cuda" and not torch.compiler.is_compiling() \
        and not torch._C._len_torch_dispatch_stack()
    unit = _units.get((dtype, device.index)) if cached else None
    if unit is None:
        unit = torch.ones((), dtype=dtype, device=device)
        if cached and type(unit) is torch.Tensor and not torch.cuda.is_current_stream_capturing():
            _units[(dtype, device.index)] = unit
    return unit


def _launch(rows: Tensor, target: Tensor, weight: Optional[Tensor], stats: Tensor, lse: Tensor,
            grad: Optional[Tensor], grad_scale: Optional[Tensor], ignore_index: int,
            label_smoothing: float, lse_square_scale: float, softcap: float,
            reduced: Optional[Tensor] = None, reduce: str = "none") -> None:
    """Run the kernel; ``stats`` (2, M) receives the per-row losses and row weights (see
    cross_entropy_forward), ``grad`` the gradient (may be ``rows`` itself; None for loss
    only), scaled per row by ``grad_scale`` (None: 1). With ``reduce`` "sum" or "mean",
    ``reduced`` (a 0-d fp32 tensor) receives the loss reduced over the rows."""
    assert (reduced is None) == (reduce == "none"), "a reduced loss needs its tensor"
    loss, row_weight = stats.unbind(0)
    check_gpu(rows)
    smoothing = label_smoothing != 0.0
    stage_weight = stages_weight(weight, label_smoothing)
    if weight is not None:
        weight = weight.to(torch.float32).contiguous()
        if stage_weight and weight.data_ptr() % 16:
            weight = weight.clone()
    if grad is not None and grad_scale is None:
        grad_scale = unit_scale(torch.float32, rows.device).expand(rows.shape[0])
    target = target.contiguous()
    grad_out = rows if grad is None else grad
    fn, cfg, resident = _forward_plan(rows, target, grad_out, weight is not None,
                                      stage_weight, smoothing, lse_square_scale != 0.0,
                                      softcap, grad is not None, reduce)
    # (a grid of one row block per CTA ignores grid_rows)
    grid_rows = rows.shape[0] if resident is None else \
        loop_grid_rows(cfg, rows.shape[0], resident)
    row_blocks = -(-rows.shape[0] // cfg.rows_per_block) if resident is None else grid_rows
    # vectors the variant does not read (no weights, no gradient, no reduction) are
    # filled by loss and by any int64 vector (int64 targets: no lookup, nor a memset
    # under graph capture)
    if reduced is not None:
        partials = _grid_partials(rows.device, CrossEntropyForward.GRID_SUM_VALUES
                                  * grid_sum_slots(cfg, row_blocks))
    else:
        partials = target if target.dtype == torch.int64 else _grid_partials(rows.device, 1)
    fn(rows, target, loss if weight is None else weight, loss, row_weight, lse, grad_out,
       loss if grad_scale is None else grad_scale,
       loss if reduced is None else reduced.view(1), partials, ignore_index,
       label_smoothing, lse_square_scale, abs(softcap) if softcap else 1.0, grid_rows)


# (a lookup: torch.promote_types is a dispatcher call on every training step)
_LOSS_DTYPES = {torch.float64: torch.float64, torch.float32: torch.float32,
                torch.float16: torch.float32, torch.bfloat16: torch.float32}


def _loss_dtype(logits: Tensor) -> torch.dtype:
    return _LOSS_DTYPES.get(logits.dtype) or torch.promote_types(logits.dtype, torch.float32)


# ----------------------------------------------------------------------------- the ops
def stages_weight(weight: Optional[Tensor], label_smoothing: float) -> bool:
    """Whether the kernel stages the whole class-weight row next to the logits (its sum
    of w z for label smoothing) rather than gathering w_t alone."""
    return weight is not None and label_smoothing != 0.0


def _reduces_in_kernel(eager: bool, reduction: str, num_rows: int, weight: Optional[Tensor],
                       label_smoothing: float) -> bool:
    """Whether an eager reduced loss is summed by the forward kernel itself
    (config.ce_reduces_in_kernel)."""
    return eager and reduction != "none" \
        and ce_reduces_in_kernel(num_rows, stages_weight(weight, label_smoothing))


def reduced_stats(stats: Tensor, reduction: str) -> Tensor:
    """The loss of (2, M) stats (losses, row weights) reduced over the rows: a mean is
    the losses' sum over the row weights' (one reduction of both)."""
    if reduction == "mean":
        totals = stats.sum(1)
        return totals[0] / totals[1]
    if reduction == "sum":
        return stats[0].sum()
    return stats[0]


def plain_backward_scale(target: Tensor, weight: Optional[Tensor], ignore_index: int,
                         n_cols: int, loss_dtype: torch.dtype, reduction: str) -> tuple:
    """(the mean's denominator or None, the 0-d upstream gradient a plain backward()
    gives each row's loss: 1 / denominator for a mean, as torch's DivBackward computes
    it, else 1)."""
    if reduction != "mean":
        return None, unit_scale(loss_dtype, target.device)
    denominator = _mean_denominator(target, weight, ignore_index, n_cols, loss_dtype)
    return denominator, torch.reciprocal(denominator)


def row_weights(target: Tensor, weight: Optional[Tensor], ignore_index: int, n_cols: int,
                dtype: torch.dtype) -> Tensor:
    """Each row's weight in a mean over rows, as torch's cross_entropy counts it: w_t (1
    without class weights) for a target in [0, C) that is not ignore_index, else 0."""
    valid = _valid_targets(target, n_cols, ignore_index)
    if weight is None:
        return valid.to(dtype)
    safe = torch.where(valid, target, torch.zeros_like(target)).long()
    return torch.where(valid, weight.to(dtype)[safe], 0.0)


def _checked_reference(logits, target, weight, ignore_index, label_smoothing, lse_square_scale,
                       softcap, compute_grad, grad_scale):
    """The CPU ops' body: validate (bad targets raise), then the reference, the losses
    stacked with the row weights."""
    _check_op_inputs(logits, target, weight, grad_scale, cuda=False)
    _raise_on_bad_targets(target, logits.shape[1], ignore_index)
    loss, lse, grad = cross_entropy_reference(logits, target, weight, ignore_index,
                                              label_smoothing, lse_square_scale, softcap,
                                              compute_grad, grad_scale)
    weights = row_weights(target, weight, ignore_index, logits.shape[1], loss.dtype)
    return torch.stack((loss, weights)), lse, grad


@torch.library.custom_op("quack_kernels::cross_entropy_forward", mutates_args=(),
                         device_types="cpu")
def cross_entropy_forward(logits: Tensor, target: Tensor, weight: Optional[Tensor],
                          ignore_index: int, label_smoothing: float, lse_square_scale: float,
                          softcap: float, compute_grad: bool,
                          grad_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(stats, lse, grad) of (M, C) logits; softcap 0 means none. ``stats`` (2, M): the
    per-row losses, and each row's weight in a mean (row_weights), so that a mean is one
    reduction over ``stats``. ``grad`` is the gradient of sum_i grad_scale_i loss_i wrt
    the logits (grad_scale: fp32 (M,), default 1) in the logits' dtype, or an empty
    tensor when not asked for."""
    stats, lse, grad = _checked_reference(logits, target, weight, ignore_index, label_smoothing,
                                          lse_square_scale, softcap, compute_grad, grad_scale)
    return stats, lse, grad if compute_grad else logits.new_empty(0)


@cross_entropy_forward.register_kernel("cuda")
def _cross_entropy_forward_cuda(logits, target, weight, ignore_index, label_smoothing,
                                lse_square_scale, softcap, compute_grad, grad_scale=None):
    _check_op_inputs(logits, target, weight, grad_scale, cuda=True)
    rows, stats, lse = _rows_and_outputs(logits)
    grad = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device) if compute_grad \
        else logits.new_empty(0)
    if rows.shape[0] > 0:
        _launch(rows, target, weight, stats, lse, grad if compute_grad else None, grad_scale,
                ignore_index, label_smoothing, lse_square_scale, softcap)
    return stats, lse, grad


def _rows_and_outputs(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(logits with unit column stride, stats (2, M), lse (M,)) for a CUDA launch."""
    rows = logits if logits.stride(-1) == 1 or logits.shape[0] == 0 else logits.contiguous()
    m = rows.shape[0]
    stats = torch.empty(2, m, dtype=torch.float32, device=logits.device)
    return rows, stats, torch.empty(m, dtype=torch.float32, device=logits.device)


def reduced_loss_cuda(logits: Tensor, target: Tensor, weight: Optional[Tensor],
                      ignore_index: int, label_smoothing: float, lse_square_scale: float,
                      softcap: float, reduction: str, grad_scale: Optional[Tensor] = None,
                      inplace: bool = False,
                      checked: bool = False) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(the loss reduced over the rows, "sum" or "mean", as a 0-d fp32 tensor; the
    per-row lse; the gradient or None) of (M, C) CUDA logits where
    config.ce_reduces_in_kernel: the kernel adds the row losses over its grid, so
    nothing runs after it (before it, for a mean with the gradient, the caller's
    denominator). With ``grad_scale``
    the gradient too, as cross_entropy_forward computes it, in a new buffer or, with
    ``inplace``, over the logits (unit column stride). ``checked``: the caller has
    checked the inputs already (a training step's mean, before its denominator). The
    eager path of cross_entropy; the ops and torch.compile reduce cross_entropy_forward's
    stats."""
    assert ce_reduces_in_kernel(logits.shape[0], stages_weight(weight, label_smoothing)), \
        "see its rule"
    if not checked:
        _check_op_inputs(logits, target, weight, grad_scale, cuda=True)
    rows, stats, lse = _rows_and_outputs(logits)
    grad = None
    if grad_scale is not None:
        assert not inplace or rows is logits, "in place needs unit column stride"
        grad = rows if inplace else torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
    reduced = torch.empty((), dtype=torch.float32, device=logits.device)
    _launch(rows, target, weight, stats, lse, grad, grad_scale, ignore_index, label_smoothing,
            lse_square_scale, softcap, reduced, reduction)
    return reduced, lse, grad


@cross_entropy_forward.register_fake
def _cross_entropy_forward_fake(logits, target, weight, ignore_index, label_smoothing,
                                lse_square_scale, softcap, compute_grad, grad_scale=None):
    _check_op_inputs(logits, target, weight, grad_scale, cuda=logits.device.type == "cuda")
    m = logits.shape[0]
    stats = logits.new_empty((2, m), dtype=_loss_dtype(logits))
    grad = logits.new_empty(logits.shape) if compute_grad else logits.new_empty(0)
    return stats, logits.new_empty(m, dtype=_loss_dtype(logits)), grad


def _forward_setup_context(ctx, inputs, output):
    logits, target, weight, *options, grad_scale = inputs
    for name, tensor in (("class weights", weight), ("grad_scale", grad_scale)):
        if tensor is not None and tensor.requires_grad:
            raise RuntimeError(f"quack_kernels: cross_entropy_forward is not differentiable "
                               f"with respect to the {name}")
    ctx.options = options  # ignore_index, label_smoothing, lse_square_scale, softcap, compute_grad
    ctx.save_for_backward(logits, target, weight, grad_scale)
    ctx.set_materialize_grads(False)  # (an unused output's gradient stays None)


@once_differentiable
def _forward_backward(ctx, dstats, dlse, dgrad):
    """The op's own autograd, for callers that differentiate through it directly (the
    public function's CrossEntropyFunction calls it without grad and has its own): the
    reference's losses, lse and gradient recomputed with torch ops and differentiated
    for any upstream gradient of each. The row weights and targets get none (the class
    weights and grad_scale may not require grad)."""
    logits, target, weight, grad_scale = ctx.saved_tensors
    *options, compute_grad = ctx.options
    with torch.enable_grad():
        x = logits.detach().requires_grad_()
        loss, lse, grad = cross_entropy_reference(x, target, weight, *options, compute_grad,
                                                  grad_scale)
        upstream = [(loss, None if dstats is None else dstats[0]), (lse, dlse),
                    (grad, dgrad if compute_grad else None)]
        upstream = [(out, up) for out, up in upstream if up is not None]
        dx = None
        if upstream:
            outs, ups = zip(*upstream)
            dx, = torch.autograd.grad(outs, x, ups, allow_unused=True)
    return dx, None, None, None, None, None, None, None, None


cross_entropy_forward.register_autograd(_forward_backward, setup_context=_forward_setup_context)


@torch.library.custom_op("quack_kernels::cross_entropy_forward_inplace",
                         mutates_args=("logits",), device_types="cpu")
def cross_entropy_forward_inplace(logits: Tensor, target: Tensor, weight: Optional[Tensor],
                                  ignore_index: int, label_smoothing: float,
                                  lse_square_scale: float, softcap: float,
                                  grad_scale: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(stats, lse) as cross_entropy_forward gives them; the logits are overwritten by
    the gradient of sum_i grad_scale_i loss_i."""
    stats, lse, grad = _checked_reference(logits, target, weight, ignore_index, label_smoothing,
                                          lse_square_scale, softcap, True, grad_scale)
    logits.copy_(grad)
    return stats, lse


@cross_entropy_forward_inplace.register_kernel("cuda")
def _cross_entropy_forward_inplace_cuda(logits, target, weight, ignore_index, label_smoothing,
                                        lse_square_scale, softcap, grad_scale=None):
    _check_op_inputs(logits, target, weight, grad_scale, cuda=True)
    if logits.stride(-1) != 1 and logits.shape[0] > 0:
        raise ValueError("quack_kernels: inplace cross_entropy needs logits with unit "
                         "column stride")
    _, stats, lse = _rows_and_outputs(logits)
    if logits.shape[0] > 0:
        _launch(logits, target, weight, stats, lse, logits, grad_scale, ignore_index,
                label_smoothing, lse_square_scale, softcap)
    return stats, lse


@cross_entropy_forward_inplace.register_fake
def _cross_entropy_forward_inplace_fake(logits, target, weight, ignore_index, label_smoothing,
                                        lse_square_scale, softcap, grad_scale=None):
    _check_op_inputs(logits, target, weight, grad_scale, cuda=logits.device.type == "cuda")
    m = logits.shape[0]
    return (logits.new_empty((2, m), dtype=_loss_dtype(logits)),
            logits.new_empty(m, dtype=_loss_dtype(logits)))


@torch.library.custom_op("quack_kernels::cross_entropy_rescale_grad_",
                         mutates_args=("grad",), device_types="cpu")
def cross_entropy_rescale_grad_(grad: Tensor, target: Tensor, dloss: Tensor, held: Tensor,
                                ignore_index: int) -> None:
    """Backward of the fused loss, in place: ``grad`` holds the gradient for per-row
    upstream gradients ``held``; rows of valid targets whose ``dloss`` differs are scaled
    by dloss / held (NaN where held is 0). Rows that match move no bytes on CUDA."""
    _check_rescale_inputs(grad, target, dloss, held)
    grad.copy_(rescaled_grad(grad, target, dloss, held, ignore_index))


@cross_entropy_rescale_grad_.register_kernel("cuda")
def _cross_entropy_rescale_grad_cuda(grad, target, dloss, held, ignore_index):
    _check_rescale_inputs(grad, target, dloss, held)
    if grad.shape[0] > 0:
        check_gpu(grad)
        rescale_launch(grad, dloss, held, target=target.contiguous(),
                       ignore_index=ignore_index)


@cross_entropy_rescale_grad_.register_fake
def _cross_entropy_rescale_grad_fake(grad, target, dloss, held, ignore_index):
    _check_rescale_inputs(grad, target, dloss, held)


def rescaled_grad(grad: Tensor, target: Tensor, dloss: Tensor, held: Tensor,
                  ignore_index: int) -> Tensor:
    """What cross_entropy_rescale_grad_ writes, as a new tensor (torch ops, any device)."""
    valid = _valid_targets(target, grad.shape[1], ignore_index)
    factor = torch.where(held != 0, dloss / held, math.nan)
    factor = torch.where(valid & (dloss != held), factor, 1.0)
    return (grad.to(factor.dtype) * factor[:, None]).to(grad.dtype)


def _check_rescale_inputs(grad: Tensor, target: Tensor, dloss: Tensor, held: Tensor) -> None:
    if grad.dim() != 2 or grad.stride(-1) != 1 or grad.dtype not in CPU_DTYPES:
        raise ValueError("quack_kernels: cross_entropy_rescale_grad_ needs a (M, C) float "
                         f"gradient with unit column stride, got {grad.dtype} {tuple(grad.shape)}")
    if target.dtype not in TARGET_DTYPES or target.shape != grad.shape[:1]:
        raise ValueError(f"quack_kernels: target must be int32/int64 of shape ({grad.shape[0]},)")
    _check_grad_scale(dloss, grad, "dloss")
    _check_grad_scale(held, grad, "held")


# ------------------------------------------------------------------------- autograd
def _mean_denominator(target: Tensor, weight: Optional[Tensor], ignore_index: int,
                      n_cols: int, loss_dtype: torch.dtype) -> Tensor:
    """What a mean divides by: the count of non-ignored targets, or their summed class
    weights (bad targets count: their loss is NaN, so is the mean)."""
    kept = target != ignore_index
    if weight is None:
        return kept.sum(dtype=loss_dtype)
    safe = torch.where(kept, target, torch.zeros_like(target)).clamp(0, n_cols - 1)
    return (weight.to(loss_dtype)[safe] * kept).sum()


@functools.lru_cache(maxsize=256)  # on every call: skip the grid's sizing
def _denominator_plan(weighted: bool, target_dtype: torch.dtype, num_targets: int):
    """(compiled kernel, CTAs, GridSum words) of the denominator of ``num_targets``."""
    ctas = mean_denominator_ctas(num_targets)
    words = grid_sum_slots(MeanDenominatorConfig(weighted), ctas)
    return compile_mean_denominator(weighted, target_dtype), ctas, words


def _mean_denominator_cuda(target: Tensor, weight: Optional[Tensor],
                           ignore_index: int) -> Tensor:
    """(_mean_denominator, its reciprocal) of CUDA targets as one (2,) tensor, in one
    launch (kernels.mean_denominator)."""
    out = torch.empty(2, dtype=torch.float32, device=target.device)
    fn, ctas, words = _denominator_plan(weight is not None, target.dtype, target.shape[0])
    fn(target.contiguous(), out if weight is None else weight.to(torch.float32).contiguous(),
       out, _grid_partials(target.device, words), ignore_index, ctas)
    return out


class CrossEntropyFunction(torch.autograd.Function):
    """(M, C) logits -> (the loss reduced as ``reduction`` asks, per-row lse). The
    forward computes the gradient for the upstream gradient a plain backward() of the
    result gives each row: 1 / denominator for a mean (as torch's DivBackward computes
    it, so that the two compare equal), 1 for a sum or per-row losses. The backward
    rescales only the rows where the actual upstream gradient of the result differs
    from 1, so in the expected case it moves no gradient bytes. The reduction happens
    here rather than in autograd-recorded torch ops, which saves the host two autograd
    nodes per step (eagerly, where config.ce_reduces_in_kernel, in the kernel:
    reduced_loss_cuda). lse is not differentiable. Where config.ce_gradient_in_backward
    (fp16) the gradient is computed in the backward instead, for the actual upstream
    gradient (_late_gradient)."""

    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, label_smoothing, lse_square_scale,
                softcap, inplace, reduction, eager):
        """``eager``: call the CUDA implementations directly (see common.eager_cuda)."""
        loss_dtype = _loss_dtype(logits)
        num_rows = logits.shape[0]
        denominator = None
        checked = reduction == "mean" and eager
        if checked:
            # (checked before the first kernel reads the targets and weights)
            _check_op_inputs(logits, target, weight, None, cuda=True)
            # (D, 1 / D); D is read below only where torch ops divide by it
            scales = _mean_denominator_cuda(target, weight, ignore_index)
            # 1 / D for every row in one view (a slice and an expand cost two)
            held = scales.as_strided((num_rows,), (0,), 1)
        else:
            # (an expanded scalar: the kernels take per-row scales with any stride)
            denominator, held = plain_backward_scale(target, weight, ignore_index,
                                                     logits.shape[1], loss_dtype, reduction)
            held = held.expand(num_rows)
        options = (ignore_index, label_smoothing, lse_square_scale, softcap)
        reduced = None
        late_grad = ce_gradient_in_backward(logits.dtype)
        if (not inplace or logits.stride(-1) == 1) \
                and _reduces_in_kernel(eager, reduction, num_rows, weight, label_smoothing):
            reduced, lse, grad = reduced_loss_cuda(logits, target, weight, *options, reduction,
                                                   None if late_grad else held, inplace, checked)
        elif inplace and not late_grad:
            forward = _cross_entropy_forward_inplace_cuda if eager else cross_entropy_forward_inplace
            stats, lse = forward(logits, target, weight, *options, held)
            grad = logits
        else:
            forward = _cross_entropy_forward_cuda if eager else cross_entropy_forward
            stats, lse, grad = forward(logits, target, weight, *options, not late_grad,
                                       None if late_grad else held)
        ctx.eager = eager
        ctx.ignore_index = ignore_index
        ctx.reduction = reduction
        ctx.inplace = inplace
        ctx.loss_dtype = loss_dtype
        ctx.late_grad = late_grad
        if late_grad:
            ctx.options = options
            ctx.save_for_backward(logits, target, weight, held)
        else:
            if inplace and eager:
                # (the eager kernel wrote the gradient over the logits behind autograd's
                # back: another node that saved them must fail, not read the gradient)
                torch.autograd.graph.increment_version(logits)
            ctx.save_for_backward(grad, target)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zeros for the lse's gradient
        if reduced is not None:
            return reduced, lse
        loss = stats[0]
        if reduction == "none":
            return loss, lse
        # ignored rows have loss 0; their gradient rows are 0 whatever upstream gradient
        # they get (the backward skips them), so a plain sum is safe even with no kept row
        total = loss.sum()
        if reduction == "mean" and denominator is None:
            denominator = scales[0]
        return (total / denominator if reduction == "mean" else total), lse

    @staticmethod
    def backward(ctx, dout, dlse):
        if torch.is_grad_enabled():  # (create_graph: see _once_differentiable_backward)
            return _once_differentiable_backward(ctx, dout, dlse)
        return _backward(ctx, dout, dlse)


def saved_tensors_reused() -> bool:
    """Whether a backward must leave its saved tensors intact: the graph may run
    backward again (retain_graph, gradcheck) or is being traced. Otherwise this is their
    last use, and a backward may overwrite them (no second buffer)."""
    return torch.compiler.is_compiling() \
        or torch._C._autograd._get_current_graph_task_keep_graph()


def _backward(ctx, dout, dlse):
    if dout is None:
        return (None,) * 10
    if ctx.late_grad:
        return _late_gradient(ctx, dout), *(None,) * 9
    grad, target = ctx.saved_tensors
    num_rows = grad.shape[0]
    # the saved gradient is the one for an upstream gradient of 1 on every row's loss
    # (reduction "none") or on the reduced loss: the rows are rescaled by dout where
    # it differs from 1
    dloss = dout if dout.dtype == ctx.loss_dtype else dout.to(ctx.loss_dtype)
    if ctx.reduction != "none":
        dloss = dloss.expand(num_rows)
    held = unit_scale(ctx.loss_dtype, grad.device).expand(num_rows)
    if saved_tensors_reused():
        dlogits = rescaled_grad(grad, target, dloss, held, ctx.ignore_index)
    else:
        # last use of the buffer: rescale in place and hand it to autograd
        if not ctx.eager:
            cross_entropy_rescale_grad_(grad, target, dloss, held, ctx.ignore_index)
        elif num_rows > 0:
            # (inputs the forward made or checked: no second check)
            rescale_launch(grad, dloss, held, target=target.contiguous(),
                           ignore_index=ctx.ignore_index)
        # in place, the buffer is the logits: as the input tensor itself, autograd
        # would copy it into the leaf's .grad; a view it takes over
        dlogits = grad.view_as(grad) if ctx.inplace else grad
    return dlogits, None, None, None, None, None, None, None, None, None


def _late_gradient(ctx, dout: Tensor) -> Tensor:
    """The logits' gradient computed in the backward (CrossEntropyFunction: fp16), each
    row scaled by its actual upstream gradient; over the logits with ``inplace`` unless
    the graph may run backward again or is being traced."""
    logits, target, weight, held = ctx.saved_tensors
    dloss = dout.to(ctx.loss_dtype)
    if ctx.reduction != "none":
        dloss = dloss.expand(held.shape)
    scale = dloss * held
    if ctx.inplace and not saved_tensors_reused():
        forward = _cross_entropy_forward_inplace_cuda if ctx.eager else cross_entropy_forward_inplace
        forward(logits, target, weight, *ctx.options, scale)
        if ctx.eager:  # (see the forward's inplace)
            torch.autograd.graph.increment_version(logits)
        return logits.view_as(logits)  # (a view autograd takes over: see _backward)
    forward = _cross_entropy_forward_cuda if ctx.eager else cross_entropy_forward
    return forward(logits, target, weight, *ctx.options, True, scale)[2]


# ------------------------------------------------------------------ the C++ fast path
def _native_cross_entropy(rows: Tensor, target: Tensor, ignore_index: int,
                          label_smoothing: float, lse_square_scale: float, softcap: float,
                          mean: bool):
    """(the reduced loss, lse) of the C++ fast path (native/launch.cpp: the training
    step's kernels and autograd node without Python); None where it does not apply (not
    built, fp16, non-contiguous, no rows, a graph being captured): the Python path
    runs."""
    native = native_module()
    if native is None:
        return None
    options = (ignore_index, label_smoothing, lse_square_scale, softcap, mean)
    out = native.cross_entropy(rows, target, *options)
    if out is None and _native_plan(native, rows, target, *options[1:]):
        out = native.cross_entropy(rows, target, *options)
    return out


def _native_plan(native, rows: Tensor, target: Tensor, label_smoothing: float,
                 lse_square_scale: float, softcap: float, mean: bool) -> bool:
    """Compile the training step's kernels for these inputs (no class weights) and
    register them with the C++ fast path, under the key it derives from them (row
    length, dtypes, alignment, device, mean or sum, which options are on, the softcap);
    False where the fast path does not apply. Bad input raises here."""
    if ce_gradient_in_backward(rows.dtype) or not native.cross_entropy_eligible(rows, target):
        return False
    _check_op_inputs(rows, target, None, None, cuda=True)
    check_gpu(rows)
    reduce = "mean" if mean else "sum"
    # the gradient buffer is made as the logits are laid out (contiguous, aligned)
    forward, cfg, resident = _forward_plan(rows, target, rows, False, False,
                                           label_smoothing != 0.0, lse_square_scale != 0.0,
                                           softcap, True, reduce)
    denominator = compile_mean_denominator(False, target.dtype) if mean else None
    rescale_cfg = rescale_config(rows.shape[1], rows.dtype, vector_limit(rows))
    rescale = (rescale_cfg, rows.dtype, None, target.dtype, True)  # in place, broadcast scales
    values = CrossEntropyForward.GRID_SUM_VALUES
    sizes = [cfg.rows_per_block, resident or 0, values, values * grid_sum_slots(cfg, 0),
             MEAN_DENOMINATOR_THREADS * MEAN_TARGETS_IN_FLIGHT, MEAN_DENOMINATOR_MAX_CTAS,
             grid_sum_slots(MeanDenominatorConfig(False), 0), rescale_cfg.rows_per_block,
             resident_row_blocks(rescale_kernel(*rescale)[0], rows.device)]
    native.register_cross_entropy_plan(
        rows, target, mean, label_smoothing, lse_square_scale, softcap,
        kernel_handle(denominator), kernel_handle(forward), kernel_handle(compile_rescale(*rescale)),
        unit_scale(torch.float32, rows.device), sizes)
    return True


# A backward with create_graph=True (grad mode on) must not be differentiated again: this
# backward is not differentiable (an error then, not a silent None); once_differentiable's
# wrapper costs ~10 us of host time, so only that case pays it.
_once_differentiable_backward = once_differentiable(_backward)


# ------------------------------------------------------------------------ public API
def check_loss_options(reduction: str, label_smoothing: float, lse_square_scale: float,
                       softcap: Optional[float]) -> None:
    """The public losses' options (cross_entropy, linear_cross_entropy)."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"quack_kernels: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"quack_kernels: label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"quack_kernels: softcap must be None or > 0, got {softcap}")
    if not -math.inf < lse_square_scale < math.inf:  # (math.isfinite breaks dynamic torch.compile)
        raise ValueError(f"quack_kernels: lse_square_scale must be finite, got {lse_square_scale}")


def check_target_options(target: Tensor, class_weight: Optional[Tensor],
                         ignore_index: int) -> None:
    """The public losses' ignore_index and class weights, against their targets."""
    if target.dtype == torch.int32 and not -2**31 <= ignore_index < 2**31:
        # (compared with int32 targets it would wrap in torch ops, not in the kernels)
        raise ValueError(f"quack_kernels: ignore_index {ignore_index} is outside the range "
                         "of the int32 targets")
    if class_weight is not None and class_weight.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("quack_kernels: the loss is not differentiable with respect to "
                           "the class weights (nor is torch's); pass them detached")


def cross_entropy(logits: Tensor, target: Tensor, weight: Optional[Tensor] = None, *,
                  ignore_index: int = -100, reduction: str = "mean",
                  label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                  softcap: Optional[float] = None, return_lse: bool = False,
                  inplace_backward: bool = False, check_targets: bool = False):
    """Cross-entropy of (..., C) logits (classes last) against integer targets of shape
    (...), like ``torch.nn.functional.cross_entropy`` with the class dimension last.

    fp32 math for fp32/fp16/bf16 logits; the loss and lse are fp32. ``weight``: class
    weights (C,); ``reduction`` "mean" divides by the summed weight of the non-ignored
    targets (their count without weights), as torch does, and is NaN when every target
    is ignored. ``label_smoothing`` as torch defines it (weights included);
    ``lse_square_scale`` adds scale * lse^2 to every non-ignored row (z-loss);
    ``softcap`` replaces the logits by softcap * tanh(logits / softcap).
    ``return_lse``: also return the per-row fp32 log-sum-exp (shape of target, not
    differentiable). When the logits require grad, their gradient is computed in the
    forward pass, for the upstream gradient a plain ``backward()`` of the result gives,
    and stored in a new buffer, or with ``inplace_backward=True`` over the logits (their
    values are destroyed). The backward then moves no bytes; another upstream gradient
    (a scaled loss, a weighted sum of per-row losses) costs one pass rescaling the
    affected rows (a retained graph gets a new gradient tensor each backward). fp16
    logits get their gradient in the backward instead, for the actual upstream
    gradient (a loss scaler's factor applied before the fp16 rounding): one more read
    of the logits, which ``inplace_backward`` keeps until then and overwrites there.

    Targets outside [0, C) that are not ignore_index: on CUDA that row's loss (and
    gradient) is NaN, so a mean or sum is NaN; ``check_targets=True`` (synchronizing)
    and the CPU path raise ValueError instead.
    """
    if not isinstance(logits, Tensor) or not isinstance(target, Tensor):
        raise TypeError("quack_kernels: cross_entropy expects tensors for logits and target")
    check_loss_options(reduction, label_smoothing, lse_square_scale, softcap)
    if logits.dim() < 1:
        raise ValueError("quack_kernels: logits need a class dimension (got a 0-d tensor)")
    if target.is_floating_point():
        raise TypeError("quack_kernels: probability (floating point) targets are not "
                        "supported; pass class indices (torch.int64 or torch.int32)")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"quack_kernels: target shape {tuple(target.shape)} must equal the "
                         f"logits shape without its last (class) dimension, "
                         f"{tuple(logits.shape[:-1])}")
    check_target_options(target, weight, ignore_index)
    n_cols = logits.shape[-1]
    rows = as_rows(logits)
    target_rows = target if target.dim() == 1 else target.reshape(-1)
    if check_targets:
        _raise_on_bad_targets(target_rows, n_cols, ignore_index)
    args = (target_rows, weight, int(ignore_index), float(label_smoothing),
            float(lse_square_scale), float(softcap or 0.0))
    eager = eager_cuda(logits, target, weight)

    native = None
    if torch.is_grad_enabled() and logits.requires_grad and eager and reduction != "none" \
            and weight is None and not inplace_backward:
        native = _native_cross_entropy(rows, target_rows, *args[2:], reduction == "mean")
    if native is not None:
        out, lse = native
    elif torch.is_grad_enabled() and logits.requires_grad:
        out, lse = CrossEntropyFunction.apply(rows, *args, bool(inplace_backward), reduction,
                                              eager)
        if reduction == "none":
            # a view of the function's stats, which torch does not let callers modify
            # in place: hand out a copy (M floats)
            out = out.clone()
    elif _reduces_in_kernel(eager, reduction, rows.shape[0], weight, label_smoothing):
        out, lse, _ = reduced_loss_cuda(rows, *args, reduction)
    else:
        forward = _cross_entropy_forward_cuda if eager else cross_entropy_forward
        stats, lse, _ = forward(rows, *args, False)
        out = reduced_stats(stats, reduction)
    if reduction == "none":
        out = out.view(target.shape)
    return (out, lse.view(target.shape)) if return_lse else out
