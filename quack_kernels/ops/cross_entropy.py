"""Cross-entropy as torch custom ops: CPU reference, CUDA kernel, fake kernels, autograd,
and the public ``cross_entropy`` function.

Two ops compute the per-row loss, lse and (optionally) the gradient of each row's loss
wrt its logits in one pass over the logits:

  quack_kernels::cross_entropy_forward          functional; the gradient in a new buffer
  quack_kernels::cross_entropy_forward_inplace  writes the gradient over the logits

The autograd function saves that gradient; its backward only scales row i by the
upstream gradient of loss i (an elementwise multiply, in place over the saved buffer in
the inplace mode). The reduction over rows is plain torch on the (M,) loss vector, so
autograd gets the per-row upstream gradient right for every reduction, weighting and
any use of the result.

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

from ..kernels.cross_entropy import CrossEntropyForward
from ..primitives.compile_cache import SUPPORTED_DTYPES, compile_kernel, fake_rows, fake_vector
from ..primitives.config import RowConfig, row_config
from .common import (
    as_rows,
    check_gpu,
    compiled,
    cutlass_dtype,
    kernel_key,
    vector_limit,
)

REDUCTIONS = ("none", "mean", "sum")
GPU_DTYPES = SUPPORTED_DTYPES
# fp64 logits are accepted by the CPU reference (gradcheck); the CUDA kernel takes the rest
CPU_DTYPES = GPU_DTYPES + (torch.float64,)
TARGET_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- configs
@functools.lru_cache(maxsize=None)
def forward_config(n_cols: int, dtype: torch.dtype, stage_weight: bool,
                   max_vec: int | None = None) -> RowConfig:
    """Logits are the one staged row tensor; with weighted label smoothing the fp32
    weight row is staged beside them, so accesses are sized for fp32 (4 elements)."""
    elem = torch.finfo(dtype).bits // 8
    if stage_weight:
        return row_config(n_cols, 4, staged_tensors=2, bytes_per_col=elem + 4, max_vec=max_vec)
    return row_config(n_cols, elem, staged_tensors=1, max_vec=max_vec)


def forward_kernel(cfg: RowConfig, dtype: torch.dtype, target_dtype: torch.dtype, *,
                   weighted: bool, smoothing: bool, zloss: bool, softcap: bool,
                   write_grad: bool):
    """(kernel object, *fake arguments it compiles against)."""
    import cutlass
    import cutlass.cute as cute

    dt = cutlass_dtype(dtype)
    tt = cutlass.Int32 if target_dtype == torch.int32 else cutlass.Int64
    kernel = CrossEntropyForward(cfg, dt, weighted=weighted, smoothing=smoothing,
                                 zloss=zloss, softcap=softcap, write_grad=write_grad)
    stage_weight = weighted and smoothing
    rows = cute.sym_int()
    return (
        kernel,
        fake_rows(dt, cfg.n_cols, cfg.vec, rows),
        fake_vector(tt, rows),
        fake_vector(cutlass.Float32, cute.sym_int(), cfg.vec if stage_weight else 1),
        fake_vector(cutlass.Float32, rows),
        fake_vector(cutlass.Float32, rows),
        fake_rows(dt, cfg.n_cols, cfg.vec, rows),
        cutlass.Int64(-100),
        cutlass.Float32(0.0),
        cutlass.Float32(0.0),
        cutlass.Float32(1.0),
    )


@functools.lru_cache(maxsize=None)  # on every call: skip building the key
def compile_forward(cfg: RowConfig, dtype: torch.dtype, target_dtype: torch.dtype, *,
                    weighted: bool, smoothing: bool, zloss: bool, softcap: bool,
                    write_grad: bool):
    flags = dict(weighted=weighted, smoothing=smoothing, zloss=zloss, softcap=softcap,
                 write_grad=write_grad)

    def build():
        return compile_kernel(*forward_kernel(cfg, dtype, target_dtype, **flags))

    key = kernel_key("cross_entropy_fwd", dtype, target_dtype, cfg, tuple(sorted(flags.items())))
    return compiled(key, build)


# flag sets in the resource report: plain loss + gradient, every option on, and
# smoothing + softcap without the gradient
REPORT_FLAGS = (
    dict(weighted=False, smoothing=False, zloss=False, softcap=False, write_grad=True),
    dict(weighted=True, smoothing=True, zloss=True, softcap=True, write_grad=True),
    dict(weighted=False, smoothing=True, zloss=False, softcap=True, write_grad=False),
)


def report_variants(n_grid, dtypes):
    """Kernel variants for the sm_90a resource report: (name, n, dtype, cfg, build)."""
    for dtype in dtypes:
        for n in n_grid:
            for flags in REPORT_FLAGS:
                cfg = forward_config(n, dtype, flags["weighted"] and flags["smoothing"])
                suffix = "_all" if flags["zloss"] else ("_grad" if flags["write_grad"] else "_loss")
                yield (f"xent_fwd{suffix}", n, dtype, cfg,
                       lambda n=n, dtype=dtype, cfg=cfg, flags=flags:
                       forward_kernel(cfg, dtype, torch.int64, **flags))


# -------------------------------------------------------------------------- reference
def cross_entropy_reference(logits: Tensor, target: Tensor, weight: Optional[Tensor],
                            ignore_index: int, label_smoothing: float, lse_square_scale: float,
                            softcap: float, compute_grad: bool = True):
    """Per-row loss, lse and gradient of each row's loss wrt its logits, from the
    formulas in kernels/cross_entropy.py, in fp32 (fp64 for fp64 logits). Bad targets
    give NaN rows here (the CPU op raises before calling this)."""
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
    row_keep = torch.where(valid, 1.0, torch.where(inside | ignored, 0.0, nan))
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
def _check_op_inputs(logits: Tensor, target: Tensor, weight: Optional[Tensor], cuda: bool) -> None:
    dtypes = GPU_DTYPES if cuda else CPU_DTYPES
    if logits.dtype not in dtypes:
        raise TypeError(f"quack_kernels: cross_entropy logits have dtype {logits.dtype}; "
                        f"supported: {', '.join(map(str, dtypes))}")
    if logits.dim() != 2:
        raise ValueError(f"quack_kernels: cross_entropy ops take (M, C) logits, got {tuple(logits.shape)}")
    if logits.shape[1] < 1:
        raise ValueError("quack_kernels: cross_entropy needs at least one class")
    if target.dtype not in TARGET_DTYPES:
        raise TypeError(f"quack_kernels: cross_entropy target has dtype {target.dtype}; class "
                        "indices must be torch.int64 or torch.int32 (probability targets "
                        "are not supported)")
    if target.shape != logits.shape[:1]:
        raise ValueError(f"quack_kernels: target shape {tuple(target.shape)} does not match "
                         f"logits {tuple(logits.shape)} (expected ({logits.shape[0]},))")
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


def _raise_on_bad_targets(target: Tensor, n_cols: int, ignore_index: int) -> None:
    """Synchronizing check: every target is ignore_index or inside [0, n_cols)."""
    bad = (target != ignore_index) & ((target < 0) | (target >= n_cols))
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"quack_kernels: cross_entropy target {int(target[index])} at row {index} is "
            f"outside [0, {n_cols}) and is not ignore_index ({ignore_index})")


# ----------------------------------------------------------------------------- CUDA
def _launch(rows: Tensor, target: Tensor, weight: Optional[Tensor], loss: Tensor, lse: Tensor,
            grad: Optional[Tensor], ignore_index: int, label_smoothing: float,
            lse_square_scale: float, softcap: float) -> None:
    """Run the kernel; ``grad`` is where the gradient goes (may be ``rows`` itself), None
    for loss only."""
    check_gpu(rows)
    n_cols = rows.shape[1]
    smoothing = label_smoothing != 0.0
    stage_weight = weight is not None and smoothing
    if weight is not None:
        weight = weight.to(torch.float32).contiguous()
        if stage_weight and weight.data_ptr() % 16:
            weight = weight.clone()
    target = target.contiguous()
    grad_out = rows if grad is None else grad
    cfg = forward_config(n_cols, rows.dtype, stage_weight, vector_limit(rows, grad_out))
    fn = compile_forward(cfg, rows.dtype, target.dtype, weighted=weight is not None,
                         smoothing=smoothing, zloss=lse_square_scale != 0.0,
                         softcap=softcap != 0.0, write_grad=grad is not None)
    # without weights any fp32 vector fills the (unused) weight argument
    fn(rows, target, loss if weight is None else weight, loss, lse, grad_out,
       ignore_index, label_smoothing, lse_square_scale, softcap if softcap else 1.0)


def _loss_dtype(logits: Tensor) -> torch.dtype:
    return torch.promote_types(logits.dtype, torch.float32)


# ----------------------------------------------------------------------------- the ops
@torch.library.custom_op("quack_kernels::cross_entropy_forward", mutates_args=(),
                         device_types="cpu")
def cross_entropy_forward(logits: Tensor, target: Tensor, weight: Optional[Tensor],
                          ignore_index: int, label_smoothing: float, lse_square_scale: float,
                          softcap: float, compute_grad: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row (loss, lse, grad) of (M, C) logits; softcap 0 means none. ``grad`` is
    d loss_i / d logits_i in the logits' dtype, or an empty tensor when not asked for."""
    _check_op_inputs(logits, target, weight, cuda=False)
    _raise_on_bad_targets(target, logits.shape[1], ignore_index)
    loss, lse, grad = cross_entropy_reference(logits, target, weight, ignore_index,
                                              label_smoothing, lse_square_scale, softcap,
                                              compute_grad)
    return loss, lse, grad if compute_grad else logits.new_empty(0)


