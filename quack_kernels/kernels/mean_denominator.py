"""What a cross-entropy mean divides by, and its reciprocal, in one launch.

Every CTA of the loss kernel scales the gradient rows it writes by 1 / D, D the summed
class weight of the non-ignored targets (their count without class weights; a target
outside [0, C) counts, with the weight of its index clamped into range, and makes its
row's loss NaN). Built from torch ops, D and 1 / D take three launches (a comparison,
a sum, a reciprocal) whose host time a host-bound training step pays in full; here they
take one. A grid of CTAs (config.mean_denominator_ctas) reads the targets, each adding
its share in an order fixed by the grid, and GridSum adds the CTAs' sums in a fixed
order too: the same targets give bitwise the same D.

Bytes: the M targets (and the C weights, read where a target points).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass.memory import SmemAllocator

from ..primitives.config import MeanDenominatorConfig
from ..primitives.grid_sum import GridSum
from ..primitives.rows import wait_for_previous_grid


class MeanDenominator(GridSum):
    """mOut[0] = D, mOut[1] = 1 / D (IEEE division, as torch.reciprocal) of the targets
    ``mTarget`` (M,) with fp32 class weights ``mWeight`` (C,), or unweighted when the
    config says so (mWeight is then only a placeholder). ``mPartials``: GridSum's words
    for ``num_ctas`` CTAs, zero at launch."""

    programmatic_launch = True  # see CrossEntropyForward.programmatic_launch

    def __init__(self, cfg: MeanDenominatorConfig):
        self.cfg = cfg

    def smem_bytes(self) -> int:
        return self.cfg.threads_per_block // 32 * 4 + 16

    @cute.jit
    def __call__(self, mTarget: cute.Tensor, mWeight: cute.Tensor, mOut: cute.Tensor,
                 mPartials: cute.Tensor, ignore_index: Int64, num_ctas: Int32, stream):
        self.kernel(mTarget, mWeight, mOut, mPartials, ignore_index).launch(
            grid=[num_ctas, 1, 1], block=[self.cfg.threads_per_block, 1, 1], smem=self.smem_bytes(),
            stream=stream, use_pdl=self.programmatic_launch)

    @cute.kernel
    def kernel(self, mTarget: cute.Tensor, mWeight: cute.Tensor, mOut: cute.Tensor,
               mPartials: cute.Tensor, ignore_index: Int64):
        # the first of the training step's kernels (ops.cross_entropy). The loss kernel
        # is let in only as these CTAs end: let in at their start, its looping grid (sized
        # to fill every SM) was placed while they held room and the step lost 7%
        # (results/cross_entropy_step_pdl_late_H100_20261206.txt)
        wait_for_previous_grid(let_next_launch=False)
        threads = self.cfg.threads_per_block
        in_flight = self.cfg.targets_in_flight
        tidx = cute.arch.thread_idx()[0]
        scratch = SmemAllocator().allocate_tensor(
            Float32, cute.make_layout((threads // 32, 1), stride=(1, 1)), byte_alignment=16)
        num_rows = mTarget.shape[0]
        last_class = Int64(mWeight.shape[0] - 1)
        # one running sum per load in flight: a single one added 17578 fp32 weights in a
        # row per thread at 9M targets (D off by ~1e-5 relative in a GPU test)
        totals = (Float32(0.0),) * in_flight
        one_round = threads * in_flight
        start = cute.arch.block_idx()[0] * one_round + tidx
        stride = cute.arch.grid_dim()[0] * one_round
        for first in cutlass.range(start, num_rows, stride, unroll=1):
            # independent loads, the index clamped into the targets and masked
            targets = []
            for k in cutlass.range_constexpr(in_flight):
                row = first + k * threads
                targets.append(Int64(mTarget[cutlass.select_(row < num_rows, row, 0)]))
            weights = []
            for k in cutlass.range_constexpr(in_flight):
                kept = (first + k * threads < num_rows) & (targets[k] != ignore_index)
                if cutlass.const_expr(self.cfg.weighted):
                    index = cutlass.select_(kept, targets[k], Int64(0))
                    index = cutlass.select_(index < 0, Int64(0), index)
                    index = cutlass.select_(index > last_class, last_class, index)
                    weights.append(cutlass.select_(kept, mWeight[index], Float32(0.0)))
                else:
                    weights.append(cutlass.select_(kept, Float32(1.0), Float32(0.0)))
            totals = tuple(t + w for t, w in zip(totals, weights))
        total = totals[0]
        for k in cutlass.range_constexpr(1, in_flight):
            total = total + totals[k]
        holds, (total,) = self.grid_sum((total,), mPartials, scratch)
        if holds & (tidx == 0):
            mOut[0] = total
            mOut[1] = Float32(1.0) / total
        # (as a CTA's exit would, a little sooner: the measured form)
        cute.arch.griddepcontrol_launch_dependents()
