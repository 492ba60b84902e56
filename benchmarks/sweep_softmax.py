"""Config sweep for softmax on the GPU: time heuristic variants on the shapes where the
default config is furthest from the copy ceiling. Prints one line per variant."""

import itertools
import sys

import torch
import triton

from quack_kernels.ops import softmax as ops
from quack_kernels.primitives.config import SMEM_BYTES_PER_CTA, row_config

SHAPES = [(dtype, n) for dtype in (torch.bfloat16, torch.float32)
          for n in (1024, 4096, 16384, 65536, 262144)]


def copy_ceiling_gbps():
    src = torch.empty(2**31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * src.numel() / ms / 1e6


def main():
    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s")
    for dtype, n in SHAPES:
        m = max(2**27 // n, 128)
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        dy = torch.randn_like(x)
        y = torch.empty_like(x)
        dx = torch.empty_like(x)
        eb = x.element_size()
        for backward, vpt, kib in itertools.product((False, True), (16, 32, 64), (16, 32, 64)):
            cfg = row_config(n, eb, 2 if backward else 1, values_per_thread=vpt, cta_row_bytes=kib * 1024)
            if cfg.staging_smem_bytes(eb * (2 if backward else 1)) > SMEM_BYTES_PER_CTA - 4096:
                continue
            try:
                if backward:
                    fn = ops.compile_backward(cfg, dtype, False)
                    call = lambda: fn(y, dy, dx)
                    nbytes = 3 * x.numel() * eb
                else:
                    fn = ops.compile_forward(cfg, dtype, False)
                    call = lambda: fn(x, y)
                    nbytes = 2 * x.numel() * eb
                call()
                ms = triton.testing.do_bench(call, return_mode="median")
                pct = 100 * nbytes / ms / 1e6 / ceiling
                print(f"{str(dtype)[6:]:9s} N={n:8d} {'bwd' if backward else 'fwd'} vpt={vpt:3d} kib={kib:3d} "
                      f"cl={cfg.cluster_size:2d} tpr={cfg.threads_per_row:3d} vecs={cfg.vecs_per_thread:2d} "
                      f"ch={cfg.num_chunks} {cfg.staging:9s} {ms*1e3:8.1f}us {pct:5.1f}%", flush=True)
            except Exception as e:  # a variant that does not compile or launch
                print(f"{dtype} {n} bwd={backward} vpt={vpt} kib={kib}: {type(e).__name__}")
        del x, dy, y, dx
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
