"""Drop-in ``torch.nn`` modules backed by quack_kernels ops."""

from __future__ import annotations

import torch
from torch import Tensor

from .ops.cross_entropy import cross_entropy
from .ops.linear_cross_entropy import linear_cross_entropy
from .ops.norm import layer_norm, rms_norm
from .ops.softmax import log_softmax, softmax


class Softmax(torch.nn.Module):
    """Same interface as ``torch.nn.Softmax`` (dim defaults to the last one)."""

    def __init__(self, dim: int = -1):
        super().__init__()
        self.dim = dim

    def forward(self, x: Tensor) -> Tensor:
        return softmax(x, self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class LogSoftmax(Softmax):
    """Same interface as ``torch.nn.LogSoftmax`` (dim defaults to the last one)."""

    def forward(self, x: Tensor) -> Tensor:
        return log_softmax(x, self.dim)


class CrossEntropyLoss(torch.nn.Module):
    """Like ``torch.nn.CrossEntropyLoss`` with the class dimension last ((..., C) logits,
    (...) integer targets), plus z-loss (``lse_square_scale``) and ``softcap``; see
    :func:`quack_kernels.cross_entropy`."""

    def __init__(self, weight: Tensor | None = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0,
                 lse_square_scale: float = 0.0, softcap: float | None = None,
                 inplace_backward: bool = False):
        super().__init__()
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.lse_square_scale = lse_square_scale
        self.softcap = softcap
        self.inplace_backward = inplace_backward

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        return cross_entropy(
            logits, target, self.weight, ignore_index=self.ignore_index,
            reduction=self.reduction, label_smoothing=self.label_smoothing,
            lse_square_scale=self.lse_square_scale, softcap=self.softcap,
            inplace_backward=self.inplace_backward)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, "
                f"lse_square_scale={self.lse_square_scale}, softcap={self.softcap}")


class LinearCrossEntropyLoss(torch.nn.Module):
    """The loss of an LM head, ``CrossEntropyLoss`` of ``hidden @ weight.T + bias``,
    computed in chunks of rows without the whole logits in memory; ``forward(hidden,
    weight, target, bias=None)`` (the head's parameters are the caller's, e.g. tied
    embeddings). See :func:`quack_kernels.linear_cross_entropy`."""

    def __init__(self, class_weight: Tensor | None = None, ignore_index: int = -100,
                 reduction: str = "mean", label_smoothing: float = 0.0,
                 lse_square_scale: float = 0.0, softcap: float | None = None,
                 chunk_rows: int | None = None, grad_accum_dtype: torch.dtype | None = None):
        super().__init__()
        self.register_buffer("class_weight", class_weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.lse_square_scale = lse_square_scale
        self.softcap = softcap
        self.chunk_rows = chunk_rows
        self.grad_accum_dtype = grad_accum_dtype

    def forward(self, hidden: Tensor, weight: Tensor, target: Tensor,
                bias: Tensor | None = None) -> Tensor:
        return linear_cross_entropy(
            hidden, weight, target, bias, class_weight=self.class_weight,
            ignore_index=self.ignore_index, reduction=self.reduction,
            label_smoothing=self.label_smoothing, lse_square_scale=self.lse_square_scale,
            softcap=self.softcap, chunk_rows=self.chunk_rows,
            grad_accum_dtype=self.grad_accum_dtype)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, "
                f"lse_square_scale={self.lse_square_scale}, softcap={self.softcap}, "
                f"chunk_rows={self.chunk_rows}, grad_accum_dtype={self.grad_accum_dtype}")


def _shape(normalized_shape) -> tuple:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if len(shape) != 1:
        raise ValueError(f"quack_kernels: only the last dimension can be normalized, got "
                         f"normalized_shape={shape}")
    return shape


def _check_normalized(x: Tensor, normalized_shape: tuple) -> None:
    """As torch's norm modules: the last dimension must be the normalized one (the ops
    check it against a weight; without one they would normalize any length)."""
    if x.dim() == 0 or x.shape[-1] != normalized_shape[0]:
        raise ValueError(f"quack_kernels: normalized_shape={list(normalized_shape)} expects "
                         f"input of shape [*, {normalized_shape[0]}], got {list(x.shape)}")


class RMSNorm(torch.nn.Module):
    """Drop-in for ``torch.nn.RMSNorm`` (same parameter name ``weight``, ones-initialised),
    normalizing the last dimension; ``weight_offset=1.0`` gives the Gemma form
    ``x_hat * (1 + weight)`` (then initialise the weight to zeros yourself).
    ``eps=None`` means 1e-6 here (torch uses the dtype's machine epsilon)."""

    def __init__(self, normalized_shape, eps: float | None = 1e-6, elementwise_affine: bool = True,
                 device=None, dtype=None, weight_offset: float = 0.0):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = 1e-6 if eps is None else eps
        self.elementwise_affine = elementwise_affine
        self.weight_offset = weight_offset
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)

    def forward(self, x: Tensor, residual: Tensor | None = None, prenorm: bool = False):
        _check_normalized(x, self.normalized_shape)
        return rms_norm(x, self.weight, eps=self.eps, residual=residual,
                        weight_offset=self.weight_offset, prenorm=prenorm)

    def extra_repr(self) -> str:
        return (f"{self.normalized_shape}, eps={self.eps}, "
                f"elementwise_affine={self.elementwise_affine}, weight_offset={self.weight_offset}")


class LayerNorm(torch.nn.Module):
    """Drop-in for ``torch.nn.LayerNorm`` (parameters ``weight`` and ``bias``, ones and
    zeros), normalizing the last dimension."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            if bias:
                self.bias = torch.nn.Parameter(torch.empty(self.normalized_shape, device=device, dtype=dtype))
            else:
                self.register_parameter("bias", None)
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            torch.nn.init.ones_(self.weight)
        if self.bias is not None:
            torch.nn.init.zeros_(self.bias)

    def forward(self, x: Tensor, residual: Tensor | None = None, prenorm: bool = False):
        _check_normalized(x, self.normalized_shape)
        return layer_norm(x, self.weight, self.bias, eps=self.eps, residual=residual,
                          prenorm=prenorm)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