@cross_entropy_forward.register_kernel("cuda")
def _cross_entropy_forward_cuda(logits, target, weight, ignore_index, label_smoothing,
                                lse_square_scale, softcap, compute_grad):
    _check_op_inputs(logits, target, weight, cuda=True)
    rows = logits if logits.stride(-1) == 1 or logits.shape[0] == 0 else logits.contiguous()
    m = rows.shape[0]
    loss = torch.empty(m, dtype=torch.float32, device=logits.device)
    lse = torch.empty(m, dtype=torch.float32, device=logits.device)
    grad = torch.empty(rows.shape, dtype=logits.dtype, device=logits.device) if compute_grad \
        else logits.new_empty(0)
    if m > 0:
        _launch(rows, target, weight, loss, lse, grad if compute_grad else None, ignore_index,
                label_smoothing, lse_square_scale, softcap)
    return loss, lse, grad


@cross_entropy_forward.register_fake
def _cross_entropy_forward_fake(logits, target, weight, ignore_index, label_smoothing,
                                lse_square_scale, softcap, compute_grad):
    _check_op_inputs(logits, target, weight, cuda=logits.device.type == "cuda")
    m = logits.shape[0]
    loss = logits.new_empty(m, dtype=_loss_dtype(logits))
    grad = logits.new_empty(logits.shape) if compute_grad else logits.new_empty(0)
    return loss, logits.new_empty(m, dtype=_loss_dtype(logits)), grad


