"""rms_norm / layer_norm as torch custom ops: CPU reference, CUDA kernels, fake kernels,
autograd; the public functions and their input checks.

Ops (namespace ``quack_kernels``), usable directly by callers who want the statistics:
  norm_forward(x, weight?, bias?, residual?, eps, weight_offset, rms, out_dtype?,
               residual_dtype?, store_residual) -> (y, residual_out, mean, rstd)
      residual_out (the stream x + residual, in residual_dtype) is empty unless
      store_residual and a residual is given; mean is empty for RMSNorm; mean and rstd
      are fp32 of shape x.shape[:-1].
  norm_backward(dy, h, weight?, mean?, rstd, dresidual_out?, weight_offset, rms,
                dx_dtype?, dresidual_dtype?, need_dweight, dbias_dtype?)
      -> (dx, dresidual, dweight, dbias), each empty when not asked for.
"""

from __future__ import annotations

import functools
import itertools

from typing import Optional

import torch
from torch import Tensor

from ..kernels.column_sum import ColumnSum
from ..kernels.norm import NormBackward, NormForward
from ..native import module as native_module
from ..primitives import config
from ..primitives.compile_cache import (SUPPORTED_DTYPES, compile_kernel, fake_rows, fake_vector,
                                        kernel_handle)
from ..primitives.config import (
    ACCESS_BYTES,
    ColumnSumConfig,
    SMEM_BYTES_PER_CTA,
    RowConfig,
    column_sum_config,
    loop_grid_rows,
    partial_sum_rows,
    shift_classes,
    REGISTER_SHARE_VALUES,
    norm_backward_clustered_share,
    norm_backward_prefetches_past_buffers,
    norm_backward_register_threads,
    norm_forward_share,
    odd_row_forward_share,
    odd_row_register_share,
    norm_forward_shifts,
    shifted_row_share,
    shifted_sums_share,
    splices_shifted_columns,
    register_share,
    row_config,
    staged_layer_norm_share,
    widened_16bit_share,
    with_l2_prefetch,
    with_prefetch,
)
from .common import (
    as_rows,
    check_float_dtype,
    check_gpu,
    check_same_device,
    compiled,
    cutlass_dtype,
    eager_cuda,
    flat,
    kernel_key,
    resident_row_blocks,
    rows_view,
    shiftable,
    vector_limit,
)

EMPTY = (0,)


def _stream_dtype(x: Tensor, residual: Optional[Tensor], residual_dtype) -> torch.dtype:
    """dtype of the residual stream x + residual: as asked, else the residual's, else x's."""
    return residual_dtype or (residual.dtype if residual is not None else x.dtype)


# ----------------------------------------------------------------------------- configs
def shifts_rows(*rows: Tensor, columns=()) -> bool:
    """Whether a kernel may read these (M, N) row tensors from the 16-byte boundary
    before each (forward_config's and backward_config's ``shifted``): shiftable ones,
    where config.SHIFTED_NORM_ROWS is on. The outputs the kernel writes (fresh,
    contiguous) are among them, or (the C++ path's) shiftable whenever the inputs are.
    ``columns``: the forward's weight and bias, the backward's weight (None: absent);
    those spliced from whole vectors (config.splices_shifted_columns: the backward's
    where its share has no room to stage it, config.shifted_sums_share) on 16 bytes too."""
    return config.SHIFTED_NORM_ROWS and shiftable(*rows) and all(
        c is None or not splices_shifted_columns(c.element_size())
        or c.data_ptr() % ACCESS_BYTES == 0 for c in columns)


def _bytes(*dtypes) -> list[int]:
    return [d.itemsize for d in dtypes if d is not None]


@functools.lru_cache(maxsize=None)  # on every call
def forward_config(n_cols: int, rms: bool, x_dtype, residual_dtype, has_residual: bool,
                   out_dtype, weight_dtype=None, bias_dtype=None, max_vec: int | None = None,
                   residual_in_dtype=None, shifted: bool = False) -> RowConfig:
    """Vector width from the widest tensor touched per column (a 16-byte access of it);
    staged: x, and the residual (of ``residual_in_dtype``, default the stream's
    ``residual_dtype``) when given; CTA shares from config.norm_forward_share, RMSNorm's
    of x alone widened by config.widened_16bit_share, LayerNorm's of x alone staged by
    config.staged_layer_norm_share. Odd 16-bit rows: read from the 16-byte boundary
    before each where they may be (``shifted``: shifts_rows) and the share of the
    aligned span stages them (config.shifted_row_share), else those of x alone as
    config.odd_row_forward_share gives them."""
    residual_in_dtype = residual_in_dtype or residual_dtype
    staged = [x_dtype, residual_in_dtype] if has_residual else [x_dtype]
    row_widest = max(_bytes(*staged, residual_dtype if has_residual else None, out_dtype))
    widest = max([row_widest, *_bytes(weight_dtype, bias_dtype)])
    if shifted and norm_forward_shifts(n_cols, rms, has_residual):
        unshifted = forward_config(n_cols, rms, x_dtype, residual_dtype, has_residual,
                                   out_dtype, weight_dtype, bias_dtype, max_vec,
                                   residual_in_dtype)
        # (the weight and bias are spliced or staged to the row's shift: their width sets
        # no vector)
        rows_alone = functools.partial(
            forward_config, rms=rms, x_dtype=x_dtype, residual_dtype=residual_dtype,
            has_residual=has_residual, out_dtype=out_dtype, residual_in_dtype=residual_in_dtype)
        staged_columns = [b for b in _bytes(weight_dtype, bias_dtype)
                          if not splices_shifted_columns(b)]
        return shifted_row_share(rows_alone, unshifted, row_widest,
                                 sum(_bytes(*staged)) + sum(staged_columns),
                                 through_smem=True) or unshifted
    bytes_per_col = sum(_bytes(*staged))
    cta_row_bytes, wide_clusters, values_per_thread = norm_forward_share(
        rms, len(staged), n_cols, bytes_per_col)
    share = functools.partial(row_config, n_cols, widest, staged_tensors=len(staged),
                              bytes_per_col=bytes_per_col, max_vec=max_vec,
                              cta_row_bytes=cta_row_bytes, wide_clusters=wide_clusters)
    if has_residual:
        return share(values_per_thread=values_per_thread)
    cfg = widened_16bit_share(share, bytes_per_col, widest) if rms \
        else staged_layer_norm_share(share, widest, max(_bytes(x_dtype, weight_dtype, bias_dtype)))
    return odd_row_forward_share(share, cfg, bytes_per_col, "reread" if rms else "staged") \
        or cfg


