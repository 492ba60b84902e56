"""RMSNorm / LayerNorm CUDA kernels against fp64 references (run on an H200)."""

import dataclasses
import math

import pytest
import torch

import quack_kernels as qk
from quack_kernels.ops import norm as ops
from quack_kernels.primitives.config import (ODD_ROW_FORWARD_SHARES, ODD_ROW_FORWARD_VALUES,
                                             ODD_ROW_SHARES, loop_grid_rows,
                                             partial_sum_rows, shift_order_keeps_class_sizes)

from helpers import assert_close, poison_allocator, switched

pytestmark = pytest.mark.gpu
# the configs as the library chooses them, for tests that wrap them: captured once, so
# that a wrapper never wraps another test's (in the -n 14 suite on an H100, one test's
# wrapper met configs another test's wrapper had made)
FORWARD_CONFIG, BACKWARD_CONFIG = ops.forward_config, ops.backward_config
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NS = [1, 7, 769, 1000, 4097, 131073]
F64 = torch.float64


@pytest.fixture
def wrap_config(monkeypatch):
    """wrap_config(name, wrapper): swap ops' config function ``name`` for this test,
    with the config and launch caches emptied before and after it: the launches keep
    the configs they were planned with, and a shifted config computes its unshifted one
    through the module's (wrapped) name, so its cache kept the wrapper's result for later
    tests (on the H100, a later test found stages=1 from test_rows_prefetched_to_l2's)."""
    def clear():
        FORWARD_CONFIG.cache_clear()
        BACKWARD_CONFIG.cache_clear()
        ops._forward_plans.clear()
        ops._backward_plans.clear()
    clear()
    yield lambda name, wrapper: monkeypatch.setattr(ops, name, wrapper)
    clear()


def fresh(shape, dtype, scale=1.0, shift=0.0):
    return (torch.randn(shape, device="cuda") * scale + shift).to(dtype)


def forward_ref(x, w, b, r, eps, offset, rms, out_dtype=None, residual_dtype=None):
    return ops.norm_reference(x, w, b, r, eps, offset, rms, out_dtype, residual_dtype,
                              compute_dtype=F64)


def check_forward(x, w, b, eps, rms):
    """Run the forward of x alone on poisoned outputs (y, mean, rstd start as NaN) and
    compare y, rstd (and LayerNorm's mean) with the fp64 reference; returns (mean, rstd).
    The mean's error scales with the size of the values it sums (a random row's mean is
    near 0), so it is measured against their mean magnitude."""
    stats = torch.empty(x.shape[0], dtype=torch.float32, device="cuda")
    poison_allocator(x, stats, stats)
    y, _, mean, rstd = ops.norm_forward(x, w, b, None, eps, 0.0, rms, None, None, False)
    ry, _, rmean, rrstd = forward_ref(x, w, b, None, eps, 0.0, rms)
    assert_close(y, ry, x.dtype)
    assert_close(rstd, rrstd, torch.float32, name="rstd")
    if not rms:
        assert_close(mean, rmean, torch.float32, name="mean",
                     magnitude=x.float().abs().mean(-1))
    return mean, rstd


def check_backward(dy, h, w, mean, rstd, offset, rms, dres_out=None, need_db=False, m=None,
                   dx_scale=4.0, dx_magnitude=None, partials=None):
    """Run the op on (h, dy) and compare every gradient with the fp64 reference; dw/db
    sum M terms, so their tolerance grows with sqrt(M). ``dx_magnitude``: where dx is a
    difference of larger terms, their size (see assert_close). ``partials``: a tensor
    of the size of the op's partial sums, which start as NaN too."""
    x_dtype = h.dtype
    # dx and dresidual (and the partial sums) start as NaN: unwritten elements show
    poison_allocator(h, h, *([] if partials is None else [partials]))
    dx, dres, dw, db = ops.norm_backward(
        dy, h, w, mean, rstd, dres_out, offset, rms, x_dtype,
        x_dtype if dres_out is not None else None, w is not None,
        w.dtype if need_db and w is not None else None)
    ref_dh, ref_dw, ref_db = ops.norm_backward_reference(dy, h, w, mean, rstd, dres_out, offset, rms,
                                                         compute_dtype=F64)
    assert_close(dx, ref_dh, x_dtype, scale=dx_scale, name="dx", magnitude=dx_magnitude)
    if dres_out is not None:
        assert_close(dres, ref_dh, x_dtype, scale=4.0, name="dresidual")
    m = m or h.numel() // h.shape[-1]
    grow = 4.0 * math.sqrt(max(m, 1))
    if w is not None:
        assert_close(dw, ref_dw, w.dtype, scale=grow, name="dweight")
        if need_db:
            assert_close(db, ref_db, w.dtype, scale=grow, name="dbias")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("rms", [True, False])
def test_forward_backward(n, dtype, rms):
    m = 37
    x = fresh((m, n), dtype, 2.0, 0.5)
    w = fresh(n, dtype, 0.5, 1.0)
    b = None if rms else fresh(n, dtype, 0.5)
    mean, rstd = check_forward(x, w, b, 1e-6 if rms else 1e-5, rms)
    dy = fresh((m, n), dtype)
    # N = 1 RMSNorm: dx = g * (1 - xhat^2) * rstd with xhat^2 = 1 - O(eps): the
    # cancellation leaves dx ~ eps-sized, so its error is measured against the size of
    # the cancelling terms, g * rstd (a scale of 1000 on the plain check failed a fresh
    # fp32 draw on the H200: relative error 0.011)
    terms = (dy.double() * w.double() * rstd.double()[:, None]).abs() if rms and n == 1 else None
    check_backward(dy, x, w, None if rms else mean, rstd, 0.0, rms, need_db=not rms,
                   dx_magnitude=terms)


@pytest.mark.parametrize("grads", ["all", "x", "weight", "none"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1000, 4096, 131073])
@pytest.mark.parametrize("rms", [True, False])
def test_public_api_on_the_cpp_path(monkeypatch, rms, n, dtype, grads):
    """rms_norm / layer_norm of contiguous inputs without a residual run on the C++
    fast path (native/launch.cpp): its node is the graph's, its outputs and gradients
    match fp64 (outputs and gradients over NaN-filled blocks), an upstream gradient of
    another dtype and layout included; without a gradient the Python launch never
    runs."""
    monkeypatch.setattr(ops, "_norm_forward_eager", None)  # (the Python path's launch)
    w_dtype = torch.float32 if dtype == torch.bfloat16 else dtype  # mixed where it can
    x = fresh((3, 11, n), dtype, 2.0, 0.5).requires_grad_(grads in ("all", "x"))
    w = fresh(n, w_dtype, 0.5, 1.0).requires_grad_(grads in ("all", "weight"))
    b = None if rms else fresh(n, w_dtype, 0.5).requires_grad_(grads == "all")
    eps = 1e-6 if rms else 1e-5
    stats = torch.empty(33, dtype=torch.float32, device="cuda")
    poison_allocator(x, stats, stats)
    y = qk.rms_norm(x, w, eps=eps) if rms else qk.layer_norm(x, w, b, eps=eps)
    ry, _, rmean, rrstd = forward_ref(x.detach(), w.detach(), None if rms else b.detach(), None,
                                      eps, 0.0, rms)
    assert_close(y, ry, dtype)
    if grads == "none":
        assert y.grad_fn is None
        return
    assert "NormFunction" in y.grad_fn.name(), y.grad_fn.name()
    dy = fresh((n, 3, 11), torch.float32).permute(1, 2, 0)  # fp32, not contiguous
    poison_allocator(x, w, w)
    y.backward(dy)
    rdx, rdw, rdb = ops.norm_backward_reference(dy.to(dtype), x.detach(), w.detach(),
                                                None if rms else rmean, rrstd, None, 0.0, rms,
                                                compute_dtype=F64)
    terms = (dy.double() * w.double() * rrstd.double()[..., None]).abs() \
        if rms and n == 1 else None  # see test_forward_backward
    if x.requires_grad:
        assert_close(x.grad, rdx, dtype, scale=4.0, name="dx", magnitude=terms)
    grow = 4.0 * math.sqrt(33)
    if w.requires_grad:
        assert_close(w.grad, rdw, w_dtype, scale=grow, name="dweight")
    if b is not None and b.requires_grad:
        assert_close(b.grad, rdb, w_dtype, scale=grow, name="dbias")


