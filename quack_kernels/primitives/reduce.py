"""Row reductions: thread -> warp -> block -> cluster, for one or several fp32 values.

A "combine" is any associative, commutative function on tuples of Float32 (sum, max,
the (max, sum-of-exp) pair of an online softmax, ...). ``row_allreduce`` leaves the
row's result in every thread of the row after at most one block barrier and, for
clusters, one mbarrier wait on the distributed shared memory exchange:

  warp:    butterfly shuffles over the row's lanes (threads_per_row <= 32) or the warp
  block:   lane 0 of each warp writes its partial to ``scratch``; after a barrier each
           warp reads all partials of its row and reduces them again with shuffles
  cluster: lane r of each warp st.async's its warp partial into CTA r's scratch (one
           vector store a peer), or, where merges_cta_first, the CTA's partial merged
           as in a block from the row's first warp; the mbarrier completes when every
           CTA's bytes have landed, then every warp reduces the partials of its row

``scratch`` is (rows_per_block, scratch_slots, slot_words) fp32 in shared
memory; allocate one per reduction of a kernel (never reused within one pass, so no
barrier is needed between consecutive reductions); kernels looping over row blocks
alternate two buffers of one, safe as row_allreduce says.
"""

from __future__ import annotations

import math

from typing import Callable, Tuple

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64
from cutlass._mlir.dialects import arith

from .config import RowConfig, merges_cta_first

Values = Tuple[Float32, ...]


LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


def sum_combine(a: Values, b: Values) -> Values:
    return tuple(x + y for x, y in zip(a, b))


def finite_or_zero(m: Float32) -> Float32:
    """A running max of -inf (nothing seen yet) as 0, so x - max never is -inf - -inf."""
    return Float32(cutlass.select_(m == -math.inf, Float32(0.0), m))


def centered_moments_combine(a: Values, b: Values) -> Values:
    """Merge (count, mean, sum of squared deviations from the mean) of two groups of
    values (Chan, Golub and LeVeque's pairwise update): the variance stays a centered
    sum, never E[x^2] - E[x]^2, and one reduction gives both the mean and the variance.
    An empty group (count 0) contributes nothing provided its mean is 0 (any other
    finite mean still moves the result by rounding; callers pass 0). The mean is the
    midpoint moved by delta times a weight that changes sign with it, so the two lanes
    of a butterfly (which merge (a, b) and (b, a)) round alike, whichever products the
    compiler fuses. 1 / count is the approximate reciprocal (an error of an ulp or two
    in the update terms, where an IEEE division took a dozen instructions and a branch
    on the reduction's critical path)."""
    count = a[0] + b[0]
    inv_count = cute.arch.rcp_approx(cute.arch.fmax(count, Float32(1.0)))
    delta = b[1] - a[1]
    mean = cute.math.fma(delta, (b[0] - a[0]) * Float32(0.5) * inv_count,
                         (a[1] + b[1]) * Float32(0.5))
    return count, mean, (a[2] + b[2]) + delta * delta * (a[0] * b[0] * inv_count)


def online_softmax_combine(a: Values, b: Values, rescaled: int = 1, *, base2: bool) -> Values:
    """Merge partials (m, ``rescaled`` sums of exp(x - m), any further plain sums): the
    exp sums are rescaled to the merged max; an all -inf side contributes 0. ``base2``:
    m is in base-2 units (x log2 e, see chunk_exp2), else in the units of x."""
    m = cute.arch.fmax(a[0], b[0])
    m_safe = finite_or_zero(m)

    def exponent(side_max):
        return side_max - m_safe if base2 else (side_max - m_safe) * LOG2_E

    scale_a = cute.math.exp2(exponent(a[0]), fastmath=True)
    scale_b = cute.math.exp2(exponent(b[0]), fastmath=True)
    end = 1 + rescaled
    return ((m,) + tuple(x * scale_a + y * scale_b for x, y in zip(a[1:end], b[1:end]))
            + sum_combine(a[end:], b[end:]))


class OnlineSoftmax:
    """online_softmax_combine as a combine object, ``combine(a, b)``; with
    ``two_phase`` it also reduces across lanes in two phases (``warp_allreduce``): the
    max first, then each lane's sums rescaled to it once and added. Merging pairwise
    rescales with two exp2 per butterfly step; two phases take one per lane and the
    same shuffles, but hold a few more values live across the shuffles."""

    def __init__(self, *, base2: bool, two_phase: bool):
        self.base2 = base2
        self.two_phase = two_phase

    def __call__(self, a: Values, b: Values) -> Values:
        return online_softmax_combine(a, b, base2=self.base2)

    def warp_allreduce(self, values: Values, width: int) -> Values:
        """``values`` merged over ``width`` consecutive lanes (a power of two <= 32),
        in every lane. Traced inline (not cute.jit): its loop runs at trace time."""
        if width == 1:
            return values
        m = values[0]
        offset = width // 2
        while offset >= 1:
            m = cute.arch.fmax(m, cute.arch.shuffle_sync_bfly(m, offset=offset))
            offset //= 2
        shift = values[0] - finite_or_zero(m)
        scale = cute.math.exp2(shift if self.base2 else shift * LOG2_E, fastmath=True)
        sums = (values[1] * scale,) + tuple(values[2:])
        return (m,) + _shuffle_allreduce(sums, sum_combine, width)


