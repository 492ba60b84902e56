"""RMSNorm and LayerNorm over the last dimension, forward and backward.

Forward, per row of N values (optional residual r, weight w, bias b, offset o):
    h    = x + r                     (rounded to the residual dtype: the stream that is
                                      normalized is exactly the one handed back)
    mean = sum(h) / N                (LayerNorm; 0 for RMSNorm)
    rstd = 1 / sqrt(sum((h - mean)^2) / N + eps)     (centered variance)
    y    = (h - mean) * rstd * (w + o) + b
Backward, with xhat = (h - mean) * rstd and g = dy * (w + o):
    dh = rstd * (g - xhat * mean(g * xhat) - mean(g))     (mean(g) term: LayerNorm only)
         + d(residual stream)                              (prenorm: its own gradient)
    dx = dresidual = dh,   dw = sum over rows of dy * xhat,   db = sum over rows of dy
Bytes: forward reads x (+ r) and writes y (+ h); backward reads h, dy (+ dh_out) and
writes dx (+ dresidual); weights, statistics and partial sums are O(N + M).

Layout: RowKernel geometry (rows split over a cluster of up to 16 CTAs for large N).
The forward is one row block per CTA; LayerNorm reduces twice (sum, then the centered
sum of squares, on the staged row), or once for rows of x alone split over a cluster
and not kept in registers (each thread's count, mean and centered sum of squares,
from shifted sums in one pass, merged pairwise). The backward
launches a fixed grid (as many CTAs as fit on the GPU) that loops over row blocks,
loading the next block while it reduces and stores the current one when two staging
buffers fit (cfg.stages): each CTA keeps its columns' dw/db sums in an accumulator and
writes them once as one row of fp32 partials, which kernels.column_sum adds in a fixed
order (deterministic, no atomics).

Odd 16-bit rows may be read from the 16-byte boundary before each (cfg.row_shift,
RowTiles): the rows' edge vectors are padded with 0; the forward splices its 16-bit
weight and bias to each row's shift in registers (fp32 ones are staged at it), the
backward visits its rows class by class (rows.ShiftClassOrder), stages its weight at
each class's shift and writes its per-column sums of each class at their own columns.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass.memory import SmemAllocator

from ..primitives import reduce as red
from ..primitives import tiling
from ..primitives.config import (SHIFT_CLASSES, SMEM_BYTES_PER_CTA, RowConfig, late_columns_together,
                                 layer_norm_reduces_once, loop_ctas_per_sm, norm_backward_fma_form,
                                 norm_backward_holds_weight, norm_backward_loop_registers,
                                 norm_backward_refills_chunks, norm_backward_rereads_unmasked,
                                 norm_forward_columns_ahead, norm_forward_columns_before_reduction,
                                 norm_forward_early_columns, prefetch_row_stats,
                                 row_stats_a_block_ahead, shift_order_keeps_class_sizes,
                                 splices_shifted_columns, stage_columns_once)
from ..primitives.rows import (ReductionSlot, RowKernel, RowTiles, ShiftClassOrder,
                               kept_order_values)

ZERO = (Float32(0.0),)


def _round_to(values: cute.TensorSSA, dtype) -> cute.TensorSSA:
    """Round fp32 values to ``dtype`` and back (no-op for fp32)."""
    if dtype is None or dtype.width == 32:
        return values
    return values.to(dtype).to(Float32)


class NormForward(RowKernel):
    """y = norm(x + residual) * (weight + offset) + bias; optional inputs and outputs
    are compile-time switches (pass None for the absent ones)."""

    def __init__(self, cfg: RowConfig, rms: bool, x_dtype, residual_in_dtype, residual_dtype,
                 has_residual: bool, store_residual: bool, column_dtypes: tuple = ()):
        self.cfg = cfg
        self.rms = rms
        self.has_residual = has_residual
        self.store_residual = store_residual
        self.residual_dtype = residual_dtype  # dtype of the stream h (rounding)
        self.staged_dtypes = (x_dtype, residual_in_dtype) if has_residual else (x_dtype,)
        # x + residual rounded to a 16-bit stream dtype of both is their sum in that
        # dtype (fp32 carries at least twice its precision + 2 bits, so rounding twice
        # is exact), two values an instruction
        self.adds_in_stream_dtype = has_residual and residual_dtype.width == 16 \
            and x_dtype == residual_in_dtype == residual_dtype
        # LayerNorm reduces twice (the sum, then the centered sum of squares), or once
        # where config.layer_norm_reduces_once: each thread's (count, mean, centered sum
        # of squares) merged in one reduction (reduce.centered_moments_combine)
        self.moments = layer_norm_reduces_once(cfg, rms, has_residual)
        self.reductions = 1 if rms or self.moments else 2
        self.values_per_reduction = 3 if self.moments else 1
        self.early_columns = norm_forward_early_columns(
            rms, len(self.staged_dtypes), self.staged_bytes_per_col, cfg)
        self.columns_before_reduction = norm_forward_columns_before_reduction(
            len(self.staged_dtypes), self.staged_bytes_per_col, cfg)
        self.late_columns_together = late_columns_together(cfg)
        self.columns_ahead = not self.holds_columns and norm_forward_columns_ahead(
            cfg, max(d.width for d in (x_dtype, *column_dtypes)) // 8)
        if cfg.row_shift:
            # the weight and bias (``column_dtypes``) that are not spliced to a shifted
            # row's shift are staged in shared memory at it (splices_shifted_columns)
            self.column_dtypes = tuple(d for d in column_dtypes
                                       if not splices_shifted_columns(d.width // 8))

    @cute.jit
    def __call__(self, mX: cute.Tensor, mR, mW, mB, mY: cute.Tensor, mResOut, mMean,
                 mRstd: cute.Tensor, eps: Float32, weight_offset: Float32, stream):
        self.launch(self.kernel(mX, mR, mW, mB, mY, mResOut, mMean, mRstd, eps, weight_offset),
                    mX.shape[0], stream)

    def _stream(self, tiles: RowTiles, chunk: int):
        """h = x (+ residual) of ``chunk``, 0 past the row end."""
        if cutlass.const_expr(self.adds_in_stream_dtype):
            h = tiles.to_fp32(tiles.values(0, chunk, raw=True) + tiles.values(1, chunk, raw=True))
            # (a shifted row's pad is 0 already)
            if cutlass.const_expr(self.cfg.needs_col_predicate and not self.cfg.row_shift):
                h = tiling.mask_out_of_row(h, tiles.coords[chunk], self.cfg.n_cols, 0.0)
            return h
        h = tiles.values(0, chunk, fill=0.0)
        if cutlass.const_expr(self.has_residual):
            h = _round_to(h + tiles.values(1, chunk, fill=0.0), self.residual_dtype)
        return h

    def _squared_deviations(self, tiles: RowTiles, kept: list, center: Float32) -> Float32:
        """This thread's sum of (h - center)^2 over its values inside the row."""
        cfg = self.cfg
        total = Float32(0.0)
        for c in range(cfg.num_chunks):  # (traced inline: plain Python loops and ifs)
            h = kept[c] if cfg.staging == "registers" else self._stream(tiles, c)
            d = h - center
            if cfg.needs_col_predicate:
                d = tiles.mask_outside_row(d, c, 0.0)
            total = total + red.thread_sum_of_squares(d)
        return total

    def _column(self, tiles: RowTiles, mV, chunk: int, raw: bool = False):
        """fp32 (``raw``: own dtype) values of the per-column vector ``mV`` in ``chunk``
        (None for an absent one; a shifted row's spliced to its shift, or staged at it:
        config.splices_shifted_columns)."""
        if cutlass.const_expr(mV is None):
            return None
        if cutlass.const_expr(self.cfg.row_shift):
            if cutlass.const_expr(splices_shifted_columns(mV.element_type.width // 8)):
                return tiles.shifted_column_values(mV, chunk, raw=raw)
            return tiles.column_values(mV, chunk, raw=raw)
        return tiles.load(tiles.broadcast_rows(mV), chunk, guard_rows=False, raw=raw)

    def _chunk_columns(self, tiles: RowTiles, mW, mB, chunk: int) -> tuple:
        """(weight, bias) of ``chunk``, loaded now in their own dtypes: widened where
        used, they stay half the registers until then (widened at the load, RMSNorm bf16
        262144 held 100 registers instead of 79)."""
        return self._column(tiles, mW, chunk, raw=True), self._column(tiles, mB, chunk, raw=True)

    def _share_columns(self, tiles: RowTiles, mW, mB) -> list:
        """_chunk_columns of every chunk of this CTA's share."""
        return [self._chunk_columns(tiles, mW, mB, c) for c in range(self.cfg.num_chunks)]

    @property
    def holds_columns(self) -> bool:
        """Whether the weight and bias are in registers before the output pass: loaded
        with the row (early_columns) or before its cluster exchange."""
        return self.early_columns or self.columns_before_reduction

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mR, mW, mB, mY: cute.Tensor, mResOut, mMean,
               mRstd: cute.Tensor, eps: Float32, weight_offset: Float32):
        cfg = self.cfg
        smem = SmemAllocator()
        staged = [mX, mR] if cutlass.const_expr(self.has_residual) else [mX]
        # (a shifted row's edge vectors hold the rows' beside it: padded with 0, no
        # sum's term)
        tiles = RowTiles(cfg, staged, smem, pad=0.0 if cutlass.const_expr(cfg.row_shift) else None)
        slots = [ReductionSlot(smem, cfg, self.values_per_reduction,
                               arrive=i == self.reductions - 1)
                 for i in range(self.reductions)]
        tiles.issue_loads()
        if cutlass.const_expr(cfg.row_shift):
            mW, mB = (v if v is None or splices_shifted_columns(v.element_type.width // 8)
                      else tiles.stage_shifted_columns(smem, v) for v in (mW, mB))
        # (config.norm_forward_early_columns: the share's weight and bias in flight with
        # its row, instead of loaded per chunk in the output pass)
        held_columns = self._share_columns(tiles, mW, mB) \
            if cutlass.const_expr(self.early_columns) else []
        if cutlass.const_expr(cfg.cluster_size > 1):
            cute.arch.cluster_wait()
        inv_n = Float32(1.0 / cfg.n_cols)

        kept = []
        partial = Float32(0.0)
        # moments: sums of d = h - shift and of d^2 in the same pass (shift one of the
        # thread's values; s2 - s1^2 / n is well conditioned when the shift is within a
        # few deviations of the mean), since a second pass would re-read shared memory.
        # The threads' means are merged as deviations from one value of the row (its
        # first): as absolute means they lost their differences to the rounding of the
        # mean itself (fp32 emulation at n = 262144, mean 300, std 1e-3: variance off
        # by 3.2e-4 relative, 1.4e-7 as deviations).
        shift = Float32(0.0)
        row_reference = Float32(0.0)
        if cutlass.const_expr(self.moments):
            row_reference = Float32(mX[cutlass.select_(tiles.row_in_bounds, tiles.row, 0), 0])
        shifted_squares = Float32(0.0)
        for c in cutlass.range_constexpr(cfg.num_chunks):
            tiles.wait_chunk(c)
            h = self._stream(tiles, c)
            if cutlass.const_expr(self.store_residual):
                tiles.store(mResOut, c, h)
            if cutlass.const_expr(self.moments):
                if cutlass.const_expr(c == 0):
                    shift = h[0]
                    if cutlass.const_expr(cfg.row_shift):
                        # (a shifted row's first thread may start on the row before's
                        # values, padded 0)
                        shift = cutlass.select_(tiles.first_value_in_row(), shift, row_reference)
                d = h - shift
                if cutlass.const_expr(cfg.needs_col_predicate):
                    d = tiles.mask_outside_row(d, c, 0.0)
                partial = partial + red.thread_reduce(d, cute.ReductionOp.ADD, 0.0)
                shifted_squares = shifted_squares + red.thread_sum_of_squares(d)
            else:
                partial = partial + (red.thread_sum_of_squares(h) if cutlass.const_expr(self.rms)
                                     else red.thread_reduce(h, cute.ReductionOp.ADD, 0.0))
            if cutlass.const_expr(cfg.staging == "registers"):
                kept.append(h)
        # (config.norm_forward_columns_before_reduction: their latency behind the exchange)
        if cutlass.const_expr(self.columns_before_reduction):
            held_columns = self._share_columns(tiles, mW, mB)
        tiles.prefetch_ahead()
        mean = Float32(0.0)
        if cutlass.const_expr(self.rms):
            (total,) = slots[0].allreduce((partial,), red.sum_combine, ZERO)
            variance = total * inv_n
        elif cutlass.const_expr(self.moments):
            # this thread's count, mean and centered sum of squares, merged over the row
            count = Float32(tiles.values_in_row())
            shifted_mean = partial / cute.arch.fmax(count, Float32(1.0))
            # (an empty group's mean must be 0, see centered_moments_combine)
            group_mean = cutlass.select_(count > Float32(0.0),
                                         (shift - row_reference) + shifted_mean, Float32(0.0))
            _, deviation, centered = slots[0].allreduce(
                (count, group_mean, shifted_squares - partial * shifted_mean),
                red.centered_moments_combine, ZERO * 3)
            mean = row_reference + deviation
            variance = centered * inv_n
        else:
            (total,) = slots[0].allreduce((partial,), red.sum_combine, ZERO)
            mean = total * inv_n
            (centered,) = slots[1].allreduce((self._squared_deviations(tiles, kept, mean),),
                                             red.sum_combine, ZERO)
            variance = centered * inv_n
        rstd = cute.math.rsqrt(variance + eps)
        offset_scale = weight_offset * rstd

        if cutlass.const_expr(self.columns_ahead):
            # (config.norm_forward_columns_ahead: each chunk's loaded with the chunk before)
            held_columns = {0: self._chunk_columns(tiles, mW, mB, 0)}
        for c in cutlass.range_constexpr(cfg.num_chunks):
            if cutlass.const_expr(self.columns_ahead and c + 1 < cfg.num_chunks):
                held_columns[c + 1] = self._chunk_columns(tiles, mW, mB, c + 1)
            h = kept[c] if cutlass.const_expr(cfg.staging == "registers") else self._stream(tiles, c)
            weight, bias = None, None
            if cutlass.const_expr(self.holds_columns or self.columns_ahead):
                weight, bias = (None if v is None else tiles.to_fp32(v) for v in held_columns[c])
            elif cutlass.const_expr(self.late_columns_together):
                weight, bias = self._column(tiles, mW, c), self._column(tiles, mB, c)
            # (an explicit FMA for the bias saved one instruction per value, but held
            # the weight and bias of a registers share live: fp32 128256 80 -> 127
            # registers)
            scale = rstd
            if cutlass.const_expr(mW is not None):
                if cutlass.const_expr(weight is None):
                    weight = self._column(tiles, mW, c)
                # (weight + offset) * rstd as one FMA a value
                scale = weight * rstd + offset_scale
            y = (h - mean) * scale
            if cutlass.const_expr(mB is not None):
                if cutlass.const_expr(bias is None):
                    bias = self._column(tiles, mB, c)
                y = y + bias
            tiles.store(mY, c, y)

        if tiles.leads_row:
            mRstd[tiles.row] = rstd
            if cutlass.const_expr(mMean is not None):
                mMean[tiles.row] = mean


class NormBackward(RowKernel):
    """dx (and/or dresidual), and per-CTA partial sums of dweight / dbias.

    Staged: h (the normalized stream) and dy. Optional tensors are compile-time
    switches (None when absent): mW, mMean (LayerNorm), mdResOut (gradient of the
    prenorm residual output), mdX / mdRes (outputs), mdW / mdB ((config.partial_sum_rows,
    N) fp32 partials)."""

    scratch_buffers = 2
    def __init__(self, cfg: RowConfig, rms: bool, h_dtype, dy_dtype, need_dweight: bool,
                 need_dbias: bool, weight_dtype=None):
        self.cfg = cfg
        self.rms = rms
        self.staged_dtypes = (h_dtype, dy_dtype)
        self.values_per_reduction = 1 if rms else 2
        self.need_dweight = need_dweight
        self.need_dbias = need_dbias
        self.accumulators = int(need_dweight) + int(need_dbias)
        self.loop_registers = norm_backward_loop_registers(cfg, h_dtype.width, dy_dtype.width,
                                                           self.accumulators)
        # The weight is read for every row block: held in registers by a share of one
        # chunk in registers (its columns are the same in every block), else staged once
        # in shared memory where config.stage_columns_once says so (not with vectors
        # under 4 bytes, which cp.async cannot zero-fill past the row end).
        if cfg.row_shift:
            # (staged at the shift of each class of rows this CTA visits: _row_blocks;
            # where it does not fit, read from global memory and spliced to the shift,
            # config.shifted_sums_share)
            self.column_dtypes = () if weight_dtype is None else (weight_dtype,)
            if self.column_dtypes and splices_shifted_columns(weight_dtype.width // 8) \
                    and self.launch_smem_bytes() > SMEM_BYTES_PER_CTA:
                self.column_dtypes = ()
                self._ctas_per_sm = None  # (found with the weight's buffer)
        elif weight_dtype is not None and tiling.copies_async(weight_dtype, cfg) \
                and not self.holds_weight:
            alone = loop_ctas_per_sm(cfg, self.smem_bytes(), self.loop_registers)
            self.column_dtypes = (weight_dtype,)
            smem_with = self.smem_bytes()
            with_weight = loop_ctas_per_sm(cfg, smem_with, self.loop_registers)
            if not stage_columns_once(alone, with_weight, smem_with, rms):
                self.column_dtypes = ()

    @property
    def prefetches_stats(self) -> bool:
        """Whether each row block's rstd / mean are loaded during the block before
        (config.prefetch_row_stats)."""
        return prefetch_row_stats(self.rms, self.ctas_per_sm())

    @property
    def fma_form(self) -> bool:
        """Whether dh = rstd * (g - xhat * c1 - c2) takes two FMAs a value
        (config.norm_backward_fma_form)."""
        return norm_backward_fma_form(self.cfg, self.rms, self.staged_dtypes[0].width,
                                      self.staged_dtypes[1].width)

    @property
    def holds_weight(self) -> bool:
        """Whether weight + offset is loaded once into registers before the loop over row
        blocks (config.norm_backward_holds_weight; a shifted row's is staged)."""
        return norm_backward_holds_weight(self.cfg, self.fma_form) and not self.cfg.row_shift

    @property
    def rereads_unmasked(self) -> bool:
        """Whether the dh pass re-reads h and dy from the stage unmasked and takes dh =
        g * rstd - h * (c1 * rstd^2) (config.norm_backward_rereads_unmasked)."""
        return norm_backward_rereads_unmasked(self.cfg, self.rms)

    @property
    def refills_chunks(self) -> bool:
        """Whether each chunk of the next row block is loaded as soon as the dh pass has
        read it (config.norm_backward_refills_chunks)."""
        plain_loads = not all(tiling.copies_async(d, self.cfg) for d in self.staged_dtypes)
        return norm_backward_refills_chunks(self.cfg, self.rms, plain_loads)

    def smem_bytes(self) -> int:
        # shifted rows: the kept order (ShiftClassOrder.keep), an aligned allocation
        kept = 16 + 4 * kept_order_values(self.keeps_class_sizes)
        return super().smem_bytes() + (kept if self.cfg.row_shift else 0)

    @property
    def keeps_class_sizes(self) -> bool:
        """Whether the shifted rows' order keeps its class sizes in shared memory too
        (config.shift_order_keeps_class_sizes)."""
        return shift_order_keeps_class_sizes(self.cfg)

    def splices_weight(self, mW) -> bool:
        """Whether a shifted row's weight is read from global memory, spliced to the
        row's shift (where shared memory has no room for it)."""
        return self.cfg.row_shift and mW is not None and not self.weight_staged

    @property
    def weight_staged(self) -> bool:
        """Whether the weight is read from shared memory (RowTiles.stage_columns)."""
        return bool(self.column_dtypes)

    @cute.jit
    def __call__(self, mH: cute.Tensor, mdY: cute.Tensor, mW, mMean, mRstd: cute.Tensor,
                 mdResOut, mdX, mdRes, mdW, mdB, weight_offset: Float32, grid_rows: Int32,
                 stream):
        self.launch(
            self.kernel(mH, mdY, mW, mMean, mRstd, mdResOut, mdX, mdRes, mdW, mdB,
                        weight_offset, grid_rows),
            mH.shape[0], stream, grid_rows=grid_rows)

    @cute.kernel
    def kernel(self, mH: cute.Tensor, mdY: cute.Tensor, mW, mMean, mRstd: cute.Tensor,
               mdResOut, mdX, mdRes, mdW, mdB, weight_offset: Float32, grid_rows: Int32):
        cfg = self.cfg
        smem = SmemAllocator()
        # (a shifted row's edge vectors hold the rows' beside it: padded with 0)
        home = RowTiles(cfg, [mH, mdY], smem, pad=0.0 if cutlass.const_expr(cfg.row_shift) else None)
        slot = ReductionSlot(smem, cfg, self.values_per_reduction, buffers=self.scratch_buffers)
        acc_w = [home.accumulator(smem, c, self.sums_in_registers)
                 for c in range(cfg.num_chunks)] if self.need_dweight else []
        acc_b = [home.accumulator(smem, c, self.sums_in_registers)
                 for c in range(cfg.num_chunks)] if self.need_dbias else []
        sW = mW
        if cutlass.const_expr(mW is not None and self.holds_weight):
            sW = home.kept_in_registers(self._weight(home, mW, 0, weight_offset), 0)
        elif cutlass.const_expr(mW is not None and self.weight_staged):
            # (shifted rows: staged at each class's shift, _row_blocks)
            sW = home.column_buffer(smem, mW.element_type) if cutlass.const_expr(cfg.row_shift) \
                else home.stage_columns(smem, mW)
        if cutlass.const_expr(cfg.cluster_size > 1):
            cute.arch.cluster_wait()
        sums = (mdW, mdB, acc_w, acc_b)
        row_args = (mMean, mRstd, mdResOut, mdX, mdRes, weight_offset, sums)
        if cutlass.const_expr(cfg.row_shift):
            # (every class, those this CTA does not write skipped inside: the order is
            # kept in shared memory, see ShiftClassOrder.keep)
            kept = ShiftClassOrder(mH.shape[0], grid_rows).keep(smem, self.keeps_class_sizes)
            for shift_class in cutlass.range(SHIFT_CLASSES, unroll=1):
                # (one method call a loop body: see RowKernel.for_each_row_block)
                self._class_row_blocks(shift_class, kept, home, mH.shape[0], grid_rows,
                                       slot, mW, sW, *row_args)
        else:
            self._row_blocks(home, mH.shape[0], grid_rows, slot, sW, *row_args)
            self._store_sums(home, sums)

    def _row_blocks(self, home: RowTiles, num_rows, grid_rows, slot, sW, mMean, mRstd,
                    *row_args, blocks=None, restaged=None):
        """The loop over this CTA's row blocks from ``home`` (the first), ``blocks`` as
        for_each_row_block's: the first block's loads and statistics issued before it.
        ``sW``: the weight as _row_block reads it (held, staged or global); ``restaged``
        (a class of shifted rows): the weight, staged into sW at home's shift once those
        loads are under way (they land in a buffer no thread reads now)."""
        if cutlass.const_expr(self.cfg.stages == 2 or self.refills_chunks):
            home.issue_loads()  # the first block; each iteration loads the next
        first_stats = None
        if cutlass.const_expr(self.prefetches_stats):
            first_stats = self._row_stats(home, mMean, mRstd)
        if cutlass.const_expr(restaged is not None):
            cute.arch.barrier()  # every thread has read the last class's weight
            home.restage_shifted_columns(sW, restaged)
        self.for_each_row_block(num_rows, grid_rows, self._row_block, home, grid_rows, slot,
                                sW, mMean, mRstd, *row_args, carry=first_stats, blocks=blocks)

    @cute.jit
    def _class_row_blocks(self, shift_class, kept: cute.Tensor, home: RowTiles, num_rows,
                          grid_rows, slot, mW, sW, *row_args):
        """Shifted rows: class ``shift_class`` of the order (rows.ShiftClassOrder,
        ``kept`` in shared memory), where this CTA writes it."""
        if ShiftClassOrder.writes(kept, shift_class):
            self._written_class_row_blocks(ShiftClassOrder(num_rows, grid_rows, kept=kept),
                                           shift_class, home, num_rows, grid_rows, slot, mW,
                                           sW, *row_args)

    @cute.jit
    def _written_class_row_blocks(self, order: ShiftClassOrder, shift_class, home: RowTiles,
                                  num_rows, grid_rows, slot, mW, sW, *row_args):
        """This CTA's rows of class ``shift_class`` of ``order``, the weight staged at
        their shift once every thread has read it at the last class's, then their dw / db
        sums written as the CTA's row of the class in the partials (none of the class:
        zeros, without loads or restaging)."""
        first, end = order.segment(shift_class)
        before = first - order.first  # this CTA's iterations before the class
        tiles = home.in_class(order, shift_class, (first, end),
                              before % 2 if self.cfg.stages == 2 else 0)
        if first < end:
            self._row_blocks(tiles, num_rows, grid_rows, slot, sW, *row_args,
                             blocks=(first, end, order.first),
                             restaged=mW if self.weight_staged else None)
        self._store_sums(tiles, row_args[-1], partial_row=order.cta + shift_class)

    def _store_sums(self, tiles: RowTiles, sums, partial_row=None):
        """Write this CTA's dw / db sums (``sums``: the partials and accumulators) as its
        row of the partials: ``tiles``' block row, or for a class of shifted rows row
        ``partial_row`` at their own columns (``tiles``' shift), the sums then zeroed
        for the next class."""
        mdW, mdB, acc_w, acc_b = sums
        for c in range(self.cfg.num_chunks):  # (traced inline)
            for mP, acc in ((mdW, acc_w), (mdB, acc_b)):
                if cutlass.const_expr(len(acc) > 0 and partial_row is None):
                    tiles.store(mP, c, acc[c].load(), guard_rows=False)
                elif cutlass.const_expr(len(acc) > 0):
                    tiles.store_shifted_columns(mP, partial_row, c, acc[c].load())
                    acc[c].fill(0.0)

    def _row_stats(self, tiles: RowTiles, mMean, mRstd):
        """(rstd, mean) of this thread's row of ``tiles`` loaded from global memory (mean
        0 for RMSNorm), row 0's past the last row: ``_in_row`` zeroes them at first use."""
        row = cutlass.select_(tiles.row_in_bounds, tiles.row, 0)
        mean = Float32(0.0)
        if cutlass.const_expr(not self.rms):
            mean = Float32(mMean[row])
        return Float32(mRstd[row]), mean

    @staticmethod
    def _in_row(tiles: RowTiles, stats):
        """``stats`` of a row past M replaced by 0 (another row's could be inf or NaN and
        reach the per-column sums). Selected where first used, not where loaded: a
        select next to the load would wait for a prefetched load there."""
        return tuple(Float32(cutlass.select_(tiles.row_in_bounds, v, Float32(0.0))) for v in stats)

    def _row_block(self, block_row, iteration, home: RowTiles, grid_rows, slot: ReductionSlot,
                   mW, mMean, mRstd, mdResOut, mdX, mdRes, weight_offset, sums, carry=None):
        """dx / dresidual of row block ``block_row``, and its dw / db terms (``sums``:
        the partials and accumulators of dw and db). Where the kernel prefetches_stats,
        ``carry`` holds this block's statistics and the next block's are returned,
        loaded as this block begins (config.row_stats_a_block_ahead) or once its row
        sums are in, so that their latency passes behind this block; otherwise they are
        loaded here."""
        cfg = self.cfg
        inv_n = Float32(1.0 / cfg.n_cols)
        acc_w, acc_b = sums[2:]
        tiles = home.begin_block(block_row, grid_rows, iteration, self.refills_chunks)
        early = self.prefetches_stats and row_stats_a_block_ahead(cfg)
        next_stats = None
        if cutlass.const_expr(self.prefetches_stats):
            stats = carry
        else:
            stats = self._row_stats(tiles, mMean, mRstd)
        if cutlass.const_expr(early):
            next_stats = self._row_stats(home.at_block(home.block_after(block_row, grid_rows)),
                                         mMean, mRstd)
        rstd, mean = self._in_row(tiles, stats)
        mask_rows = self._masks_rows(mdResOut)
        kept = []
        dot = Float32(0.0)  # sum(g * xhat)
        g_sum = Float32(0.0)  # sum(g), LayerNorm
        for c in range(cfg.num_chunks):
            tiles.wait_chunk(c)
            xhat, g = self._xhat_g(tiles, c, mW, mean, rstd, weight_offset, acc_w, acc_b,
                                   mask_rows)
            dot = dot + red.thread_reduce(g * xhat, cute.ReductionOp.ADD, 0.0)
            if cutlass.const_expr(not self.rms):
                g_sum = g_sum + red.thread_reduce(g, cute.ReductionOp.ADD, 0.0)
            if cutlass.const_expr(cfg.staging == "registers"):
                kept.append((xhat, g))
        tiles.prefetch_ahead(grid_rows)
        if cutlass.const_expr(self.rms):
            (dot,) = slot.allreduce((dot,), red.sum_combine, ZERO, iteration=iteration)
        else:
            dot, g_sum = slot.allreduce((dot, g_sum), red.sum_combine,
                                        (Float32(0.0), Float32(0.0)), iteration=iteration)
        c1 = dot * inv_n
        c2 = g_sum * inv_n
        scale, shift = -c1 * rstd, -c2 * rstd  # (the FMA form's)
        if cutlass.const_expr(self.prefetches_stats and not early):
            next_stats = self._row_stats(home.at_block(home.block_after(block_row, grid_rows)),
                                         mMean, mRstd)

        for c in range(cfg.num_chunks):
            if cutlass.const_expr(self.rereads_unmasked):
                h = tiles.values(0, c)
                dh = self._g(tiles, c, mW, tiles.values(1, c), weight_offset) * rstd \
                    + h * (scale * rstd)
            else:
                if cutlass.const_expr(cfg.staging == "registers"):
                    xhat, g = kept[c]
                else:
                    xhat, g = self._xhat_g(tiles, c, mW, mean, rstd, weight_offset, None,
                                           None, mask_rows)
                if cutlass.const_expr(self.rms):
                    dh = (g - xhat * c1) * rstd
                elif cutlass.const_expr(self.fma_form):  # two FMAs a value
                    dh = (g * rstd + shift) + xhat * scale
                else:
                    dh = (g - xhat * c1 - c2) * rstd
            if cutlass.const_expr(self.refills_chunks):
                tiles.refill_chunk(c, grid_rows)
            if cutlass.const_expr(mdResOut is not None):
                dh = dh + tiles.load(mdResOut, c)
            if cutlass.const_expr(mdX is not None):
                tiles.store(mdX, c, dh)
            if cutlass.const_expr(mdRes is not None):
                tiles.store(mdRes, c, dh)
        return next_stats

    def _weight(self, tiles: RowTiles, mW, c: int, weight_offset):
        """weight + offset in chunk ``c``, read from shared memory where staged."""
        if cutlass.const_expr(self.weight_staged):
            w = tiles.column_values(mW, c)
        elif cutlass.const_expr(self.splices_weight(mW)):
            # (unspecified past the row end: see _xhat_g)
            w = tiles.shifted_column_values(mW, c)
        else:
            w = tiles.load(tiles.broadcast_rows(mW), c, guard_rows=False)
        return w + weight_offset

    def _masks_rows(self, mdResOut) -> bool:
        """Whether the staged rows past M are read as 0. A block of one row is always
        inside M (the loop visits no block past it): the shares of holds_weight and of
        rereads_unmasked (with a weight or without one), without a residual gradient to
        add, read their rows unmasked (rereads_unmasked: RMSNorm fp16 512x262144 88.2% ->
        91.0% of the copy ceiling, bf16 89.5 -> 89.6). Elsewhere the loads then moved
        earlier and held more registers (sm_90a, 8 bytes spilled: RMSNorm bf16 65536 on
        1024 threads, LayerNorm bf16 262144 in two chunks, and LayerNorm bf16 8192 with
        the residual gradient)."""
        unmasked = self.holds_weight or self.rereads_unmasked
        return not (unmasked and self.cfg.rows_per_block == 1 and mdResOut is None)

    def _g(self, tiles: RowTiles, c: int, mW, dy, weight_offset):
        """g = dy * (w + offset) of chunk ``c``."""
        if cutlass.const_expr(mW is None):
            return dy
        if cutlass.const_expr(self.holds_weight):
            return dy * mW.load()
        return dy * self._weight(tiles, mW, c, weight_offset)

    def _xhat_g(self, tiles: RowTiles, c: int, mW, mean, rstd, weight_offset, acc_w, acc_b,
                mask_rows: bool):
        """xhat and g of chunk ``c``, both 0 past the row end and on rows past M (where
        ``mask_rows``; g past the row end only with accumulators where the weight is
        spliced: the dh pass stores nothing there); adds this chunk's dw / db terms when
        accumulators are given."""
        h = tiles.values(0, c, fill=0.0, mask_rows=mask_rows)
        dy = tiles.values(1, c, fill=0.0, mask_rows=mask_rows)
        xhat = (h - mean) * rstd
        if cutlass.const_expr(self.cfg.needs_col_predicate and not self.rms):
            # (RMSNorm's is 0 there already: h is, and its mean is 0)
            xhat = tiles.mask_outside_row(xhat, c, 0.0)
        g = self._g(tiles, c, mW, dy, weight_offset)
        if cutlass.const_expr(acc_w is not None and self.splices_weight(mW)):
            # (the row sums take g as 0 past the row end, where the spliced weight is
            # unspecified; the dh pass stores nothing there)
            g = tiles.mask_outside_row(g, c, 0.0)
        if cutlass.const_expr(acc_w is not None and self.need_dweight):
            acc_w[c].store(acc_w[c].load() + dy * xhat)
        if cutlass.const_expr(acc_b is not None and self.need_dbias):
            acc_b[c].store(acc_b[c].load() + dy)
        return xhat, g
