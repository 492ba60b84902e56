"""Where the norms' small training steps (issue 3: bf16 forward + backward through
autograd at 4096x4096 and 1024x8192) spend their time, ours against torch eager: the
wall time of back-to-back steps, the host's enqueue time alone, the kernels' device
time (torch.profiler), then the host-side ops of one step at 4096x4096. When wall
follows host and the kernels' sum is far below it, the step is host-bound.

    python benchmarks/norm_step_host.py
"""

import collections
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

import quack_kernels as qk
from quack_kernels.native import module as native_module

from profile_ops import kernels_us, wall_us

F = torch.nn.functional
ROUNDS = 7
PROFILED_STEPS = 20


def enqueue_us(fn, calls=30):
    """Host time per call of a loop that never waits for the GPU (it may fall behind)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return host


def steps(M, N):
    """Training steps (x, weight [, bias] all requiring grad), ours and torch's; the
    LayerNorm forward alone (building the graph, and without grad), ours also straight
    from the C++ entry (no Python layer); its backward alone on a retained graph."""
    dtype = torch.bfloat16
    x = torch.randn(M, N, device="cuda", dtype=dtype).requires_grad_()
    w = torch.randn(N, device="cuda", dtype=dtype).requires_grad_()
    b = torch.randn(N, device="cuda", dtype=dtype).requires_grad_()
    dy = torch.randn(M, N, device="cuda", dtype=dtype)

    def step(f):
        def run():
            x.grad = w.grad = b.grad = None
            f().backward(dy)
        return run

    def backward_only(f):
        y = f()

        def run():
            x.grad = w.grad = b.grad = None
            y.backward(dy, retain_graph=True)
        return run

    def no_grad(f):
        def run():
            with torch.no_grad():
                f()
        return run

    ours_ln = lambda: qk.layer_norm(x, w, b)  # noqa: E731
    torch_ln = lambda: F.layer_norm(x, (N,), w, b)  # noqa: E731
    ours_ln()  # (registers the C++ plan)
    native = native_module()
    straight_ln = lambda: native.norm(x, w, b, None, x.dtype, 1e-5, 0.0, False, False)  # noqa: E731
    return {
        "ours rms": step(lambda: qk.rms_norm(x, w)),
        "torch rms": step(lambda: F.rms_norm(x, (N,), w)),
        "ours ln": step(ours_ln),
        "torch ln": step(torch_ln),
        "ours rms frozen w": step(lambda: qk.rms_norm(x, w.detach())),
        "torch rms frozen w": step(lambda: F.rms_norm(x, (N,), w.detach())),
        "ours ln fwd(grad)": ours_ln,
        "ours ln fwd(grad) C++": straight_ln,
        "torch ln fwd(grad)": torch_ln,
        "ours ln fwd no grad": no_grad(ours_ln),
        "ours ln fwd no grad C++": no_grad(straight_ln),
        "torch ln fwd no grad": no_grad(torch_ln),
        "ours ln bwd only": backward_only(ours_ln),
        "torch ln bwd only": backward_only(torch_ln),
    }


def main():
    for M, N in ((8, 4096), (1024, 8192), (4096, 4096)):  # the last one profiled below
        cases = steps(M, N)
        walls, hosts = collections.defaultdict(list), collections.defaultdict(list)
        for r in range(ROUNDS):  # interleaved, every other round in reverse
            order = list(cases.items()) if r % 2 == 0 else list(reversed(cases.items()))
            for name, fn in order:
                walls[name].append(wall_us(fn, 100, warmup=5))
                hosts[name].append(enqueue_us(fn))
        print(f"=== {M}x{N} bf16: us per step, medians of {ROUNDS} rounds")
        for name, fn in cases.items():
            kernels = kernels_us(fn)
            slowest = sorted(kernels.items(), key=lambda kv: -kv[1])[:3]
            print(f"{name:20s} wall {statistics.median(walls[name]):6.1f}  host "
                  f"{statistics.median(hosts[name]):6.1f}  kernels {sum(kernels.values()):6.1f}: "
                  + ", ".join(f"{k[:40]} {t:.1f}" for k, t in slowest))
    for name in ("ours ln", "torch ln", "ours rms", "torch rms"):
        fn = cases[name]
        wall_us(fn, 10)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED_STEPS):
                fn()
            torch.cuda.synchronize()
        print(f"--- {name} {M}x{N}: host ops per step (us, profiler overhead included)")
        for e in sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]:
            print(f"  {e.key[:50]:50s} self {e.self_cpu_time_total / PROFILED_STEPS:7.1f}  "
                  f"cum {e.cpu_time_total / PROFILED_STEPS:7.1f}  x{e.count / PROFILED_STEPS:.1f}")


if __name__ == "__main__":
    main()
