"""Linear + cross-entropy in chunks of rows: against torch's linear and cross_entropy
(CPU, fp64: every option, reduction, bias, ragged chunks), the op (opcheck, fake
kernel), errors, torch.compile, the chunk heuristic; on a GPU against an fp64
reference."""

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

import quack_kernels as qk
from quack_kernels.primitives import config

from helpers import assert_close, torch_cross_entropy

OPTIONS = [dict(), dict(label_smoothing=0.1, lse_square_scale=1e-3, softcap=5.0)]


def make_case(m=29, h=16, v=37, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(m, h, generator=g, dtype=dtype, device=device)
    weight = torch.randn(v, h, generator=g, dtype=dtype, device=device) / h ** 0.5
    bias = torch.randn(v, generator=g, dtype=dtype, device=device)
    target = torch.randint(0, v, (m,), generator=g, device=device)
    target[::4] = -100
    class_weight = torch.rand(v, generator=g, dtype=dtype, device=device) + 0.5
    return hidden, weight, bias, target, class_weight


def losses_and_grads(fn, hidden, weight, bias, target, upstream):
    """(loss, grads of hidden, weight[, bias]) of ``fn`` for the upstream gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias) if t is not None]
    loss = fn(*leaves[:2], target, *leaves[2:])
    grads = torch.autograd.grad(loss, leaves, upstream(loss))
    return loss.detach(), grads


@pytest.mark.parametrize("reduction,with_bias,weighted,options", list(itertools.product(
    ["mean", "sum", "none"], [False, True], [False, True], range(len(OPTIONS)))))
def test_matches_torch_linear_and_cross_entropy(reduction, with_bias, weighted, options):
    """Chunks of 6 of 29 rows (a short last one) against the unchunked definition; a
    non-uniform upstream gradient for "none" (the backward runs the chunks again)."""
    hidden, weight, bias, target, class_weight = make_case()
    bias = bias if with_bias else None
    class_weight = class_weight if weighted else None
    kw = dict(OPTIONS[options], reduction=reduction)
    g = torch.Generator().manual_seed(1)

    def upstream(loss):
        return torch.randn(loss.shape, generator=g, dtype=loss.dtype) + 1.5

    ours = losses_and_grads(lambda h, w, t, *b: qk.linear_cross_entropy(
        h, w, t, *b, class_weight=class_weight, chunk_rows=6, **kw),
        hidden, weight, bias, target, upstream)
    g.manual_seed(1)
    ref = losses_and_grads(lambda h, w, t, *b: torch_cross_entropy(
        F.linear(h, w, *b), t, class_weight, **kw), hidden, weight, bias, target, upstream)
    assert_close(ours[0], ref[0], torch.float32, name="loss")
    for name, got, want in zip(("hidden", "weight", "bias"), ours[1], ref[1]):
        assert_close(got, want, torch.float32, name=f"grad {name}")


def test_leading_dims_module_and_no_grad():
    hidden, weight, bias, target, _ = make_case(m=24)
    loss_fn = qk.nn.LinearCrossEntropyLoss(reduction="none", chunk_rows=5)
    leaf = hidden.clone().requires_grad_()
    per_row = loss_fn(leaf.view(4, 6, -1), weight, target.view(4, 6), bias)
    assert per_row.shape == (4, 6)
    expected = F.cross_entropy(F.linear(hidden, weight, bias), target, reduction="none")
    torch.testing.assert_close(per_row.view(-1).detach(), expected)
    per_row[0, 0] = 7.0  # a tensor of its own (not a view of the stats), as torch hands out
    per_row.sum().backward()
    with torch.no_grad():
        leaf = hidden.clone().requires_grad_()
        loss = qk.linear_cross_entropy(leaf, weight, target, bias)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(hidden, weight, bias), target))


def test_frozen_weight_and_every_row_ignored():
    """Only the hidden states train (a frozen head): their gradient alone; every
    target ignored: a NaN mean, a zero sum, zero gradients, as torch."""
    hidden, weight, bias, target, _ = make_case()
    leaf = hidden.clone().requires_grad_()
    qk.linear_cross_entropy(leaf, weight, target, bias).backward()
    ref = hidden.clone().requires_grad_()
    F.cross_entropy(F.linear(ref, weight, bias), target).backward()
    torch.testing.assert_close(leaf.grad, ref.grad)
    ignored = torch.full_like(target, -100)
    for reduction in ("mean", "sum"):
        leaf.grad = None
        loss = qk.linear_cross_entropy(leaf, weight, ignored, bias, reduction=reduction)
        loss.backward()
        assert torch.isnan(loss) if reduction == "mean" else loss == 0
        assert int(torch.count_nonzero(leaf.grad)) == 0


def test_zero_rows():
    hidden, weight, bias, target, _ = make_case(m=0)
    leaf_w = weight.clone().requires_grad_()
    assert torch.isnan(qk.linear_cross_entropy(hidden, leaf_w, target, bias))
    loss = qk.linear_cross_entropy(hidden, leaf_w, target, bias, reduction="sum")
    loss.backward()
    assert loss == 0 and int(torch.count_nonzero(leaf_w.grad)) == 0


@pytest.mark.parametrize("accum", [torch.float16, torch.float32])
@pytest.mark.parametrize("m", [0, 29])
def test_fp16_mean_over_no_row(accum, m):
    """fp16 (gradients of the summed losses in the forward, with an fp32 sum): a mean
    with every target ignored, or over no rows, has a NaN loss and zero gradients, as
    torch and the bf16 path (the mean's 1 / 0 must not reach the zero gradients)."""
    hidden, weight, bias, _, _ = make_case(m=m, dtype=torch.float32)
    leaves = [t.half().requires_grad_() for t in (hidden, weight, bias)]
    ignored = torch.full((m,), -100)
    loss = qk.linear_cross_entropy(*leaves[:2], ignored, leaves[2], grad_accum_dtype=accum)
    loss.backward()
    assert torch.isnan(loss)
    for leaf in leaves:
        assert int(torch.count_nonzero(leaf.grad)) == 0, leaf.shape


def test_opcheck_and_fake_kernel():
    from torch._subclasses.fake_tensor import FakeTensorMode

    hidden, weight, bias, target, class_weight = make_case(dtype=torch.float32)
    op = torch.ops.quack_kernels.linear_cross_entropy_forward
    scale = torch.rand(hidden.shape[0]) + 0.5
    for b, cw, gs, wg in ((bias, None, scale, True), (None, class_weight, None, True),
                          (bias, class_weight, scale, True), (bias, None, scale, False)):
        torch.library.opcheck(op, (hidden, weight, b, target, cw, -100, 0.1, 1e-3, 3.0, gs, wg, 7,
                                    torch.float32))
    with FakeTensorMode():
        h = torch.empty(9, 8, dtype=torch.bfloat16)
        w = torch.empty(11, 8, dtype=torch.bfloat16)
        t = torch.empty(9, dtype=torch.int64)
        b = torch.empty(11, dtype=torch.bfloat16)
        stats, gh, gw, gb = op(h, w, b, t, None, -100, 0.0, 0.0, 0.0, torch.empty(9), True, 4, h.dtype)
        assert stats.shape == (2, 9) and stats.dtype == torch.float32
        assert gh.shape == (9, 8) and gw.shape == (11, 8) and gb.shape == (11,)
        assert gh.dtype == gw.dtype == gb.dtype == torch.bfloat16
        _, _, gw, gb = op(h, w, b, t, None, -100, 0.0, 0.0, 0.0, torch.empty(9), True, 4,
                          torch.float32)
        assert gw.dtype == gb.dtype == torch.float32
        _, gh, gw, gb = op(h, w, b, t, None, -100, 0.0, 0.0, 0.0, torch.empty(9), False, 4, h.dtype)
        assert gh.shape == (9, 8) and gw.numel() == gb.numel() == 0


def test_frozen_head_skips_its_gradient():
    """weight_grad=False (the weight and bias frozen): no weight or bias gradient, the
    hidden states' the same as with them."""
    hidden, weight, bias, target, _ = make_case()
    op = torch.ops.quack_kernels.linear_cross_entropy_forward
    scale = torch.rand(hidden.shape[0], dtype=hidden.dtype) + 0.5
    full = op(hidden, weight, bias, target, None, -100, 0.0, 0.0, 0.0, scale, True, 6, hidden.dtype)
    frozen = op(hidden, weight, bias, target, None, -100, 0.0, 0.0, 0.0, scale, False, 6, hidden.dtype)
    assert frozen[2].numel() == frozen[3].numel() == 0 and full[2].abs().sum() > 0
    torch.testing.assert_close(frozen[1], full[1], rtol=0, atol=0)


@pytest.mark.parametrize("accum,passes", [(torch.float16, 2), (torch.float32, 1)])
def test_fp16_gradients_take_the_loss_scale_before_rounding(monkeypatch, accum, passes):
    """fp16: with a loss scaler's factor the gradients are as precise as torch's
    unfused ones (computed in the forward for the plain 1 / M, their small values
    underflowed fp16 and no factor brought them back: 6.2e-3 off instead of 2.7e-4).
    With an fp32 sum of the head's gradient the forward computes the gradients of the
    summed losses (one pass over the chunks: 3.1e-4 and 2.3e-4 off), with an fp16 sum
    the chunks run again in the backward (two)."""
    from quack_kernels.ops import linear_cross_entropy as lce

    calls = []
    original = lce.linear_cross_entropy_forward
    monkeypatch.setattr(lce, "linear_cross_entropy_forward",
                        lambda *args: calls.append(1) or original(*args))
    hidden, weight, bias, target, _ = make_case(m=2048, h=64, v=8192, dtype=torch.float32)
    hidden, weight = hidden.half(), weight.half()
    scale = 1024.0
    ours = losses_and_grads(lambda h, w, t: qk.linear_cross_entropy(
        h, w, t, chunk_rows=700, grad_accum_dtype=accum), hidden, weight, None, target,
        lambda loss: torch.full_like(loss, scale))
    assert len(calls) == passes
    ref = losses_and_grads(lambda h, w, t: F.cross_entropy(F.linear(h, w).double(), t),
                           hidden.double(), weight.double(), None, target,
                           lambda loss: torch.full_like(loss, scale))
    for got, want in zip(ours[1], ref[1]):
        assert ((got.double() - want).norm() / want.norm()).item() < 1.5e-3


def weight_grad_errors(hidden, weight, target, chunk_rows, device="cpu"):
    """{grad_accum_dtype: the weight's gradient off fp64 in norm} over many chunks."""
    ref = losses_and_grads(lambda h, w, t: F.cross_entropy(F.linear(h, w), t, reduction="sum"),
                           hidden.double(), weight.double(), None, target, torch.ones_like)
    errors = {}
    for accum in (hidden.dtype, torch.float32):
        _, (_, grad_weight) = losses_and_grads(lambda h, w, t: qk.linear_cross_entropy(
            h, w, t, reduction="sum", chunk_rows=chunk_rows, grad_accum_dtype=accum),
            hidden, weight, None, target, torch.ones_like)
        assert grad_weight.dtype == weight.dtype
        want = ref[1][1]
        errors[accum] = ((grad_weight.double() - want).norm() / want.norm()).item()
    return errors


def test_fp32_grad_accumulation_rounds_once():
    """bf16 over 128 chunks: the weight's gradient summed in fp32 is rounded once
    (one bf16 rounding, ~2e-3 in norm), summed in bf16 once per chunk."""
    hidden, weight, _, target, _ = make_case(m=1024, h=16, v=37, dtype=torch.float32)
    errors = weight_grad_errors(hidden.bfloat16(), weight.bfloat16(), target, chunk_rows=8)
    assert errors[torch.float32] < 4e-3 < errors[torch.bfloat16]


def test_transposed_head_weight():
    """A head weight stored transposed (a (V, H) view of an (H, V) tensor, as a tied
    embedding's may be): the same loss and gradients as a row-major one."""
    hidden, weight, bias, target, _ = make_case()
    fn = functools.partial(qk.linear_cross_entropy, chunk_rows=6)
    rows = losses_and_grads(lambda h, w, t, b: fn(h, w, t, b), hidden, weight, bias, target,
                            torch.ones_like)
    cols = losses_and_grads(lambda h, w, t, b: fn(h, w, t, b), hidden,
                            weight.t().contiguous().t(), bias, target, torch.ones_like)
    for got, want in zip((cols[0], *cols[1]), (rows[0], *rows[1])):
        torch.testing.assert_close(got, want)


def test_autocast_casts_the_head():
    hidden, weight, bias, target, _ = make_case(dtype=torch.float32)
    leaf = weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = qk.linear_cross_entropy(hidden, leaf, target, bias)
        ref = F.cross_entropy(F.linear(hidden, weight, bias).float(), target)
    loss.backward()
    assert leaf.grad.dtype == torch.float32
    assert_close(loss, ref, torch.bfloat16)


def test_torch_compile_fullgraph():
    hidden, weight, bias, target, _ = make_case(dtype=torch.float32)
    for dynamic in (False, True):  # (dynamic: the row count and the z-loss scale symbolic)
        compiled = torch.compile(lambda h, w, t, b, z: qk.linear_cross_entropy(
            h, w, t, b, label_smoothing=0.1, lse_square_scale=z), fullgraph=True,
            backend="aot_eager", dynamic=dynamic)
        for m in (29, 13):
            case = (hidden[:m], weight, bias, target[:m])
            ours = losses_and_grads(lambda h, w, t, b: compiled(h, w, t, b, 1e-3), *case,
                                    torch.ones_like)
            ref = losses_and_grads(lambda h, w, t, b: torch_cross_entropy(
                F.linear(h, w, b), t, None, label_smoothing=0.1, lse_square_scale=1e-3),
                *case, torch.ones_like)
            assert_close(ours[0], ref[0], torch.float32)
            for got, want in zip(ours[1], ref[1]):
                assert_close(got, want, torch.float32)


def test_errors():
    hidden, weight, bias, target, _ = make_case(dtype=torch.float32)
    with pytest.raises(ValueError, match="target shape"):
        qk.linear_cross_entropy(hidden, weight, target[:-1])
    with pytest.raises(ValueError, match=r"\(V, H\) weight"):
        qk.linear_cross_entropy(hidden, weight[:, :-1], target)
    with pytest.raises(TypeError, match="must match"):
        qk.linear_cross_entropy(hidden, weight.double(), target)
    with pytest.raises(ValueError, match="bias must have shape"):
        qk.linear_cross_entropy(hidden, weight, target, bias[:-1])
    with pytest.raises(TypeError, match="class indices"):
        qk.linear_cross_entropy(hidden, weight, target.to(torch.int16))
    with pytest.raises(ValueError, match="one device"):
        qk.linear_cross_entropy(hidden, weight, target, class_weight=bias.to("meta"))
    with pytest.raises(ValueError, match="chunk_rows"):
        qk.linear_cross_entropy(hidden, weight, target, chunk_rows=0)
    with pytest.raises(RuntimeError, match="class weights"):
        qk.linear_cross_entropy(hidden, weight, target,
                                class_weight=torch.rand(weight.shape[0], requires_grad=True))
    with pytest.raises(ValueError, match="int32"):
        qk.linear_cross_entropy(hidden, weight, target.int(), ignore_index=-2**31 - 1)
    with pytest.raises(TypeError, match="grad_accum_dtype"):
        qk.linear_cross_entropy(hidden, weight, target, grad_accum_dtype=torch.float16)
    with pytest.raises(ValueError, match="reduction"):
        qk.linear_cross_entropy(hidden, weight, target, reduction="avg")
    with pytest.raises(TypeError, match="dtype torch.int64"):
        qk.linear_cross_entropy(hidden.long(), weight.long(), target)
    bad = target.clone()
    bad[1] = weight.shape[0]
    with pytest.raises(ValueError, match="target"):
        qk.linear_cross_entropy(hidden, weight, bad)


def test_chunk_rows_heuristic():
    """Chunk logits about the size of the hidden states (M H / V rows), at least
    LINEAR_CE_MIN_CHUNK_ROWS rows, the rows split evenly."""
    least = config.LINEAR_CE_MIN_CHUNK_ROWS
    assert least == 2048
    assert config.linear_ce_chunk_rows(8192, 4096, 128256) == least  # 262 rows would do
    assert config.linear_ce_chunk_rows(131072, 4096, 128256) == 4229  # 31 chunks of >= 4186
    assert config.linear_ce_chunk_rows(least + 1, 4096, 128256) == least + 1  # one chunk
    assert config.linear_ce_chunk_rows(6000, 64, 32000) == 3000  # two, not 2048 + 2048 + 1904
    assert config.linear_ce_chunk_rows(5, 8, 7) == 5
    assert config.linear_ce_chunk_rows(0, 8, 7) == 1
    for m, h, v in ((3000, 64, 32000), (100_000, 2048, 50257), (7, 4096, 2), (10**6, 8192, 32000)):
        rows = config.linear_ce_chunk_rows(m, h, v)
        chunks = -(-m // rows)
        assert rows - m // chunks <= 1  # even: the last chunk at most one row short
        assert rows >= min(m, max(least, m * h / v))


# -------------------------------------------------------------------------------- GPU
def check_head_gradients(grads, dlogits, hidden, weight, dtype, chunks):
    """The gradients of hidden, weight[, bias] against the fp64 logits' gradient
    ``dlogits`` through the head, relative to the size of the terms they add up (the
    target's term and the rest cancel: the logits' gradient rounded to the dtype is off
    by its rounding of those terms); the weight's and the bias's are rounded once per
    chunk as they accumulate (bf16, 3 chunks: elements 1.1% off their terms' size)."""
    h, w = hidden.double(), weight.double()
    expected = (dlogits @ w, dlogits.t() @ h, dlogits.sum(0))
    sizes = (dlogits.abs() @ w.abs(), chunks * (dlogits.abs().t() @ h.abs()),
             chunks * dlogits.abs().sum(0))
    for name, got, want, size in zip(("hidden", "weight", "bias"), grads, expected, sizes):
        assert_close(got, want, dtype, scale=4.0, name=f"grad {name}", magnitude=size)


@pytest.mark.gpu
@pytest.mark.parametrize("m,h,v,dtype", [(1000, 256, 32000, torch.bfloat16),
                                         (3000, 512, 50257, torch.float32),
                                         (257, 128, 128256, torch.float16)])
@pytest.mark.parametrize("options", range(len(OPTIONS)))
def test_gpu_matches_fp64_reference(m, h, v, dtype, options):
    """The chunked loss on CUDA (torch's GEMMs, our kernel in place on each chunk's
    logits; 3 chunks), sum and mean with a bias, against fp64 from the same logits
    (the head's GEMM in the dtype, as an unfused head computes them): the loss, and the
    gradients as the fp64 logits' gradient through the head."""
    hidden, weight, bias, target, _ = make_case(m, h, v, torch.float32, "cuda", seed=3)
    hidden, weight, bias = (t.to(dtype) for t in (hidden * 2, weight, bias))
    for reduction in ("mean", "sum"):
        kw = dict(OPTIONS[options], reduction=reduction)
        loss, grads = losses_and_grads(lambda x, w, t, b: qk.linear_cross_entropy(
            x, w, t, b, chunk_rows=-(-m // 3), **kw), hidden, weight, bias, target,
            torch.ones_like)
        logits = F.linear(hidden, weight, bias).double().requires_grad_()
        ref = torch_cross_entropy(logits, target, None, **kw)
        (dlogits,) = torch.autograd.grad(ref, logits)
        assert_close(loss, ref, torch.float32, scale=8.0, name="loss")
        check_head_gradients(grads, dlogits, hidden, weight, dtype, chunks=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_per_row_losses_class_weights_no_bias(dtype):
    """reduction="none" with a non-uniform upstream gradient (the chunks run again in
    the backward, as for every fp16 loss), class weights, softcap, no bias."""
    m, h, v = 1500, 256, 50257
    hidden, weight, _, target, class_weight = make_case(m, h, v, torch.float32, "cuda", seed=5)
    hidden, weight = (hidden * 2).to(dtype), weight.to(dtype)
    g = torch.Generator(device="cuda").manual_seed(6)
    upstream = torch.rand(m, device="cuda", generator=g) * 1024
    loss, grads = losses_and_grads(lambda x, w, t: qk.linear_cross_entropy(
        x, w, t, class_weight=class_weight, reduction="none", chunk_rows=400, softcap=30.0),
        hidden, weight, None, target, lambda _: upstream)
    logits = F.linear(hidden, weight).double().requires_grad_()
    ref = torch_cross_entropy(logits, target, class_weight.double(), reduction="none",
                              softcap=30.0)
    (dlogits,) = torch.autograd.grad(ref, logits, upstream.double())
    assert_close(loss, ref, torch.float32, scale=8.0, name="losses")
    check_head_gradients(grads, dlogits, hidden, weight, dtype, chunks=4)


@pytest.mark.gpu
def test_gpu_fp32_grad_accumulation_rounds_once():
    """On CUDA each chunk's GEMM adds its fp32 sum into the fp32 buffer (cuBLAS with
    out_dtype): bf16 over 64 chunks, rounded once."""
    hidden, weight, _, target, _ = make_case(m=4096, h=256, v=4096, dtype=torch.float32,
                                             device="cuda", seed=7)
    errors = weight_grad_errors(hidden.bfloat16(), weight.bfloat16(), target, chunk_rows=64)
    assert errors[torch.float32] < 4e-3 < errors[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("accum", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("transposed", [False, True])
def test_gpu_scaled_upstream_and_a_second_backward(accum, transposed):
    """bf16 mean over 3 chunks with an upstream gradient of 0.37: the gradients
    computed for 1 are scaled on the way out (in place, or out of an fp32 sum),
    bitwise the plain ones times 0.37 where they are kept in bf16; a second backward
    through the retained graph gets the same again (the saved gradients were not
    scaled in place). ``transposed``: the head's weight a transposed view (its
    gradient buffers stay row-major for the rescale kernel)."""
    hidden, weight, bias, target, _ = make_case(2048, 256, 32000, torch.float32, "cuda", seed=11)
    hidden, bias = hidden.bfloat16(), bias.bfloat16()
    weight = weight.bfloat16().t().contiguous().t() if transposed else weight.bfloat16()

    def loss_of(h, w, b):
        return qk.linear_cross_entropy(h, w, target, b, grad_accum_dtype=accum, chunk_rows=700)

    _, plain = losses_and_grads(lambda h, w, t, b: loss_of(h, w, b), hidden, weight, bias,
                                target, torch.ones_like)
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    assert leaves[1].stride(0) == (1 if transposed else 256)
    loss = loss_of(*leaves)
    upstream = torch.tensor(0.37, device="cuda")
    loss.backward(upstream, retain_graph=True)
    first = [leaf.grad.clone() for leaf in leaves]
    loss.backward(upstream)
    for name, leaf, once, unit in zip(("hidden", "weight", "bias"), leaves, first, plain):
        assert leaf.grad.dtype == torch.bfloat16
        assert torch.equal(leaf.grad, once * 2), name
        if accum == torch.bfloat16 or name == "hidden":
            assert torch.equal(once, (unit.float() * 0.37).bfloat16()), name
        else:
            assert_close(once, unit.float() * 0.37, torch.bfloat16, name=f"grad {name}")
