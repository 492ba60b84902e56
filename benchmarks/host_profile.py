"""Python host time per call of the public functions, by function (cProfile), on tiny
tensors so the GPU never holds the host back.

    python benchmarks/host_profile.py
"""

import cProfile
import pstats

import torch

import quack_kernels as qk

from profile_ops import wall_us

CALLS = 300


def cases():
    try:  # QuACK's cross-entropy step, as a reference for the host path, when installed
        from quack.cross_entropy import cross_entropy as quack_ce
    except ImportError:
        quack_ce = None
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    dy = torch.randn_like(x)
    logits = torch.randn(8, 32000, device="cuda", dtype=torch.bfloat16)
    lg = logits.clone().requires_grad_()
    target = torch.randint(0, 32000, (8,), device="cuda")

    def norm_train():
        xg.grad = wg.grad = None
        qk.rms_norm(xg, wg).backward(dy)

    def torch_norm_train():
        xg.grad = wg.grad = None
        torch.nn.functional.rms_norm(xg, (4096,), wg).backward(dy)

    def ce_train():
        lg.grad = None
        qk.cross_entropy(lg, target).backward()

    def torch_ce_train():
        lg.grad = None
        torch.nn.functional.cross_entropy(lg, target).backward()

    def quack_ce_train():
        lg.grad = None
        quack_ce(lg, target).backward()

    def softmax_train():
        xg.grad = None
        qk.softmax(xg).backward(dy)

    def torch_softmax_train():
        xg.grad = None
        torch.softmax(xg, -1).backward(dy)

    return {
        "rms_norm fwd": lambda: qk.rms_norm(x, w),
        "torch rms_norm fwd": lambda: torch.nn.functional.rms_norm(x, (4096,), w),
        "rms_norm fwd+bwd": norm_train,
        "torch rms_norm fwd+bwd": torch_norm_train,
        "cross_entropy loss": lambda: qk.cross_entropy(logits, target),
        "cross_entropy fwd+bwd": ce_train,
        "torch cross_entropy fwd+bwd": torch_ce_train,
        **({"quack cross_entropy fwd+bwd": quack_ce_train} if quack_ce else {}),
        "softmax fwd": lambda: qk.softmax(x),
        "torch softmax fwd": lambda: torch.softmax(x, -1),
        "softmax fwd+bwd": softmax_train,
        "torch softmax fwd+bwd": torch_softmax_train,
    }


def main():
    for name, fn in cases().items():
        print(f"\n== {name}: {wall_us(fn, CALLS, warmup=20):.1f} us/call")
        if name.startswith(("torch", "quack")):
            continue
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(CALLS):
            fn()
        profiler.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(profiler).sort_stats("tottime")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]
        for (file, line, func), (_, ncalls, tottime, cumtime, _) in rows:
            print(f"  {tottime / CALLS * 1e6:7.1f} us self {cumtime / CALLS * 1e6:7.1f} us cum "
                  f"{ncalls // CALLS:3d}x {func} ({file.split('/')[-1]}:{line})")


if __name__ == "__main__":
    main()
