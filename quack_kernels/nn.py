"""Drop-in ``torch.nn`` modules backed by quack_kernels ops."""

from __future__ import annotations

import torch
from torch import Tensor

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