@functools.lru_cache(maxsize=None)  # on every call
def backward_config(n_cols: int, h_dtype, dy_dtype, out_dtypes: tuple, weight_dtype,
                    accumulators: int, max_vec: int | None = None,
                    cta_row_bytes: int | None = None,
                    values_per_thread: int | None = None,
                    max_threads_per_row: int | None = None, rms: bool = False,
                    shifted: bool = False) -> RowConfig:
    """Staged: h and dy; every fp32 dweight/dbias accumulator counts as one more
    tensor kept per column (in registers when config.sums_in_registers, else shared
    memory). ``cta_row_bytes``, ``values_per_thread`` and ``max_threads_per_row``
    default to the norm backward's tuning (config.norm_backward_register_threads, else
    config.norm_backward_share, and SUM_THREADS_PER_ROW for shares whose sums would
    otherwise leave registers); sweeps override them. ``rms``: the config of an RMSNorm
    (else one LayerNorm fits too). Odd 16-bit rows read from the 16-byte boundary
    before each where they may be (``shifted``: shifts_rows) take the share of the
    aligned span (config.shifted_row_share, through shared memory) where it fits with
    the weight staged beside it."""
    widest = max(_bytes(h_dtype, dy_dtype, weight_dtype, *out_dtypes))
    staged_bytes = _bytes(h_dtype, dy_dtype)
    staged = max(staged_bytes)
    bytes_per_col = sum(staged_bytes) + 4 * accumulators
    # (LayerNorm's kernel sizes RMSNorm's configs too; where a 16-bit LayerNorm share holds
    # its weight in registers, RMSNorm's stages it in 16-32 KiB more shared memory, which
    # changed no config of 1344 checked: those shares take one CTA per SM either way)
    kernel_for = lambda c: _backward_kernel_object(  # noqa: E731
        c, False, h_dtype, dy_dtype, accumulators >= 1, accumulators >= 2, weight_dtype)
    if shifted:
        unshifted = backward_config(n_cols, h_dtype, dy_dtype, out_dtypes, weight_dtype,
                                    accumulators, max_vec, rms=rms)
        # (the weight is staged value by value: its width sets no vector)
        rows_alone = functools.partial(backward_config, h_dtype=h_dtype, dy_dtype=dy_dtype,
                                       out_dtypes=out_dtypes, weight_dtype=None,
                                       accumulators=accumulators, rms=rms)
        cfg = shifted_row_share(rows_alone, unshifted, max(_bytes(h_dtype, dy_dtype, *out_dtypes)),
                                sum(_bytes(h_dtype, dy_dtype, weight_dtype)), through_smem=True)
        if _fits_shifted(cfg, kernel_for, weight_dtype, weight_staged=True):
            return cfg
        # (LayerNorm's two sums only, measured there, with or without a residual's
        # gradients; the weight then read from global memory: spliced, so 16-bit;
        # RMSNorm's and one sum's wider CTAs spilled, sm_90a)
        spliced = weight_dtype is None or splices_shifted_columns(weight_dtype.itemsize)
        cfg = shifted_sums_share(n_cols, max(_bytes(h_dtype, dy_dtype, *out_dtypes))) \
            if accumulators == 2 and not rms and spliced else None
        return cfg if _fits_shifted(cfg, kernel_for, weight_dtype) else unshifted
    tuned = all(v is None for v in (cta_row_bytes, values_per_thread, max_threads_per_row))
    register_threads = norm_backward_register_threads(staged, accumulators, n_cols, rms,
                                                      max_vec)
    register = None  # (threads, values) of a one-chunk register share
    if tuned and register_threads:
        register = (register_threads, REGISTER_SHARE_VALUES)
    else:
        prefetched = norm_backward_clustered_share(
            n_cols, widest, staged, accumulators, bytes_per_col, max_vec, cta_row_bytes,
            values_per_thread, max_threads_per_row, kernel_for)
        if tuned:
            register = odd_row_register_share(n_cols, staged, accumulators, len(out_dtypes),
                                              rms, prefetched)
    if register:
        prefetched = with_prefetch(register_share(
            n_cols, widest, *register, bytes_per_col=bytes_per_col, max_vec=max_vec),
            kernel_for)
    return with_l2_prefetch(prefetched, *staged_bytes, past_two_buffers=(
        norm_backward_prefetches_past_buffers(prefetched, accumulators)))


def _fits_shifted(cfg: RowConfig | None, kernel_for, weight_dtype,
                  weight_staged: bool = False) -> bool:
    """Whether the backward's shifted share ``cfg`` fits in shared memory, with the
    weight staged there too where ``weight_staged`` (NormBackward stages it where it
    fits)."""
    if cfg is None:
        return False
    kernel = kernel_for(cfg)
    return kernel.launch_smem_bytes() <= SMEM_BYTES_PER_CTA \
        and (kernel.weight_staged or weight_dtype is None or not weight_staged)


def forward_kernel(cfg: RowConfig, rms: bool, x_dtype, residual_dtype, has_residual: bool,
                   store_residual: bool, weight_dtype, bias_dtype, out_dtype,
                   residual_in_dtype=None):
    """(kernel object, *fake arguments it compiles against). ``residual_dtype``: the
    stream x + residual (rounding, stored output); ``residual_in_dtype``: the residual
    input (default the same)."""
    from cutlass import Float32
    import cutlass.cute as cute

    residual_in_dtype = residual_in_dtype or residual_dtype
    vec, n, dt = cfg.vec, cfg.n_cols, cutlass_dtype
    rdt = dt(residual_dtype)
    columns = [None if d is None else dt(d) for d in (weight_dtype, bias_dtype)]
    kernel = NormForward(cfg, rms, dt(x_dtype), dt(residual_in_dtype), rdt, has_residual,
                         store_residual, tuple(d for d in columns if d is not None))
    rows = cute.sym_int()
    row_tensor = functools.partial(fake_rows, n_cols=n, vec=vec, shifted=cfg.row_shift)
    return (
        kernel,
        row_tensor(dt(x_dtype)),
        row_tensor(dt(residual_in_dtype)) if has_residual else None,
        *(None if d is None else fake_vector(d, n, _column_alignment(cfg, d)) for d in columns),
        row_tensor(dt(out_dtype)),
        row_tensor(rdt) if store_residual else None,
        fake_vector(Float32, rows) if not rms else None,
        fake_vector(Float32, rows),
        Float32(1e-6),
        Float32(0.0),
    )