@pytest.mark.parametrize("n", [1000, 4096, 65536])
@pytest.mark.parametrize("stream", ["bf16", "fp32 stream", "fp32 residual"])
@pytest.mark.parametrize("prenorm,use_h", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("rms", [True, False])
def test_residual_on_the_cpp_path(rms, prenorm, use_h, stream, n):
    """The add + norm of a transformer block on the C++ fast path: bf16 x with a bf16 or
    fp32 residual, the stream h = x + residual in bf16 or fp32 (residual_dtype), stored
    and returned with prenorm (and stored for the backward without it), h's own gradient
    added where h is used (the plan's second backward variant) and not where only y is;
    every output and gradient against fp64 over NaN-filled blocks."""
    m = 37
    r_dtype = torch.float32 if stream == "fp32 residual" else torch.bfloat16
    res_dtype = torch.float32 if stream == "fp32 stream" else None
    x = fresh((m, n), torch.bfloat16, 2.0, 0.5).requires_grad_()
    r = fresh((m, n), r_dtype).requires_grad_()
    w = fresh(n, torch.bfloat16, 0.5, 1.0).requires_grad_()
    b = None if rms else fresh(n, torch.bfloat16).requires_grad_()
    norm = qk.rms_norm if rms else qk.layer_norm
    kw = dict(residual=r, prenorm=prenorm, residual_dtype=res_dtype)
    poison_allocator(x, x, x)
    out = norm(x, w, **kw) if rms else norm(x, w, b, **kw)
    y, h = out if prenorm else (out, None)
    assert "NormFunction" in y.grad_fn.name(), y.grad_fn.name()
    stream_dtype = res_dtype or r_dtype
    ry, rh, _, _ = forward_ref(x.detach(), w.detach(), None if rms else b.detach(), r.detach(),
                               1e-6 if rms else 1e-5, 0.0, rms, None, stream_dtype)
    assert_close(y, ry, torch.bfloat16)
    if prenorm:
        assert h.dtype == stream_dtype
        assert_close(h, rh, stream_dtype, name="h")
    dy = fresh((m, n), torch.bfloat16)
    dh = fresh((m, n), stream_dtype) if use_h else None
    poison_allocator(x, r, x)
    torch.autograd.backward([y, h] if use_h else [y], [dy, dh] if use_h else [dy])
    leaves = [t.detach().double().requires_grad_() for t in (x, r, w)]
    xd, rd, wd = leaves
    hd = xd + rd
    bd = None if rms else b.detach().double().requires_grad_()
    yd = torch.nn.functional.rms_norm(hd, (n,), wd, eps=1e-6) if rms \
        else torch.nn.functional.layer_norm(hd, (n,), wd, bd, eps=1e-5)
    torch.autograd.backward([yd, hd] if use_h else [yd],
                            [dy.double(), dh.double()] if use_h else [dy.double()])
    low = max((torch.bfloat16, r_dtype, stream_dtype), key=lambda d: TOL_ORDER[d])
    assert_close(x.grad, xd.grad, low, scale=4.0, name="dx")
    assert_close(r.grad, rd.grad, low, scale=4.0, name="dresidual")
    assert_close(w.grad, wd.grad, low, scale=4.0 * math.sqrt(m), name="dweight")
    if not rms:
        assert_close(b.grad, bd.grad, low, scale=4.0 * math.sqrt(m), name="dbias")


def test_cpp_path_plans_by_alignment_and_gradients_and_serves_modules():
    """The C++ fast path keys its plans by what they were decided from: a misaligned x
    (an offset of one element: 2-byte vectors) and an aligned one, a bias-only gradient
    (the one-segment column sum of dbias), and nn.Parameter weights of the modules; a
    saved_tensors_hooks pair offloading to the CPU hands contiguous tensors back."""
    n = 4096
    base = fresh(16 * n + 1, torch.bfloat16, 2.0, 0.5)
    w = fresh(n, torch.bfloat16, 0.5, 1.0)
    b = fresh(n, torch.bfloat16, 0.5)
    for x in (base[1:].view(16, n), base[:-1].view(16, n)):  # misaligned, then aligned
        bias = b.clone().requires_grad_()
        y = qk.layer_norm(x, w, bias)
        assert "NormFunction" in y.grad_fn.name()
        ry, _, mean, rstd = forward_ref(x, w, b, None, 1e-5, 0.0, False)
        assert_close(y, ry, torch.bfloat16)
        dy = fresh((16, n), torch.bfloat16)
        y.backward(dy)
        _, _, rdb = ops.norm_backward_reference(dy, x, w, mean, rstd, None, 0.0, False, F64)
        assert_close(bias.grad, rdb, torch.bfloat16, scale=16.0, name="dbias")
    for module in (qk.nn.RMSNorm(n).cuda(), qk.nn.LayerNorm(n).cuda()):
        x = fresh((64, n), torch.float32).requires_grad_()
        with torch.autograd.graph.save_on_cpu():
            y = module(x)
        assert "NormFunction" in y.grad_fn.name(), y.grad_fn.name()
        dy = fresh((64, n), torch.float32)
        y.backward(dy)
        ref_x = x.detach().double().requires_grad_()
        ref_module = (torch.nn.RMSNorm(n, eps=1e-6) if isinstance(module, qk.nn.RMSNorm)
                      else torch.nn.LayerNorm(n)).cuda().double()
        ref_module(ref_x).backward(dy.double())
        assert_close(x.grad, ref_x.grad, torch.float32, scale=4.0, name="dx")
        assert_close(module.weight.grad, ref_module.weight.grad, torch.float32, scale=32.0,
                     name="dweight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rms", [True, False])
def test_262144_columns(dtype, rms):
    m, n = 9, 262144
    x, w, b = fresh((m, n), dtype), fresh(n, dtype, 0.5, 1.0), fresh(n, dtype)
    r = fresh((m, n), dtype)
    y, h, mean, rstd = ops.norm_forward(x, w, None if rms else b, r, 1e-5, 0.0, rms, None, None, True)
    ry, rh, _, _ = forward_ref(x, w, None if rms else b, r, 1e-5, 0.0, rms)
    assert_close(h, rh, dtype, name="h")
    assert_close(y, ry, dtype)
    dy, dres_out = fresh((m, n), dtype), fresh((m, n), dtype)
    check_backward(dy, h, w, None if rms else mean, rstd, 0.0, rms, dres_out, need_db=not rms)
    check_backward(dy, h, w, None if rms else mean, rstd, 0.0, rms)


@pytest.mark.parametrize("n", [524288, 1100000])
def test_rms_forward_of_rows_past_the_early_columns(n):
    """16-bit RMSNorm rows whose shares hold more than EARLY_COLUMN_VALUES per thread
    (their weight loaded chunk by chunk, not held through the row) and, at 1.1M
    columns, the default share rather than WIDE_SHARE_VALUES (config.widened_16bit_share):
    the forward against the fp32 reference from poisoned outputs."""
    from quack_kernels.primitives import config

    m, dtype = 5, torch.bfloat16
    cfg = ops.forward_config(n, True, dtype, dtype, False, dtype, dtype)
    assert not config.norm_forward_early_columns(True, 1, 2, cfg)
    x, w = fresh((m, n), dtype, 2.0, 0.5), fresh(n, dtype, 0.5, 1.0)
    stats = torch.empty(m, dtype=torch.float32, device="cuda")
    poison_allocator(x, stats, stats)
    y, _, _, rstd = ops.norm_forward(x, w, None, None, 1e-6, 0.0, True, None, None, False)
    ry, _, _, rrstd = forward_ref(x, w, None, None, 1e-6, 0.0, True)
    assert_close(y, ry, dtype)
    assert_close(rstd, rrstd, torch.float32, name="rstd")


@pytest.mark.parametrize("mean,std", [(300.0, 1e-3), (-1e4, 1.0), (0.5, 2.0)])
def test_layer_norm_statistics_of_rows_far_from_zero(mean, std):
    """LayerNorm of x alone on rows a cluster merges as (count, mean, centered sum of
    squares) per thread (kernels.norm's moments path): rows whose mean is many
    deviations from 0 keep an fp32-accurate variance. y is not compared: its error is
    the fp32 rounding of the mean times rstd, for any fp32 implementation."""
    m, n, fp32 = 6, 262144, torch.float32
    cfg = ops.forward_config(n, False, fp32, fp32, False, fp32, fp32, None)
    assert ops.forward_kernel(cfg, False, fp32, fp32, False, False, fp32, None, fp32)[0].moments
    x = fresh((m, n), fp32, std, mean)
    x[1, 0] = mean + 40 * std  # a row whose first value is far out
    stats = torch.empty(m, dtype=fp32, device="cuda")
    poison_allocator(x, stats, stats)  # y, mean, rstd start as NaN
    _, _, got_mean, got_rstd = ops.norm_forward(x, None, None, None, 1e-12, 0.0, False, None,
                                                None, False)
    _, _, ref_mean, ref_rstd = forward_ref(x, None, None, None, 1e-12, 0.0, False)
    assert_close(got_rstd, ref_rstd, fp32, name="rstd")
    assert_close(got_mean, ref_mean, fp32, name="mean")


@pytest.mark.parametrize("n,x_dtype", [(131073, torch.float32), (200000, torch.float32),
                                        (262143, torch.float32), (200000, torch.bfloat16),
                                        (262143, torch.bfloat16)])
@pytest.mark.parametrize("rms", [True, False])
def test_long_residual_rows_kept_in_registers(n, x_dtype, rms):
    """Ragged rows with an fp32 residual whose staged pair is 1 MiB or more (h kept in
    registers, config.RESIDUAL_REGISTER_ROW_BYTES): outputs poisoned, against the fp64
    reference."""
    m, fp32 = 5, torch.float32
    assert ops.forward_config(n, rms, x_dtype, fp32, True, x_dtype, x_dtype,
                              None if rms else x_dtype).staging == "registers"
    x, r = fresh((m, n), x_dtype), fresh((m, n), fp32)
    w, b = fresh(n, x_dtype, 0.5, 1.0), fresh(n, x_dtype)
    poison_allocator(r, x)  # y and h start as NaN
    y, h, _, _ = ops.norm_forward(x, w, None if rms else b, r, 1e-5, 0.0, rms, None, None, True)
    ry, rh, _, _ = forward_ref(x, w, None if rms else b, r, 1e-5, 0.0, rms)
    assert_close(h, rh, fp32, name="h")
    assert_close(y, ry, x_dtype)


@pytest.mark.parametrize("m,n", [(3000, 1000), (300, 32768), (40, 262144), (1000, 7)])
def test_many_row_blocks_per_cta(m, n):
    """The backward grid loops: several row blocks per CTA (and per cluster)."""
    for rms in (True, False):
        x, w = fresh((m, n), torch.bfloat16), fresh(n, torch.float32, 0.5, 1.0)
        b = fresh(n, torch.float32)
        y, h, mean, rstd = ops.norm_forward(x, w, b, None, 1e-5, 0.0, rms, None, None, False)
        check_backward(fresh((m, n), torch.bfloat16), x, w, None if rms else mean, rstd, 0.0, rms,
                       need_db=True)


@pytest.mark.parametrize("n, dtype, rms", [
    (262144, torch.float32, True), (262144, torch.float32, False),
    (139265, torch.bfloat16, False),  # (odd rows a cluster of odd-row register shares cannot hold)
    (200000, torch.float32, True)])
def test_refilled_chunks_over_many_row_blocks(n, dtype, rms):
    """Single-buffered shares that load each chunk of the next row block once the dh pass
    has read it (NormBackward.refills_chunks), over several blocks a CTA, the last ones
    refilled from past M, with and without the residual gradient."""
    cfg = ops.backward_config(n, dtype, dtype, (dtype,), dtype, 1 if rms else 2, rms=rms)
    kernel = ops._backward_kernel_object(cfg, rms, dtype, dtype, True, not rms, dtype)
    assert kernel.refills_chunks
    resident = ops.resident_row_blocks(kernel, torch.device("cuda"))
    m = 2 * resident + resident // 2 + 1  # two or three blocks a CTA, refills past M
    assert loop_grid_rows(cfg, m, resident) == resident
    x, w, b = fresh((m, n), dtype), fresh(n, dtype, 0.5, 1.0), fresh(n, dtype)
    _, _, mean, rstd = ops.norm_forward(x, w, None if rms else b, None, 1e-5, 0.0, rms, None,
                                        None, False)
    dy = fresh((m, n), dtype)
    check_backward(dy, x, w, None if rms else mean, rstd, 0.0, rms, need_db=not rms)
    check_backward(dy, x, w, None if rms else mean, rstd, 0.0, rms, fresh((m, n), dtype),
                   need_db=not rms)


@pytest.fixture
def shifted_norm_rows(monkeypatch):
    yield from switched(monkeypatch, "SHIFTED_NORM_ROWS", True,
                        (ops._forward_plans, ops._backward_plans))


@pytest.fixture
def unshifted_norm_rows(monkeypatch):
    """Odd 16-bit rows on their one-value shares, as misaligned rows take them."""
    yield from switched(monkeypatch, "SHIFTED_NORM_ROWS", False,
                        (ops._forward_plans, ops._backward_plans))


@pytest.mark.parametrize("n, dtype, rms", [
    (50257, torch.bfloat16, True), (32001, torch.float16, True), (200001, torch.bfloat16, True),
    (131073, torch.bfloat16, False), (65537, torch.float16, False)])
def test_odd_rows_on_register_shares(n, dtype, rms, unshifted_norm_rows):
    """Odd 16-bit rows (one-value vectors, the shifted ones off) on the register shares of
    config.odd_row_register_share (RMSNorm 1024 threads, LayerNorm 512), over two or three
    row blocks a CTA (the last block's prefetch past M skipped); dx, dweight (and dbias)
    on poisoned outputs. The forward too, on the shares of config.odd_row_forward_share."""
    sums = 1 if rms else 2
    cfg = ops.backward_config(n, dtype, dtype, (dtype,), dtype, sums, rms=rms)
    assert (cfg.threads_per_row, cfg.vec, cfg.staging) == \
        (ODD_ROW_SHARES[rms][0], 1, "registers"), cfg
    kernel = ops._backward_kernel_object(cfg, rms, dtype, dtype, True, not rms, dtype)
    resident = ops.resident_row_blocks(kernel, torch.device("cuda"))
    m = 2 * resident + resident // 2 + 1
    x, w = fresh((m, n), dtype), fresh(n, dtype, 0.5, 1.0)
    b = None if rms else fresh(n, dtype)
    forward_cfg = ops.forward_config(n, rms, dtype, dtype, False, dtype, dtype,
                                     None if rms else dtype)
    assert (forward_cfg.vecs_per_thread, forward_cfg.staging) == \
        (ODD_ROW_FORWARD_VALUES, ODD_ROW_FORWARD_SHARES["reread" if rms else "staged"][1]), \
        forward_cfg
    mean, rstd = check_forward(x, w, b, 1e-5, rms)
    check_backward(fresh((m, n), dtype), x, w, None if rms else mean, rstd, 0.0, rms,
                   need_db=not rms)


@pytest.mark.parametrize("n, dtype, weight_dtype", [
    (16385, torch.bfloat16, None), (50257, torch.float16, None), (262143, torch.bfloat16, None),
    (100001, torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("rms", [True, False])
def test_forward_of_odd_rows(n, dtype, weight_dtype, rms, unshifted_norm_rows):
    """The forward of odd 16-bit rows (the shifted ones off) on the shares of
    config.odd_row_forward_share (RMSNorm's x re-read from global memory in the output
    pass, LayerNorm's staged, both from 2 CTAs to a full cluster; LayerNorm with an fp32
    weight, whose RMSNorm runs its register share), y, rstd and mean on poisoned
    outputs, a row with a large mean among them."""
    m = 67
    weight_dtype = weight_dtype or dtype
    x = fresh((m, n), dtype, 2.0, 0.5)
    x[m // 2] += 300.0
    w = fresh(n, weight_dtype, 0.5, 1.0)
    b = None if rms else fresh(n, weight_dtype, 0.5)
    check_forward(x, w, b, 1e-5, rms)


# (row length, row dtype, weight dtype) of the shifted rows' tests, beside a short row each
SHIFTED_ROWS = [(4095, torch.float16, torch.float16), (12289, torch.bfloat16, torch.float32),
                (50257, torch.bfloat16, torch.bfloat16), (131071, torch.float16, torch.float16),
                (262143, torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("n, dtype, weight_dtype",
                         [(2049, torch.bfloat16, torch.bfloat16), *SHIFTED_ROWS])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rms", [True, False])
def test_shifted_odd_rows(n, dtype, weight_dtype, residual, rms, shifted_norm_rows):
    """The forward of odd 16-bit rows read from the 16-byte boundary before each
    (forward_config's ``shifted``), its weight and bias spliced to each row's shift: 25
    rows (every shift), large values in the rows' and the weight's first and last
    columns, one row with a large mean; y, the stored stream, rstd and mean on poisoned
    outputs against the fp64 reference, through the op and the public API (the C++
    path, its backward shifted too, one row a CTA); every third row alone (row stride 3N: every shift
    again) leaves the rows between untouched; a misaligned copy of x, or of a 16-bit
    weight, takes the unshifted share. Row lengths used by no other test of the C++ path (its plans outlive a
    test)."""
    from quack_kernels.ops.common import shiftable
    from quack_kernels.primitives import config

    m, eps = 25, 1e-5
    x = fresh((m, n), dtype, 2.0, 0.5)
    x[1::3, 0] = 30.0
    x[2::3, -1] = -30.0
    x[m // 2] += 300.0
    r = fresh((m, n), dtype) if residual else None
    w = fresh(n, weight_dtype, 0.5, 1.0)
    w[0], w[-1] = 4.0, -4.0
    b = None if rms else fresh(n, weight_dtype, 0.5)
    if b is not None:
        b[0], b[-1] = -5.0, 5.0
    bias_dtype = None if rms else weight_dtype
    cfg = ops.forward_config(n, rms, dtype, dtype, residual, dtype, weight_dtype, bias_dtype, 1,
                             None, True)
    # (x alone: shifted from config.SHIFTED_RMS_NORM_X_MIN_COLS /
    # SHIFTED_LAYER_NORM_X_MIN_COLS, its unshifted share checked below them)
    assert cfg.row_shift == config.norm_forward_shifts(n, rms, residual), cfg
    ry, rh, rmean, rrstd = forward_ref(x, w, b, r, eps, 0.0, rms)

    def check(y, h, mean, rstd, rows=slice(None)):
        assert_close(y, ry[rows], dtype)
        assert_close(rstd, rrstd[rows], torch.float32, name="rstd")
        if residual:
            assert_close(h, rh[rows], dtype, name="stream")
        if not rms:
            assert_close(mean, rmean[rows], torch.float32, name="mean",
                         magnitude=rh[rows].float().abs().mean(-1))

    stats = torch.empty(m, dtype=torch.float32, device="cuda")
    poison_allocator(x, x, stats, stats)
    check(*ops.norm_forward(x, w, b, r, eps, 0.0, rms, None, None, residual))

    leaves = [t.clone().requires_grad_() for t in (x, w)]
    norm = qk.rms_norm if rms else qk.layer_norm
    kwargs = dict(eps=eps, residual=r, prenorm=residual, return_stats=True)
    out = norm(*leaves, **kwargs) if rms else norm(*leaves, b, **kwargs)
    y, h = out[0], out[1] if residual else None
    check(y, h, None if rms else out[-2], out[-1])
    dy = fresh((m, n), dtype)
    y.backward(dy)
    mean = None if rms else rmean.float()
    ref_dh, ref_dw, _ = ops.norm_backward_reference(dy, rh, w, mean, rrstd.float(), None, 0.0,
                                                    rms, compute_dtype=F64)
    assert_close(leaves[0].grad, ref_dh, dtype, scale=4.0, name="dx")
    assert_close(leaves[1].grad, ref_dw, weight_dtype, scale=4.0 * math.sqrt(m), name="dweight")

    sentinel = 7.0
    y_third = torch.full_like(x, sentinel)
    h_third = torch.full_like(x, sentinel) if residual else None
    mean_third = torch.empty(len(range(0, m, 3)), dtype=torch.float32, device="cuda")
    rstd_third = torch.empty_like(mean_third)
    fn = ops.compile_forward(cfg, rms, dtype, dtype, residual, residual, weight_dtype,
                             bias_dtype, dtype)
    fn(x[::3], r[::3] if residual else None, w, b, y_third[::3],
       h_third[::3] if residual else None, None if rms else mean_third, rstd_third, eps, 0.0)
    check(y_third[::3], h_third[::3] if residual else None, mean_third, rstd_third,
          slice(None, None, 3))
    for between in [t for t in (y_third, h_third) if t is not None]:
        untouched = torch.cat([between[1::3], between[2::3]])
        assert torch.equal(untouched, torch.full_like(untouched, sentinel))

    misaligned = torch.empty(m * n + 1, dtype=dtype, device="cuda")[1:].view(m, n)
    misaligned.copy_(x)
    assert not shiftable(misaligned)
    check(*ops.norm_forward(misaligned, w, b, r, eps, 0.0, rms, None, None, residual))
    weight_off = torch.empty(n + 1, dtype=weight_dtype, device="cuda")[1:].copy_(w)
    # (a 16-bit weight is spliced from whole vectors: unshifted; an fp32 one is staged
    # value by value: shifted still)
    assert ops.shifts_rows(x, columns=(weight_off,)) == (weight_dtype == torch.float32)
    check(*ops.norm_forward(x, weight_off, b, r, eps, 0.0, rms, None, None, residual))


@pytest.mark.parametrize("n, dtype, weight_dtype",
                         [(1001, torch.bfloat16, torch.bfloat16), *SHIFTED_ROWS])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rms", [True, False])
def test_shifted_odd_rows_backward(n, dtype, weight_dtype, residual, rms, shifted_norm_rows):
    """The backward of odd 16-bit rows read from the 16-byte boundary before each
    (backward_config's ``shifted``): its looping grid, as many row blocks as are
    resident, visits the rows class by class (rows.ShiftClassOrder: each CTA a range,
    its weight staged again at each class's shift, its sums written a row a class),
    three row blocks a CTA and more; dx (and the residual gradient), dweight and dbias
    on poisoned outputs (the partial sums too) against fp64, dy large at the rows'
    edges and in the weight's first and last columns; then the public API (the C++ path)
    on the same rows (LayerNorm of 1001 columns: unshifted; of 262143:
    config.shifted_sums_share, the weight read spliced), and a misaligned weight (a
    16-bit one: unshifted)."""
    dres_dtype = dtype if residual else None
    sums = 1 if rms else 2
    outs = (dtype, dtype, dtype) if residual else (dtype,)
    shifted = ops.backward_config(n, dtype, dtype, outs, weight_dtype, sums, 1, rms=rms,
                                  shifted=True)
    # (LayerNorm's span share at 1001 columns holds two rows a CTA: those rows keep their
    # one-value share)
    assert shifted.row_shift == (rms or n != 1001), shifted
    if shifted.row_shift and not rms and n == 262143:
        assert shifted.threads_per_row & (shifted.threads_per_row - 1), shifted
    plan = ops._backward_plan(n, rms, dtype, dtype, weight_dtype, dres_dtype, dtype, dres_dtype,
                              True, None if rms else weight_dtype, 1, True,
                              torch.device("cuda"))
    cfg, resident = plan[1], plan[2]
    assert cfg == shifted, (cfg, resident)
    m = 3 * resident + 5
    h = fresh((m, n), dtype, 2.0, 0.5)
    dy = fresh((m, n), dtype)
    dy[:, 0] *= 40
    dy[:, -1] *= 40
    w = fresh(n, weight_dtype, 0.5, 1.0)
    w[0], w[-1] = 4.0, -4.0
    _, _, mean, rstd = ops.norm_reference(h, None, None, None, 1e-5, 0.0, rms)
    mean = None if rms else mean
    sum_cfg = plan[4]
    partials = torch.empty(partial_sum_rows(cfg, loop_grid_rows(cfg, m, resident)),
                           sum_cfg.width, device="cuda")
    check_backward(dy, h, w, mean, rstd, 0.0, rms,
                   dres_out=fresh((m, n), dtype) if residual else None, need_db=not rms,
                   partials=partials)

    leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    b = None if rms else torch.zeros(n, dtype=weight_dtype, device="cuda", requires_grad=True)
    y = qk.rms_norm(*leaves, eps=1e-5) if rms else qk.layer_norm(*leaves, b, eps=1e-5)
    y.backward(dy)
    ref_dh, ref_dw, ref_db = ops.norm_backward_reference(dy, h, w, mean, rstd, None, 0.0, rms,
                                                         compute_dtype=F64)
    grow = 4.0 * math.sqrt(m)
    assert_close(leaves[0].grad, ref_dh, dtype, scale=4.0, name="dx")
    assert_close(leaves[1].grad, ref_dw, weight_dtype, scale=grow, name="dweight")
    if b is not None:
        assert_close(b.grad, ref_db, weight_dtype, scale=grow, name="dbias")
    weight_off = torch.empty(n + 1, dtype=weight_dtype, device="cuda")[1:].copy_(w)
    assert ops.shifts_rows(h, columns=(weight_off,)) == (weight_dtype == torch.float32)
    check_backward(dy, h, weight_off, mean, rstd, 0.0, rms, need_db=not rms)


@pytest.mark.parametrize("n, rms", [(4097, False), (50257, True), (100001, False),
                                    (131073, True)])
@pytest.mark.parametrize("rows, grid", [
    ("1", None), ("5", None), ("a CTA each", None), ("8 a CTA", None), ("16 a CTA + 3", None),
    (40, 1), (40, 2), (43, 3), (41, 7), (45, 9), (67, 8), (67, 16), (8, 8), (203, 24)])
def test_shifted_backward_on_row_counts(n, rms, rows, grid, shifted_norm_rows, monkeypatch):
    """The shifted backward's rows and partial sums (rows.ShiftClassOrder) on row counts
    and grids that place the CTAs' ranges differently against the classes. On the
    resident grid: fewer rows than classes (a CTA a row, most classes empty), a row a CTA
    on a grid one short of the resident one (every class start a range start), 8 and
    16 rows a CTA. On grids held to ``grid`` row blocks: one CTA through all 8 classes,
    a few CTAs across several, and grids of a multiple of 8 (each class split among G / 8
    CTAs of its own: ShiftClassOrder.splits_classes); RMSNorm of 131073 columns reads
    its class sizes back from shared memory (config.shift_order_keeps_class_sizes). The
    partial sums start as NaN, so a row left unwritten (or a row visited twice or never)
    shows in dx, dweight or dbias."""
    dtype = torch.bfloat16
    if grid is not None:
        monkeypatch.setattr(ops, "resident_row_blocks", lambda kernel, device: grid)
    plan = ops._backward_plan(n, rms, dtype, dtype, dtype, None, dtype, None, True,
                              None if rms else dtype, 1, True, torch.device("cuda"))
    cfg, resident, sum_cfg = plan[1], plan[2], plan[4]
    assert cfg.row_shift and shift_order_keeps_class_sizes(cfg) == (n == 131073), cfg
    m = rows if grid is not None else {"1": 1, "5": 5, "a CTA each": resident - 1,
                                       "8 a CTA": 8 * resident,
                                       "16 a CTA + 3": 16 * resident + 3}[rows]
    h, dy = fresh((m, n), dtype, 2.0, 0.5), fresh((m, n), dtype)
    w = fresh(n, dtype, 0.5, 1.0)
    _, _, mean, rstd = ops.norm_reference(h, None, None, None, 1e-5, 0.0, rms)
    partials = torch.empty(partial_sum_rows(cfg, loop_grid_rows(cfg, m, resident)),
                           sum_cfg.width, device="cuda")
    check_backward(dy, h, w, None if rms else mean, rstd, 0.0, rms, need_db=not rms,
                   partials=partials)


@pytest.mark.parametrize("dtype, mean_value", [(torch.float16, 1e4), (torch.bfloat16, 1e3)])
@pytest.mark.parametrize("n", [8192, 65536])
def test_layer_norm_backward_of_16bit_rows_far_from_zero(n, dtype, mean_value):
    """The 16-bit LayerNorm backward on its 512-thread register shares (FMA form, held
    weight, unmasked rows) on rows far from zero (std 1): xhat is computed from h - mean.
    As h * rstd - mean * rstd it erred by |mean| * rstd * 2^-24: an emulation of that
    form failed this dweight check at fp16 mean 1e4 (7322 of 8192 columns)."""
    m = 300
    cfg = ops.backward_config(n, dtype, dtype, (dtype,), dtype, 2)
    assert ops._backward_kernel_object(cfg, False, dtype, dtype, True, True, dtype).fma_form
    x = fresh((m, n), dtype, 1.0, mean_value)
    w, b = fresh(n, dtype, 0.5, 1.0), fresh(n, dtype, 0.5)
    _, _, mean, rstd = ops.norm_forward(x, w, b, None, 1e-5, 0.0, False, None, None, False)
    check_backward(fresh((m, n), dtype), x, w, mean, rstd, 0.0, False, need_db=True)


@pytest.mark.parametrize("n, dtype", [(262144, torch.float32), (65536, torch.bfloat16),
                                      (65528, torch.bfloat16)])
@pytest.mark.parametrize("rms", [True, False])
def test_rows_prefetched_to_l2(n, dtype, rms, wrap_config):
    """Forward (with a residual) and looping backward whose CTAs ask L2 for the rows of
    a later row block (RowConfig.l2_prefetch: the forward 3 blocks ahead, the backward
    with one staging buffer 3 iterations ahead, both past M at the end; 65528: the
    cluster's last CTA holds less than a share), against the fp64 reference."""
    with_l2 = lambda config_fn: lambda *a, **k: dataclasses.replace(  # noqa: E731
        config_fn(*a, **k), l2_prefetch=3, stages=1)
    wrap_config("forward_config", with_l2(FORWARD_CONFIG))
    wrap_config("backward_config", with_l2(BACKWARD_CONFIG))
    m = 40
    x, r = fresh((m, n), dtype), fresh((m, n), dtype)
    w, b = fresh(n, dtype, 0.5, 1.0), None if rms else fresh(n, dtype, 0.5)
    poison_allocator(x, r)  # y and h start as NaN
    y, h, mean, rstd = ops.norm_forward(x, w, b, r, 1e-5, 0.0, rms, None, None, True)
    ry, rh, _, _ = forward_ref(x, w, b, r, 1e-5, 0.0, rms)
    assert_close(h, rh, dtype, name="h")
    assert_close(y, ry, dtype)
    check_backward(fresh((m, n), dtype), h, w, None if rms else mean, rstd, 0.0, rms,
                   need_db=not rms)


@pytest.mark.parametrize("n, dtype", [(65536, torch.bfloat16), (65536, torch.float32),
                                      (16384, torch.bfloat16)])
@pytest.mark.parametrize("rms", [True, False])
def test_backward_prefetching_past_two_buffers(n, dtype, rms, monkeypatch, wrap_config):
    """The looping backward with two staging buffers asking L2 for the row block after
    the second buffer's (config.norm_backward_prefetches_past_buffers; forced here where
    the sums stay in registers), on a grid held to two row blocks so that 40 rows take
    20 iterations and the prefetches land inside the tensor, against the fp64
    reference."""
    def prefetching(*a, **k):
        cfg = BACKWARD_CONFIG(*a, **k)
        assert cfg.stages == 2
        return dataclasses.replace(cfg, l2_prefetch=1)

    wrap_config("backward_config", prefetching)
    monkeypatch.setattr(ops, "resident_row_blocks", lambda kernel, device: 2)
    m = 40
    x = fresh((m, n), dtype)
    w, b = fresh(n, dtype, 0.5, 1.0), None if rms else fresh(n, dtype, 0.5)
    _, _, mean, rstd = ops.norm_forward(x, w, b, None, 1e-5, 0.0, rms, None, None, False)
    check_backward(fresh((m, n), dtype), x, w, None if rms else mean, rstd, 0.0, rms,
                   need_db=not rms)


@pytest.mark.parametrize("x_dtype,r_dtype,w_dtype,res_dtype,out_dtype", [
    (torch.bfloat16, torch.bfloat16, torch.float32, None, None),
    (torch.float16, torch.bfloat16, torch.bfloat16, torch.float32, torch.float32),
    (torch.bfloat16, torch.float32, torch.float32, torch.float32, torch.bfloat16),
    (torch.float32, torch.float16, torch.float16, torch.float16, torch.float16),
])
@pytest.mark.parametrize("rms", [True, False])
def test_mixed_dtypes_residual_prenorm(x_dtype, r_dtype, w_dtype, res_dtype, out_dtype, rms):
    m, n = 65, 3000
    x = fresh((m, n), x_dtype).requires_grad_()
    r = fresh((m, n), r_dtype).requires_grad_()
    w = fresh(n, w_dtype, 0.5, 1.0).requires_grad_()
    b = fresh(n, w_dtype).requires_grad_()
    if rms:
        y, h = qk.rms_norm(x, w, residual=r, prenorm=True, out_dtype=out_dtype,
                           residual_dtype=res_dtype, weight_offset=0.25)
    else:
        y, h = qk.layer_norm(x, w, b, residual=r, prenorm=True, out_dtype=out_dtype,
                             residual_dtype=res_dtype)
    ry, rh, _, _ = forward_ref(x, w, None if rms else b, r, 1e-6 if rms else 1e-5,
                               0.25 if rms else 0.0, rms, out_dtype, res_dtype)
    assert y.dtype == (out_dtype or x_dtype) and h.dtype == (res_dtype or r_dtype)
    assert_close(h, rh, h.dtype, name="h")
    assert_close(y, ry, y.dtype)
    dy, dh = fresh((m, n), y.dtype), fresh((m, n), h.dtype)
    torch.autograd.backward([y, h], [dy, dh])
    # fp64 autograd through the reference from the same leaves
    leaves = [t.detach().double().requires_grad_() for t in (x, r, w, b)]
    xd, rd, wd, bd = leaves
    hd = xd + rd
    if rms:
        yd = torch.nn.functional.rms_norm(hd, (n,), wd + 0.25, eps=1e-6)
    else:
        yd = torch.nn.functional.layer_norm(hd, (n,), wd, bd, eps=1e-5)
    torch.autograd.backward([yd, hd], [dy.double(), dh.double()])
    low = max((x_dtype, r_dtype, res_dtype or r_dtype), key=lambda d: TOL_ORDER[d])
    assert_close(x.grad, xd.grad, low, scale=4.0, name="dx")
    assert_close(r.grad, rd.grad, low, scale=4.0, name="dresidual")
    assert_close(w.grad, wd.grad, low, scale=4.0 * math.sqrt(m), name="dweight")
    if not rms:
        assert_close(b.grad, bd.grad, low, scale=4.0 * math.sqrt(m), name="dbias")
    else:
        assert b.grad is None


@pytest.mark.parametrize("n", [32768, 50000, 65536, 131072, 200000, 262144, 524288])
def test_layer_norm_of_fp32_rows_staged_over_a_cluster(n):
    """fp32 LayerNorm of x alone staged in chunks in shared memory over a cluster
    (config.staged_layer_norm_share: where its share would be kept in registers, and
    past 131K columns in chunks of 16 or 8 values): one reduction, the columns loaded in
    the output pass (a chunk ahead on shares of 3+ chunks)."""
    cfg = _fp32_layer_norm_config(n)
    assert cfg.cluster_size > 1 and cfg.staging == "smem" and cfg.num_chunks > 1
    _check_fp32_layer_norm_forward(n)


@pytest.mark.parametrize("n", [8000, 8192])
def test_layer_norm_of_fp32_rows_of_8k_columns_on_two_ctas(n):
    """fp32 LayerNorm of x alone that one CTA would hold at more than
    LAYER_NORM_ONE_CTA_MAX_VALUES per thread runs on a 2-CTA cluster
    (config.staged_layer_norm_share); 8000 leaves the last vectors of a share idle."""
    cfg = _fp32_layer_norm_config(n)
    assert cfg.cluster_size == 2 and cfg.staging == "registers"
    _check_fp32_layer_norm_forward(n)


@pytest.mark.parametrize("n", [150000, 262144])
@pytest.mark.parametrize("column_dtype", [torch.bfloat16, torch.float16])
def test_layer_norm_of_fp32_rows_with_16bit_columns_past_131k_columns(n, column_dtype):
    """fp32 x with a 16-bit weight and bias past 131K columns: the fp32 rows' chunks of
    16 (262144) or 8 (150000) values, the columns a chunk ahead, with columns of half
    x's width."""
    cfg = _fp32_layer_norm_config(n, column_dtype)
    assert cfg.staging == "smem" and cfg.num_chunks > 2
    _check_fp32_layer_norm_forward(n, column_dtype)


@pytest.mark.parametrize("n,residual", [(16384, False), (65536, False), (131072, False),
                                        (262144, False), (196608, True), (393216, True)])
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16])
def test_layer_norm_of_16bit_rows_with_fp32_columns_staged(n, residual, x_dtype):
    """16-bit x (and residual) with an fp32 weight and bias, on shares staged in shared
    memory in chunks of 16 values or fewer, more than two: 4-value vectors of x, the
    columns loaded a chunk ahead (norm_forward_columns_ahead counts the columns'
    width)."""
    cfg = ops.forward_config(n, False, x_dtype, x_dtype, residual, x_dtype, torch.float32,
                             torch.float32)
    assert cfg.staging == "smem" and cfg.num_chunks > 2 and cfg.thread_values_per_chunk <= 16
    m = 9
    x = fresh((m, n), x_dtype, 2.0, 0.5)
    r = fresh((m, n), x_dtype) if residual else None
    w, b = fresh(n, torch.float32, 0.5, 1.0), fresh(n, torch.float32, 0.5)
    stats = torch.empty(m, dtype=torch.float32, device="cuda")
    poison_allocator(x, x, stats, stats)  # y, h, mean, rstd start as NaN
    y, h, mean, rstd = ops.norm_forward(x, w, b, r, 1e-5, 0.0, False, None, None, residual)
    ry, rh, rmean, rrstd = forward_ref(x, w, b, r, 1e-5, 0.0, False)
    assert_close(y, ry, x_dtype)
    if residual:
        assert_close(h, rh, x_dtype, name="h")
    assert_close(mean, rmean, torch.float32, name="mean")
    assert_close(rstd, rrstd, torch.float32, name="rstd")


def _fp32_layer_norm_config(n, column_dtype=torch.float32):
    return ops.forward_config(n, False, torch.float32, torch.float32, False, torch.float32,
                              column_dtype, column_dtype)


def _check_fp32_layer_norm_forward(n, column_dtype=torch.float32):
    m = 9
    x = fresh((m, n), torch.float32, 2.0, 0.5)
    w, b = fresh(n, column_dtype, 0.5, 1.0), fresh(n, column_dtype, 0.5)
    stats = torch.empty(m, dtype=torch.float32, device="cuda")
    poison_allocator(x, stats, stats)  # y, mean, rstd start as NaN
    y, _, mean, rstd = ops.norm_forward(x, w, b, None, 1e-5, 0.0, False, None, None, False)
    ry, _, rmean, rrstd = forward_ref(x, w, b, None, 1e-5, 0.0, False)
    assert_close(y, ry, torch.float32)
    assert_close(mean, rmean, torch.float32, name="mean")
    assert_close(rstd, rrstd, torch.float32, name="rstd")


@pytest.mark.parametrize("n,dtype", [(65536, torch.bfloat16), (40000, torch.float32),
                                     (262144, torch.bfloat16), (262144, torch.float32)])
@pytest.mark.parametrize("rms", [True, False])
def test_residual_rows_over_a_cluster(n, dtype, rms):
    """Rows split over a cluster with a residual; all but the bf16 LayerNorm (a share in
    shared memory) load their weight (and bias) at the start
    (config.norm_forward_early_columns); rows of 262144 keep h in registers and load
    them in the output pass (bf16) or before the cluster exchange (fp32,
    config.norm_forward_columns_before_reduction)."""
    m = 9
    x, r = fresh((m, n), dtype), fresh((m, n), dtype)
    w = fresh(n, dtype, 0.5, 1.0)
    b = None if rms else fresh(n, dtype, 0.5)
    eps = 1e-6 if rms else 1e-5
    stats = torch.empty(m, dtype=torch.float32, device="cuda")
    poison_allocator(x, x, stats, stats)  # y, h, mean, rstd start as NaN
    y, h, mean, rstd = ops.norm_forward(x, w, b, r, eps, 0.0, rms, None, None, True)
    ry, rh, rmean, rrstd = forward_ref(x, w, b, r, eps, 0.0, rms)
    assert_close(h, rh, dtype, name="h")
    assert_close(y, ry, dtype)
    assert_close(rstd, rrstd, torch.float32, name="rstd")
    if not rms:
        assert_close(mean, rmean, torch.float32, name="mean")


TOL_ORDER = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def test_residual_without_prenorm_and_no_weight():
    x = fresh((4, 5, 512), torch.bfloat16).requires_grad_()
    r = fresh((4, 5, 512), torch.bfloat16).requires_grad_()
    y = qk.rms_norm(x, residual=r)
    ref = torch.nn.functional.rms_norm((x.float() + r.float()).bfloat16().double(), (512,), eps=1e-6)
    assert_close(y, ref, torch.bfloat16)
    dy = fresh((4, 5, 512), torch.bfloat16)
    y.backward(dy)
    hd = (x.detach().float() + r.detach().float()).bfloat16().double().requires_grad_()
    torch.nn.functional.rms_norm(hd, (512,), eps=1e-6).backward(dy.double())
    assert_close(x.grad, hd.grad, torch.bfloat16, scale=4.0, name="x grad")
    assert torch.equal(x.grad, r.grad)  # (the stream's gradient, handed to both)


def test_frozen_weight_and_inference():
    """A frozen weight gets no gradient while x's is right; a forward without grad
    with a residual and a bias matches the reference."""
    x = fresh((64, 2048), torch.bfloat16).requires_grad_()
    w = fresh(2048, torch.bfloat16)
    dy = fresh((64, 2048), torch.bfloat16)
    qk.rms_norm(x, w).backward(dy)
    assert w.grad is None
    xd = x.detach().double().requires_grad_()
    torch.nn.functional.rms_norm(xd, (2048,), w.double(), eps=1e-6).backward(dy.double())
    assert_close(x.grad, xd.grad, torch.bfloat16, scale=4.0, name="x grad")
    with torch.no_grad():
        y = qk.layer_norm(x, w, w, residual=x)
    assert_close(y, forward_ref(x.detach(), w, w, x.detach(), 1e-5, 0.0, False)[0],
                 torch.bfloat16)


def test_weight_only_gradient():
    x = fresh((100, 1536), torch.bfloat16)
    w = fresh(1536, torch.float32, 0.5, 1.0).requires_grad_()
    b = fresh(1536, torch.float32).requires_grad_()
    dy = fresh((100, 1536), torch.bfloat16)
    qk.layer_norm(x, w, b).backward(dy)
    _, _, mean, rstd = forward_ref(x, None, None, None, 1e-5, 0.0, False)
    _, rdw, rdb = ops.norm_backward_reference(dy, x, w, mean, rstd, None, 0.0, False, F64)
    assert_close(w.grad, rdw, torch.float32, scale=40.0, name="dweight")
    assert_close(b.grad, rdb, torch.float32, scale=40.0, name="dbias")


def test_empty_rows():
    x = torch.empty(0, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(4096, device="cuda", requires_grad=True)
    y = qk.rms_norm(x, w)
    assert y.shape == (0, 4096)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))


def test_non_contiguous_and_leading_dims():
    x = fresh((8, 6, 1024), torch.float32).transpose(0, 1)  # non-contiguous (6, 8, 1024)
    w = fresh(2048, torch.float32)[::2]  # strided weight
    y = qk.layer_norm(x, w)
    ref = torch.nn.functional.layer_norm(x.double(), (1024,), w.double(), eps=1e-5)
    assert_close(y, ref, torch.float32)
    xs = fresh((64, 2048), torch.bfloat16)[:, 3:1027]  # misaligned base, strided rows
    assert_close(qk.rms_norm(xs), torch.nn.functional.rms_norm(xs.double(), (1024,), eps=1e-6),
                 torch.bfloat16)


@pytest.mark.parametrize("rows", [1, 5, 3001])
@pytest.mark.parametrize("n", [1, 7, 1000, 4097, 262144])
@pytest.mark.parametrize("out_dtypes", [(torch.float32,), (torch.bfloat16, torch.float16)])
def test_column_sum_of_partial_rows(rows, n, out_dtypes):
    """The backward's fixed-order sum of partial rows, alone: every column of every
    segment against an fp64 sum (padding columns hold NaN and must not leak in), twice
    bitwise equal."""
    cfg = ops.column_sum_config(n, len(out_dtypes))
    fn = ops.compile_column_sum(cfg, out_dtypes)
    partial = torch.full((rows, cfg.width), float("nan"), device="cuda")
    segments = [partial[:, k * cfg.padded:k * cfg.padded + n] for k in range(len(out_dtypes))]
    for segment in segments:
        segment.copy_(fresh((rows, n), torch.float32, scale=3.0, shift=1.0))
    results = []
    for _ in range(2):
        outs = [torch.full((n,), float("nan"), device="cuda", dtype=d) for d in out_dtypes]
        fn(partial, outs[0], outs[1] if len(outs) == 2 else None)
        results.append(outs)
    for out, segment in zip(results[0], segments):
        assert_close(out, segment.double().sum(0), out.dtype, scale=math.sqrt(rows), name="sum")
    for first, second in zip(*results):
        assert torch.equal(first, second)


def test_backward_is_bitwise_reproducible():
    x = fresh((8192, 4096), torch.bfloat16).requires_grad_()
    w = fresh(4096, torch.float32).requires_grad_()
    b = fresh(4096, torch.float32).requires_grad_()
    dy = fresh((8192, 4096), torch.bfloat16)
    grads = []
    for _ in range(2):
        x.grad = w.grad = b.grad = None
        qk.layer_norm(x, w, b).backward(dy)
        grads.append((x.grad.clone(), w.grad.clone(), b.grad.clone()))
    for a, c in zip(*grads):
        assert torch.equal(a, c)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("m,n", [(32768, 4096), (8192, 10000), (8192, 12288)])
@pytest.mark.parametrize("rms", [True, False])
def test_fp32_backward_of_many_row_blocks_launched_back_to_back(m, n, rms):
    """Hundreds of back-to-back launches of the looping fp32 backward over many row
    blocks per CTA, on 4-16 CTA clusters of 128 threads: every launch ends (the sweeps
    and the runner of 2026-12-03 hung in LayerNorm fp32 32768x4096, 16384x8192 and
    8192x16384 on such shares, after the first launch had finished; the last two now
    take register shares) and gives the first launch's gradients."""
    x = fresh((m, n), torch.float32).requires_grad_()
    w = fresh(n, torch.float32).requires_grad_()
    b = None if rms else fresh(n, torch.float32).requires_grad_()
    y = qk.rms_norm(x, w) if rms else qk.layer_norm(x, w, b)
    dy = fresh((m, n), torch.float32)
    params = [x, w] + ([] if rms else [b])
    first = torch.autograd.grad(y, params, dy, retain_graph=True)
    for _ in range(300):
        last = torch.autograd.grad(y, params, dy, retain_graph=True)
    torch.cuda.synchronize()
    for a, c in zip(first, last):
        assert torch.equal(a, c)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prenorm_stream_is_exact_for_every_16bit_value(dtype):
    """h = x + residual, stored as the prenorm stream, is exactly torch's 16-bit sum for
    every finite value of the dtype: rows of 65536 columns with a residual take shares
    in shared memory over a cluster, where bf16 is widened by integer ops
    (tiling.to_fp32) and x + residual is added in the 16-bit dtype (NormForward.
    adds_in_stream_dtype). A pair widened in the wrong order or by a wrong shift, or a
    sum rounded twice, moves values. Outputs poisoned."""
    from quack_kernels.primitives.config import widens_by_integer_ops

    n, m = 65536, 4
    cfg = ops.forward_config(n, True, dtype, dtype, True, dtype)
    assert widens_by_integer_ops(cfg) and cfg.cluster_size > 1
    bits = torch.arange(-32768, 32768, dtype=torch.int32, device="cuda").to(torch.int16)
    values = bits.view(dtype)
    values = values[torch.isfinite(values)]  # every finite value, -0 included
    rows = []
    for _ in range(m):  # each row every value once, in its own order, then filled up
        order = torch.randperm(values.numel(), device="cuda")
        fill = torch.randint(values.numel(), (n - values.numel(),), device="cuda")
        rows.append(torch.cat([values[order], values[fill]]))
    x = torch.stack(rows)
    residual = torch.where(torch.rand(m, n, device="cuda") < 0.5, 0.0,
                           torch.randn(m, n, device="cuda")).to(dtype)
    poison_allocator(x, x)
    _, h = qk.rms_norm(x, None, residual=residual, prenorm=True)
    expected = (x.float() + residual.float()).to(dtype)
    mismatch = (h.view(torch.int16) != expected.view(torch.int16)).nonzero()
    assert mismatch.numel() == 0, (
        f"{mismatch.shape[0]} values differ, first at {mismatch[0].tolist()}: "
        f"{x[tuple(mismatch[0])].item()} + {residual[tuple(mismatch[0])].item()} -> "
        f"{h[tuple(mismatch[0])].item()}, torch {expected[tuple(mismatch[0])].item()}")


def test_torch_compile_fullgraph():
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), qk.nn.RMSNorm(512),
                                qk.nn.LayerNorm(512)).cuda()
    for dynamic in (False, True):
        compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)
        for m in (8, 24):
            x = torch.randn(m, 256, device="cuda", requires_grad=True)
            y = compiled(x)
            assert_close(y, model(x).double(), torch.float32)
            y.sum().backward()


def test_cuda_graph_capture():
    x = fresh((256, 4096), torch.bfloat16).requires_grad_()
    w = fresh(4096, torch.float32).requires_grad_()
    dy = fresh((256, 4096), torch.bfloat16)

    def step():
        x.grad = w.grad = None
        y = qk.rms_norm(x, w)
        y.backward(dy)
        return y

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = qk.rms_norm(x, w)
        grads = torch.autograd.grad(y, (x, w), dy)
    with torch.no_grad():
        x.copy_(fresh((256, 4096), torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    assert_close(y, forward_ref(x, w, None, None, 1e-6, 0.0, True)[0], torch.bfloat16)
    _, _, _, rstd = forward_ref(x, None, None, None, 1e-6, 0.0, True)
    rdx, rdw, _ = ops.norm_backward_reference(dy, x, w, None, rstd, None, 0.0, True, F64)
    assert_close(grads[0], rdx, torch.bfloat16, scale=4.0, name="dx")
    assert_close(grads[1], rdw, torch.float32, scale=64.0, name="dweight")


def test_modules_match_torch():
    ln, ours = torch.nn.LayerNorm(768).cuda(), qk.nn.LayerNorm(768).cuda()
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    ours.load_state_dict(ln.state_dict())
    x = fresh((32, 768), torch.float32)
    assert_close(ours(x), ln(x).double(), torch.float32)
    rms, ours_rms = torch.nn.RMSNorm(768, eps=1e-6).cuda(), qk.nn.RMSNorm(768).cuda()
    ours_rms.load_state_dict(rms.state_dict())
    assert_close(ours_rms(x), rms(x).double(), torch.float32)


@pytest.mark.slow
def test_more_than_2_31_elements():
    m, n = 65537, 32768  # 2^31 + 2^15 elements, 4 GiB in bf16
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    y, _, _, rstd = ops.norm_forward(x, None, None, None, 1e-6, 0.0, True, None, None, False)
    for rows in (slice(0, 4), slice(m - 4, m)):
        assert_close(y[rows], forward_ref(x[rows], None, None, None, 1e-6, 0.0, True)[0],
                     torch.bfloat16)
    del y
    # dy = x would make dx vanish (x is orthogonal to its own gradient): use another dy
    dy = x.flip(1)
    dx = ops.norm_backward(dy, x, None, None, rstd, None, 0.0, True, torch.bfloat16, None, False,
                           None)[0]
    ref = ops.norm_backward_reference(dy[m - 3:], x[m - 3:], None, None, rstd[m - 3:], None, 0.0,
                                      True, F64)[0]
    assert_close(dx[m - 3:], ref, torch.bfloat16, scale=4.0)