@torch.library.custom_op("quack_kernels::cross_entropy_forward_inplace",
                         mutates_args=("logits",), device_types="cpu")
def cross_entropy_forward_inplace(logits: Tensor, target: Tensor, weight: Optional[Tensor],
                                  ignore_index: int, label_smoothing: float,
                                  lse_square_scale: float, softcap: float) -> tuple[Tensor, Tensor]:
    """Per-row (loss, lse); the logits are overwritten by d loss_i / d logits_i."""
    _check_op_inputs(logits, target, weight, cuda=False)
    _raise_on_bad_targets(target, logits.shape[1], ignore_index)
    loss, lse, grad = cross_entropy_reference(logits, target, weight, ignore_index,
                                              label_smoothing, lse_square_scale, softcap)
    logits.copy_(grad)
    return loss, lse


@cross_entropy_forward_inplace.register_kernel("cuda")
def _cross_entropy_forward_inplace_cuda(logits, target, weight, ignore_index, label_smoothing,
                                        lse_square_scale, softcap):
    _check_op_inputs(logits, target, weight, cuda=True)
    if logits.stride(-1) != 1 and logits.shape[0] > 0:
        raise ValueError("quack_kernels: inplace cross_entropy needs logits with unit "
                         "column stride")
    m = logits.shape[0]
    loss = torch.empty(m, dtype=torch.float32, device=logits.device)
    lse = torch.empty(m, dtype=torch.float32, device=logits.device)
    if m > 0:
        _launch(logits, target, weight, loss, lse, logits, ignore_index, label_smoothing,
                lse_square_scale, softcap)
    return loss, lse


@cross_entropy_forward_inplace.register_fake
def _cross_entropy_forward_inplace_fake(logits, target, weight, ignore_index, label_smoothing,
                                        lse_square_scale, softcap):
    _check_op_inputs(logits, target, weight, cuda=logits.device.type == "cuda")
    m = logits.shape[0]
    return (logits.new_empty(m, dtype=_loss_dtype(logits)),
            logits.new_empty(m, dtype=_loss_dtype(logits)))


