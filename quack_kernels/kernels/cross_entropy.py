"""Cross-entropy over the last dimension: loss, log-sum-exp and gradient in one pass.

Per row i with target t (class count C = n_cols), optional class weights w (w = 1
without), smoothing eps, z-loss scale zs and softcap s (z = s * tanh(x / s), else z = x):

  lse   = log sum_j exp(z_j)                  p_j = exp(z_j - lse)
  loss  = (1 - eps) w_t (lse - z_t)                          (weighted nll)
        + (eps / C) sum_j w_j (lse - z_j)                    (label smoothing, as torch)
        + zs lse^2                                           (z-loss)
  dloss/dz_j = A p_j - B [j == t] - (eps / C) w_j
        with A = (1 - eps) w_t + (eps / C) W + 2 zs lse,  B = (1 - eps) w_t,  W = sum_j w_j
  dloss/dx_j = dloss/dz_j * (1 - (z_j / s)^2)               (softcap chain rule)

Ignored rows (t == ignore_index): loss 0, gradient 0. Targets outside [0, C) that are
not ignore_index: loss NaN and gradient row NaN (never an out-of-bounds access: the
target column is only used as an address for a target inside the row: by the thread
holding it, for the class weight, and as the clamped index of z_t in a streamed row). lse is written for every row, and each row's
weight in a mean over rows: w_t (1 without class weights), 0 for an ignored row or a
bad target. The loss is per row; its sum or mean over rows is the torch layer's, or,
eagerly where config.ce_reduces_in_kernel (``reduce``), the grid's last CTA's.

The gradient row i is scaled by ``grad_scale[i]``, the upstream gradient of loss i the
caller expects (e.g. 1 / count for a mean), so that the backward has nothing to do when
the expectation holds; kernels.rescale.RowRescale fixes the rows where it does not.

Bytes: one read of the logits (M x C); with the gradient, one write of M x C more.
Class weights with label smoothing also read the weight row (C fp32, from L2).

Layout: RowKernel geometry (a row split over a cluster of up to 16 CTAs), one row block
per CTA, but for the gradient of rows one CTA holds: a fixed grid of CTAs looping over
row blocks so that the next block's logits load while the current block is reduced
and its epilogue runs (a CTA's life is otherwise one load, one short reduction and a
short epilogue: its load latency would be exposed; config.loops_over_row_blocks). One
row_allreduce per row combines the online (max, sum of exp, sum of exp over the
non-target classes) triple with plain sums of z_t (from the thread holding the target
column, which where it can sets it aside before the row is read, in a staged row from
shared memory and in a streamed one in registers: ``target_aside``; with softcap the
set-aside logit and the row-end padding become -s and are counted out,
``capped_placeholders``), of w_t (gathered by the row's first thread) and, for label
smoothing, of sum_j w_j z_j and W. Every thread then knows lse and writes its share of
the gradient; the row's first thread writes loss and lse. A set-aside target's gradient
is written by the thread holding its column, after that thread's vector stores
(RowTiles.store_column). Maxima are in base-2 units (reduce.chunk_exp2).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float16, Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import arith, vector
from cutlass.memory import SmemAllocator

from ..primitives import reduce as red
from ..primitives import tiling
from ..primitives.config import (CE_LOOP_REGISTERS, CE_PLAIN_GRAD_LOOP_REGISTERS,
                                 CE_WIDE_GRAD_LOOP_REGISTERS, CAPPED_GRAD_REGISTERS,
                                 HELD_FMA_CAP_STRIDE, REGISTERS_PER_SM,
                                 STREAM_LOSS_REGISTERS, STREAM_UNROLL, RowConfig, loop_ctas_per_sm, loops_over_row_blocks,
                                 staged_share_chunks, whole_vectors)
from ..primitives.rows import ReductionSlot, RowKernel, RowTiles, broadcast_rows


def _combine(a, b):
    """(max, sum of exp, sum of exp over the non-target classes) merged online, both
    sums rescaled to the new max; every further value is a plain sum."""
    return red.online_softmax_combine(a, b, rescaled=2, base2=True)


def _fixed_max_combine(a, b):
    """_combine of partials that share one max (``fixed_max``: each side's is the cap s,
    or -inf with empty sums): plain sums, no exp2."""
    return (cute.arch.fmax(a[0], b[0]),) + red.sum_combine(a[1:], b[1:])


def _exp_below(z: Float32, base2_max: Float32) -> Float32:
    """exp(z) / 2^base2_max for one logit z, its exponent the exact z log2 e minus the
    max in base-2 units, as every class's exponent has it (red.chunk_exp2: one FFMA)."""
    return cute.math.exp2(cute.math.fma(z, Float32(red.LOG2_E), -base2_max), fastmath=True)


def _with_target(other_max: Float32, other_sumexp: Float32, z_target: Float32, valid):
    """(max, sum of exp, sum of exp over the non-target classes) of a row, max in base-2
    units as the reduction gives it, from its non-target (max, sum of exp) and the
    set-aside target logit (rows with a valid target; other rows had nothing set
    aside)."""
    row_max = cutlass.select_(valid, cute.arch.fmax(other_max, z_target * red.LOG2_E), other_max)
    row_max_safe = red.finite_or_zero(row_max)
    other = other_sumexp * cute.math.exp2(other_max - row_max_safe, fastmath=True)
    target = _exp_below(z_target, row_max_safe)
    return row_max, other + cutlass.select_(valid, target, Float32(0.0)), other


def _words(v: cute.TensorSSA):
    """The int32 words of fp32 values ``v`` (an MLIR vector)."""
    return vector.bitcast(ir.VectorType.get([cute.size(v.shape)], Int32.mlir_type), v)


def _floats(words, shape) -> cute.TensorSSA:
    """fp32 values of shape ``shape`` from their int32 ``words`` (_words)."""
    count = cute.size(shape)
    return cute.TensorSSA(vector.bitcast(ir.VectorType.get([count], Float32.mlir_type), words),
                          shape, Float32)


def _splat_words(count: int, value: int):
    """An int32 vector of ``count`` copies of ``value``."""
    words_type = ir.VectorType.get([count], Int32.mlir_type)
    return arith.constant(words_type, ir.DenseElementsAttr.get_splat(
        words_type, ir.IntegerAttr.get(Int32.mlir_type, value)))


# fma_reciprocal's first guess 1/y ~ bits(RECIPROCAL_GUESS - bits(y)) (5e-2 relative over
# [1, 2^100]) and the bound it clamps y to: 1/2^100 is below every cap's rounding, and an
# exponent that large keeps the guess a normal fp32.
RECIPROCAL_GUESS = 0x7EF311C3
RECIPROCAL_CLAMP = 2.0 ** 100


