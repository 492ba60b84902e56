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
NO_KERNEL = [0, 0, 0]  # (handle, ...) of a kernel a plan does not have
NO_BACKWARD = [0, 0, 0, 1]  # ... of a norm backward it does not have


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
        self.calls.append(("forward", residual is None, h is None, eps, weight_offset,
                           tuple(x.shape)))
        x, weight, bias = as_torch(x), as_torch(weight), as_torch(bias)
        ry, rh, rmean, rrstd = ops.norm_reference(x, weight, bias, as_torch(residual), eps,
                                                  weight_offset, self.rms)
        as_torch(y).copy_(ry)
        as_torch(rstd).copy_(rrstd)
        if h is not None:
            as_torch(h).copy_(rh)
        assert (mean is None) == self.rms
        if mean is not None:
            as_torch(mean).copy_(rmean)

    def backward(self, h, dy, weight, mean, rstd, dres_out, dx, dresidual, dw_part, db_part,
                 weight_offset, grid_rows):
        self.calls.append(("backward", dres_out is None, dresidual is None, weight_offset,
                           grid_rows, dx is None, dw_part is None, db_part is None))
        dh, dw, db = ops.norm_backward_reference(as_torch(dy), as_torch(h), as_torch(weight),
                                                 as_torch(mean), as_torch(rstd),
                                                 as_torch(dres_out), weight_offset, self.rms)
        for out in (dx, dresidual):
            if out is not None:
                as_torch(out).copy_(dh)
        # the sums over rows land in the first partial row; the column sum adds them up
        for part, total in ((dw_part, dw), (db_part, db)):
            if part is not None:
                part = as_torch(part)
                part.zero_()
                part[0].copy_(total)

    def sums(self, partial, first, second):
        self.calls.append(("sums", tuple(partial.shape), second is None))
        partial, n = as_torch(partial), first.shape[0]
        as_torch(first).copy_(partial[:, :n].sum(0))
        if second is not None:
            start = SUM_WIDTH - SUM_PADDED
            as_torch(second).copy_(partial[:, start:start + n].sum(0))


def register(module, stand_ins, x, weight, bias, rms, rows_per_block=2, resident=3,
             residual=None, prenorm=False, shift_classes=1):
    """A plan of the stand-ins; its backward with the stream's gradient (prenorm) runs
    row blocks of one row, at most 5 resident."""
    forward, backward, sums = stand_ins.handles()
    module.register_norm_plan(x, weight, bias, residual, None, rms, prenorm, forward,
                              [backward, rows_per_block, resident, shift_classes],
                              [backward, 1, 5, 1], [sums, SUM_WIDTH, SUM_PADDED])


def norm(module, x, weight, bias, eps, weight_offset, rms, residual=None, prenorm=False):
    return module.norm(x, weight, bias, residual, None, eps, weight_offset, rms, prenorm)


@pytest.mark.parametrize("rms, shift_classes, rows_per_block, resident, grid, partial_rows", [
    (True, 1, 2, 3, 3, 6), (False, 1, 2, 3, 3, 6), (True, 8, 2, 3, 3, 6 + 7),
    (False, 8, 1, 8, 8, 8 + 7)])
def test_plan_runs_forward_and_backward_through_the_cpp_node(
        module, rms, shift_classes, rows_per_block, resident, grid, partial_rows):
    """10 rows in blocks of ``rows_per_block``, at most ``resident`` blocks: a grid of
    ``grid``. ``shift_classes``: a shifted backward's (config.partial_sum_rows: a
    partial row per CTA and class, 7 more than the CTAs); its x one value off 16 bytes,
    a plan of its own."""
    x = torch.randn(5, 2, N, requires_grad=True)
    if shift_classes > 1:
        x = torch.randn(10 * N + 1)[1:].view(5, 2, N).requires_grad_()
    weight = torch.randn(N, requires_grad=True)
    bias = None if rms else torch.randn(N, requires_grad=True)
    stand_ins = StandIns(rms)
    assert norm(module, x, weight, bias, 1e-5, 0.25, rms) is None  # no plan yet
    register(module, stand_ins, x, weight, bias, rms, rows_per_block=rows_per_block,
             resident=resident, shift_classes=shift_classes)
    outputs = norm(module, x, weight, bias, 1e-5, 0.25, rms)
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
    assert forward == ("forward", True, True, 1e-5, 0.25, (10, N))
    assert backward == ("backward", True, True, 0.25, grid, False, False, rms)
    assert sums == ("sums", (partial_rows, SUM_WIDTH), rms)


