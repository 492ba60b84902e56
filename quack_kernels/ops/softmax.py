"""softmax / log_softmax as torch custom ops: CPU reference, CUDA kernel, fake kernel,
autograd. The ops work on the last dimension; ``quack_kernels.softmax`` moves any other
dim there first."""

from __future__ import annotations

import functools
import itertools
import operator

import torch
from torch import Tensor

from ..kernels.softmax import SoftmaxBackward, SoftmaxForward
from ..native import module as native_module
from ..primitives.compile_cache import compile_kernel, fake_rows, kernel_handle
from ..primitives.config import (Y_SHARE_VALUES, RowConfig, copies_async,
                                 held_share, odd_row_forward_share, row_config,
                                 shifted_row_share, widened_16bit_share, with_held_chunk)
from .common import (
    as_rows,
    check_float_dtype,
    check_gpu,
    compiled,
    cutlass_dtype,
    eager_cuda,
    kernel_key,
    rows_view,
    shiftable,
    vector_limit,
)


# ----------------------------------------------------------------------------- configs
@functools.lru_cache(maxsize=None)
def forward_config(n_cols: int, dtype: torch.dtype, max_vec: int | None = None,
                   shifted: bool = False) -> RowConfig:
    """Wide 16-bit shares in chunks of WIDE_SHARE_VALUES per thread where that halves
    their staged chunks (config.widened_16bit_share); chunks held in registers by
    config.with_held_chunk; odd 16-bit rows read from the 16-byte boundary before each
    where they may be (``shifted``: ops.common.shiftable) and the share of the aligned
    span stages them (config.shifted_row_share), else staged as
    config.odd_row_forward_share stages LayerNorm's."""
    elem = dtype.itemsize
    share = functools.partial(row_config, n_cols, elem, staged_tensors=1, max_vec=max_vec)
    cfg = with_held_chunk(widened_16bit_share(share, elem, elem), elem, full_clusters_too=False)
    cfg = odd_row_forward_share(share, cfg, elem, "staged") or cfg
    if shifted:
        return shifted_row_share(lambda span: forward_config(span, dtype), cfg, elem, elem) or cfg
    return cfg


@functools.lru_cache(maxsize=None)
def backward_config(n_cols: int, dtype: torch.dtype, max_vec: int | None = None,
                    shifted: bool = False, *, log: bool) -> RowConfig:
    """The share of the softmax (``log`` False) or log_softmax backward: odd 16-bit rows
    read from the 16-byte boundary before each where they may be (``shifted``:
    ops.common.shiftable) and the share of the aligned span stages y and dy
    (config.shifted_row_share); else, in the order checked:
    - y and dy staged together, where they fit;
    - 16-bit softmax rows: both staged on config.held_share's shares, their last chunks
      held in registers, where the rest then fits;
    - log_softmax rows: dy alone on config.held_share's shares (SoftmaxBackward stages
      the log_softmax's dy and reads y once, in its output pass), its last chunks held
      in registers where the rest would not fit (fp32 only: 16-bit rows so spilled);
    - fp32 softmax rows: y alone on such shares of config.Y_SHARE_VALUES, dy re-read in
      both passes;
    - one tensor staged alone, where it fits shared memory (16-bit rows of about
      820K-1.6M columns; fp32 rows of narrow vectors, which the share above refuses) and
      its vectors go there by cp.async (odd 16-bit rows, copied by plain loads and
      stores, took 124-128 registers and 1.6x the instructions): the softmax's y,
      re-reading dy in both passes, and the 16-bit log_softmax's dy where its held share
      would hold chunks (about 1.57M-1.6M);
    - else y and dy both re-read from global memory."""
    elem = dtype.itemsize
    unshifted = _unshifted_backward_config(n_cols, elem, max_vec, log)
    if shifted:
        return shifted_row_share(lambda span: backward_config(span, dtype, log=log), unshifted,
                                 elem, 2 * elem) or unshifted
    return unshifted


