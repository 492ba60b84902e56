"""quack-kernels: memory-bound GPU kernels for PyTorch, written in CuTe-DSL for Hopper.

Public functions are differentiable and backed by ``torch.ops.quack_kernels.*`` custom
ops (CPU reference implementations, CUDA kernels for sm_90+).
"""

from .primitives.compile_cache import compile_for_hopper_without_gpu

compile_for_hopper_without_gpu()  # before the kernels import the DSL

from . import nn  # noqa: E402
from .ops.cross_entropy import cross_entropy  # noqa: E402
from .ops.linear_cross_entropy import linear_cross_entropy  # noqa: E402
from .ops.norm import layer_norm, rms_norm  # noqa: E402
from .ops.softmax import log_softmax, softmax  # noqa: E402

__version__ = "0.1.0"
__all__ = ["softmax", "log_softmax", "rms_norm", "layer_norm", "cross_entropy",
           "linear_cross_entropy", "nn", "__version__"]
