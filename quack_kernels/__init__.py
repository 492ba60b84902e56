"""quack-kernels: memory-bound GPU kernels for PyTorch, written in CuTe-DSL for Hopper.

Public functions are differentiable and backed by ``torch.ops.quack_kernels.*`` custom
ops (CPU reference implementations, CUDA kernels for sm_90+).
"""

from . import nn
from .ops.cross_entropy import cross_entropy
from .ops.norm import layer_norm, rms_norm
from .ops.softmax import log_softmax, softmax

__version__ = "0.1.0"
__all__ = ["softmax", "log_softmax", "rms_norm", "layer_norm", "cross_entropy", "nn", "__version__"]
