"""Softmax / log-softmax CUDA kernels against an fp64 reference (run on an H200)."""

import dataclasses

import pytest
import torch

import quack_kernels as qk
from quack_kernels.ops import softmax as ops
from quack_kernels.ops.common import shiftable
from quack_kernels.primitives.config import row_config

from helpers import assert_close, poison_allocator, switched

pytestmark = pytest.mark.gpu
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NS = [1, 2, 7, 64, 100, 769, 1000, 1024, 4097, 8192, 32000, 50257, 65536, 131073, 262144]


def reference(x, log, dim=-1):
    xd = x.double()
    return torch.log_softmax(xd, dim) if log else torch.softmax(xd, dim)


# Per element, relative: a softmax output is computed in fp32 and rounded once, so each
# value is within a few of its dtype's units in the last place of the fp64 value (a
# whole-tensor norm or an absolute bound would miss a wrong small probability); fp16
# values below its normal range have fixed spacing (the absolute floor).
PROBABILITY_TOLERANCE = {torch.float32: (1e-5, 0.0), torch.float16: (2.0 ** -9, 2.0 ** -24),
                         torch.bfloat16: (2.0 ** -7, 0.0)}


def assert_probabilities_close(y, ref, dtype):
    rel, floor = PROBABILITY_TOLERANCE[dtype]
    err = (y.double() - ref).abs()
    bad = ~(err <= rel * ref.abs() + floor)
    if bad.any():
        idx = tuple(i.item() for i in bad.nonzero()[0])
        raise AssertionError(f"{int(bad.sum())} probabilities off; first at {idx}: "
                             f"got {y[idx].item()!r}, expected {ref[idx].item()!r}")


def fresh(shape, dtype, scale=3.0):
    return (torch.randn(shape, device="cuda", dtype=torch.float32) * scale).to(dtype)


def check_backward(dx, y, dy, log):
    """dx against the fp64 backward of y as rounded to its dtype (what the kernel sees),
    with the relative tolerance taken of the two terms dx is the difference of: a row
    of 1M fp32 values cancels them by 1e-2 and more. The row sum's size is at least its
    summands' root sum of squares, the size of the partial sums its rounding errors
    scale with: a sum that cancels to near zero (a row whose one finite y multiplies
    it) is still as inexact as a typical one."""
    yd, dyd = y.double(), dy.double()
    p = yd.exp() if log else yd
    summands = dyd if log else yd * dyd
    total = summands.sum(-1, keepdim=True)
    sum_size = torch.maximum(total.abs(), summands.square().sum(-1, keepdim=True).sqrt())
    terms = summands.abs() + p * sum_size
    assert_close(dx, ops.softmax_backward_reference(yd, dyd, log), y.dtype, scale=4.0,
                 name="dx", magnitude=terms)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("log", [False, True])
def test_forward_backward(n, dtype, log):
    m = 37
    x = fresh((m, n), dtype)
    poison_allocator(x)
    y = ops.softmax_forward(x, log)
    assert_close(y, reference(x, log), dtype)
    if not log:
        assert_probabilities_close(y, reference(x, log), dtype)
    dy = fresh((m, n), dtype, 1.0)
    poison_allocator(x)
    check_backward(ops.softmax_backward(y, dy, log), y, dy, log)


@pytest.mark.parametrize("grad", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 1000, 4096, 131073])
@pytest.mark.parametrize("log", [False, True])
def test_public_api_on_the_cpp_path(monkeypatch, log, n, dtype, grad):
    """softmax / log_softmax of contiguous inputs run on the C++ fast path
    (native/launch.cpp): its node is the graph's, and y and dx (over NaN-filled blocks)
    match fp64, for an upstream gradient of another dtype and layout too; the Python
    path's launch never runs."""
    monkeypatch.setattr(ops, "_softmax_forward_cuda", None)
    x = fresh((3, 11, n), dtype).requires_grad_(grad)
    poison_allocator(x)
    y = qk.log_softmax(x) if log else qk.softmax(x)
    assert_close(y, reference(x.detach(), log), dtype)
    if not grad:
        assert y.grad_fn is None
        return
    assert "SoftmaxFunction" in y.grad_fn.name(), y.grad_fn.name()
    dy = fresh((n, 3, 11), torch.float32, 1.0).permute(1, 2, 0)  # fp32, not contiguous
    poison_allocator(x, x)
    y.backward(dy)
    check_backward(x.grad, y.detach(), dy.to(dtype), log)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1 << 20, 1000000, 1000003])
