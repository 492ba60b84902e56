"""Comparison helpers and tolerances shared by the tests."""

from __future__ import annotations

import inspect
from collections.abc import Iterator

import torch
import torch.nn.functional as F

# Relative tolerance on the whole tensor (||out - ref|| / ||ref||) and max abs error per
# element, by output dtype. bf16 keeps 8 mantissa bits (2^-8 ~ 4e-3 per element).
TOLERANCE = {
    torch.float32: dict(rel=1e-5, atol=1e-5),
    torch.float16: dict(rel=2e-3, atol=2e-3),
    torch.bfloat16: dict(rel=1e-2, atol=1.6e-2),
}


def poison_allocator(*like: torch.Tensor) -> None:
    """Leave 0xFF-filled (NaN in every float dtype) blocks of these tensors' sizes in
    torch's caching allocator, in reverse order, so the outputs an op allocates next
    reuse them: an element the kernel never writes then reads back as NaN. Call it
    after creating the inputs and right before the op."""
    blocks = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device=t.device).fill_(255)
              for t in reversed(like)]
    del blocks


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype=None, scale: float = 1.0, name="out",
                 magnitude: torch.Tensor | None = None):
    """Compare with an fp64/fp32 reference; report the first mismatching index and the
    NaN/inf pattern so a failure says where, not only that. ``magnitude``: where ref is
    a difference of larger terms, their size, which the relative error scales with."""
    tol = TOLERANCE[dtype or out.dtype]
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.double(), ref.double()
    nan_mismatch = torch.isnan(o) != torch.isnan(r)
    inf_mismatch = torch.isinf(o) & ~(o == r)
    bad = nan_mismatch | inf_mismatch
    finite = torch.isfinite(o) & torch.isfinite(r)
    err = torch.where(finite, (o - r).abs(), torch.zeros_like(o))
    size = r.abs() if magnitude is None else torch.maximum(r.abs(), magnitude.double())
    bad |= err > tol["atol"] * scale + tol["rel"] * size.where(finite, torch.zeros_like(r))
    if bad.any():
        idx = tuple(i.item() for i in bad.nonzero()[0])
        raise AssertionError(
            f"{name}: {int(bad.sum())} of {bad.numel()} elements differ; first at {idx}: "
            f"got {o[idx].item()!r}, expected {r[idx].item()!r}; "
            f"nan mismatches {int(nan_mismatch.sum())}, max finite err {err.max().item():.3g}"
        )
    norm = size[finite].norm()  # (with ``magnitude``, relative to the terms' size)
    if norm > 0:
        rel = (o[finite] - r[finite]).norm() / norm
        assert rel <= tol["rel"] * scale, f"{name}: relative error {rel:.3g} > {tol['rel'] * scale:.3g}"


def torch_cross_entropy(x, target, weight, *, ignore_index=-100, reduction="mean",
                        label_smoothing=0.0, lse_square_scale=0.0, softcap=None):
    """The definition, from torch's own cross_entropy: softcap first, z-loss per
    non-ignored row, the reduction as torch does it (mean over the summed target
    weights)."""
    z = softcap * torch.tanh(x / softcap) if softcap else x
    loss = F.cross_entropy(z, target, weight, ignore_index=ignore_index, reduction="none",
                           label_smoothing=label_smoothing)
    kept = target != ignore_index
    if lse_square_scale:
        loss = loss + torch.where(kept, lse_square_scale * torch.logsumexp(z, -1) ** 2, 0.0)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    w_t = kept.to(x.dtype) if weight is None else weight[target.clamp(min=0)] * kept
    return loss.sum() / w_t.sum()


