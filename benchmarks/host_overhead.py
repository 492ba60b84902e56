"""Host overhead per call: wall-clock time of many back-to-back calls on a tiny tensor
(the GPU finishes each kernel long before the next launch), per code path."""

import threading

import torch

import quack_kernels as qk
from quack_kernels import bench
from quack_kernels.ops import norm as norm_ops
from quack_kernels.ops import softmax as ops

from profile_ops import wall_us


class _TorchSoftmaxInPython(torch.autograd.Function):
    """torch's own softmax kernels behind a Python autograd node: fwd+bwd of this minus
    torch's native fwd+bwd is what any Python autograd.Function costs on this host (the
    engine's CUDA worker thread runs the backward under the GIL)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.softmax(x, -1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return torch._softmax_backward_data(grad, y, -1, grad.dtype)


def in_worker_thread(fn):
    """``fn`` timed on a thread other than the main one, as the autograd engine runs a
    backward on its own device thread: the fwd+bwd rows cost more than their forward
    and backward launches timed on the main thread, so a per-thread cost (stream or
    context lookup) is a suspect."""

    def call():
        result = {}

        def work():
            try:
                result["us"] = wall_us(fn, calls=2000, warmup=50)
            except BaseException as error:  # handed to the caller below
                result["error"] = error

        worker = threading.Thread(target=work)
        worker.start()
        worker.join()
        if "error" in result:
            raise result["error"]
        return result["us"]

    return call


def norm_rows():
    """RMSNorm's training step taken apart: forward with and without a graph, the
    backward's launch alone, and the whole step, against torch's fused RMSNorm."""
    F = torch.nn.functional
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    bg = torch.randn_like(w).requires_grad_()
    dy = torch.randn_like(x)
    _, _, _, rstd = norm_ops._norm_forward_eager(x, w, None, None, 1e-6, 0.0, True, None,
                                                 x.dtype, False)

    def step(norm):
        def run():
            xg.grad = wg.grad = bg.grad = None
            norm(xg, wg).backward(dy)
        return run

    return [
        ("qk.rms_norm (no grad)", lambda: qk.rms_norm(x, w)),
        ("qk.rms_norm with grad (graph built)", lambda: qk.rms_norm(xg, wg)),
        ("rms_norm backward launch (_norm_backward_eager)",
         lambda: norm_ops._norm_backward_eager(dy, x, w, None, rstd, None, 0.0, True,
                                               x.dtype, None, True, None)),
        ("fwd+bwd qk.rms_norm", step(qk.rms_norm)),
        ("F.rms_norm (no grad)", lambda: F.rms_norm(x, (4096,), w)),
        ("F.rms_norm with grad (graph built)", lambda: F.rms_norm(xg, (4096,), wg)),
        ("fwd+bwd F.rms_norm", step(lambda a, b: F.rms_norm(a, (4096,), b))),
        ("fwd+bwd qk.layer_norm", step(lambda a, b: qk.layer_norm(a, b, bg))),
        ("fwd+bwd F.layer_norm", step(lambda a, b: F.layer_norm(a, (4096,), b, bg))),
    ]


def cross_entropy_rows():
    """The cross-entropy training step (mean, bf16) on a tiny batch: ours against torch's
    and Liger's, the host's cost per step with the kernels' time negligible."""
    F = torch.nn.functional
    logits = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 1024, (8,), device="cuda")

    def step(loss_fn):
        def run():
            logits.grad = None
            loss_fn(logits, target).backward()
        return run

    rows = [
        ("qk.cross_entropy (no grad)", lambda: qk.cross_entropy(logits.detach(), target)),
        ("fwd+bwd qk.cross_entropy", step(qk.cross_entropy)),
        ("fwd+bwd F.cross_entropy", step(F.cross_entropy)),
    ]
    try:
        liger = bench._liger_cross_entropy()
    except bench.Unavailable:
        return rows
    return rows + [("fwd+bwd Liger cross-entropy", step(liger))]


def main():
    x = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)
    xg = x.clone().requires_grad_()
    y = qk.softmax(x)
    dy = torch.randn_like(y)
    cfg = ops.forward_config(128, torch.bfloat16)
    kernel = ops.compile_forward(cfg, torch.bfloat16, False)
    out = torch.empty_like(x)
    rows = [
        ("compiled kernel only (TVM-FFI)", lambda: kernel(x, out)),
        ("qk.softmax (eager, no grad)", lambda: qk.softmax(x)),
        ("torch.ops.quack_kernels.softmax_forward", lambda: torch.ops.quack_kernels.softmax_forward(x, False)),
        ("qk.softmax with grad (autograd.Function)", lambda: qk.softmax(xg)),
        ("fwd+bwd qk.softmax", lambda: qk.softmax(xg).backward(dy)),
        ("backward launch (ops._softmax_backward_cuda)",
         lambda: ops._softmax_backward_cuda(y, dy, False)),
        ("torch._softmax_backward_data", lambda: torch._softmax_backward_data(dy, y, -1, dy.dtype)),
        ("torch.empty_like", lambda: torch.empty_like(x)),
        ("torch.softmax", lambda: torch.softmax(x, -1)),
        ("fwd+bwd torch.softmax", lambda: torch.softmax(xg, -1).backward(dy)),
        ("fwd+bwd torch.softmax in a Python Function",
         lambda: _TorchSoftmaxInPython.apply(xg).backward(dy)),
    ]
    threaded = [
        ("backward launch on a worker thread",
         in_worker_thread(lambda: ops._softmax_backward_cuda(y, dy, False))),
        ("torch._softmax_backward_data on a worker thread",
         in_worker_thread(lambda: torch._softmax_backward_data(dy, y, -1, dy.dtype))),
    ]
    for name, fn in rows + norm_rows() + cross_entropy_rows():
        print(f"{name:45s} {wall_us(fn, calls=2000, warmup=50):7.1f} us/call")
    for name, per_call in threaded:
        print(f"{name:45s} {per_call():7.1f} us/call")


if __name__ == "__main__":
    main()
