"""Linear + cross-entropy training steps: time and peak memory against the baselines.

The LM head's loss with the gradients of the hidden states and the head's weight:
quack_kernels.linear_cross_entropy against torch (F.linear then
F.cross_entropy), torch.compile of it, and Liger's fused linear cross-entropy when
installed. Per implementation: the median step time (back-to-back calls, as the
runner's host-inclusive cases) and the peak memory the step allocates beyond its
inputs. GEMM-bound, so no copy ceiling here: the point is time and memory side by side.

    python benchmarks/linear_cross_entropy.py [--shapes 8192x4096x128256,...] [--dtype bf16]
        [--out benchmarks/results]
"""

import argparse
import csv
import datetime
import functools
import itertools
import pathlib
import re

import torch
import torch.nn.functional as F

import quack_kernels as qk
from quack_kernels.bench import (_compiled, _optional_module, environment,
                                 time_host_inclusive_ms)

SHAPES = "8192x4096x128256,16384x2048x151936,4096x4096x32000"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _torch_loss(hidden, weight, target):
    return F.cross_entropy(F.linear(hidden, weight), target)


def _liger_loss():
    loss = _optional_module("liger_kernel.transformers").LigerFusedLinearCrossEntropyLoss()
    return lambda hidden, weight, target: loss(weight, hidden, target)


IMPLEMENTATIONS = {
    "quack_kernels": lambda: qk.linear_cross_entropy,
    # the head's gradient summed over the chunks in fp32 (rounded once)
    "quack_kernels_fp32_accum": lambda: functools.partial(qk.linear_cross_entropy,
                                                          grad_accum_dtype=torch.float32),
    "torch": lambda: _torch_loss,
    "torch_compile": lambda: _compiled(_torch_loss),
    "liger": _liger_loss,
}
OURS = ("quack_kernels", "quack_kernels_fp32_accum")
CSV_COLUMNS = ("M", "H", "V", "dtype", "impl", "ms", "peak_gib", "speedup_vs_best_baseline",
               "gpu", "date", "torch", "triton", "cutlass_dsl", "quack_kernels_version",
               "liger", "quack", "error")


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


def run_shape(shape: str, dtype: torch.dtype) -> list[dict]:
    """One row per implementation; ours carry their speedup over the fastest baseline."""
    m, h, v = map(int, shape.split("x"))
    hidden = torch.randn(m, h, device="cuda", dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda", dtype=dtype) / h ** 0.5).requires_grad_()
    target = torch.randint(0, v, (m,), device="cuda")
    rows = []
    for name, resolve in IMPLEMENTATIONS.items():
        row = dict(M=m, H=h, V=v, impl=name)
        try:
            ms, gib = measure(resolve(), hidden, weight, target)
            row.update(ms=f"{ms:.3f}", peak_gib=f"{gib:.2f}")
            print(f"{shape:20s} {name:25s} {ms:9.3f} ms {gib:7.2f} GiB", flush=True)
        except Exception as exc:  # a baseline's failure is reported, the run goes on
            row.update(error=f"{type(exc).__name__}: {str(exc)[:120]}")
            print(f"{shape:20s} {name:25s} {row['error']}", flush=True)
        torch.cuda.empty_cache()
        rows.append(row)
    best = min((float(r["ms"]) for r in rows if r["impl"] not in OURS and "ms" in r),
               default=None)
    for r in rows:
        if best and r["impl"] in OURS and "ms" in r:
            r["speedup_vs_best_baseline"] = f"{best / float(r['ms']):.3f}"
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="tokens x hidden x vocab, comma-separated")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("benchmarks/results"),
                   help="folder for the CSV (linear_cross_entropy_<gpu>_<dtype>_<date>.csv)")
    args = p.parse_args(argv)
    gpu = torch.cuda.get_device_name()
    env = environment(gpu)
    print(f"{gpu}, torch {torch.__version__}, {args.dtype}")
    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M")
    name = f"linear_cross_entropy_{slug}_{args.dtype}_{stamp}"
    path = args.out / f"{name}.csv"
    for copy in itertools.count(2):  # a run in the same minute: a new file
        if not path.exists():
            break
        path = args.out / f"{name}-{copy}.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=CSV_COLUMNS)
        writer.writeheader()
        for shape in args.shapes.split(","):
            for row in run_shape(shape, DTYPES[args.dtype]):
                writer.writerow({**env, "dtype": args.dtype, **row})
            handle.flush()
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
