"""Config sweep for the cross-entropy forward kernel on the GPU (loss only and loss +
gradient): values per thread, per-CTA row share, threads per row, threads per block,
staging and staging buffers (prefetch); one line per variant, timed like the runner
(quack_kernels.bench.time_device_ms: an L2 flush before each call, a reading one for
the loss alone, as the runner times it).

    python benchmarks/sweep_cross_entropy.py                      # the default grid
    python benchmarks/sweep_cross_entropy.py --shapes bf16:131072x1024 --mode loss \\
        --vpt 32,64 --tpr 32,64,128 --tpb 128,256 --staging staged,direct
    python benchmarks/sweep_cross_entropy.py --default --mode grad --l2-prefetch 0,1 --rounds 2
"""

import argparse
import dataclasses
import functools
import itertools
import sys

import torch

from quack_kernels.bench import time_device_ms
from quack_kernels.ops import cross_entropy as ops
from quack_kernels.ops.common import resident_row_blocks
from quack_kernels.primitives.config import (CE_MIN_VECS_PER_THREAD, loop_grid_rows,
                                             loops_over_row_blocks, row_config)

from sweep_softmax import (add_l2_prefetch_option, ints, l2_prefetch_variants, parsed_shapes,
                           printed_copy_ceiling, words)

DEFAULT_SHAPES = ",".join(f"{d}:{m}x{n}" for d in ("bf16", "fp32")
                          for m, n in ((32768, 4096), (8192, 16384), (4096, 128256), (8192, 151936)))
FLAGS = dict(weighted=False, smoothing=False, zloss=False, softcap=False)


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="dtype:MxN,...")
    p.add_argument("--mode", default="loss,grad", type=words(("loss", "grad")))
    p.add_argument("--vpt", type=ints, default=[16, 32], help="values per thread")
    # 128 KiB and more per CTA (loss only: no second pass over the row): shares of long
    # rows staged whole in shared memory or re-read from global memory; 64 KiB gives
    # rows just above a power of two of 32-KiB shares (151936 bf16) half the cluster
    p.add_argument("--kib", type=ints, default=[16, 32, 64, 128, 256, 1024], help="row KiB per CTA")
    p.add_argument("--tpr", type=ints, default=[256], help="max threads per row")
    p.add_argument("--tpb", type=ints, default=[128], help="min threads per block")
    p.add_argument("--stages", type=ints, default=[1, 2], help="staging buffers of looping grids")
    # direct: the loss alone read straight into registers (no cp.async through shared
    # memory), as the streamed shares of long rows are
    p.add_argument("--staging", default="staged", type=words(("staged", "direct")))
    p.add_argument("--default", action="store_true",
                   help="only the op's own config of each shape (with each --l2-prefetch)")
    p.add_argument("--rounds", type=int, default=1, help="times each variant is timed, in turn")
    add_l2_prefetch_option(p, own_by_default=True)
    return p.parse_args(argv)


def variants(n, dtype, write_grad, args):
    """The grid's configs, or the op's own (``--default``), each with every
    --l2-prefetch distance its kernel can take (looping grids of whole 16-byte
    vectors)."""
    elem_bytes = dtype.itemsize
    grid = [ops.forward_config(n, dtype, False, write_grad)] if args.default \
        else _grid(n, elem_bytes, write_grad, args)
    for cfg in grid:
        yield from l2_prefetch_variants(cfg, args, elem_bytes,
                                        takes_prefetch=loops_over_row_blocks(cfg, write_grad))


def _grid(n, elem_bytes, write_grad, args):
    seen = set()
    for vpt, kib, tpr, tpb, stages, staging in itertools.product(
            args.vpt, args.kib, args.tpr, args.tpb, args.stages, args.staging):
        cfg = row_config(n, elem_bytes, values_per_thread=vpt, cta_row_bytes=kib * 1024,
                         max_threads_per_row=tpr, min_threads_per_block=tpb,
                         min_vecs_per_thread=CE_MIN_VECS_PER_THREAD)
        if staging == "direct":
            if write_grad:
                continue
            cfg = dataclasses.replace(cfg, staging="global")
        cfg = dataclasses.replace(cfg, stages=stages)
        if cfg in seen or (stages == 2 and not loops_over_row_blocks(cfg, write_grad)):
            continue
        if kib > 64 and (write_grad or n * elem_bytes <= kib * 1024 // 2):
            continue
        seen.add(cfg)
        yield cfg


def main(argv=None):
    args = parse_args(argv)
    ceiling = printed_copy_ceiling()
    for name, mn, m, n, dtype in parsed_shapes(args.shapes):
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        target = torch.randint(0, n, (m,), device="cuda")
        loss, row_weight, lse, scale = (torch.empty(m, device="cuda") for _ in range(4))
        grad = torch.empty_like(x)
        eb = x.element_size()
        for mode in args.mode:
            write_grad = mode == "grad"
            timed = []
            for cfg in variants(n, dtype, write_grad, args):
                try:
                    fn = ops.compile_forward(cfg, dtype, torch.int64, write_grad=write_grad, **FLAGS)
                    kernel = ops.forward_kernel_object(cfg, dtype, write_grad=write_grad, **FLAGS)
                    grid = loop_grid_rows(cfg, m, resident_row_blocks(kernel, x.device))
                    # (no reduction: the int64 targets stand in for the unread partials)
                    call = functools.partial(fn, x, target, loss, loss, row_weight, lse, grad,
                                             scale, loss, target, -100, 0.0, 0.0, 1.0, grid)
                    call()
                except Exception as e:  # a variant that does not compile or launch
                    print(f"{name} {mn} {mode} {cfg}: {type(e).__name__} {e}"[:240], flush=True)
                    continue
                timed.append((cfg, kernel, call))
            nbytes = (2 if write_grad else 1) * x.numel() * eb
            # variants timed in turn, round after round (clock drift weighs on each alike)
            for _, (cfg, kernel, call) in itertools.product(range(args.rounds), timed):
                try:
                    ms = time_device_ms(call, reading_flush=not write_grad)
                except Exception as e:  # the variant's failure; the others go on
                    print(f"{name} {mn} {mode} {cfg}: {type(e).__name__} {e}"[:240], flush=True)
                    continue
                pct = 100 * nbytes / ms / 1e6 / ceiling
                print(f"{name:5s} {mn:>12s} {mode} cl={cfg.cluster_size:2d} "
                      f"thr={cfg.threads_per_row:3d} rows={cfg.rows_per_block:2d} "
                      f"vecs={cfg.vecs_per_thread:2d} ch={cfg.num_chunks} {cfg.staging:9s} "
                      f"st={cfg.stages} pf={cfg.l2_prefetch} loops={int(kernel.loops)} "
                      f"ctas/SM={kernel.ctas_per_sm()} {ms * 1e3:8.1f}us {pct:5.1f}%", flush=True)
        del x, grad
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