# ------------------------------------------------------------------------- autograd
class CrossEntropyFunction(torch.autograd.Function):
    """(M, C) logits -> per-row (loss, lse). The forward computes the gradient of each
    row's loss; the backward scales row i by d out / d loss_i. lse is not
    differentiable."""

    @staticmethod
    def forward(ctx, logits, target, weight, ignore_index, label_smoothing, lse_square_scale,
                softcap, inplace):
        if inplace:
            loss, lse = cross_entropy_forward_inplace(logits, target, weight, ignore_index,
                                                      label_smoothing, lse_square_scale, softcap)
            grad = logits
        else:
            loss, lse, grad = cross_entropy_forward(logits, target, weight, ignore_index,
                                                    label_smoothing, lse_square_scale, softcap,
                                                    True)
        ctx.inplace = inplace
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(lse)
        return loss, lse

    @staticmethod
    def backward(ctx, dloss, dlse):
        (grad,) = ctx.saved_tensors
        if dloss is None:
            return (None,) * 8
        scale = dloss.unsqueeze(-1)
        if grad.dtype != torch.float16:
            # one dtype keeps torch's vectorized elementwise path (a mixed-dtype
            # broadcast multiply is not vectorized); bf16 has fp32's range, so rounding
            # the row scale adds about one rounding of the gradient. fp16 keeps the
            # fp32 scale: a mean over many rows would make it subnormal in fp16.
            scale = scale.to(grad.dtype)
        if ctx.inplace:
            # the buffer is the logits' and is consumed here: backward runs once
            dlogits = grad.mul_(scale)
        elif scale.dtype == grad.dtype:
            dlogits = torch.mul(grad, scale)
        else:
            dlogits = torch.mul(grad, scale, out=torch.empty_like(grad))
        return dlogits, None, None, None, None, None, None, None


# ------------------------------------------------------------------------ public API
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
    forward pass and stored in a new buffer, or with ``inplace_backward=True`` over the
    logits (their values are destroyed; backward may then run only once).

    Targets outside [0, C) that are not ignore_index: on CUDA that row's loss (and
    gradient) is NaN, so a mean or sum is NaN; ``check_targets=True`` (synchronizing)
    and the CPU path raise ValueError instead.
    """
    if not isinstance(logits, Tensor) or not isinstance(target, Tensor):
        raise TypeError("quack_kernels: cross_entropy expects tensors for logits and target")
    if reduction not in REDUCTIONS:
        raise ValueError(f"quack_kernels: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"quack_kernels: label_smoothing must be in [0, 1], got {label_smoothing}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"quack_kernels: softcap must be None or > 0, got {softcap}")
    if not math.isfinite(lse_square_scale):
        raise ValueError(f"quack_kernels: lse_square_scale must be finite, got {lse_square_scale}")
    if logits.dim() < 1:
        raise ValueError("quack_kernels: logits need a class dimension (got a 0-d tensor)")
    if target.is_floating_point():
        raise TypeError("quack_kernels: probability (floating point) targets are not "
                        "supported; pass class indices (torch.int64 or torch.int32)")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"quack_kernels: target shape {tuple(target.shape)} must equal the "
                         f"logits shape without its last (class) dimension, "
                         f"{tuple(logits.shape[:-1])}")
    n_cols = logits.shape[-1]
    rows = as_rows(logits)
    target_rows = target.reshape(-1)
    if check_targets:
        _raise_on_bad_targets(target_rows, n_cols, ignore_index)
    args = (target_rows, weight, int(ignore_index), float(label_smoothing),
            float(lse_square_scale), float(softcap or 0.0))
    if torch.is_grad_enabled() and logits.requires_grad:
        loss, lse = CrossEntropyFunction.apply(rows, *args, bool(inplace_backward))
    else:
        loss, lse, _ = cross_entropy_forward(rows, *args, False)

    if reduction == "none":
        out = loss.view(target.shape)
    elif reduction == "sum":
        out = loss.sum()
    else:
        kept = target_rows != ignore_index
        if weight is None:
            denominator = kept.sum()
        else:
            safe = torch.where(kept, target_rows, torch.zeros_like(target_rows)).clamp(0, n_cols - 1)
            denominator = (weight.to(loss.dtype)[safe] * kept).sum()
        # where, not a plain sum: an ignored row then gets upstream gradient 0, not
        # 0 / 0 (torch's gradient is 0 even when every target is ignored)
        out = torch.where(kept, loss, torch.zeros_like(loss)).sum() / denominator
    return (out, lse.view(target.shape)) if return_lse else out
