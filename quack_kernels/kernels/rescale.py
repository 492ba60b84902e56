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
from cutlass import Boolean, Float32, Int64
from cutlass.memory import SmemAllocator

from ..primitives.config import RowConfig
from ..primitives.rows import RowKernel, RowTiles


class RowRescale(RowKernel):
    """``with_target``: rows of targets outside [0, n_cols) or equal to ignore_index are
    left as they are (in place only). ``out_of_place``: write every row to mOut."""

    staged_dtypes = ()
    reductions = 0

    def __init__(self, cfg: RowConfig, with_target: bool, out_of_place: bool):
        assert cfg.staging == "global", "the rescale reads rows straight from global memory"
        assert not (with_target and out_of_place), "out of place, every row is written"
        self.cfg = cfg
        self.with_target = with_target
        self.out_of_place = out_of_place

    @cute.jit
    def __call__(self, mGrad: cute.Tensor, mOut: cute.Tensor, mTarget, mDloss: cute.Tensor,
                 mHeld: cute.Tensor, ignore_index: Int64, stream):
        self.launch(self.kernel(mGrad, mOut, mTarget, mDloss, mHeld, ignore_index),
                    mGrad.shape[0], stream)

    @cute.kernel
    def kernel(self, mGrad: cute.Tensor, mOut: cute.Tensor, mTarget, mDloss: cute.Tensor,
               mHeld: cute.Tensor, ignore_index: Int64):
        tiles = RowTiles(self.cfg, [mGrad], SmemAllocator())
        moves = Boolean(False)
        factor = Float32(1.0)
        if tiles.row_in_bounds:
            dloss = mDloss[tiles.row]
            held = mHeld[tiles.row]
            moves = Boolean(self.out_of_place) | (dloss != held)
            if cutlass.const_expr(self.with_target):
                target = Int64(mTarget[tiles.row])
                moves = moves & (target >= Int64(0)) & (target < Int64(self.cfg.n_cols)) \
                    & (target != ignore_index)
            factor = cutlass.select_(held != Float32(0.0), dloss / held, Float32(math.nan))
        if moves:
            self._scale_row(tiles, mOut, factor)

    @cute.jit
    def _scale_row(self, tiles: RowTiles, mOut: cute.Tensor, factor: Float32):
        # (a method: the row tiles, a Python object, cannot be carried through the `if`)
        for c in cutlass.range_constexpr(self.cfg.num_chunks):
            tiles.store(mOut, c, tiles.values(0, c) * factor)
