"""Config sweep for softmax on the GPU: time heuristic variants on chosen shapes, one
line per variant, with the runner's timing (quack_kernels.bench.time_device_ms: an L2
flush before each call) and its copy ceiling.

    python benchmarks/sweep_softmax.py                     # the 2^27 grid, vpt x kib
    python benchmarks/sweep_softmax.py --shapes bf16:128x1048576 --tpr 256,512,1024
    python benchmarks/sweep_softmax.py --shapes bf16:128x1048576 --direction fwd \
        --register-chunks 0,1,2          # the share's last chunks held in registers
    python benchmarks/sweep_softmax.py --shapes bf16:4096x4096 --direction bwd \
        --staging auto,global            # each share also re-read from global memory
"""

import argparse
import dataclasses
import functools
import itertools
import sys

import torch

from quack_kernels.bench import measure_copy_ceiling_gbps, time_device_ms
from quack_kernels.ops import softmax as ops
from quack_kernels.primitives import config
from quack_kernels.primitives.config import SMEM_BYTES_PER_CTA, row_config

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_SHAPES = ",".join(f"{d}:{2**27 // n}x{n}" for d in ("bf16", "fp32")
                          for n in (1024, 4096, 16384, 65536, 262144))


def ints(text):
    return [int(v) for v in text.split(",")]


def words(allowed):
    """argparse type: a comma list of words from ``allowed``."""
    def parse(text):
        chosen = text.split(",")
        if not set(chosen) <= set(allowed):
            raise argparse.ArgumentTypeError(f"choose from {','.join(allowed)}, got {text}")
        return chosen
    return parse


def parsed_shapes(text):
    """(dtype name, "MxN", M, N, dtype) of each "dtype:MxN" of a comma list."""
    for shape in text.split(","):
        name, mn = shape.split(":")
        m, n = (int(v) for v in mn.split("x"))
        yield name, mn, m, n, DTYPES[name]


def printed_copy_ceiling() -> float:
    ceiling = measure_copy_ceiling_gbps()
    print(f"copy ceiling {ceiling:.0f} GB/s")
    return ceiling


def directions(text):
    chosen = text.split(",")
    if not set(chosen) <= {"fwd", "bwd"}:
        raise argparse.ArgumentTypeError(f"directions are fwd and bwd, got {text}")
    return chosen


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help="dtype:MxN,...")
    p.add_argument("--direction", default="fwd,bwd", type=directions)
    p.add_argument("--vpt", type=ints, default=[16, 32, 64], help="values per thread")
    p.add_argument("--kib", type=ints, default=[16, 32, 64], help="row KiB per CTA")
    p.add_argument("--tpr", type=ints, default=[256], help="max threads per row")
    p.add_argument("--log", action="store_true", help="log_softmax instead of softmax")
    p.add_argument("--op-config", action="store_true",
                   help="the op's own share (ops.softmax.forward_config / backward_config) "
                        "instead of --vpt/--kib/--tpr; --register-chunks still applies")
    add_staging_option(p)
    add_wide_cluster_option(p)
    add_register_chunks_option(p)
    add_l2_prefetch_option(p)
    return p.parse_args(argv)


def add_staging_option(parser):
    parser.add_argument("--staging", type=words(("auto", "global")), default=["auto"],
                        help="comma list of auto, global (global: re-read the row from global "
                             "memory, mostly L1 / L2, in the output pass instead of staging it "
                             "on chip or keeping a one-chunk share in registers)")


def restaged(cfg, staging):
    """``cfg`` as --staging asks: its own ("auto"), or re-read from global memory."""
    if staging == "global":
        return dataclasses.replace(cfg, staging="global", register_chunks=0)
    return cfg


def add_register_chunks_option(parser):
    parser.add_argument("--register-chunks", type=ints, default=[None],
                        help="chunks of the share held in registers (RowConfig.register_"
                             "chunks; a share re-read from global memory is staged for k > "
                             "0); default: the op's own choice")


def add_l2_prefetch_option(parser, own_by_default=False):
    """--l2-prefetch; ``own_by_default``: without it each config keeps its own value
    (args.l2_prefetch None), else 0."""
    parser.add_argument("--l2-prefetch", type=ints, default=None if own_by_default else [0],
                        help="row blocks ahead whose rows each CTA asks L2 for (RowConfig."
                             "l2_prefetch; looping kernels: iterations past those their "
                             "staging buffers hold); 0: none; default: "
                             + ("each config's own" if own_by_default else "0"))


def l2_prefetch_variants(cfg, args, elem_bytes, takes_prefetch=True):
    """``cfg`` with each --l2-prefetch distance (its own where the option leaves it);
    distances > 0 only where ``takes_prefetch`` and for whole 16-byte vectors of
    ``elem_bytes`` (a bulk prefetch starts and ends on 16 bytes)."""
    for ahead in getattr(args, "l2_prefetch", [0]) or [cfg.l2_prefetch]:
        if ahead and not (takes_prefetch and config.whole_vectors(cfg, elem_bytes)):
            continue
        yield dataclasses.replace(cfg, l2_prefetch=ahead)


def add_wide_cluster_option(parser):
    parser.add_argument("--wide16", action="store_true",
                        help="keep 16-CTA clusters whose shares pass "
                             "config.WIDE_CLUSTER_SHARE_BYTES (the default halves them)")