def warp_allreduce(values: Values, combine: Callable, width: int) -> Values:
    """``values`` reduced over ``width`` consecutive lanes (a power of two <= 32) with
    ``combine``, in every lane: by the combine's own two-phase form where it has one
    (OnlineSoftmax), else pairwise in a butterfly."""
    if _two_phase(combine):
        return combine.warp_allreduce(values, width)
    return _shuffle_allreduce(values, combine, width)


def _two_phase(combine: Callable) -> bool:
    """Whether ``combine`` reduces across lanes in its own two phases (OnlineSoftmax).
    Only the softmax forward of rows staged in shared memory uses one: in the
    cross-entropy kernels it (and skipping the identity in _reduce_slots) moved the
    every-option fp32 kernel at 128256 columns from 64 to 80 registers, 4 to 3 CTAs
    per SM, and lost 8 points there."""
    return getattr(combine, "two_phase", False)


def chunk_exp2(x: cute.TensorSSA, x_max: Float32, *, base2: bool):
    """(m, exp(x - x_max)) of values ``x`` whose max is ``x_max``, m as
    online_softmax_combine takes it (-inf when every value is -inf). ``base2``: m =
    x_max log2 e and each exponent one FFMA against that same rounded m, so the sums and
    the max that rescales them agree exactly; the natural-units max (``base2=False``,
    two instructions per exponent) keeps x - max exact, which x - lse needs (a
    log-softmax of a confident row is close to 0)."""
    if base2:
        m = x_max * LOG2_E
        return m, cute.math.exp2(x * LOG2_E - finite_or_zero(m), fastmath=True)
    return x_max, cute.math.exp2((x - finite_or_zero(x_max)) * LOG2_E, fastmath=True)


def slot_words(cfg: RowConfig, num_values: int) -> int:
    """32-bit words a scratch slot takes. A cluster's partials travel as vector st.async
    (each store is one packet between SMs; a 16-CTA exchange of LayerNorm's two backward
    sums was 512 of them per CTA), so their slots round up to whole vectors of 2 or 4
    words (store_vector)."""
    if cfg.cluster_size == 1 or num_values == 1:
        return num_values
    return num_values + 1 if num_values % 4 == 3 else num_values + num_values % 2


def store_vector(words: int) -> int:
    """Words per st.async of a slot of ``words`` words (slot_words)."""
    return 4 if words % 4 == 0 else min(words, 2)


def peer_slots(cfg: RowConfig, buffers: int = 1) -> int:
    """Partials of a row every CTA of a cluster receives (slots 0 .. peer_slots - 1):
    one per warp of every CTA, or one per CTA where merges_cta_first."""
    return cfg.cluster_size * (1 if merges_cta_first(cfg, buffers) else cfg.warps_per_row)


def scratch_slots(cfg: RowConfig, buffers: int = 1) -> int:
    """Partials a row's scratch holds: in a CTA one per warp of the row; in a cluster
    the peer_slots, and after them the CTA's own warps where merges_cta_first."""
    if cfg.cluster_size == 1:
        return cfg.warps_per_row
    own = cfg.warps_per_row if merges_cta_first(cfg, buffers) else 0
    return peer_slots(cfg, buffers) + own


def scratch_words(cfg: RowConfig, num_values: int, buffers: int = 1) -> int:
    """32-bit words of one scratch buffer."""
    return cfg.rows_per_block * scratch_slots(cfg, buffers) * slot_words(cfg, num_values)


def scratch_layout(cfg: RowConfig, num_values: int, buffers: int = 1) -> cute.Layout:
    """(row, slot, word[, buffer]); looping kernels alternate between two buffers."""
    slots = scratch_slots(cfg, buffers)
    words = slot_words(cfg, num_values)
    if buffers == 1:
        return cute.make_ordered_layout((cfg.rows_per_block, slots, words), order=(2, 1, 0))
    return cute.make_ordered_layout((cfg.rows_per_block, slots, words, buffers),
                                    order=(2, 1, 0, 3))


def scratch_tx_bytes(cfg: RowConfig, num_values: int, buffers: int = 1) -> int:
    """Bytes every CTA of a cluster receives through one reduction."""
    return cfg.rows_per_block * peer_slots(cfg, buffers) * slot_words(cfg, num_values) * 4