def _unshifted_backward_config(n_cols: int, elem: int, max_vec: int | None,
                               log: bool) -> RowConfig:
    both = row_config(n_cols, elem, staged_tensors=2, max_vec=max_vec)
    if both.staging != "global":
        return with_held_chunk(both, 2 * elem, full_clusters_too=True)
    held = held_share(n_cols, elem, 2, max_vec) if elem == 2 and not log else None
    if held is not None:
        return held
    dy_share = held_share(n_cols, elem, 1, max_vec) if log else None
    if dy_share is not None and (elem == 4 or dy_share.register_chunks == 0):
        return dy_share
    # the fp32 softmax's y alone, dy re-read in both passes (config.Y_SHARE_VALUES)
    y_share = held_share(n_cols, elem, 1, max_vec, Y_SHARE_VALUES) \
        if elem == 4 and not log else None
    if y_share is not None:
        return y_share
    one_staged = row_config(n_cols, elem, staged_tensors=2, bytes_per_col=elem, max_vec=max_vec)
    if one_staged.staging == "smem" and copies_async(one_staged, elem):
        return one_staged
    return both


def forward_kernel(cfg: RowConfig, dtype: torch.dtype, log: bool):
    """(kernel object, *fake arguments it compiles against)."""
    dt = cutlass_dtype(dtype)
    return SoftmaxForward(cfg, dt, log), *[fake_rows(dt, cfg.n_cols, cfg.vec, shifted=cfg.row_shift)
                                           for _ in range(2)]


def backward_kernel(cfg: RowConfig, dtype: torch.dtype, log: bool):
    dt = cutlass_dtype(dtype)
    return SoftmaxBackward(cfg, dt, log), *[
        fake_rows(dt, cfg.n_cols, cfg.vec, shifted=cfg.row_shift) for _ in range(3)]


def compile_forward(cfg: RowConfig, dtype: torch.dtype, log: bool):
    return compiled(kernel_key("softmax_fwd", dtype, cfg, log),
                    lambda: compile_kernel(*forward_kernel(cfg, dtype, log)))


def compile_backward(cfg: RowConfig, dtype: torch.dtype, log: bool):
    return compiled(kernel_key("softmax_bwd", dtype, cfg, log),
                    lambda: compile_kernel(*backward_kernel(cfg, dtype, log)))


def report_variants(n_grid, dtypes):
    """Every kernel variant for the sm_90a resource report: (name, n, dtype, cfg, build)."""
    for dtype, n, log, shifted in itertools.product(dtypes, n_grid, (False, True), (False, True)):
        name = ("log_softmax" if log else "softmax")
        suffix = "_shifted" if shifted else ""
        forward = forward_config(n, dtype, shifted=shifted)
        if forward.row_shift == shifted:
            yield (f"{name}_fwd{suffix}", n, dtype, forward,
                   lambda cfg=forward, dtype=dtype, log=log: forward_kernel(cfg, dtype, log))
        backward = backward_config(n, dtype, shifted=shifted, log=log)
        if backward.row_shift == shifted:
            yield (f"{name}_bwd{suffix}", n, dtype, backward,
                   lambda cfg=backward, dtype=dtype, log=log: backward_kernel(cfg, dtype, log))


# -------------------------------------------------------------------------- references
def softmax_reference(x: Tensor, log: bool) -> Tensor:
    """fp32 math, output in x's dtype."""
    xf = x.float()
    y = torch.log_softmax(xf, dim=-1) if log else torch.softmax(xf, dim=-1)
    return y.to(x.dtype)


def softmax_backward_reference(y: Tensor, dy: Tensor, log: bool) -> Tensor:
    compute = torch.promote_types(y.dtype, torch.float32)  # fp64 stays fp64 (tests)
    yf, dyf = y.to(compute), dy.to(compute)
    if log:
        dx = dyf - torch.exp(yf) * dyf.sum(-1, keepdim=True)
    else:
        dx = yf * (dyf - (yf * dyf).sum(-1, keepdim=True))
    return dx.to(dy.dtype)


# ----------------------------------------------------------------------------- the ops
@torch.library.custom_op("quack_kernels::softmax_forward", mutates_args=(), device_types="cpu")
def softmax_forward(x: Tensor, log: bool) -> Tensor:
    """softmax (log=False) or log_softmax (log=True) over the last dimension."""
    check_float_dtype("x", x)
    return softmax_reference(x, log)


