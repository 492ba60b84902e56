"""Cross-entropy loss alone through the public function, by reduction, against the
kernel alone and torch's mean, timed like the runner (an L2 flush before each call):
what a reduction over rows costs on top of the kernel.

    python benchmarks/cross_entropy_reductions.py
"""

import torch

import quack_kernels as qk
from quack_kernels.bench import measure_copy_ceiling_gbps, time_device_ms
from quack_kernels.ops import cross_entropy as ops

SHAPES = ((131072, 1024), (32768, 4096), (4096, 128256))


def main():
    ceiling = measure_copy_ceiling_gbps()
    for dtype in (torch.bfloat16, torch.float32):
        for m, n in SHAPES:
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            target = torch.randint(0, n, (m,), device="cuda")
            calls = {"kernel": lambda: ops._cross_entropy_forward_cuda(
                x, target, None, -100, 0.0, 0.0, 0.0, False)}
            for reduction in ("none", "sum", "mean"):
                calls[reduction] = lambda r=reduction: qk.cross_entropy(x, target, reduction=r)
            calls["torch_mean"] = lambda: torch.nn.functional.cross_entropy(x, target)
            nbytes = x.numel() * x.element_size()
            times = {name: time_device_ms(call) for name, call in calls.items()}
            print(f"{str(dtype)[6:]:9s} {m}x{n} " + " ".join(
                f"{name}={ms * 1e3:.1f}us({100 * nbytes / ms / 1e6 / ceiling:.1f}%)"
                for name, ms in times.items()), flush=True)


if __name__ == "__main__":
    main()
