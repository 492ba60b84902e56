"""Config sweep for the RMSNorm / LayerNorm forward on the GPU (with and without a residual): time
launch configurations on chosen shapes, one line per variant, with the runner's timing
(an L2 flush before each call) and its copy ceiling.

    python benchmarks/sweep_norm_forward.py --shapes bf16:512x262144 --residual 0,1
    python benchmarks/sweep_norm_forward.py --norm layer --shapes bf16:8192x16384 --residual 0
    python benchmarks/sweep_norm_forward.py --dry-run   # compile only (no GPU needed)
"""

import argparse
import dataclasses
import itertools
import sys

import torch

from sweep_softmax import (DTYPES, add_l2_prefetch_option, add_register_chunks_option,
                           add_staging_option, add_wide_cluster_option,
                           apply_wide_cluster_option, ints, restaged, variants)

from quack_kernels.kernels import norm as kernels
from quack_kernels.ops import norm as ops


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="bf16:512x262144,fp32:512x262144,bf16:2048x65536",
                   help="dtype:MxN,...")
    p.add_argument("--residual", type=ints, default=[0, 1], help="0: x only; 1: x + residual")
    p.add_argument("--norm", default="rms", choices=("rms", "layer"))
    p.add_argument("--vpt", type=ints, default=[16, 32, 64], help="values per thread")
    p.add_argument("--kib", type=ints, default=[16, 32, 64, 128], help="row KiB per CTA")
    p.add_argument("--tpr", type=ints, default=[256], help="max threads per row")
    p.add_argument("--rpb", type=ints, default=[0],
                   help="rows per block (0: the config's; 2 on cluster rows: two rows per CTA "
                        "share one cluster exchange and, through L1, their weight and bias)")
    p.add_argument("--late-columns", action="store_true",
                   help="load the weight and bias per chunk in the output pass everywhere "
                        "(config.norm_forward_early_columns off)")
    p.add_argument("--dry-run", action="store_true", help="compile the variants, time nothing")
    add_staging_option(p)
    add_wide_cluster_option(p)
    add_register_chunks_option(p)
    add_l2_prefetch_option(p)
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    apply_wide_cluster_option(args)
    if args.late_columns:
        kernels.norm_forward_early_columns = lambda *_: False
    if not args.dry_run:  # (without a GPU the package compiles for sm_90a)
        from quack_kernels.bench import measure_copy_ceiling_gbps, time_device_ms

        ceiling = measure_copy_ceiling_gbps()
        print(f"copy ceiling {ceiling:.0f} GB/s")
    rms = args.norm == "rms"
    for shape, residual in itertools.product(args.shapes.split(","), args.residual):
        name, mn = shape.split(":")
        m, n = (int(v) for v in mn.split("x"))
        dtype = DTYPES[name]
        eb = torch.finfo(dtype).bits // 8
        staged = 1 + residual
        if not args.dry_run:
            x = torch.randn(m, n, device="cuda", dtype=dtype)
            res = torch.randn_like(x) if residual else None
            weight = torch.randn(n, device="cuda", dtype=dtype)
            y = torch.empty_like(x)
            h = torch.empty_like(x) if residual else None
            rstd = torch.empty(m, device="cuda")
            mean = None if rms else torch.empty(m, device="cuda")
            bias = None if rms else torch.randn(n, device="cuda", dtype=dtype)
            y_ref = ops.norm_reference(x, weight, bias, res, 1e-6, 0.0, rms, None, None)[0]
        for (vpt, kib, tpr, share), staging, rpb in itertools.product(
                variants(n, eb, staged, args), args.staging, args.rpb):
            cfg = dataclasses.replace(share, rows_per_block=rpb or share.rows_per_block)
            cfg = restaged(cfg, staging)
            if cfg.threads_per_block > 1024:
                continue
            label = (f"{args.norm:5s} {name:5s} {mn:>12s} res={residual} vpt={vpt:3d} "
                     f"kib={kib:3d} tpr={tpr:4d} "
                     f"cl={cfg.cluster_size:2d} thr={cfg.threads_per_row:4d} "
                     f"vecs={cfg.vecs_per_thread:2d} ch={cfg.num_chunks:2d} {cfg.staging:9s} "
                     f"held={cfg.register_chunks} rpb={cfg.rows_per_block} pf={cfg.l2_prefetch}")
            try:
                fn = ops.compile_forward(cfg, rms, dtype, dtype, bool(residual), bool(residual),
                                         dtype, None if rms else dtype, dtype)
                if args.dry_run:
                    print(label, "compiled", flush=True)
                    continue
                call = lambda: fn(x, res, weight, bias, y, h, mean, rstd, 1e-6, 0.0)  # noqa: E731
                call()
                ms = time_device_ms(call)
            except Exception as e:  # a variant that does not compile or launch
                print(f"{label} {type(e).__name__}: {str(e)[:80]}", flush=True)
                continue
            # read x [+ residual], write y [+ the residual stream]
            pct = 100 * 2 * staged * m * n * eb / ms / 1e6 / ceiling
            # (a config the kernel mishandles is off by far more than 16-bit rounding)
            right = (y.float() - y_ref.float()).abs().max() <= 2e-2 * y_ref.float().abs().max()
            print(f"{label} {ms * 1e3:8.1f}us {pct:5.1f}%{'' if right else ' WRONG'}", flush=True)
        if not args.dry_run:
            del x, res, y, h, y_ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
