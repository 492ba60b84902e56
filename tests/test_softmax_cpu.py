"""CPU checks for softmax: reference math, op registration, fake kernels, autograd
formulas, error messages, and compiling the kernels for sm_90a."""

import re

import pytest
import torch
from torch.library import opcheck

import quack_kernels as qk
from quack_kernels.ops import softmax as ops
from quack_kernels.report import measure, spills

from helpers import assert_close, compiled_sass


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("log", [False, True])
def test_reference_matches_torch_fp64(dtype, log):
    x = (torch.randn(17, 301) * 4).to(dtype)
    expected = (torch.log_softmax if log else torch.softmax)(x.double(), -1)
    assert_close(ops.softmax_forward(x, log), expected, dtype)


@pytest.mark.parametrize("log", [False, True])
def test_backward_reference_matches_autograd(log):
    x = torch.randn(9, 130, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(9, 130, dtype=torch.float64)
    y = (torch.log_softmax if log else torch.softmax)(x, -1)
    (gx,) = torch.autograd.grad(y, x, dy)
    assert_close(ops.softmax_backward_reference(y.detach(), dy, log).double(), gx, torch.float32)


@pytest.mark.parametrize("log", [False, True])
def test_opcheck(log):
    x = torch.randn(5, 33, requires_grad=True)
    opcheck(torch.ops.quack_kernels.softmax_forward.default, (x, log))
    y = ops.softmax_forward(x.detach(), log)
    opcheck(torch.ops.quack_kernels.softmax_backward.default, (y, torch.randn(5, 33), log))


def test_gradcheck_cpu_path():
    x = torch.randn(4, 11, dtype=torch.float32, requires_grad=True)
    for fn in (qk.softmax, qk.log_softmax):
        # fp32 op: loose finite-difference tolerances
        assert torch.autograd.gradcheck(lambda t: fn(t, -1), (x,), eps=1e-3, atol=2e-3, rtol=1e-2)


def test_public_api_dims_and_module():
    x = torch.randn(3, 4, 5)
    for dim in (0, 1, 2, -1, -3):
        assert_close(qk.softmax(x, dim), torch.softmax(x.double(), dim), torch.float32)
        assert_close(qk.log_softmax(x, dim), torch.log_softmax(x.double(), dim), torch.float32)
    assert_close(qk.nn.Softmax(1)(x), torch.nn.Softmax(1)(x).double(), torch.float32)
    assert_close(qk.nn.LogSoftmax()(x), torch.nn.LogSoftmax(-1)(x).double(), torch.float32)
    assert qk.softmax(torch.empty(0, 8)).shape == (0, 8)


def test_fake_kernel_shapes_under_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(6, 7, 8, dtype=torch.bfloat16)
        y = torch.ops.quack_kernels.softmax_forward(x, False)
        assert y.shape == x.shape and y.dtype == x.dtype
        dx = torch.ops.quack_kernels.softmax_backward(y, y, True)
        assert dx.shape == x.shape


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph_cpu(dynamic):
    """torch.compile(fullgraph=True) through AOT autograd (the ops' autograd traced), with
    static and dynamic shapes (two row counts): values and gradients against torch's own
    softmax / log_softmax in fp64."""
    def model(t):
        return qk.log_softmax(qk.softmax(t * 2, -1), 0)

    def reference(t):
        return torch.log_softmax(torch.softmax(t * 2, -1), 0)

    fn = torch.compile(model, fullgraph=True, backend="aot_eager", dynamic=dynamic)
    for rows in (4, 6):
        x = torch.randn(rows, 9, requires_grad=True)
        xd = x.detach().double().requires_grad_()
        y, expected = fn(x), reference(xd)
        assert_close(y, expected, torch.float32)
        dy = torch.randn_like(y)
        y.backward(dy)
        expected.backward(dy.double())
        assert_close(x.grad, xd.grad, torch.float32, name="grad")


def test_rejects_gpus_older_than_hopper(monkeypatch):
    """A CUDA tensor on a GPU below sm_90 gets an error naming the GPU and its arch
    (checked with a stand-in device: there is no GPU here)."""
    from types import SimpleNamespace

    from quack_kernels.ops import common

    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(common, "_capability", lambda index: (8, 0))
    with pytest.raises(RuntimeError, match=r"compute capability 9\.0.*NVIDIA A100 is sm_80"):
        common.check_gpu(on_gpu)
    monkeypatch.setattr(common, "_capability", lambda index: (9, 0))
    common.check_gpu(on_gpu)


@pytest.mark.parametrize("bad", [torch.float64, torch.int32])
def test_rejects_unsupported_dtypes(bad):
    with pytest.raises(TypeError, match="supported dtypes are"):
        qk.softmax(torch.ones(3, 4, dtype=bad))


def test_rejects_bad_dim_and_non_tensor():
    with pytest.raises(IndexError, match="out of range"):
        qk.softmax(torch.ones(3, 4), dim=2)
    # a 0-d tensor takes dim -1 or 0, as torch's
    assert qk.log_softmax(torch.tensor(2.0), 0).item() == 0.0
    with pytest.raises(IndexError, match="out of range"):
        qk.softmax(torch.tensor(1.0), 3)
    with pytest.raises(TypeError, match="dim must be an int"):
        qk.nn.Softmax(None)(torch.ones(3, 4))
    with pytest.raises(TypeError, match="torch.Tensor"):
        qk.softmax([1.0, 2.0])


def test_backward_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="one shape, dtype and device"):
        ops.softmax_backward(torch.ones(3, 4), torch.ones(3, 5), False)