# Launch caches for the common case (contiguous tensors): one dict lookup replaces
# validation, config and compile-key building, which cost ~15 us of Python per call.
# Keys carry everything the checked path decided from (N, dtype, device, alignment).
_forward_launch: dict = {}
_backward_launch: dict = {}


def _launch_key(t: Tensor, *flags):
    return (t.shape[-1], t.dtype, t.device.index, t.data_ptr() % 16, *flags)


@softmax_forward.register_kernel("cuda")
def _softmax_forward_cuda(x: Tensor, log: bool) -> Tensor:
    key = _launch_key(x, log)
    kernel = _forward_launch.get(key) if x.is_contiguous() else None
    if kernel is None:
        return _softmax_forward_checked(x, log, key)
    out = torch.empty_like(x)
    if x.numel() > 0:
        kernel(rows_view(x, key[0]), rows_view(out, key[0]))
    return out


def _softmax_forward_checked(x: Tensor, log: bool, key) -> Tensor:
    check_float_dtype("x", x)
    check_gpu(x)
    rows = as_rows(x)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.numel() > 0:
        cfg = forward_config(rows.shape[1], x.dtype, vector_limit(rows), shiftable(rows))
        kernel = compile_forward(cfg, x.dtype, log)
        kernel(rows, out)
        if x.is_contiguous():
            _forward_launch[key] = kernel
    return out.view(x.shape)


@softmax_forward.register_fake
def _softmax_forward_fake(x: Tensor, log: bool) -> Tensor:
    check_float_dtype("x", x)
    return x.new_empty(x.shape)


@torch.library.custom_op("quack_kernels::softmax_backward", mutates_args=(), device_types="cpu")
def softmax_backward(y: Tensor, dy: Tensor, log: bool) -> Tensor:
    """Gradient wrt the input, from the forward output ``y`` and its gradient ``dy``."""
    _check_backward_inputs(y, dy)
    return softmax_backward_reference(y, dy, log)


@softmax_backward.register_kernel("cuda")
def _softmax_backward_cuda(y: Tensor, dy: Tensor, log: bool) -> Tensor:
    key = _launch_key(y, log, dy.dtype, dy.data_ptr() % 16)
    same_layout = (y.is_contiguous() and dy.is_contiguous() and y.shape == dy.shape
                   and y.device == dy.device)
    kernel = _backward_launch.get(key) if same_layout else None
    if kernel is None:
        return _softmax_backward_checked(y, dy, log, key)
    dx = torch.empty_like(dy)
    if dx.numel() > 0:
        n = key[0]
        kernel(rows_view(y, n), rows_view(dy, n), rows_view(dx, n))
    return dx


def _softmax_backward_checked(y: Tensor, dy: Tensor, log: bool, key) -> Tensor:
    _check_backward_inputs(y, dy)
    check_gpu(y)
    y_rows, dy_rows = as_rows(y), as_rows(dy)
    dx = torch.empty(y_rows.shape, dtype=dy.dtype, device=dy.device)
    if dx.numel() > 0:
        cfg = backward_config(y_rows.shape[1], y.dtype, vector_limit(y_rows, dy_rows),
                              shiftable(y_rows, dy_rows), log=log)
        kernel = compile_backward(cfg, y.dtype, log)
        kernel(y_rows, dy_rows, dx)
        if y.is_contiguous() and dy.is_contiguous():
            _backward_launch[key] = kernel
    return dx.view(y.shape)


@softmax_backward.register_fake
def _softmax_backward_fake(y: Tensor, dy: Tensor, log: bool) -> Tensor:
    _check_backward_inputs(y, dy)
    return dy.new_empty(dy.shape)


def _check_backward_inputs(y: Tensor, dy: Tensor) -> None:
    check_float_dtype("y", y)
    check_float_dtype("dy", dy)
    if y.shape != dy.shape or y.dtype != dy.dtype or y.device != dy.device:
        raise ValueError(
            "quack_kernels: softmax_backward needs y and dy of one shape, dtype and device; "
            f"got {tuple(y.shape)} {y.dtype} {y.device} and {tuple(dy.shape)} {dy.dtype} {dy.device}"
        )


def _setup_context(ctx, inputs, output):
    _, log = inputs
    ctx.log = log
    ctx.save_for_backward(output)