def test_million_columns(n, dtype):
    """Rows of about 1M columns: 16-bit backwards with held chunks (the softmax) or dy
    staged alone (the log_softmax; 1M and the ragged 1000000 with its padded last
    chunk), the fp32 log_softmax's dy staged with a held chunk; the fp32 softmax's
    backward and the odd 1000003 re-read both."""
    x = fresh((3, n), dtype)
    dy = fresh((3, n), dtype)
    for log in (False, True):
        y = ops.softmax_forward(x, log)
        assert_close(y, reference(x, log), dtype)
        check_backward(ops.softmax_backward(y, dy, log), y, dy, log)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n", [1 << 20, 1000000])
def test_backward_of_million_column_rows(n, dtype):
    """The ops' own backward shares of rows of about 1M columns, on poisoned outputs:
    the 16-bit softmax's y and dy staged with held chunks (fp32: y alone, dy re-read), the
    log_softmax's dy staged alone (fp32: a chunk of it held) and y read in the output
    pass; y from rows with -inf entries and rows whose only finite value is the row's
    last column or the first CTA's last (in a held chunk where the share ends on the row's
    end: 1M)."""
    x = fresh((5, n), dtype)
    x[1] = -float("inf")
    x[1, n - 1] = 2.0
    x[2, ::5] = -float("inf")
    x[3] = -float("inf")
    x[3, ops.backward_config(n, dtype, log=False).cols_per_cta - 1] = -3.0
    dy = fresh((5, n), dtype)
    for log in (False, True):
        cfg = ops.backward_config(n, dtype, log=log)
        kernel = ops.backward_kernel(cfg, dtype, log)[0]
        assert (cfg.register_chunks > 0) == (dtype == torch.float32 or not log)
        assert kernel.streams_y == log
        y = ops.softmax_forward(x, log)
        dx = torch.full_like(y, float("nan"))
        ops.compile_backward(cfg, dtype, log)(y, dy, dx)
        check_backward(dx, y, dy, log)


@pytest.mark.parametrize("threads", [512, 1024])
@pytest.mark.parametrize("n, dtype", [(4097, torch.bfloat16), (262144, torch.float32),
                                      (1 << 20, torch.float32), (1 << 20, torch.bfloat16)])
def test_rows_of_16_and_32_warps(n, dtype, threads):
    """Rows of more than 8 warps (the defaults stop at 256 threads; the sweeps measured
    512 and 1024 faster for rows re-read from global memory): the block reduction over
    16 and 32 warps, registers, shared-memory and global staging."""
    eb = torch.finfo(dtype).bits // 8
    x = fresh((5, n), dtype)
    dy = fresh((5, n), dtype)
    for log in (False, True):
        fwd_cfg = row_config(n, eb, 1, max_threads_per_row=threads)
        y = torch.full_like(x, float("nan"))
        ops.compile_forward(fwd_cfg, dtype, log)(x, y)
        assert_close(y, reference(x, log), dtype)
        bwd_cfg = row_config(n, eb, 2, max_threads_per_row=threads)
        dx = torch.full_like(x, float("nan"))
        ops.compile_backward(bwd_cfg, dtype, log)(y, dy, dx)
        check_backward(dx, y, dy, log)


@pytest.mark.parametrize("n, dtype, threads", [
    (1 << 20, torch.bfloat16, None), (1000003, torch.bfloat16, None),
    (262144, torch.float32, None), (131073, torch.float16, None),
    (131080, torch.bfloat16, None), (100000, torch.bfloat16, None),
    (4097, torch.float32, None), (2048, torch.float32, 32)])