def _column_alignment(cfg: RowConfig, dtype) -> int:
    """Elements a forward's per-column vector of cutlass ``dtype`` is aligned to: a
    vector, but beside shifted rows where it is staged value by value
    (config.splices_shifted_columns)."""
    if cfg.row_shift and not splices_shifted_columns(dtype.width // 8):
        return 1
    return cfg.vec


def compile_forward(cfg: RowConfig, rms: bool, x_dtype, residual_dtype, has_residual: bool,
                    store_residual: bool, weight_dtype, bias_dtype, out_dtype,
                    residual_in_dtype=None):
    residual_in_dtype = residual_in_dtype or residual_dtype
    args = (cfg, rms, x_dtype, residual_dtype, has_residual, store_residual, weight_dtype,
            bias_dtype, out_dtype, residual_in_dtype)
    return compiled(kernel_key("norm_fwd", *args), lambda: compile_kernel(*forward_kernel(*args)))


def backward_kernel(cfg: RowConfig, rms: bool, h_dtype, dy_dtype, weight_dtype,
                    has_dresidual_out: bool, dresidual_out_dtype, dx_dtype, dresidual_dtype,
                    need_dweight: bool, need_dbias: bool):
    """(kernel object, *fake arguments it compiles against)."""
    from cutlass import Float32, Int32
    import cutlass.cute as cute

    vec, n, dt = cfg.vec, cfg.n_cols, cutlass_dtype
    kernel = _backward_kernel_object(cfg, rms, h_dtype, dy_dtype, need_dweight, need_dbias,
                                     weight_dtype)
    rows = cute.sym_int()
    row_tensor = functools.partial(fake_rows, n_cols=n, vec=vec, shifted=cfg.row_shift)
    return (
        kernel,
        row_tensor(dt(h_dtype)),
        row_tensor(dt(dy_dtype)),
        # (a shifted row's weight is staged value by value: any alignment; read from
        # global memory it is spliced from whole vectors)
        fake_vector(dt(weight_dtype), n, 1 if cfg.row_shift and kernel.weight_staged else vec)
        if weight_dtype is not None else None,
        fake_vector(Float32, rows) if not rms else None,
        fake_vector(Float32, rows),
        row_tensor(dt(dresidual_out_dtype)) if has_dresidual_out else None,
        row_tensor(dt(dx_dtype)) if dx_dtype is not None else None,
        row_tensor(dt(dresidual_dtype)) if dresidual_dtype is not None else None,
        fake_rows(Float32, n, vec) if need_dweight else None,
        fake_rows(Float32, n, vec) if need_dbias else None,
        Float32(0.0),
        Int32(1),
    )


def compile_backward(cfg: RowConfig, rms: bool, h_dtype, dy_dtype, weight_dtype,
                     has_dresidual_out: bool, dresidual_out_dtype, dx_dtype, dresidual_dtype,
                     need_dweight: bool, need_dbias: bool):
    args = (cfg, rms, h_dtype, dy_dtype, weight_dtype, has_dresidual_out, dresidual_out_dtype,
            dx_dtype, dresidual_dtype, need_dweight, need_dbias)
    return compiled(kernel_key("norm_bwd", *args), lambda: compile_kernel(*backward_kernel(*args)))


def column_sum_kernel(cfg: ColumnSumConfig, out_dtypes: tuple):
    """(kernel object, *fake arguments): the fixed-order sum of the backward's partial
    rows into dweight / dbias (``out_dtypes``, one per segment)."""
    from cutlass import Float32

    outs = [fake_vector(cutlass_dtype(d), cfg.n_cols) for d in out_dtypes]
    return (ColumnSum(cfg), fake_rows(Float32, cfg.width, 4), outs[0],
            outs[1] if cfg.segments == 2 else None)


def compile_column_sum(cfg: ColumnSumConfig, out_dtypes: tuple):
    return compiled(kernel_key("column_sum", cfg, out_dtypes),
                    lambda: compile_kernel(*column_sum_kernel(cfg, out_dtypes)))


@functools.lru_cache(maxsize=None)  # on every call
def _backward_kernel_object(cfg: RowConfig, rms: bool, h_dtype, dy_dtype, need_dweight: bool,
                            need_dbias: bool, weight_dtype=None) -> NormBackward:
    dt = cutlass_dtype
    return NormBackward(cfg, rms, dt(h_dtype), dt(dy_dtype), need_dweight, need_dbias,
                        dt(weight_dtype) if weight_dtype is not None else None)


def report_variants(n_grid, dtypes):
    """Kernel variants for the sm_90a resource report: (name, n, dtype, cfg, build).
    Per norm: forward with weight (and bias for LayerNorm); forward with a residual
    whose stream is stored (prenorm); backward without and with dweight/dbias and a
    residual gradient; each of them shifted too where its rows may be (odd 16-bit rows:
    the configs' ``shifted``)."""
    for dtype in dtypes:
        for n in n_grid:
            for rms in (True, False):
                name = "rms_norm" if rms else "layer_norm"
                bias = None if rms else dtype
                for has_residual, shifted in itertools.product((False, True), (False, True)):
                    cfg = forward_config(n, rms, dtype, dtype, has_residual, dtype, dtype, bias,
                                         shifted=shifted)
                    if cfg.row_shift != shifted:
                        continue  # (rows that are not shifted: the unshifted variant)
                    args = (cfg, rms, dtype, dtype, has_residual, has_residual, dtype, bias, dtype)
                    yield (f"{name}_fwd" + ("_res" if has_residual else "")
                           + ("_shifted" if shifted else ""), n, dtype, cfg,
                           lambda args=args: forward_kernel(*args))
                # (sums, residual gradients): none; both; the sums alone where their
                # share is another (a share sized by its outputs, such as RMSNorm's
                # odd-row register share of 50257 columns)
                for (sums, dres), shifted in itertools.product(
                        ((False, False), (True, True), (True, False)), (False, True)):
                    accumulators = (1 if rms else 2) if sums else 0
                    outs = (dtype, dtype) if dres else (dtype,)
                    cfg = backward_config(n, dtype, dtype, outs, dtype, accumulators, rms=rms,
                                          shifted=shifted)
                    if cfg.row_shift != shifted or sums and not dres and cfg == backward_config(
                            n, dtype, dtype, (dtype,) * 2, dtype, accumulators, rms=rms,
                            shifted=shifted):
                        continue
                    args = (cfg, rms, dtype, dtype, dtype, dres, dtype if dres else None, dtype,
                            dtype if dres else None, sums, accumulators == 2)
                    yield (f"{name}_bwd" + ("_dw" if sums else "") + ("" if dres or not sums
                                                                       else "_alone")
                           + ("_shifted" if shifted else ""), n, dtype, cfg,
                           lambda args=args: backward_kernel(*args))
            for segments in (1, 2):
                cfg = column_sum_config(n, segments)
                yield (f"column_sum_{segments}", n, dtype, cfg,
                       lambda cfg=cfg, outs=(dtype,) * segments: column_sum_kernel(cfg, outs))


# -------------------------------------------------------------------------- references
def norm_reference(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                   residual: Optional[Tensor], eps: float, weight_offset: float, rms: bool,
                   out_dtype: Optional[torch.dtype] = None,
                   residual_dtype: Optional[torch.dtype] = None,
                   compute_dtype: torch.dtype = torch.float32):
    """(y, h, mean, rstd) in ``compute_dtype`` math; y in out_dtype, h (the normalized
    stream x + residual, rounded to residual_dtype) in residual_dtype."""
    out_dtype = out_dtype or x.dtype
    residual_dtype = _stream_dtype(x, residual, residual_dtype)
    h = x.to(compute_dtype)
    if residual is not None:
        h = (h + residual.to(compute_dtype)).to(residual_dtype).to(compute_dtype)
    if rms:
        mean = torch.zeros(h.shape[:-1], dtype=compute_dtype, device=h.device)
        var = (h * h).mean(-1)
    else:
        mean = h.mean(-1)
        var = ((h - mean[..., None]) ** 2).mean(-1)
    rstd = torch.rsqrt(var + eps)
    y = (h - mean[..., None]) * rstd[..., None]
    if weight is not None:
        y = y * (weight.to(compute_dtype) + weight_offset)
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return y.to(out_dtype), h.to(residual_dtype), mean, rstd


def norm_backward_reference(dy: Tensor, h: Tensor, weight: Optional[Tensor], mean: Optional[Tensor],
                            rstd: Tensor, dresidual_out: Optional[Tensor], weight_offset: float,
                            rms: bool, compute_dtype: torch.dtype = torch.float32):
    """(dh, dweight, dbias) in ``compute_dtype``."""
    hc, dyc = h.to(compute_dtype), dy.to(compute_dtype)
    rstd = rstd.to(compute_dtype)[..., None]
    mean = 0.0 if rms else mean.to(compute_dtype)[..., None]
    xhat = (hc - mean) * rstd
    g = dyc if weight is None else dyc * (weight.to(compute_dtype) + weight_offset)
    dh = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if not rms:
        dh = dh - g.mean(-1, keepdim=True)
    dh = dh * rstd
    if dresidual_out is not None:
        dh = dh + dresidual_out.to(compute_dtype)
    # summed over the rows as (rows, N): a sum over no dims (a 1-D x) would sum them all
    n_cols = h.shape[-1]
    return dh, (dyc * xhat).reshape(-1, n_cols).sum(0), dyc.reshape(-1, n_cols).sum(0)


# ----------------------------------------------------------------------------- the ops
@torch.library.custom_op("quack_kernels::norm_forward", mutates_args=(), device_types="cpu")
def norm_forward(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor],
                 residual: Optional[Tensor], eps: float, weight_offset: float, rms: bool,
                 out_dtype: Optional[torch.dtype], residual_dtype: Optional[torch.dtype],
                 store_residual: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """RMSNorm (rms=True) or LayerNorm over the last dimension: (y, residual_out, mean,
    rstd); see the module docstring."""
    _check_forward(x, weight, bias, residual, out_dtype, residual_dtype)
    y, h, mean, rstd = norm_reference(x, weight, bias, residual, eps, weight_offset, rms,
                                      out_dtype, residual_dtype)
    h = h if store_residual and residual is not None else x.new_empty(EMPTY, dtype=h.dtype)
    mean = mean if not rms else x.new_empty(EMPTY, dtype=torch.float32)
    return y, h, mean, rstd


@norm_forward.register_kernel("cuda")
def _norm_forward_cuda(x, weight, bias, residual, eps, weight_offset, rms, out_dtype,
                       residual_dtype, store_residual):
    return _norm_forward_checked(x, weight, bias, residual, eps, weight_offset, rms, out_dtype,
                                 residual_dtype, store_residual)


def _norm_forward_checked(x, weight, bias, residual, eps, weight_offset, rms, out_dtype,
                          residual_dtype, store_residual, plan_key=None):
    """The CUDA forward for any layout; with ``plan_key`` (contiguous tensors), the
    kernel is remembered for the eager fast path."""
    _check_forward(x, weight, bias, residual, out_dtype, residual_dtype)
    check_gpu(x)
    out_dtype = out_dtype or x.dtype
    residual_dtype = _stream_dtype(x, residual, residual_dtype)
    has_residual = residual is not None
    store_residual = store_residual and has_residual
    rows = as_rows(x)
    num_rows, n_cols = rows.shape
    res_rows = as_rows(residual) if has_residual else None
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    y = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    h = torch.empty(rows.shape if store_residual else EMPTY, dtype=residual_dtype, device=x.device)
    mean = torch.empty(num_rows if not rms else 0, dtype=torch.float32, device=x.device)
    rstd = torch.empty(num_rows, dtype=torch.float32, device=x.device)
    if num_rows > 0:
        tensors = [t for t in (rows, res_rows, y, h if store_residual else None) if t is not None]
        fn = _forward_fn(n_cols, rms, x.dtype, residual_dtype, has_residual, store_residual,
                         weight.dtype if weight is not None else None,
                         bias.dtype if bias is not None else None, out_dtype,
                         residual.dtype if has_residual else None,
                         vector_limit(*tensors, weight, bias),
                         shifts_rows(*tensors, columns=(weight, bias)))
        fn(rows, res_rows, weight, bias, y, h if store_residual else None,
           mean if not rms else None, rstd, eps, weight_offset)
        if plan_key is not None:
            _forward_plans[plan_key] = fn
    stats_shape = x.shape[:-1]
    return (y.view(x.shape), h.view(x.shape) if store_residual else h,
            mean.view(stats_shape) if not rms else mean, rstd.view(stats_shape))


@norm_forward.register_fake
def _norm_forward_fake(x, weight, bias, residual, eps, weight_offset, rms, out_dtype,
                       residual_dtype, store_residual):
    _check_forward(x, weight, bias, residual, out_dtype, residual_dtype)
    out_dtype = out_dtype or x.dtype
    residual_dtype = _stream_dtype(x, residual, residual_dtype)
    stored = store_residual and residual is not None
    y = x.new_empty(x.shape, dtype=out_dtype)
    h = x.new_empty(x.shape if stored else EMPTY, dtype=residual_dtype)
    mean = x.new_empty(x.shape[:-1] if not rms else EMPTY, dtype=torch.float32)
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return y, h, mean, rstd


@torch.library.custom_op("quack_kernels::norm_backward", mutates_args=(), device_types="cpu")
def norm_backward(dy: Tensor, h: Tensor, weight: Optional[Tensor], mean: Optional[Tensor],
                  rstd: Tensor, dresidual_out: Optional[Tensor], weight_offset: float, rms: bool,
                  dx_dtype: Optional[torch.dtype], dresidual_dtype: Optional[torch.dtype],
                  need_dweight: bool, dbias_dtype: Optional[torch.dtype]
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients of norm_forward from the normalized stream ``h`` and the statistics:
    (dx, dresidual, dweight, dbias), each empty when its dtype is None / not needed."""
    _check_backward(dy, h, weight, mean, rstd, dresidual_out, rms)
    dh, dw, db = norm_backward_reference(dy, h, weight, mean, rstd, dresidual_out,
                                         weight_offset, rms)
    return _backward_outputs(dy, weight, dx_dtype, dresidual_dtype, need_dweight, dbias_dtype,
                             dh, dw, db)


def _backward_outputs(dy, weight, dx_dtype, dresidual_dtype, need_dweight, dbias_dtype,
                      dh=None, dw=None, db=None):
    """The four outputs (real values when given, else uninitialised / fake)."""
    n_cols = dy.shape[-1]

    def out(value, shape, dtype, wanted):
        if not wanted:
            return dy.new_empty(EMPTY, dtype=dtype or dy.dtype)
        return value.to(dtype, copy=True) if value is not None else dy.new_empty(shape, dtype=dtype)

    need_dweight = need_dweight and weight is not None
    return (
        out(dh, dy.shape, dx_dtype, dx_dtype is not None),
        out(dh, dy.shape, dresidual_dtype, dresidual_dtype is not None),
        out(dw, (n_cols,), weight.dtype if weight is not None else None, need_dweight),
        out(db, (n_cols,), dbias_dtype, dbias_dtype is not None),
    )


@norm_backward.register_kernel("cuda")
def _norm_backward_cuda(dy, h, weight, mean, rstd, dresidual_out, weight_offset, rms, dx_dtype,
                        dresidual_dtype, need_dweight, dbias_dtype):
    return _norm_backward_checked(dy, h, weight, mean, rstd, dresidual_out, weight_offset, rms,
                                  dx_dtype, dresidual_dtype, need_dweight, dbias_dtype)


def _norm_backward_checked(dy, h, weight, mean, rstd, dresidual_out, weight_offset, rms,
                           dx_dtype, dresidual_dtype, need_dweight, dbias_dtype, plan_key=None):
    """The CUDA backward for any layout; with ``plan_key`` (contiguous tensors), the
    kernel and its grid sizing are remembered for the eager fast path."""
    _check_backward(dy, h, weight, mean, rstd, dresidual_out, rms)
    check_gpu(dy)
    need_dweight = need_dweight and weight is not None
    need_dbias = dbias_dtype is not None
    h_rows, dy_rows = as_rows(h), as_rows(dy)
    num_rows, n_cols = h_rows.shape
    dres_rows = as_rows(dresidual_out) if dresidual_out is not None else None
    weight_c = weight.contiguous() if weight is not None else None
    weight_dtype = weight.dtype if weight is not None else None
    device = dy.device
    dx = torch.empty(h_rows.shape if dx_dtype is not None else EMPTY,
                     dtype=dx_dtype or dy.dtype, device=device)
    dres = torch.empty(h_rows.shape if dresidual_dtype is not None else EMPTY,
                       dtype=dresidual_dtype or dy.dtype, device=device)
    # with no rows the sums over rows are zero; otherwise the partials below fill them
    dweight = torch.zeros(n_cols if need_dweight and num_rows == 0 else 0,
                          dtype=weight_dtype or dy.dtype, device=device)
    dbias = torch.zeros(n_cols if need_dbias and num_rows == 0 else 0,
                        dtype=dbias_dtype or dy.dtype, device=device)
    if num_rows > 0 and (dx_dtype or dresidual_dtype or need_dweight or need_dbias):
        outs = [t for t in (dres_rows, dx if dx_dtype else None, dres if dresidual_dtype else None)
                if t is not None]
        plan = _backward_plan(n_cols, rms, h.dtype, dy.dtype, weight_dtype,
                              dres_rows.dtype if dres_rows is not None else None, dx_dtype,
                              dresidual_dtype, need_dweight, dbias_dtype,
                              vector_limit(h_rows, dy_rows, *outs, weight_c),
                              shifts_rows(h_rows, dy_rows, *outs, columns=(weight_c,)), device)
        if plan_key is not None:
            _backward_plans[plan_key] = plan
        dw, db = _launch_backward(
            plan, h_rows, dy_rows, weight_c, mean.reshape(-1) if not rms else None,
            rstd.reshape(-1), dres_rows, dx if dx_dtype else None,
            dres if dresidual_dtype else None, weight_offset,
            weight.dtype if need_dweight else None, dbias_dtype)
        dweight = dw if need_dweight else dweight
        dbias = db if need_dbias else dbias
    return (dx.view(dy.shape) if dx_dtype else dx, dres.view(dy.shape) if dresidual_dtype else dres,
            dweight, dbias)


def _forward_fn(n_cols: int, rms: bool, x_dtype, residual_dtype, has_residual: bool,
                store_residual: bool, weight_dtype, bias_dtype, out_dtype, residual_in_dtype,
                max_vec: int, shifted: bool):
    """The compiled forward for these dtypes and flags, ``max_vec`` elements per access
    at most (the alignment of the tensors it runs on), rows read from the 16-byte
    boundary before each where ``shifted`` (shifts_rows)."""
    cfg = forward_config(n_cols, rms, x_dtype, residual_dtype, has_residual, out_dtype,
                         weight_dtype, bias_dtype, max_vec, residual_in_dtype, shifted)
    return compile_forward(cfg, rms, x_dtype, residual_dtype, has_residual, store_residual,
                           weight_dtype, bias_dtype, out_dtype, residual_in_dtype)


def _backward_plan(n_cols: int, rms: bool, h_dtype, dy_dtype, weight_dtype, dres_out_dtype,
                   dx_dtype, dresidual_dtype, need_dweight: bool, dbias_dtype, max_vec: int,
                   shifted: bool, device: torch.device) -> tuple:
    """(compiled backward, its config, the row blocks its looping grid launches at most
    on ``device``, compiled column sum, its config) for these dtypes (None: not given /
    not computed); rows read from the 16-byte boundary before each where ``shifted``
    (shifts_rows)."""
    need_dbias = dbias_dtype is not None
    out_dtypes = tuple(d for d in (dres_out_dtype, dx_dtype, dresidual_dtype) if d is not None)
    cfg = backward_config(n_cols, h_dtype, dy_dtype, out_dtypes, weight_dtype,
                          int(need_dweight) + int(need_dbias), max_vec, rms=rms, shifted=shifted)
    kernel = _backward_kernel_object(cfg, rms, h_dtype, dy_dtype, need_dweight, need_dbias,
                                     weight_dtype)
    resident = resident_row_blocks(kernel, device)
    fn = compile_backward(cfg, rms, h_dtype, dy_dtype, weight_dtype, dres_out_dtype is not None,
                          dres_out_dtype, dx_dtype, dresidual_dtype, need_dweight, need_dbias)
    sum_dtypes = tuple(d for d in (weight_dtype if need_dweight else None, dbias_dtype) if d)
    sum_cfg = column_sum_config(n_cols, len(sum_dtypes)) if sum_dtypes else None
    column_sum = compile_column_sum(sum_cfg, sum_dtypes) if sum_dtypes else None
    return fn, cfg, resident, column_sum, sum_cfg


def _launch_backward(plan, h_rows, dy_rows, weight, mean, rstd, dresidual_out_rows, dx_rows,
                     dresidual_rows, weight_offset, dweight_dtype, dbias_dtype):
    """Run the backward kernel of ``plan`` (compiled function, config, resident row
    blocks, column-sum function and config) on (M, N) rows and (M,) statistics, outputs
    None when not asked for. Returns (dweight, dbias), None where their dtype is None:
    fp32 sums over the per-CTA partial rows (dweight | dbias side by side in one
    buffer) in a fixed order, bitwise reproducible."""
    fn, cfg, resident_blocks, column_sum, sum_cfg = plan
    num_rows, n_cols = h_rows.shape
    grid_rows = loop_grid_rows(cfg, num_rows, resident_blocks)
    device = h_rows.device
    dw_part = db_part = dweight = dbias = None
    if sum_cfg is not None:
        partial = torch.empty((partial_sum_rows(cfg, grid_rows), sum_cfg.width),
                              dtype=torch.float32, device=device)
        if dweight_dtype:
            dw_part = partial[:, :n_cols]
            dweight = torch.empty(n_cols, dtype=dweight_dtype, device=device)
        if dbias_dtype:
            start = sum_cfg.width - sum_cfg.padded
            db_part = partial[:, start:start + n_cols]
            dbias = torch.empty(n_cols, dtype=dbias_dtype, device=device)
    fn(h_rows, dy_rows, weight, mean, rstd, dresidual_out_rows, dx_rows, dresidual_rows,
       dw_part, db_part, weight_offset, grid_rows)
    if sum_cfg is not None:
        sums = [t for t in (dweight, dbias) if t is not None]
        column_sum(partial, sums[0], sums[1] if len(sums) == 2 else None)
    return dweight, dbias


@norm_backward.register_fake
def _norm_backward_fake(dy, h, weight, mean, rstd, dresidual_out, weight_offset, rms, dx_dtype,
                        dresidual_dtype, need_dweight, dbias_dtype):
    _check_backward(dy, h, weight, mean, rstd, dresidual_out, rms)
    return _backward_outputs(dy, weight, dx_dtype, dresidual_dtype, need_dweight, dbias_dtype)


# ----------------------------------------------------------------------------- checks
def _check_forward(x, weight, bias, residual, out_dtype, residual_dtype) -> None:
    check_float_dtype("x", x)
    if x.dim() == 0:
        raise ValueError("quack_kernels: norms need x with at least one dimension")
    n_cols = x.shape[-1]
    if n_cols < 1:
        raise ValueError(f"quack_kernels: the normalized dimension must be >= 1, got shape {tuple(x.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_float_dtype(name, t)
            if tuple(t.shape) != (n_cols,):
                raise ValueError(
                    f"quack_kernels: {name} must have shape ({n_cols},) to match the last "
                    f"dimension of x {tuple(x.shape)}; got {tuple(t.shape)}")
    if residual is not None:
        check_float_dtype("residual", residual)
        if residual.shape != x.shape:
            raise ValueError(
                f"quack_kernels: residual must have the shape of x {tuple(x.shape)}; "
                f"got {tuple(residual.shape)}")
    _check_dtype_options(out_dtype, residual_dtype)
    check_same_device(x=x, weight=weight, bias=bias, residual=residual)


def _check_dtype_options(out_dtype, residual_dtype) -> None:
    for name, dtype in (("out_dtype", out_dtype), ("residual_dtype", residual_dtype)):
        if dtype is not None and dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"quack_kernels: {name}={dtype} is not supported; use "
                            "torch.float32, torch.float16 or torch.bfloat16")


def _check_backward(dy, h, weight, mean, rstd, dresidual_out, rms) -> None:
    for name, t in (("dy", dy), ("h", h), ("dresidual_out", dresidual_out), ("weight", weight)):
        if t is not None:
            check_float_dtype(name, t)
    if dy.shape != h.shape or (dresidual_out is not None and dresidual_out.shape != dy.shape):
        raise ValueError(f"quack_kernels: norm_backward needs dy, h (and dresidual_out) of one "
                         f"shape; got {tuple(dy.shape)} and {tuple(h.shape)}")
    if rstd.dtype != torch.float32 or rstd.shape != dy.shape[:-1] or \
            (not rms and (mean is None or mean.shape != rstd.shape)):
        raise ValueError("quack_kernels: norm_backward needs fp32 rstd (and mean for LayerNorm) "
                         f"of shape {tuple(dy.shape[:-1])}")
    check_same_device(dy=dy, h=h, weight=weight, rstd=rstd, dresidual_out=dresidual_out)


# ------------------------------------------------------------------- eager fast path
# Launch plans for contiguous tensors: one dict lookup replaces the checks, config and
# compile-key building of the checked path, and outputs nobody reads (the stream when
# not stored, LayerNorm's mean for RMSNorm) are None instead of empty allocations
# (benchmarks/host_profile.py: the Python per call was 3-4x torch's). Keys carry
# everything the checked path decides from: row length, dtypes, devices, alignment,
# shapes of the per-column vectors, flags.
_forward_plans: dict = {}
_backward_plans: dict = {}
_UNPLANNED = "not contiguous"  # in a key: never planned, such calls take the checked path


def _plan_part(t: Optional[Tensor]):
    if t is None:
        return None
    if not t.is_contiguous():
        return _UNPLANNED
    return t.dtype, t.device, t.data_ptr() % 16, t.shape[-1], t.dim() == 1


def _norm_forward_eager(x, weight, bias, residual, eps, weight_offset, rms, out_dtype,
                        residual_dtype, store_residual):
    """(y, h, mean, rstd) of the CUDA forward, h None unless stored, mean None for
    RMSNorm."""
    key = (rms, out_dtype, residual_dtype, store_residual, _plan_part(x), _plan_part(weight),
           _plan_part(bias), _plan_part(residual))
    fn = _forward_plans.get(key)
    stored = store_residual and residual is not None
    if fn is None or x.numel() == 0 or (residual is not None and residual.shape != x.shape):
        planned = None if _UNPLANNED in key else key
        y, h, mean, rstd = _norm_forward_checked(x, weight, bias, residual, eps, weight_offset,
                                                 rms, out_dtype, residual_dtype, store_residual,
                                                 planned)
    else:
        n_cols = x.shape[-1]
        y = torch.empty_like(x, dtype=out_dtype or x.dtype)
        h = torch.empty_like(x, dtype=residual_dtype) if stored else None
        mean = None if rms else torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        rstd = torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)
        fn(rows_view(x, n_cols), None if residual is None else rows_view(residual, n_cols),
           weight, bias, rows_view(y, n_cols), None if h is None else rows_view(h, n_cols),
           None if mean is None else flat(mean), flat(rstd), eps, weight_offset)
        return y, h, mean, rstd
    return y, (h if stored else None), (None if rms else mean), rstd


def _norm_backward_eager(dy, h, weight, mean, rstd, dresidual_out, weight_offset, rms,
                         dx_dtype, dresidual_dtype, need_dweight, dbias_dtype):
    """(dx, dresidual, dweight, dbias) of the CUDA backward, None where not asked for."""
    key = (rms, dx_dtype, dresidual_dtype, need_dweight, dbias_dtype, _plan_part(dy),
           _plan_part(h), _plan_part(weight), _plan_part(dresidual_out), _plan_part(rstd),
           _plan_part(mean))
    plan = _backward_plans.get(key)
    if plan is None or dy.numel() == 0 or dy.shape != h.shape \
            or (dresidual_out is not None and dresidual_out.shape != dy.shape):
        planned = None if _UNPLANNED in key else key
        dx, dres, dweight, dbias = _norm_backward_checked(
            dy, h, weight, mean, rstd, dresidual_out, weight_offset, rms, dx_dtype,
            dresidual_dtype, need_dweight, dbias_dtype, planned)
        return (dx if dx_dtype else None, dres if dresidual_dtype else None,
                dweight if need_dweight and weight is not None else None,
                dbias if dbias_dtype else None)
    n_cols = dy.shape[-1]
    dx = torch.empty_like(dy, dtype=dx_dtype) if dx_dtype else None
    dres = torch.empty_like(dy, dtype=dresidual_dtype) if dresidual_dtype else None
    dweight, dbias = _launch_backward(
        plan, rows_view(h, n_cols), rows_view(dy, n_cols), weight,
        None if mean is None else flat(mean), flat(rstd),
        None if dresidual_out is None else rows_view(dresidual_out, n_cols),
        None if dx is None else rows_view(dx, n_cols),
        None if dres is None else rows_view(dres, n_cols), weight_offset,
        weight.dtype if need_dweight and weight is not None else None, dbias_dtype)
    return dx, dres, dweight, dbias


# ------------------------------------------------------------------ the C++ fast path
def _native_norm(x, weight, bias, residual, eps, weight_offset, rms, residual_dtype, prenorm):
    """(y, h, mean, rstd) of the C++ fast path (native/launch.cpp: the kernels and the
    autograd node without Python), h None unless stored, mean None for RMSNorm; None
    where it does not apply (not built, non-contiguous inputs, no rows): the Python
    path runs."""
    native = native_module()
    if native is None:
        return None
    args = (x, weight, bias, residual, residual_dtype, float(eps), float(weight_offset), rms,
            prenorm)
    outputs = native.norm(*args)
    if outputs is None:
        if not _native_plan(native, *args):
            return None
        outputs = native.norm(*args)
    # (y, [h,] [mean,] rstd): h where the stream is stored
    stored = len(outputs) == (3 if rms else 4)
    return (outputs[0], outputs[1] if stored else None, None if rms else outputs[-2],
            outputs[-1])


def _native_plan(native, x, weight, bias, residual, residual_dtype, eps, weight_offset, rms,
                 prenorm) -> bool:
    """Compile the kernels of these inputs (y in x's dtype) and register them with the
    C++ fast path, under the key it derives from the same inputs (row length, dtypes,
    alignments, device, the stream's dtype, storage and return, the gradients asked
    for); False where the fast path does not apply. Bad input raises here, as on the
    Python path."""
    if not native.norm_eligible(x, weight, bias, residual):
        return False
    _check_forward(x, weight, bias, residual, None, residual_dtype)
    check_gpu(x)
    n_cols = x.shape[-1]
    weight_dtype = weight.dtype if weight is not None else None
    bias_dtype = bias.dtype if bias is not None else None
    has_residual = residual is not None
    stream_dtype = _stream_dtype(x, residual, residual_dtype) if has_residual else x.dtype
    grad = torch.is_grad_enabled()
    need = [grad and t is not None and t.requires_grad for t in (x, weight, bias, residual)]
    store = has_residual and (prenorm or any(need))
    forward = _forward_fn(n_cols, rms, x.dtype, stream_dtype, has_residual, store, weight_dtype,
                          bias_dtype, x.dtype, residual.dtype if has_residual else None,
                          vector_limit(x, residual, weight, bias),
                          shifts_rows(*(as_rows(t) for t in (x, residual) if t is not None),
                                      columns=(weight, bias)))
    variants, sums = [[0, 0, 0, 0], [0, 0, 0, 0]], [0, 0, 0]
    if any(need):
        # h as the backward reads it (x itself, or the stored stream: fresh, aligned) and
        # dy, dh as the C++ backward hands them over: contiguous, aligned
        max_vec = vector_limit(weight) if has_residual else vector_limit(x, weight)
        shifted = shifts_rows(*([] if has_residual else [as_rows(x)]), columns=(weight,))
        # the variant with the stream's own gradient: only where the stream is returned
        dres_out_dtypes = (None, stream_dtype) if has_residual and prenorm else (None,)
        for i, dres_out_dtype in enumerate(dres_out_dtypes):
            backward, cfg, resident, column_sum, sum_cfg = _backward_plan(
                n_cols, rms, stream_dtype, x.dtype, weight_dtype, dres_out_dtype,
                x.dtype if need[0] else None, residual.dtype if need[3] else None, need[1],
                bias_dtype if need[2] else None, max_vec, shifted, x.device)
            variants[i] = [kernel_handle(backward), cfg.rows_per_block, resident,
                           shift_classes(cfg)]
        if sum_cfg is not None:
            sums = [kernel_handle(column_sum), sum_cfg.width, sum_cfg.padded]
    native.register_norm_plan(x, weight, bias, residual, residual_dtype, rms, prenorm,
                              kernel_handle(forward), *variants, sums)
    return True


# --------------------------------------------------------------------------- autograd
def _setup_context(ctx, inputs, output):
    x, weight, bias, residual, eps, weight_offset, rms, out_dtype, residual_dtype, store = inputs
    _, h, mean, rstd = output
    ctx.rms = rms
    ctx.weight_offset = weight_offset
    ctx.has_residual = residual is not None
    ctx.stored = store and residual is not None
    ctx.x_dtype = x.dtype
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.residual_stream_dtype = _stream_dtype(x, residual, residual_dtype)
    ctx.set_materialize_grads(False)
    # the statistics are returned for callers who want them, without a gradient path
    ctx.mark_non_differentiable(*(t for t in (mean, rstd) if t is not None))
    if residual is None:
        ctx.save_for_backward(x, weight, mean if not rms else None, rstd, None, None)
    elif ctx.stored:
        ctx.save_for_backward(h, weight, mean if not rms else None, rstd, None, None)
    else:  # stream not stored (no prenorm): recompute it in the backward
        ctx.save_for_backward(None, weight, mean if not rms else None, rstd, x, residual)


def _backward(ctx, dy, dresidual_out, _mean_grad_unused, _rstd_grad_unused):
    return _gradients(ctx, dy, dresidual_out, norm_backward)


def _gradients(ctx, dy, dresidual_out, backward_op):
    """Input gradients from the saved context, through ``backward_op`` (the registered
    op, or its CUDA implementation on the eager path)."""
    h, weight, mean, rstd, x, residual = ctx.saved_tensors
    if h is None:
        h = (x.float() + residual.float()).to(ctx.residual_stream_dtype)
    needs = ctx.needs_input_grad
    if dy is None:
        dy = torch.zeros_like(h)
    if not ctx.stored:
        dresidual_out = None
    dx, dres, dw, db = backward_op(
        dy, h, weight, mean, rstd, dresidual_out, ctx.weight_offset, ctx.rms,
        ctx.x_dtype if needs[0] else None,
        ctx.residual_dtype if ctx.has_residual and needs[3] else None,
        bool(needs[1]),
        ctx.bias_dtype if needs[2] else None,
    )
    return (dx if needs[0] else None, dw if needs[1] else None, db if needs[2] else None,
            dres if ctx.has_residual and needs[3] else None,
            None, None, None, None, None, None)


norm_forward.register_autograd(_backward, setup_context=_setup_context)


class _EagerNorm(torch.autograd.Function):
    """The op's autograd on the eager CUDA path: the same kernels and formulas without
    the custom-op dispatcher (see common.eager_cuda)."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _norm_forward_eager(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, dy, dresidual_out, _mean_grad_unused, _rstd_grad_unused):
        return _gradients(ctx, dy, dresidual_out, _norm_backward_eager)


# ------------------------------------------------------------------------ public API
def _norm(x, weight, bias, residual, eps, weight_offset, rms, prenorm, out_dtype, residual_dtype,
          return_stats):
    if not isinstance(x, Tensor):
        raise TypeError(f"quack_kernels: expected a torch.Tensor, got {type(x).__name__}")
    # (before any plan is looked up: a plan's key has no residual_dtype without a residual)
    _check_dtype_options(out_dtype, residual_dtype)
    residual_dtype = _stream_dtype(x, residual, residual_dtype)
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, weight, bias, residual))
    store = residual is not None and (prenorm or needs_grad)
    args = (x, weight, bias, residual, float(eps), float(weight_offset), rms, out_dtype,
            residual_dtype, store)
    if not eager_cuda(x, weight, bias, residual):
        y, h, mean, rstd = norm_forward(*args)
    elif out_dtype in (None, x.dtype) and (native := _native_norm(
            x, weight, bias, residual, eps, weight_offset, rms, residual_dtype, prenorm)) \
            is not None:
        y, h, mean, rstd = native
    elif needs_grad:
        y, h, mean, rstd = _EagerNorm.apply(*args)
    else:
        y, h, mean, rstd = _norm_forward_eager(*args)
    outputs = (y,)
    if prenorm:
        outputs += (h if residual is not None else x.to(residual_dtype),)
    if return_stats:
        outputs += (rstd,) if rms else (mean, rstd)
    return outputs[0] if len(outputs) == 1 else outputs


def rms_norm(x: Tensor, weight: Optional[Tensor] = None, *, eps: float = 1e-6,
             residual: Optional[Tensor] = None, weight_offset: float = 0.0, prenorm: bool = False,
             out_dtype: Optional[torch.dtype] = None, residual_dtype: Optional[torch.dtype] = None,
             return_stats: bool = False):
    """RMSNorm over the last dimension:
    ``y = h * rsqrt(mean(h^2) + eps) * (weight + weight_offset)``, h = x + residual.

    ``weight_offset=1.0`` is the Gemma form (ignored without a weight). With
    ``prenorm=True`` returns ``(y, h)``, h in ``residual_dtype`` (default: the
    residual's dtype, else x's). Statistics in fp32; y in ``out_dtype`` (default x's).
    ``return_stats=True`` appends rstd (fp32, shape ``x.shape[:-1]``, no gradient).
    Differentiable wrt x, weight and residual.

    x, residual, weight: fp32, fp16 or bf16 each (mixed allowed). Raises TypeError for another dtype, ValueError for a
    weight or residual whose shape does not match x (weight: (N,)) or tensors on
    different devices, RuntimeError for CUDA tensors on a GPU older than sm_90."""
    return _norm(x, weight, None, residual, eps, weight_offset, True, prenorm, out_dtype,
                 residual_dtype, return_stats)


def layer_norm(x: Tensor, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None, *,
               eps: float = 1e-5, residual: Optional[Tensor] = None, prenorm: bool = False,
               out_dtype: Optional[torch.dtype] = None,
               residual_dtype: Optional[torch.dtype] = None, return_stats: bool = False):
    """LayerNorm over the last dimension (centered variance):
    ``y = (h - mean(h)) * rsqrt(var(h) + eps) * weight + bias``, h = x + residual.

    ``prenorm``, ``out_dtype`` and ``residual_dtype`` as in :func:`rms_norm`;
    ``return_stats=True`` appends (mean, rstd) (fp32, no gradient).
    Differentiable wrt x, weight, bias and residual. Dtypes and errors as in
    :func:`rms_norm` (bias alike)."""
    return _norm(x, weight, bias, residual, eps, 0.0, False, prenorm, out_dtype, residual_dtype,
                 return_stats)
