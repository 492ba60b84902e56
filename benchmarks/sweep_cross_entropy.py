"""Config sweep for the cross-entropy forward kernel on the GPU (loss only and loss +
gradient): values per thread, per-CTA row share and staging buffers (prefetch), one
line per variant."""

import dataclasses
import itertools
import sys

import torch
import triton

from quack_kernels.ops import cross_entropy as ops
from quack_kernels.ops.common import resident_row_blocks
from quack_kernels.primitives.config import loop_grid_rows, loops_over_row_blocks, row_config

from quack_kernels.bench import measure_copy_ceiling_gbps as copy_ceiling_gbps

SHAPES = [(dtype, m, n) for dtype in (torch.bfloat16, torch.float32)
          for m, n in ((32768, 4096), (8192, 16384), (4096, 128256), (8192, 151936))]
FLAGS = dict(weighted=False, smoothing=False, zloss=False, softcap=False)


def main(argv):
    """argv: dtypes to sweep (bfloat16, float32; default both), row lengths N of
    SHAPES (default all), tpr=T,T (threads per row at most; default 256)."""
    options = [a for a in argv if a.startswith("tpr=")]
    argv = [a for a in argv if a not in options]
    dtypes = [getattr(torch, a) for a in argv if not a.isdigit()] or [torch.bfloat16, torch.float32]
    lengths = [int(a) for a in argv if a.isdigit()]
    thread_limits = [int(t) for o in options for t in o[4:].split(",")] or [256]
    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s")
    for dtype, m, n in SHAPES:
        if dtype not in dtypes or (lengths and n not in lengths):
            continue
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        target = torch.randint(0, n, (m,), device="cuda")
        loss, lse, scale = (torch.empty(m, device="cuda") for _ in range(3))
        grad = torch.empty_like(x)
        eb = x.element_size()
        # 128 KiB and more per CTA (loss only: no second pass over the row): shares of
        # long rows staged whole in shared memory or re-read from global memory; 64 KiB
        # gives rows just above a power of two of 32-KiB shares (151936 bf16) half the
        # cluster
        seen = set()
        for write_grad, vpt, kib, stages, tpr in itertools.product(
                (False, True), (16, 32), (16, 32, 64, 128, 256, 1024), (1, 2), thread_limits):
            cfg = dataclasses.replace(
                row_config(n, eb, values_per_thread=vpt, cta_row_bytes=kib * 1024,
                           max_threads_per_row=tpr), stages=stages)
            if (write_grad, cfg) in seen:  # thread limits above the row's need
                continue
            seen.add((write_grad, cfg))
            if stages == 2 and not loops_over_row_blocks(cfg, write_grad):
                continue
            if kib > 64 and (write_grad or n * eb <= kib * 1024 // 2):
                continue
            try:
                fn = ops.compile_forward(cfg, dtype, torch.int64, write_grad=write_grad, **FLAGS)
                kernel = ops.forward_kernel_object(cfg, dtype, write_grad=write_grad, **FLAGS)
                grid = loop_grid_rows(cfg, m, resident_row_blocks(kernel, x.device))
                call = lambda: fn(x, target, loss, loss, lse, grad, scale, -100, 0.0, 0.0, 1.0, grid)
                call()
                ms = triton.testing.do_bench(call, return_mode="median")
                nbytes = (2 if write_grad else 1) * x.numel() * eb
                pct = 100 * nbytes / ms / 1e6 / ceiling
                print(f"{str(dtype)[6:]:9s} {m}x{n} {'grad' if write_grad else 'loss'} vpt={vpt:3d} "
                      f"kib={kib:3d} cl={cfg.cluster_size:2d} tpr={cfg.threads_per_row:3d} "
                      f"rows={cfg.rows_per_block} vecs={cfg.vecs_per_thread:2d} ch={cfg.num_chunks} "
                      f"{cfg.staging:9s} st={stages} ctas/SM={kernel.ctas_per_sm()} "
                      f"{ms*1e3:8.1f}us {pct:5.1f}%", flush=True)
            except Exception as e:  # a variant that does not compile or launch
                print(f"{dtype} {n} grad={write_grad} vpt={vpt} kib={kib} st={stages} tpr={tpr}: "
                      f"{type(e).__name__} {e}"[:200])
        del x, grad
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
