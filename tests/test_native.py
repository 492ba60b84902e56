"""The C++ fast path (quack_kernels/native/launch.cpp) on the CPU: built, and its plumbing
driven by stand-in kernels (Python functions behind TVM-FFI handles that do the
reference math on the tensors they are handed), so that argument order, None slots,
the partial-sum views, the dy hand-over and the autograd node are checked without a GPU.
The GPU tests run the same path on the compiled kernels."""

import ctypes

import pytest
import torch

from quack_kernels import native
from quack_kernels.ops import norm as ops

tvm_ffi = pytest.importorskip("tvm_ffi")

N = 24  # row length of the stand-in plans
SUM_WIDTH, SUM_PADDED = 64, 32  # dweight at column 0 of a partial row, dbias at 32


@pytest.fixture(scope="module")
def module():
    built = native.module()
    assert built is not None, "the C++ fast path did not build (see the warning)"
    return built


def as_torch(t):
    """A torch view of a TVM-FFI tensor handed to a stand-in kernel (None stays None)."""
    if t is None:
        return None
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[str(t.dtype)]
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.strides))
    buffer = (ctypes.c_char * (extent * dtype.itemsize)).from_address(t.data_ptr())
    flat = torch.frombuffer(buffer, dtype=dtype, count=extent)
    return flat.as_strided(tuple(t.shape), tuple(t.strides))


class StandIns:
    """Forward, backward and column-sum stand-ins recording what each call got."""

    def __init__(self, rms):
        self.rms = rms
        self.calls = []
        self.functions = [tvm_ffi.convert(f) for f in (self.forward, self.backward, self.sums)]

    def handles(self):
        return [f.__chandle__() for f in self.functions]

    def forward(self, x, residual, weight, bias, y, h, mean, rstd, eps, weight_offset):
        self.calls.append(("forward", residual, h, eps, weight_offset, tuple(x.shape)))
        x, weight, bias = as_torch(x), as_torch(weight), as_torch(bias)
        ry, _, rmean, rrstd = ops.norm_reference(x, weight, bias, None, eps, weight_offset,
                                                 self.rms)
        as_torch(y).copy_(ry)
        as_torch(rstd).copy_(rrstd)
        assert (mean is None) == self.rms
        if mean is not None:
            as_torch(mean).copy_(rmean)

    def backward(self, h, dy, weight, mean, rstd, dres_out, dx, dresidual, dw_part, db_part,
                 weight_offset, grid_rows):
        self.calls.append(("backward", dres_out, dresidual, weight_offset, grid_rows,
                           dx is None, dw_part is None, db_part is None))
        dh, dw, db = ops.norm_backward_reference(as_torch(dy), as_torch(h), as_torch(weight),
                                                 as_torch(mean), as_torch(rstd), None,
                                                 weight_offset, self.rms)
        if dx is not None:
            as_torch(dx).copy_(dh)
        # the sums over rows land in the first partial row; the column sum adds them up
        for part, total in ((dw_part, dw), (db_part, db)):
            if part is not None:
                part = as_torch(part)
                part.zero_()
                part[0].copy_(total)

    def sums(self, partial, first, second):
        self.calls.append(("sums", tuple(partial.shape), second is None))
        partial = as_torch(partial)
        as_torch(first).copy_(partial[:, :N].sum(0))
        if second is not None:
            start = SUM_WIDTH - SUM_PADDED
            as_torch(second).copy_(partial[:, start:start + N].sum(0))


def register(module, stand_ins, x, weight, bias, rms, rows_per_block=2, resident=3):
    forward, backward, sums = stand_ins.handles()
    module.register_norm_plan(x, weight, bias, rms, forward, backward, sums, rows_per_block,
                              resident, SUM_WIDTH, SUM_PADDED)


@pytest.mark.parametrize("rms", [True, False])
def test_plan_runs_forward_and_backward_through_the_cpp_node(module, rms):
    x = torch.randn(5, 2, N, requires_grad=True)
    weight = torch.randn(N, requires_grad=True)
    bias = None if rms else torch.randn(N, requires_grad=True)
    stand_ins = StandIns(rms)
    assert module.norm(x, weight, bias, 1e-5, 0.25, rms) is None  # no plan yet
    register(module, stand_ins, x, weight, bias, rms)
    outputs = module.norm(x, weight, bias, 1e-5, 0.25, rms)
    y, rstd = outputs[0], outputs[-1]
    assert type(y.grad_fn).__name__ == "CppFunction" and "NormFunction" in y.grad_fn.name()
    assert not rstd.requires_grad
    ry, _, rmean, rrstd = ops.norm_reference(x.detach(), weight.detach(),
                                             None if rms else bias.detach(), None, 1e-5, 0.25, rms)
    torch.testing.assert_close(y, ry)
    torch.testing.assert_close(rstd, rrstd)
    if not rms:
        torch.testing.assert_close(outputs[1], rmean)
    # an upstream gradient of another dtype and layout is handed over as x's, contiguous
    dy = torch.randn(N, 5, 2, dtype=torch.float64).permute(1, 2, 0)
    y.backward(dy)
    dh, dw, db = ops.norm_backward_reference(dy.float(), x.detach(), weight.detach(), rmean, rrstd,
                                             None, 0.25, rms)
    torch.testing.assert_close(x.grad, dh)
    torch.testing.assert_close(weight.grad, dw)
    if not rms:
        torch.testing.assert_close(bias.grad, db)
    forward, backward, sums = stand_ins.calls
    assert forward == ("forward", None, None, 1e-5, 0.25, (10, N))
    # 10 rows in blocks of 2, at most 3 resident: a grid of 3 row blocks
    assert backward == ("backward", None, None, 0.25, 3, False, False, rms)
    assert sums == ("sums", (6, SUM_WIDTH), rms)