def _as_i32(value: Float32) -> Int32:
    return Int32(arith.bitcast(Int32.mlir_type, Float32(value).ir_value()))


@cute.jit
def _shuffle_allreduce(values: Values, combine: Callable, width: cutlass.Constexpr[int]) -> Values:
    """Butterfly over ``width`` consecutive lanes (a power of two <= 32)."""
    offset = width // 2
    while cutlass.const_expr(offset >= 1):
        others = tuple(cute.arch.shuffle_sync_bfly(v, offset=offset) for v in values)
        values = combine(values, others)
        offset //= 2
    return values


@cute.jit
def _reduce_slots(scratch: cute.Tensor, row: Int32, slots: cutlass.Constexpr[int],
                  combine: Callable, identity: Values, first: cutlass.Constexpr[int] = 0) -> Values:
    """Reduce the ``slots`` partials of ``row`` from slot ``first`` so that every lane
    holds the result.
    Lanes are split into groups of ``width`` (a power of two covering min(slots, 32));
    each group reads all slots (lane l takes slots l mod width, + width, ...) and
    reduces them with a butterfly inside the group."""
    width = min(32, 1 << (slots - 1).bit_length())
    lane_in_group = cute.arch.lane_idx() % width
    acc = identity
    for base in cutlass.range_constexpr(0, slots, width):
        slot = base + lane_in_group
        valid = slot < slots
        slot = cutlass.select_(valid, slot, 0)
        part = tuple(scratch[row, first + slot, k] for k in range(len(identity)))
        part = tuple(Float32(cutlass.select_(valid, p, i)) for p, i in zip(part, identity))
        if cutlass.const_expr(base == 0 and _two_phase(combine)):
            acc = part  # (merging it into the identity would cost an online combine's exp2)
        else:
            acc = combine(acc, part)
    return warp_allreduce(acc, combine, width)


@cute.jit
def _send_to_peers(values: Values, scratch: cute.Tensor, row: Int32, warp_in_row,
                   cfg: cutlass.Constexpr, mbar_ptr, lane: Int32):
    """Lane r stores ``values`` into CTA r's scratch, completing on its mbarrier, as
    one vector st.async (slot_words): into this warp's slot there (``warp_in_row`` +
    warps_per_row x this CTA's rank), or this CTA's (its rank) for ``warp_in_row``
    None."""
    rank = cute.arch.block_idx_in_cluster()
    if lane < cfg.cluster_size:
        slot = rank
        if cutlass.const_expr(warp_in_row is not None):
            slot = warp_in_row + cfg.warps_per_row * rank
        words = slot_words(cfg, len(values))
        vec = store_vector(words)
        padded = [_as_i32(v) for v in values] + [Int32(0)] * (words - len(values))
        for k in cutlass.range_constexpr(0, words, vec):
            dst = scratch.iterator + cute.crd2idx((row, slot, k), scratch.layout)
            word = padded[k] if cutlass.const_expr(vec == 1) else tuple(padded[k:k + vec])
            cute.arch.store_async_dsmem(dst, word, mbar_ptr, lane)


@cute.jit
def row_allreduce(values: Values, combine: Callable, identity: Values,
                  cfg: cutlass.Constexpr, scratch: cute.Tensor, mbar_ptr,
                  phase=0, rearm: cutlass.Constexpr[bool] = False) -> Values:
    """Reduce ``values`` (this thread's partials) over the whole row, cluster included.

    Kernels that loop over row blocks reduce once per iteration, alternating between
    two scratch buffers, each with its own mbarrier (``mbar_ptr``): they pass the phase
    of that barrier (its parity is waited on) and ``rearm=True``, so thread 0 re-arms
    it for its next exchange as soon as this one completed. No barrier between
    iterations is needed: a warp can only write a buffer again after every warp of the
    row contributed to the exchange between, i.e. after it finished reading the buffer;
    for the same reason a barrier's next bytes arrive only after its exchange completed
    (before thread 0's re-arm they are legal: the tx-count goes transiently negative).
    Where merges_cta_first, a CTA's slots of its own warps are written again only
    after the block barrier of the exchange between, which every warp reaches after
    reading them."""
    values = warp_allreduce(values, combine, min(32, cfg.threads_per_row))
    if cutlass.const_expr(cfg.warps_per_row == 1 and cfg.cluster_size == 1):
        return values
    lane = cute.arch.lane_idx()
    warp = cute.arch.warp_idx()
    row = warp // cfg.warps_per_row
    warp_in_row = warp % cfg.warps_per_row
    if cutlass.const_expr(cfg.cluster_size == 1):
        if lane == 0:
            for k in cutlass.range_constexpr(len(values)):
                scratch[row, warp_in_row, k] = values[k]
        cute.arch.barrier()
        return _reduce_slots(scratch, row, cfg.warps_per_row, combine, identity)
    buffers = 2 if rearm else 1  # (rearm: a looping kernel's reduction)
    if cutlass.const_expr(merges_cta_first(cfg, buffers)):
        if lane == 0:
            for k in cutlass.range_constexpr(len(values)):
                scratch[row, cfg.cluster_size + warp_in_row, k] = values[k]
        cute.arch.barrier()
        values = _reduce_slots(scratch, row, cfg.warps_per_row, combine, identity,
                               first=cfg.cluster_size)
        if warp_in_row == 0:
            _send_to_peers(values, scratch, row, None, cfg, mbar_ptr, lane)
    else:
        _send_to_peers(values, scratch, row, warp_in_row, cfg, mbar_ptr, lane)
    cute.arch.mbarrier_wait(mbar_ptr, phase % 2)
    if cutlass.const_expr(rearm):
        if cute.arch.thread_idx()[0] == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_ptr,
                                                    scratch_tx_bytes(cfg, len(values), buffers))
    return _reduce_slots(scratch, row, peer_slots(cfg, buffers), combine, identity)


