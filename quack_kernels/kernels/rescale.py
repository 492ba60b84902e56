"""Gradients computed ahead of the backward, for the upstream gradient a plain
``backward()`` gives, brought to the one that actually arrives.

Row i of ``grad`` was computed for the upstream gradient ``held[i]``; the backward
receives ``dloss[i]`` and the row becomes ``grad[i] * dloss[i] / held[i]`` (NaN where
held is 0: such a row cannot be recovered). In place, rows where the two agree move no
bytes (a plain backward costs one read of M scales), and with targets so do rows of
ignored or bad targets (0 or NaN whatever the scale). Out of place every row is
written to ``out``, converted to its dtype (a sum kept in fp32, delivered in the
parameter's dtype).

Bytes: the M scales (and targets); one read and one write of each row that moves.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from ..primitives.config import RowConfig
from ..primitives.rows import RowKernel, RowTiles


class RowRescale(RowKernel):
    """``with_target``: rows of targets outside [0, n_cols) or equal to ignore_index are
    left as they are (in place only). ``out_of_place``: write every row to mOut.
    ``uniform``: one scale pair for every row (dloss and held broadcast views, as for a
    reduced loss): read once, and in place with nothing to move every CTA returns at
    once, so the host launches a small looping grid (a plain backward costs ~3 us
    instead of a CTA per row block: 41 us at 131072 x 1024)."""

    staged_dtypes = ()
    reductions = 0
    programmatic_launch = True  # see CrossEntropyForward.programmatic_launch

    def __init__(self, cfg: RowConfig, with_target: bool, out_of_place: bool, uniform: bool):
        assert cfg.staging == "global", "the rescale reads rows straight from global memory"
        assert not (with_target and out_of_place), "out of place, every row is written"
        self.cfg = cfg
        self.with_target = with_target
        self.out_of_place = out_of_place
        self.uniform = uniform

    @cute.jit
    def __call__(self, mGrad: cute.Tensor, mOut: cute.Tensor, mTarget, mDloss: cute.Tensor,
                 mHeld: cute.Tensor, ignore_index: Int64, grid_rows: Int32, stream):
        self.launch(self.kernel(mGrad, mOut, mTarget, mDloss, mHeld, ignore_index, grid_rows),
                    mGrad.shape[0], stream, grid_rows=grid_rows)

    @cute.kernel
    def kernel(self, mGrad: cute.Tensor, mOut: cute.Tensor, mTarget, mDloss: cute.Tensor,
               mHeld: cute.Tensor, ignore_index: Int64, grid_rows: Int32):
        self.begin()
        home = RowTiles(self.cfg, [mGrad], SmemAllocator())
        rows = mGrad.shape[0]
        if cutlass.const_expr(self.uniform):
            factor = _factor(mDloss[0], mHeld[0])
            if Boolean(self.out_of_place) | (mDloss[0] != mHeld[0]):
                self.for_each_row_block(rows, grid_rows, self._row_block, home, mOut, mTarget,
                                        mDloss, mHeld, ignore_index, factor)
        else:
            self.for_each_row_block(rows, grid_rows, self._row_block, home, mOut, mTarget,
                                    mDloss, mHeld, ignore_index, Float32(1.0))

    @cute.jit
    def _row_block(self, block_row: Int32, iteration, home: RowTiles, mOut: cute.Tensor,
                   mTarget, mDloss: cute.Tensor, mHeld: cute.Tensor, ignore_index: Int64,
                   uniform_factor: Float32):
        tiles = home.at_block(block_row)
        moves = Boolean(False)
        factor = uniform_factor
        if tiles.row_in_bounds:
            moves = Boolean(True)
            if cutlass.const_expr(not self.uniform):
                dloss = mDloss[tiles.row]
                held = mHeld[tiles.row]
                moves = Boolean(self.out_of_place) | (dloss != held)
                factor = _factor(dloss, held)
            if cutlass.const_expr(self.with_target):
                target = Int64(mTarget[tiles.row])
                moves = moves & (target >= Int64(0)) & (target < Int64(self.cfg.n_cols)) \
                    & (target != ignore_index)
        if moves:
            self._scale_row(tiles, mOut, factor)

    @cute.jit
    def _scale_row(self, tiles: RowTiles, mOut: cute.Tensor, factor: Float32):
        # (a method: the row tiles, a Python object, cannot be carried through the `if`)
        for c in cutlass.range_constexpr(self.cfg.num_chunks):
            tiles.store(mOut, c, tiles.values(0, c) * factor)


@cute.jit
def _factor(dloss: Float32, held: Float32) -> Float32:
    return cutlass.select_(held != Float32(0.0), dloss / held, Float32(math.nan))