def test_gradients_not_asked_for_are_neither_computed_nor_returned(module):
    x = torch.randn(4, N)
    weight = torch.randn(N, requires_grad=True)
    bias = torch.randn(N)  # frozen
    stand_ins = StandIns(rms=False)
    register(module, stand_ins, x, weight, bias, False)
    y = norm(module, x, weight, bias, 1e-5, 0.0, False)[0]
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
        assert norm(module, x, None, None, 1e-6, 0.0, True) is None  # grad plans don't serve
        forward = stand_ins.handles()[0]
        module.register_norm_plan(x, None, None, None, None, True, False, forward, NO_BACKWARD,
                                  NO_BACKWARD, NO_KERNEL)
        y, rstd = norm(module, x, None, None, 1e-6, 0.0, True)
    assert y.grad_fn is None
    torch.testing.assert_close(y, ops.norm_reference(x.detach(), None, None, None, 1e-6, 0.0,
                                                     True)[0])


def test_inputs_off_the_fast_path(module):
    x = torch.randn(6, N)
    assert module.norm_eligible(x, None, None, None)
    assert not module.norm_eligible(x.t(), None, None, None)  # non-contiguous
    assert not module.norm_eligible(x[:0], None, None, None)  # no rows
    assert not module.norm_eligible(x, torch.randn(N + 1), None, None)  # another length
    assert not module.norm_eligible(x, torch.randn(2 * N)[::2], None, None)  # strided
    assert not module.norm_eligible(x, None, None, torch.randn(3, N))  # residual's shape
    with pytest.raises(RuntimeError, match="take no native plan"):
        module.register_norm_plan(x.t(), None, None, None, None, True, False, 0, NO_BACKWARD,
                                  NO_BACKWARD, NO_KERNEL)


@pytest.mark.parametrize("raised,expected", [(ValueError, ValueError), (TypeError, TypeError),
                                             (KeyError, RuntimeError)])
def test_kernel_errors_come_back_as_python_errors(module, raised, expected):
    """A kernel's argument checks raise TypeError / ValueError on the Python path; the C++
    path raises the same kinds (others as RuntimeError), with the message."""
    def failing(*args):
        raise raised("the stand-in refuses")

    x = torch.randn(2, 10 + len(raised.__name__), dtype=torch.bfloat16)  # a plan each
    kernel = tvm_ffi.convert(failing)
    module.register_norm_plan(x, None, None, None, None, True, False, kernel.__chandle__(),
                              NO_BACKWARD, NO_BACKWARD, NO_KERNEL)
    with pytest.raises(expected, match="the stand-in refuses"):
        norm(module, x, None, None, 1e-6, 0.0, True)


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


class CrossEntropyStandIns:
    """The cross-entropy step's kernels as reference math: the mean's denominator, the
    loss + gradient (loss reduced over the rows), the gradient's rescale."""

    def __init__(self, softcap=False):
        self.softcap = softcap  # (a compile-time switch: the value is read only if on)
        self.calls = []
        self.functions = [tvm_ffi.convert(f) for f in (self.denominator, self.forward,
                                                       self.rescale)]

    def handles(self):
        return [f.__chandle__() for f in self.functions]

    def denominator(self, target, weight_slot, out, partials, ignore_index, ctas):
        # (the partials buffer is shared and only grows: its words are at least those asked)
        self.calls.append(("denominator", ctas, partials.shape[0]))
        count = (as_long(target) != ignore_index).sum().float()
        as_torch(out).copy_(torch.stack((count, 1 / count)))

    def forward(self, logits, target, weight_slot, loss, row_weight, lse, grad, grad_scale,
                reduced, partials, ignore_index, smoothing, zloss, softcap, grid_rows):
        from quack_kernels.ops.cross_entropy import cross_entropy_reference

        self.calls.append(("forward", tuple(grad_scale.strides), partials.shape[0],
                           smoothing, zloss, softcap, grid_rows))
        target = as_long(target)
        scale = as_torch(grad_scale)
        rloss, rlse, rgrad = cross_entropy_reference(as_torch(logits), target, None,
                                                     ignore_index, smoothing, zloss,
                                                     softcap if self.softcap else 0.0, True,
                                                     scale.contiguous())
        kept = (target != ignore_index).float()
        as_torch(loss).copy_(rloss)
        as_torch(row_weight).copy_(kept)
        as_torch(lse).copy_(rlse)
        as_torch(grad).copy_(rgrad)
        # a mean's rows are scaled by 1 / D: the reduced loss is the mean over kept rows
        total = rloss.sum() * (scale[0] if scale[0] != 1 else 1.0)
        as_torch(reduced).copy_(total.reshape(1))

    def rescale(self, grad, out, target, dloss, held, ignore_index, grid_rows):
        self.calls.append(("rescale", tuple(dloss.strides), tuple(held.strides), grid_rows))
        factor = as_torch(dloss) / as_torch(held)
        kept = as_long(target) != ignore_index
        as_torch(out).mul_(torch.where(kept, factor, 1.0)[:, None])


