"""What each cross-entropy option costs the training step: the step (loss, then
backward) with no option, each option alone and all of them, replayed from a CUDA graph
(kernels alone, no host), as % of the copy ceiling (read + write of M x V).

    python benchmarks/cross_entropy_options.py bf16:131072x1024,bf16:4096x128256
"""

import sys

import torch

import quack_kernels as qk
from quack_kernels.bench import captured, measure_copy_ceiling_gbps, time_device_ms

OPTION_SETS = {
    "plain": {},
    "softcap": dict(softcap=30.0),
    "zloss": dict(lse_square_scale=1e-4),
    "smooth": dict(label_smoothing=0.1),
    "all": dict(label_smoothing=0.1, lse_square_scale=1e-4, softcap=30.0),
}
DTYPES = dict(bf16=torch.bfloat16, fp16=torch.float16, fp32=torch.float32)


def graphed_step(x, target, options):
    """The training step captured in a CUDA graph."""

    def step():
        x.grad = None
        qk.cross_entropy(x, target, **options).backward()

    return captured(step)


def main(argv):
    ceiling = measure_copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s")
    for spec in argv[0].split(","):
        name, shape = spec.split(":")
        m, n = map(int, shape.split("x"))
        x = (torch.randn(m, n, device="cuda", dtype=DTYPES[name]) * 3).requires_grad_()
        target = torch.randint(0, n, (m,), device="cuda")
        line = f"{spec:>18s}"
        for option_name, options in OPTION_SETS.items():
            graph = graphed_step(x, target, options)
            ms = time_device_ms(graph.replay)
            pct = 100 * 2 * x.numel() * x.element_size() / (ms * 1e-3) / 1e9 / ceiling
            line += f"  {option_name} {ms * 1e3:7.1f}us {pct:5.1f}%"
            del graph
        print(line, flush=True)
        del x
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