def fma_reciprocal(y: cute.TensorSSA) -> cute.TensorSSA:
    """1 / y for y in [1, inf] (NaN stays NaN) on the FMA pipe, where MUFU.RCP would wait
    for the multi-function unit: three Newton steps r <- r (2 - y r) from the integer
    guess take its 5e-2 relative error to 2.6e-3, 6.6e-6 and 6e-8 (fp32 emulation against
    fp64 over [1, 2^100]: MUFU.RCP's level). y = inf gives 2^-100."""
    y = cute.where(y > Float32(RECIPROCAL_CLAMP), Float32(RECIPROCAL_CLAMP), y)
    guess = arith.subi(_splat_words(cute.size(y.shape), RECIPROCAL_GUESS), _words(y))
    r = _floats(guess, y.shape)
    for _ in range(3):
        r = r * (Float32(2.0) - y * r)
    return r


# fma_exp2's 2^f on [-1/2, 1/2], lowest power first: a degree-5 fit of the relative
# error (7.5e-8 in fp64; fma_exp2 in fp32 emulation against fp64 over [-126, 0]: 2.3e-7,
# MUFU.EX2's level). Adding ROUNDING_SHIFT to an fp32 under 2^22 in magnitude rounds it
# to an integer n, which the sum's low mantissa bits hold: shifted up 23 bits and added
# to the word of 1.0 they are the word of 2^n.
EXP2_POLYNOMIAL = (1.0000000716554343, 0.6931469670620429, 0.24022119720074434,
                   0.055507132760937, 0.009675541540094703, 0.0013276471737340791)
ROUNDING_SHIFT = 1.5 * 2.0 ** 23
ONE_WORD = 0x3F800000


def fma_exp2(x: cute.TensorSSA) -> cute.TensorSSA:
    """2^x for x in [-126, 127] (NaN stays NaN) on the FMA pipe, where MUFU.EX2 would
    wait for the multi-function unit: 2^n p(f) for x = n + f, n an integer and f in
    [-1/2, 1/2], in 10 instructions a value (3 FADD, 5 FFMA, an IMAD and an FMUL)."""
    rounded = x + Float32(ROUNDING_SHIFT)
    f = x - (rounded - Float32(ROUNDING_SHIFT))
    p = f * Float32(EXP2_POLYNOMIAL[-1]) + Float32(EXP2_POLYNOMIAL[-2])
    for coefficient in reversed(EXP2_POLYNOMIAL[:-2]):
        p = p * f + Float32(coefficient)
    count = cute.size(x.shape)
    power_words = arith.addi(arith.muli(_words(rounded), _splat_words(count, 1 << 23)),
                             _splat_words(count, ONE_WORD))
    return p * _floats(power_words, x.shape)


def _target_gradient(p_target, coef_p, coef_t, one_minus_p_target):
    """A p_t - B formed as (A - B) p_t - B (1 - p_t), so that a confident row's tiny
    true-class gradient keeps its relative precision (1 - p_t from the non-target sum)."""
    return p_target * (coef_p - coef_t) - coef_t * one_minus_p_target


