"""Linear layer + cross-entropy in chunks of rows: the loss of an LM head without its
(M, V) logits in memory at once.

  quack_kernels::linear_cross_entropy_forward   (stats, grad_hidden, grad_weight, grad_bias)

Each chunk's logits (hidden @ weight^T + bias, in the inputs' dtype, by torch's GEMM)
go through the cross-entropy kernel, which overwrites them with their gradient
(quack_kernels::cross_entropy_forward_inplace, scaled per row by grad_scale); two more
GEMMs turn that into the chunk's rows of grad_hidden and its share of grad_weight. So
a training step's gradients are done in the forward pass and the backward of a mean or
sum only scales them by the upstream gradient (one scalar). fp16
(config.ce_gradient_in_backward) computes the gradients of the summed losses, whose
logits' gradient keeps its small values in fp16, and scales them by the mean's
1 / denominator with the upstream gradient (a loss scaler's factor) in the backward.
The chunks run again in the backward, with the actual upstream gradient, for
reduction="none" (the weight's gradient, a sum over rows, cannot be rescaled per row
afterwards) and for fp16 summing the head's gradient in fp16 (at the summed losses'
scale that sum could overflow).

grad_weight (and grad_bias) accumulate over the chunks in ``grad_accum_dtype``: the
weight's dtype rounds once per chunk (bf16, 128 chunks: 1.5e-2 off fp64 in norm, 2.5e-3
in one chunk), fp32 once at the end for twice the buffer (on CUDA each chunk's GEMM
writes its fp32 sum straight into it). A frozen head (weight and bias,
weight_grad=False) costs neither the weight's GEMM nor its buffer.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..primitives.config import (ce_gradient_in_backward, linear_ce_chunk_rows,
                                 linear_ce_grad_accum_dtype)
from .common import check_same_device, eager_cuda
from .cross_entropy import (
    CPU_DTYPES,
    GPU_DTYPES,
    _loss_dtype,
    check_loss_options,
    check_target_options,
    check_target_rows,
    cross_entropy_forward,
    cross_entropy_forward_inplace,
    plain_backward_scale,
    reduced_stats,
    saved_tensors_reused,
    unit_scale,
)
from .rescale import rescale_launch


def _check_inputs(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                  class_weight: Optional[Tensor], chunk_rows: int,
                  grad_accum_dtype: torch.dtype) -> None:
    dtypes = CPU_DTYPES if hidden.device.type == "cpu" else GPU_DTYPES
    if hidden.dtype not in dtypes:
        raise TypeError(f"quack_kernels: linear_cross_entropy hidden states have dtype "
                        f"{hidden.dtype}; supported: {', '.join(map(str, dtypes))}")
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"quack_kernels: linear_cross_entropy needs (M, H) hidden states and "
                         f"a (V, H) weight, got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    for name, tensor in (("weight", weight), ("bias", bias)):
        if tensor is not None and tensor.dtype != hidden.dtype:
            raise TypeError(f"quack_kernels: linear_cross_entropy {name} has dtype "
                            f"{tensor.dtype}, the hidden states {hidden.dtype}; they must match")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"quack_kernels: bias must have shape ({weight.shape[0]},), "
                         f"got {tuple(bias.shape)}")
    check_target_rows(target, hidden.shape[0], "linear_cross_entropy")
    if chunk_rows < 1:
        raise ValueError(f"quack_kernels: chunk_rows must be at least 1, got {chunk_rows}")
    if grad_accum_dtype not in (hidden.dtype, torch.float32):
        raise TypeError(f"quack_kernels: grad_accum_dtype must be the head's dtype "
                        f"({hidden.dtype}) or torch.float32, got {grad_accum_dtype}")
    check_same_device(hidden=hidden, weight=weight, bias=bias, target=target,
                      class_weight=class_weight)


@torch.library.custom_op("quack_kernels::linear_cross_entropy_forward", mutates_args=())
def linear_cross_entropy_forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor],
                                 target: Tensor, class_weight: Optional[Tensor],
                                 ignore_index: int, label_smoothing: float,
                                 lse_square_scale: float, softcap: float,
                                 grad_scale: Optional[Tensor], weight_grad: bool,
                                 chunk_rows: int, grad_accum_dtype: torch.dtype
                                 ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(stats, grad_hidden, grad_weight, grad_bias) of cross-entropy over the logits
    hidden (M, H) @ weight (V, H)^T + bias, ``chunk_rows`` rows at a time. ``stats``
    (2, M) as cross_entropy_forward gives them; with ``grad_scale`` (the loss dtype, (M,))
    the gradients of sum_i grad_scale_i loss_i, else empty tensors (so are grad_weight
    and grad_bias without ``weight_grad``, grad_bias without a bias); grad_weight and
    grad_bias in ``grad_accum_dtype``, the sum's dtype over the chunks. One implementation
    for every device: the chunks' GEMMs are torch's, their losses the cross-entropy
    ops' (the CUDA kernel or the CPU reference)."""
    _check_inputs(hidden, weight, bias, target, class_weight, chunk_rows, grad_accum_dtype)
    num_rows, vocab = hidden.shape[0], weight.shape[0]
    stats = hidden.new_empty((2, num_rows), dtype=_loss_dtype(hidden))
    with_grad = grad_scale is not None
    weight_grad = with_grad and weight_grad
    grad_hidden = hidden.new_empty(hidden.shape) if with_grad else hidden.new_empty(0)
    # (left empty for the first chunk's product to overwrite, unless there is none;
    # row-major whatever the weight's layout, as the rescale kernel reads rows)
    new_grad_weight = weight.new_empty if num_rows else weight.new_zeros
    grad_weight = (new_grad_weight(weight.shape, dtype=grad_accum_dtype) if weight_grad
                   else weight.new_empty(0))
    grad_bias = (hidden.new_zeros(vocab, dtype=grad_accum_dtype)
                 if weight_grad and bias is not None else hidden.new_empty(0))
    options = (ignore_index, label_smoothing, lse_square_scale, softcap)
    for start in range(0, num_rows, chunk_rows):
        rows = slice(start, start + chunk_rows)
        chunk = hidden[rows]
        logits = chunk @ weight.t() if bias is None else torch.addmm(bias, chunk, weight.t())
        if with_grad:
            chunk_stats, _ = cross_entropy_forward_inplace(logits, target[rows], class_weight,
                                                           *options, grad_scale[rows])
            torch.mm(logits, weight, out=grad_hidden[rows])
            if weight_grad:
                _add_product(grad_weight, logits.t(), chunk, first=start == 0)
                if bias is not None:
                    grad_bias += logits.sum(0, dtype=grad_accum_dtype)
        else:
            chunk_stats, _, _ = cross_entropy_forward(logits, target[rows], class_weight,
                                                      *options, False)
        stats[:, rows] = chunk_stats
    return stats, grad_hidden, grad_weight, grad_bias


