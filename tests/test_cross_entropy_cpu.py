"""Cross-entropy on CPU (CI): the reference against torch for every option, the custom
ops (opcheck, fake kernels, gradcheck), errors, and the sm_90a compile with no spills."""

import itertools
import math
import re

import pytest
import torch
import torch.nn.functional as F

import quack_kernels as qk
from quack_kernels.ops import cross_entropy as ops
from quack_kernels.ops import rescale
from quack_kernels.primitives import config
from quack_kernels.report import measure, spills

from helpers import (
    assert_close,
    assert_looping_launch_fits,
    check_cross_entropy_backward_paths,
    check_plain_backward_rescales_no_row,
    compiled_sass,
    torch_cross_entropy,
)

OPTIONS = dict(
    weighted=[False, True],
    label_smoothing=[0.0, 0.1],
    lse_square_scale=[0.0, 1e-3],
    softcap=[None, 5.0],
    reduction=["none", "sum", "mean"],
)
COMBOS = [dict(zip(OPTIONS, values)) for values in itertools.product(*OPTIONS.values())]


def make_case(m=29, v=37, dtype=torch.float64, ignore_every=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, v, generator=g, dtype=dtype) * 3
    target = torch.randint(0, v, (m,), generator=g)
    target[::ignore_every] = -100
    # a confident row: the target logit 10 above the max
    x[1, target[1]] = x[1].max() + 10
    weight = torch.rand(v, generator=g, dtype=dtype) + 0.5
    return x, target, weight