def test_register_chunks(n, dtype, threads):
    """Shares holding their last chunks in registers (RowConfig.register_chunks), on
    poisoned outputs: aligned and ragged rows (the pad past the row end, vectors of one
    value, 131080: the row ends inside a held chunk of 16-byte vectors), four rows per
    block (2048 on 32 threads: rows past M in the last block), -inf values and a row
    whose only finite value is in a held chunk; the backward (y and dy held) where its
    share is staged (not 1M and 1000003 16-bit: y and dy are re-read there)."""
    eb = torch.finfo(dtype).bits // 8

    def held(staged_tensors):
        staged = row_config(n, eb, staged_tensors, values_per_thread=8 if n < 65536 else None,
                            max_threads_per_row=threads)
        return dataclasses.replace(staged, register_chunks=max(1, staged.num_chunks // 4)), \
            staged.staging == "smem"

    fwd_cfg, _ = held(1)
    bwd_cfg, bwd_staged = held(2)
    assert fwd_cfg.staging == "smem" and fwd_cfg.smem_chunks >= 1, fwd_cfg
    assert bwd_staged == (n < 1000000)
    assert (fwd_cfg.rows_per_block > 1) == (threads is not None)
    x = fresh((5, n), dtype)
    x[1] = -float("inf")
    x[1, n - 1] = 2.0
    x[2, ::5] = -float("inf")
    dy = fresh((5, n), dtype)
    for log in (False, True):
        y = torch.full_like(x, float("nan"))
        ops.compile_forward(fwd_cfg, dtype, log)(x, y)
        assert_close(y, reference(x, log), dtype)
        if bwd_staged:
            y = ops.softmax_forward(x[3:], log)
            dx = torch.full_like(y, float("nan"))
            ops.compile_backward(bwd_cfg, dtype, log)(y, dy[3:], dx)
            check_backward(dx, y, dy[3:], log)


@pytest.mark.parametrize("n", [3000, 65536, 1 << 20])
def test_outputs_fully_written(n):
    for log in (False, True):
        x = fresh((129 if n < 65536 else 5, n), torch.bfloat16)
        poison_allocator(x)
        y = ops.softmax_forward(x, log)
        assert not torch.isnan(y).any()
        dy = fresh(x.shape, torch.bfloat16)
        poison_allocator(x)
        dx = ops.softmax_backward(y, dy, log)
        assert not torch.isnan(dx).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [100, 4096, 65536])
def test_special_values(n, dtype):
    x = fresh((7, n), torch.float32)
    x[0, ::3] = -float("inf")         # some -inf
    x[1] = 5.0                         # all equal
    # large magnitude (fp16: within its range, where an overflow to inf would change
    # the row's answer)
    x[2] *= 1e3 if dtype == torch.float16 else 1e4
    x[3] = -float("inf")               # all -inf -> nan like torch
    x[4, 17] = float("inf")            # one +inf -> nan like torch
    x[5, :n - 1] = -float("inf")       # one finite value
    x[6] = -float("inf")               # one finite value below -88.7: threads holding
    x[6, 0] = -100.0                   # only -inf must not scale by exp(0 - max) = inf
    x = x.to(dtype)
    dy = fresh((7, n), dtype, 1.0)
    for log in (False, True):
        y = ops.softmax_forward(x, log)
        assert_close(y, reference(x, log), dtype)
        check_backward(ops.softmax_backward(y, dy, log), y, dy, log)


def test_empty_and_zero_rows():
    """No rows, and rows of no columns: forward and backward give empty tensors."""
    for shape in ((0, 128), (4, 0)):
        x = torch.empty(shape, device="cuda", requires_grad=True)
        for fn in (qk.softmax, qk.log_softmax):
            y = fn(x)
            assert y.shape == shape
            (dx,) = torch.autograd.grad(y, x, torch.empty(shape, device="cuda"))
            assert dx.shape == shape


def test_non_contiguous_and_other_dims():
    x = fresh((64, 96, 48), torch.bfloat16)
    for dim in (0, 1, 2, -1):
        assert_close(qk.softmax(x, dim), reference(x, False, dim), torch.bfloat16)
    xt = fresh((512, 256), torch.float32).t()
    assert_close(qk.log_softmax(xt), reference(xt, True), torch.float32)
    xs = fresh((64, 2048), torch.float32)[:, 3:1027]  # misaligned base, strided rows
    assert_close(qk.softmax(xs), reference(xs, False), torch.float32)


def test_autograd_matches_torch():
    for dtype in DTYPES:
        x = fresh((33, 5000), dtype).requires_grad_()
        dy = fresh((33, 5000), dtype)
        (qk.softmax(x) * dy).sum().backward()
        xr = x.detach().double().requires_grad_()
        (torch.softmax(xr, -1) * dy.double()).sum().backward()
        assert_close(x.grad, xr.grad, dtype, scale=4.0, name="grad")


def test_torch_compile_fullgraph_and_dynamic():
    """A model using the module under torch.compile (inductor), static and dynamic
    shapes: outputs and the input's gradient against torch's softmax in fp64 on the
    same linear layer's output."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), qk.nn.Softmax(-1)).cuda()
    for dynamic in (False, True):
        compiled = torch.compile(model, fullgraph=True, dynamic=dynamic)
        for m in (8, 24):
            x = torch.randn(m, 256, device="cuda", requires_grad=True)
            xd = x.detach().double().requires_grad_()
            y = compiled(x)
            expected = torch.softmax(torch.nn.functional.linear(
                xd, model[0].weight.double(), model[0].bias.double()), -1)
            assert_close(y, expected, torch.float32)
            dy = torch.randn_like(y)
            y.backward(dy)
            expected.backward(dy.double())
            assert_close(x.grad, xd.grad, torch.float32, name="grad")


def test_cuda_graph_capture():
    x = fresh((256, 4096), torch.bfloat16)
    qk.softmax(x)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            y = qk.softmax(x)
    torch.cuda.current_stream().wait_stream(s)
    x.copy_(fresh((256, 4096), torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    assert_close(y, reference(x, False), torch.bfloat16)
    # the backward op, captured alike
    dy = fresh((256, 4096), torch.bfloat16, 1.0)
    ops.softmax_backward(y, dy, False)
    backward = torch.cuda.CUDAGraph()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(backward, stream=s):
            dx = ops.softmax_backward(y, dy, False)
    torch.cuda.current_stream().wait_stream(s)
    dy.copy_(fresh((256, 4096), torch.bfloat16, 1.0))
    backward.replay()
    torch.cuda.synchronize()
    check_backward(dx, y, dy, False)


def test_non_default_stream():
    x = fresh((512, 8192), torch.bfloat16)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = qk.softmax(x)
    s.synchronize()
    assert_close(y, reference(x, False), torch.bfloat16)


@pytest.mark.slow
def test_more_than_2_31_elements():
    m, n = 65537, 32768  # 2^31 + 2^15 elements, 4 GiB in bf16
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    y = qk.softmax(x)
    for rows in (slice(0, 4), slice(m - 4, m)):
        assert_close(y[rows], reference(x[rows], False), torch.bfloat16)
    del y
    y = ops.softmax_forward(x, True)
    dx = ops.softmax_backward(y, x, True)
    check_backward(dx[m - 3:], y[m - 3:], x[m - 3:], True)


@pytest.mark.parametrize("n, dtype", [(262144, torch.bfloat16), (1 << 20, torch.float32),
                                      (4096, torch.float32), (524288, torch.float32),
                                      (256, torch.float32), (262136, torch.bfloat16)])
@pytest.mark.parametrize("ahead", [1, 3])
def test_rows_prefetched_to_l2(n, dtype, ahead):
    """Shares that ask L2 for the rows ``ahead`` row blocks on (RowConfig.l2_prefetch),
    the last blocks past M (the prefetch skips them), on poisoned outputs: rows re-read
    from global memory (1M fp32), the softmax backward's share staging y alone and
    re-reading dy (524288 fp32: dy prefetched beside it), several rows per block (256) and a cluster
    whose last CTA holds less than a share (262136)."""
    if n == 524288:
        softmax_cfg = ops.backward_config(n, dtype, log=False)
        assert not ops.backward_kernel(softmax_cfg, dtype, False)[0].stages_both
    if n == 256:
        assert ops.forward_config(n, dtype).rows_per_block > 1
    x, dy = fresh((7, n), dtype), fresh((7, n), dtype)
    for log in (False, True):
        fwd_cfg = dataclasses.replace(ops.forward_config(n, dtype), l2_prefetch=ahead)
        y = torch.full_like(x, float("nan"))
        ops.compile_forward(fwd_cfg, dtype, log)(x, y)
        assert_close(y, reference(x, log), dtype)
        # (the softmax's share, run by both ops)
        bwd_cfg = dataclasses.replace(ops.backward_config(n, dtype, log=False),
                                      l2_prefetch=ahead)
        dx = torch.full_like(x, float("nan"))
        ops.compile_backward(bwd_cfg, dtype, log)(y, dy, dx)
        check_backward(dx, y, dy, log)


@pytest.fixture
def shifted_rows_on(monkeypatch):
    yield from switched(monkeypatch, "SHIFTED_ODD_ROWS", True,
                        (ops._forward_launch, ops._backward_launch))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [4095, 4097, 8191, 16385, 50257, 131073, 262143])
def test_shifted_odd_rows(n, dtype, shifted_rows_on):
    """Odd 16-bit rows read from the 16-byte boundary before each
    (config.shifted_row_share), on poisoned outputs: 25 rows (every shift), the max of
    some rows in their first or last column, dy large at the rows' edges, through the op
    and the public API (the C++ path); every third row alone (row stride 3N: every shift
    again) leaves the rows between untouched, so no store crosses a row's edge; a
    misaligned copy takes the unshifted share. 4095 and 8191: for some shifts a cluster
    CTA holds none of the row, for others the row ends on a CTA's last column. (The C++ path's plans outlive the test:
    a row length planned before it keeps its share there.)"""
    m = 25
    x = fresh((m, n), dtype)
    x[1::3, 0] = 30.0
    x[2::3, -1] = 30.0
    dy = fresh((m, n), dtype, 1.0)
    dy[:, 0] *= 40
    dy[:, -1] *= 40
    sentinel = 7.0
    for log in (False, True):
        fwd = ops.forward_config(n, dtype, 1, True)
        bwd = ops.backward_config(n, dtype, 1, True, log=log)
        assert fwd.row_shift and bwd.row_shift
        poison_allocator(x)
        y = ops.softmax_forward(x, log)
        assert_close(y, reference(x, log), dtype)
        poison_allocator(x)
        check_backward(ops.softmax_backward(y, dy, log), y, dy, log)

        leaf = x.clone().requires_grad_()
        out = (qk.log_softmax if log else qk.softmax)(leaf)
        assert_close(out, reference(x, log), dtype)
        out.backward(dy)
        check_backward(leaf.grad, out.detach(), dy, log)

        y_third = torch.full_like(x, sentinel)
        ops.compile_forward(fwd, dtype, log)(x[::3], y_third[::3])
        assert_close(y_third[::3], reference(x[::3], log), dtype)
        dx_third = torch.full_like(x, sentinel)
        ops.compile_backward(bwd, dtype, log)(y[::3], dy[::3], dx_third[::3])
        check_backward(dx_third[::3], y[::3], dy[::3], log)
        for between in (y_third, dx_third):
            untouched = torch.cat([between[1::3], between[2::3]])
            assert torch.equal(untouched, torch.full_like(untouched, sentinel))

        misaligned = torch.empty(m * n + 1, dtype=dtype, device="cuda")[1:].view(m, n)
        misaligned.copy_(x)
        assert not shiftable(misaligned)
        assert_close(ops.softmax_forward(misaligned, log), reference(x, log), dtype)