def check_cross_entropy_backward_paths(x, target, weight, reduction, inplace, ref_grad,
                                       dtype, tol_scale=1.0, loss_scale=0.37, reuse_scale=2.0):
    """quack_kernels.cross_entropy's three backward paths against ``ref_grad`` (the
    reference gradient of the plain loss): a plain backward (the gradient computed in
    the forward is used as is), a scaled loss (every row rescaled), and a retained graph
    run backward twice (the second time scaled by ``reuse_scale``)."""
    import quack_kernels as qk

    for scale in (1.0, loss_scale):
        leaf = x.clone().requires_grad_()
        logits = leaf * 1 if inplace else leaf
        loss = qk.cross_entropy(logits, target, weight, reduction=reduction,
                                inplace_backward=inplace)
        (loss * scale).backward()
        assert_close(leaf.grad, ref_grad * scale, dtype, scale=tol_scale, name=f"grad x {scale}")
    leaf = x.clone().requires_grad_()
    loss = qk.cross_entropy(leaf * 1, target, weight, reduction=reduction,
                            inplace_backward=inplace)
    first = torch.autograd.grad(loss, leaf, retain_graph=True)[0]
    second = torch.autograd.grad(reuse_scale * loss, leaf)[0]
    assert_close(first, ref_grad, dtype, scale=tol_scale, name="retained 1st")
    assert_close(second, reuse_scale * ref_grad, dtype, scale=tol_scale, name="retained 2nd")


def check_plain_backward_rescales_no_row(monkeypatch, rescale_name, x, target, weight,
                                         reduction):
    """The gradient quack_kernels.cross_entropy computes in its forward is the one a
    plain backward() asks for: the rescale the backward calls (``rescale_name`` in
    ops.cross_entropy, patched to count) sees an upstream gradient equal bit for bit to
    the held one in every row; a scaled loss differs in every row."""
    import quack_kernels as qk
    from quack_kernels.ops import cross_entropy as ops

    differing = []
    original = getattr(ops, rescale_name)
    signature = inspect.signature(original)

    def recording(*args, **kwargs):
        scales = signature.bind(*args, **kwargs).arguments
        differing.append(int((scales["dloss"] != scales["held"]).sum()))
        return original(*args, **kwargs)

    monkeypatch.setattr(ops, rescale_name, recording)
    for scale, expected in ((1.0, 0), (0.37, x.shape[0])):
        leaf = x.clone().requires_grad_()
        out = qk.cross_entropy(leaf, target, weight, reduction=reduction)
        (out.sum() * scale if reduction == "none" else out * scale).backward()
        assert differing.pop() == expected


def assert_looping_launch_fits(kernel, name, n, dtype, cfg, res) -> None:
    """A kernel looping over row blocks is launched for ``kernel.ctas_per_sm()`` CTAs
    per SM: its compiled register count must let all of them be resident at once (else
    the last CTAs would run as a second, mostly idle wave)."""
    from quack_kernels.primitives.config import REGISTERS_PER_SM

    ctas = kernel.ctas_per_sm()
    regs = -(-res["regs"] // 8) * 8  # allocation granularity
    assert ctas * cfg.threads_per_block * regs <= REGISTERS_PER_SM, \
        f"{ctas} CTAs/SM of {name} n={n} {dtype} do not fit: {res}"


def compiled_sass(kernel_and_fakes, folder, cuobjdump: str) -> tuple[dict, str]:
    """(resource usage, SASS) of a kernel (``(kernel, *fake arguments)``) compiled with
    its cubin kept in ``folder`` (a pathlib.Path, made if missing)."""
    from quack_kernels.primitives.compile_cache import compile_kernel
    from quack_kernels.report import _cubin_file, disassembly, resource_usage

    folder.mkdir(exist_ok=True)
    fn = compile_kernel(*kernel_and_fakes, keep_cubin_in=str(folder))
    cubin = _cubin_file(fn.__cubin__, str(folder))
    return resource_usage(cubin, cuobjdump), disassembly(cubin, cuobjdump)


def compiled_ptx(kernel_and_fakes, folder) -> str:
    """The PTX of a kernel (``(kernel, *fake arguments)``) compiled for sm_90a, kept in
    ``folder`` (a pathlib.Path, made if missing)."""
    from quack_kernels.primitives.compile_cache import compile_kernel

    folder.mkdir(exist_ok=True)
    compile_kernel(*kernel_and_fakes, keep_ptx_in=str(folder))
    return "".join(path.read_text() for path in sorted(folder.glob("*.ptx")))


def switched(monkeypatch, switch: str, on: bool, caches) -> Iterator[None]:
    """A fixture's body: config.``switch`` set to ``on`` for one test, the launch caches
    (dicts) emptied before and after it (their keys do not hold the switch)."""
    from quack_kernels.primitives import config

    monkeypatch.setattr(config, switch, on)
    for cache in caches:
        cache.clear()
    yield
    for cache in caches:
        cache.clear()