@pytest.mark.parametrize("combo", COMBOS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_public_function_matches_torch(combo):
    combo = dict(combo)
    x, target, weight = make_case()
    weight = weight if combo.pop("weighted") else None
    ours_x = x.clone().requires_grad_()
    ref_x = x.clone().requires_grad_()
    ours = qk.cross_entropy(ours_x, target, weight, **combo)
    ref = torch_cross_entropy(ref_x, target, weight, **combo)
    assert_close(ours, ref, torch.float32, name="loss")
    # a non-uniform upstream gradient, and the loss used twice
    upstream = torch.rand_like(ref) + 0.5
    ((ours * upstream).sum() + ours.sum()).backward()
    ((ref * upstream).sum() + ref.sum()).backward()
    assert_close(ours_x.grad, ref_x.grad, torch.float32, name="grad")


def test_fake_tensors_leave_no_cached_unit(monkeypatch):
    """The cached 1 the gradient is computed for (ops.unit_scale) is made and handed out only
    for plain eager calls: under FakeTensorMode (tracing, meta analyses) a fake CUDA 1 is
    made afresh, neither cached for later real calls nor taken from the cache."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    real = torch.ones(())  # stands in for a cached CUDA 1 (this machine has no GPU)
    monkeypatch.setattr(ops, "_units", {(torch.float32, 0): real})
    with FakeTensorMode():
        unit = ops.unit_scale(torch.float32, torch.device("cuda", 0))
        fresh = ops.unit_scale(torch.bfloat16, torch.device("cuda", 0))
    assert isinstance(unit, FakeTensor) and unit.device.type == "cuda"
    assert isinstance(fresh, FakeTensor)
    assert ops._units == {(torch.float32, 0): real}


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_create_graph_gives_the_gradient_and_refuses_a_second_order(reduction):
    """backward with create_graph=True and an upstream gradient that itself requires
    grad: the first-order gradient as torch's, and differentiating it again raises (the
    fused gradient is not differentiable) instead of a silent None or a wrong second
    derivative."""
    x, target, _ = make_case()
    ours_x, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, ref = qk.cross_entropy(ours_x, target, reduction=reduction), \
        F.cross_entropy(ref_x, target, reduction=reduction)
    upstream = (torch.rand_like(ref) + 0.5).requires_grad_()
    (grad,) = torch.autograd.grad(ours, ours_x, upstream, create_graph=True)
    (ref_grad,) = torch.autograd.grad(ref, ref_x, upstream)
    assert_close(grad, ref_grad, torch.float32, name="grad")
    with pytest.raises(RuntimeError, match="once_differentiable"):
        grad.square().sum().backward()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("inplace", [False, True])
def test_backward_paths_match_torch(reduction, weighted, inplace):
    """The expected upstream gradient (plain backward: nothing to rescale), a scaled
    loss (every row rescaled), and a retained graph run backward twice."""
    x, target, weight = make_case()
    weight = weight if weighted else None
    ref_x = x.clone().requires_grad_()
    F.cross_entropy(ref_x, target, weight, reduction=reduction).backward()
    check_cross_entropy_backward_paths(x, target, weight, reduction, inplace, ref_x.grad,
                                       torch.float32, loss_scale=0.37, reuse_scale=2.0)


def test_rescale_grad_op():
    """Rows whose upstream gradient differs from the held one are scaled; matching,
    ignored and bad-target rows are left alone; a held 0 cannot be undone (NaN)."""
    g = torch.Generator().manual_seed(1)
    grad = torch.randn(6, 9, generator=g)
    target = torch.tensor([1, -100, 3, 4, 20, 0])
    held = torch.tensor([0.5, 0.5, 0.5, 0.0, 0.5, 0.5])
    dloss = torch.tensor([0.5, 2.0, 1.5, 1.0, 3.0, 0.0])
    out = grad.clone()
    torch.ops.quack_kernels.cross_entropy_rescale_grad_(out, target, dloss, held, -100)
    expected = grad.clone()
    expected[2] *= 3.0
    expected[3] = float("nan")
    expected[5] = 0.0
    torch.testing.assert_close(out, expected, equal_nan=True)
    torch.library.opcheck(torch.ops.quack_kernels.cross_entropy_rescale_grad_,
                          (grad.clone(), target, dloss, held, -100))
    with pytest.raises(ValueError, match="dloss must be torch.float32"):
        torch.ops.quack_kernels.cross_entropy_rescale_grad_(grad, target, dloss.double(), held, -100)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_plain_backward_finds_nothing_to_rescale(monkeypatch, reduction, weighted):
    """On the CPU path (on CUDA, a differing row costs a pass over its gradient):
    helpers.check_plain_backward_rescales_no_row."""
    x, target, weight = make_case(dtype=torch.float32)
    check_plain_backward_rescales_no_row(monkeypatch, "rescaled_grad", x, target,
                                         weight if weighted else None, reduction)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32])
def test_dtypes_and_inplace(dtype, target_dtype):
    x, target, weight = make_case(dtype=torch.float32)
    x = x.to(dtype)
    for inplace in (False, True):
        xi = x.clone().requires_grad_()
        xr = x.float().clone().requires_grad_()
        kw = dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=4.0)
        loss, lse = qk.cross_entropy(xi * 1 if inplace else xi, target.to(target_dtype), weight,
                                     return_lse=True, inplace_backward=inplace, **kw)
        ref = torch_cross_entropy(xr, target, weight, **kw)
        assert loss.dtype == torch.float32 and lse.dtype == torch.float32
        assert_close(loss, ref.float(), torch.float32, scale=4.0, name="loss")
        assert_close(lse, torch.logsumexp(4.0 * torch.tanh(xr / 4.0), -1).detach(), torch.float32)
        loss.backward()
        ref.backward()
        assert xi.grad.dtype == dtype
        assert_close(xi.grad, xr.grad.to(dtype), dtype, name="grad")


def test_inplace_overwrites_logits_with_gradient():
    x, target, _ = make_case(dtype=torch.float32)
    leaf = x.clone().requires_grad_()
    logits = leaf * 1.0
    loss = qk.cross_entropy(logits, target, reduction="sum", inplace_backward=True)
    xd = x.double().requires_grad_()  # (torch's own gradient, not our reference's)
    F.cross_entropy(xd, target, reduction="sum").backward()
    per_row_grad = xd.grad
    assert_close(logits.detach(), per_row_grad, torch.float32)  # the buffer is the gradient now
    loss.backward()
    assert_close(leaf.grad, per_row_grad, torch.float32)
    # logits that are a leaf themselves: autograd keeps the buffer as .grad, no copy
    leaf = x.clone().requires_grad_()
    qk.cross_entropy(leaf, target, reduction="sum", inplace_backward=True).backward()
    assert leaf.grad.data_ptr() == leaf.data_ptr()
    assert_close(leaf.grad, per_row_grad, torch.float32)


def test_leading_dims_ignore_index_and_empty():
    x = torch.randn(3, 5, 11, dtype=torch.float64)
    target = torch.randint(0, 11, (3, 5))
    target[0, 0] = 3
    out = qk.cross_entropy(x, target, ignore_index=3, reduction="none")
    ref = F.cross_entropy(x.reshape(-1, 11), target.reshape(-1), ignore_index=3, reduction="none")
    assert out.shape == (3, 5)
    assert_close(out, ref.view(3, 5), torch.float32)
    one = qk.cross_entropy(x[0, 0], target[0, 1])  # (C,) logits, () target
    assert_close(one, F.cross_entropy(x[0, 0], target[0, 1]), torch.float32)
    empty = torch.empty(0, 11, requires_grad=True)
    no_target = torch.empty(0, dtype=torch.long)
    for reduction, expected in (("none", (0,)), ("sum", ()), ("mean", ())):
        assert qk.cross_entropy(empty, no_target, reduction=reduction).shape == expected
    assert torch.isnan(qk.cross_entropy(empty, no_target))  # like torch: mean of nothing
    qk.cross_entropy(empty, no_target, reduction="sum").backward()
    assert empty.grad.shape == (0, 11)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
@pytest.mark.parametrize("weighted", [False, True])
def test_all_rows_ignored_like_torch(label_smoothing, weighted):
    x = torch.randn(4, 6, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    target = torch.full((4,), -100)
    weight = torch.rand(6) + 0.5 if weighted else None
    ours = qk.cross_entropy(x, target, weight, label_smoothing=label_smoothing)
    ref = F.cross_entropy(xr, target, weight, label_smoothing=label_smoothing)
    assert torch.isnan(ours) and torch.isnan(ref)
    ours.backward()
    ref.backward()
    assert torch.equal(x.grad.abs(), xr.grad.abs()) and not x.grad.isnan().any()


def test_module():
    x, target, weight = make_case(dtype=torch.float32)
    module = qk.nn.CrossEntropyLoss(weight, label_smoothing=0.1, reduction="sum")
    ref = torch.nn.CrossEntropyLoss(weight, label_smoothing=0.1, reduction="sum")
    assert_close(module(x, target), ref(x, target), torch.float32)
    assert "label_smoothing=0.1" in repr(module)


def test_errors():
    x = torch.randn(4, 10)
    t = torch.tensor([0, 1, 2, 3])
    with pytest.raises(ValueError, match="outside"):
        qk.cross_entropy(x, torch.tensor([0, 10, 2, 3]))
    with pytest.raises(ValueError, match="outside"):
        qk.cross_entropy(x, torch.tensor([0, -1, 2, 3]), check_targets=True)
    with pytest.raises(ValueError, match="target shape"):
        qk.cross_entropy(x, t[:3])
    with pytest.raises(TypeError, match="probability"):
        qk.cross_entropy(x, torch.rand(4, 10))
    with pytest.raises(TypeError, match="int64 or torch.int32"):
        qk.cross_entropy(x, t.to(torch.int16))
    with pytest.raises(TypeError, match="dtype"):
        qk.cross_entropy(x.to(torch.int64), t)
    with pytest.raises(ValueError, match="reduction"):
        qk.cross_entropy(x, t, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        qk.cross_entropy(x, t, label_smoothing=1.5)
    with pytest.raises(ValueError, match="softcap"):
        qk.cross_entropy(x, t, softcap=0.0)
    with pytest.raises(ValueError, match="weight must have shape"):
        qk.cross_entropy(x, t, torch.ones(9))
    with pytest.raises(ValueError, match="one device"):
        qk.cross_entropy(x, t.to("meta"))
    # ignore_index inside [0, C) is a legal ignore, not a bad target
    assert torch.isfinite(qk.cross_entropy(x, t, ignore_index=2))
    # torch ops would wrap it to 0 against int32 targets (every row ignored), the
    # kernels would not
    with pytest.raises(ValueError, match="outside the range of the int32"):
        qk.cross_entropy(x, t.int(), ignore_index=2**32)
    assert torch.isfinite(qk.cross_entropy(x, t.int(), ignore_index=-2**31))
    # class weights take no gradient (as in torch): refused, not silently dropped
    weight = torch.rand(10, requires_grad=True)
    with pytest.raises(RuntimeError, match="not differentiable with respect to the class"):
        qk.cross_entropy(x.requires_grad_(), t, weight)
    with torch.no_grad():
        assert torch.isfinite(qk.cross_entropy(x, t, weight))


def _op_args(x, target, weight, compute_grad=True):
    return (x, target, weight, -100, 0.1, 1e-3, 3.0) + ((compute_grad,) if compute_grad is not None else ())


@pytest.mark.parametrize("weighted", [False, True])
def test_opcheck(weighted):
    x, target, weight = make_case(dtype=torch.float32)
    weight = weight.float() if weighted else None
    for compute_grad in (True, False):
        torch.library.opcheck(torch.ops.quack_kernels.cross_entropy_forward,
                              _op_args(x, target, weight, compute_grad))
    grad_scale = torch.rand(x.shape[0]) + 0.5
    torch.library.opcheck(torch.ops.quack_kernels.cross_entropy_forward,
                          _op_args(x, target, weight) + (grad_scale,))
    torch.library.opcheck(torch.ops.quack_kernels.cross_entropy_forward_inplace,
                          _op_args(x.clone(), target, weight, None))
    # logits that require grad: the op's own autograd (opcheck's traced backward)
    torch.library.opcheck(torch.ops.quack_kernels.cross_entropy_forward,
                          _op_args(x.clone().requires_grad_(), target, weight) + (grad_scale,))


@pytest.mark.parametrize("output, compute_grad", [("loss", True), ("lse", True),
                                                  ("grad", True), ("loss", False),
                                                  ("lse", False)])
def test_op_autograd_of_each_output(output, compute_grad):
    """The forward op differentiated directly (not through the public function): the
    losses, the lse and the gradient output each pass gradcheck, with class weights,
    label smoothing, z-loss, softcap, an ignored row and per-row grad_scale, with and
    without the gradient output; a second derivative and class weights that require
    grad are refused with an error, not a silent None."""
    x, target, weight = make_case(m=6, v=9)
    grad_scale = torch.rand(6, dtype=torch.float64) + 0.5
    index = {"loss": 0, "lse": 1, "grad": 2}[output]

    def run(logits, weight=weight):
        outs = torch.ops.quack_kernels.cross_entropy_forward(
            *_op_args(logits, target, weight, compute_grad), grad_scale)
        return outs[0][0] if index == 0 else outs[index]

    x.requires_grad_()
    assert torch.autograd.gradcheck(run, (x,))
    (dx,) = torch.autograd.grad(run(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        dx.sum().backward()
    with pytest.raises(RuntimeError, match="class weights"):
        run(x, weight.clone().requires_grad_())


def test_fake_kernels():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(7, 100, dtype=torch.bfloat16)
        target = torch.empty(7, dtype=torch.int32)
        stats, lse, grad = torch.ops.quack_kernels.cross_entropy_forward(
            x, target, None, -100, 0.0, 0.0, 0.0, True)
        assert stats.shape == (2, 7) and lse.shape == (7,) and stats.dtype == torch.float32
        assert grad.shape == (7, 100) and grad.dtype == torch.bfloat16
        stats, lse = torch.ops.quack_kernels.cross_entropy_forward_inplace(
            x, target, None, -100, 0.0, 0.0, 0.0)
        assert stats.shape == (2, 7)


@pytest.mark.parametrize("weighted", [False, True])
def test_row_weights_are_the_mean_denominator(weighted):
    """The op's second stats row weighs each row as torch's mean does: its sum is the
    denominator, ignored rows count 0."""
    x, target, weight = make_case(dtype=torch.float32)
    weight = weight.float() if weighted else None
    (loss, weights), _, _ = torch.ops.quack_kernels.cross_entropy_forward(
        x, target, weight, -100, 0.0, 0.0, 0.0, False)
    kept = target != -100
    assert kept.any() and not kept.all()
    expected = kept.float() if weight is None else \
        torch.where(kept, weight[target.clamp(min=0)], 0.0)
    torch.testing.assert_close(weights, expected, rtol=0, atol=0)
    torch.testing.assert_close(loss.sum() / weights.sum(),
                               F.cross_entropy(x, target, weight), rtol=1e-5, atol=1e-6)


def test_gradcheck():
    x, target, weight = make_case(m=6, v=7, ignore_every=3)
    for kw in (dict(), dict(label_smoothing=0.2, lse_square_scale=0.01, softcap=2.0)):
        for w in (None, weight):
            torch.autograd.gradcheck(
                lambda a: qk.cross_entropy(a, target, w, reduction="none", **kw),
                (x.clone().requires_grad_(),))


def test_torch_compile_fullgraph():
    """Static and dynamic shapes (dynamic: the rows and the z-loss scale symbolic; a
    math.isfinite check of the scale broke that graph)."""
    x, target, weight = make_case(dtype=torch.float32)
    for dynamic in (False, True):
        fn = torch.compile(lambda a, t, z: qk.cross_entropy(a, t, weight, label_smoothing=0.1,
                                                            lse_square_scale=z),
                           fullgraph=True, backend="aot_eager", dynamic=dynamic)
        for m in (29, 13):
            a = x[:m].clone().requires_grad_()
            out = fn(a, target[:m], 1e-3)
            out.backward()
            ar = x[:m].clone().requires_grad_()
            ref = torch_cross_entropy(ar, target[:m], weight, label_smoothing=0.1,
                                      lse_square_scale=1e-3)
            ref.backward()
            assert_close(out, ref, torch.float32)
            assert_close(a.grad, ar.grad, torch.float32)


def test_forward_configs():
    """Rows one CTA holds loop over row blocks with prefetch when the gradient is
    written, and run one CTA per row block for the loss alone; rows split over a
    cluster do not loop; the loss alone of rows of 128 KiB and more is streamed from
    global memory (never with the gradient, which needs the row on chip), shorter ones
    staged (but odd 16-bit rows of 16K+ columns: test_odd_row_cross_entropy_shares)."""
    from quack_kernels.primitives.config import loops_over_row_blocks

    bf16 = torch.bfloat16
    small = ops.forward_config(4096, bf16, False, True)
    assert small.cluster_size == 1 and loops_over_row_blocks(small, True) and small.stages == 2
    loss_only = ops.forward_config(4096, bf16, False, False)
    assert not loops_over_row_blocks(loss_only, False) and loss_only.stages == 1
    assert not ops.forward_kernel_object(loss_only, bf16, weighted=False, smoothing=False,
                                         zloss=False, softcap=False, write_grad=False).loops
    clustered = ops.forward_config(65536, bf16, False, True)
    assert clustered.cluster_size > 1 and not loops_over_row_blocks(clustered, True)
    assert clustered.stages == 1
    streamed = ops.forward_config(128256, bf16, False, False)
    assert streamed.staging == "global" and not loops_over_row_blocks(streamed, False)
    assert streamed.cols_per_cta * 2 <= config.CE_STREAM_CTA_ROW_BYTES
    assert ops.forward_config(128256, bf16, False, True).staging != "global"
    assert ops.forward_config(65536, bf16, False, False).staging == "global"  # 128 KiB
    assert ops.forward_config(65528, bf16, False, False).staging != "global"


def test_plain_gradient_loops_on_more_ctas_per_sm():
    """The plain per-row gradient (z-loss at most) of one-chunk rows of whole 16-byte
    vectors is sized for config.CE_PLAIN_GRAD_LOOP_REGISTERS where it is bf16 or the
    default bound leaves two CTAs per SM: six CTAs of 128 threads per SM at 1024 and 4096
    bf16 columns, three of 256 at 4096 fp32; fp32 1024 (five by default), fp16, ragged or misaligned
    rows, the other options and the loss reduced in the kernel keep the default bound
    (softcap: the wide one)."""

    def kernel(n, dtype, max_vec=None, **options):
        flags = dict(weighted=False, smoothing=False, zloss=False, softcap=0.0,
                     write_grad=True) | options
        cfg = ops.forward_config(n, dtype, False, True, max_vec=max_vec,
                                 softcap=flags["softcap"] != 0.0)
        return cfg, ops.forward_kernel_object(cfg, dtype, **ops.kernel_flags(cfg, **flags))

    plain_bound = config.CE_PLAIN_GRAD_LOOP_REGISTERS
    for n, dtype, ctas in ((1024, torch.bfloat16, 6), (4096, torch.bfloat16, 6),
                           (4096, torch.float32, 3)):
        for zloss in (False, True):
            cfg, plain = kernel(n, dtype, zloss=zloss)
            assert plain.loops and cfg.num_chunks == 1
            assert plain.loop_registers == plain_bound and plain.ctas_per_sm() == ctas, \
                (n, dtype, zloss)
        for options in (dict(weighted=True), dict(smoothing=True), dict(softcap=30.0),
                        dict(reduce="mean"), dict(reduce="sum")):
            _, other = kernel(n, dtype, **options)
            assert other.loop_registers > plain_bound, (n, dtype, options)
            assert other.ctas_per_sm() < ctas, (n, dtype, options)
    default = config.CE_LOOP_REGISTERS
    for n, dtype, max_vec in ((1024, torch.float32, None), (1024, torch.float16, None),
                              (1000, torch.bfloat16, None), (1000, torch.float32, None),
                              (4096, torch.bfloat16, 4), (16384, torch.bfloat16, None)):
        cfg, other = kernel(n, dtype, max_vec)
        assert other.loop_registers == default, (n, dtype, max_vec)


@pytest.mark.parametrize("n, dtype, cluster", [
    (65536, torch.bfloat16, 1), (151936, torch.bfloat16, 1), (262144, torch.bfloat16, 2),
    (151936, torch.float32, 2), (262144, torch.float32, 4), (524288, torch.float16, 4)])
def test_streamed_loss_reads_64_bytes_a_chunk(n, dtype, cluster):
    """config.CE_STREAM_*: the streamed loss alone reads four 16-byte vectors per thread
    and chunk in any dtype, its shares up to 320 KiB (a 151936-column bf16 row on one
    CTA); a misaligned row (8-byte vectors) keeps 16 values per chunk."""
    cfg = ops.forward_config(n, dtype, False, False)
    elem = torch.finfo(dtype).bits // 8
    assert cfg.staging == "global" and cfg.cluster_size == cluster
    assert cfg.vec * elem == 16 and cfg.vecs_per_thread * cfg.vec * elem == 64
    assert cfg.cols_per_cta * elem <= config.CE_STREAM_CTA_ROW_BYTES
    misaligned = ops.forward_config(n, dtype, False, False, 8 // elem)
    assert misaligned.staging == "global" and misaligned.vec * misaligned.vecs_per_thread == 16


@pytest.mark.parametrize("n", [16384, 32768, 32000, 50256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_loss_alone_of_whole_staged_16bit_shares_reads_64_bytes_a_chunk(n, dtype):
    """The loss alone of 16-bit rows staged in whole vectors and whole chunks takes 32
    values (4 vectors) per thread and chunk; rows with a partial last chunk (32000,
    50256) or narrow vectors (a misaligned base) keep 16 values, and the gradient keeps
    its own share. (Odd rows take config.odd_row_forward_share's: test_config.)"""
    loss = ops.forward_config(n, dtype, False, False)
    grad = ops.forward_config(n, dtype, False, True)
    whole = loss.vec == 8 and not loss.needs_col_predicate
    assert loss.staging == "smem"
    assert loss.vec * loss.vecs_per_thread == (32 if whole else 16)
    assert whole == (n % 16384 == 0)
    assert grad.vec * grad.vecs_per_thread in (16, 32)
    assert (grad.vec * grad.vecs_per_thread == 32) == (
        grad.staging == "registers" or config.loops_over_row_blocks(grad, True))
    misaligned = ops.forward_config(n, dtype, False, False, 4)  # 8-byte vectors
    assert misaligned.vec * misaligned.vecs_per_thread == 16


@pytest.mark.parametrize("n", [4096, 8192, 16384, 32000, 50256, 50257, 128256, 151936,
                               262144, 262145])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softcap_gradient_keeps_capped_values_in_registers(n, dtype):
    """With softcap and the gradient, rows split over a cluster take the smallest cluster
    (up to 16 CTAs of MAX_THREADS_PER_ROW threads) whose CTAs hold their share in one
    chunk of at most KEPT_CAPPED_VALUES per thread, so the gradient pass reuses the
    capped values; so do the looping grid's one-CTA rows where such a share needs a
    cluster (16384 bf16 columns), not where one CTA holds it (8192 fp32). Rows that
    cannot (151936 bf16 columns) and rows of one-element vectors (odd lengths) keep the
    plain config."""
    plain = ops.forward_config(n, dtype, False, True)
    capped = ops.forward_config(n, dtype, False, True, softcap=True)
    loops = config.loops_over_row_blocks(plain, True)
    if plain.staging == "registers" or plain.vec == 1:
        assert capped == plain
        return
    if capped.staging != "registers":
        # no one-chunk share fits: 16 CTAs of 256 threads hold too few values, or one
        # CTA would (the looping grid's rows stay there)
        share = config.MAX_THREADS_PER_ROW * config.KEPT_CAPPED_VALUES
        assert n <= share if loops else -(-n // 16) > share
        assert capped == plain
        return
    per_thread = capped.vec * capped.vecs_per_thread
    assert capped.num_chunks == 1
    assert per_thread <= config.KEPT_CAPPED_VALUES and capped.cluster_size <= 16
    assert capped.threads_per_row == config.MAX_THREADS_PER_ROW or capped.cluster_size == 1
    assert capped.cols_covered >= n
    assert capped.cluster_size > 1 or not loops
    if capped.cluster_size > 1:  # the smallest cluster: half of it would not hold the row
        assert -(-n // (capped.cluster_size // 2)) > \
            capped.threads_per_row * config.KEPT_CAPPED_VALUES
    kernel = ops.forward_kernel_object(capped, dtype, weighted=False, smoothing=True,
                                       zloss=True, softcap=True, write_grad=True)
    assert not kernel.loops and kernel.target_aside and kernel.capped_placeholders


@pytest.mark.parametrize("n", [32768, 65536, 100000, 128256, 151936, 262144, 262145, 524288])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_long_softcapped_rows_hold_their_logits_and_stage_their_cap_shares(n, dtype):
    """With held_shares (config.HELD_SHARES_MIN_COLS), 16-bit rows of 65536+ columns in
    16-byte vectors hold every chunk of 16 values in registers, at most
    HELD_CAP_SHARE_VALUES a thread on the fewest 256-thread CTAs that hold them, of any
    count (151936 columns on 10, not 13 of 48 values a thread), and their kernel stages the
    cap shares of up to three chunks in shared memory (config.HELD_STAGED_SHARE_BYTES;
    a fourth keeps its shares in registers), held to the registers of the 4 CTAs per SM
    that leaves room for. Not fp32 rows, shorter ones (kept in registers), one-value
    vectors (262145) nor rows past 16 CTAs of 64 values (524288)."""
    unheld = ops.forward_config(n, dtype, False, True, softcap=True)
    held = ops.forward_config(n, dtype, False, True, softcap=True, held_shares=True)
    too_long = -(-n // (config.MAX_THREADS_PER_ROW * config.HELD_CAP_SHARE_VALUES)) > 16
    if dtype == torch.float32 or n < config.HELD_SHARES_MIN_COLS or unheld.vec == 1 \
            or too_long:
        assert held == unheld
        return
    assert held.staging == "smem" and held.register_chunks == held.num_chunks
    assert held.thread_values_per_chunk == 16 and held.threads_per_row == 256
    assert held.thread_values <= config.HELD_CAP_SHARE_VALUES and held.cols_covered >= n
    assert held.cluster_size == -(-n // (256 * config.HELD_CAP_SHARE_VALUES)) <= 16
    kernel = ops.forward_kernel_object(held, dtype, weighted=False, smoothing=True,
                                       zloss=True, softcap=True, write_grad=True,
                                       fixed_max=True)
    assert kernel.stages_cap_shares and kernel.sums_from_share and not kernel.loops
    assert kernel.share_chunks == config.staged_share_chunks(held) == min(held.num_chunks, 3)
    ctas = config.loop_ctas_per_sm(held, kernel.smem_bytes(), kernel.block_registers)
    assert ctas == 4 and kernel.block_registers * ctas * 256 <= config.REGISTERS_PER_SM
    # the running max (a wide softcap) takes no cap shares: the kernel refuses the config
    with pytest.raises(AssertionError, match="held in registers whole"):
        ops.forward_kernel_object(held, dtype, weighted=False, smoothing=True, zloss=True,
                                  softcap=True, write_grad=True)


def test_held_cap_shares_only_with_the_fixed_max_gradient():
    """config.holds_cap_shares, through the launches' configs (ops.variant): the
    gradient with a softcap taken as the fixed max (class weights and the loss reduced
    in the kernel too, not the weight row staged), and not a shifted row's span (odd
    16-bit rows stay shifted)."""
    def variant(n, options, shifted=False, **changes):
        return ops.variant(n, torch.bfloat16, shifted,
                           **{**ops.REPORT_OPTIONS[options], **changes})
    for options, changes in (("_capped", {}), ("_capped_mean", {}),
                             ("_capped", dict(weighted=True, smoothing=False, reduce="sum")),
                             ("_capped", dict(softcap=-40.0))):
        cfg, flags = variant(128256, options, **changes)
        assert cfg.register_chunks == cfg.num_chunks and flags["fixed_max"], (options, changes)
    for options, changes in (("_capped_wide", {}), ("_all", {}), ("_loss", {}),
                             ("_capped", dict(softcap=-50.0)), ("_grad", {})):
        cfg, _ = variant(128256, options, **changes)
        assert cfg.register_chunks == 0, (options, changes, cfg)
    shifted, _ = variant(131073, "_capped", shifted=True)
    assert shifted.row_shift and shifted.register_chunks == 0
    assert config.holds_cap_shares(-30.0, False, True)
    assert not config.holds_cap_shares(30.0, False, False)
    assert not config.holds_cap_shares(30.0, True, True)


@pytest.mark.parametrize("n", [2, 7, 1000, 1024, 4096, 8192])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_short_loss_only_rows_keep_threads_busy(n, dtype):
    """The loss alone of short rows (config.CE_LOSS_*): one CTA per row, at most 64
    threads per row, chunks of at most 4 vectors, 8+ vectors per thread where the row
    has them, 256-thread blocks; with the gradient the general rule applies."""
    cfg = ops.forward_config(n, dtype, False, False)
    vectors = -(-n // cfg.vec)
    if vectors > config.CE_LOSS_MAX_THREADS_PER_ROW * config.CE_LOSS_MAX_VECS_PER_THREAD:
        # too long for the rule (8192 fp32 columns): the general one
        assert cfg.threads_per_row > config.CE_LOSS_MAX_THREADS_PER_ROW
        return
    assert cfg.cluster_size == 1 and cfg.threads_per_row <= config.CE_LOSS_MAX_THREADS_PER_ROW
    assert cfg.vecs_per_thread <= config.CE_LOSS_VECS_PER_CHUNK
    held = cfg.vecs_per_thread * cfg.num_chunks
    assert held >= min(config.CE_LOSS_MIN_VECS_PER_THREAD, vectors)
    assert cfg.threads_per_row * held >= vectors
    assert cfg.threads_per_block >= config.CE_LOSS_MIN_THREADS_PER_BLOCK
    assert ops.forward_config(n, dtype, False, True) != cfg


# ------------------------------------------------------------- sm_90a compile, no spills
SPILL_CASES = [
    (n, dtype, dict(weighted=w, smoothing=s, zloss=z, softcap=c, write_grad=g, reduce=r))
    for n in (2, 1000, 16384, 32000, 50257, 151936, 262145, 524288)
    for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for w, s, z, c, g, r in ((False, False, False, 0.0, True, "none"),
                             (True, True, True, 30.0, True, "none"),
                             (False, True, True, 30.0, True, "none"),
                             (False, True, True, 50.0, True, "none"),
                             (True, False, True, 30.0, True, "none"),
                             (False, False, False, 30.0, True, "none"),
                             (False, True, False, 30.0, False, "none"),
                             (False, False, False, 0.0, False, "none"),
                             (True, False, True, 30.0, False, "mean"),
                             (False, False, False, 0.0, True, "sum"),
                             (False, True, True, 30.0, True, "mean"))
] + [
    # the plain per-row gradient on its 80 registers (six CTAs per SM), and beside it
    (n, dtype, dict(weighted=False, smoothing=False, zloss=z, softcap=0.0, write_grad=True,
                    reduce="none"))
    for n in (1000, 1024, 4096) for dtype in (torch.float32, torch.bfloat16, torch.float16)
    for z in (False, True)
] + [
    # held cap shares on 64 registers (four CTAs per SM), as 151936 above
    (n, dtype, dict(weighted=w, smoothing=s, zloss=s, softcap=30.0, write_grad=True, reduce=r))
    for n in (65536, 262144) for dtype in (torch.bfloat16, torch.float16)
    for w, s, r in ((False, False, "none"), (False, True, "none"), (True, False, "sum"),
                    (False, True, "mean"))
    if r == "none" or not ops.ce_gradient_in_backward(dtype)
]


@pytest.mark.slow
def test_sm90a_compile_without_spills(tmp_path, cuobjdump):
    variants = []
    for n, dtype, options in SPILL_CASES:
        cfg, flags = ops.variant(n, dtype, **options)
        variants.append(("xent", n, dtype, cfg,
                         lambda cfg=cfg, dtype=dtype, flags=flags: ops.forward_kernel(cfg, dtype, torch.int64, **flags)))
    for n, dtype in ((50257, torch.float16), (524288, torch.float32)):
        cfg = rescale.rescale_config(n, dtype)
        for uniform in (False, True):
            variants.append(("xent_rescale", n, dtype, cfg, lambda cfg=cfg, dtype=dtype, u=uniform:
                             rescale.rescale_kernel(cfg, dtype, None, torch.int32, u)))
    rows = list(measure(variants, str(tmp_path), cuobjdump))
    assert len(rows) == len(variants)
    for name, n, dtype, cfg, kernel, res in rows:
        assert spills(res) == 0, f"{name} {n} {dtype}: {res}"
        if name == "xent":
            assert_looping_launch_fits(kernel, name, n, dtype, cfg, res)


@pytest.mark.slow
def test_plain_streamed_loss_held_only_where_it_fits(tmp_path, cuobjdump):
    """The plain streamed loss of 16-bit rows in whole chunks of 16-byte vectors is held
    to STREAM_LOSS_REGISTERS (4 CTAs of 256 threads per SM) and compiles without a spill
    for either target dtype, reduced or not, with or without z-loss; the narrower
    vectors of a misaligned tensor and a row with a partial last chunk (128256 columns),
    which spilled at that bound, are not held and compile without a spill either."""
    variants, expect_held = [], []

    def add(held, n, dtype, max_vec, zloss, reduce, target_dtype):
        cfg = ops.forward_config(n, dtype, False, False, max_vec)
        flags = ops.kernel_flags(cfg, weighted=False, smoothing=False, zloss=zloss,
                                 softcap=0.0, write_grad=False, reduce=reduce)
        variants.append((f"loss vec<={max_vec} z={zloss} {reduce} {target_dtype}", n, dtype,
                         cfg, lambda: ops.forward_kernel(cfg, dtype, target_dtype, **flags)))
        expect_held.append(held)

    for case in itertools.product((65536, 131072, 524288), (torch.bfloat16, torch.float16),
                                  (None,), (False, True), ("none", "mean"),
                                  (torch.int32, torch.int64)):
        add(True, *case)
    for max_vec in (4, 2, 1):
        add(False, 65536, torch.bfloat16, max_vec, False, "mean", torch.int32)
    add(False, 128256, torch.bfloat16, None, False, "none", torch.int32)
    rows = list(measure(variants, str(tmp_path), cuobjdump))
    assert len(rows) == len(variants)
    for (name, n, dtype, cfg, kernel, res), held in zip(rows, expect_held):
        assert cfg.staging == "global"
        assert kernel.block_registers == (config.STREAM_LOSS_REGISTERS if held else None), name
        assert spills(res) == 0, f"{name} {n} {dtype}: {res}"
        if held:
            assert res["regs"] <= config.STREAM_LOSS_REGISTERS, f"{name} {n} {dtype}: {res}"


@pytest.mark.parametrize("n", [65536, 262144])
def test_plain_streamed_bf16_loss_widens_by_integer_ops_unguarded(n, tmp_path, cuobjdump):
    """The plain streamed bf16 loss widens bf16 pairs by integer ops (the DSL's
    conversion unpacks each pair with a PRMT: four a loaded vector), in the held
    registers, and a share of one CTA (65536 columns) loads its 16-byte vectors without
    a row guard (none predicated; with a cluster the compiler keeps the in-row predicate
    of the rank's columns), fp16 too."""
    for dtype in (torch.bfloat16, torch.float16):
        cfg, flags = ops.variant(n, dtype, False, **ops.REPORT_OPTIONS["_plain_mean"])
        assert cfg.staging == "global" and not flags["write_grad"]
        kernel = ops.forward_kernel(cfg, dtype, torch.int64, **flags)
        usage, sass = compiled_sass(kernel, tmp_path / f"{n}_{dtype}", cuobjdump)
        assert spills(usage) == 0 and usage["regs"] <= config.STREAM_LOSS_REGISTERS, usage
        loads = re.findall(r"^.*\bLDG\.E\.128\b.*$", sass, re.M)
        assert len(loads) >= cfg.vecs_per_thread, (dtype, len(loads))
        if cfg.cluster_size == 1:
            assert not [line for line in loads if re.search(r"@!?U?P\d", line)], dtype
        if dtype == torch.bfloat16:  # (a cluster's DSMEM addresses take a PRMT or two)
            assert len(re.findall(r"\bPRMT\b", sass)) < len(loads), dtype


def test_staged_16_bit_rows_recap_on_the_fma_pipe(tmp_path, cuobjdump):
    """A staged 16-bit row with the fixed max caps its logits twice, for the sums and
    for the gradient, and takes the second cap's reciprocal by Newton steps on the FMA
    pipe (kernels.cross_entropy.fma_reciprocal): its SASS holds about one MUFU.RCP a
    value instead of two, without a spill. A one-block share in shared memory is held
    to CAPPED_GRAD_REGISTERS where its shared memory leaves room for the CTAs the hold
    is for; not where it does not (fp16 524288 columns, one CTA a SM) nor a share
    re-read from global memory (2M columns, which spilled at 64). fp32 rows and softcaps
    past the fixed max's bound keep both reciprocals on the multi-function unit. Rows
    staged in shared memory, shifted ones included, take their sums from the cap shares
    too (sums_from_share); not one-value vectors (50257 bf16: masked per value) nor
    global shares. Rows kept in registers cap once and keep the shares for the gradient
    (grads_from_share), and so do rows that hold their logits in registers and stage
    the shares (stages_cap_shares: fp16 151936 and bf16 262144,
    config.HELD_SHARES_MIN_COLS): three MUFU.EX2 a value and one MUFU.RCP, but for the
    chunks whose first-pass reciprocal (caps_on_fma) or, in unpadded rows, sum terms
    (sums_on_fma) are on the FMA pipe: one op of each chunk's two."""
    for n, dtype, options, on_fma, from_share, held, shifted in (
            (16383, torch.bfloat16, "_capped", True, False, False, False),  # looping
            (151936, torch.float16, "_capped", True, True, True, False),  # held shares
            (262144, torch.bfloat16, "_capped", True, True, True, False),
            (262145, torch.bfloat16, "_capped", True, True, True, True),
            (524288, torch.float16, "_capped", True, True, False, False),
            (50257, torch.bfloat16, "_capped", True, False, True, False),
            (2_000_000, torch.bfloat16, "_capped", True, False, False, False),
            (151936, torch.float32, "_capped", False, False, False, False),
            (16384, torch.bfloat16, "_capped_wide", False, False, False, False),
            (16384, torch.bfloat16, "_capped", False, True, True, False),  # kept
            (32768, torch.bfloat16, "_capped", False, True, True, False),  # kept
            (4096, torch.float32, "_capped", False, True, False, False)):
        cfg, flags = ops.variant(n, dtype, shifted, **ops.REPORT_OPTIONS[options])
        kernel = ops.forward_kernel(cfg, dtype, torch.int64, **flags)
        case = (n, dtype, options, cfg.staging, cfg.row_shift)
        assert kernel[0].recaps_on_fma == on_fma, case
        held_shares = (n, dtype) in ((151936, torch.float16), (262144, torch.bfloat16))
        assert kernel[0].stages_cap_shares == held_shares, case
        assert kernel[0].sums_from_share == from_share, case
        kept = cfg.staging == "registers"
        assert kernel[0].grads_from_share == (on_fma or (kept and from_share)), case
        assert kernel[0].block_registers == (config.CAPPED_GRAD_REGISTERS if held else None), case
        usage, sass = compiled_sass(kernel, tmp_path / f"{n}_{dtype}{options}", cuobjdump)
        assert spills(usage) == 0, (case, usage)
        if held:
            assert usage["regs"] <= config.CAPPED_GRAD_REGISTERS, (case, usage)
        values = cfg.thread_values
        rcp = len(re.findall(r"\bMUFU\.RCP\b", sass))
        ex2 = len(re.findall(r"\bMUFU\.EX2\b", sass))
        if kept or held_shares:  # capped once, the shares kept
            def values_moved(moves_chunk):  # a thread's values in the chunks it moves
                return sum(cfg.thread_values_per_chunk for c in range(cfg.num_chunks)
                           if moves_chunk(c))

            caps_moved = values_moved(kernel[0].caps_on_fma)
            sums_moved = values_moved(kernel[0].sums_on_fma)
            assert 0 < caps_moved < values if held_shares else caps_moved == 0, (case, caps_moved)
            assert sums_moved == (values - caps_moved if held_shares and not cfg.needs_col_predicate
                                  else 0), (case, sums_moved)
            assert values - caps_moved <= rcp < 1.5 * values - caps_moved, (case, rcp, values)
            if from_share:  # the cap's exp, the sums' and the gradient's: no second cap
                assert 3 * values - sums_moved <= ex2 < 3.5 * values - sums_moved, \
                    (case, ex2, values)
        else:
            assert (rcp < 1.5 * values) if on_fma else (rcp >= 2 * values), (case, rcp, values)


def test_per_row_losses_can_be_modified_in_place():
    """reduction="none" hands out a tensor callers may modify in place, as torch's does
    (the autograd function's loss is a view of its (2, M) stats)."""
    x, target, _ = make_case(dtype=torch.float32)
    for requires_grad in (False, True):
        leaf = x.clone().requires_grad_(requires_grad)
        loss = qk.cross_entropy(leaf, target, reduction="none")
        loss.mul_(2.0)
        loss[0] = 0.0
        expected = 2 * F.cross_entropy(x, target, reduction="none")
        expected[0] = 0.0
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        if requires_grad:
            loss.sum().backward()
            assert torch.isfinite(leaf.grad).all()


def test_softcap_takes_the_fixed_max_up_to_its_bound():
    """config.ce_fixed_max: softcaps of either sign up to CE_FIXED_MAX_SOFTCAP (where
    exp(-2 s) is still a normal fp32), not 0 (no cap) nor larger ones; with the gradient
    and for the streamed loss alone and in the looping grid, not with the weight row
    staged or for the loss alone of short rows. The kernel refuses a fixed max without
    softcap and holds the kept-values gradient share to CAPPED_GRAD_REGISTERS."""
    bound = config.CE_FIXED_MAX_SOFTCAP
    assert torch.finfo(torch.float32).tiny < math.exp(-2 * bound)
    kept = ops.forward_config(128256, torch.float32, False, True, softcap=True)
    looping = ops.forward_config(8192, torch.float32, False, True, softcap=True)
    streamed = ops.forward_config(128256, torch.bfloat16, False, False, softcap=True)
    short = ops.forward_config(32000, torch.float32, False, False, softcap=True)
    assert config.ce_fixed_max(30.0, kept, False, True)
    assert config.ce_fixed_max(-bound, kept, False, True)
    assert config.ce_fixed_max(30.0, streamed, False, False) and streamed.staging == "global"
    assert not config.ce_fixed_max(0.0, kept, False, True)
    assert not config.ce_fixed_max(bound * 1.001, kept, False, True)
    assert not config.ce_fixed_max(30.0, kept, True, True)
    assert config.ce_fixed_max(30.0, looping, False, True) and ops.loops_over_row_blocks(
        looping, True)
    assert not config.ce_fixed_max(30.0, short, False, False)
    plain = dict(weighted=False, smoothing=True, zloss=True, write_grad=True)
    with pytest.raises(AssertionError):
        ops.forward_kernel_object(kept, torch.float32, softcap=False, fixed_max=True, **plain)
    held = ops.forward_kernel_object(kept, torch.float32, softcap=True, fixed_max=True, **plain)
    running = ops.forward_kernel_object(kept, torch.float32, softcap=True, fixed_max=False,
                                        **plain)
    assert kept.staging == "registers" and not held.loops
    assert held.block_registers == config.CAPPED_GRAD_REGISTERS
    assert running.block_registers is None
    # the in-kernel reduction's epilogue spilled 16 bytes under the hold (65536 16-bit)
    reduced = ops.forward_kernel_object(kept, torch.float32, softcap=True, fixed_max=True,
                                        reduce="mean", **plain)
    assert reduced.block_registers is None


def test_loss_reduced_in_the_kernel_where_the_rule_says():
    """config.ce_reduces_in_kernel: any row count but 0, not with the weight row staged
    (its variants spilled)."""
    assert config.ce_reduces_in_kernel(1, False)
    assert config.ce_reduces_in_kernel(1 << 20, False)
    assert not config.ce_reduces_in_kernel(0, False)
    assert not config.ce_reduces_in_kernel(8, True)


def test_reduced_loss_epilogue_has_no_divergent_warp_sync(tmp_path, cuobjdump):
    """The last CTA's epilogue (block_sum) runs lane-0-only code; a full-warp shuffle
    there (cute.arch.warp_idx() makes its result warp-uniform with one) compiled to
    WARPSYNC.ALL in lane 0 alone while the other lanes waited at the CTA barrier: the
    looping gradient kernel with the reduction hung on the H200. None may remain."""
    from quack_kernels.primitives.compile_cache import compile_kernel
    from quack_kernels.report import _cubin_file, disassembly, warp_syncs

    for n, write_grad in ((4096, True), (7, False), (151936, False)):
        cfg = ops.forward_config(n, torch.bfloat16, False, write_grad)
        kernel = ops.forward_kernel(cfg, torch.bfloat16, torch.int64, weighted=False,
                                    smoothing=False, zloss=False, softcap=False,
                                    write_grad=write_grad, reduce="mean")
        fn = compile_kernel(*kernel, keep_cubin_in=str(tmp_path))
        cubin = _cubin_file(fn.__cubin__, str(tmp_path))
        assert warp_syncs(disassembly(cubin, cuobjdump)) == 0, f"{n} columns, write_grad={write_grad}"


def test_looping_staged_gradient_reads_no_unwritten_register(tmp_path, cuobjdump):
    """The looping gradient kernels of shares staged in shared memory, with the options
    that change their code and the loss summed in the kernel, read no register before
    writing it (report.uninitialized_reads): CUDA 13's ptxas compiled label smoothing
    without softcap, when it still compared every value with the target column, with
    the thread index taken from a register it never wrote (16-bit rows of 16384
    columns). Every staged variant but weighted smoothing now sets the target aside.
    Meaningful where the toolchain is CUDA 13's (CI installs the cu13 flavor)."""
    from quack_kernels.primitives.compile_cache import compile_kernel
    from quack_kernels.report import _cubin_file, disassembly, uninitialized_reads

    option_sets = [dict(smoothing=True), dict(smoothing=True, zloss=True), dict(zloss=True),
                   dict(smoothing=True, zloss=True, softcap=30.0)]
    for n, dtype in ((16384, torch.bfloat16), (16384, torch.float16), (8192, torch.float32)):
        for index, chosen in enumerate(option_sets):
            if "softcap" in chosen and dtype.itemsize == 2:
                continue  # kept in registers over a cluster, not looping
            options = dict(weighted=False, smoothing=False, zloss=False, softcap=0.0,
                           write_grad=True, reduce="mean") | chosen
            cfg, flags = ops.variant(n, dtype, **options)
            assert config.loops_over_row_blocks(cfg, True) and cfg.staging == "smem"
            kernel, *fakes = ops.forward_kernel(cfg, dtype, torch.int64, **flags)
            assert kernel.target_aside
            folder = tmp_path / f"{n}_{dtype}_{index}"
            folder.mkdir()
            fn = compile_kernel(kernel, *fakes, keep_cubin_in=str(folder))
            sass = disassembly(_cubin_file(fn.__cubin__, str(folder)), cuobjdump)
            assert uninitialized_reads(sass) == [], (n, dtype, chosen)


@pytest.mark.parametrize("n, dtype", [(50257, torch.bfloat16), (262143, torch.float16)])
def test_shifted_odd_rows_take_16_byte_accesses(n, dtype, tmp_path, cuobjdump):
    """Odd 16-bit rows read from the 16-byte boundary before each
    (config.shifted_row_share), in every option set the report compiles shifted: each
    staged vector one 16-byte cp.async (a streamed loss: 16-byte loads, the target's
    word its one 2-byte load), no spill, no register read before it is written; the
    gradient in 16-byte stores but for the edge vectors' values and the set-aside
    target's one value (2-byte stores). The unshifted loss of such rows reads 2-byte
    values (the contrast the test relies on)."""
    from quack_kernels.report import uninitialized_reads

    shifted = [v for v in ops.report_variants([n], [dtype]) if v[0].endswith("_shifted")]
    assert len(shifted) >= 3, shifted
    for suffix, _, _, cfg, build in shifted:
        assert cfg.row_shift, suffix
        usage, sass = compiled_sass(build(), tmp_path / suffix, cuobjdump)
        assert usage["stack"] == 0 and usage["local"] == 0, (suffix, usage)
        assert uninitialized_reads(sass) == [], suffix
        vectors = cfg.num_chunks * cfg.vecs_per_thread
        if cfg.staging == "global":  # streamed in a dynamic loop; the target's word alone
            assert re.findall(r"\bLDG\.E\.128\b", sass), suffix
            assert len(re.findall(r"\bLDG\.E\.U16\b", sass)) <= 1, suffix
        else:
            assert len(re.findall(r"\bLDGSTS\.E\.128\b", sass)) == vectors, suffix
            assert not re.findall(r"\bLDG\.E\.U16\b", sass), suffix
        wide, narrow = (len(re.findall(rf"\bSTG\.E\.{w}\b", sass)) for w in ("128", "U16"))
        if ops.REPORT_OPTIONS[suffix.removeprefix("xent_fwd").removesuffix("_shifted")]["write_grad"]:
            assert 0 < wide <= vectors and 0 < narrow <= vectors * cfg.vec + 1, (suffix, wide, narrow)
        else:
            assert wide == narrow == 0, suffix
    cfg, flags = ops.variant(n, dtype, False, **ops.REPORT_OPTIONS["_plain_mean"])
    unshifted = ops.forward_kernel(cfg, dtype, torch.int64, **flags)
    assert re.findall(r"\bLDG\.E\.U16\b", compiled_sass(unshifted, tmp_path / "unshifted",
                                                         cuobjdump)[1])


@pytest.mark.parametrize("inplace", [False, True])
def test_fp16_gradient_takes_the_loss_scale_before_rounding(inplace):
    """fp16 logits get their gradient in the backward, for the actual upstream
    gradient: with a loss scaler's factor it is as precise as torch's (computed in the
    forward for 1 / M and rescaled, its small values had underflowed: 2.0e-3 off in
    norm against 2.1e-4); a retained graph runs backward twice with the logits kept."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2048, 8192, generator=g) * 2).half()
    target = torch.randint(0, 8192, (2048,), generator=g)
    target[::5] = -100
    ref = x.double().requires_grad_()
    F.cross_entropy(ref, target).backward(torch.tensor(1024.0, dtype=torch.float64))
    leaf = x.clone().requires_grad_()
    logits = leaf * 1  # (a non-leaf: in place overwrites it, not the leaf)
    loss = qk.cross_entropy(logits, target, inplace_backward=inplace)
    loss.backward(torch.tensor(1024.0), retain_graph=True)
    error = (leaf.grad.double() - ref.grad).norm() / ref.grad.norm()
    assert error < 1e-3, f"relative error {error:.3g}"
    first = leaf.grad.clone()
    loss.backward(torch.tensor(1024.0))  # the graph again: the logits were kept
    torch.testing.assert_close(leaf.grad, 2 * first, rtol=1e-3, atol=0)


def test_inplace_backward_invalidates_other_uses_of_the_logits():
    """The logits overwritten in place (inplace_backward): a node that saved them
    before fails in the backward instead of reading the gradient (the CUDA twin is in
    test_cross_entropy_gpu.py, where the eager kernel bumps the version itself)."""
    x, target, _ = make_case(dtype=torch.float32)
    logits = x.clone().requires_grad_() * 1
    aux = (logits * logits).mean()  # (saved before the loss overwrites them)
    loss = qk.cross_entropy(logits, target, inplace_backward=True) + aux
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