@pytest.mark.parametrize("n", [1, 7, 4097, 262144, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_compile_for_sm90a_without_spills(n, dtype, tmp_path, cuobjdump):
    fwd = ops.forward_config(n, dtype)
    bwd, log_bwd = (ops.backward_config(n, dtype, log=log) for log in (False, True))
    variants = [("fwd", n, dtype, fwd, lambda: ops.forward_kernel(fwd, dtype, True)),
                ("bwd", n, dtype, bwd, lambda: ops.backward_kernel(bwd, dtype, False)),
                ("log bwd", n, dtype, log_bwd, lambda: ops.backward_kernel(log_bwd, dtype, True))]
    for name, _, _, cfg, kernel, res in measure(variants, str(tmp_path), cuobjdump):
        assert spills(res) == 0, f"{name} n={n}: {res}"
        # (a CTA fits an SM: its registers and shared memory)
        assert res["regs"] * cfg.threads_per_block <= 65536, f"{name} n={n}: {res}"
        assert kernel.smem_bytes() <= 227 * 1024


@pytest.mark.parametrize("n, dtype", [(4097, torch.float16), (50257, torch.bfloat16),
                                      (262143, torch.bfloat16)])
def test_shifted_odd_rows_take_16_byte_accesses(n, dtype, tmp_path, cuobjdump):
    """Odd 16-bit rows read from the 16-byte boundary before each
    (config.shifted_row_share): every staged vector is one 16-byte cp.async and every
    vector store but the row's two edges' one 16-byte store, with no 2-byte global
    load, no spill; the edges' values are stored one by one (2-byte stores). Rows that
    may not be shifted keep 2-byte loads (the contrast the test relies on)."""
    def sass_of(kernel_and_fakes):
        return compiled_sass(kernel_and_fakes, tmp_path, cuobjdump)

    fwd = ops.forward_config(n, dtype, 1, True)
    builds = [(fwd, 1, ops.forward_kernel(fwd, dtype, log)) for log in (False, True)]
    for log in (False, True):
        bwd = ops.backward_config(n, dtype, 1, True, log=log)
        builds.append((bwd, 2, ops.backward_kernel(bwd, dtype, log)))
    for cfg, staged, kernel_and_fakes in builds:
        assert cfg.row_shift
        usage, sass = sass_of(kernel_and_fakes)
        assert usage["stack"] == 0 and usage["local"] == 0, usage
        vectors = cfg.num_chunks * cfg.vecs_per_thread
        assert len(re.findall(r"\bLDGSTS\.E\.128\b", sass)) == staged * vectors
        # (ptxas drops the stores of vectors that start past every shift's row end)
        assert 0 < len(re.findall(r"\bSTG\.E\.128\b", sass)) <= vectors
        assert 0 < len(re.findall(r"\bSTG\.E\.U16\b", sass)) <= vectors * cfg.vec
        assert not re.findall(r"\bLDG\.E\.U16\b", sass)
    unshifted = ops.forward_config(n, dtype, 1, False)
    _, sass = sass_of(ops.forward_kernel(unshifted, dtype, False))
    assert re.findall(r"\bLDG\.E\.U16\b", sass)


def test_backward_stages_one_tensor_where_both_would_be_re_read():
    """Rows whose y and dy would both be re-read from global memory but whose one tensor
    fits a share in shared memory stage that one (the log_softmax of bf16 1M columns:
    dy, y read once in the output pass; the softmax of fp32 524288: y, dy re-read; the
    log_softmax of fp32 1M: dy, a chunk of it held in registers); rows where both fit
    stage both, and rows where neither fits re-read both."""
    from quack_kernels.kernels.softmax import SoftmaxBackward
    from quack_kernels.ops.common import cutlass_dtype
    from quack_kernels.primitives.config import SMEM_BYTES_PER_CTA

    def kernel(n, dtype, log):
        cfg = ops.backward_config(n, dtype, log=log)
        dt = cutlass_dtype(dtype)
        return cfg, SoftmaxBackward(cfg, dt, log)

    for n, dtype, log in ((1 << 20, torch.bfloat16, True), (524288, torch.float32, False),
                          (1 << 20, torch.float32, True)):  # (the last with a held chunk)
        cfg, alone = kernel(n, dtype, log)
        assert cfg.staging == "smem" and not alone.stages_both
        assert alone.streams_y == log and len(alone.staged_dtypes) == 1
        assert alone.smem_bytes() <= SMEM_BYTES_PER_CTA
    cfg, both = kernel(262144, torch.float32, True)
    assert cfg.staging == "smem" and both.stages_both and len(both.staged_dtypes) == 2
    cfg, neither = kernel(1 << 21, torch.float32, True)
    assert cfg.staging == "global" and neither.stages_both and not neither.streams_y


def test_16bit_softmax_backward_of_a_million_columns_holds_chunks():
    """config.held_share: the 16-bit softmax backward of rows whose y and dy would be
    re-read stages both on 512-thread shares, its last chunks in registers so the rest
    fits STAGING_SMEM_BYTES; the log_softmax backward stages dy alone, fp32 softmax
    rows y alone on chunks of Y_SHARE_VALUES (dy re-read in both passes), odd rows
    (2-byte vectors) keep theirs."""
    from quack_kernels.primitives import config

    for dtype in (torch.bfloat16, torch.float16):
        for n in (1 << 20, 1000000):  # (1000000: the padded last chunk, held)
            cfg = ops.backward_config(n, dtype, log=False)
            assert (cfg.threads_per_row, cfg.register_chunks) == (512, 2)
            assert cfg.staging == "smem" and cfg.cols_covered >= n
            assert cfg.staging_smem_bytes(4) <= config.STAGING_SMEM_BYTES
            held_bytes = cfg.register_chunks * cfg.thread_values_per_chunk * 4
            assert held_bytes <= config.HELD_CHUNK_BYTES_PER_THREAD
            assert ops.backward_config(n, dtype, log=True).register_chunks == 0
    for n in (1 << 20, 1000000, 800000, 524288):
        cfg = ops.backward_config(n, torch.float32, log=False)
        kernel = ops.backward_kernel(cfg, torch.float32, False)[0]
        assert (cfg.threads_per_row, cfg.vec * cfg.vecs_per_thread, cfg.staging) == \
            (config.HELD_SHARE_THREADS, config.Y_SHARE_VALUES, "smem"), (n, cfg)
        assert kernel.streams_dy and cfg.staging_smem_bytes(4) <= config.STAGING_SMEM_BYTES
    assert ops.backward_config(1600000, torch.float32, log=False).staging == "global"
    assert ops.backward_config(1000003, torch.bfloat16, log=False).register_chunks == 0
    assert ops.backward_config(262144, torch.bfloat16, log=False) == ops.backward_config(
        262144, torch.bfloat16, log=True)  # both fit: the held share is not asked