class CrossEntropyForward(RowKernel):
    """With the gradient, rows a single CTA holds (config.loops_over_row_blocks) run on
    a fixed grid of ``grid_rows`` row blocks that loops, loading the next block while it
    finishes the current one (cfg.stages == 2); every other variant runs one row block
    per CTA.
    Compile-time switches: ``weighted`` (class weights), ``smoothing`` (label
    smoothing > 0), ``zloss`` (lse_square_scale != 0), ``softcap``, ``write_grad``,
    ``reduce`` (the loss also summed over the rows: "sum" or "mean") and ``fixed_max``
    (softcap only; the host sets it where s is at most config.CE_FIXED_MAX_SOFTCAP):
    capped logits lie in [-s, s], so the exp sums take s as the row's max,
    exp(z - s) >= exp(-2 s) staying a normal fp32, instead of a running max: no max per
    value and plain sums where the online merges rescale with exp2.
    The matching float values are runtime arguments, so changing them never
    recompiles."""

    loop_registers = CE_LOOP_REGISTERS
    # the training step's kernels (denominator, this, the rescale) overlap each launch
    # with the kernel before; begin() waits for it, so any kernel before is safe
    programmatic_launch = True
    GRID_SUM_VALUES = 2  # a reduction's sums over the grid: losses and row weights
    share_chunks = 0  # chunks of staged cap shares (set in __init__; smem_bytes counts them)

    def __init__(self, cfg: RowConfig, dtype, *, weighted: bool, smoothing: bool,
                 zloss: bool, softcap: bool, write_grad: bool, reduce: str = "none",
                 fixed_max: bool = False):
        self.cfg = cfg
        assert softcap or not fixed_max, "only capped logits have a fixed bound"
        self.fixed_max = fixed_max
        # merges this thread's running (max, sum of exp, non-target sum of exp)
        self.combine = _fixed_max_combine if fixed_max else _combine
        # "sum" / "mean": the loss also reduced over the rows by the grid's last CTA
        # (_reduce_rows) instead of by two more launches after this one
        assert reduce in ("none", "sum", "mean")
        self.reduce = reduce
        self.grid_sums = 0 if reduce == "none" else self.GRID_SUM_VALUES
        self.weighted = weighted
        self.smoothing = smoothing
        self.zloss = zloss
        self.softcap = softcap
        self.write_grad = write_grad
        # The weight row is staged next to the logits only when every class's weight
        # enters the result (label smoothing); otherwise only w_t is gathered.
        self.stage_weight = weighted and smoothing
        assert reduce == "none" or not self.stage_weight, "see config.ce_reduces_in_kernel"
        self.staged_dtypes = (dtype, Float32) if self.stage_weight else (dtype,)
        self.loops = loops_over_row_blocks(cfg, write_grad)
        # label smoothing alone sets the target aside too (see target_aside below)
        self.smoothing_aside = smoothing and not softcap and not self.stage_weight \
            and cfg.staging != "global"
        if write_grad and (softcap or (self.smoothing_aside and dtype == Float16)):
            self.loop_registers = CE_WIDE_GRAD_LOOP_REGISTERS
        # A 16-bit row re-read for its gradient (staged in shared memory, or past that in
        # global memory) and so capped twice, for its sums and again for its gradient, takes
        # 6.2-6.5 multi-function-unit ops a value (the cap's ex2 and rcp twice, two exps)
        # where the bf16 step at 85% of the copy ceiling allows 5.8 (16 a clock per SM,
        # 2.8 values a clock per SM on an H100); 29-31 of its 46 issue slots are used, so
        # the second cap takes its reciprocal on the FMA pipe. With the running max and
        # in fp32 rows that spilled 8 bytes (sm_90a: bf16 / fp16 16384 columns, fp32
        # 262144 / 524288).
        self.recaps_on_fma = softcap and fixed_max and write_grad and dtype.width == 16 \
            and cfg.staging != "registers"
        # The sums of a staged row that re-caps on the FMA pipe from its cap shares r
        # (_cap_share) too: exp(z - s) one FMUL from r, the sum of z from the sum of r;
        # z itself is never formed (one FFMA a value fewer). So for a row kept in
        # registers, which keeps r for its gradient (grads_from_share). Not where the
        # weight row is staged (its sum of w z) nor past the row end unpadded (a mask
        # per value).
        kept_capped = softcap and fixed_max and write_grad and cfg.staging == "registers"
        self.sums_from_share = (kept_capped or (self.recaps_on_fma and cfg.staging == "smem")) \
            and not self.stage_weight and (cfg.vec > 1 or not cfg.needs_col_predicate)
        # the gradient from the cap shares (see the gradient pass)
        self.grads_from_share = self.recaps_on_fma or (kept_capped and self.sums_from_share)
        # the loss alone of a share re-read from global memory: one streaming pass
        self.streams = cfg.staging == "global" and not write_grad and not self.stage_weight
        # a shifted row streamed: its loads fill -inf outside it (RowTiles.load), which
        # masks the max and the sum of exp; not the softcap's nor smoothing's terms
        # (ops.cross_entropy.forward_config)
        self.streams_shifted = self.streams and cfg.row_shift
        assert not (self.streams_shifted and (softcap or smoothing)), \
            "a streamed shifted row's fill is no capped logit's nor a sum of z's mask"
        plain_terms = not (weighted or smoothing or softcap)  # z-loss at most
        # whole 16-byte vectors in whole chunks (narrowed vectors of a misaligned tensor
        # and a partial last chunk spilled under the holds below)
        whole_chunks = whole_vectors(cfg, dtype.width // 8) and not cfg.needs_col_predicate
        held_stream = self.streams and plain_terms and dtype.width == 16 and whole_chunks
        if held_stream:
            self.block_registers = STREAM_LOSS_REGISTERS
        # bf16 widening (RowTiles' integer_widening): by integer ops on the held streamed
        # share too, else where config.widens_by_integer_ops says (fp16 keeps its
        # conversion either way). Capped logits past the fixed bound (the running max)
        # keep the DSL's conversion: widened by integer ops, the share of 524288 columns
        # with the gradient, smoothing and z-loss was held to 80 registers by ptxas and
        # spilled 8 bytes (sm_90a; converted: 102 registers, no spill).
        self.integer_widening = False if softcap and not fixed_max else (
            True if held_stream else None)
        assert self.loops or cfg.stages == 1, "prefetching needs the looping grid"
        # Target column found by offsets from the thread's first value (see
        # tiling.is_column): the per-value coordinates held the one-block gradient
        # kernel at 80 registers (3 CTAs of 256 threads per SM) where offsets need 58 (4)
        # at 128256 bf16 columns. With the weight row staged as well, offsets spilled
        # 8 bytes at 262145 bf16 columns, so that variant keeps coordinates.
        self.column_offsets = self.loops or not self.stage_weight
        # The target logit set aside from a staged row: its owner thread reads it from
        # shared memory once and leaves -inf in its place, so the row's max and sum see
        # only non-target classes and no value is compared with the target column (the
        # per-value selects of z_t and of the non-target sum were 5 of ~15 instructions
        # per bf16 logit, which held the loss alone at the issue rate). With the
        # gradient, the vector stores write a placeholder's value at the set-aside target
        # and its owner overwrites it with the true one once per row
        # (RowTiles.store_column). Label smoothing alone sums z over every class from
        # the staged chunk before its target is set aside (smoothing_aside: one more
        # shared-memory read of the chunk, not the compares). A streamed
        # row (loss alone) sets it aside in registers instead: one select per value,
        # after the cap, replaces it by -inf, and every thread loads z_t (one broadcast
        # word, the index clamped into the row) while the row's lead thread keeps it; not
        # with softcap or smoothing there (the padding of a streamed row is masked per
        # value, and its sum of z would lose the target).
        # With softcap a staged row's placeholders, the set-aside target and the padding
        # past the row end, are -inf logits that the cap turns into exactly -s: each
        # thread counts its own and takes their terms out of its partial sums once per
        # row (capped_placeholders) instead of masking and comparing every value. Not
        # with the weight row staged (its sum of w z would need w_t as well).
        self.capped_placeholders = softcap and not self.stage_weight \
            and cfg.staging != "global"
        # (the sums from the shares take every held value as one, the pads and the
        # set-aside target included: unmasked, their terms counted out afterwards)
        assert self.capped_placeholders or not self.sums_from_share
        self.target_aside = self.capped_placeholders or self.smoothing_aside or (
            not softcap and not smoothing and (cfg.staging != "global" or self.streams))
        self.scratch_buffers = 2 if self.loops else 1  # alternate per row block
        # Reduced over the row: ([max], [sum of exp], sum of exp without the target, z_t,
        # [w_t], [sum w z], [W]). With fixed_max not the max (every thread's is the
        # cap's, a constant), nor, with the target set aside, the sum over every class
        # (until _with_target adds the target it is the non-target sum): each value
        # reduced costs a shuffle and a merge per warp level and a scratch word, and a
        # row's fixed work is a quarter of the options kernel's at 65536 columns. Under
        # a running max the sum stays: without it the fp16 capped gradient of 16384
        # columns and the bf16 streamed loss of 524288 spilled 16-24 bytes (sm_90a).
        self.reduces_max = not fixed_max
        self.reduces_sum = not (fixed_max and self.target_aside)
        self.values_per_reduction = 2 + int(self.reduces_max) + int(self.reduces_sum) \
            + int(weighted) + int(smoothing) + int(self.stage_weight)
        self.reduce_combine = _combine if self.reduces_max else red.sum_combine
        # The one-block shares of the fixed-max gradient held to CAPPED_GRAD_REGISTERS: the
        # kept values', and the re-capping shares' staged in shared memory where it leaves
        # room for the CTAs the hold is for (else the hint let the compiler take up to 255
        # registers; a share re-read from global memory spilled at 64: 104 bytes at 2M
        # bf16 columns). With class weights 64 spilled 16 bytes (unbounded they take the
        # running max's 80); with the in-kernel reduction's epilogue 64 spilled 16 bytes at
        # 65536 16-bit columns.
        held_ctas = REGISTERS_PER_SM // (CAPPED_GRAD_REGISTERS * cfg.threads_per_block)
        # A row whose every chunk is held in registers (config.HELD_SHARES_MIN_COLS) stages
        # its cap shares r (fp32) in shared memory for the gradient pass instead of capping
        # its logits again, and is held to the registers that the CTAs its shares leave
        # room for allow (64 at 4 CTAs of 256 threads per SM).
        holds_whole_row = cfg.staging == "smem" and cfg.smem_chunks == 0
        self.stages_cap_shares = self.sums_from_share and holds_whole_row
        # the chunks whose shares are staged (config.staged_share_chunks); the rest keep
        # theirs in registers
        self.share_chunks = staged_share_chunks(cfg) if self.stages_cap_shares else 0
        assert self.stages_cap_shares or not holds_whole_row, \
            "a row held in registers whole is for the cap shares (config.holds_cap_shares)"
        if self.stages_cap_shares:
            ctas = loop_ctas_per_sm(cfg, self.smem_bytes(), CAPPED_GRAD_REGISTERS)
            self.block_registers = REGISTERS_PER_SM // (ctas * cfg.threads_per_block) // 8 * 8
        elif fixed_max and write_grad and not self.loops and not weighted and reduce == "none" \
                and (cfg.staging == "registers" or (self.recaps_on_fma and cfg.staging == "smem"
                     and loop_ctas_per_sm(cfg, self.smem_bytes(), CAPPED_GRAD_REGISTERS)
                     == held_ctas)):
            self.block_registers = CAPPED_GRAD_REGISTERS
        plain = write_grad and reduce == "none" and plain_terms
        if plain and whole_chunks and cfg.num_chunks == 1 and dtype != Float16 and (dtype.width == 16 or loop_ctas_per_sm(
                    cfg, self.smem_bytes(), self.loop_registers) <= 2):
            self.loop_registers = CE_PLAIN_GRAD_LOOP_REGISTERS

    def caps_on_fma(self, chunk: int) -> bool:
        """Whether a held row's first pass takes chunk ``chunk``'s cap reciprocal on the
        FMA pipe (every HELD_FMA_CAP_STRIDE-th chunk, the first of each stride): the
        multi-function unit does its cap's ex2 and rcp, the sum's ex2 and the gradient's
        ex2, 4.2 ops a value where 2.8 values a clock an SM leave it about 73% busy."""
        return self.stages_cap_shares and chunk % HELD_FMA_CAP_STRIDE == 0

    def sums_on_fma(self, chunk: int) -> bool:
        """Whether a held row's first pass takes chunk ``chunk``'s sum terms exp(z - s)
        on the FMA pipe (fma_exp2): the chunks whose cap reciprocal stays on the
        multi-function unit (caps_on_fma), so that each moves one of its two ops there;
        unpadded rows only: padded 8192x151936 bf16 compiled to 203 MUFU ops a thread
        without a spill with it too, but lost on the H100 (85.1 -> 83.6% of the copy
        ceiling, results/cross_entropy_held_fma_padded_H100_20261208.txt). Its exponents
        r (-2 s log2 e) lie in [-116, 0] (CE_FIXED_MAX_SOFTCAP), fma_exp2's range."""
        return self.stages_cap_shares and not self.caps_on_fma(chunk) \
            and not self.cfg.needs_col_predicate

    def _cap_share_buffer_layout(self) -> cute.Layout:
        """(value, chunk, thread) of the staged cap shares: a thread's values in groups of
        up to 4 (16-byte accesses), consecutive threads' groups side by side so that a
        warp's accesses take whole 128-byte lines (no bank conflict)."""
        cfg = self.cfg
        values = cfg.thread_values_per_chunk
        group = math.gcd(values, 4)
        threads = cfg.threads_per_block
        return cute.make_layout(((group, values // group, self.share_chunks), threads),
                                stride=((1, group * threads, values * threads), group))

    def smem_bytes(self) -> int:
        cfg = self.cfg
        shares = 4 * cfg.thread_values_per_chunk * self.share_chunks * cfg.threads_per_block
        return super().smem_bytes() + (shares + 16 if shares else 0)

    @cute.jit
    def __call__(self, mX: cute.Tensor, mTarget: cute.Tensor, mWeight: cute.Tensor,
                 mLoss: cute.Tensor, mRowWeight: cute.Tensor, mLse: cute.Tensor,
                 mdX: cute.Tensor, mGradScale: cute.Tensor, mReduced: cute.Tensor,
                 mPartials: cute.Tensor, ignore_index: Int64, smoothing: Float32,
                 lse_square_scale: Float32, softcap: Float32, grid_rows: Int32, stream):
        self.launch(
            self.kernel(mX, mTarget, mWeight, mLoss, mRowWeight, mLse, mdX, mGradScale,
                        mReduced, mPartials, ignore_index, smoothing, lse_square_scale, softcap,
                        grid_rows),
            mX.shape[0], stream, grid_rows=grid_rows if self.loops else None)

    def _cap(self, x, inv_softcap: Float32, softcap: Float32):
        """s tanh(x / s) as s - 2 s r, r = 1 / (1 + exp(2 x / s)) (_cap_share): the ex2
        and rcp of a precise tanh and three FP32 instructions per value, where the tanh's
        relative precision near 0 took about 14 more (MUFU.TANH alone is off by 5e-4
        relative). Absolute error under 6e-7 s (fp32 emulation with the approximate ex2
        and rcp), the precision exp(z - lse) and the loss need; x = -inf gives -s, +inf
        gives s. SASS of the gradient kernel, 4096x128256 bf16, every option on: 4744 ->
        3192 instructions per thread (plain: 1304)."""
        if self.softcap:
            x = softcap - (softcap + softcap) * self._cap_share(x, inv_softcap)
        return x

    @staticmethod
    def _share_exponent_slope(softcap: Float32) -> Float32:
        """exp(z - s) = exp2(r (-2 s log2 e)) of a cap share r (_cap_share)."""
        return softcap * Float32(-2.0 * red.LOG2_E)

    def _cap_share(self, x, inv_softcap: Float32, on_fma: bool = False):
        """r = 1 / (1 + exp(2 x / s)) of logits ``x``, which the capped logit z = s - 2 s r
        and its gradient's chain 1 - (z / s)^2 = 4 r (1 - r) take; ``on_fma``: its
        reciprocal on the FMA pipe (fma_reciprocal) instead of the multi-function unit."""
        e = cute.math.exp2(x * (inv_softcap * Float32(2.0 * red.LOG2_E)), fastmath=True)
        if on_fma:
            return fma_reciprocal(e + Float32(1.0))
        return cute.math.rcp(e + Float32(1.0), approx=True, ftz=True)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mTarget: cute.Tensor, mWeight: cute.Tensor,
               mLoss: cute.Tensor, mRowWeight: cute.Tensor, mLse: cute.Tensor, mdX: cute.Tensor,
               mGradScale: cute.Tensor, mReduced: cute.Tensor, mPartials: cute.Tensor,
               ignore_index: Int64, smoothing: Float32, lse_square_scale: Float32,
               softcap: Float32, grid_rows: Int32):
        self.begin()
        cfg = self.cfg
        smem = SmemAllocator()
        staged = [mX]
        if cutlass.const_expr(self.stage_weight):
            staged.append(broadcast_rows(mWeight, mX.shape[0], cfg.n_cols))
        # -inf past the row end stands for the mask of the max and the sum (capped to -s
        # and counted with softcap, see capped_placeholders); without softcap not for
        # smoothing's sum of z, but for shifted rows (their edge vectors hold the rows'
        # beside, which only the pad hides; smoothing's sum skips it, RowTiles.in_row_sum)
        pad = -math.inf if self.capped_placeholders or not (self.softcap or self.smoothing) \
            or cfg.row_shift else None
        home = RowTiles(cfg, staged, smem, pad=pad, integer_widening=self.integer_widening)
        slot = ReductionSlot(smem, cfg, self.values_per_reduction, buffers=self.scratch_buffers)
        cap_shares = None
        if cutlass.const_expr(self.stages_cap_shares):
            cap_shares = smem.allocate_tensor(Float32, self._cap_share_buffer_layout(),
                                              byte_alignment=16)
        if cutlass.const_expr(cfg.stages == 2):
            home.issue_loads()  # the first block; each iteration prefetches the next
        inv_softcap = Float32(0.0)
        if cutlass.const_expr(self.softcap):
            inv_softcap = cute.arch.rcp_approx(softcap)
        if cutlass.const_expr(cfg.cluster_size > 1):
            cute.arch.cluster_wait()

        options = (home, grid_rows, slot, cap_shares, mTarget, mWeight, mLoss, mRowWeight, mLse,
                   mdX, mGradScale, ignore_index, smoothing, lse_square_scale, softcap,
                   inv_softcap)
        if cutlass.const_expr(self.loops):
            self.for_each_row_block(mX.shape[0], grid_rows, self._row_block, *options)
            if cutlass.const_expr(self.reduce != "none"):
                self._reduce_rows(smem, self._own_row_sums(mLoss, mRowWeight, mX.shape[0],
                                                           grid_rows), mReduced, mPartials)
        else:
            # with a reduction, the (loss, row weight) of the row this thread leads
            sums = None
            if cutlass.const_expr(self.reduce != "none"):
                sums = (Float32(0.0), Float32(0.0))
            sums = self._row_block(cute.arch.block_idx()[0], None, *options, carry=sums)
            if cutlass.const_expr(self.reduce != "none"):
                self._reduce_rows(smem, sums, mReduced, mPartials)

    @cute.jit
    def _own_row_sums(self, mLoss: cute.Tensor, mRowWeight: cute.Tensor, num_rows: Int32,
                      grid_rows: Int32) -> tuple:
        """This thread's share of the (losses, row weights) of the rows of this CTA of a
        looping grid, read back after a CTA barrier from their lead threads' stores
        (carried through the loop instead, they spilled 8 bytes of the 16-bit capped
        gradient of 16384 columns, held to 128 registers)."""
        rows_per_block = self.cfg.rows_per_block
        threads = self.cfg.threads_per_block
        cute.arch.barrier()
        first_block, iterations = self.row_block_iterations(num_rows, grid_rows)
        loss = Float32(0.0)
        weight = Float32(0.0)
        for i in cutlass.range(cute.arch.thread_idx()[0], iterations * rows_per_block, threads,
                               unroll=1):
            row = (first_block + (i // rows_per_block) * grid_rows) * rows_per_block \
                + i % rows_per_block
            if row < num_rows:
                loss = loss + mLoss[row]
                weight = weight + mRowWeight[row]
        return loss, weight

    @cute.jit
    def _reduce_rows(self, smem, sums: tuple, mReduced: cute.Tensor, mPartials: cute.Tensor):
        """mReduced[0] = the sum of the row losses (over the sum of the row weights for a
        mean: NaN when every row is ignored, as torch); ``sums``: this thread's (losses,
        row weights) of the rows it leads; GridSum.grid_sum adds them over the grid
        (``mPartials`` as there)."""
        scratch = smem.allocate_tensor(
            Float32, cute.make_layout((self.cfg.threads_per_block // 32, self.grid_sums),
                                      stride=(self.grid_sums, 1)),
            byte_alignment=16)
        holds, totals = self.grid_sum(sums, mPartials, scratch)
        if holds & (cute.arch.thread_idx()[0] == 0):
            if cutlass.const_expr(self.reduce == "mean"):
                mReduced[0] = totals[0] / totals[1]
            else:
                mReduced[0] = totals[0]

    @cute.jit
    def _row_block(self, block_row: Int32, iteration, home: RowTiles, grid_rows: Int32,
                   slot: ReductionSlot, cap_shares, mTarget: cute.Tensor, mWeight: cute.Tensor,
                   mLoss: cute.Tensor, mRowWeight: cute.Tensor, mLse: cute.Tensor,
                   mdX: cute.Tensor, mGradScale: cute.Tensor, ignore_index: Int64,
                   smoothing: Float32, lse_square_scale: Float32, softcap: Float32,
                   inv_softcap: Float32, carry=None):
        """Loss, lse (and gradient) of the rows of block ``block_row``; ``iteration`` is
        the loop count of a looping grid (None: one row block per CTA). ``carry``: None,
        or the (losses, row weights) summed so far of the rows this thread leads, which
        it returns with this block's added. ``cap_shares``: the staged cap shares' buffer
        (stages_cap_shares) or None."""
        cfg = self.cfg
        n_cols = cfg.n_cols
        tiles = home.begin_block(block_row, grid_rows, iteration)
        row = tiles.row
        lead = tiles.leads_row

        # Target of this thread's row (every thread of the row loads the same word).
        target = Int64(0)
        if tiles.row_in_bounds:
            target = Int64(mTarget[row])
        ignored = target == ignore_index
        inside = (target >= Int64(0)) & (target < Int64(n_cols))
        valid = inside & (target != ignore_index)
        target_col = Int32(cutlass.select_(valid, Int32(target), Int32(-1)))

        # w_t is gathered by the row's first thread (everyone else adds 0 in the
        # reduction); the weight vector is small and stays in L2.
        w_target = Float32(0.0)
        if cutlass.const_expr(self.weighted):
            if lead & valid:
                w_target = Float32(mWeight[target_col])
        # the row's weight in a mean, stored now: kept until the loss is written it cost
        # the looping gradient kernel registers (spills at 16384 bf16 columns); a
        # reduction keeps it in its sums
        row_weight = cutlass.select_(lead & valid, w_target if self.weighted else Float32(1.0),
                                     Float32(0.0))
        if lead:
            mRowWeight[row] = row_weight

        kept = {}  # chunk -> (values, weights) kept in registers for the gradient
        zero = Float32(0.0)
        # this thread's (max, sumexp, sumexp over the non-target classes, z_t, sum w z, W)
        running = (Float32(-math.inf), zero, zero, zero, zero, zero)
        if cutlass.const_expr(self.streams):
            if cutlass.const_expr(self.target_aside):
                # every thread loads the word (one broadcast per warp; a branch around
                # the load cost a stack frame), the lead thread keeps it
                z_t = tiles.staged[0][cutlass.select_(tiles.row_in_bounds, row, Int32(0)),
                                      cutlass.select_(valid, target_col, Int32(0))]
                running = (*running[:3], cutlass.select_(lead & valid, z_t.to(Float32),
                                                         Float32(0.0)), *running[4:])
            # the target's column in the tiles, which a shifted row's start moves (none: -1)
            tile_target = target_col
            if cutlass.const_expr(cfg.row_shift):
                tile_target = cutlass.select_(valid, target_col + tiles.shift, Int32(-1))
            # a dynamic loop, a few chunks unrolled so that their loads overlap
            row_max, row_sum, other_sum, z_t, sum_wz, sum_w = running
            for c in cutlass.range(cfg.num_chunks, unroll=STREAM_UNROLL):
                # one method call per iteration (see RowKernel.for_each_row_block)
                row_max, row_sum, other_sum, z_t, sum_wz, sum_w = self._streamed_chunk_stats(
                    tiles, c, tile_target, inv_softcap, softcap,
                    (row_max, row_sum, other_sum, z_t, sum_wz, sum_w))
            running = (row_max, row_sum, other_sum, z_t, sum_wz, sum_w)
        else:
            # A row held in registers whole sets its target aside before its first value's
            # terms: a branch (the target's warp) between two chunks' terms kept the first
            # one's exps live across it, which spilled 8 bytes at 80 registers (bf16 65536
            # columns, softcap without label smoothing; sm_90a).
            takes_target_first = self.target_aside and self.stages_cap_shares
            if cutlass.const_expr(takes_target_first):
                for c in cutlass.range_constexpr(cfg.num_chunks):
                    z_target = running[3] + tiles.take_column(0, c, target_col, -math.inf)
                    running = (*running[:3], z_target, *running[4:])
            for c in cutlass.range_constexpr(cfg.num_chunks):
                tiles.wait_chunk(c)
                if cutlass.const_expr(self.smoothing_aside):
                    # every class's z, the target's among them, before it is set aside
                    sum_z = running[4] + tiles.in_row_sum(0, c)
                    running = (*running[:4], sum_z, running[5])
                if cutlass.const_expr(self.target_aside and not takes_target_first):
                    z_target = running[3] + tiles.take_column(0, c, target_col, -math.inf)
                    running = (*running[:3], z_target, *running[4:])
                if cutlass.const_expr(self.sums_from_share):
                    z = self._cap_share(tiles.values(0, c), inv_softcap,
                                        on_fma=self.caps_on_fma(c))
                    if cutlass.const_expr(c < self.share_chunks):
                        cap_shares[(None, None, c), tiles.tidx].store(z)
                else:
                    z = self._cap(tiles.values(0, c), inv_softcap, softcap)
                running, w = self._chunk_stats(z, tiles, c, tiles.coords[c], target_col, running,
                                               softcap)
                # (a held row keeps the shares of its chunks past the staged ones)
                keeps = cfg.staging == "registers" or c >= self.share_chunks > 0
                if cutlass.const_expr(keeps and self.write_grad):
                    kept[c] = (z, w)
            if cutlass.const_expr(self.sums_from_share and self.smoothing):
                # the sum of the shares as the sum of z = s - 2 s r over every value held
                held_values = Float32(cfg.thread_values)
                running = (*running[:4], held_values * softcap
                           - (softcap + softcap) * running[4], running[5])
            if cutlass.const_expr(self.capped_placeholders):
                running = self._without_placeholders(running, tiles, target_col, inv_softcap,
                                                     softcap)
            if cutlass.const_expr(self.loops):
                tiles.prefetch_ahead(grid_rows)
        row_max, row_sumexp, other_sumexp, z_target, sum_wz, sum_w = running
        partials = (other_sumexp, z_target)
        identity = (Float32(0.0), Float32(0.0))
        if cutlass.const_expr(self.reduces_sum):
            partials, identity = (row_sumexp, *partials), (Float32(0.0), *identity)
        if cutlass.const_expr(self.reduces_max):
            partials, identity = (row_max, *partials), (Float32(-math.inf), *identity)
        if cutlass.const_expr(self.weighted):
            partials = partials + (w_target,)
            identity = identity + (Float32(0.0),)
        if cutlass.const_expr(self.smoothing):
            partials = partials + (sum_wz,)
            identity = identity + (Float32(0.0),)
        if cutlass.const_expr(self.stage_weight):
            partials = partials + (sum_w,)
            identity = identity + (Float32(0.0),)
        totals = slot.allreduce(partials, self.reduce_combine, identity, iteration=iteration)
        k = 0
        if cutlass.const_expr(self.reduces_max):
            row_max = totals[k]
            k += 1
        if cutlass.const_expr(self.reduces_sum):
            row_sumexp = totals[k]
            k += 1
        other_sumexp, z_target = totals[k], totals[k + 1]
        k += 2
        if cutlass.const_expr(self.target_aside):
            row_max, row_sumexp, other_sumexp = _with_target(row_max, other_sumexp, z_target, valid)
        w_target = Float32(1.0)
        if cutlass.const_expr(self.weighted):
            w_target = totals[k]
            k += 1
        sum_wz = Float32(0.0)
        if cutlass.const_expr(self.smoothing):
            sum_wz = totals[k]
            k += 1
        # W: sum of the class weights (C without weights; without smoothing unused)
        sum_w = Float32(n_cols)
        if cutlass.const_expr(self.stage_weight):
            sum_w = totals[k]

        # row_max is in base-2 units (red.chunk_exp2). Accurate log: the loss of a
        # confident row is log(sumexp) with sumexp ~ 1.
        log_sumexp = cute.math.log(row_sumexp)
        lse = row_max * red.LN_2 + log_sumexp
        eps_per_class = Float32(0.0)
        nll_scale = w_target
        if cutlass.const_expr(self.smoothing):
            eps_per_class = smoothing * Float32(1.0 / n_cols)
            nll_scale = (Float32(1.0) - smoothing) * w_target

        row_loss = Float32(0.0)
        # the carried row weight, derived again here from values the loss needs anyway:
        # carried from its store above, it spilled 8 bytes of one-block fp32 kernels
        # (524288 columns with the gradient, 151936 with every option)
        carried_weight = Float32(0.0)
        if lead:
            # -log p_t = log(sumexp) + (max - z_t) = log1p(sumexp_other * exp(max - z_t)):
            # the second form keeps the precision of a small loss (confident row)
            gap_log2 = cute.math.fma(z_target, Float32(-red.LOG2_E), row_max)
            nll = gap_log2 * red.LN_2 + log_sumexp
            if cutlass.const_expr(self.fixed_max):
                # the max is the cap, not the row's, so a confident row's gap is not
                # small: its loss is -log1p(-q) of the non-target share q = 1 - p_t, which
                # keeps its relative precision (both sums share one max)
                non_target_share = other_sumexp / row_sumexp
                if non_target_share < Float32(0.5):
                    nll = -cute.math.log1p(-non_target_share)
            elif gap_log2 < Float32(20.0 * red.LOG2_E):
                nll = cute.math.log1p(other_sumexp * cute.math.exp2(gap_log2))
            loss = nll_scale * nll
            if cutlass.const_expr(self.smoothing):
                loss = loss + eps_per_class * (sum_w * lse - sum_wz)
            if cutlass.const_expr(self.zloss):
                loss = loss + lse_square_scale * lse * lse
            loss = cutlass.select_(valid, loss, Float32(0.0))
            loss = cutlass.select_(inside | ignored, loss, Float32(math.nan))
            mLoss[row] = loss
            mLse[row] = lse
            row_loss = loss
            carried_weight = cutlass.select_(valid, w_target, Float32(0.0))

        if cutlass.const_expr(self.write_grad):
            # Row coefficients times the row's gradient scale; 0 for an ignored row
            # (whatever its scale), NaN for a bad target.
            grad_scale = Float32(0.0)
            if tiles.row_in_bounds:
                grad_scale = mGradScale[row]
            coef_p = nll_scale + eps_per_class * sum_w
            if cutlass.const_expr(self.zloss):
                coef_p = coef_p + Float32(2.0) * lse_square_scale * lse
            row_keep = cutlass.select_(valid, grad_scale, Float32(0.0))
            row_keep = cutlass.select_(inside | ignored, row_keep, Float32(math.nan))
            coef_p = coef_p * row_keep
            coef_t = nll_scale * row_keep
            coef_w = eps_per_class * row_keep
            lse_log2 = row_max + log_sumexp * red.LOG2_E
            one_minus_p_target = other_sumexp * cute.arch.rcp_approx(row_sumexp)
            # exp(z - lse) as exp2(v slope + offset) of the values v: the capped logits,
            # or where grads_from_share their cap share r (_cap_share): z log2 e - lse_log2
            # = r (-2 s log2 e) + (s log2 e - lse_log2), one FFMA without z, and the
            # chain 4 r (1 - r) with its 4 in the coefficients (2 fewer instructions a
            # value than z and 1 - (z / s)^2)
            slope, offset, chain = Float32(red.LOG2_E), -lse_log2, Float32(1.0)
            if cutlass.const_expr(self.grads_from_share):
                slope = self._share_exponent_slope(softcap)
                offset = softcap * Float32(red.LOG2_E) - lse_log2
                chain = Float32(4.0)
            # the kept chunks first, their registers free before the staged shares are
            # read (the other order spilled 16 bytes of held rows at 64 registers)
            for c in sorted(range(cfg.num_chunks), key=lambda chunk: chunk not in kept):
                if cutlass.const_expr(c in kept):
                    v, w = kept[c]
                elif cutlass.const_expr(self.stages_cap_shares):
                    v = cap_shares[(None, None, c), tiles.tidx].load().reshape(
                        tiles.coords[c].shape)
                    w = None
                else:
                    v = tiles.values(0, c)
                    if cutlass.const_expr(self.recaps_on_fma):
                        v = self._cap_share(v, inv_softcap, on_fma=True)
                    else:
                        v = self._cap(v, inv_softcap, softcap)
                    w = None
                    if cutlass.const_expr(self.stage_weight):
                        w = tiles.values(1, c)
                p = cute.math.exp2(v * slope + offset, fastmath=True)
                if cutlass.const_expr(self.target_aside):
                    g = p * (coef_p * chain)  # the set-aside target's gradient is written below
                else:
                    is_target = tiling.is_column(tiles.coords[c], target_col, self.column_offsets)
                    g = cute.where(is_target, _target_gradient(p, coef_p * chain, coef_t * chain,
                                                               one_minus_p_target),
                                   p * (coef_p * chain))
                tiles.store(mdX, c, self._option_terms(g, v, w, coef_w * chain, inv_softcap,
                                                       from_share=self.grads_from_share))
            if cutlass.const_expr(self.target_aside):
                p_target = _exp_below(z_target, lse_log2)
                tiles.store_column(mdX, target_col, self._option_terms(
                    _target_gradient(p_target, coef_p, coef_t, one_minus_p_target), z_target,
                    None, coef_w, inv_softcap))
        if cutlass.const_expr(carry is not None):
            carry = (carry[0] + row_loss, carry[1] + carried_weight)
        return carry

    @cute.jit
    def _streamed_chunk_stats(self, tiles: RowTiles, chunk: Int32, target_col: Int32,
                              inv_softcap: Float32, softcap: Float32, running: tuple) -> tuple:
        """_chunk_stats of chunk ``chunk`` (a runtime index), read from global memory
        (the target, when set aside, as -inf); ``target_col`` is the target's column in
        the tiles."""
        fill = -math.inf if self.streams_shifted else 0.0
        # no row guard: a streamed share's CTA always has its row (one row a CTA, one
        # CTA per row and rank: the grid is the rows)
        rows_guarded = self.cfg.rows_per_block > 1
        z = self._cap(tiles.load(tiles.staged[0], chunk, fill=fill, guard_rows=rows_guarded),
                      inv_softcap, softcap)
        tXcX = tiles.chunk_coords(chunk)
        if cutlass.const_expr(self.target_aside):
            z = cute.where(tiling.is_column(tXcX, target_col, self.column_offsets), -math.inf, z)
        return self._chunk_stats(z, tiles, chunk, tXcX, target_col, running, softcap)[0]

    @cute.jit
    def _chunk_stats(self, z: cute.TensorSSA, tiles: RowTiles, chunk, tXcX: cute.Tensor,
                     target_col: Int32, running: tuple, softcap: Float32) -> tuple:
        """(``running`` (max, sumexp, sumexp over the non-target classes, z_t, sum w z,
        W) with chunk ``chunk``'s (capped) logits ``z`` added, the chunk's staged class
        weights or None). The weights are read only after the logits' terms: loaded
        earlier they stay live through them and spilled (151936 fp32 columns). With
        ``fixed_max`` the max is the cap ``softcap``; with ``sums_from_share`` ``z`` holds
        the cap shares r and the sum of z their sum (the caller converts it)."""
        n_cols = self.cfg.n_cols
        z_max_in = z
        z_sum_in = z
        if cutlass.const_expr(self.cfg.needs_col_predicate and tiles.pad is None
                              and not self.streams_shifted):
            assert not self.sums_from_share, "a share r is masked by no -inf"
            z_max_in = tiling.mask_out_of_row(z, tXcX, n_cols, -math.inf)
            z_sum_in = tiling.mask_out_of_row(z, tXcX, n_cols, 0.0)
        if cutlass.const_expr(self.sums_from_share):
            # z the cap share r: exp(z - s) = exp2(r (-2 s log2 e))
            chunk_max = softcap * red.LOG2_E
            exponent = z * self._share_exponent_slope(softcap)
            if cutlass.const_expr(self.sums_on_fma(chunk)):
                e = fma_exp2(exponent)
            else:
                e = cute.math.exp2(exponent, fastmath=True)
        else:
            bound = softcap if self.fixed_max \
                else red.thread_reduce(z_max_in, cute.ReductionOp.MAX, -math.inf)
            chunk_max, e = red.chunk_exp2(z_max_in, bound, base2=True)
        chunk_sum = red.thread_reduce(e, cute.ReductionOp.ADD, 0.0)
        z_target = running[3]
        if cutlass.const_expr(self.target_aside):
            # the target was set aside (take_column, or -inf in a streamed chunk): every
            # value is a non-target one
            stats = self.combine(running[:3], (chunk_max, chunk_sum, chunk_sum))
        else:
            # z_t comes from the registers of the thread holding the target column, not
            # from a global load that depends on the target
            at_target = tiling.is_column(tXcX, target_col, self.column_offsets)
            z_target = z_target + red.thread_reduce(cute.where(at_target, z, 0.0),
                                                    cute.ReductionOp.ADD, 0.0)
            # the non-target sum keeps 1 - p_t = sumexp_other / sumexp exact for a
            # confident row, where 1 - exp(z_t - lse) would be mostly rounding
            e_other = cute.where(at_target, 0.0, e)
            stats = self.combine(running[:3], (chunk_max, chunk_sum,
                                               red.thread_reduce(e_other, cute.ReductionOp.ADD,
                                                                 0.0)))
        sum_wz, sum_w = running[4], running[5]
        w = None
        if cutlass.const_expr(self.stage_weight):
            w = tiles.values(1, chunk, fill=0.0)
            sum_wz = sum_wz + red.thread_reduce(w * z_sum_in, cute.ReductionOp.ADD, 0.0)
            sum_w = sum_w + red.thread_reduce(w, cute.ReductionOp.ADD, 0.0)
        elif cutlass.const_expr(self.smoothing and not self.smoothing_aside):
            sum_wz = sum_wz + red.thread_reduce(z_sum_in, cute.ReductionOp.ADD, 0.0)
        return (*stats, z_target, sum_wz, sum_w), w

    def _option_terms(self, g, v, w, coef_w: Float32, inv_softcap: Float32,
                      from_share: bool = False):
        """The gradient wrt the logits from ``g`` = A p - B onehot(t) (values or one
        value): minus (eps/C) w for label smoothing, times the softcap chain of the capped
        logits ``v``, or ``from_share`` of their cap share r (_cap_share), r (1 - r): the
        chain over 4, which the caller's coefficients carry."""
        if self.stage_weight:
            g = g - w * coef_w
        elif self.smoothing:
            g = g - coef_w
        if self.softcap:
            if from_share:
                g = g * (v - v * v)
            else:
                y = v * inv_softcap
                g = g * (Float32(1.0) - y * y)
        return g

    def _without_placeholders(self, running: tuple, tiles: RowTiles, target_col: Int32,
                              inv_softcap: Float32, softcap: Float32) -> tuple:
        """``running`` with this thread's placeholders taken out (capped_placeholders):
        each is the value -s, whose exp term leaves both sums and whose -s leaves the sum
        of z; the set-aside target's capped z_t is kept and joins the sum of z. A
        placeholder's term is the smallest of the thread's, so the subtraction costs
        only the rounding of the sums."""
        cfg = self.cfg
        count = Int32(0)
        held = Boolean(False)
        for c in range(cfg.num_chunks):
            held_here = tiles.holds_column(c, target_col)[0]
            held = held | held_here
            count = count + cutlass.select_(held_here, Int32(1), Int32(0))
        if cutlass.const_expr(tiles.pad is not None):  # the padded values past the row end
            count = count + (cfg.thread_values - tiles.values_in_row())
        placeholders = Float32(count)
        row_max, row_sum, other_sum, z_raw, sum_wz, sum_w = running
        if cutlass.const_expr(self.sums_from_share):
            term = cute.math.exp2(self._share_exponent_slope(softcap), fastmath=True)  # r = 1
        else:
            term = _exp_below(-softcap, red.finite_or_zero(row_max))
        z_target = cutlass.select_(held, self._cap(z_raw, inv_softcap, softcap), Float32(0.0))
        return (row_max, row_sum - placeholders * term, other_sum - placeholders * term,
                z_target, sum_wz + placeholders * softcap + z_target, sum_w)