def as_long(t):
    """A TVM-FFI int64 vector as a torch tensor."""
    buffer = (ctypes.c_char * (t.shape[0] * 8)).from_address(t.data_ptr())
    return torch.frombuffer(buffer, dtype=torch.int64, count=t.shape[0])


@pytest.mark.parametrize("mean", [True, False])
def test_cross_entropy_step_through_the_cpp_node(module, mean):
    import torch.nn.functional as F

    n = 50 + mean
    logits = torch.randn(6, n, requires_grad=True)
    target = torch.randint(0, n, (6,))
    target[2] = -100
    stand_ins = CrossEntropyStandIns()
    options = (-100, 0.0, 0.0, 0.0, mean)
    assert module.cross_entropy(logits, target, *options) is None
    denominator, forward, rescale = stand_ins.handles()
    unit = torch.ones(())
    # 2 rows per block, 2 resident row blocks; grid sums of 2 values per block + 10;
    # denominator CTAs of 4 targets, at most 8, + 3 words; rescale 1 row per block, 4
    sizes = [2, 2, 2, 10, 4, 8, 3, 1, 4]
    module.register_cross_entropy_plan(logits, target, mean, 0.0, 0.0, 0.0,
                                       denominator if mean else 0, forward, rescale, unit, sizes)
    loss, lse = module.cross_entropy(logits, target, *options)
    assert "CrossEntropyFunction" in loss.grad_fn.name() and not lse.requires_grad
    reduction = "mean" if mean else "sum"
    reference = logits.detach().clone().requires_grad_()
    ref_loss = F.cross_entropy(reference, target, reduction=reduction)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(lse, torch.logsumexp(logits.detach(), -1))
    (3 * loss).backward()  # an upstream gradient of 3: every kept row rescaled
    (3 * ref_loss).backward()
    torch.testing.assert_close(logits.grad, reference.grad)
    calls = stand_ins.calls
    if mean:  # 6 targets, 4 per CTA: 2 CTAs, 2 + 3 words
        name, ctas, words = calls.pop(0)
        assert (name, ctas) == ("denominator", 2) and words >= 5
    # the gradient's scale broadcast to every row; a looping grid of 2 row blocks:
    # partials of 2 * 2 + 10 words
    (name, scale_strides, words, *options), rescale = calls
    assert (name, scale_strides, words >= 14, *options) == ("forward", (0,), True, 0.0, 0.0,
                                                            1.0, 2)
    assert rescale == ("rescale", (0,), (0,), 4)


def test_cross_entropy_retained_graph_keeps_its_gradient(module):
    logits = torch.randn(4, 48, requires_grad=True)
    target = torch.randint(0, 48, (4,))
    stand_ins = CrossEntropyStandIns(softcap=True)
    options = (-100, 0.0, 0.0, 30.0, False)  # a softcap: a plan of its own
    _, forward, rescale = stand_ins.handles()
    module.register_cross_entropy_plan(logits, target, False, 0.0, 0.0, 30.0, 0, forward,
                                       rescale, torch.ones(()), [4, 0, 2, 10, 4, 8, 3, 1, 4])
    loss, _ = module.cross_entropy(logits, target, *options)
    loss.backward(torch.tensor(2.0), retain_graph=True)
    first = logits.grad.clone()
    loss.backward(torch.tensor(2.0))
    torch.testing.assert_close(logits.grad, 2 * first)
    assert stand_ins.calls[0][-2:] == (30.0, 4)  # |softcap|; one row block per CTA: grid M


def test_cross_entropy_gradient_with_create_graph_is_once_differentiable(module):
    logits = torch.randn(3, 44, requires_grad=True)
    target = torch.randint(0, 44, (3,))
    stand_ins = CrossEntropyStandIns()
    _, forward, rescale = stand_ins.handles()
    module.register_cross_entropy_plan(logits, target, False, 0.0, 0.0, 0.0, 0, forward,
                                       rescale, torch.ones(()), [4, 0, 2, 10, 4, 8, 3, 1, 4])
    loss, _ = module.cross_entropy(logits, target, -100, 0.0, 0.0, 0.0, False)
    upstream = torch.tensor(0.5, requires_grad=True)
    (grad,) = torch.autograd.grad(loss, logits, upstream, create_graph=True)
    reference = logits.detach().clone().requires_grad_()
    torch.nn.functional.cross_entropy(reference, target, reduction="sum").backward()
    torch.testing.assert_close(grad, 0.5 * reference.grad)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.sum().backward()