def test_gradients_not_asked_for_are_neither_computed_nor_returned(module):
    x = torch.randn(4, N)
    weight = torch.randn(N, requires_grad=True)
    bias = torch.randn(N)  # frozen
    stand_ins = StandIns(rms=False)
    register(module, stand_ins, x, weight, bias, False)
    y = module.norm(x, weight, bias, 1e-5, 0.0, False)[0]
    y.sum().backward()
    _, backward, sums = stand_ins.calls
    assert backward[-3:] == (True, False, True)  # no dx, dweight, no dbias
    assert sums == ("sums", (4, SUM_WIDTH), True)  # 2 row blocks of 2 rows
    _, _, mean, rstd = ops.norm_reference(x, None, None, None, 1e-5, 0.0, False)
    _, dw, _ = ops.norm_backward_reference(torch.ones_like(x), x, weight.detach(), mean, rstd,
                                           None, 0.0, False)
    torch.testing.assert_close(weight.grad, dw)


def test_inference_plan_is_apart_and_builds_no_graph(module):
    x = torch.randn(3, N, requires_grad=True)
    stand_ins = StandIns(rms=True)
    with torch.no_grad():
        assert module.norm(x, None, None, 1e-6, 0.0, True) is None  # grad plans don't serve it
        forward = stand_ins.handles()[0]
        module.register_norm_plan(x, None, None, True, forward, 0, 0, 0, 0, 0, 0)
        y, rstd = module.norm(x, None, None, 1e-6, 0.0, True)
    assert y.grad_fn is None
    torch.testing.assert_close(y, ops.norm_reference(x.detach(), None, None, None, 1e-6, 0.0,
                                                     True)[0])


def test_inputs_off_the_fast_path(module):
    x = torch.randn(6, N)
    assert module.norm_eligible(x, None, None)
    assert not module.norm_eligible(x.t(), None, None)  # non-contiguous
    assert not module.norm_eligible(x[:0], None, None)  # no rows
    assert not module.norm_eligible(x, torch.randn(N + 1), None)  # weight of another length
    assert not module.norm_eligible(x, torch.randn(2 * N)[::2], None)  # strided weight
    with pytest.raises(RuntimeError, match="take no native plan"):
        module.register_norm_plan(x.t(), None, None, True, 0, 0, 0, 0, 0, 0, 0)


def test_kernel_errors_come_back_as_python_errors(module):
    def failing(*args):
        raise ValueError("the stand-in refuses")

    x = torch.randn(2, N, dtype=torch.bfloat16)
    kernel = tvm_ffi.convert(failing)
    module.register_norm_plan(x, None, None, True, kernel.__chandle__(), 0, 0, 0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="the stand-in refuses"):
        module.norm(x, None, None, 1e-6, 0.0, True)


def test_disabled_by_the_environment(monkeypatch):
    monkeypatch.setenv("QUACK_KERNELS_NATIVE", "0")
    native.module.cache_clear()
    try:
        assert native.module() is None
    finally:
        monkeypatch.undo()
        native.module.cache_clear()


@pytest.mark.parametrize("log", [False, True])
def test_softmax_plan_runs_through_the_cpp_node(module, log):
    from quack_kernels.ops.softmax import softmax_backward_reference, softmax_reference

    calls = []

    def forward(x, y):
        calls.append(("forward", tuple(x.shape), tuple(y.shape)))
        as_torch(y).copy_(softmax_reference(as_torch(x), log))

    def backward(y, dy, dx):
        calls.append(("backward", tuple(dy.shape)))
        as_torch(dx).copy_(softmax_backward_reference(as_torch(y), as_torch(dy), log))

    kernels = [tvm_ffi.convert(f) for f in (forward, backward)]
    n = 40 + log  # plans outlive a test: a row length of each test's own
    x = torch.randn(4, 3, n, requires_grad=True)
    assert module.softmax(x, log) is None
    module.register_softmax_plan(x, log, *(k.__chandle__() for k in kernels))
    assert module.softmax(x, not log) is None  # the other function has its own plan
    y = module.softmax(x, log)
    assert type(y.grad_fn).__name__ == "CppFunction" and "SoftmaxFunction" in y.grad_fn.name()
    torch.testing.assert_close(y, softmax_reference(x.detach(), log))
    dy = torch.randn(n, 4, 3, dtype=torch.float64).permute(1, 2, 0)
    y.backward(dy)
    torch.testing.assert_close(x.grad, softmax_backward_reference(y.detach(), dy.float(), log))
    assert calls == [("forward", (12, n), (12, n)), ("backward", (12, n))]
    assert not module.softmax_eligible(x.transpose(0, 1))
