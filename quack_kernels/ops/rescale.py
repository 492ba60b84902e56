"""The rescale of gradients computed ahead of the backward (kernels/rescale.py): the
cross-entropy's own backward (per-row scales, rows of valid targets, in place) and the
linear cross-entropy's (one scale for every row of the hidden states' and the head's
gradients, in place or from an fp32 sum into the head's dtype)."""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from ..kernels.rescale import RowRescale
from ..primitives.compile_cache import compile_kernel, fake_rows, fake_strided_vector, fake_vector
from ..primitives.config import RowConfig, elementwise_row_config, loop_grid_rows
from .common import (alignment_key, compiled, cutlass_dtype, kernel_key,
                     resident_row_blocks, vector_limit)


@functools.lru_cache(maxsize=None)
def rescale_config(n_cols: int, dtype: torch.dtype, max_vec: int | None = None) -> RowConfig:
    return elementwise_row_config(n_cols, dtype.itemsize, max_vec)


def rescale_kernel(cfg: RowConfig, dtype: torch.dtype, out_dtype: Optional[torch.dtype],
                   target_dtype: Optional[torch.dtype], uniform: bool):
    """(kernel object, *fake arguments it compiles against). ``out_dtype`` None: in
    place; ``target_dtype`` None: no targets; ``uniform``: one scale for every row."""
    import cutlass
    import cutlass.cute as cute

    rows = cute.sym_int()
    grad = fake_rows(cutlass_dtype(dtype), cfg.n_cols, cfg.vec, rows)
    out = grad if out_dtype is None else fake_rows(cutlass_dtype(out_dtype), cfg.n_cols,
                                                   cfg.vec, rows)
    target = None if target_dtype is None else fake_vector(
        cutlass.Int32 if target_dtype == torch.int32 else cutlass.Int64, rows)
    kernel = RowRescale(cfg, with_target=target_dtype is not None,
                        out_of_place=out_dtype is not None, uniform=uniform)
    return (kernel, grad, out, target, fake_strided_vector(cutlass.Float32, rows),
            fake_strided_vector(cutlass.Float32, rows), cutlass.Int64(-100), cutlass.Int32(1))


@functools.lru_cache(maxsize=None)  # on every call: skip building the key
def compile_rescale(cfg: RowConfig, dtype: torch.dtype, out_dtype: Optional[torch.dtype],
                    target_dtype: Optional[torch.dtype], uniform: bool):
    return compiled(kernel_key("row_rescale", dtype, out_dtype, target_dtype, uniform, cfg),
                    lambda: compile_kernel(*rescale_kernel(cfg, dtype, out_dtype, target_dtype,
                                                           uniform)))


# launch plans by what decides them (a repeated call skips the config and compile lookups)
_plans: dict = {}


def rescale_launch(grad: Tensor, dloss: Tensor, held: Tensor, out: Optional[Tensor] = None,
                   target: Optional[Tensor] = None, ignore_index: int = -100) -> None:
    """The kernel on checked CUDA inputs: ``grad`` (M, N) of unit column stride,
    ``dloss`` and ``held`` (M,) fp32 (broadcast views welcome), ``out`` None (in place)
    or an (M, N) buffer of unit column stride, ``target`` None or (M,) contiguous
    int32/int64. M > 0. Broadcast scales in place run a looping grid of the CTAs the
    GPU holds at once (nothing to move: each returns at once); anything else one CTA
    per row block."""
    uniform = dloss.stride(0) == 0 and held.stride(0) == 0
    out_key = () if out is None else (out.dtype, *alignment_key(out))
    key = (grad.shape[1], grad.dtype, grad.device.index, *alignment_key(grad), out_key,
           None if target is None else target.dtype, uniform)
    plan = _plans.get(key)
    if plan is None:
        max_vec = vector_limit(grad) if out is None else vector_limit(grad, out)
        cfg = rescale_config(grad.shape[1], grad.dtype, max_vec)
        args = (cfg, grad.dtype, None if out is None else out.dtype,
                None if target is None else target.dtype, uniform)
        loops = uniform and out is None
        resident = resident_row_blocks(rescale_kernel(*args)[0], grad.device) if loops else None
        plan = _plans[key] = (compile_rescale(*args), cfg, resident)
    fn, cfg, resident = plan
    blocks = -(-grad.shape[0] // cfg.rows_per_block)
    grid_rows = blocks if resident is None else loop_grid_rows(cfg, grad.shape[0], resident)
    fn(grad, grad if out is None else out, target, dloss, held, ignore_index, grid_rows)


def report_variants(n_grid, dtypes):
    """Kernel variants for the sm_90a resource report: (name, n, dtype, cfg, build)."""
    # (name, in place or from fp32, targets, uniform): the cross-entropy's per-row and
    # reduced-loss rescales, the linear cross-entropy's in place and from an fp32 sum
    variants = (("rescale_target", False, torch.int64, False),
                ("rescale_target_uniform", False, torch.int64, True),
                ("rescale_uniform", False, None, True),
                ("rescale_from_fp32", True, None, True))
    for dtype in dtypes:
        for name, from_fp32, target_dtype, uniform in variants:
            if from_fp32 and dtype == torch.float32:
                continue
            grad_dtype = torch.float32 if from_fp32 else dtype
            for n in n_grid:
                cfg = rescale_config(n, grad_dtype)
                args = (cfg, grad_dtype, dtype if from_fp32 else None, target_dtype, uniform)
                yield (name, n, dtype, cfg, lambda args=args: rescale_kernel(*args))
