"""Column sums of a (P, W) fp32 matrix of partial sums, always in the same order.

The norm backward leaves one row of per-column partial sums (dweight, dbias) per row
slot of its looping grid; this kernel adds the P rows up and writes the (N,) results in
their own dtypes, in one launch for every segment. Segments sit side by side in a
row, each ``padded`` columns wide (a multiple of 4, so no vector crosses two).

Each CTA owns ``cols_per_cta`` columns. Its threads are (column thread, row group):
a column thread reads one 4-column vector, so a warp's load covers whole 32-byte
sectors of several rows; row group g adds rows g, g + groups, ... in order. Row
groups are then combined by butterfly shuffles inside each warp and across warps
through shared memory in warp order: the same input gives bitwise the same sums.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.memory import SmemAllocator

from ..primitives.config import ColumnSumConfig

VEC = 4  # fp32 per 16-byte load
WARP = 32
ROWS_IN_FLIGHT = 4  # loads a thread issues before it adds them


class ColumnSum:
    """out_k[j] = sum over rows p of partial[p, k * padded + j], j < n_cols, for each
    segment k (1 or 2; outputs in any float dtype)."""

    def __init__(self, cfg: ColumnSumConfig):
        assert cfg.padded % VEC == 0 and cfg.segments in (1, 2)
        self.cfg = cfg
        self.n_cols = cfg.n_cols
        self.padded = cfg.padded
        self.cols_per_cta = cfg.cols_per_cta
        self.width = cfg.width
        self.col_threads = cfg.cols_per_cta // VEC
        self.row_groups = cfg.threads_per_block // self.col_threads
        self.warps = cfg.threads_per_block // WARP
        assert self.col_threads <= WARP

    def smem_bytes(self) -> int:
        return self.warps * self.cols_per_cta * 4 + 64

    @cute.jit
    def __call__(self, mPartial: cute.Tensor, mOut0: cute.Tensor, mOut1, stream):
        self.kernel(mPartial, mOut0, mOut1).launch(
            grid=[cute.ceil_div(self.width, self.cols_per_cta), 1, 1],
            block=[self.cfg.threads_per_block, 1, 1], smem=self.smem_bytes(), stream=stream)

    @cute.kernel
    def kernel(self, mPartial: cute.Tensor, mOut0: cute.Tensor, mOut1):
        tidx = cute.arch.thread_idx()[0]
        tile = cute.arch.block_idx()[0]
        smem = SmemAllocator()
        warp_sums = smem.allocate_tensor(
            Float32, cute.make_ordered_layout((self.warps, self.cols_per_cta), order=(1, 0)),
            byte_alignment=16)

        col_thread = tidx % self.col_threads
        vector = tile * self.col_threads + col_thread
        in_range = vector * VEC < self.width
        # a column thread past the last column reads no row (a register tensor cannot
        # be updated inside a runtime branch it was made outside of)
        rows = cutlass.select_(in_range, mPartial.shape[0], 0)
        vector = cutlass.select_(in_range, vector, 0)
        acc = cute.make_rmem_tensor(cute.make_layout((1, VEC)), Float32)
        acc.fill(0.0)
        group = tidx // self.col_threads
        rows_per_batch = self.row_groups * ROWS_IN_FLIGHT
        batches = (rows - group + rows_per_batch - 1) // rows_per_batch
        for batch in cutlass.range(batches, unroll=1):
            # all loads of a batch are issued before the first add (an unrolled loop
            # that checks its bound per row waited for every load in turn); rows past
            # the end read row 0 and add nothing
            first = group + batch * rows_per_batch
            loaded = [cute.make_rmem_tensor(cute.make_layout((1, VEC)), Float32)
                      for _ in range(ROWS_IN_FLIGHT)]
            for k in cutlass.range_constexpr(ROWS_IN_FLIGHT):
                row = first + k * self.row_groups
                row = cutlass.select_(row < rows, row, 0)
                cute.autovec_copy(cute.local_tile(mPartial, (1, VEC), (row, vector)), loaded[k])
            for k in cutlass.range_constexpr(ROWS_IN_FLIGHT):
                inside = first + k * self.row_groups < rows
                for i in cutlass.range_constexpr(VEC):
                    acc[0, i] = acc[0, i] + Float32(cutlass.select_(inside, loaded[k][0, i],
                                                                     Float32(0.0)))

        lane = cute.arch.lane_idx()
        warp = cute.arch.warp_idx()
        offset = self.col_threads
        while cutlass.const_expr(offset < WARP):
            for i in cutlass.range_constexpr(VEC):
                acc[0, i] = acc[0, i] + cute.arch.shuffle_sync_bfly(acc[0, i], offset=offset)
            offset *= 2
        if lane < self.col_threads:
            for i in cutlass.range_constexpr(VEC):
                warp_sums[warp, col_thread * VEC + i] = acc[0, i]
        cute.arch.barrier()

        if tidx < self.cols_per_cta:
            total = Float32(0.0)
            for w in cutlass.range_constexpr(self.warps):
                total = total + warp_sums[w, tidx]
            column = tile * self.cols_per_cta + tidx
            segment = column // self.padded
            j = column - segment * self.padded
            if j < self.n_cols:
                if segment == 0:
                    mOut0[j] = total.to(mOut0.element_type)
                if cutlass.const_expr(mOut1 is not None):
                    if segment == 1:
                        mOut1[j] = total.to(mOut1.element_type)
