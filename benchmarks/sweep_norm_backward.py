"""Sweep for the norm backward kernels on the GPU (dx and dweight, plus dbias for
LayerNorm): row bytes per CTA (cluster size), vectors and threads per row, rows per
block and one or two staging buffers (prefetch of the next row block), one line per
variant, as % of the copy ceiling for the model bytes (read h and dy, write dx). Each
variant's dx and summed partials are checked against the default config's: a line
ending in WRONG is a config the kernel does not handle. ``kib=`` on a line is the KiB of
each staged tensor's row a CTA holds (not the --kib it came from).

    python benchmarks/sweep_norm_backward.py [--norm rms,layer] [--kib 16,32,64]
        [--rpb 1,2] [--shapes bf16:8192x16384,...]
    python benchmarks/sweep_norm_backward.py --default --l2-prefetch 0,1,2 --rounds 2
    python benchmarks/sweep_norm_backward.py --norm layer --shapes bf16:8192x16384 \
        --shares 8:256:8:1:registers,8:128:16:1:registers,4:256:16:1:registers
"""

import argparse
import dataclasses
import sys

import torch
import triton

from sweep_softmax import DTYPES, add_l2_prefetch_option, ints, l2_prefetch_variants

from quack_kernels.bench import measure_copy_ceiling_gbps as copy_ceiling_gbps
from quack_kernels.ops import norm as ops
from quack_kernels.ops.common import resident_row_blocks
from quack_kernels.primitives.config import SMEM_BYTES_PER_CTA, loop_grid_rows, partial_sum_rows

DEFAULT_SHAPES = ",".join(f"{d}:{m}x{n}" for d in ("bf16", "fp32")
                          for m, n in ((32768, 4096), (8192, 16384), (2048, 65536), (512, 262144)))


def _shapes(text):
    for item in text.split(","):
        dtype, shape = item.split(":")
        m, n = shape.split("x")
        yield DTYPES[dtype], int(m), int(n)


def backward_variants(dtype, n, rms, args):
    """The configs to time: the default alone (``--default``), or the grid of row
    bytes, vectors, threads and rows per block, each with one and two staging buffers;
    every one with each --l2-prefetch distance (a bulk prefetch needs whole 16-byte
    vectors)."""
    accumulators = 1 if rms else 2
    vec = 16 // dtype.itemsize
    default = default_config(dtype, n, rms)
    if args.shares:  # the default first, to read each share against
        grid = [default] + [cfg for cfg in explicit_shares(
            n, ops.backward_config(n, dtype, dtype, (dtype,), dtype, 2), args.shares)
            if cfg != default]
    elif args.default:
        grid = [default]
    else:
        grid = [dataclasses.replace(default, stages=stages,
                                    rows_per_block=rpb or default.rows_per_block)
                for kib in args.kib for vecs in args.vecs for tpr in args.tpr
                for rpb in args.rpb
                # values per thread over every staged tensor and accumulator
                for default in [ops.backward_config(
                    n, dtype, dtype, (dtype,), dtype, accumulators, cta_row_bytes=kib * 1024,
                    values_per_thread=vecs * vec * (2 + accumulators), max_threads_per_row=tpr)]
                for stages in (1, 2)]
    for cfg in grid:
        yield from l2_prefetch_variants(cfg, args, dtype.itemsize)


def default_config(dtype, n, rms):
    """The op's own config of the backward with dweight (and dbias for LayerNorm)."""
    return ops.backward_config(n, dtype, dtype, (dtype,), dtype, 1 if rms else 2, rms=rms)


def explicit_shares(n, base, shares):
    """``base`` as each share of ``shares`` ("cluster:threads:values:chunks:staging[:stages
    [:l2 prefetch]]", values per thread per chunk of each staged tensor, staging
    registers or smem; two staging buffers and no prefetch unless given) whose cluster
    covers the row with no CTA left empty (others are skipped)."""
    for share in shares.split(","):
        cluster, threads, values, chunks, staging, *rest = share.split(":")
        stages, ahead = (int(v) for v in rest + ["2", "0"][len(rest):])
        cfg = dataclasses.replace(
            base, cluster_size=int(cluster), threads_per_row=int(threads),
            vecs_per_thread=int(values) // base.vec, num_chunks=int(chunks), staging=staging,
            stages=stages, l2_prefetch=ahead)
        if cfg.cols_covered >= n > cfg.cols_covered - cfg.cols_per_cta:
            yield cfg


