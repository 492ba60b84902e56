"""Torch-side helpers shared by every op: input checks, row views, launch plumbing."""

from __future__ import annotations

import functools
import math

import torch

from ..primitives.compile_cache import SUPPORTED_DTYPES, compiled, cutlass_dtype, target_arch
from ..primitives import config
from ..primitives.config import ACCESS_BYTES
from ..primitives.occupancy import resident_clusters

MIN_CAPABILITY = (9, 0)  # cluster launch, DSMEM and st.async are sm_90 features


def check_float_dtype(name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"quack_kernels: {name} has dtype {tensor.dtype}; supported dtypes are "
            "torch.float32, torch.float16 and torch.bfloat16"
        )


def check_same_device(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {dev}" for name, dev in devices.items())
        raise ValueError(f"quack_kernels: tensors must be on one device, got {listing}")


def device_index(device: torch.device) -> int:
    """The CUDA device index of ``device`` ("cuda" alone means the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def check_gpu(tensor: torch.Tensor) -> None:
    """Our CUDA kernels need Hopper (sm_90) or newer (cached: this is on every call)."""
    capability = _capability(device_index(tensor.device))
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(tensor.device)
        raise RuntimeError(
            f"quack_kernels: the CUDA kernels need compute capability 9.0 (Hopper) or newer; "
            f"{name} is sm_{capability[0]}{capability[1]}. Use the CPU path or torch's ops."
        )


@functools.lru_cache(maxsize=None)
def _sms_of(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SMs of ``device`` (sizes the grid of kernels looping over row blocks)."""
    return _sms_of(device_index(device))


def resident_row_blocks(kernel, device: torch.device) -> int:
    """Row blocks (clusters of kernel.cfg.cluster_size CTAs) of a looping ``kernel``
    resident on ``device`` at once: ``kernel.ctas_per_sm()`` per SM, and for clusters
    no more than the driver places together (GPCs bound them, see
    primitives.occupancy)."""
    cfg = kernel.cfg
    by_sms = kernel.ctas_per_sm() * num_sms(device) // cfg.cluster_size
    if cfg.cluster_size == 1:
        return by_sms
    return max(1, min(by_sms, resident_clusters(device_index(device), cfg.cluster_size,
                                                cfg.threads_per_block, kernel.launch_smem_bytes())))


def eager_cuda(*tensors) -> bool:
    """Whether a call may skip the custom op's dispatcher and run the CUDA implementation
    directly: plain CUDA tensors (None allowed), no torch.compile tracing and no
    dispatch mode (fake tensors, profilers of ops). The dispatcher's Python layers cost
    100+ us per call in torch 2.11 (measured with benchmarks/host_profile.py), more
    than the kernels of most shapes. Under functorch transforms (vmap, grad) tensors
    are wrapped and have no data of their own."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() \
            or torch._C._are_functorch_transforms_active():
        return False
    return all(t is None or (type(t) in _PLAIN_TENSORS and t.is_cuda) for t in tensors)


# tensors whose data the kernels may read directly: not subclasses (DTensor, fake
# tensors, ...) beyond Parameter, which every module's weights are
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def as_rows(tensor: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (M, N) with unit column stride, a view when the layout allows (a 2-D
    tensor of unit column stride as it is: a view would cost an autograd node)."""
    if tensor.dim() == 2 and tensor.stride(-1) == 1:
        return tensor
    n_cols = tensor.shape[-1]
    rows = tensor.reshape(math.prod(tensor.shape[:-1]), n_cols)
    if rows.stride(-1) != 1 and rows.shape[0] > 0:
        rows = rows.contiguous()
    return rows


def rows_view(tensor: torch.Tensor, n_cols: int) -> torch.Tensor:
    """A contiguous (..., n_cols) tensor as (M, n_cols); 2-D tensors as they are (a
    view costs ~2 us of host time per call)."""
    return tensor if tensor.dim() == 2 else tensor.view(-1, n_cols)


def flat(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous per-row vector (shape of the leading dims) as (M,), no view if 1-D."""
    return tensor if tensor.dim() == 1 else tensor.view(-1)


def vector_limit(*tensors: torch.Tensor | None) -> int:
    """Largest element count a 16-byte access may cover for all of ``tensors`` (None
    skipped): each base pointer must be a multiple of it, and so must the row stride of
    an (M, N) view of more than one row (1-D per-column vectors and contiguous tensors
    of other ranks: the base alone; their rows' length is the config's to check)."""
    limit = ACCESS_BYTES
    for t in tensors:
        if t is None:
            continue
        elem = t.element_size()
        per_access = ACCESS_BYTES // elem
        align = math.gcd(per_access, t.data_ptr() // elem if t.data_ptr() % elem == 0 else 1)
        if t.dim() == 2 and t.shape[0] > 1:
            align = math.gcd(align, t.stride(0))
        limit = min(limit, align)
    return max(1, limit)


def shiftable(*rows: torch.Tensor) -> bool:
    """Whether rows of these (M, N) tensors may be read from the 16-byte boundary before
    each (config.shifted_row_share, where config.SHIFTED_ODD_ROWS is on): bases 16-byte
    aligned, and one row stride for all, N (a kernel finds a row's shift from the first
    tensor's stride). No rows: those the C++ backward hands over (aligned, contiguous)."""
    return config.SHIFTED_ODD_ROWS and all(t.data_ptr() % ACCESS_BYTES == 0
               and (t.shape[0] <= 1 or t.stride(0) == t.shape[1]) for t in rows)


def alignment_key(rows: torch.Tensor) -> tuple:
    """What vector_limit reads of a (M, N) tensor besides its dtype, cheaply: the base
    pointer and the row stride modulo 16 (every access width divides 16 elements) and
    whether the stride matters (more than one row). Keys launch caches."""
    return rows.data_ptr() % 16, rows.stride(0) % 16, rows.shape[0] > 1


def kernel_key(name: str, *parts) -> tuple:
    return (name, target_arch(), *parts)


__all__ = [
    "check_float_dtype",
    "check_same_device",
    "check_gpu",
    "eager_cuda",
    "num_sms",
    "resident_row_blocks",
    "as_rows",
    "flat",
    "rows_view",
    "vector_limit",
    "shiftable",
    "alignment_key",
    "kernel_key",
    "compiled",
    "cutlass_dtype",
]
