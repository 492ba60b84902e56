"""Compile cache: one binary per (kernel, dtypes, N, flags, arch), row count symbolic.

Kernels are compiled against fake tensors whose row count (and row stride) are
symbolic, so a new batch size never recompiles. Launch goes through the DSL's TVM-FFI
path: the compiled function takes torch tensors directly and launches on torch's
current stream (CUDA-graph capture and torch.compile see an ordinary launch).

The target architecture is the current GPU's, or ``CUTE_DSL_ARCH`` (e.g. ``sm_90a``)
on machines without one, where compiling still produces PTX/cubin for the resource
report.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Callable, Hashable

import torch

_cache: dict[Hashable, Any] = {}
_lock = threading.Lock()
_key_locks: dict[Hashable, threading.Lock] = {}

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cutlass_dtype(dtype: torch.dtype):
    import cutlass

    return {
        torch.float32: cutlass.Float32,
        torch.float16: cutlass.Float16,
        torch.bfloat16: cutlass.BFloat16,
    }[dtype]


def compile_for_hopper_without_gpu() -> None:
    """On a machine without a CUDA GPU, compile for sm_90a (what these kernels target)
    unless CUTE_DSL_ARCH says otherwise. The DSL reads the variable when it is imported
    and otherwise picks its own default (sm_100a), so this runs before anything imports
    it: on import of the package."""
    if "CUTE_DSL_ARCH" not in os.environ and not torch.cuda.is_available():
        os.environ["CUTE_DSL_ARCH"] = "sm_90a"


@functools.lru_cache(maxsize=None)
def target_arch() -> str:
    """The arch kernels are compiled for: CUTE_DSL_ARCH if set, else the current GPU's
    (sm_90a for Hopper: cluster launch and DSMEM need the 'a' features). Read once per
    process: it is part of every cache key, looked up on every call."""
    arch = os.environ.get("CUTE_DSL_ARCH")
    if arch:
        return arch
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}a" if major >= 9 else f"sm_{major}{minor}"


def compiled(key: Hashable, build: Callable[[], Any]) -> Any:
    """Return the compiled kernel for ``key``, building it once (thread-safe: two
    threads asking for the same key compile it once; different keys compile in
    parallel)."""
    fn = _cache.get(key)
    if fn is not None:
        return fn
    with _lock:
        key_lock = _key_locks.setdefault(key, threading.Lock())
    with key_lock:
        fn = _cache.get(key)
        if fn is None:
            fn = build()
            _cache[key] = fn
    return fn


def kernel_handle(fn) -> int:
    """The TVM-FFI function handle of a compiled kernel (0 for None), for the C++ fast
    path (quack_kernels.native), which calls it with the same arguments as Python."""
    return 0 if fn is None else fn._tvm_ffi_function.__chandle__()


def fake_rows(dtype, n_cols: int, vec: int, rows=None, shifted: bool = False):
    """A fake (M, n_cols) tensor: M symbolic, unit column stride, row stride symbolic
    but a multiple of ``vec`` (64-bit, so tensors over 2^31 elements index safely), base
    aligned to one vector. ``shifted``: a row stride of any value (rows read from the
    16-byte boundary before them: config.shifted_row_share)."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    if rows is None:
        rows = cute.sym_int()
    row_stride = cute.sym_int(64, divisibility=1 if shifted else vec)
    return make_fake_tensor(
        dtype, (rows, n_cols), (row_stride, 1), assumed_align=vec * dtype.width // 8
    )


def fake_vector(dtype, length, align_elems: int = 1):
    from cutlass.cute.runtime import make_fake_compact_tensor

    return make_fake_compact_tensor(dtype, (length,), assumed_align=align_elems * dtype.width // 8)


def fake_strided_vector(dtype, length):
    """A fake (length,) tensor with a symbolic element stride: a broadcast view (stride
    0, e.g. an expanded scalar such as the upstream gradient of a mean) is accepted
    without a copy."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(dtype, (length,), (cute.sym_int(64),), assumed_align=dtype.width // 8)


def compile_kernel(kernel_obj, *fake_args, keep_cubin_in: str | None = None,
                   keep_ptx_in: str | None = None):
    """cute.compile with TVM-FFI and the caller's stream taken from torch. With
    ``keep_cubin_in`` (a folder) the cubin is kept there; its path is ``fn.__cubin__``;
    with ``keep_ptx_in`` the PTX is (one of the two at a time).
    A configuration whose shared memory exceeds a CTA's is refused here, with the row
    length in the message, instead of failing at launch."""
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream

    from .config import SMEM_BYTES_PER_CTA

    smem = kernel_obj.smem_bytes()
    if smem > SMEM_BYTES_PER_CTA:
        raise ValueError(
            f"quack_kernels: {type(kernel_obj).__name__} for rows of {kernel_obj.cfg.n_cols} "
            f"columns needs {smem // 1024} KiB of shared memory per CTA, more than the "
            f"{SMEM_BYTES_PER_CTA // 1024} KiB a Hopper CTA has; use shorter rows"
        )

    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    options = "--enable-tvm-ffi"
    for kept, folder in (("cubin", keep_cubin_in), ("ptx", keep_ptx_in)):
        if folder:
            options += f" --keep-{kept} --dump-dir={folder}"
    return cute.compile(kernel_obj, *fake_args, stream, options=options)