def sweep_shape(dtype, m, n, rms, args, ceiling):
    h, dy = (torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(2))
    weight = torch.randn(n, device="cuda", dtype=dtype)
    rstd = torch.rand(m, device="cuda") + 0.5
    mean = None if rms else torch.randn(m, device="cuda")
    dx = torch.empty_like(h)
    accumulators = 1 if rms else 2
    reference = _default_result(dtype, rms, h, dy, weight, mean, rstd)
    default_cfg = default_config(dtype, n, rms)
    timed = []  # (config, kernel, call, right)
    for cfg in backward_variants(dtype, n, rms, args):
        kernel = ops._backward_kernel_object(cfg, rms, dtype, dtype, True, not rms, dtype)
        if kernel.smem_bytes() > SMEM_BYTES_PER_CTA:
            continue
        fn = ops.compile_backward(cfg, rms, dtype, dtype, dtype, False, None, dtype,
                                  None, True, not rms)
        grid = loop_grid_rows(cfg, m, resident_row_blocks(kernel, h.device))
        parts = [torch.empty(partial_sum_rows(cfg, grid), n, device="cuda")
                 for _ in range(accumulators)]

        def call(fn=fn, parts=parts, grid=grid):
            fn(h, dy, weight, mean, rstd, None, dx, None, parts[0],
               parts[1] if not rms else None, 0.0, grid)

        call()
        right = _close(dx.float(), reference[0]) and _close(parts[0].sum(0), reference[1])
        timed.append((cfg, kernel, call, right))
    # variants timed in turn, round after round: a drift of the clocks weighs on each alike
    for _ in range(args.rounds):
        for cfg, kernel, call, right in timed:
            ms = triton.testing.do_bench(call, return_mode="median")
            pct = 100 * 3 * h.numel() * h.element_size() / ms / 1e6 / ceiling
            mark = "*" if cfg == default_cfg else " "
            print(f"{'rms' if rms else 'layer':5s} {str(dtype)[6:]:9s} {m}x{n} "
                  f"kib={cfg.cols_per_cta * dtype.itemsize // 1024:3d} "
                  f"stages={cfg.stages} pf={cfg.l2_prefetch} cl={cfg.cluster_size:2d} "
                  f"ch={cfg.num_chunks} vpt={cfg.vec * cfg.vecs_per_thread:2d} "
                  f"thr={cfg.threads_per_block:4d} {cfg.staging:9s} "
                  f"sums={'regs' if kernel.sums_in_registers else 'smem'} "
                  f"ctas/SM={kernel.ctas_per_sm()} {ms * 1e3:8.1f}us "
                  f"{pct:5.1f}%{mark}{'' if right else ' WRONG'}", flush=True)


def _close(got, expected, tol=2e-2):
    """Within ``tol`` of the largest magnitude (16-bit outputs of two configs may round
    apart; a config the kernel mishandles is off by far more)."""
    return bool((got - expected).abs().max() <= tol * expected.abs().max())


def _default_result(dtype, rms, h, dy, weight, mean, rstd):
    """(dx, dweight) in fp32 from the default config through the op."""
    dx, _, dweight, _ = ops.norm_backward(dy, h, weight, mean, rstd, None, 0.0, rms, dtype,
                                          None, True, None if rms else dtype)
    return dx.float(), dweight.float()


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--norm", default="rms,layer")
    p.add_argument("--kib", type=ints, default=[16], help="row KiB per CTA (cluster size)")
    p.add_argument("--vecs", type=ints, default=[1], help="vectors per thread per tensor")
    p.add_argument("--tpr", type=ints, default=[256, 512],
                   help="max threads per row (512: the per-column sums fit in registers "
                        "at long rows, config.SUM_THREADS_PER_ROW)")
    p.add_argument("--rpb", type=ints, default=[0],
                   help="rows per block (0: the config's; 2 on cluster rows: two rows per "
                        "CTA share one cluster exchange)")
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="dtype:MxN,...")
    p.add_argument("--shares", help="explicit shares instead of the grid, comma list of "
                                    "cluster:threads:values:chunks:staging[:stages[:l2 "
                                    "prefetch]] (see explicit_shares)")
    p.add_argument("--default", action="store_true",
                   help="only the default config of each shape (with each --l2-prefetch)")
    p.add_argument("--rounds", type=int, default=1, help="times each variant is timed, in turn")
    add_l2_prefetch_option(p, own_by_default=True)
    args = p.parse_args(argv)
    ceiling = copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s; * marks the default config")
    for dtype, m, n in _shapes(args.shapes):
        for norm in args.norm.split(","):
            sweep_shape(dtype, m, n, norm == "rms", args, ceiling)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
