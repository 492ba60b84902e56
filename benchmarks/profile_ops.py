"""Where an op's time goes: the CUDA kernels one call launches (device time each, from
torch.profiler), their sum, and the wall time per call of back-to-back calls. When the
wall time is well above the kernels' sum, host overhead (or idle gaps) is the problem,
not the kernels.

    python benchmarks/profile_ops.py [--only cross_entropy,norm,softmax]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile

import quack_kernels as qk

CALLS = 10


def _drain():
    """Wait for queued GPU work (nothing to wait for on a machine without one)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def wall_us(fn, calls=50, warmup=5):
    """Wall time per call of ``calls`` back-to-back calls, GPU work included."""
    for _ in range(warmup):
        fn()
    _drain()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    _drain()
    return (time.perf_counter() - start) / calls * 1e6


def kernels_us(fn):
    """Mean device time per call of each kernel name ``fn`` launches."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            fn()
        torch.cuda.synchronize()
    per_name = collections.defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name[:60]] += event.device_time / CALLS
    return per_name


def report(label, fn, model_bytes, ceiling_gbps):
    kernels = kernels_us(fn)
    total = sum(kernels.values())
    wall = wall_us(fn)
    floor = model_bytes / (ceiling_gbps * 1e3)
    print(f"\n{label}: wall {wall:.1f} us/call, kernels {total:.1f} us, "
          f"floor {floor:.1f} us -> kernels at {100 * floor / total:.0f}% "
          f"wall at {100 * floor / wall:.0f}% of the copy ceiling")
    for name, us in sorted(kernels.items(), key=lambda kv: -kv[1]):
        print(f"    {us:8.1f} us  {name}")


def copy_ceiling_gbps():
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = sum(kernels_us(lambda: dst.copy_(src)).values())
    return 2 * src.numel() / (us * 1e3)


def cross_entropy_cases(ceiling):
    for M, V in ((1024, 131072), (4096, 128256), (32768, 4096), (131072, 1024)):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(M, V, device="cuda", dtype=dtype)
            t = torch.randint(0, V, (M,), device="cuda")
            nbytes = x.numel() * x.element_size()
            report(f"cross_entropy loss {M}x{V} {dtype}", lambda: qk.cross_entropy(x, t),
                   nbytes, ceiling)
            xg = x.clone().requires_grad_()

            def step():
                xg.grad = None
                qk.cross_entropy(xg, t).backward()

            report(f"cross_entropy loss+grad {M}x{V} {dtype}", step, 2 * nbytes, ceiling)
            x = xg = None  # (freed before the next shape)


def norm_cases(ceiling):
    for M, N in ((32768, 4096), (512, 262144), (4096, 4096)):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        nbytes = x.numel() * x.element_size()
        report(f"rms_norm fwd {M}x{N} bf16", lambda: qk.rms_norm(x.detach(), w.detach()),
               2 * nbytes, ceiling)

        def step():
            x.grad = None
            w.grad = None
            qk.rms_norm(x, w).backward(dy)

        report(f"rms_norm fwd+bwd {M}x{N} bf16", step, 5 * nbytes, ceiling)


def softmax_cases(ceiling):
    for M, N in ((1024, 8192), (256, 32000), (4096, 4096), (128, 1 << 20)):
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(M, N, device="cuda", dtype=dtype)
            report(f"softmax fwd {M}x{N} {dtype}", lambda: qk.softmax(x),
                   2 * x.numel() * x.element_size(), ceiling)


CASES = {"cross_entropy": cross_entropy_cases, "norm": norm_cases, "softmax": softmax_cases}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(CASES))
    args = parser.parse_args()
    ceiling = copy_ceiling_gbps()
    print(f"{torch.cuda.get_device_name()}: copy ceiling {ceiling:.0f} GB/s")
    for name in args.only.split(","):
        CASES[name](ceiling)


if __name__ == "__main__":
    main()
