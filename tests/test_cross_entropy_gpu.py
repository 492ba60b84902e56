"""Cross-entropy CUDA kernel against an fp64 reference (run on an H200)."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import quack_kernels as qk
from quack_kernels.ops import cross_entropy as ops
from quack_kernels.primitives import config

from helpers import (assert_close, check_cross_entropy_backward_paths,
                     check_plain_backward_rescales_no_row, poison_allocator,
                     torch_cross_entropy)

pytestmark = pytest.mark.gpu
REDUCED_LOSS_CUDA = ops.reduced_loss_cuda  # (before any test patches it)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
VOCABS = [2, 7, 1000, 4096, 32000, 50257, 128256, 131073, 151936, 262145, 524288]
# The loss is fp32 whatever the logits; its error grows with the row's sums.
LOSS_TOL = torch.float32
LOSS_SCALE = 8.0


def fresh(m, v, dtype, confident_every=3, ignore_every=5, seed=None):
    """Logits with realistic losses (randn * 2), every ``confident_every`` row with its
    target logit 10 above the row max, every ``ignore_every`` row ignored; from a fresh
    seed unless given (printed: pytest shows it with a failure)."""
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
        print(f"fresh({m}, {v}, {dtype}): seed {seed}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, v, device="cuda", generator=g) * 2
    target = torch.randint(0, v, (m,), device="cuda", generator=g)
    rows = torch.arange(0, m, confident_every, device="cuda")
    x[rows, target[rows]] = x[rows].amax(-1) + 10
    target[1::ignore_every] = -100
    return x.to(dtype), target


def takes_the_cpp_step(dtype, weight) -> bool:
    """Whether a reduced loss's training step on these logits runs on the C++ fast
    path (native/launch.cpp): without class weights, for logits whose gradient the
    forward computes, where the extension is built."""
    return weight is None and not config.ce_gradient_in_backward(dtype) \
        and ops.native_module() is not None


def reference(x, target, weight=None, ignore_index=-100, label_smoothing=0.0,
              lse_square_scale=0.0, softcap=0.0):
    """Per-row loss, lse, gradient in fp64 from the logits as stored."""
    loss, lse, grad = ops.cross_entropy_reference(
        x.double(), target, None if weight is None else weight.double(), ignore_index,
        label_smoothing, lse_square_scale, softcap or 0.0)
    return loss, lse, grad


def check_true_class_gradient(grad, ref_grad, x, target, rel):
    """Confident rows: d loss / d x_t = p_t - 1 is tiny; it must keep its relative
    precision, not drown in the rounding of p_t ~ 1."""
    kept = (target >= 0).nonzero()[:, 0]
    t = target[kept]
    got = grad[kept, t].double()
    want = ref_grad[kept, t]
    # below the normal range the dtype itself has only absolute precision (fp16
    # subnormals step by 6e-8): allow one subnormal step on top of the relative bound
    info = torch.finfo(grad.dtype)
    bad = (got - want).abs() > rel * want.abs() + info.smallest_normal * info.eps
    assert not bad.any(), (f"true-class gradient off at rows {kept[bad][:5].tolist()}: "
                           f"{got[bad][:5].tolist()} vs {want[bad][:5].tolist()}")


def check_gradient_values(grad, ref, target, dtype, floor):
    """Every gradient value but the targets' (check_true_class_gradient) against fp64 to
    its dtype's rounding (bf16 2^-7, fp16 2^-9 relative, fp16's subnormal step): a
    whole-tensor norm would pass wrong values of the many tiny ones. ``floor``: the size
    of the terms that cancel in a value (label smoothing's eps / C times the row's
    scale), which its error scales with."""
    rel = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-9}[dtype]
    info = torch.finfo(dtype)
    bound = rel * (ref.abs() + floor) + info.smallest_normal * info.eps
    bad = (grad.double() - ref).abs() > bound
    kept = (target >= 0).nonzero()[:, 0]
    bad[kept, target[kept]] = False
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"{int(bad.sum())} gradient values off; first at {idx}: "
                             f"{grad[idx].item()!r} vs {ref[idx].item()!r}")


def check_fused_forward(x, target, weight, options, dtype):
    """The forward with the gradient, and the loss alone (long rows are streamed from
    global memory instead of staged), on poisoned outputs against the reference, a
    16-bit gradient value by value (label smoothing's eps / C times the largest class
    weight: the floor of its cancelling terms); returns the row weights."""
    poison_allocator(torch.empty(2, x.shape[0], device="cuda"),
                     torch.empty(x.shape[0], device="cuda"), x)
    (loss, weights), lse, grad = ops.cross_entropy_forward(x, target, weight, *options, True)
    ref_loss, ref_lse, ref_grad = reference(x, target, weight, *options)
    assert_close(loss, ref_loss, LOSS_TOL, scale=LOSS_SCALE, name="loss")
    assert_close(lse, ref_lse, LOSS_TOL, scale=LOSS_SCALE, name="lse")
    assert_close(grad, ref_grad, dtype, scale=2.0, name="grad")
    if dtype != torch.float32:
        largest = 1.0 if weight is None else weight.max().item()
        check_gradient_values(grad, ref_grad, target, dtype, options[1] / x.shape[1] * largest)
    (loss_only, _), lse_only, _ = ops.cross_entropy_forward(x, target, weight, *options, False)
    assert_close(loss_only, ref_loss, LOSS_TOL, scale=LOSS_SCALE, name="loss only")
    assert_close(lse_only, ref_lse, LOSS_TOL, scale=LOSS_SCALE, name="lse only")
    return weights


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", VOCABS)
def test_loss_and_gradient(v, dtype):
    m = 37 if v <= 151936 else 7
    x, target = fresh(m, v, dtype)
    poison_allocator(torch.empty(2, m, device="cuda"), torch.empty(m, device="cuda"), x)
    (loss, weights), lse, grad = ops.cross_entropy_forward(x, target, None, -100, 0.0, 0.0, 0.0,
                                                           True)
    ref_loss, ref_lse, ref_grad = reference(x, target)
    assert_close(loss, ref_loss, LOSS_TOL, scale=LOSS_SCALE, name="loss")
    assert torch.equal(weights, ops.row_weights(target, None, -100, v, torch.float32))
    assert_close(lse, ref_lse, LOSS_TOL, scale=LOSS_SCALE, name="lse")
    assert_close(grad, ref_grad, dtype, scale=2.0, name="grad")
    check_true_class_gradient(grad, ref_grad, x, target, 2e-2 if dtype != torch.float32 else 2e-3)
    if dtype != torch.float32:
        check_gradient_values(grad, ref_grad, target, dtype, 0.0)
    # loss only: same loss and lse
    (loss_only, _), lse_only, empty = ops.cross_entropy_forward(x, target, None, -100, 0.0, 0.0,
                                                                0.0, False)
    assert empty.numel() == 0
    assert_close(loss_only, ref_loss, LOSS_TOL, scale=LOSS_SCALE, name="loss only")


@pytest.mark.parametrize("v", [1024, 4096])
def test_gradient_prefetching_past_two_buffers(monkeypatch, v):
    """The looping gradient of fp32 rows asks L2 for the row block after its second
    staging buffer's (config.ce_prefetches_past_buffers), on a grid held to two row
    blocks so that the prefetches land inside the tensor, against the fp64 reference."""
    assert ops.forward_config(v, torch.float32, False, True).l2_prefetch == 1
    monkeypatch.setattr(ops, "_forward_plans", {})
    monkeypatch.setattr(ops, "resident_row_blocks", lambda kernel, device: 2)
    x, target = fresh(64, v, torch.float32)
    (loss, _), lse, grad = ops.cross_entropy_forward(x, target, None, -100, 0.0, 0.0, 0.0, True)
    ref_loss, ref_lse, ref_grad = reference(x, target)
    assert_close(loss, ref_loss, LOSS_TOL, scale=LOSS_SCALE, name="loss")
    assert_close(lse, ref_lse, LOSS_TOL, scale=LOSS_SCALE, name="lse")
    assert_close(grad, ref_grad, torch.float32, scale=2.0, name="grad")
    check_true_class_gradient(grad, ref_grad, x, target, 2e-3)


FLAGS = list(itertools.product([False, True], repeat=4))  # weighted, smoothing, zloss, softcap


@pytest.mark.parametrize("v,dtype", [(4096, torch.float32), (50257, torch.bfloat16),
                                     (262145, torch.float16), (16384, torch.float16),
                                     (151936, torch.bfloat16)])
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "w{}s{}z{}c{}".format(*map(int, f)))
def test_every_option(v, dtype, flags):
    """Every combination of the options, on rows kept in registers over a cluster (fp16
    16384), on bf16 151936 (with softcap the logits held in registers with their cap
    shares staged; with class weights and smoothing, the weight row staged beside them,
    the running max), of one-value vectors and in the looping grid."""
    weighted, smoothing, zloss, softcap = flags
    m = 19
    x, target = fresh(m, v, dtype)
    weight = torch.rand(v, device="cuda") + 0.5 if weighted else None
    options = (-100, 0.1 if smoothing else 0.0, 1e-3 if zloss else 0.0, 30.0 if softcap else 0.0)
    weights = check_fused_forward(x, target, weight, options, dtype)
    assert torch.equal(weights, ops.row_weights(target, weight, -100, v, torch.float32))


@pytest.mark.parametrize("v,dtype", [(16384, torch.bfloat16), (8192, torch.float32)])
@pytest.mark.parametrize("flags", FLAGS, ids=lambda f: "w{}s{}z{}c{}".format(*map(int, f)))
def test_every_option_reduced_with_the_gradient(monkeypatch, v, dtype, flags):
    """Every option through the public loss with the gradient, summed and averaged, on
    shares staged in shared memory by the looping grid with two staging buffers (the
    configs of these rows; with softcap the bf16 rows are kept in registers over 2-CTA
    clusters instead). Summed in the kernel, label smoothing without softcap (then
    comparing every value with the target column) was compiled by the CUDA 13 ptxas
    with the thread index read from a register never written
    (report.uninitialized_reads): an illegal instruction on the H200, which no test of
    these rows had run. It sets the target aside now (kernels.cross_entropy,
    smoothing_aside)."""
    weighted, smoothing, zloss, softcap = flags
    calls = []
    monkeypatch.setattr(ops, "reduced_loss_cuda",
                        lambda *a: calls.append(a[7]) or REDUCED_LOSS_CUDA(*a))  # (reduction)
    x, target = fresh(45, v, dtype)
    weight = torch.rand(v, device="cuda") + 0.5 if weighted else None
    kw = dict(label_smoothing=0.1 if smoothing else 0.0, lse_square_scale=1e-3 if zloss else 0.0,
              softcap=30.0 if softcap else None)
    native = takes_the_cpp_step(dtype, weight)
    for reduction in ("mean", "sum"):
        leaf = x.clone().requires_grad_()
        loss = qk.cross_entropy(leaf, target, weight, reduction=reduction, **kw)
        assert (type(loss.grad_fn).__name__ == "CppFunction") == native
        loss.backward()
        xr = x.double().requires_grad_()
        ref = torch_cross_entropy(xr, target, None if weight is None else weight.double(),
                                  reduction=reduction, **kw)
        ref.backward()
        assert_close(loss, ref, LOSS_TOL, scale=LOSS_SCALE, name=reduction)
        assert_close(leaf.grad, xr.grad, dtype, scale=2.0, name=f"grad ({reduction})")
    # summed in the kernel, except with the weight row staged (class weights with
    # smoothing); the C++ step's kernel sums it too, without this Python function
    assert calls == ([] if weighted and smoothing or native else ["mean", "sum"])


CPP_STEP_OPTIONS = {"plain": {}, "smoothing": dict(label_smoothing=0.1),
                    "zloss": dict(lse_square_scale=1e-3), "softcap": dict(softcap=30.0),
                    "wide_softcap": dict(softcap=60.0),
                    "all": dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=30.0)}


@pytest.mark.parametrize("options", list(CPP_STEP_OPTIONS))
@pytest.mark.parametrize("m,v,dtype", [(37, 1000, torch.bfloat16), (45, 16384, torch.bfloat16),
                                       (8, 128256, torch.bfloat16), (64, 4096, torch.float32),
                                       (5, 151936, torch.float32)])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_training_step_on_the_cpp_path(reduction, m, v, dtype, options):
    """A reduced loss with the gradient (no class weights, bf16 / fp32) runs on the C++
    fast path (native/launch.cpp): the mean's denominator, the loss + gradient kernel
    and the node's rescale launched from C++. Loss, lse and gradient against fp64 for a
    plain backward, a scaled loss (every row rescaled) and a graph retained for a second
    backward; (3, M/3, V) logits for a view's gradient."""
    if ops.native_module() is None:
        pytest.fail("the C++ fast path did not build")
    kw = CPP_STEP_OPTIONS[options]
    x, target = fresh(m, v, dtype)
    shape = (3, m // 3, v) if m % 3 == 0 else (m, v)
    xr = x.double().requires_grad_()
    ref = torch_cross_entropy(xr, target, None, reduction=reduction, **kw)
    ref.backward()
    ref_lse = reference(x, target, None, -100, kw.get("label_smoothing", 0.0),
                        kw.get("lse_square_scale", 0.0), kw.get("softcap", 0.0))[1]
    for scale in (1.0, 0.37):
        leaf = x.clone().view(shape).requires_grad_()
        poison_allocator(x, x)
        loss, lse = qk.cross_entropy(leaf, target.view(shape[:-1]), reduction=reduction,
                                     return_lse=True, **kw)
        assert type(loss.grad_fn).__name__ == "CppFunction", loss.grad_fn.name()
        assert_close(loss, ref.detach(), LOSS_TOL, scale=LOSS_SCALE, name="loss")
        assert_close(lse.view(-1), ref_lse, LOSS_TOL, scale=LOSS_SCALE, name="lse")
        (loss * scale).backward()
        assert_close(leaf.grad.view(m, v), xr.grad * scale, dtype, scale=2.0,
                     name=f"grad x {scale}")
    leaf = x.clone().requires_grad_()
    loss = qk.cross_entropy(leaf, target, reduction=reduction, **kw)
    first = torch.autograd.grad(loss, leaf, retain_graph=True)[0]
    second = torch.autograd.grad(3.0 * loss, leaf)[0]
    assert_close(first, xr.grad, dtype, scale=2.0, name="retained 1st")
    assert_close(second, 3.0 * xr.grad, dtype, scale=2.0, name="retained 2nd")


def test_cpp_step_with_int32_targets_and_create_graph():
    """The C++ training step with int32 targets (a plan of their own), and backward with
    create_graph=True: the first-order gradient, and an error (not a silent None) when
    it is differentiated again, as the Python path's once_differentiable gives."""
    x, target = fresh(64, 32000, torch.bfloat16)
    xr = x.double().requires_grad_()
    torch_cross_entropy(xr, target, None).backward()
    for targets in (target.int(), target):
        leaf = x.clone().requires_grad_()
        loss = qk.cross_entropy(leaf, targets)
        assert type(loss.grad_fn).__name__ == "CppFunction"
        upstream = torch.tensor(0.5, device="cuda", requires_grad=True)
        (grad,) = torch.autograd.grad(loss, leaf, upstream, create_graph=True)
        assert_close(grad, 0.5 * xr.grad, torch.bfloat16, scale=2.0, name="grad")
        with pytest.raises(RuntimeError, match="once_differentiable"):
            grad.float().sum().backward()


@pytest.mark.parametrize("v,dtype", [(4096, torch.float32), (128256, torch.bfloat16),
                                     (151936, torch.float32), (16384, torch.bfloat16),
                                     (151936, torch.bfloat16), (16383, torch.bfloat16),
                                     (524288, torch.bfloat16), (262144, torch.bfloat16)])
def test_softcap_of_infinite_and_nan_logits(v, dtype):
    """softcap caps +-inf logits at +-s (a finite loss and gradient, as torch's tanh
    gives: a set-aside target among them too); a NaN logit makes its row's loss, lse
    and gradient NaN. bf16 16384 columns keep their cap shares in registers between the
    passes, bf16 128256, 151936 and 262144 stage them (their logits held in registers,
    262144's NaN in a chunk whose reciprocal or sum terms are on the FMA pipe); fp32
    151936 re-cap them from shared memory, bf16 16383 (the looping grid) and 524288
    with the reciprocal on the FMA pipe, whose clamp meets the +inf
    (kernels.cross_entropy.fma_reciprocal). A negative softcap is the same cap
    (s tanh(x / s) is even in s); one above config.CE_FIXED_MAX_SOFTCAP keeps the
    running max (kernels.cross_entropy, fixed_max)."""
    m, s = 8, 30.0
    x, target = fresh(m, v, dtype)  # rows 0 and 3 confident, 1 and 6 ignored
    x[0, (target[0] + 1) % v] = math.inf
    x[2, 3] = -math.inf
    x[3, target[3]] = math.inf  # the target itself
    x[4, :5] = -math.inf
    x[5, v - 1] = math.nan
    ref_loss = reference(x, target, None, -100, 0.1, 1e-3, s)[0]
    assert torch.isnan(ref_loss[5]) and torch.isfinite(ref_loss[[0, 2, 3, 4]]).all()
    for cap in (s, -s, config.CE_FIXED_MAX_SOFTCAP + 10.0):
        check_fused_forward(x, target, None, (-100, 0.1, 1e-3, cap), dtype)


@pytest.mark.parametrize("v,dtype", [(65536, torch.bfloat16), (100000, torch.float16),
                                     (151936, torch.bfloat16), (262144, torch.bfloat16)])
@pytest.mark.parametrize("smoothing,zloss", [(0.0, 0.0), (0.1, 1e-3)])
def test_held_rows_stage_their_cap_shares(v, dtype, smoothing, zloss):
    """Long 16-bit rows with a softcap taken as the fixed max hold their logits in
    registers and stage the cap shares in shared memory for the gradient
    (config.HELD_SHARES_MIN_COLS; the kernel's flag checked): loss, lse and gradient
    against fp64, with targets at the row's first and last columns, either side of every
    CTA's and chunk's first column and spread over the row, confident rows (target 10
    above the max) and ignored ones; padded rows (100000, 151936) too."""
    cfg, flags = ops.variant(v, dtype, False, weighted=False, smoothing=smoothing > 0,
                             zloss=zloss > 0, softcap=30.0, write_grad=True)
    assert ops.forward_kernel_object(cfg, dtype, **flags).stages_cap_shares
    starts = [k * cfg.cols_per_chunk for k in range(cfg.num_chunks * cfg.cluster_size)]
    picks = sorted({c for start in starts for c in (start - 1, start) if 0 <= c < v} | {v - 1})
    m = len(picks) + 9
    x, _ = fresh(m, v, dtype)
    spread = torch.linspace(0, v - 1, m - len(picks), device="cuda").long()
    target = torch.cat([torch.tensor(picks, device="cuda"), spread])
    confident = torch.arange(0, m, 3, device="cuda")
    x[confident, target[confident]] = (x[confident].float().amax(-1) + 10).to(dtype)
    target[1::7] = -100
    check_fused_forward(x, target, None, (-100, smoothing, zloss, 30.0), dtype)


@pytest.mark.parametrize("v,dtype", [(1000, torch.float16), (1000, torch.bfloat16),
                                     (4000, torch.float32), (10000, torch.bfloat16),
                                     (128256, torch.bfloat16), (151936, torch.bfloat16),
                                     (151936, torch.float32), (262144, torch.bfloat16)])
def test_softcap_counts_its_placeholders(v, dtype):
    """With softcap the set-aside target and the padding past the row end cap to -s and
    are counted out of each thread's sums (kernels.cross_entropy, capped_placeholders).
    Rows whose every logit caps to -s weigh each class as much as a placeholder, so one
    miscounted placeholder moves lse by 1/C and the smoothing term by 3/C at C = 1000;
    rows of one large logit over such a floor, at the target or elsewhere, too. The
    largest softcap that takes s as the row max (config.CE_FIXED_MAX_SOFTCAP, floor
    terms exp(-2 s) ~ 1e-35) and one above it, too. Under the fixed max these take
    their sums from the cap shares (sums_from_share): bf16 128256 and 151936 (padded)
    held in registers with their shares staged, and 262144, whose set-aside target's
    term may be summed by fma_exp2 and taken out by MUFU.EX2 (sums_on_fma); 1000,
    4000, 10000 (over a 2-CTA cluster) kept in registers."""
    m = 12
    x, target = fresh(m, v, dtype)  # rows 1, 6 and 11 ignored
    x[:] = -1e4
    x[4, target[4]] = 5.0  # the target alone above the floor
    x[5, (target[5] + 7) % v] = 5.0  # another class alone above it
    x[8:] = torch.randn(m - 8, v, device="cuda").to(dtype) - 60.0  # all below -s/2
    for s in (30.0, config.CE_FIXED_MAX_SOFTCAP, config.CE_FIXED_MAX_SOFTCAP + 10.0):
        check_fused_forward(x, target, None, (-100, 0.1, 1e-3, s), dtype)


@pytest.mark.parametrize("v,dtype", [(128256, torch.bfloat16), (151936, torch.float32),
                                     (262144, torch.bfloat16)])
def test_softcapped_confident_rows_keep_relative_precision(v, dtype):
    """Losses of 1e-8 to 2e-3 (targets 10 to 25 over a floor of -10; 262143 floor terms
    at the smallest margin give 1.1e-3) to 1e-3 relative, with a softcap taken as the
    row max (30, 40: the loss from the non-target share) and past that bound (50: the
    running max)."""
    m = 8
    x = torch.full((m, v), -10.0, device="cuda", dtype=dtype)
    target = torch.arange(m, device="cuda") * 997 % v
    x[torch.arange(m), target] = torch.linspace(10.0, 25.0, m, device="cuda").to(dtype)
    for s in (30.0, config.CE_FIXED_MAX_SOFTCAP, config.CE_FIXED_MAX_SOFTCAP + 10.0):
        for grad in (False, True):
            (loss, _), _, _ = ops.cross_entropy_forward(x, target, None, -100, 0.0, 0.0, s, grad)
            ref = reference(x, target, None, -100, 0.0, 0.0, s)[0]
            assert (ref > 0).all() and (ref < 2e-3).all()
            torch.testing.assert_close(loss.double(), ref, rtol=1e-3, atol=0.0)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("target_dtype", [torch.int64, torch.int32])
def test_public_function_autograd(reduction, inplace, dtype, target_dtype):
    """Every option at once (ignore_index, weights, smoothing, z-loss, softcap), a
    non-uniform upstream gradient and the loss used twice, against torch in fp64."""
    v = 32003
    x, target = fresh(45, v, dtype)
    weight = torch.rand(v, device="cuda") + 0.5
    kw = dict(reduction=reduction, label_smoothing=0.05, lse_square_scale=1e-4, softcap=20.0)
    leaf = x.clone().requires_grad_()
    logits = leaf * 1 if inplace else leaf
    ours = qk.cross_entropy(logits, target.to(target_dtype), weight, inplace_backward=inplace, **kw)
    xr = x.double().requires_grad_()
    ref = torch_cross_entropy(xr, target, weight.double(), **kw)
    assert_close(ours, ref, LOSS_TOL, scale=LOSS_SCALE, name="loss")
    upstream = torch.rand_like(ours) + 0.5
    ((ours * upstream).sum() + 2 * ours.sum()).backward()
    ((ref * upstream.double()).sum() + 2 * ref.sum()).backward()
    assert_close(leaf.grad, xr.grad, dtype, scale=2.0, name="grad")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_fast_and_rescaled_paths(reduction, inplace, dtype):
    """Plain backward (the gradient computed in the forward is already right: the
    backward only checks the per-row upstream gradients), a scaled loss (every row
    rescaled by the CUDA kernel), and a retained graph run twice, against fp64 torch."""
    v = 50257
    x, target = fresh(37, v, dtype)
    weight = torch.rand(v, device="cuda") + 0.5
    xr = x.double().requires_grad_()
    F.cross_entropy(xr, target, weight.double(), reduction=reduction).backward()
    check_cross_entropy_backward_paths(x, target, weight, reduction, inplace, xr.grad, dtype,
                                       tol_scale=2.0, loss_scale=0.3, reuse_scale=3.0)


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_plain_backward_moves_no_gradient_bytes(monkeypatch, reduction, weighted):
    """On CUDA too (the backward compares the reduced loss's upstream gradient with 1):
    helpers.check_plain_backward_rescales_no_row, through the CUDA rescale's launch."""
    x, target = fresh(64, 4096, torch.bfloat16)
    weight = torch.rand(4096, device="cuda") + 0.5 if weighted else None
    # the Python step's launch is what is counted (the C++ step launches the same
    # rescale kernel from C++)
    monkeypatch.setattr(ops, "native_module", lambda: None)
    check_plain_backward_rescales_no_row(monkeypatch, "rescale_launch",
                                         x, target, weight, reduction)


@pytest.mark.parametrize("m", [0, 1, 37, 4097, 131073, 2_000_003])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("target_dtype", [torch.int32, torch.int64])
def test_mean_denominator_kernel(m, weighted, target_dtype):
    """kernels.mean_denominator against the torch ops it replaces on the eager path
    (_mean_denominator, then torch.reciprocal): ignored rows and bad targets (negative,
    past C: counted, their weight's index clamped), bitwise for a count and for the
    reciprocal of the same D (IEEE division), within fp32 rounding for summed weights
    (another order), bitwise the same on a second call; every target ignored gives
    D = 0 and 1 / D = inf."""
    v = 1000
    g = torch.Generator(device="cuda").manual_seed(m)
    target = torch.randint(0, v, (m,), device="cuda", generator=g)
    target[::5], target[1::97], target[2::89] = -100, v + 3, -7
    target = target.to(target_dtype)
    weight = torch.rand(v, device="cuda", generator=g) + 0.5 if weighted else None
    den, inverse = ops._mean_denominator_cuda(target, weight, -100).split(1)
    ref = ops._mean_denominator(target, weight, -100, v, torch.float32).view(1)
    if weighted:
        torch.testing.assert_close(den, ref, rtol=1e-6, atol=0.0)
    else:
        assert torch.equal(den, ref)
    assert torch.equal(inverse, torch.reciprocal(den))
    again = ops._mean_denominator_cuda(target, weight, -100)[:1]
    assert torch.equal(den, again)
    den, inverse = ops._mean_denominator_cuda(torch.full_like(target, -100), weight, -100)
    assert den.item() == 0.0 and inverse.item() == math.inf


@pytest.mark.parametrize("v", [1001, 524288])
def test_rescale_kernel_matches_cpu_op(v):
    """The CUDA rescale against the CPU op: matching, differing, ignored, bad-target
    and held-0 rows; a ragged V and one of several chunks per CTA."""
    grad = torch.randn(8, v, device="cuda", dtype=torch.bfloat16)
    target = torch.tensor([1, -100, 3, 4, v + 999, 0, 5, 6], device="cuda")
    held = torch.tensor([0.5, 0.5, 0.5, 0.0, 0.5, 0.5, 2.0, 1.0], device="cuda")
    dloss = torch.tensor([0.5, 2.0, 1.5, 1.0, 3.0, 0.0, 2.0, -1.0], device="cuda")
    ours = grad.clone()
    torch.ops.quack_kernels.cross_entropy_rescale_grad_(ours, target, dloss, held, -100)
    ref = grad.cpu()
    torch.ops.quack_kernels.cross_entropy_rescale_grad_(ref, target.cpu(), dloss.cpu(),
                                                         held.cpu(), -100)
    torch.testing.assert_close(ours.cpu(), ref, equal_nan=True, rtol=0, atol=0)


def test_leading_dims_module_and_lse():
    x, target = fresh(24, 1000, torch.bfloat16)
    x3, t3 = x.view(2, 12, 1000), target.view(2, 12)
    loss, lse = qk.cross_entropy(x3, t3, reduction="none", return_lse=True)
    assert loss.shape == lse.shape == (2, 12)
    ref_loss, ref_lse, _ = reference(x, target)
    assert_close(loss.reshape(-1), ref_loss, LOSS_TOL, scale=LOSS_SCALE)
    assert_close(lse.reshape(-1), ref_lse, LOSS_TOL, scale=LOSS_SCALE)
    module = qk.nn.CrossEntropyLoss(label_smoothing=0.1)
    assert_close(module(x3, t3), F.cross_entropy(x.double(), target, label_smoothing=0.1),
                 LOSS_TOL, scale=LOSS_SCALE)


def test_empty_all_ignored_and_bad_targets():
    empty = torch.empty(0, 50257, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    no_target = torch.empty(0, dtype=torch.long, device="cuda")
    assert torch.isnan(qk.cross_entropy(empty, no_target))
    qk.cross_entropy(empty, no_target, reduction="sum").backward()
    assert empty.grad.shape == (0, 50257)

    x, _ = fresh(8, 3000, torch.float32)
    x.requires_grad_()
    ignored = torch.full((8,), -100, device="cuda")
    loss = qk.cross_entropy(x, ignored, label_smoothing=0.1)
    loss.backward()
    assert torch.isnan(loss) and torch.equal(x.grad, torch.zeros_like(x))

    x, target = fresh(8, 3000, torch.bfloat16)
    target[2], target[5] = 3000, -7
    (loss, _), lse, grad = ops.cross_entropy_forward(x, target, None, -100, 0.0, 0.0, 0.0, True)
    bad = torch.zeros(8, dtype=torch.bool, device="cuda")
    bad[[2, 5]] = True
    assert torch.isnan(loss[bad]).all() and torch.isfinite(loss[~bad]).all()
    assert torch.isnan(grad[bad]).all() and torch.isfinite(grad[~bad]).all()
    assert torch.isfinite(lse).all()
    assert torch.isnan(qk.cross_entropy(x, target))
    with pytest.raises(ValueError, match="outside"):
        qk.cross_entropy(x, target, check_targets=True)
    with pytest.raises(ValueError, match="one device"):
        qk.cross_entropy(x, target.cpu())
    with pytest.raises(ValueError, match="target shape"):
        qk.cross_entropy(x, target[:4])
    # the training step's mean reads targets and weights first (its denominator): the
    # same clear errors before any kernel runs
    leaf = x.clone().requires_grad_()
    with pytest.raises(TypeError, match="int64 or torch.int32"):
        qk.cross_entropy(leaf, target.to(torch.int16))
    with pytest.raises(ValueError, match="weight must have shape"):
        qk.cross_entropy(leaf, target, torch.ones(2, 3000, device="cuda"))
    with pytest.raises(ValueError, match="weight must have shape"):
        qk.cross_entropy(leaf, target, torch.ones(0, device="cuda"))


@pytest.mark.parametrize("v", [3000, 151936])
def test_loss_alone_bad_and_in_row_ignored_targets(v):
    """The loss alone (151936 columns: rows streamed from global memory, the target set
    aside in registers through a clamped z_t load; 3000: staged): a target past the row
    or negative gives NaN in its row only, an ignore_index inside [0, v) a zero loss
    and weight, every other row the reference loss."""
    x, target = fresh(8, v, torch.bfloat16, ignore_every=1000)
    target[1], target[2], target[5], target[6] = 0, v, -7, 5
    assert ops.forward_config(v, x.dtype, False, False, 8).staging == \
        ("global" if v == 151936 else "smem")
    (loss, weight), lse, _ = ops.cross_entropy_forward(x, target, None, 5, 0.0, 0.0, 0.0, False)
    bad = torch.zeros(8, dtype=torch.bool, device="cuda")
    bad[[2, 5]] = True
    assert torch.isnan(loss[bad]).all() and torch.isfinite(lse).all()
    assert loss[6] == 0 and weight[6] == 0
    ref_loss, ref_lse, _ = reference(x[~bad], target[~bad], ignore_index=5)
    assert_close(loss[~bad], ref_loss, LOSS_TOL, scale=LOSS_SCALE)
    assert_close(lse[~bad], ref_lse, LOSS_TOL, scale=LOSS_SCALE)


@pytest.mark.parametrize("m,v,dtype", [(4096, 7, torch.float16), (300000, 7, torch.float32),
                                       (9_000_000, 7, torch.float32),
                                       (4000, 1000, torch.bfloat16),
                                       (512, 4096, torch.bfloat16), (9000, 4096, torch.bfloat16),
                                       (3, 151936, torch.bfloat16),
                                       (40, 262145, torch.float32)])
@pytest.mark.parametrize("options", ["plain", "weighted", "weighted_smoothing", "zloss_softcap"])
def test_loss_reduced_in_the_kernel(monkeypatch, m, v, dtype, options):
    """The eager loss with a sum or mean is reduced over the grid by the kernel
    (reduced_loss_cuda, GridSum.grid_sum), alone and with the gradient (not with the
    weight row staged, class weights with label smoothing: torch's reduction, checked
    the same way): thousands of CTAs of
    short rows (two groups of gathered CTAs; 35000 CTAs in the most groups, of more than
    one round of loads each), the looping gradient
    grid, streamed rows split over a cluster, staged weights; against torch in fp64 and
    the op path's reduction of the row losses, bitwise the same on a second call (the
    stream's partials reused: zeroed by the gathering CTAs), NaN / 0 when every target
    is ignored. Its result from a poisoned block, so a result never written shows."""
    calls = []
    monkeypatch.setattr(ops, "reduced_loss_cuda",
                        lambda *a: calls.append(a[7]) or REDUCED_LOSS_CUDA(*a))  # (reduction)
    x, target = fresh(m, v, dtype)
    weight = torch.rand(v, device="cuda") + 0.5 if options.startswith("weighted") else None
    kw = dict(weighted_smoothing=dict(label_smoothing=0.1),
              zloss_softcap=dict(lse_square_scale=1e-3, softcap=20.0)).get(options, {})
    op_args = (-100, kw.get("label_smoothing", 0.0), kw.get("lse_square_scale", 0.0),
               kw.get("softcap", 0.0), False)
    (losses, row_weights), lse_like, _ = ops.cross_entropy_forward(x, target, weight, *op_args)
    stats_like = torch.stack([losses, row_weights])  # (kept alive: only the poisoned blocks are free)
    word = torch.empty(1, device="cuda")  # the 0-d result: a small block
    for reduction in ("sum", "mean"):
        poison_allocator(stats_like, lse_like, word, word)
        ours, lse = qk.cross_entropy(x, target, weight, reduction=reduction, return_lse=True,
                                     **kw)
        ref = torch_cross_entropy(x.double(), target, None if weight is None else weight.double(),
                                  reduction=reduction, **kw)
        assert_close(ours, ref, LOSS_TOL, scale=LOSS_SCALE, name=reduction)
        # the fp64 sum of the op's own row losses: one row left out or added twice shows
        by_op = losses.double().sum() / (row_weights.double().sum() if reduction == "mean"
                                         else 1.0)
        torch.testing.assert_close(ours.double(), by_op, rtol=2e-5, atol=0.0)
        poison_allocator(stats_like, lse_like, word, word)
        assert torch.equal(ours, qk.cross_entropy(x, target, weight, reduction=reduction, **kw))
        assert ours.shape == () and lse.shape == (m,)
        # each stream's partials are zeroed again by the gathering CTA, ready for the next
        assert all(int(torch.count_nonzero(p)) == 0 for p in ops._partials.values())
    for reduction in ("sum", "mean"):  # with the gradient: the looping grid among them
        runs = []
        for _ in range(2):
            leaf = x.clone().requires_grad_()
            trained = qk.cross_entropy(leaf, target, weight, reduction=reduction, **kw)
            trained.backward()
            runs.append((trained.detach(), leaf.grad))
        assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
        by_op = losses.double().sum() / (row_weights.double().sum() if reduction == "mean"
                                         else 1.0)
        torch.testing.assert_close(trained.double(), by_op, rtol=2e-5, atol=0.0)
    xr = x.double().requires_grad_()
    torch_cross_entropy(xr, target, None if weight is None else weight.double(), **kw).backward()
    assert_close(trained, ref, LOSS_TOL, scale=LOSS_SCALE, name="mean with the gradient")
    assert_close(leaf.grad, xr.grad, dtype, scale=2.0, name="grad")
    halved = qk.cross_entropy(leaf, target, weight, **kw)
    halved *= 0.5  # (in place, as gradient accumulation scales a loss: not a view)
    leaf.grad = None
    halved.backward()
    assert_close(leaf.grad, xr.grad / 2, dtype, scale=2.0, name="grad of the halved loss")
    ignored = torch.full_like(target, -100)
    assert torch.isnan(qk.cross_entropy(x, ignored, weight, **kw))
    assert qk.cross_entropy(x, ignored, weight, reduction="sum", **kw) == 0
    for reduction in ("mean", "sum"):  # every row ignored, with the gradient
        leaf.grad = None
        trained = qk.cross_entropy(leaf, ignored, weight, reduction=reduction, **kw)
        trained.backward()
        assert torch.isnan(trained) if reduction == "mean" else trained == 0
        assert int(torch.count_nonzero(leaf.grad)) == 0
    # the C++ step (no class weights) reduces in its own kernel launch, not through
    # reduced_loss_cuda
    native = takes_the_cpp_step(dtype, weight)
    assert (type(trained.grad_fn).__name__ == "CppFunction") == native

    def stepped(reductions):
        return [] if native else reductions

    in_kernel = ["sum"] * 2 + ["mean"] * 2 + stepped(["sum"] * 2 + ["mean"] * 3) \
        + ["mean", "sum"] + stepped(["mean", "sum"])
    assert calls == ([] if options == "weighted_smoothing" else in_kernel)


def test_outputs_fully_written():
    """Outputs are allocated from NaN-poisoned blocks, so every unwritten element shows."""
    for v in (7, 50257, 262145):
        x, target = fresh(33, v, torch.bfloat16, ignore_every=1000)
        stats = torch.empty(2, 33, dtype=torch.float32, device="cuda")
        poison_allocator(stats, stats[0], x)  # stats, lse, grad in allocation order
        (loss, weights), lse, grad = ops.cross_entropy_forward(x, target, None, -100, 0.1, 0.0,
                                                               0.0, True)
        assert torch.isfinite(loss).all() and torch.isfinite(lse).all()
        assert torch.isfinite(weights).all() and torch.isfinite(grad).all()


def test_strided_and_misaligned_logits():
    x, target = fresh(16, 4099, torch.bfloat16)
    wide = torch.zeros(16, 4110, device="cuda", dtype=torch.bfloat16)
    wide[:, 3:4102] = x
    view = wide[:, 3:4102]  # misaligned base and row stride
    (loss, _), lse, grad = ops.cross_entropy_forward(view, target, None, -100, 0.0, 0.0, 0.0, True)
    ref_loss, _, ref_grad = reference(x, target)
    assert_close(loss, ref_loss, LOSS_TOL, scale=LOSS_SCALE)
    assert_close(grad, ref_grad, torch.bfloat16, scale=2.0)


@pytest.mark.parametrize("offset", [2, 4])
def test_held_rows_of_narrow_accesses_and_reduced_weighted_losses(offset):
    """Held cap shares (config.HELD_SHARES_MIN_COLS) on rows read in 4- or 8-byte
    vectors (a view's base and row stride ``offset`` bf16 elements off 16 bytes), and,
    through the public loss, with class weights and the loss summed or averaged in the
    kernel, against fp64."""
    m, v, dtype = 12, 65536, torch.bfloat16
    x, target = fresh(m, v, dtype)
    wide = torch.zeros(m, v + 8, device="cuda", dtype=dtype)
    wide[:, offset:offset + v] = x
    view = wide[:, offset:offset + v]
    cfg = ops.forward_config(v, dtype, False, True, ops.vector_limit(view), True,
                             held_shares=True)
    assert cfg.vec == offset and cfg.register_chunks == cfg.num_chunks
    check_fused_forward(view, target, None, (-100, 0.1, 1e-3, 30.0), dtype)
    weight = torch.rand(v, device="cuda") + 0.5
    kw = dict(lse_square_scale=1e-3, softcap=30.0)
    for reduction in ("sum", "mean"):
        leaf = x.clone().requires_grad_()
        loss = qk.cross_entropy(leaf, target, weight, reduction=reduction, **kw)
        loss.backward()
        xr = x.double().requires_grad_()
        ref = torch_cross_entropy(xr, target, weight.double(), reduction=reduction, **kw)
        ref.backward()
        assert_close(loss, ref, LOSS_TOL, scale=LOSS_SCALE, name=reduction)
        assert_close(leaf.grad, xr.grad, dtype, scale=2.0, name=f"grad ({reduction})")


def test_torch_compile_fullgraph():
    x, target = fresh(64, 32000, torch.bfloat16)
    weight = torch.rand(32000, device="cuda") + 0.5

    def step(logits, t):
        return qk.cross_entropy(logits, t, weight, label_smoothing=0.1, lse_square_scale=1e-4)

    for dynamic in (False, True):
        compiled = torch.compile(step, fullgraph=True, dynamic=dynamic)
        for m in (64, 40):
            a = x[:m].clone().requires_grad_()
            out = compiled(a, target[:m])
            out.backward()
            ar = x[:m].double().requires_grad_()
            ref = torch_cross_entropy(ar, target[:m], weight.double(), label_smoothing=0.1,
                                      lse_square_scale=1e-4)
            ref.backward()
            assert_close(out, ref, LOSS_TOL, scale=LOSS_SCALE)
            assert_close(a.grad, ar.grad, torch.bfloat16, scale=2.0)


@pytest.mark.parametrize("cold_constants", [False, True])
def test_cuda_graph_capture(monkeypatch, cold_constants):
    """Captured after a warm-up; ``cold_constants``: with the cached grid partials and
    unit scales dropped first, so the capture is their first use (they must not be cached
    then: a tensor made during capture is filled only at replay). An eager step after
    the replays checks the same."""
    x, target = fresh(128, 50257, torch.bfloat16)
    static_x = x.clone().requires_grad_()

    def step(**options):
        loss = qk.cross_entropy(static_x, target, **options)
        (grad,) = torch.autograd.grad(loss, static_x)
        return loss, grad

    def check(loss, grad, inputs, **options):
        xr = inputs.double().requires_grad_()
        ref = F.cross_entropy(xr, target, **options)
        ref.backward()
        assert_close(loss, ref, LOSS_TOL, scale=LOSS_SCALE)
        assert_close(grad, xr.grad, torch.bfloat16, scale=2.0)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step(label_smoothing=0.1)  # compile and warm up outside the capture
        step()
        if cold_constants:
            monkeypatch.setattr(ops, "_partials", {})
            monkeypatch.setattr(ops, "_units", {})
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            smoothed = step(label_smoothing=0.1)
            plain = step()  # (the mean reduced in the kernel: its partials)
    torch.cuda.current_stream().wait_stream(s)
    assert not ops._units and not ops._partials if cold_constants else ops._units
    new_x, _ = fresh(128, 50257, torch.bfloat16, seed=1)
    with torch.no_grad():
        static_x.copy_(new_x)
    for _ in range(2):
        g.replay()
    torch.cuda.synchronize()
    check(*smoothed, new_x, label_smoothing=0.1)
    check(*plain, new_x)
    check(*step(), new_x)


def test_more_than_2_31_elements():
    m, v = 8193, 262144  # 2^31 + 2^18 elements, 4 GiB in bf16
    x = torch.randn(m, v, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, v, (m,), device="cuda")
    target[-1] = v - 1
    (loss, _), lse, grad = ops.cross_entropy_forward(x, target, None, -100, 0.0, 0.0, 0.0, True)
    rows = slice(m - 3, m)
    ref_loss, _, ref_grad = reference(x[rows], target[rows])
    assert_close(loss[rows], ref_loss, LOSS_TOL, scale=LOSS_SCALE)
    assert_close(grad[rows], ref_grad, torch.bfloat16, scale=2.0)
    del grad
    # in place over the logits
    x_last = x[rows].clone()
    (loss2, _), _ = ops.cross_entropy_forward_inplace(x, target, None, -100, 0.0, 0.0, 0.0)
    assert torch.equal(loss2, loss)
    assert_close(x[rows], reference(x_last, target[rows])[2], torch.bfloat16, scale=2.0)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fp16_gradient_in_the_backward(inplace, reduction):
    """fp16 logits: the gradient computed in the backward for the actual upstream
    gradient (a loss scaler's 1024 here), as precise as torch's fp32 gradient rounded
    to fp16; a retained graph runs it twice."""
    x, target = fresh(2048, 8192, torch.float16)
    ref = x.double().requires_grad_()
    ref_loss = F.cross_entropy(ref, target, reduction=reduction)
    upstream = torch.full_like(ref_loss, 1024.0)
    if reduction == "none":
        upstream = upstream * torch.rand_like(upstream)
    ref_loss.backward(upstream)
    leaf = x.clone().requires_grad_()
    logits = leaf * 1  # (a non-leaf: in place overwrites it)
    loss = qk.cross_entropy(logits, target, reduction=reduction, inplace_backward=inplace)
    assert_close(loss, ref_loss.detach(), LOSS_TOL, scale=LOSS_SCALE, name="loss")
    loss.backward(upstream.float(), retain_graph=True)
    error = (leaf.grad.double() - ref.grad).norm() / ref.grad.norm()
    assert error < 1e-3, f"relative error {error:.3g}"
    first = leaf.grad.clone()
    loss.backward(upstream.float())
    torch.testing.assert_close(leaf.grad, 2 * first, rtol=1e-3, atol=0)


def test_inplace_backward_invalidates_other_uses_of_the_logits():
    """inplace_backward overwrites the logits in the forward (bf16): a node that saved
    them before (here a product of the logits with themselves) fails in the backward,
    as after any in-place op, instead of reading the gradient as logits."""
    x, target = fresh(64, 4096, torch.bfloat16)
    leaf = x.clone().requires_grad_()
    logits = leaf * 1
    aux = (logits * logits).float().mean()
    loss = qk.cross_entropy(logits, target, inplace_backward=True) + aux
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()



SHIFTED_OPTIONS = {"plain": (-100, 0.0, 0.0, 0.0), "smoothing": (-100, 0.1, 0.0, 0.0),
                   "zloss": (-100, 0.0, 1e-3, 0.0), "capped": (-100, 0.1, 1e-3, 30.0),
                   "capped_wide": (-100, 0.0, 0.0, 50.0)}


@pytest.mark.parametrize("options", list(SHIFTED_OPTIONS))
@pytest.mark.parametrize("v,dtype", [(16385, torch.bfloat16), (32001, torch.float16),
                                     (50257, torch.bfloat16), (131073, torch.bfloat16),
                                     (262143, torch.bfloat16)])
def test_shifted_odd_rows(monkeypatch, v, dtype, options):
    """Odd 16-bit rows read from the 16-byte boundary before each
    (config.shifted_row_share), loss alone and with the gradient, on poisoned outputs:
    25 rows (every shift, 8 rows apart), targets in the rows' first and last columns
    (their edge vectors, shared with the rows beside), the max of some rows there,
    ignored rows (no target column: nothing of the row before may be taken or
    written); every third row alone (row stride 3V: shifted all the same) leaves the
    gradient rows between untouched; the public loss (the C++ step) and the in-place
    backward. The loss alone without softcap or smoothing streams the rows, its loads
    filling the edges."""
    monkeypatch.setattr(config, "SHIFTED_ODD_ROWS", True)
    monkeypatch.setattr(ops, "_forward_plans", {})
    m = 25
    options = SHIFTED_OPTIONS[options]
    x, target = fresh(m, v, dtype, ignore_every=7)  # rows 1, 8, 15, 22 ignored
    target[2::7] = 0
    target[3::7] = v - 1
    x[2::7, 0] = x[2::7].amax(-1) + 10  # confident at the first column
    x[4::7, 0] = x[4::7].amax(-1) + 5  # the max in the first column, not the target
    x[5::7, -1] = x[5::7].amax(-1) + 5
    poison_allocator(torch.empty(2, m, device="cuda"), torch.empty(m, device="cuda"), x)
    check_fused_forward(x, target, None, options, dtype)
    # the plans it ran (by write_grad, the key's last but one): the loss alone shifted,
    # streamed but with softcap or smoothing; the gradient shifted but with softcap where
    # the capped values are kept in registers (up to 50257 columns here)
    plans = {key[-2]: cfg for key, (_, cfg, _) in ops._forward_plans.items()}
    softcap, smoothing = options[3] != 0.0, options[1] != 0.0
    assert plans[False].row_shift
    assert (plans[False].staging == "global") == (not softcap and not smoothing)
    assert plans[True].row_shift == (not softcap or v > 50257), plans[True]

    with monkeypatch.context() as patch:  # every third row, sentinels between
        patch.setattr(ops, "shiftable", lambda *rows: True)
        patch.setattr(ops, "_forward_plans", {})
        sentinel = 7.0
        grad_third = torch.full_like(x, sentinel)
        stats = torch.empty(2, len(x[::3]), device="cuda")
        lse = torch.empty(len(x[::3]), device="cuda")
        ref_loss, ref_lse, ref_grad = reference(x[::3], target[::3], None, *options)
        for grad in (None, grad_third[::3]):  # the loss alone, then with the gradient
            ops._launch(x[::3], target[::3], None, stats, lse, grad, None, *options)
            assert_close(stats[0], ref_loss, LOSS_TOL, scale=LOSS_SCALE, name="loss (thirds)")
            assert_close(lse, ref_lse, LOSS_TOL, scale=LOSS_SCALE, name="lse (thirds)")
        assert_close(grad_third[::3], ref_grad, dtype, scale=2.0, name="grad (every third)")
        check_gradient_values(grad_third[::3], ref_grad, target[::3], dtype, options[1] / v)
        untouched = torch.cat([grad_third[1::3], grad_third[2::3]])
        assert torch.equal(untouched, torch.full_like(untouched, sentinel))

    _, smoothing, zloss, cap = options
    kw = dict(label_smoothing=smoothing, lse_square_scale=zloss, softcap=cap or None)
    xr = x.double().requires_grad_()
    torch_cross_entropy(xr, target, None, **kw).backward()
    for inplace in (False, True):
        leaf = x.clone().requires_grad_()
        poison_allocator(x, x)
        loss = qk.cross_entropy(leaf * 1, target, inplace_backward=inplace, **kw)
        loss.backward()
        assert_close(leaf.grad, xr.grad, dtype, scale=2.0, name=f"grad (in place: {inplace})")
        check_gradient_values(leaf.grad, xr.grad, target, dtype,
                              smoothing / v / (target >= 0).sum())
        check_true_class_gradient(leaf.grad, xr.grad, x, target, 2e-2)