def _add_product(total: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """total += a @ b (total = a @ b when ``first``: beta 0 ignores its garbage), the
    product summed in fp32 and rounded once, to total's dtype."""
    beta = 0 if first else 1
    if total.dtype == a.dtype:
        total.addmm_(a, b, beta=beta)
    elif total.is_cuda and _ADDMM_OUT_DTYPE:  # cuBLAS's fp32 sum into total, not via a's dtype
        torch.addmm(total, a, b, beta=beta, out_dtype=total.dtype, out=total)
    else:
        total.addmm_(a.to(total.dtype), b.to(total.dtype), beta=beta)


# addmm(..., out_dtype=) (torch >= 2.8; before it, fp32 copies of the chunk's operands)
_ADDMM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


@linear_cross_entropy_forward.register_fake
def _linear_cross_entropy_forward_fake(hidden, weight, bias, target, class_weight,
                                       ignore_index, label_smoothing, lse_square_scale,
                                       softcap, grad_scale, weight_grad, chunk_rows,
                                       grad_accum_dtype):
    _check_inputs(hidden, weight, bias, target, class_weight, chunk_rows, grad_accum_dtype)
    stats = hidden.new_empty((2, hidden.shape[0]), dtype=_loss_dtype(hidden))
    if grad_scale is None:
        return stats, hidden.new_empty(0), weight.new_empty(0), hidden.new_empty(0)
    if not weight_grad:
        return stats, hidden.new_empty(hidden.shape), weight.new_empty(0), hidden.new_empty(0)
    grad_bias = (hidden.new_empty(weight.shape[0], dtype=grad_accum_dtype) if bias is not None
                 else hidden.new_empty(0))
    return (stats, hidden.new_empty(hidden.shape),
            weight.new_empty(weight.shape, dtype=grad_accum_dtype), grad_bias)


def _per_row_or_reduced(stats: Tensor, reduction: str) -> Tensor:
    loss = reduced_stats(stats, reduction)
    # (per-row losses: not a view of the stats, so that callers may modify them in place)
    return loss.clone() if reduction == "none" else loss


class LinearCrossEntropyFunction(torch.autograd.Function):
    """(M, H) hidden states, (V, H) weight, bias -> the loss reduced as ``reduction``
    asks; see the module docstring for where the gradients are computed."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, class_weight, ignore_index, label_smoothing,
                lse_square_scale, softcap, reduction, chunk_rows, grad_accum_dtype):
        options = (ignore_index, label_smoothing, lse_square_scale, softcap)
        weight_grad = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        ctx.options, ctx.weight_grad = options, weight_grad
        ctx.chunking, ctx.grad_dtype = (chunk_rows, grad_accum_dtype), hidden.dtype
        held = None  # the row scale of a plain backward(), for a sum or mean
        if reduction != "none":
            _, held = plain_backward_scale(target, class_weight, ignore_index, weight.shape[0],
                                           _loss_dtype(hidden), reduction)
        # fp16 (config.ce_gradient_in_backward): the forward computes the gradients of
        # the summed losses (a row scale of 1: the logits' gradient within [-1, 1] keeps
        # its small values, a loss scaler's factor and held join in the backward's one
        # rescale), unless the head's gradient sums in fp16, where that sum could
        # overflow: then the chunks run again in the backward, for the actual scale
        sums_first = ce_gradient_in_backward(hidden.dtype)
        ctx.recomputes = held is None or (sums_first and weight_grad
                                          and grad_accum_dtype != torch.float32)
        scale = held_later = None
        if not ctx.recomputes:
            row_scale = held
            if sums_first:
                # (a mean over no weight, held = inf, stays in the forward as in bf16:
                # its rows' gradients are 0, or NaN for valid targets of weight 0)
                finite = held.isfinite()
                row_scale = torch.where(finite, 1.0, held)
                held_later = torch.where(finite, held, 1.0)
            scale = row_scale.expand(hidden.shape[0])
        stats, *grads = linear_cross_entropy_forward(hidden, weight, bias, target, class_weight,
                                                     *options, scale, weight_grad, *ctx.chunking)
        if ctx.recomputes:
            ctx.save_for_backward(hidden, weight, bias, target, class_weight, held)
        else:
            ctx.save_for_backward(*grads, held_later)
        return _per_row_or_reduced(stats, reduction)

    @staticmethod
    @once_differentiable
    def backward(ctx, dloss):
        if ctx.recomputes:
            hidden, weight, bias, target, class_weight, held = ctx.saved_tensors
            scale = dloss if held is None else (dloss * held).expand(hidden.shape[0])
            _, *grads = linear_cross_entropy_forward(
                hidden, weight, bias, target, class_weight, *ctx.options,
                scale.to(_loss_dtype(hidden)).contiguous(), ctx.weight_grad, *ctx.chunking)
            grads = [grad.to(ctx.grad_dtype) for grad in grads]
        else:
            *saved, held_later = ctx.saved_tensors
            upstream = dloss if held_later is None else dloss * held_later
            in_place = not saved_tensors_reused()
            grads = [_times_upstream(grad, upstream, ctx.grad_dtype, in_place) if needed else None
                     for grad, needed in zip(saved, ctx.needs_input_grad)]
        # (a frozen weight's gradient is an empty tensor)
        return (*(grad if needed else None for grad, needed in zip(grads, ctx.needs_input_grad)),
                *(None,) * 9)


def _times_upstream(grad: Tensor, dloss: Tensor, dtype: torch.dtype, in_place: bool) -> Tensor:
    """A gradient computed for an upstream gradient of 1, times the actual ``dloss``
    (fp32: torch's multiply of a 16-bit tensor by it would round it to 16 bits first),
    in ``dtype``. Eagerly on CUDA the rescale kernel, in place where the saved gradient
    is not needed again (no second weight-sized buffer at the step's peak; a ``dloss``
    of exactly 1 moves no bytes); elsewhere torch ops, which torch.compile fuses."""
    if grad.dim() == 2 and grad.numel() > 0 and eager_cuda(grad, dloss):
        rows = grad.shape[0]
        held = unit_scale(dloss.dtype, grad.device).expand(rows)
        out = None if in_place and grad.dtype == dtype else grad.new_empty(grad.shape, dtype=dtype)
        rescale_launch(grad, dloss.expand(rows), held, out=out)
        return grad if out is None else out
    return (grad.to(dloss.dtype) * dloss).to(dtype)


def linear_cross_entropy(hidden: Tensor, weight: Tensor, target: Tensor,
                         bias: Optional[Tensor] = None, *, class_weight: Optional[Tensor] = None,
                         ignore_index: int = -100, reduction: str = "mean",
                         label_smoothing: float = 0.0, lse_square_scale: float = 0.0,
                         softcap: Optional[float] = None, chunk_rows: Optional[int] = None,
                         grad_accum_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``cross_entropy(hidden @ weight.T + bias, target, class_weight, ...)`` without
    the (..., V) logits in memory at once: the rows go through the linear layer (an LM
    head) and the loss in chunks, and with a gradient each chunk's gradients are
    computed right away (the logits of one chunk at a time exist, as logits and then
    as their gradient; the backward of a sum or mean only scales them, while
    reduction="none" computes them in the backward, for the per-row upstream
    gradients). ``hidden`` (..., H), ``weight`` (V, H),
    ``bias`` (V,) or None, all of one dtype (under autocast, cast to its dtype as
    ``F.linear`` would be); ``target`` (...) class indices. ``class_weight``,
    ``ignore_index``, ``reduction``, ``label_smoothing``, ``lse_square_scale`` and
    ``softcap`` are :func:`quack_kernels.cross_entropy`'s (``class_weight`` is its
    ``weight``, a name the head's weight takes here).
    ``chunk_rows``: rows per chunk (default config.linear_ce_chunk_rows: chunk logits
    about the size of the hidden states). ``grad_accum_dtype``: the dtype the weight's
    and bias's gradients sum over the chunks in, the head's own (rounded once per chunk)
    or torch.float32 (rounded once, for a weight-sized fp32 buffer; default
    config.linear_ce_grad_accum_dtype: fp32 for fp16, whose chunks otherwise run again
    in the backward)."""
    if not all(isinstance(t, Tensor) for t in (hidden, weight, target)):
        raise TypeError("quack_kernels: linear_cross_entropy expects tensors for hidden, "
                        "weight and target")
    check_loss_options(reduction, label_smoothing, lse_square_scale, softcap)
    if hidden.dim() < 1 or target.shape != hidden.shape[:-1]:
        raise ValueError(f"quack_kernels: target shape {tuple(target.shape)} must equal the "
                         f"hidden states' shape without its last dimension, "
                         f"{tuple(hidden.shape[:-1])}")
    check_target_options(target, class_weight, ignore_index)
    if torch.is_autocast_enabled(hidden.device.type):  # the head's GEMM as autocast casts it
        dtype = torch.get_autocast_dtype(hidden.device.type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    rows = hidden.reshape(-1, hidden.shape[-1])
    target_rows = target.reshape(-1)
    if chunk_rows is None:
        chunk_rows = linear_ce_chunk_rows(rows.shape[0], rows.shape[1], weight.shape[0])
    if grad_accum_dtype is None:
        grad_accum_dtype = linear_ce_grad_accum_dtype(weight.dtype)
    args = (target_rows, class_weight, int(ignore_index), float(label_smoothing),
            float(lse_square_scale), float(softcap or 0.0))
    trains = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    if trains:
        loss = LinearCrossEntropyFunction.apply(rows, weight, bias, *args, reduction,
                                                int(chunk_rows), grad_accum_dtype)
    else:
        stats, *_ = linear_cross_entropy_forward(rows, weight, bias, *args, None, False,
                                                 int(chunk_rows), grad_accum_dtype)
        loss = _per_row_or_reduced(stats, reduction)
    return loss.view(target.shape) if reduction == "none" else loss