def test_saved_tensor_changed_by_a_hook_is_refused(module):
    x = torch.randn(4, 45, requires_grad=True)
    stand_ins = StandIns(rms=True)
    register(module, stand_ins, x, None, None, True, rows_per_block=1, resident=4)
    # an unpack hook that hands back a transposed copy's transpose: same values, new strides
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t.t().contiguous().t()):
        y, _ = norm(module, x, None, None, 1e-6, 0.0, True)
    with pytest.raises(RuntimeError, match="expects a contiguous tensor"):
        y.sum().backward()


def test_prenorm_residual_stream_and_its_gradient(module):
    """With a residual and prenorm: the stored stream h = x + residual is an output, the
    backward reads it instead of x, and with h's own gradient the plan's second backward
    variant runs (rows of 1 per block here) and dh joins dx and dresidual."""
    x = torch.randn(5, 40, requires_grad=True)
    residual = torch.randn(5, 40, requires_grad=True)
    weight = torch.randn(40, requires_grad=True)
    stand_ins = StandIns(rms=True)
    register(module, stand_ins, x, weight, None, True, residual=residual, prenorm=True)
    y, h, rstd = norm(module, x, weight, None, 1e-6, 0.0, True, residual, prenorm=True)
    torch.testing.assert_close(h, x.detach() + residual.detach())
    assert h.requires_grad and not rstd.requires_grad
    dy, dh = torch.randn(5, 40), torch.randn(5, 40)
    torch.autograd.backward([y, h], [dy, dh])
    hd = (x.detach() + residual.detach()).requires_grad_()
    wd = weight.detach().clone().requires_grad_()
    yd = torch.nn.functional.rms_norm(hd, (40,), wd, eps=1e-6)
    torch.autograd.backward([yd, hd], [dy, dh])
    torch.testing.assert_close(x.grad, hd.grad)
    torch.testing.assert_close(residual.grad, hd.grad)
    torch.testing.assert_close(weight.grad, wd.grad)
    forward, backward, _ = stand_ins.calls
    assert forward[:3] == ("forward", False, False)  # the residual read, h stored
    # dh given, dx and dresidual written; the stream variant's grid: 5 row blocks of 1
    assert backward[:3] == ("backward", False, False) and backward[4] == 5


def test_residual_without_prenorm_has_a_plan_of_its_own(module):
    """A residual without prenorm: the stream is stored for the backward (an output of
    the node the Python layer drops), no variant with its gradient is compiled, and a
    prenorm call of the same tensors needs a plan of its own."""
    x = torch.randn(3, 41, requires_grad=True)
    residual = torch.randn(3, 41)
    stand_ins = StandIns(rms=True)
    forward, backward, sums = stand_ins.handles()
    module.register_norm_plan(x, None, None, residual, None, True, False, forward,
                              [backward, 1, 3, 1], NO_BACKWARD, NO_KERNEL)
    assert norm(module, x, None, None, 1e-6, 0.0, True, residual, prenorm=True) is None
    y, h, _ = norm(module, x, None, None, 1e-6, 0.0, True, residual)
    torch.testing.assert_close(h, x.detach() + residual)
    y.sum().backward()
    hd = (x.detach() + residual).requires_grad_()
    torch.nn.functional.rms_norm(hd, (41,), eps=1e-6).sum().backward()
    torch.testing.assert_close(x.grad, hd.grad)
    assert stand_ins.calls[1][1] is True  # no stream gradient passed


def test_grid_sizes_match_the_python_configs(module):
    """The C++ path sizes the looping grids and the mean's denominator grid with one
    formula (capped_blocks) that copies config.loop_grid_rows and
    config.mean_denominator_ctas: the same counts for every row count tried."""
    from quack_kernels.primitives import config

    cfg = ops.forward_config(256, True, torch.bfloat16, torch.bfloat16, False, torch.bfloat16,
                             torch.bfloat16, None)
    assert cfg.rows_per_block > 1
    per_cta = config.MEAN_DENOMINATOR_THREADS * config.MEAN_TARGETS_IN_FLIGHT
    for num_rows in (0, 1, 2, 7, 127, 128, 129, 1000, 4097, per_cta, per_cta + 1, 10**6, 10**9):
        for resident in (1, 3, 132, 264):
            assert module.capped_blocks(num_rows, cfg.rows_per_block, resident) == \
                config.loop_grid_rows(cfg, num_rows, resident), (num_rows, resident)
        assert module.capped_blocks(num_rows, per_cta, config.MEAN_DENOMINATOR_MAX_CTAS) == \
            config.mean_denominator_ctas(num_rows), num_rows