# The high half of a grid-sum word once its CTA has written it (0: not yet, see
# tagged_word).
GRID_WORD_READY = 1


def tagged_word(value: Float32) -> Int64:
    """``value``'s bits in the low half of a 64-bit word and GRID_WORD_READY in the high
    half: one single-copy-atomic store publishes a value and its flag together, so a
    reader that sees the flag sees the value, with no fence between them."""
    low = Int64(arith.extui(Int64.mlir_type, _as_i32(value).ir_value()))
    return low | (Int64(GRID_WORD_READY) << 32)


def word_value(word: Int64) -> Float32:
    """The value of a tagged_word."""
    low = arith.trunci(Int32.mlir_type, Int64(word).ir_value())
    return Float32(arith.bitcast(Float32.mlir_type, low))


def word_ready(word: Int64) -> Boolean:
    return (word >> 32) == Int64(GRID_WORD_READY)


@cute.jit
def block_sum(values: Values, scratch: cute.Tensor) -> Values:
    """The sum of ``values`` over every thread of the CTA, in every thread, added in an
    order fixed by the thread count alone (bitwise reproducible). ``scratch``: fp32
    shared memory of shape (warps per CTA, len(values)); a CTA barrier separates its
    writes from its reads (a second call on the same scratch needs one before it)."""
    values = _shuffle_allreduce(values, sum_combine, 32)
    # warp_idx() is a full-warp shuffle (it makes the index warp-uniform): read under
    # the lane-0 branch, lane 0 waited there for lanes already at the barrier (the hang
    # of the looping gradient kernel, fourteenth session)
    warp = cute.arch.warp_idx()
    if cute.arch.lane_idx() == 0:
        for k in cutlass.range_constexpr(len(values)):
            scratch[warp, k] = values[k]
    cute.arch.barrier()
    total = tuple(scratch[0, k] for k in range(len(values)))
    for w in cutlass.range_constexpr(1, cute.size(scratch, mode=[0])):
        total = sum_combine(total, tuple(scratch[w, k] for k in range(len(values))))
    return total


@cute.jit
def cluster_reduction_setup(mbar_ptr, count: cutlass.Constexpr[int],
                            tx_bytes: cutlass.Constexpr[int], arrive: cutlass.Constexpr[bool]):
    """Arm the ``count`` mbarriers from ``mbar_ptr`` that cluster reductions complete on
    (thread 0 arrives once on each and expects every peer's bytes), make the inits
    visible cluster-wide and, with ``arrive``, arrive on the cluster barrier. Call at
    kernel start, then ``cute.arch.cluster_wait()`` before the first remote store."""
    if cute.arch.thread_idx()[0] == 0:
        for i in cutlass.range_constexpr(count):
            cute.arch.mbarrier_init(mbar_ptr + i, 1)
            cute.arch.mbarrier_arrive_and_expect_tx(mbar_ptr + i, tx_bytes)
    cute.arch.mbarrier_init_fence()
    if cutlass.const_expr(arrive):
        cute.arch.cluster_arrive_relaxed()


def thread_reduce(values: cute.TensorSSA, op: cute.ReductionOp, init: float) -> Float32:
    return values.reduce(op, Float32(init), reduction_profile=0)


def thread_sum_of_squares(values: cute.TensorSSA) -> Float32:
    """Sum of values^2 in fused multiply-adds (a product then a tree of adds is two
    instructions per value), in two chains so that they overlap."""
    chains = [Float32(0.0), Float32(0.0)]
    for i in range(cute.size(values.shape)):
        chains[i % 2] = cute.math.fma(values[i], values[i], chains[i % 2])
    return chains[0] + chains[1]
