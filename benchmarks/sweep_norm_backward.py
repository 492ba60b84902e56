"""Sweep for the RMSNorm backward kernel on the GPU (dx and dweight): one and two staging
buffers (prefetch of the next row block), one line per variant, as % of the copy
ceiling for the model bytes (read h and dy, write dx)."""

import dataclasses
import sys

import torch
import triton

from quack_kernels.ops import norm as ops
from quack_kernels.ops.common import resident_row_blocks
from quack_kernels.primitives.config import loop_grid_rows

from quack_kernels.bench import measure_copy_ceiling_gbps as copy_ceiling_gbps

SHAPES = [(m, n) for m, n in ((32768, 4096), (8192, 16384), (2048, 65536), (512, 262144))]


def main(argv):
    """argv: dtypes to sweep (bfloat16, float32; default both)."""
    dtypes = [getattr(torch, name) for name in argv] or [torch.bfloat16, torch.float32]
    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s")
    for dtype in dtypes:
        for m, n in SHAPES:
            h, dy = (torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(2))
            weight = torch.randn(n, device="cuda", dtype=dtype)
            rstd = torch.rand(m, device="cuda") + 0.5
            dx = torch.empty_like(h)
            default = ops.backward_config(n, dtype, dtype, (dtype,), dtype, 1)
            for stages in (1, 2):
                cfg = dataclasses.replace(default, stages=stages)
                kernel = ops._backward_kernel_object(cfg, True, dtype, dtype, True, False)
                if kernel.smem_bytes() > 227 * 1024:
                    continue
                fn = ops.compile_backward(cfg, True, dtype, dtype, dtype, False, None, dtype,
                                          None, True, False)
                grid = loop_grid_rows(cfg, m, resident_row_blocks(kernel, h.device))
                dw_part = torch.empty(grid * cfg.rows_per_block, n, device="cuda")
                call = lambda: fn(h, dy, weight, None, rstd, None, dx, None, dw_part, None, 0.0, grid)
                call()
                ms = triton.testing.do_bench(call, return_mode="median")
                pct = 100 * 3 * h.numel() * h.element_size() / ms / 1e6 / ceiling
                print(f"{str(dtype)[6:]:9s} {m}x{n} stages={stages} cl={cfg.cluster_size:2d} "
                      f"ch={cfg.num_chunks} {cfg.staging:9s} ctas/SM={kernel.ctas_per_sm()} "
                      f"{ms * 1e3:8.1f}us {pct:5.1f}%", flush=True)
            del h, dy, dx
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
