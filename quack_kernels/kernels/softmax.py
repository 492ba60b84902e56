"""Softmax and log-softmax over the last dimension, forward and backward.

Forward:  m = max_j x_j,  s = sum_j exp(x_j - m)
          softmax: y = exp(x - m) / s           log_softmax: y = x - m - log(s)
Backward: softmax:     dx = y * (dy - sum_j y_j dy_j)
          log_softmax: dx = dy - exp(y) * sum_j dy_j
Bytes: forward reads x and writes y (2 MN elements), backward reads y, dy and writes dx
(3 MN elements).

Layout: RowKernel geometry (rows split over a cluster of up to 16 CTAs). The forward
reduces the pair (max, sum of exp) in one online pass and one row_allreduce, so a row
costs a single barrier / DSMEM exchange; the backward reduces one sum.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass.memory import SmemAllocator
from cutlass import Float32

from ..primitives import reduce as red
from ..primitives.config import (RowConfig, rereads_in_reverse, softmax_merges_max_first,
                                 stages_in_smem)
from ..primitives.rows import ReductionSlot, RowKernel, RowTiles

class SoftmaxForward(RowKernel):
    values_per_reduction = 2

    def __init__(self, cfg: RowConfig, dtype, log: bool):
        self.cfg = cfg
        self.staged_dtypes = (dtype,)
        self.log = log

    @cute.jit
    def __call__(self, mX: cute.Tensor, mY: cute.Tensor, stream):
        self.launch(self.kernel(mX, mY), mX.shape[0], stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mY: cute.Tensor):
        cfg = self.cfg
        smem = SmemAllocator()
        tiles = RowTiles(cfg, [mX], smem, pad=-math.inf)
        slot = ReductionSlot(smem, cfg, 2)
        tiles.issue_loads()
        if cutlass.const_expr(cfg.cluster_size > 1):
            cute.arch.cluster_wait()

        kept = []
        # (max, sum of exp(x - max)): for the softmax the max is in base-2 units, so that
        # each exponent is one FFMA; the log-softmax keeps it in x's (red.chunk_exp2)
        base2 = not self.log
        combine = red.OnlineSoftmax(base2=base2, two_phase=softmax_merges_max_first(cfg))
        stats = (Float32(-math.inf), Float32(0.0))
        for c in cutlass.range_constexpr(cfg.num_chunks):
            tiles.wait_chunk(c)
            x = tiles.values(0, c, fill=-math.inf)
            chunk_max, e = red.chunk_exp2(
                x, red.thread_reduce(x, cute.ReductionOp.MAX, -math.inf), base2=base2)
            stats = combine(stats, (chunk_max, red.thread_reduce(e, cute.ReductionOp.ADD, 0.0)))
            if cutlass.const_expr(cfg.staging == "registers"):
                kept.append(e if not self.log else x)
                # -inf when every value is: its scale below is then 0 (never inf * 0)
                kept_max = chunk_max
        tiles.prefetch_ahead()
        row_max, row_sum = slot.allreduce(stats, combine, (Float32(-math.inf), Float32(0.0)))

        for c in cutlass.range_constexpr(cfg.num_chunks):
            if cutlass.const_expr(self.log):
                x = kept[c] if cfg.staging == "registers" else tiles.values(0, c)
                y = x - (row_max + cute.math.log(row_sum, fastmath=True))
            elif cutlass.const_expr(cfg.staging == "registers"):
                # e was exp(x - thread max): rescale to the row max in one multiply
                scale = cute.math.exp2(kept_max - row_max, fastmath=True) \
                    * cute.arch.rcp_approx(row_sum)
                y = kept[c] * scale
            else:
                y = cute.math.exp2(tiles.values(0, c) * red.LOG2_E - row_max, fastmath=True) \
                    * cute.arch.rcp_approx(row_sum)
            tiles.store(mY, c, y)


class SoftmaxBackward(RowKernel):
    values_per_reduction = 1

    def __init__(self, cfg: RowConfig, dtype, log: bool):
        """``dtype``: of y and dy both (and dx)."""
        self.cfg = cfg
        self.log = log
        # where only one of y and dy fits the share's shared memory (ops.softmax.
        # backward_config) the other is read from global memory: the log_softmax's y,
        # which only its output pass needs (read once), or the softmax's dy (read in both)
        self.stages_both = cfg.staging != "smem" or stages_in_smem(cfg, 2 * dtype.width // 8)
        self.streams_y = log and not self.stages_both
        self.streams_dy = not log and not self.stages_both
        # where dy's rows outgrow L2 (config.rereads_in_reverse) its second read goes
        # last chunk first: the chunks read last are the likeliest still there
        self.rereads_dy_in_reverse = self.streams_dy and rereads_in_reverse(
            cfg.n_cols, dtype.width // 8)
        self.staged_dtypes = (dtype, dtype) if self.stages_both else (dtype,)

    @cute.jit
    def __call__(self, mY: cute.Tensor, mdY: cute.Tensor, mdX: cute.Tensor, stream):
        self.launch(self.kernel(mY, mdY, mdX), mY.shape[0], stream)

    @cute.kernel
    def kernel(self, mY: cute.Tensor, mdY: cute.Tensor, mdX: cute.Tensor):
        cfg = self.cfg
        smem = SmemAllocator()
        if cutlass.const_expr(self.stages_both):
            staged, streamed = [mY, mdY], None
        elif cutlass.const_expr(self.streams_y):
            staged, streamed = [mdY], mY
        else:
            staged, streamed = [mY], mdY
        tiles = RowTiles(cfg, staged, smem, pad=0.0)
        slot = ReductionSlot(smem, cfg, 1)
        tiles.issue_loads()
        if cutlass.const_expr(cfg.cluster_size > 1):
            cute.arch.cluster_wait()

        kept = []
        partial = Float32(0.0)
        # a streamed dy's loads issued a chunk ahead, before the wait for y's copies (one
        # chunk at a time, their latency was exposed)
        first_read_policy = "evict_last" if self.rereads_dy_in_reverse else None
        loaded = self._prefetch(tiles, mdY, 0, {}, self.streams_dy, first_read_policy)
        for c in cutlass.range_constexpr(cfg.num_chunks):
            loaded = self._prefetch(tiles, mdY, c + 1, loaded, self.streams_dy,
                                    first_read_policy)
            tiles.wait_chunk(c)
            # log_softmax needs sum(dy); softmax needs sum(y * dy)
            if cutlass.const_expr(self.streams_y):
                term = tiles.values(0, c, fill=0.0)
            else:
                y = tiles.values(0, c, fill=0.0)
                dy = tiles.to_fp32(loaded[c]) if self.streams_dy else tiles.values(1, c, fill=0.0)
                term = dy if self.log else y * dy
                if cutlass.const_expr(cfg.staging == "registers"):
                    kept.append((y, dy))
            partial = partial + red.thread_reduce(term, cute.ReductionOp.ADD, 0.0)
        tiles.prefetch_ahead(also=() if streamed is None else (streamed,))
        (dot,) = slot.allreduce((partial,), red.sum_combine, (Float32(0.0),))

        order = list(range(cfg.num_chunks))
        if cutlass.const_expr(self.rereads_dy_in_reverse):
            order.reverse()
        # (dy's re-read is its last use, and dx is written once and not read here)
        last_use_policy = "evict_first" if self.rereads_dy_in_reverse else None
        loaded = self._prefetch(tiles, streamed, order[0], {}, streamed is not None,
                                last_use_policy)
        for i, c in enumerate(order):
            if cutlass.const_expr(i + 1 < len(order)):
                loaded = self._prefetch(tiles, streamed, order[i + 1], loaded,
                                        streamed is not None, last_use_policy)
            if cutlass.const_expr(cfg.staging == "registers"):
                y, dy = kept[c]
            elif cutlass.const_expr(self.streams_y):
                y, dy = tiles.to_fp32(loaded[c]), tiles.values(0, c)
            else:
                y = tiles.values(0, c)
                dy = tiles.to_fp32(loaded[c]) if self.streams_dy else tiles.values(1, c)
            if cutlass.const_expr(self.log):
                dx = dy - cute.math.exp2(y * red.LOG2_E, fastmath=True) * dot
            else:
                dx = y * (dy - dot)
            tiles.store(mdX, c, dx, l2_policy=last_use_policy)

    def _prefetch(self, tiles: RowTiles, mT: cute.Tensor, chunk: int, loaded: dict,
                  streams: bool, l2_policy: str | None = None) -> dict:
        """``loaded`` (chunk -> values, 0 past the row end) with ``chunk``'s values of
        ``mT`` read from global memory (with ``l2_policy``, a key of
        tiling.L2_POLICIES), where it ``streams`` and the chunk exists. In
        mT's dtype: widened where used, a chunk in flight holds half the registers
        (widened at the load, the bf16 log_softmax backward of 1M columns took 98
        registers instead of 72 and ran 8% slower)."""
        if streams and chunk < self.cfg.num_chunks:
            loaded = {**loaded, chunk: tiles.load(mT, chunk, fill=0.0, raw=True,
                                                  l2_policy=l2_policy)}
        return loaded