def apply_wide_cluster_option(args):
    if args.wide16:
        config.WIDE_CLUSTER_SHARE_BYTES = float("inf")


def held_as_the_op_holds(cfg, bytes_per_col, backward):
    """The chunks config.with_held_chunk would hold of ``cfg`` (a backward re-read from
    global memory holds none: its op takes other shares there, ops.softmax.
    backward_config)."""
    if backward and cfg.staging == "global":
        return cfg
    return config.with_held_chunk(cfg, bytes_per_col, full_clusters_too=backward)


def variants(n, elem_bytes, staged, args, own_choice=lambda cfg: cfg, staged_bytes_of=None):
    """(vpt, kib, tpr, cfg) of each distinct config the options ask for; ``own_choice``
    maps a share to the op's default (its register chunks) where --register-chunks
    leaves them to the op; ``staged_bytes_of(cfg)``: the bytes per column its kernel
    stages (default ``staged`` tensors of ``elem_bytes``)."""
    seen = set()
    op_config = getattr(args, "op_config", False)  # (the norm sweep has no such option)
    for vpt, kib, tpr, held in itertools.product(args.vpt, args.kib, args.tpr,
                                                 args.register_chunks):
        if op_config:
            cfg = dataclasses.replace(own_choice(None), register_chunks=0)
        else:
            cfg = row_config(n, elem_bytes, staged, values_per_thread=vpt,
                             cta_row_bytes=kib * 1024, max_threads_per_row=tpr)
        if held is None:
            cfg = own_choice(cfg)
        elif held:
            if held >= cfg.num_chunks or cfg.staging == "registers":
                continue
            cfg = dataclasses.replace(cfg, staging="smem", register_chunks=held)
        staged_bytes = staged_bytes_of(cfg) if staged_bytes_of else elem_bytes * staged
        too_big = cfg.staging_smem_bytes(staged_bytes) > SMEM_BYTES_PER_CTA - 4096
        if too_big and op_config and held == 0:
            cfg = dataclasses.replace(cfg, staging="global")  # the share before it was held
        elif too_big and not op_config:
            continue
        for variant in l2_prefetch_variants(cfg, args, elem_bytes):
            if variant not in seen:
                seen.add(variant)
                yield vpt, kib, tpr, variant


def main(argv=None):
    args = parse_args(argv)
    apply_wide_cluster_option(args)
    ceiling = printed_copy_ceiling()
    for name, mn, m, n, dtype in parsed_shapes(args.shapes):
        x = torch.randn(m, n, device="cuda", dtype=dtype)
        dy, y, dx = torch.randn_like(x), torch.empty_like(x), torch.empty_like(x)
        eb = x.element_size()
        for direction in args.direction:
            backward = direction == "bwd"
            staged = 2 if backward else 1
            if args.op_config:
                if backward:
                    own_choice = lambda _: ops.backward_config(n, dtype, log=args.log)  # noqa: E731
                else:
                    own_choice = lambda _: ops.forward_config(n, dtype)  # noqa: E731
            else:
                own_choice = functools.partial(held_as_the_op_holds, bytes_per_col=eb * staged,
                                               backward=backward)
            kernel_for = ops.backward_kernel if backward else ops.forward_kernel

            def staged_bytes_of(cfg):
                """Bytes per column ``cfg``'s kernel stages (an op's own share may stage
                fewer tensors than ``staged``)."""
                kernel = kernel_for(cfg, dtype, args.log)[0]
                return sum(t.width // 8 for t in kernel.staged_dtypes)

            shares = variants(n, eb, staged, args, own_choice, staged_bytes_of)
            seen = set()
            for (vpt, kib, tpr, share), staging in itertools.product(shares, args.staging):
                cfg = restaged(share, staging)
                if cfg in seen:
                    continue
                seen.add(cfg)
                try:
                    if backward:
                        fn = ops.compile_backward(cfg, dtype, args.log)
                        call = lambda: fn(y, dy, dx)  # noqa: E731
                    else:
                        fn = ops.compile_forward(cfg, dtype, args.log)
                        call = lambda: fn(x, y)  # noqa: E731
                    call()
                    ms = time_device_ms(call)
                except Exception as e:  # a variant that does not compile or launch
                    print(f"{name} {mn} {direction} vpt={vpt} kib={kib} tpr={tpr} "
                          f"{cfg.staging}: "
                          f"{type(e).__name__}: {str(e)[:80]}", flush=True)
                    continue
                pct = 100 * (staged + 1) * x.numel() * eb / ms / 1e6 / ceiling
                print(f"{name:5s} {mn:>12s} {direction} vpt={vpt:3d} kib={kib:3d} tpr={tpr:4d} "
                      f"cl={cfg.cluster_size:2d} thr={cfg.threads_per_row:4d} "
                      f"vecs={cfg.vecs_per_thread:2d} ch={cfg.num_chunks} {cfg.staging:9s} "
                      f"held={cfg.register_chunks} pf={cfg.l2_prefetch} "
                      f"{ms * 1e3:8.1f}us {pct:5.1f}%", flush=True)
        x = dy = y = dx = None  # (freed before the next row length)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    sys.exit(main())
