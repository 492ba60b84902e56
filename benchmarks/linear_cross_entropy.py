"""Linear + cross-entropy training steps: time and peak memory against the baselines.

The LM head's loss with the gradients of the hidden states and the head's weight:
quack_kernels.linear_cross_entropy against torch (F.linear then
F.cross_entropy), torch.compile of it, and Liger's fused linear cross-entropy when
installed. Per implementation: the median step time (back-to-back calls, as the
runner's host-inclusive cases) and the peak memory the step allocates beyond its
inputs. GEMM-bound, so no copy ceiling here: the point is time and memory side by side.

    python benchmarks/linear_cross_entropy.py [--shapes 8192x4096x128256,...] [--dtype bf16]
"""

import argparse
import functools

import torch
import torch.nn.functional as F

import quack_kernels as qk
from quack_kernels.bench import _compiled, _optional_module, time_host_inclusive_ms

SHAPES = "8192x4096x128256,16384x2048x151936,4096x4096x32000"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _torch_loss(hidden, weight, target):
    return F.cross_entropy(F.linear(hidden, weight), target)


def _liger_loss():
    loss = _optional_module("liger_kernel.transformers").LigerFusedLinearCrossEntropyLoss()
    return lambda hidden, weight, target: loss(weight, hidden, target)


IMPLEMENTATIONS = {
    "quack_kernels": lambda: qk.linear_cross_entropy,
    "torch": lambda: _torch_loss,
    "torch_compile": lambda: _compiled(_torch_loss),
    "liger": _liger_loss,
}


def step(loss_fn, hidden, weight, target):
    hidden.grad = weight.grad = None
    loss_fn(hidden, weight, target).backward()


def measure(loss_fn, hidden, weight, target) -> tuple[float, float]:
    """(median ms per step, peak GiB a step allocates beyond its inputs, the gradients
    included)."""
    call = functools.partial(step, loss_fn, hidden, weight, target)
    call()  # compile, warm up
    hidden.grad = weight.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return time_host_inclusive_ms(call), peak


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="tokens x hidden x vocab, comma-separated")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    args = p.parse_args(argv)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}")
    for shape in args.shapes.split(","):
        m, h, v = map(int, shape.split("x"))
        hidden = torch.randn(m, h, device="cuda", dtype=DTYPES[args.dtype], requires_grad=True)
        weight = (torch.randn(v, h, device="cuda", dtype=DTYPES[args.dtype]) / h ** 0.5
                  ).requires_grad_()
        target = torch.randint(0, v, (m,), device="cuda")
        for name, resolve in IMPLEMENTATIONS.items():
            try:
                ms, gib = measure(resolve(), hidden, weight, target)
                print(f"{shape:20s} {name:14s} {ms:9.3f} ms {gib:7.2f} GiB", flush=True)
            except Exception as exc:  # a baseline's failure is reported, the run goes on
                print(f"{shape:20s} {name:14s} {type(exc).__name__}: {str(exc)[:120]}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