def _backward(ctx, grad):
    (y,) = ctx.saved_tensors
    return softmax_backward(y, grad, ctx.log), None


softmax_forward.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------------ public API
class _EagerSoftmax(torch.autograd.Function):
    """Eager CUDA path with gradients: the same kernels as the op, minus the custom-op
    dispatcher (see common.eager_cuda). torch.compile and CPU tensors go through the
    registered op instead."""

    @staticmethod
    def forward(ctx, x: Tensor, log: bool) -> Tensor:
        y = _softmax_forward_cuda(x, log)
        ctx.log = log
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        (y,) = ctx.saved_tensors
        return _softmax_backward_cuda(y, grad, ctx.log), None


def _native_softmax(x: Tensor, log: bool) -> Tensor | None:
    """softmax / log_softmax of the C++ fast path (native/launch.cpp: the kernels and
    the autograd node without Python); None where it does not apply (not built,
    non-contiguous, no rows): the Python path runs."""
    native = native_module()
    if native is None:
        return None
    y = native.softmax(x, log)
    if y is None and _native_plan(native, x, log):
        y = native.softmax(x, log)
    return y


def _native_plan(native, x: Tensor, log: bool) -> bool:
    """Compile the kernels of these inputs and register them with the C++ fast path,
    under the key it derives from them (row length, dtype, alignment, device, log,
    whether a gradient is needed); False where the fast path does not apply. Bad input
    raises here, as on the Python path."""
    if not native.softmax_eligible(x):
        return False
    check_float_dtype("x", x)
    check_gpu(x)
    n_cols = x.shape[-1]
    max_vec = vector_limit(as_rows(x))
    forward = compile_forward(forward_config(n_cols, x.dtype, max_vec, shiftable(as_rows(x))),
                              x.dtype, log)
    backward = None
    if x.requires_grad and torch.is_grad_enabled():
        # y, dy and dx as the C++ backward hands them over: contiguous and aligned
        backward = compile_backward(backward_config(n_cols, x.dtype, max_vec, shiftable(),
                                                    log=log), x.dtype, log)
    native.register_softmax_plan(x, log, kernel_handle(forward), kernel_handle(backward))
    return True


def _softmax_last_dim(x: Tensor, log: bool) -> Tensor:
    if not eager_cuda(x):
        return softmax_forward(x, log)
    y = _native_softmax(x, log)
    if y is not None:
        return y
    if x.requires_grad and torch.is_grad_enabled():
        return _EagerSoftmax.apply(x, log)
    return _softmax_forward_cuda(x, log)


def _along_last(x: Tensor, dim: int, log: bool) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"quack_kernels: expected a torch.Tensor, got {type(x).__name__}")
    try:  # (torch.nn.Softmax's deprecated dim=None guesses one)
        dim = operator.index(dim)
    except TypeError:
        raise TypeError(f"quack_kernels: dim must be an int, got {dim!r}") from None
    rank = max(x.dim(), 1)  # (a 0-d tensor takes dim -1 or 0, as in torch)
    if not -rank <= dim < rank:
        raise IndexError(f"quack_kernels: dim {dim} is out of range for a {x.dim()}-d tensor")
    if x.dim() == 0:
        return _softmax_last_dim(x.reshape(1), log).reshape(())
    if dim % x.dim() == x.dim() - 1:
        return _softmax_last_dim(x, log)
    return _softmax_last_dim(x.movedim(dim, -1), log).movedim(-1, dim)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Softmax over ``dim`` (fp32 math, output in x's dtype). Differentiable.

    x: fp32, fp16 or bf16, any shape.
    Raises TypeError for another dtype or a non-int ``dim``, IndexError for a ``dim``
    out of range, RuntimeError for a CUDA tensor on a GPU older than sm_90."""
    return _along_last(x, dim, False)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """Log-softmax over ``dim`` (fp32 math, output in x's dtype). Differentiable.

    x: fp32, fp16 or bf16, any shape.
    Raises TypeError for another dtype or a non-int ``dim``, IndexError for a ``dim``
    out of range, RuntimeError for a CUDA tensor on a GPU older than sm_90."""
    return _along_last(x, dim, True)
