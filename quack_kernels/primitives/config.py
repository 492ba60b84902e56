"""Launch configuration for row-wise kernels: the one place where heuristics live.

Every kernel family (softmax, norms, cross-entropy) maps a row length ``n_cols`` and
the bytes per column it keeps on chip to a :class:`RowConfig` through
:func:`row_config`. Each decision is one small function with its reason next to it.

Vocabulary:
  vector       one global-memory access of ``vec`` contiguous elements (16 bytes when
               the row length allows it)
  chunk        the (rows_per_block, cols_per_chunk) tile a CTA holds in registers at a
               time; ``num_chunks`` of them make the CTA's share of the row
  cluster      ``cluster_size`` CTAs (one per SM) that split one row between them and
               combine their partial reductions through distributed shared memory
  staging      where the CTA's share of the row lives between the reduction pass and
               the output pass: "registers" (one chunk), "smem" (every chunk staged in
               shared memory), or "global" (re-read from memory, mostly from L2);
               a share in shared memory may hold its last ``register_chunks`` chunks
               in registers instead (loaded straight there, kept in their own dtype)
  stages       staging buffers of a kernel looping over row blocks: 2 lets a CTA load
               its next row block while it reduces and stores the current one
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

# Hopper limits (sm_90): 16 CTAs per cluster with the non-portable attribute,
# 227 KB of shared memory per CTA, 64K 32-bit registers per SM.
MAX_CLUSTER_SIZE = 16
SMEM_BYTES_PER_CTA = 227 * 1024
ACCESS_BYTES = 16  # widest global load/store a thread can issue (ld.global.v4.b32)

# Row values a thread keeps in fp32 registers per chunk, summed over the staged
# tensors, by element size. Fewer registers mean more resident CTAs per SM, so one CTA
# loads while another reduces or stores; longer shares are staged in shared memory in
# chunks. Measured on H200 over N = 1K..256K, fwd and bwd (sweep of 16/32/64 in
# benchmarks/results/softmax_config_sweep_H200_20261129.txt): 16-bit rows were best
# at 16 (bf16 256K fwd 93% vs 88% at 64), fp32 rows at 32 (fp32 64K bwd 101% vs 92%
# at 16).
VALUES_PER_THREAD = {2: 16, 4: 32}
# Bytes of the row (all staged tensors) one CTA owns: the cluster grows until a CTA's
# share fits. Small shares keep several CTAs resident per SM and balance the tail
# (16 KiB was at least as good as 32/64 KiB on every swept shape, same file).
CTA_ROW_BYTES = 16 * 1024
# A row of 1 MiB (16 CTA shares of 64 KiB) runs faster on 8 CTAs of 128 KiB each on
# H200 (benchmarks/sweep_softmax.py, results/softmax_threads_cluster_sweep_H200_20261129
# .txt): fp32 512x262144 softmax forward 82% -> 90% of the copy ceiling, bf16 backward
# 85% -> 87% (90% with 32 values per thread). Not at 512 KiB (32-KiB shares: bf16
# forward 93% on 16 CTAs, 80% on 8 of 64 KiB, results/softmax_config_sweep_H200_
# 20261129.txt). With these two bounds the rule applies to rows of exactly 1 MiB (e.g.
# 262144 fp32 columns); rows in between, and ragged rows just above (262145 fp32,
# whose 8-CTA shares would pass 128 KiB), were not measured and keep 16 CTAs. Why 8
# wins is open: by the driver's table (benchmarks/NOTES.md) 8-CTA clusters of 128 KiB
# have fewer CTAs resident (15 x 8) than 16-CTA ones of 64 KiB (21 x 16); the per-row
# cost of a 16-CTA cluster (its barrier, 16 DSMEM exchanges) is the suspect.
WIDE_CLUSTER_SHARE_BYTES = 64 * 1024
NARROW_CLUSTER_SHARE_BYTES = 128 * 1024
# A share staged in shared memory takes at most this many chunks; longer shares take
# more values per thread instead (as long as the share stays in shared memory). Every
# 16-chunk default measured on H200 ran faster with 8 chunks of twice the values
# (sweep_softmax.py / sweep_norm_forward.py, results/softmax_chunks_sweep_H200_20261130
# .txt): bf16 softmax backward 512x262144 86.9% -> 89.9% of the copy ceiling, RMSNorm
# forward with residual 512x262144 69.5% -> 75.8%; bf16 softmax forward 128x1048576
# 67.7% -> 69.6% (results/softmax_threads_cluster_sweep_H200_20261129.txt). Shares of
# 2 chunks did not gain from more values (bf16 softmax backward 2048x65536: 98.5% ->
# 88.0%).
MAX_CHUNKS_PER_SHARE = 8
# Threads per row grow before the cluster does: a 256-thread row needs 8 warps in the
# block reduction, beyond that the smem round trip and barrier stall start to cost more
# than a DSMEM exchange.
MAX_THREADS_PER_ROW = 256
# Except for shares re-read from global memory ("global" staging: 1M-column softmax
# rows): there no shared memory bounds the CTA, and 512 threads per row (half the
# chunks per thread) were faster in every case of the H200 sweep (results/softmax_
# threads_cluster_sweep_H200_20261129.txt: 128x1048576 fp32 forward 60.9% -> 69.3% of
# the copy ceiling, bf16 backward 45.5% -> 49.6%, fp32 backward 58.3% -> 59.4%). Fewer
# chunks per thread also end the fp32 log_softmax backward's 16-byte spill. Looping
# kernels were not measured that way and keep MAX_THREADS_PER_ROW, except a norm
# backward whose per-column sums then fit in registers (SUM_THREADS_PER_ROW).
GLOBAL_STAGED_THREADS_PER_ROW = 512
# Small rows pack several rows into a block so a block still has >= 4 warps in flight.
MIN_THREADS_PER_BLOCK = 128
# Vectors a thread loads per chunk when the row is short: 4 x 16 B in flight per thread
# (with ~16 warps per SM) covers HBM latency; more only adds registers.
MIN_VECS_PER_THREAD = 4
# ... except one fp32 tensor staged alone and read at its own width (the softmax and
# norm forwards of fp32 rows), which spreads to more threads at 2: H200, kernels alone
# (benchmarks/compare_trees.py, results/kernel_ab_min_vecs_H200_20261130.txt) at fp32
# 131072x1024 (128 threads per row instead of 2 rows of 64): softmax forward 96.3% ->
# 98.0% of the copy ceiling, RMSNorm 95.4% -> 97.3%, LayerNorm 94.4% -> 96.6%. Not the
# cross-entropy, which lost with it (CE_MIN_VECS_PER_THREAD), nor kernels looping over
# row blocks, whose shares were tuned with 4 (the norm backward: within 0.5 points either
# way at fp32 in the same A/B).
FP32_ROW_MIN_VECS_PER_THREAD = 2
# Such a row on one CTA, read in whole 16-byte vectors at the default values per thread,
# takes FP32_ROW_THREADS_PER_ROW threads where they hold it in exactly
# FP32_ROW_MIN_VECS_PER_THREAD vectors each (4096 columns): half the registers
# per thread, twice the warps per SM (torch.compile's Triton kernel runs 512 threads at
# 24 registers there, 100% occupancy against our 62.5%: ncu). H200, kernels alone
# (results/kernel_ab_fp32_row_threads_H200_20261202.txt), 256 -> 512 threads, % of the
# copy ceiling: 32768x4096 softmax 95.3 -> 96.2, RMSNorm 95.1 -> 96.5, LayerNorm 95.3 ->
# 97.8; 4096x4096 84.4 -> 85.1, 82.2 -> 84.4, 80.2 -> 83.0. Where the 512 threads would
# leave vectors idle or hold more it lost: 65536x2560 (5/8 of them busy) 97.1 -> 91.4
# (softmax), 97.9 -> 87.0 (LayerNorm); LayerNorm 16384x8192 (4 vectors) 94.3 -> 92.1.
FP32_ROW_THREADS_PER_ROW = 512
# Shared memory we allow the staged row to take, leaving room for reduction scratch.
STAGING_SMEM_BYTES = 200 * 1024
# A reduction that needs each value once (a loss without its gradient) streams a long
# share through a dynamic loop over its chunks, this many unrolled so that their loads
# are in flight together (as many as the fully unrolled chunks of the sweep that
# measured streaming at 62% vs 51% staged, 4096x128256 bf16 cross-entropy loss).
STREAM_UNROLL = 4


def _next_pow2(value: int) -> int:
    return 1 if value <= 1 else 1 << (value - 1).bit_length()


@dataclasses.dataclass(frozen=True)
class RowConfig:
    n_cols: int
    vec: int  # elements per vector access
    threads_per_row: int
    rows_per_block: int
    cluster_size: int
    vecs_per_thread: int  # vectors per thread per chunk
    num_chunks: int
    staging: str  # "registers" | "smem" | "global"
    stages: int = 1  # staging buffers; 2: prefetch the next row block (looping kernels)
    register_chunks: int = 0  # of an "smem" share: its last chunks held in registers
    # Row blocks ahead whose staged rows a CTA asks L2 for while it works on its own
    # (RowTiles.prefetch_ahead): a one-block kernel asks for the block that many ahead,
    # a looping one for the block that many iterations past those its staging buffers
    # hold. 0: none.
    l2_prefetch: int = 0
    # Rows read in whole vectors from an aligned start before them (shifted_row_share):
    # n_cols is the row's length, the tiles cover its aligned span.
    row_shift: bool = False

    @property
    def smem_chunks(self) -> int:
        """Chunks of the share staged in shared memory (the first ones)."""
        return self.num_chunks - self.register_chunks if self.staging == "smem" else 1

    @property
    def threads_per_block(self) -> int:
        return self.threads_per_row * self.rows_per_block

    @property
    def warps_per_row(self) -> int:
        return max(1, self.threads_per_row // 32)

    @property
    def thread_values_per_chunk(self) -> int:
        """Values one thread holds of each staged tensor per chunk."""
        return self.vec * self.vecs_per_thread

    @property
    def thread_values(self) -> int:
        """Values one thread holds of each staged tensor over all its chunks."""
        return self.thread_values_per_chunk * self.num_chunks

    @property
    def cols_per_chunk(self) -> int:
        return self.thread_values_per_chunk * self.threads_per_row

    @property
    def cols_per_cta(self) -> int:
        return self.cols_per_chunk * self.num_chunks

    @property
    def cols_covered(self) -> int:
        """Columns the grid spans; more than n_cols means the tail is predicated."""
        return self.cols_per_cta * self.cluster_size

    @property
    def needs_col_predicate(self) -> bool:
        return self.cols_covered != self.n_cols

    def staging_smem_bytes(self, bytes_per_col: int) -> int:
        """Shared memory holding the staged row tiles of all staged tensors."""
        return self.rows_per_block * self.cols_per_chunk * self.smem_chunks * bytes_per_col \
            * self.stages


def vector_width(n_cols: int, elem_bytes: int, max_vec: int | None = None) -> int:
    """Elements per access: 16 bytes when the row length allows, else the largest power
    of two dividing n_cols, so every row starts aligned (ragged n by predication on
    whole vectors, never a misaligned access). ``max_vec`` caps it for tensors whose
    base pointer or row stride is less aligned."""
    vec = ACCESS_BYTES // elem_bytes
    if max_vec is not None:
        vec = min(vec, max_vec)
    while n_cols % vec:
        vec //= 2
    return vec


def threads_per_row_for(vectors: int, max_vecs_per_thread: int, max_threads: int,
                        min_vecs_per_thread: int) -> int:
    """At least ``min_vecs_per_thread`` vectors per thread before adding threads; at
    most ``max_threads``. Power of two so the warp butterfly is exact."""
    wanted = _next_pow2(math.ceil(vectors / min_vecs_per_thread))
    needed = _next_pow2(math.ceil(vectors / max_vecs_per_thread))
    return min(max_threads, max(wanted, needed, 1))


def cluster_size_for(row_bytes: int, cta_row_bytes: int, looping: bool = False,
                     narrow_share_bytes: int = 0, wide: bool = False,
                     fewest: bool = False) -> int:
    """Smallest power-of-two cluster whose CTAs each own at most ``cta_row_bytes`` of
    the row, or with ``fewest`` the smallest of any size; capped at 16 (beyond that a
    CTA's share grows instead). A one-block-per-CTA kernel takes 8 CTAs instead of 16
    when their shares stay within ``narrow_share_bytes`` (a kernel family's measured
    bound), or when the 16-CTA shares would be WIDE_CLUSTER_SHARE_BYTES or more and the
    8-CTA ones stay within NARROW_CLUSTER_SHARE_BYTES (see there). Looping kernels were
    not measured that way and keep 16, as do kernels that ask for ``wide`` clusters
    (measured faster)."""
    ctas = math.ceil(row_bytes / cta_row_bytes)
    cluster = min(MAX_CLUSTER_SIZE, ctas if fewest else _next_pow2(ctas))
    if looping or wide or fewest or cluster < MAX_CLUSTER_SIZE:
        return cluster
    narrow_share = row_bytes / (cluster // 2)
    if narrow_share <= narrow_share_bytes or (
            WIDE_CLUSTER_SHARE_BYTES <= row_bytes / cluster
            and narrow_share <= NARROW_CLUSTER_SHARE_BYTES):
        return cluster // 2
    return cluster


def cluster_class(cfg: RowConfig) -> int:
    """The power-of-two cluster a share was sized for (cluster_size_for), which the
    measured rules name: cfg.cluster_size itself, or fewer CTAs where the share rounded
    up to whole threads and chunks left some past the row end (_split_share)."""
    return _next_pow2(cfg.cluster_size)


def whole_vectors(cfg: RowConfig, elem_bytes: int) -> bool:
    """Whether each access of ``elem_bytes`` elements is a whole ACCESS_BYTES vector
    (not narrowed by the row length or a misaligned tensor)."""
    return cfg.vec * elem_bytes == ACCESS_BYTES


# bf16 values widened to fp32 by integer ops (tiling.to_fp32) rather than the DSL's
# conversion: on shares staged in shared memory over a cluster. H200, kernels alone, % of
# the copy ceiling, DSL -> integer ops (results/bf16_widening_H200_20261203.txt): RMSNorm
# bwd 512x262144 63.7 -> 87.4, LayerNorm bwd 53.7 -> 61.7, RMSNorm fwd 90.3 -> 90.9.
# Elsewhere the kernels lost, though they ran fewer instructions at the same occupancy
# (not understood): RMSNorm bwd on register shares 32768x4096 87.5 -> 68.8, 2048x65536
# 93.3 -> 88.5, LayerNorm fwd on one CTA 8192x16384 91.3 -> 83.3. Rows re-read from
# global memory gained a little (cross-entropy loss alone 512x262144 79.4 -> 80.2,
# 4096x128256 92.3 -> 93.2): the plain streamed loss takes it (RowTiles'
# integer_widening, set by CrossEntropyForward), the other re-read shares do not. A kernel
# may keep the DSL's conversion where this rule spills it (the cross-entropy's running
# max of capped logits).
def widens_by_integer_ops(cfg: RowConfig) -> bool:
    return cfg.staging == "smem" and cfg.cluster_size > 1


def copies_async(cfg: RowConfig, elem_bytes: int) -> bool:
    """Whether vectors of ``elem_bytes``-byte elements go global -> shared with
    cp.async, which moves 4, 8 or 16 bytes (and zero-fills a predicated-off vector); a
    2-byte vector (odd-length 16-bit rows) is copied with plain loads and stores."""
    return cfg.vec * elem_bytes >= 4


def stages_in_smem(cfg: RowConfig, bytes_per_col: int) -> bool:
    """Whether staged tensors of ``bytes_per_col`` bytes per column fit the shared
    memory of a share staged there (cfg.staging == "smem")."""
    return cfg.staging == "smem" and cfg.staging_smem_bytes(bytes_per_col) <= STAGING_SMEM_BYTES


def staging_for(chunks: int, chunk_bytes: int) -> str:
    """Registers when one chunk holds the share; else shared memory when all chunks
    fit; else re-read the row from global memory in the output pass (a 16-CTA cluster
    reads its row twice within microseconds, so the second read mostly hits L2)."""
    if chunks == 1:
        return "registers"
    if chunks * chunk_bytes <= STAGING_SMEM_BYTES:
        return "smem"
    return "global"


# A share whose per-column sums stay in registers (sums_in_registers) stages only its rows
# in shared memory, where they may fit though rows and sums together did not: LayerNorm
# fp32 512x262144 on 16 CTAs, 512 threads x 4 chunks in shared memory, one buffer and the
# L2 prefetch, 68.3-68.8% of the copy ceiling against 47.6-48.2% re-read from global
# memory (kernels alone, results/norm_backward_register_shares_H200_20261203.txt, calls
# 1-3; 1024 threads x 2 chunks, 69.9%, would need a thread count of its own). Not
# measured: fp32 229376 (14 CTAs) and rows of bf16 h with fp32 dy (229376, 262144: two
# buffers of 512-thread shares instead of one of 256 or a re-read).
def rows_alone_in_smem(cfg: RowConfig, row_bytes_per_col: int) -> RowConfig:
    """``cfg`` staged in shared memory when its rows of ``row_bytes_per_col`` bytes per
    column (every staged tensor, no sums) fit there."""
    chunk_bytes = cfg.rows_per_block * cfg.cols_per_chunk * row_bytes_per_col
    return dataclasses.replace(cfg, staging=staging_for(cfg.num_chunks, chunk_bytes))


# A softmax share staged in shared memory holds its last chunks in registers instead
# (RowConfig.register_chunks: loaded straight there, kept in their own dtype) where that
# lets two CTAs share an SM (the rest staged within TWO_CTA_STAGING_BYTES), and a forward
# share otherwise re-read from global memory is staged so wherever the rest fits. H200,
# kernels alone, softmax / log_softmax, % of the copy ceiling (benchmarks/sweep_softmax.py
# --register-chunks, results/softmax_register_chunks_sweep_H200_20261130.txt and
# held_chunk_backward_norm_sweep_H200_20261130.txt):
# - fp32 512x262144 forward 89.1 / 89.0 -> 93.2 / 93.6 (128 -> 96 KiB staged), backward
#   84.9 / 84.2 -> 97.4 / 97.3;
# - fp32 128x1048576 forward 69.2 / 69.1 -> 72.2 / 75.2 (staged instead of re-read; 68.9
#   / 69.0 -> 69.9 / 70.4 on a later machine);
# - fp32 1024x131072 backward (8 CTAs) 96.0 -> 100.7 (softmax only);
# - bf16 512x262144 backward (8 CTAs, two 16-KiB chunks of y and dy held) 90.0 / 82.9 ->
#   97.1 / 97.2 (three chunks: 96.1 / 98.3);
# - bf16 256x524288 (softmax, default shares, two chunks held): forward on 8 CTAs 80.1 ->
#   84.7, backward on 16 CTAs 80.6 -> 94.4.
# The forward's 16-CTA clusters lost with two CTAs per SM (fp32 256x524288 79.6 -> 77.8,
# softmax only), so the forward holds a chunk for that only on smaller clusters (its
# re-read rows, on 16, gained). Where the rest still took the SM alone it did not pay:
# bf16 128x1048576 forward 71.2 / 71.6 -> 71.9 / 72.6 (112 KiB), bf16 512x262144 backward
# 86.7 / 77.7 -> 82.8 / 76.0 (120 KiB); nor did two or three chunks held on the forward's
# 16-CTA clusters (bf16 1M at 99 KiB: 68.1%, 128 registers), nor the bf16 1M backward (y
# and dy staged with 2-4 chunks held instead of dy re-read: 69.0 / 67.8 -> 69.1-73.2 /
# 69.7-78.2, at 200-255 registers on 256-thread shares; on 512-thread ones it paid:
# held_share). The held chunks are at most
# HELD_CHUNK_BYTES_PER_THREAD (as measured) so that they never spill. The norm forward
# did not gain (RMSNorm fp32 512x262144 88.9% with its early columns, 88.8% with a held
# chunk instead).
TWO_CTA_STAGING_BYTES = 100 * 1024
HELD_CHUNK_BYTES_PER_THREAD = 128
# ... and such kernels are compiled for at most 128 registers per thread (RowKernel.launch),
# two CTAs of 256 threads per SM where shared memory allows: left to itself the compiler
# took up to 159 registers (fp16 softmax of 524288 columns), which keeps one CTA per SM.
HELD_CHUNK_REGISTERS = 128


def _fewest_held(cfg: RowConfig, bytes_per_col: int, fits: Callable[[RowConfig], bool],
                 first: int = 1) -> RowConfig | None:
    """``cfg`` staged in shared memory but for the fewest of its last chunks, ``first`` or
    more, held in registers (at most HELD_CHUNK_BYTES_PER_THREAD a thread; at least one
    chunk stays staged) that ``fits``; None where no such count does."""
    chunk_bytes = cfg.thread_values_per_chunk * bytes_per_col  # per thread
    most = min(HELD_CHUNK_BYTES_PER_THREAD // chunk_bytes, cfg.num_chunks - 1)
    for chunks in range(first, most + 1):
        held = dataclasses.replace(cfg, staging="smem", register_chunks=chunks)
        if fits(held):
            return held
    return None


def _within_staging(cfg: RowConfig, bytes_per_col: int) -> bool:
    """Whether a share's staged chunks are at most MAX_CHUNKS_PER_SHARE and fit
    STAGING_SMEM_BYTES."""
    return cfg.smem_chunks <= MAX_CHUNKS_PER_SHARE \
        and cfg.staging_smem_bytes(bytes_per_col) <= STAGING_SMEM_BYTES


def with_held_chunk(cfg: RowConfig, bytes_per_col: int, full_clusters_too: bool) -> RowConfig:
    """``cfg`` with its last chunks held in registers where that pays (see
    TWO_CTA_STAGING_BYTES): the fewest that bring the rest within TWO_CTA_STAGING_BYTES,
    or one for a share otherwise re-read; ``full_clusters_too``: also for two CTAs per SM
    on clusters of MAX_CLUSTER_SIZE CTAs (the backward; the forward lost there)."""
    chunk_bytes = cfg.thread_values_per_chunk * bytes_per_col  # per thread
    if cfg.staging == "registers" or cfg.stages > 1:
        return cfg
    if cfg.staging == "global":
        # (as measured: whole 16-byte vectors, within the chunks a staged share may have)
        held = dataclasses.replace(cfg, staging="smem", register_chunks=1)
        fits = chunk_bytes <= HELD_CHUNK_BYTES_PER_THREAD \
            and whole_vectors(cfg, bytes_per_col) and _within_staging(held, bytes_per_col)
        return held if fits else cfg
    if cluster_class(cfg) == MAX_CLUSTER_SIZE and not full_clusters_too \
            or cfg.staging_smem_bytes(bytes_per_col) <= TWO_CTA_STAGING_BYTES:
        return cfg
    return _fewest_held(cfg, bytes_per_col, lambda held: held.staging_smem_bytes(
        bytes_per_col) <= TWO_CTA_STAGING_BYTES) or cfg


# The 16-bit softmax backward of rows of about 1M columns (y and dy both re-read, or y
# staged alone and dy re-read) stages both on shares of HELD_SHARE_THREADS threads x
# HELD_SHARE_VALUES values (of y and dy together, or of dy alone) whose last chunks are
# held in registers so that the rest fits STAGING_SMEM_BYTES. H200, kernels alone, % of
# the copy ceiling (results/softmax_1m_held_shares_H200_20261203.txt), y staged alone and
# dy re-read -> held: bf16 128x1048576 68.7 -> 70.6, 256x1048576 71.1 -> 73.1, 128x1000000
# 66.5 -> 70.0, fp16 128x1048576 69.1 -> 70.5 (4 chunks with one held: within 0.3 of 8
# with two). The forward on such shares over 8 CTAs (16 clusters resident against 7) was
# mixed: bf16 71.3 -> 71.5, 256x1048576 74.4 -> 78.2, fp16 73.9 -> 67.3; it keeps its
# 16-CTA shares.
# The log_softmax backward, which needs only dy before its reduction, stages dy alone
# instead (SoftmaxBackward.streams_y), and for fp32 rows whose dy alone would be re-read
# holds dy's last chunk here too (one tensor of 1M fp32 columns on 16 CTAs: 192 KiB
# staged + one chunk of 32 values a thread): fp32 128x1048576 75.3 -> 91.7, 128x1000000
# 74.8 -> 91.1, 256x1048576 76.5 -> 94.1 (16-bit rows of 2M columns spilled 64 bytes so).
# At 1024 threads (16 values) the softmax backward spilled 24 bytes (sm_90a).
# The 16-bit log_softmax backward takes such dy shares too where none of its chunks is
# held (results/log_softmax_bwd_dy_share_H200_20261203.txt, y-alone 256-thread shares ->
# these): bf16 128x1048576 77.6 -> 85.2, 256x1048576 79.6 -> 88.1; fp32 256x524288 82.9 ->
# 89.6 (dy alone on 256 threads before).
HELD_SHARE_THREADS = 512
HELD_SHARE_VALUES = 32
# The fp32 softmax backward of rows whose y and dy together outgrow a cluster's shared
# memory (400K+ columns) stages y alone on held shares of chunks of this many values, dy
# read from global memory in both passes (its second read mostly from L2): at 32 values
# the held chunk, dy's chunk and the next one in flight spilled 64-72 bytes (sm_90a,
# 800000-1048576 columns), at 16 none (126-128 registers). Before, rows of 800K+ columns
# re-read y and dy both. H200 kernels alone: 128x1048576 59.4 -> 71.8%, 256x1048576
# 60.1 -> 74.7, 128x1000000 59.2 -> 72.1, 256x524288 76.2 -> 84.2.
Y_SHARE_VALUES = 16
# The second read of such a dy comes from L2 only while its lines survive the traffic
# between the two reads (y, dx and the other resident clusters' rows). Where the rows
# of dy in flight, about one per cluster of up to 16 CTAs (7 such clusters fit on 132
# SMs), outgrow half of L2 (a rough bound: 3.57 MiB rows, 936229+ fp32 columns), the
# output pass re-reads dy last chunk first (the chunks read last are the likeliest
# still there), dy's first read is marked evict-last and its re-read and the dx stores
# evict-first (tiling.L2_POLICIES). H100 kernels alone
# (results/softmax_bwd_reread_in_reverse_H100_20261206.txt), main -> reversed + hints:
# fp32 128x1048576 78.0 -> 81.7, 256x1048576 79.3 -> 85.7, 128x1000000 77.9 -> 80.3
# (reversed alone). Under the bound it lost: 256x800000 (3.05 MiB) 81.3 -> 80.2, and
# 256x524288 (reversed alone, 16 bytes spilled) 94.5 -> 87.4; rows between 800000 and
# 936229 columns were not measured.
L2_BYTES = 50 * 1024 * 1024
RESIDENT_FULL_CLUSTERS = 7
REREAD_IN_REVERSE_MIN_ROW_BYTES = L2_BYTES // 2 // RESIDENT_FULL_CLUSTERS


def rereads_in_reverse(n_cols: int, elem_bytes: int) -> bool:
    """Whether a tensor that a row kernel reads twice from global memory is re-read
    last chunk first, with L2 eviction hints (see REREAD_IN_REVERSE_MIN_ROW_BYTES)."""
    return n_cols * elem_bytes >= REREAD_IN_REVERSE_MIN_ROW_BYTES


def held_share(n_cols: int, elem_bytes: int, staged_tensors: int,
               max_vec: int | None = None,
               values_per_thread: int = HELD_SHARE_VALUES) -> RowConfig | None:
    """Shares of ``n_cols`` over MAX_CLUSTER_SIZE CTAs of HELD_SHARE_THREADS threads, chunks of
    ``values_per_thread``, staged in shared memory but for the fewest last chunks held in
    registers (at most HELD_CHUNK_BYTES_PER_THREAD) that bring the rest within
    STAGING_SMEM_BYTES; None where no such share exists or its accesses are narrower than
    ACCESS_BYTES."""
    bytes_per_col = staged_tensors * elem_bytes
    share = row_config(n_cols, elem_bytes, staged_tensors, max_vec=max_vec,
                       values_per_thread=values_per_thread,
                       cta_row_bytes=math.ceil(n_cols * bytes_per_col / MAX_CLUSTER_SIZE),
                       max_threads_per_row=HELD_SHARE_THREADS, wide_clusters=True)
    if share.staging == "registers" or not whole_vectors(share, elem_bytes):
        return None
    return _fewest_held(share, bytes_per_col,
                        lambda held: _within_staging(held, bytes_per_col), first=0)


def row_config(n_cols: int, elem_bytes: int, staged_tensors: int = 1,
               bytes_per_col: int | None = None, max_vec: int | None = None,
               values_per_thread: int | None = None,
               max_threads_per_row: int | None = None,
               min_threads_per_block: int = MIN_THREADS_PER_BLOCK,
               cta_row_bytes: int = CTA_ROW_BYTES, looping: bool = False,
               narrow_share_bytes: int = 0, wide_clusters: bool = False,
               fewest_ctas: bool = False,
               min_vecs_per_thread: int | None = None) -> RowConfig:
    """Configuration for rows of ``n_cols`` elements of ``elem_bytes`` each (the widest
    staged dtype), with ``staged_tensors`` row tensors kept on chip together (e.g. y and
    dy in a backward). ``bytes_per_col`` is the staged bytes per column over all of
    them (defaults to staged_tensors * elem_bytes). ``looping``: the kernel loops over row
    blocks; ``narrow_share_bytes``, ``wide_clusters`` and ``fewest_ctas`` (its
    ``fewest``): see cluster_size_for.
    The keyword limits default to the tuned constants above (``max_threads_per_row``:
    MAX_THREADS_PER_ROW, or GLOBAL_STAGED_THREADS_PER_ROW for rows that end up re-read
    from global memory, or FP32_ROW_THREADS_PER_ROW for the one-CTA fp32 rows it names;
    ``values_per_thread``: VALUES_PER_THREAD, more for shares of
    more than MAX_CHUNKS_PER_SHARE chunks; ``min_vecs_per_thread``:
    MIN_VECS_PER_THREAD, or FP32_ROW_MIN_VECS_PER_THREAD for one fp32 tensor staged alone
    at its own width, not looping); tests and sweeps override them to force other
    paths."""
    if n_cols < 1:
        raise ValueError(f"row length must be >= 1, got {n_cols}")
    if bytes_per_col is None:
        bytes_per_col = staged_tensors * elem_bytes
    fp32_row = min_vecs_per_thread is None and staged_tensors == 1 \
        and bytes_per_col == elem_bytes == 4 and not looping
    if min_vecs_per_thread is None:
        min_vecs_per_thread = FP32_ROW_MIN_VECS_PER_THREAD if fp32_row else MIN_VECS_PER_THREAD
    vec = vector_width(n_cols, elem_bytes, max_vec)
    tuned_values = values_per_thread is None
    if tuned_values:
        values_per_thread = VALUES_PER_THREAD.get(elem_bytes, 32)
    max_vecs_per_thread = max(1, values_per_thread // (vec * staged_tensors))
    vectors = math.ceil(n_cols / vec)
    cluster = cluster_size_for(n_cols * bytes_per_col, cta_row_bytes, looping,
                               narrow_share_bytes, wide_clusters, fewest_ctas)
    vectors_per_cta = math.ceil(vectors / cluster)
    split = functools.partial(_split_share, n_cols, vec, cluster, vectors_per_cta,
                              bytes_per_col=bytes_per_col,
                              min_threads_per_block=min_threads_per_block,
                              min_vecs_per_thread=min_vecs_per_thread)
    threads = MAX_THREADS_PER_ROW if max_threads_per_row is None else max_threads_per_row
    cfg = split(max_vecs_per_thread, threads)
    if fp32_row and tuned_values and cluster == 1 and max_threads_per_row is None \
            and whole_vectors(cfg, elem_bytes):
        fp32_row_share = split(max_vecs_per_thread, FP32_ROW_THREADS_PER_ROW)
        if fp32_row_share.vecs_per_thread == min_vecs_per_thread and \
                fp32_row_share.threads_per_row * fp32_row_share.vecs_per_thread == vectors_per_cta:
            return fp32_row_share
    if looping:  # the looping kernels' shares were tuned as they are
        return cfg
    if max_threads_per_row is None and cfg.staging == "global":
        threads = GLOBAL_STAGED_THREADS_PER_ROW
        cfg = split(max_vecs_per_thread, threads)
    while tuned_values and cfg.staging == "smem" and cfg.num_chunks > MAX_CHUNKS_PER_SHARE:
        max_vecs_per_thread *= 2
        fewer_chunks = split(max_vecs_per_thread, threads)
        # whole chunks of more values can pad the share out of shared memory: keep it
        if fewer_chunks.staging != "smem":
            break
        cfg = fewer_chunks
    return cfg


def _split_share(n_cols: int, vec: int, cluster: int, vectors_per_cta: int,
                 max_vecs_per_thread: int, max_threads_per_row: int, *, bytes_per_col: int,
                 min_threads_per_block: int, min_vecs_per_thread: int) -> RowConfig:
    """A CTA's share of ``vectors_per_cta`` vectors split into threads, chunks and rows
    per block, and where it is staged. A share rounded up to whole threads and chunks can
    cover the row with fewer CTAs than ``cluster``: the cluster keeps only those (a CTA
    past the row end would hold a resident slot and join every exchange for nothing;
    e.g. 49152 bf16 columns in 16 shares of 4096 left 4 CTAs empty)."""
    threads_per_row = threads_per_row_for(vectors_per_cta, max_vecs_per_thread,
                                          max_threads_per_row, min_vecs_per_thread)
    vecs_needed = math.ceil(vectors_per_cta / threads_per_row)
    vecs_per_thread = min(vecs_needed, max_vecs_per_thread)
    num_chunks = math.ceil(vecs_needed / vecs_per_thread)
    cluster = math.ceil(math.ceil(n_cols / vec) / (threads_per_row * vecs_per_thread * num_chunks))
    rows_per_block = max(1, min_threads_per_block // threads_per_row)
    chunk_bytes = rows_per_block * vec * threads_per_row * vecs_per_thread * bytes_per_col
    return RowConfig(
        n_cols=n_cols,
        vec=vec,
        threads_per_row=threads_per_row,
        rows_per_block=rows_per_block,
        cluster_size=cluster,
        vecs_per_thread=vecs_per_thread,
        num_chunks=num_chunks,
        staging=staging_for(num_chunks, chunk_bytes),
    )


def streamed_row_config(n_cols: int, elem_bytes: int, cta_row_bytes: int,
                        max_vec: int | None = None,
                        values_per_thread: int = VALUES_PER_THREAD[2]) -> RowConfig:
    """Rows reduced once and never written (a loss without its gradient): shares of up
    to ``cta_row_bytes`` per CTA, re-read chunk by chunk from global memory instead of
    staged, since nothing comes back to them. Their threads per row stay at the
    MAX_THREADS_PER_ROW they were measured with."""
    return dataclasses.replace(
        row_config(n_cols, elem_bytes, max_vec=max_vec, values_per_thread=values_per_thread,
                   cta_row_bytes=cta_row_bytes, max_threads_per_row=MAX_THREADS_PER_ROW,
                   min_vecs_per_thread=MIN_VECS_PER_THREAD),
        staging="global")


def elementwise_row_config(n_cols: int, elem_bytes: int, max_vec: int | None = None) -> RowConfig:
    """Rows rewritten element by element (no reduction, nothing kept between passes):
    the usual tiling, each chunk read from and written back to global memory. Nothing
    is staged, so the rules for staged shares (GLOBAL_STAGED_THREADS_PER_ROW,
    MAX_CHUNKS_PER_SHARE) do not apply."""
    return dataclasses.replace(
        row_config(n_cols, elem_bytes, max_vec=max_vec,
                   values_per_thread=VALUES_PER_THREAD.get(elem_bytes, 32),
                   max_threads_per_row=MAX_THREADS_PER_ROW,
                   min_vecs_per_thread=MIN_VECS_PER_THREAD),
        staging="global")


# Kernels that loop over row blocks (a norm backward reducing dweight over rows, the
# cross-entropy forward) launch a fixed grid, as many CTAs as fit on the GPU at once:
# the resident CTAs (times their staging buffers) set the bytes in flight per SM (two
# CTAs of 8 KiB each held the 4096-column norm backward to ~50% of the copy ceiling on
# H200), and a CTA that does not fit would run as a second, mostly idle wave.
MAX_LOOP_CTAS_PER_SM = 8
# Registers per thread a looping kernel is compiled for by default: the launch asks
# the compiler for the resident CTAs this allows (the resource report checks for
# spills; a kernel that needs more sets RowKernel.loop_registers).
LOOP_REGS_PER_THREAD = 80
REGISTERS_PER_SM = 64 * 1024
THREADS_PER_SM = 2048
SMEM_BYTES_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024  # the driver's own shared memory per CTA


def loop_ctas_per_sm(cfg: RowConfig, smem_bytes: int,
                     regs_per_thread: int = LOOP_REGS_PER_THREAD) -> int:
    """Resident CTAs per SM of a looping kernel: the fewest that registers, threads and
    shared memory allow, at most MAX_LOOP_CTAS_PER_SM."""
    threads = cfg.threads_per_block
    return max(1, min(MAX_LOOP_CTAS_PER_SM,
                      REGISTERS_PER_SM // (regs_per_thread * threads),
                      THREADS_PER_SM // threads,
                      SMEM_BYTES_PER_SM // (smem_bytes + SMEM_RESERVED_PER_CTA)))


# A looping launch of clusters asks for enough shared memory that an SM holds no more
# than the CTAs its grid is sized for (fenced_smem_bytes), where that is at most this
# many: a kernel compiled into fewer registers than it was allowed fits more, and the
# CTA scheduler then packs the clusters onto fewer SMs and leaves others idle. ncu,
# LayerNorm backward bf16 8192x16384 (8-CTA clusters, 3 CTAs per SM planned, 64
# registers: 4 fit): SMs active 80% of the kernel's cycles, 91% fenced. H200, kernels
# alone (results/kernel_ab_fenced_residency_H200_20261202.txt): that kernel 60.4% ->
# 68.5% of the copy ceiling; 3-4 CTAs of 2-CTA clusters (bf16 32768x4096) level; but
# 8 CTAs of 128 threads per SM (fp32 8192x16384, 16-CTA clusters) lost 16-21 points.
MAX_FENCED_CTAS_PER_SM = 4


def fenced_smem_bytes(smem_bytes: int, ctas_per_sm: int) -> int:
    """Dynamic shared memory that holds an SM to ``ctas_per_sm`` CTAs (at least
    ``smem_bytes``, what the CTA uses)."""
    too_many = SMEM_BYTES_PER_SM // (ctas_per_sm + 1) - SMEM_RESERVED_PER_CTA + 1
    return max(smem_bytes, -(-too_many // 128) * 128)


def loop_grid_rows(cfg: RowConfig, num_rows: int, resident_blocks: int) -> int:
    """Row blocks launched by a kernel looping over row blocks (grid x; each of them
    is a cluster of cfg.cluster_size CTAs): no more than ``resident_blocks``, the row
    blocks (clusters) the GPU holds at once, see ops.common.resident_row_blocks."""
    return max(1, min(math.ceil(num_rows / cfg.rows_per_block), resident_blocks))


def partial_sum_rows(cfg: RowConfig, grid_rows: int) -> int:
    """Rows of per-column partial sums (a norm backward's dweight / dbias) that a looping
    grid of ``grid_rows`` row blocks writes: one per row of its blocks; for shifted rows
    one per CTA and class of rows it visits (rows.ShiftClassOrder: SHIFT_CLASSES - 1
    more, those no CTA takes zeros)."""
    return grid_rows * cfg.rows_per_block + shift_classes(cfg) - 1


def shift_classes(cfg: RowConfig) -> int:
    """The classes of rows a looping grid of ``cfg`` visits a class at a time (see
    partial_sum_rows): SHIFT_CLASSES for shifted rows, else 1."""
    return SHIFT_CLASSES if cfg.row_shift else 1


def loops_over_row_blocks(cfg: RowConfig, writes_rows: bool) -> bool:
    """Whether a kernel free to choose (the cross-entropy forward) runs the looping grid
    rather than one CTA per row block: only for rows one CTA holds, and only when it
    writes rows back (the gradient). H200 sweep (benchmarks/sweep_cross_entropy.py):
    32768x4096 bf16 loss + gradient 61% -> 73% of the copy ceiling, but rows split over
    a cluster fell (4096x128256 bf16 loss only 53% -> 34%): the looping grid keeps 2
    CTAs of 256 threads per SM where one-block CTAs reach 4, and a cluster's CTAs wait
    for each other at every row. The loss alone ran faster on one CTA per row block at
    1024 and 4096 columns too (H200, same run: 32768x4096 bf16 208 -> 130 us, fp32 186
    -> 168 us; 131072x1024 bf16 139 -> 129 us, fp32 190 -> 170 us). Not for shares
    streamed from global memory either: a long share is already plenty of work per CTA
    (and the looping grid's register budget made that variant spill)."""
    return writes_rows and cfg.cluster_size == 1 and cfg.staging != "global"


# A LayerNorm forward of x alone (one staged tensor) takes 32-KiB CTA shares, half the
# cluster CTA_ROW_BYTES gives rows of 16-512 KiB. Swept when every LayerNorm row reduced
# twice (the mean, then the centered variance), so that fewer CTAs wait on each
# reduction (H200, benchmarks/sweep_norm_forward.py --norm layer, results/norm_forward_
# layer_sweep_H200_20261130.txt; kernel alone, % of the copy ceiling): bf16 8192x16384
# 83.9% -> 90.8%, 2048x65536 74.4% -> 78.7%; fp32 8192x16384 83.6% -> 94.1%,
# 2048x65536 73.1% -> 89.3%. The one-reduction kernel that rows over a cluster now run
# (kernels.norm.NormForward.moments) also ran fastest on 32-KiB shares (2048x65536 bf16:
# 82.0% vs 74.4% on 16 and 75.8% on 64). With a residual (two staged tensors) not
# measured.
LAYER_NORM_CTA_ROW_BYTES = 32 * 1024
# ... and keeps 16-CTA clusters for rows of 1 MiB, which the softmax rule
# (WIDE_CLUSTER_SHARE_BYTES) would split over 8: fp32 512x262144 ran at 71.8% of the
# copy ceiling on 16 CTAs against 64.1-66.1% on 8 (H200, kernel alone, benchmarks/
# sweep_norm_forward.py --wide16, results/norm_forward_layer_staging_sweep_H200_
# 20261130.txt); 16-bit rows of 1 MiB (524288 columns) take it too, not measured.
# Rows with a residual: see RESIDUAL_REGISTER_ROW_BYTES.


# A norm forward with a residual keeps h = x + residual in registers for rows whose
# staged pair is 1 MiB or more, up to RESIDUAL_REGISTER_MAX_COLS columns: one chunk of
# up to 64 values of each tensor per thread on 16 CTAs of 256 threads, rather than x and the
# residual staged in shared memory and both re-read for the output (with little shared
# memory per CTA, more CTAs stay resident). H200, 512x262144, kernel alone, % of the
# copy ceiling (benchmarks/sweep_norm_forward.py --residual 1 --wide16 --vpt 32,64,128,
# results/norm_forward_layer_staging_sweep_H200_20261130.txt): RMSNorm bf16 80.3% ->
# 91.1% (77.0% for the 8-CTA default in the runner), fp32 71.9% -> 84.7%; LayerNorm
# bf16 67.2% -> 80.3%, fp32 55.0% -> 71.4%. Rows of x alone lost that way (RMSNorm
# bf16 88.6% -> 71.2%, fp32 78.4% -> 64.7%), as did short rows with a residual
# (8192x16384 bf16 LayerNorm, 93.5% -> 88.5%, norm_forward_layer_moments_sweep).
# Rows between 1 MiB and 262144 columns (fp32 pairs from 131072 columns, bf16 x with an
# fp32 residual from 174763) take the rule by the same mechanism, not measured.
RESIDUAL_REGISTER_ROW_BYTES = 1024 * 1024
RESIDUAL_REGISTER_VALUES = 128  # per thread, over both staged tensors
RESIDUAL_REGISTER_MAX_COLS = \
    MAX_CLUSTER_SIZE * MAX_THREADS_PER_ROW * RESIDUAL_REGISTER_VALUES // 2
# An RMSNorm or softmax forward of one 16-bit tensor staged alone and read in whole
# 16-byte vectors (measured only so: not misaligned), whose 16-CTA shares outgrow
# CTA_ROW_BYTES, takes 32 values per thread (half the chunks of the share).
# RMSNorm, H200, kernel alone (results/kernel_ab_rms_forward_values_H200_20261130.txt):
# bf16 512x262144 85.2% -> 88.3%, 656x200000 75.2% -> 81.2%, fp16 512x262144 85.7% ->
# 88.4%; first seen in benchmarks/sweep_norm_forward.py (results/norm_forward_values_
# sweep_H200_20261130.txt). Shorter rows were the same within 0.3 points (2048x65536,
# 8192x16384); LayerNorm lost with it (8192x16384 91.1% -> 86.5%, 512x262144 74.5% ->
# 72.7%). Softmax / log_softmax, each twice (results/softmax_wide_share_values_H200_
# 20261130.txt): bf16 512x262144 93.4, 92.9 / 87.8, 87.5% -> 92.6, 92.9 / 92.2, 92.2%;
# fp16 85.0, 84.7 / 88.6, 88.1% -> 93.2, 92.9 / 93.5, 93.5% (softmax shares re-read from
# global memory keep their default: not measured).
WIDE_SHARE_VALUES = 32


def wide_16bit_share(n_cols: int, bytes_per_col: int, access_bytes: int) -> bool:
    """Whether one 16-bit tensor read ``access_bytes`` at a time takes WIDE_SHARE_VALUES."""
    return bytes_per_col == 2 and access_bytes == ACCESS_BYTES \
        and n_cols * bytes_per_col > MAX_CLUSTER_SIZE * CTA_ROW_BYTES


def widened_16bit_share(share: Callable[..., RowConfig], bytes_per_col: int,
                        access_elem_bytes: int) -> RowConfig:
    """``share()`` (row_config with the caller's arguments: one staged tensor of
    ``bytes_per_col``, accessed ``cfg.vec`` elements of ``access_elem_bytes`` at a time),
    in chunks of WIDE_SHARE_VALUES per thread where wide_16bit_share and where that
    halves the chunks of a share staged in shared memory: rows whose shares already take
    more values per thread (past MAX_CHUNKS_PER_SHARE chunks: 16-bit rows of 1.05M-1.6M
    columns) keep theirs."""
    cfg = share()
    if not wide_16bit_share(cfg.n_cols, bytes_per_col, cfg.vec * access_elem_bytes):
        return cfg
    wide = share(values_per_thread=WIDE_SHARE_VALUES)
    return wide if wide.staging == "smem" and wide.num_chunks < cfg.num_chunks else cfg


def keeps_residual_in_registers(staged_tensors: int, n_cols: int, bytes_per_col: int) -> bool:
    """Whether a norm forward with a residual keeps h in registers (see
    RESIDUAL_REGISTER_ROW_BYTES)."""
    return staged_tensors == 2 and n_cols * bytes_per_col >= RESIDUAL_REGISTER_ROW_BYTES \
        and n_cols <= RESIDUAL_REGISTER_MAX_COLS


def norm_forward_share(rms: bool, staged_tensors: int, n_cols: int,
                       bytes_per_col: int) -> tuple[int, bool, int | None]:
    """(CTA row bytes, whether to keep 16-CTA clusters, values per thread or None for
    the default) of a norm forward (see LAYER_NORM_CTA_ROW_BYTES and
    RESIDUAL_REGISTER_ROW_BYTES; RMSNorm of x alone may widen its share:
    ops.norm.forward_config)."""
    if not rms and staged_tensors == 1:
        return LAYER_NORM_CTA_ROW_BYTES, True, None
    if keeps_residual_in_registers(staged_tensors, n_cols, bytes_per_col):
        return CTA_ROW_BYTES, True, RESIDUAL_REGISTER_VALUES
    return CTA_ROW_BYTES, False, None


# LayerNorm of x alone over a cluster of 4 CTAs or more, where its share would be kept
# in registers (fp32 rows of 16K-131K columns: one chunk of 20-32 values per thread,
# with the weight and bias loaded with it; 117 registers and two CTAs of 256 threads per
# SM at 65536), takes fewer values per thread instead: chunks staged in shared memory,
# one reduction (NormForward.moments) and the columns loaded in the output pass. H200,
# kernel alone (benchmarks/sweep_norm_forward.py, 32-KiB shares; results/norm_forward_
# layer_values_sweep_H200_20261202.txt), % of the copy ceiling at 32 (registers) / 16 /
# 8 values per thread: fp32 4096x32768 (4 CTAs) 88.3 / 92.1 / 85.8, 2048x65536 (8)
# 82.2 / 90.4 / 91.6, 1024x131072 (16) 71.7 / 81.4 / 82.6; 2-CTA clusters lost
# (8192x16384: 94.5 / 94.1 / 88.1). A/B in one GPU session (results/kernel_ab_layer_
# norm_four_cta_H200_20261202.txt): 4096x32768 88.2% -> 92.7%. Only those three row
# lengths were measured: shares of three chunks (8 and 16 CTAs: 32K-49K, 64K-98K columns)
# or with a partly empty last chunk (4 CTAs: 16K-32K columns short of 32768) were not,
# nor narrower vectors (ragged or misaligned rows).
# (smallest cluster, values per thread), largest cluster first
LAYER_NORM_STAGED_VALUES = ((8, 8), (4, 16))
# ... and where one CTA would hold the row in registers at more values per thread than
# this (fp32 rows of 7169-8192 columns), it takes two CTAs of 16-KiB shares instead
# (CTA_ROW_BYTES, as RMSNorm does). H200, kernel alone, % of the copy ceiling, one CTA
# (32 values) -> two (16), three runs of 1024x8192 and two of the rest: fp32 1024x8192
# 60.7-60.9% -> 68.5-71.3%, 4096x8192 84.6% -> 89.3%, 16384x8192 94.9% -> 96.3%,
# 4096x8000 85.7% -> 86.9%; at 28 and 24 values one CTA won (16384x7168: 94.4% ->
# 90.4%, 32768x6144: 96.4% -> 94.5%)
# (results/norm_forward_layer_small_rows_sweep_H200_20261202.txt).
LAYER_NORM_ONE_CTA_MAX_VALUES = 28


# ... and a share staged in shared memory anyway at its widest dtype's default
# VALUES_PER_THREAD, more than LATE_COLUMNS_TOGETHER_VALUES (fp32 rows of 131K+ columns;
# 16-bit rows with an fp32 weight or bias from 8K columns), takes chunks of
# LATE_COLUMNS_TOGETHER_VALUES, or of LAYER_NORM_LONG_ROW_VALUES where those cover fewer
# columns (a smaller empty tail), so that its weight and bias load together, a chunk
# ahead (norm_forward_columns_ahead): only where those loads are whole vectors (of the
# widest of x and the columns), and in at most LAYER_NORM_LONG_ROW_MAX_CHUNKS chunks.
# H100, kernels alone (results/norm_forward_columns_ahead_H100_20261206.txt), 32 -> 8
# values: fp32 512x262144 77.5 -> 81.7%, 1024x200000 83.4 -> 94.0, 256x524288 60.3 ->
# 63.5, and in a review's A/B 1024x150000 80.8 -> 94.6, 256x786432 58.0 -> 61.9. 8 -> 16
# values (results/norm_forward_layer_long_rows_H100_H200_20261206.txt; 90 registers at
# 262144, two CTAs per SM, against 56): H100 512x262144 81.6 -> 90.0, 512x300000 82.2 ->
# 90.0, 256x524288 65.3 -> 69.9, 256x786432 62.2 -> 69.1, 512x196608 and 256x393216
# level; H200 512x262144 73.4 -> 77.0, 256x786432 51.6 -> 59.1. Chunks of 16 that cover
# more columns lost (H200 1024x200000, 4 chunks with the last 1% full, 83.4 -> 73.4;
# 1024x150000 84.8 -> 79.7), as did the last chunk held in registers (1024x150000 68.3)
# and the first chunk's columns loaded before the cluster exchange (H100 1024x200000
# 93.9 -> 88.0). Many chunks lost: bf16 shares widened past MAX_CHUNKS_PER_SHARE (1M
# columns) in 17-46 chunks of 8, 12-14 points (128x1048576 53.4 -> 41.2), so no split
# takes more chunks than the most that gained (fp32 256x786432 in 24 chunks of 8). 16-bit
# x with an fp32 weight and bias: see norm_forward_columns_ahead.
LAYER_NORM_LONG_ROW_VALUES = 8
LAYER_NORM_LONG_ROW_MAX_CHUNKS = 24


def staged_layer_norm_share(share: Callable[..., RowConfig], access_elem_bytes: int,
                            loaded_ahead_bytes: int) -> RowConfig:
    """``share()`` (row_config with the caller's arguments: LayerNorm of x alone,
    accessed ``cfg.vec`` elements of ``access_elem_bytes``, its widest dtype, at a time)
    where it would be a registers share: staged in chunks of LAYER_NORM_STAGED_VALUES
    per thread for its cluster size, or a one-CTA share of more than
    LAYER_NORM_ONE_CTA_MAX_VALUES per thread split over two CTAs; staged at the widest
    dtype's default values per thread, more than LATE_COLUMNS_TOGETHER_VALUES, where the
    columns would load ahead in whole vectors (``loaded_ahead_bytes``: the widest of x
    and its weight and bias): _long_row_chunks."""
    cfg = share()
    if not whole_vectors(cfg, access_elem_bytes):
        return cfg
    default_values = VALUES_PER_THREAD[access_elem_bytes]
    if cfg.staging == "smem" and cfg.thread_values_per_chunk == default_values \
            and not late_columns_together(cfg):
        return _long_row_chunks(share, loaded_ahead_bytes) or cfg
    if cfg.staging != "registers":
        return cfg
    for min_cluster, values in LAYER_NORM_STAGED_VALUES:
        if cluster_class(cfg) >= min_cluster:
            return share(values_per_thread=values)
    if cfg.cluster_size == 1 and cfg.thread_values_per_chunk > LAYER_NORM_ONE_CTA_MAX_VALUES:
        return share(cta_row_bytes=CTA_ROW_BYTES)
    return cfg


def _long_row_chunks(share: Callable[..., RowConfig],
                     loaded_ahead_bytes: int) -> RowConfig | None:
    """``share`` in chunks of LATE_COLUMNS_TOGETHER_VALUES or LAYER_NORM_LONG_ROW_VALUES
    per thread, whichever covers fewer columns (the wider on a tie), of those that load
    their columns ahead (norm_forward_columns_ahead) in at most
    LAYER_NORM_LONG_ROW_MAX_CHUNKS chunks; None where neither does."""
    splits = [split for split in (share(values_per_thread=LATE_COLUMNS_TOGETHER_VALUES),
                                  share(values_per_thread=LAYER_NORM_LONG_ROW_VALUES))
              if split.num_chunks <= LAYER_NORM_LONG_ROW_MAX_CHUNKS
              and norm_forward_columns_ahead(split, loaded_ahead_bytes)]
    return min(splits, key=lambda split: split.cols_covered, default=None)


# The norm forward of rows split over a cluster loads its whole share of the weight (and
# bias) into registers at the start, in flight together with the row's own loads, rather
# than chunk by chunk in the output pass (where each chunk's loads wait behind the
# previous chunk's stores: they may alias). H200, kernels alone, each cell twice
# (results/norm_forward_early_columns_H200_20261130.txt): RMSNorm fp32 512x262144 79.3%
# -> 89.1% of the copy ceiling, fp32 2048x65536 90.1% -> 95.3%, bf16 512x262144 88.4% ->
# 90.2%, bf16 2048x65536 93.3% -> 93.9%; LayerNorm fp32 2048x65536 (a registers share
# then; staged since, see staged_layer_norm_share) 72.3% -> 82.4%. LayerNorm shares
# staged in shared memory lost (bf16 512x262144 75.8% -> 58.7%, 2048x65536 82.2% ->
# 78.0%, fp32 512x262144 67.0% -> 48.7%: twice the columns held through the row). With a residual (results/norm_forward_early_columns_residual_
# H200_20261130.txt): RMSNorm bf16 2048x65536 94.0% -> 96.4%, fp32 95.7% -> 96.3%,
# LayerNorm fp32 2048x65536 91.7% -> 93.9%, LayerNorm bf16 (shared memory) 84.8% ->
# 75.5%; rows kept in registers with their residual (keeps_residual_in_registers) lost
# for RMSNorm (bf16 512x262144 91.3% -> 78.3%, fp32 85.3% -> 82.8%; LayerNorm fp32
# gained, 71.5% -> 78.0%, not taken). Not for rows re-read from global memory (not
# measured: no staged loads to overlap, and every chunk's columns held
# through both passes spilled: sm_90a, RMSNorm fp32 of 1M columns 200 bytes), nor
# shares of more than EARLY_COLUMN_VALUES per thread (the weight held through the row:
# RMSNorm bf16 of 1.1M columns, 288-320 values, spilled 72-168 bytes at 255 registers;
# the measured wins above hold up to 128: fp32 262144 at 8-CTA clusters).
# Rows one CTA holds (kernel_ab_norm_early_columns_one_cta_H200_20261201.txt): RMSNorm
# gains or ties (bf16 32768x4096 92.3% -> 94.0%, fp32 131072x1024 with a residual 93.7%
# -> 97.2%), LayerNorm bf16 loses 3-3.6 points (90.9% -> 87.3% at 32768x4096), so they
# load early for RMSNorm only.
EARLY_COLUMN_VALUES = 128


def norm_forward_early_columns(rms: bool, staged_tensors: int, bytes_per_col: int,
                               cfg: RowConfig) -> bool:
    return cfg.staging != "global" \
        and (rms or (cfg.cluster_size > 1 and cfg.staging == "registers")) \
        and cfg.cols_per_cta <= EARLY_COLUMN_VALUES * cfg.threads_per_row \
        and not keeps_residual_in_registers(staged_tensors, cfg.n_cols, bytes_per_col)


# A full share kept in registers with its residual (keeps_residual_in_registers: half of
# RESIDUAL_REGISTER_VALUES of each tensor per thread, fp32 rows of 262144 columns)
# already holds its CTA to one per SM (179-215 registers), so the weight and bias can be
# loaded once the row's values are in, before the cluster exchange of its sums, at no
# cost in CTAs: their latency passes behind the exchange. H200, kernel alone, 512x262144
# (results/kernel_ab_norm_forward_columns_H200_20261202.txt): LayerNorm 71.4% -> 82.5% of
# the copy ceiling, RMSNorm 85.1% -> 86.6%. 16-bit rows lost (120-127 -> 183-217
# registers, two CTAs per SM -> one: LayerNorm bf16 80.5% -> 69.7%, RMSNorm 91.4% ->
# 80.9%), and so would shorter fp32 shares (sm_90a, LayerNorm of 131073-196608 columns:
# 84-128 -> 133-167 registers); mixed dtypes were not measured.
def norm_forward_columns_before_reduction(staged_tensors: int, bytes_per_col: int,
                                          cfg: RowConfig) -> bool:
    return cfg.staging == "registers" and bytes_per_col == 2 * 4 \
        and cfg.thread_values_per_chunk == RESIDUAL_REGISTER_VALUES // 2 \
        and keeps_residual_in_registers(staged_tensors, cfg.n_cols, bytes_per_col)


# Columns loaded in the output pass (neither early nor before the exchange): a chunk's
# weight and bias together where each holds at most LATE_COLUMNS_TOGETHER_VALUES values
# per thread and chunk, else one after the other. Loaded together, a 64-value registers
# share of LayerNorm bf16 with a residual took 185 registers instead of 127, one CTA per
# SM instead of two (512x262144: 60.7% of the copy ceiling against 80.5%); fp32
# 512x262144 shares of x alone (32 values a chunk) ran at 67.9% against 71.1%
# (results/kernel_ab_norm_forward_columns_H200_20261202.txt).
LATE_COLUMNS_TOGETHER_VALUES = 16


def late_columns_together(cfg: RowConfig) -> bool:
    return cfg.thread_values_per_chunk <= LATE_COLUMNS_TOGETHER_VALUES


# Columns loaded in the output pass of a share staged in shared memory, together
# (late_columns_together), are loaded a chunk ahead on shares of more than two chunks:
# chunk c + 1's before chunk c's math and stores, which they would otherwise wait behind
# (the stores may alias them). H100, kernels alone, LayerNorm of x alone (benchmarks/
# results/norm_forward_columns_ahead_H100_20261206.txt), % of the copy ceiling: bf16
# 4096x32768 93.6 -> 95.8, 2048x65536 91.7 -> 95.4, 1024x131072 90.8 -> 95.0, 512x262144
# 89.0 -> 92.9, fp32 2048x65536 92.4 -> 96.9, 1024x131072 87.3 -> 95.6; with a residual
# bf16 1024x131072 93.0 -> 94.0; one-CTA 8192x16384 level (95.8 / 95.7). Shares of two
# chunks lost (fp32 4096x32768 97.2 -> 94.5, with a residual bf16 2048x65536 95.4 ->
# 94.5), so they keep the late loads. The extra registers (40 -> 64 at bf16 262144) cost
# clusters no CTA (their launches are fenced to three CTAs per SM: fenced_smem_bytes);
# the one-CTA share of 16384 columns went from five CTAs per SM to three, and ran level.
# Only whole 16-byte vectors of the widest of x and the columns were measured: odd rows
# (shifted, or of narrower vectors) keep the late loads. 16-bit x with an fp32 weight and
# bias (8-byte vectors of x; 16-value chunks: staged_layer_norm_share), H100, kernels
# alone (results/norm_forward_layer_long_rows_H100_H200_20261206.txt): bf16 2048x65536
# 87.9 -> 90.4, 1024x131072 85.1 -> 87.7, 256x524288 59.9 -> 67.0, fp16 1024x131072 86.9
# -> 88.4, 512x262144 and 8192x16384 level; then (against the shares of 32 values loaded
# late) 8192x10000 87.3 -> 89.7, 8192x12288 level, 256x557056 63.6 -> 66.3, 128x987136
# 40.5 -> 52.0, 128x1048576 37.0 -> 52.9, and staged shares with a residual 512x196608
# 86.6 -> 91.0, 256x393216 68.5 -> 71.3.
def norm_forward_columns_ahead(cfg: RowConfig, widest_bytes: int) -> bool:
    """``widest_bytes``: of the widest of x and the per-column vectors."""
    return cfg.staging == "smem" and cfg.num_chunks > 2 and late_columns_together(cfg) \
        and not cfg.row_shift and whole_vectors(cfg, widest_bytes)


# Norm backward of 16-bit rows (h and dy staged; dweight / dbias sums kept per column,
# each counted as one more fp32 tensor of the share): CTA row bytes and vectors per
# thread of each staged tensor, from H200 sweeps over the issue's grid (N = 1K..256K at
# M*N = 2^27; benchmarks/sweep_norm_backward.py, results/norm_backward_config_sweep_
# H200_20261130.txt; % of the copy ceiling, kernel alone, no spills):
# - RMSNorm (one sum): rows of up to 4096 columns stay at CTA_ROW_BYTES and one vector
#   (1024: 96.8% vs 83.6% with two; 4096: 89.7% vs 79.6%); longer rows take 64-KiB
#   shares of two vectors (16384: 73% -> 77%, 65536: 57% -> 65%, 262144: 44% -> 52%).
# - LayerNorm (two sums): 32-KiB shares of two vectors (1024: 77.5% -> 81.6%, 4096: 63%
#   -> 72%, 262144: 32% -> 39%). Between 4096 and 65536 columns one vector ran faster
#   then (16384: 57% vs 45%), but no longer once launches of clusters fenced their
#   residency (config.fenced_smem_bytes) and the row statistics were loaded beside the
#   staged rows (results/norm_backward_layer_shares_fenced_H200_20261202.txt: 8192x16384
#   69.6% -> 86.0%, 2048x65536 47.0% -> 69.6%).
# The two-vector threads are compiled for more registers (kernels.norm.NormBackward),
# which costs resident CTAs: that is why short RMSNorm rows keep one vector.
# fp32 rows keep CTA_ROW_BYTES and VALUES_PER_THREAD (LayerNorm 8192x16384 with 32-KiB
# shares: 79% -> 61%), as do backwards without sums (frozen weight, not swept).
def norm_backward_share(elem_bytes: int, accumulators: int, n_cols: int):
    """(CTA row bytes, vectors per thread of each staged tensor or None for the
    VALUES_PER_THREAD default) of a norm backward."""
    if elem_bytes != 2 or accumulators == 0:  # the latter not swept: the row defaults
        return CTA_ROW_BYTES, None
    if accumulators == 1:
        return (CTA_ROW_BYTES, 1) if n_cols <= 4096 else (64 * 1024, 2)
    return 32 * 1024, 2


# Norm backwards with per-column sums over rows of 4097-131072 columns held as one chunk
# in registers by wide CTAs: REGISTER_SHARE_VALUES values per thread of each staged
# tensor, 512 threads (8192 columns a CTA, one CTA per SM), as many CTAs as the row
# needs; 16-bit RMSNorm rows take 1024 threads where that makes two CTAs or more and
# leaves no more padding, and 512 however much those pad the row. H200, kernels alone, %
# of the copy ceiling, the clustered shares of norm_backward_share -> these
# (results/norm_backward_register_shares_H200_20261203.txt): RMSNorm bf16 16384x8192
# 89.4 -> 95.4, 8192x16384 84.3 -> 95.2, 4096x32768 75.2 -> 93.0 (1024 threads; 512:
# 90.5), 2048x65536 72.0 -> 94.9 (512: 89.6), 1024x131072 60.3 -> 93.8 (512: 72.2),
# 8192x24000 67.3 -> 85.4, 4096x40000 64.6 -> 81.0, 8192x12288 -> 79.9, 8192x10000 48.9
# -> 64.4 (one 1024-thread CTA: 77.7), fp32 16384x8192 94.8 -> 96.3, 2048x65536 92.3 ->
# 97.7, 1024x131072 78.3 -> 95.5; LayerNorm bf16 16384x8192 88.4 -> 94.7, 8192x16384
# 86.0 -> 88.2, 4096x32768 74.5 -> 83.3, 2048x65536 69.4 -> 74.3, 1024x131072 47.2 ->
# 62.5, 8192x24000 74.0 -> 78.7, 4096x40000 66.8 -> 71.7, fp32 2048x65536 72.0 -> 97.2,
# 1024x131072 70.7 -> 73.7; RMSNorm fp32 8192x16384 level (97.3 -> 97.0). One
# 1024-thread CTA ran slower than two of 512 at 16384 columns (RMSNorm bf16 92.8 vs
# 95.4%), and its variant with a residual gradient spilled 8 bytes at 12288 (2 x 512
# there: 79.9%, 128- and 256-thread shares 66.2-67.8%). Where whole 512-thread shares
# would pad LayerNorm rows by a fifth or more they lost (bf16 8192x10000: 2 CTAs 54.8%
# against 68.2% on three 256-thread CTAs), as did 1024-thread LayerNorm CTAs (64
# registers a thread: 35-37%), shares of 32 values (bf16 2048x65536 RMSNorm 84.1%,
# LayerNorm 37.4%) and 4096-column rows (one 512-thread CTA: RMSNorm bf16 89.8 -> 80.6,
# LayerNorm 92.7 -> 79.0). Rows of 262144 columns (32 such CTAs) keep the clustered
# shares (16 CTAs of 1024 threads: RMSNorm 78.6 -> 69.9). Odd lengths (narrowed vectors)
# and backwards without sums were not measured; vectors narrowed by a misaligned tensor
# (max_vec) keep the clustered shares too (16-bit RMSNorm 65536 of one-value vectors
# spilled 40 bytes on 1024 threads, sm_90a report).
REGISTER_SHARE_VALUES = 16
REGISTER_SHARE_THREADS = 512
RMS_16BIT_REGISTER_SHARE_THREADS = 1024
REGISTER_SHARE_MIN_COLS = 4097
REGISTER_SHARE_MIN_FILL = 0.8


def norm_backward_register_threads(elem_bytes: int, accumulators: int, n_cols: int,
                                   rms: bool, max_vec: int | None = None) -> int | None:
    """Threads per CTA of a norm backward's one-chunk register share (see above), or
    None where the row keeps the shares of norm_backward_share: also where the row
    length or ``max_vec`` narrows the staged dtype's accesses below ACCESS_BYTES."""
    if accumulators == 0 or n_cols < REGISTER_SHARE_MIN_COLS \
            or vector_width(n_cols, elem_bytes, max_vec) * elem_bytes < ACCESS_BYTES:
        return None

    def fill(threads: int) -> float:
        """The row's share of the columns its CTAs cover (0: more than a cluster)."""
        ctas = math.ceil(n_cols / (threads * REGISTER_SHARE_VALUES))
        if ctas > MAX_CLUSTER_SIZE:
            return 0.0
        return n_cols / (ctas * threads * REGISTER_SHARE_VALUES)

    wide, narrow = RMS_16BIT_REGISTER_SHARE_THREADS, REGISTER_SHARE_THREADS
    if rms and elem_bytes == 2 and fill(narrow) > 0:
        # (one 1024-thread CTA: 512 ran faster at 16384 columns, and at 12288 the
        # variant with a residual gradient spilled)
        two_wide_ctas = n_cols > wide * REGISTER_SHARE_VALUES
        return wide if two_wide_ctas and fill(wide) >= fill(narrow) else narrow
    return narrow if fill(narrow) >= REGISTER_SHARE_MIN_FILL else None


# 16-bit rows of odd length (one-value vectors: 2-byte accesses, a predicate and an
# address per value) whose clustered norm backward share with per-column sums stages
# them in shared memory take a one-chunk register share instead: RMSNorm 1024 threads x
# at most 15 values, LayerNorm (two sums) 512 x at most 17 (ODD_ROW_SHARES), where the
# row needs two such CTAs or more and a cluster holds them. H200, kernels alone, % of
# the copy ceiling (results/norm_backward_odd_rows_H200_20261204.txt, compare_trees),
# clustered -> these: RMSNorm bf16 4096x50257 25.0 -> 43.5 (torch eager 28.0 in the
# runner), 1024x131073 22.7 -> 30.1, 2048x100001 22.5 -> 39.5, fp16 4096x32001 31.4 ->
# 42.6; LayerNorm bf16 1024x131073 11.3 -> 33.9 (torch.compile 27.5), 2048x100001 21.9
# -> 28.9, 4096x65537 22.9 -> 38.0. In the share sweeps smaller shares lost (RMSNorm
# 50257 on 512 threads x 32 values 30.2, on 256 x 16 26.4; LayerNorm 131073 on 1024
# threads x 9 values 30.5), and where the clustered share holds the row in registers it
# won (LayerNorm 4096x50257: 36.1 against 24.0 on 1024 threads). The value caps as
# compiled for sm_90a: RMSNorm at 16 values spilled 32 bytes (32001 bf16 columns),
# LayerNorm on 1024 threads (64 registers) 32-120 bytes; nor do the residual's gradients
# fit (read and written besides dx: 32-112 bytes).
ODD_ROW_SHARES = {True: (1024, 15), False: (512, 17)}  # rms -> (threads, most values)


def odd_row_register_share(n_cols: int, elem_bytes: int, accumulators: int, outputs: int,
                           rms: bool, clustered: RowConfig) -> tuple[int, int] | None:
    """(threads per CTA, most values a thread) of the one-chunk register share a norm
    backward of odd 16-bit rows takes instead of ``clustered`` (see above), or None where
    it keeps that share. ``outputs``: its row tensors besides h and dy (dx alone is 1; a
    residual's gradient read and another written make 3)."""
    if accumulators == 0 or outputs != 1 \
            or not _narrow_row_off_registers(n_cols, elem_bytes, clustered):
        return None
    threads, values = ODD_ROW_SHARES[rms]
    ctas = math.ceil(n_cols / (threads * values))
    return (threads, values) if 1 < ctas <= MAX_CLUSTER_SIZE else None


# The norm forward of x alone, the softmax forward and the cross-entropy loss alone on odd
# 16-bit rows of 16K-256K columns that their clustered shares do not hold in registers:
# chunks of 8 values on 256 threads; RMSNorm re-reads x from global memory (mostly L2) in
# its output pass, 16 KiB of the row a CTA, LayerNorm and softmax stage it, 32 KiB a CTA,
# and the loss streams it (one pass, nothing written back), 32 KiB a CTA. Smaller chunks
# keep more of the narrow loads in flight. H200, bf16 kernels alone, % of the copy ceiling,
# the shares before -> these (compare_trees,
# results/norm_forward_odd_rows_H200_20261204.txt): RMSNorm 4096x50257 25.1 -> 52.8,
# 2048x100001 24.1 -> 50.1, 1024x131073 21.9 -> 50.1, 512x262143 24.6 -> 46.4 (torch.compile
# 32.8-34.4 in the runner); LayerNorm 32.6 -> 40.0, 34.6 -> 41.9, 34.0 -> 41.4, 36.0 ->
# 36.1; softmax (softmax_forward_odd_rows_and_ce_sweep_H200_20261204.txt) 59.4 -> 60.1, 56.4
# -> 62.5, 51.7 -> 56.9, 8192x16385 50.3 -> 58.7, fp16 4096x32001 64.1 -> 62.0 (its one
# loss; softmax at 16 KiB a CTA did worse). In the share sweep
# (norm_forward_odd_rows_sweep_H200_20261204.txt) a one-chunk register share of 1024 threads
# x 15 values reached 35 / 27 (RMSNorm / LayerNorm at 50257); 16-value chunks, 512 or 1024
# threads and the other staging lost. Cross-entropy loss alone (compare_trees,
# cross_entropy_odd_rows_and_small_softmax_sweep_H200_20261204.txt), bf16: 4096x50257 40.2
# -> 45.0 (4 CTAs of 16 staged values before), 1024x131073 30.5 -> 39.2 and 512x262143 30.8
# -> 46.1 (one streaming CTA a row before), 8192x16385 38.4 -> 40.6; the one loss
# 2048x100001, 50.8 -> 49.1 (one streaming CTA a row fills the GPU at 2048 rows). Not the
# gradient: staged on these shares its kernel alone gained 2-9 points (4096x50257 50.2 ->
# 53.6), but the training step's variant (the in-kernel mean) compiled to 72 registers at
# 131073 columns (3 CTAs per SM; 48 before) and the step ran 279 -> 476 us in the runner
# (cross_entropy_nvidia-h200_20261204-2118.csv).
ODD_ROW_FORWARD_THREADS = 256
ODD_ROW_FORWARD_VALUES = 8
# how the kernel comes back to its row (streamed: it does not) -> (row bytes a CTA, staging)
ODD_ROW_FORWARD_SHARES = {"reread": (16 * 1024, "global"), "staged": (32 * 1024, "smem"),
                          "streamed": (32 * 1024, "global")}
ODD_ROW_FORWARD_MIN_COLS = 16 * 1024


def odd_row_forward_share(share: Callable[..., RowConfig], clustered: RowConfig,
                          elem_bytes: int, reads: str) -> RowConfig | None:
    """The share (``share()``: row_config with the caller's arguments) a forward of odd
    16-bit rows of ``elem_bytes`` (one row tensor) takes instead of ``clustered`` (see
    above); ``reads``, a key of ODD_ROW_FORWARD_SHARES, says how the kernel comes back
    to the row: "reread" from global memory in its output pass, "staged" on chip, or
    "streamed" (not at all: one pass). None where it keeps ``clustered``, or where the
    share would pass MAX_CHUNKS_PER_SHARE chunks (unrolled) or, staged,
    STAGING_SMEM_BYTES: rows past 262144 columns, where it was not measured either."""
    n_cols = clustered.n_cols
    if n_cols < ODD_ROW_FORWARD_MIN_COLS or not _narrow_row_off_registers(n_cols, elem_bytes,
                                                                         clustered):
        return None
    row_bytes, staging = ODD_ROW_FORWARD_SHARES[reads]
    cfg = share(values_per_thread=ODD_ROW_FORWARD_VALUES, cta_row_bytes=row_bytes,
                max_threads_per_row=ODD_ROW_FORWARD_THREADS)
    if staging != cfg.staging:
        cfg = dataclasses.replace(cfg, staging=staging, register_chunks=0)
    if cfg.num_chunks > MAX_CHUNKS_PER_SHARE \
            or staging == "smem" and not _within_staging(cfg, elem_bytes):
        return None
    return cfg


# Odd 16-bit rows of contiguous tensors on a 16-byte-aligned base, read in whole 16-byte
# vectors: row r starts s = r * N mod 8 values past a 16-byte boundary, so its CTAs tile
# the aligned span from there (N + s values, rounded up to whole vectors) with the share
# of an aligned row of N + 7 columns, read whole vectors (cp.async), pad the values
# outside [s, s + N) in shared memory with the identity of the reduction, and store
# whole vectors but the row's two edge vectors, which share 16 bytes with the rows
# beside it and are stored value by value (RowTiles). One-value vectors instead take a
# load, a predicate and an address a value and cannot use cp.async (softmax forward of
# odd bf16 rows on odd_row_forward_share: 56-63% of the copy ceiling, aligned rows
# 85-90%). Staged shares of one row a CTA only: the pad lives in shared memory, and a
# CTA finds its row's shift once. The last row's last vector reads up to 14 bytes past
# the tensor, inside its 16-byte block (no fault; a memory checker reports it).
# H200, kernels alone, % of the copy ceiling, one-value vectors -> shifted (compare_trees
# --abba, results/softmax_shifted_odd_rows_H200_20261205.txt): bf16 4096x50257 forward
# 60.1 -> 95.5, backward 60.9 -> 99.0, log_softmax backward 63.4 -> 100.2; 1024x131073
# 56.8 -> 89.0, 56.1 -> 83.6, 59.1 -> 83.4; 512x262143 53.2 -> 71.8, 41.3 -> 94.3, 44.0 ->
# 92.5; 16384x4097 64.9 -> 83.5, 41.6 -> 75.9, 43.9 -> 78.6; fp16 4096x32001 61.8 ->
# 93.5, 66.9 -> 98.7, 68.9 -> 98.8 (every cell won). The hosts take these shares where
# SHIFTED_ODD_ROWS is on (ops.common.shiftable; tests turn it off to reach the others).
SHIFTED_ODD_ROWS = True
# The norms take them too (ops.norm.shifts_rows), their per-column vectors lined up with
# each row's shift (splices_shifted_columns, rows.ShiftClassOrder). H200, kernels
# alone, % of the copy ceiling, one-value vectors -> shifted (compare_trees --abba,
# results/norm_shifted_odd_rows_H200_20261205.txt), RMSNorm / LayerNorm forward of x,
# then with a residual: bf16 4096x50257 52.8 -> 77.8 / 40.1 -> 51.6, 54.8 -> 94.8 / 45.0 ->
# 65.3; 1024x131073 50.1 -> 66.5 / 41.4 -> 48.7, 52.3 -> 89.1 / 50.7 -> 73.2; 512x262143
# 46.5 -> 59.1 / 36.2 -> 51.0, 50.1 -> 74.5 / 37.6 -> 58.1; 16384x4097 59.2 -> 71.8 / 49.0
# -> 46.6 (see norm_forward_shifts), 39.3 -> 72.6 / 32.2 -> 49.5; fp16 4096x32001 54.6 -> 81.5
# / 47.1 -> 67.3, 62.0 -> 95.7 / 51.8 -> 79.1. The backward where its looping grid was a
# multiple of 8 row blocks (each CTA one shift): fp16 4096x32001 42.6 -> 83.5 / 30.8 ->
# 61.2, bf16 16384x4097 38.3 -> 54.1 / 36.4 -> 40.3, LayerNorm 1024x131073 33.9 -> 34.9.
# Every grid now visits the rows a class at a time (rows.ShiftClassOrder: a grid of a
# multiple of 8 splits each class among its own CTAs as before, any other runs class by
# class), so the few large clusters of 50K columns and up take them; against 2-byte
# accesses (results/norm_backward_class_major_H100_20261205.txt): bf16 4096x50257 56.9 -> 84.9 /
# 47.6 -> 74.2, 2048x100001 51.3 -> 78.6 / 37.7 -> 65.7, 1024x131073 40.6 -> 61.6 / (48.6,
# shifted already) 51.0, RMSNorm 512x262143 26.1 -> 58.9 (LayerNorm 262143 has no
# shifted share: 18.8).
SHIFTED_NORM_ROWS = True
# The forward of x alone on short shifted rows (one row a CTA): LayerNorm lost at 2049
# and 4097 columns and won from 12289 (H100, the same way,
# results/norm_shifted_odd_rows_H100_20261205.txt: bf16 65536x2049 81.5 -> 42.3,
# 32768x4097 68.0 -> 66.6, 8192x12289 63.9 -> 85.8; H200 16384x4097 above); RMSNorm won
# at 4097 (above), not measured below. Shifted from these many columns; with a residual,
# wherever the share allows (measured from 2049 columns: RMSNorm 84.7 -> 97.0 on the
# H100; LayerNorm from 4097, above).
SHIFTED_RMS_NORM_X_MIN_COLS = 4 * 1024
SHIFTED_LAYER_NORM_X_MIN_COLS = 8 * 1024


def norm_forward_shifts(n_cols: int, rms: bool, has_residual: bool) -> bool:
    """Whether a norm forward of odd 16-bit rows that may be read shifted
    (ops.norm.shifts_rows) takes the shifted share: with a residual, or from the columns
    above."""
    return has_residual or n_cols >= (SHIFTED_RMS_NORM_X_MIN_COLS if rms
                                      else SHIFTED_LAYER_NORM_X_MIN_COLS)


def shifted_row_share(share_of_span: Callable[[int], RowConfig], unshifted: RowConfig,
                      elem_bytes: int, staged_bytes_per_col: int,
                      streamed: bool = False, through_smem: bool = False) -> RowConfig | None:
    """The shifted share (see above) of the odd 16-bit rows ``unshifted`` was chosen for:
    ``share_of_span(span)`` is the kernel's share of aligned rows of ``span`` columns;
    None where that share does not stage the row tensors (``staged_bytes_per_col`` bytes
    a column) in shared memory one row a CTA (or, ``streamed``, read them from global
    memory, the edges filled as loaded: RowTiles.load), or the rows are not odd 16-bit
    rows. ``through_smem``: any share whose rows pass through shared memory (the norms':
    one chunk held in registers, staged on the way, and a looping grid's second buffer,
    see rows.ShiftClassOrder); its L2 prefetch is dropped (a shifted row's span
    starts before it, off the 16 bytes a bulk prefetch needs)."""
    n_cols = unshifted.n_cols
    if not _shiftable_odd_rows(n_cols, elem_bytes):
        return None
    cfg = share_of_span(shifted_span(n_cols, elem_bytes))
    if through_smem:
        cfg = dataclasses.replace(cfg, l2_prefetch=0)
        placed = cfg.staging in ("smem", "registers") \
            and cfg.staging_smem_bytes(staged_bytes_per_col) <= STAGING_SMEM_BYTES
    else:
        placed = cfg.stages == 1 and (cfg.staging == "global" if streamed
                                      else stages_in_smem(cfg, staged_bytes_per_col))
    if not (placed and cfg.rows_per_block == 1 and cfg.register_chunks == 0
            and cfg.l2_prefetch == 0 and whole_vectors(cfg, elem_bytes)):
        return None
    return dataclasses.replace(cfg, n_cols=n_cols, row_shift=True)


# A shifted norm backward whose power-of-two share of the span leaves no room for its
# per-column sums beside the staged rows: LayerNorm bf16 262143 columns, whose span
# (262150 columns, 32769 vectors) is one vector past 16 CTAs x 2048, so the span's share
# (15 CTAs of 18432 columns, 14 bytes a column with the sums and the weight) did not fit
# and the unshifted one read 2 bytes an access (18.2% of the copy ceiling on the H100,
# torch.compile 33.7%).
# Instead: SPAN_SUMS_CHUNKS vectors a thread on CTAs of as many whole warps as the span
# needs (11 at 262143: 16896 columns, 198 KiB with the sums in shared memory), the weight
# read from global memory and spliced to each row's shift (NormBackward: the weight is
# staged only where it fits). Six chunks: 11 warps, at most 3 a scheduler, so 168
# registers a thread (five: 13 warps at 128 registers spilled 8 bytes, sm_90a). H100,
# kernels alone (results/norm_backward_span_sums_H100_20261206.txt): bf16 512x262143
# 17.9 -> 36.4% of the copy ceiling, fp16 19.1 -> 37.1, bf16 256x290817 (12 warps) 3.9 ->
# 34.3; 1.12x torch.compile in the runner (it lost at 0.54x). One CTA an SM, one
# staging buffer: far from the 79% of 262144 columns' double-buffered share. With a
# residual's gradients too (its 8-byte spill gone with shift_order_keeps_class_sizes):
# bf16 512x262143 25.1 -> 44.8%, 256x290817 6.0 -> 45.8
# (results/norm_backward_kept_sizes_H100_20261206.txt).
SPAN_SUMS_CHUNKS = 6
# (only spans past the largest such power-of-two share: shorter rows keep their shares;
# and only CTAs of at most 3 warps a scheduler: 14-18 warps, 96-128 registers, spilled
# 8-16 bytes at 327K-442K columns)
SPAN_SUMS_MIN_VECTORS = MAX_CLUSTER_SIZE * 2048
SPAN_SUMS_MAX_THREADS = 3 * 4 * 32


def shifted_span(n_cols: int, elem_bytes: int) -> int:
    """Columns of the aligned span a shifted row of ``n_cols`` columns is read over:
    up to a vector less one before the row, rounded up to whole 16-byte vectors."""
    per_access = ACCESS_BYTES // elem_bytes
    return -(-(n_cols + per_access - 1) // per_access) * per_access


def _shiftable_odd_rows(n_cols: int, elem_bytes: int) -> bool:
    """Whether rows of ``n_cols`` ``elem_bytes``-byte values are the odd 16-bit rows that
    shifting serves (one-value vectors otherwise)."""
    return elem_bytes == 2 and vector_width(n_cols, elem_bytes) == 1


def shifted_sums_share(n_cols: int, elem_bytes: int) -> RowConfig | None:
    """The shifted share above of odd ``elem_bytes``-byte rows of ``n_cols`` columns
    (one vector a chunk, SPAN_SUMS_CHUNKS chunks, a full cluster); None for other rows,
    spans of SPAN_SUMS_MIN_VECTORS or fewer, and spans needing CTAs past
    SPAN_SUMS_MAX_THREADS (whether it fits SMEM_BYTES_PER_CTA: the caller checks)."""
    if not _shiftable_odd_rows(n_cols, elem_bytes):
        return None
    per_access = ACCESS_BYTES // elem_bytes
    vectors = shifted_span(n_cols, elem_bytes) // per_access
    if vectors <= SPAN_SUMS_MIN_VECTORS:
        return None
    warp_vectors = 32 * SPAN_SUMS_CHUNKS
    threads = 32 * -(-vectors // (MAX_CLUSTER_SIZE * warp_vectors))
    if threads > SPAN_SUMS_MAX_THREADS:
        return None
    return RowConfig(n_cols=n_cols, vec=per_access, threads_per_row=threads, rows_per_block=1,
                     cluster_size=-(-vectors // (threads * SPAN_SUMS_CHUNKS)), vecs_per_thread=1,
                     num_chunks=SPAN_SUMS_CHUNKS, staging="smem", row_shift=True)


# The shifts a 16-bit row may have: 0-7 values past a 16-byte boundary.
SHIFT_CLASSES = ACCESS_BYTES // 2


# A shifted norm backward's order (rows.ShiftClassOrder.keep) keeps its class sizes in
# shared memory on shares of one staging buffer there: computed from the row count they
# were hoisted out of the loop over classes and spilled 8 bytes at 262143 columns with a
# residual's gradients (sm_90a: LayerNorm without sums at 128 registers, RMSNorm with
# dweight at 255), and LayerNorm's span share (shifted_sums_share) with those gradients
# spilled too. Not on one-chunk register shares: read from shared memory there they
# cost the LayerNorm backward 10-15 points (H100, kernels alone, results/norm_backward_
# kept_sizes_H100_20261206.txt: fp16 4096x32001 83.0 -> 70.2%, bf16 4096x50257 77.1 ->
# 62.6; RMSNorm within a point); on single-buffered shares they stayed level (bf16
# 512x262143 with a residual's gradients: RMSNorm 58.8 -> 58.9, LayerNorm 36.5 -> 36.8
# without; 1024x131073 RMSNorm 60.5 -> 60.3). Double-buffered shares in shared memory
# (no sums; LayerNorm 131073) keep the computed sizes: they do not spill, and only
# 131073 was measured (level).
def shift_order_keeps_class_sizes(cfg: RowConfig) -> bool:
    return cfg.row_shift and cfg.staging == "smem" and cfg.stages == 1


def splices_shifted_columns(column_bytes: int) -> bool:
    """Whether a norm forward's per-column vector (weight, bias) of ``column_bytes``-byte
    values beside shifted rows (16-bit: SHIFT_CLASSES values a vector) is spliced to
    each row's shift from whole 16-byte vectors in registers
    (RowTiles.shifted_column_values; its base on 16 bytes): where a vector of it is 16
    bytes. A wider one (an fp32 weight beside bf16 rows: 32-byte vectors, whose second
    half may lie wholly past the vector's allocation) is staged in shared memory value
    by value (RowTiles.stage_shifted_columns; any alignment)."""
    return column_bytes * SHIFT_CLASSES == ACCESS_BYTES


# The loss alone of shifted odd 16-bit rows without softcap or label smoothing (the -inf
# its loads fill outside the row masks the max and the sum of exp, not their terms:
# kernels.cross_entropy, streams_shifted) streams the span's streamed loss share (one
# CTA a row or two) from this many columns, like the aligned rows of 128 KiB and more.
# H200, kernels alone, % of the copy ceiling, the gradient's staged share of the span ->
# streamed (results/cross_entropy_shifted_loss_streamed_H200_20261205.txt): bf16
# 8192x16385 59.2 -> 75.1, 4096x50257 64.7 -> 71.9, 2048x100001 67.0 -> 73.6, 1024x131073
# 66.3 -> 71.2, 512x262143 63.9 -> 75.1; fp16 4096x32001 83.3 -> 89.1. Shorter rows take
# the gradient's share where it stages the span (not measured).
SHIFTED_STREAMED_LOSS_MIN_COLS = 16 * 1024


def _narrow_row_off_registers(n_cols: int, elem_bytes: int, clustered: RowConfig) -> bool:
    """Whether ``clustered`` is a share of odd 16-bit rows (one-value vectors) that does
    not hold them in registers (staged in shared memory, or re-read from global
    memory)."""
    return elem_bytes == 2 and vector_width(n_cols, elem_bytes) == 1 \
        and clustered.staging != "registers"


def register_share(n_cols: int, elem_bytes: int, threads: int, values: int, *,
                   bytes_per_col: int, max_vec: int | None = None) -> RowConfig:
    """One chunk of ``values`` values per thread of ``threads``-thread CTAs, as many CTAs
    as the row needs (a cluster of up to MAX_CLUSTER_SIZE)."""
    vec = vector_width(n_cols, elem_bytes, max_vec)
    vectors = math.ceil(n_cols / vec)
    vecs_per_thread = max(1, values // vec)
    cluster = math.ceil(vectors / (threads * vecs_per_thread))
    if cluster > MAX_CLUSTER_SIZE:
        raise ValueError(f"{n_cols} columns need {cluster} CTAs of {threads} threads")
    return _split_share(n_cols, vec, cluster, math.ceil(vectors / cluster), vecs_per_thread,
                        threads, bytes_per_col=bytes_per_col,
                        min_threads_per_block=MIN_THREADS_PER_BLOCK,
                        min_vecs_per_thread=MIN_VECS_PER_THREAD)


# Per-column fp32 sums (a norm backward's dweight / dbias) stay in registers across row
# blocks for a one-chunk share; a share of several chunks keeps them in shared memory,
# which at 16-CTA clusters of 256-KiB-and-up rows holds a CTA to one per SM and leaves
# no room for a second staging buffer (ncu, LayerNorm backward bf16 512x262144: 199 KB
# of shared memory, 128 of them the sums, 8 warps per SM). For those rows the backward
# takes SUM_THREADS_PER_ROW threads per row, so that each thread's sums fit in
# REGISTER_SUM_VALUES registers per accumulator, where that keeps more row blocks in
# flight per SM (norm_backward_clustered_share; in practice one CTA per SM that gains the
# prefetch: 16-bit rows of 160000+ columns, fp32 ones of 100000+). H200, same session
# (kernel_ab_norm_backward_register_sums_H200_20261130.txt, run 2): bf16 512x262144
# RMSNorm 52.1% -> 57.3% of the copy ceiling, LayerNorm 38.9% -> 46.9%. Multi-chunk
# sums in registers at 256 threads lost where they changed the CTAs per SM
# (2048x65536: bf16 LayerNorm 42.2% -> 30.8%, fp32 RMSNorm 82.6% -> 72.3%) and also
# where they did not (bf16 RMSNorm 65.3% -> 49.7%), and the wide share without a
# prefetch lost too (fp32 512x262144 RMSNorm 72.5% -> 70.3%).
REGISTER_SUM_VALUES = 32
SUM_THREADS_PER_ROW = 512


def sums_in_registers(cfg: RowConfig) -> bool:
    """Whether a looping kernel keeps its per-column sums in registers: one chunk, or a
    SUM_THREADS_PER_ROW share of at most REGISTER_SUM_VALUES per thread (not of
    one-value vectors, whose predicate per value spilled LayerNorm 65537 bf16)."""
    return cfg.num_chunks == 1 or (
        cfg.threads_per_row >= SUM_THREADS_PER_ROW and cfg.vec > 1
        and cfg.thread_values <= REGISTER_SUM_VALUES)


# A per-column vector read for every row block (a norm backward's weight) is staged once
# per CTA in shared memory, where it fits, (1) where a single CTA per SM is resident:
# there nothing hides the latency of a global load per row block; (2) for LayerNorm
# wherever it costs no resident CTA. H200, kernels alone: staged everywhere
# (kernel_ab_norm_backward_staged_weight_H200_20261130.txt), bf16 512x262144 (one CTA)
# RMSNorm 53.8% -> 65.3% of the copy ceiling, LayerNorm 46.2% -> 54.1%; with more CTAs
# per SM RMSNorm lost at 7 of 8 shapes (bf16 32768x4096 88.2% -> 68.3%). LayerNorm under
# this rule (kernel_ab_norm_backward_stats_prefetch_H200_20261130.txt, run 1, _tree_ln):
# bf16 32768x4096 70.5% -> 74.5%, 8192x16384 56.3% -> 58.0%, 2048x65536 42.2% -> 44.9%,
# fp32 8192x16384 79.0% -> 78.1%. Its largest gain staged everywhere, fp32 2048x65536
# 59.7% -> 70.5%, came where staging costs a CTA (2 -> 1), which the rule leaves out:
# not yet measured on its own.
def stage_columns_once(ctas_per_sm_without: int, ctas_per_sm_with: int, smem_bytes_with: int,
                       rms: bool) -> bool:
    if smem_bytes_with > SMEM_BYTES_PER_CTA:
        return False
    return ctas_per_sm_without == 1 or (not rms and ctas_per_sm_with == ctas_per_sm_without)


# A norm backward's per-row statistics (rstd, mean) are loaded during the row block before
# (row_stats_a_block_ahead says where in it), for LayerNorm everywhere and for RMSNorm
# where one CTA per SM is resident. ncu had their load at the block's start as the largest
# stall (the L1TEX scoreboard, 37-58% of stall cycles). H200, kernels alone
# (kernel_ab_norm_backward_stats_prefetch_H200_20261130.txt, loaded then after the block's
# row sums): LayerNorm bf16 32768x4096 74.5% -> 85.8% of the copy ceiling, 131072x1024
# 80.0% -> 89.4%, fp32 8192x16384 78.1% -> 86.2%; RMSNorm bf16 512x262144 (one CTA) 65.0%
# -> 76.5%, but at 2-6 CTAs per SM it lost 1-7 points (bf16 131072x1024 94.9% -> 88.1%),
# where other CTAs hide the load. Issued as the block before begins instead (ncu had the
# select of the loaded rstd waiting for it before the dx store): LayerNorm bf16 32768x4096
# 86.1% -> 90.9%, fp32 8192x16384 88.7% -> 92.3%
# (kernel_ab_fenced_residency_H200_20261202.txt).
def prefetch_row_stats(rms: bool, ctas_per_sm: int) -> bool:
    return not rms or ctas_per_sm == 1


# The softmax forward merges (max, sum of exp) across lanes in two phases, the max first
# (reduce.OnlineSoftmax), where the row waits in shared memory; a row kept in registers is
# live across the reduction, and the two phases' extra values took fp32 rows of 8K-64K
# columns from 32 to 33-36 registers (8 to 6 CTAs per SM, 2-7 points lost).
def softmax_merges_max_first(cfg: RowConfig) -> bool:
    return cfg.staging != "registers"


# LayerNorm's forward reduces once, each thread's (count, mean, centered sum of squares)
# merged, for rows of x alone split over a cluster and not kept in registers: one
# cluster exchange per row instead of two (the sum, then the centered sum of squares).
# H200 sweep (kernel alone, benchmarks/sweep_norm_forward.py --norm layer, results/
# norm_forward_layer_moments_sweep_H200_20261130.txt): bf16 2048x65536 78.3% -> 82.0% of
# the copy ceiling, 512x262144 71.3% -> 73.3%, fp32 2048x65536 89.3% -> 90.9%, 512x262144
# 55.4% -> 63.2%; rows one CTA holds lost 2-5 points (8192x16384 bf16 90.5% -> 88.5%) and
# rows with a residual were mixed (2048x65536 bf16 83.6% -> 79.3%). Shares kept in
# registers lost in the same sweep (fp32 2048x65536 78.1% -> 71.5%, bf16 8192x16384 75.5%
# -> 70.5%), and fp32 8192x16384, a 2-CTA registers share by default, ran at 80.7% against
# 93.2% with two reductions (results/norm_forward_layer_sweep_H200_20261130.txt), so they
# reduce twice.
def layer_norm_reduces_once(cfg: RowConfig, rms: bool, has_residual: bool) -> bool:
    return not rms and not has_residual and cfg.cluster_size > 1 and cfg.staging != "registers"


# Registers per thread of a norm backward's looping grid (its default: LOOP_REGS_PER_THREAD).
# 16-bit rows with per-column sums holding more than 8 values per thread of each tensor
# (two 16-byte vectors, norm_backward_share): at the default 80 they spilled 8-120 bytes
# (sm_90a resource report), at 96 LayerNorm's rows of up to 1024 columns still did.
# Without sums the same threads fit 80.
NORM_BACKWARD_WIDE_LOOP_REGISTERS = 104
# fp32 rows (h and dy) with per-column sums over a full cluster of 128-thread CTAs
# (16384 columns, 12288 too): eight CTAs per SM instead of six, at the 56-64 registers
# these kernels take anyway. H200, kernel alone (results/kernel_ab_loop_registers_H200_
# 20261202.txt): RMSNorm fp32 8192x16384 92.2% -> 97.6% of the copy ceiling, LayerNorm
# 87.1% -> 90.2%; with 4 CTAs per row (fp32 4096) or none (1024) within -1.7..+1.2
# points, and bf16 LayerNorm on 8-CTA clusters of 256 threads lost 6. Mixed dtypes and
# frozen weights on such clusters were not measured.
NORM_BACKWARD_FULL_CLUSTER_LOOP_REGISTERS = 64


def norm_backward_loop_registers(cfg: RowConfig, h_bits: int, dy_bits: int,
                                 accumulators: int) -> int:
    """Registers per thread a norm backward's looping grid is sized for (see above)."""
    if accumulators and h_bits == 16 and cfg.thread_values_per_chunk > 8:
        return NORM_BACKWARD_WIDE_LOOP_REGISTERS
    if cluster_class(cfg) == MAX_CLUSTER_SIZE and cfg.threads_per_block == 128 \
            and h_bits == dy_bits == 32 and accumulators:
        return NORM_BACKWARD_FULL_CLUSTER_LOOP_REGISTERS
    return LOOP_REGS_PER_THREAD


# The LayerNorm backward's dh = rstd * (g - xhat * c1 - c2) in two FMAs a value: 16-bit
# rows on 512-thread CTAs, where its loop was issue-bound (bf16 2048x65536 70.6% ->
# 74.6% of the copy ceiling with xhat as one FMA too, results/norm_backward_fewer_
# instructions_H200_20261203.txt). xhat stays (h - mean) * rstd: as h * rstd - mean *
# rstd it erred by |mean| * rstd * 2^-24 (fp16 rows of mean 1e4, std 1: dweight 20% off
# in an fp64 emulation). At the 128-register edge the form spilled elsewhere (sm_90a,
# 8-32 bytes: fp32 and 16-bit LayerNorm of 256 and 1024 columns with a residual
# gradient).
def norm_backward_fma_form(cfg: RowConfig, rms: bool, h_bits: int, dy_bits: int) -> bool:
    return not rms and h_bits == dy_bits == 16 and cfg.threads_per_block == REGISTER_SHARE_THREADS


# The weight (+ offset) loaded once into registers before the loop over row blocks, by a
# share of one chunk in registers (the same columns in every block): saves each value's
# weight load and the add of the offset. The FMA form's 16-bit LayerNorm only, the one
# measured to gain: H200, kernel alone, against the same code with the weight read per
# block (results/norm_backward_fewer_instructions_H200_20261203.txt): bf16 2048x65536
# 74.6% -> 79.4% of the copy ceiling, 4096x32768 82.6 -> 83.4, 8192x16384 87.1 -> 88.5;
# it lost on RMSNorm bf16 32768x4096 (87.7 -> 69.3) and LayerNorm fp32 2048x65536 (95.7 ->
# 86.8); on CTAs other than 512 threads it spilled (sm_90a: short rows' smaller CTAs,
# fp16 256 and 1024 columns; RMSNorm bf16 65536 on 1024 threads, 64 registers a thread).
def norm_backward_holds_weight(cfg: RowConfig, fma_form: bool) -> bool:
    return fma_form and cfg.staging == "registers" and cfg.num_chunks == 1


# RMSNorm's dh pass on double-buffered shares re-reads h and dy from the stage unmasked
# (its stores past the row end and M are predicated off) and takes dh = g * rstd - h *
# (c1 * rstd^2), a multiply a value fewer than through xhat. H200, kernel alone, against
# the masked xhat pass (results/norm_backward_unmasked_pass_H200_20261204.txt): RMSNorm
# fp16 512x262144 68.1% -> 88.2% of the copy ceiling (91.0 with its rows read unmasked
# too, NormBackward._masks_rows), bf16 87.8 -> 89.5. The masked pass branched around each
# chunk's reads, which then came chunk by chunk between the stores. Not taken where it
# lost: RMSNorm fp32 262144 (single-buffered, 76.9 -> 73.2) and LayerNorm bf16 / fp16
# 262144 (66.0 -> 65.3, 64.8 -> 63.8); nor on one-value vectors (odd bf16 rows of
# 32001-100001 columns spilled 144-272 bytes, sm_90a).
def norm_backward_rereads_unmasked(cfg: RowConfig, rms: bool) -> bool:
    return rms and cfg.staging != "registers" and cfg.stages == 2 and cfg.vec > 1


# A single-buffered shared-memory share loads each chunk of the next row block as soon
# as the norm backward's dh pass has read it (RowTiles.refill_chunk), instead of the
# whole block at the next iteration's start: the next block's bytes are in flight while
# this one's later chunks are computed and stored (fp32 262144 columns: two buffers do
# not fit). H200, kernels alone: LayerNorm fp32 512x262144 68.4 -> 89.6% of the copy
# ceiling, RMSNorm fp32 1024x131073 48.3 -> 58.9, 640x200000 62.1 -> 83.7 (at 512x262144
# on 256 threads 77.2 -> 76.7, but 90.4 on the 512 of ops.norm's wider share). Not
# RMSNorm's plain-load (2-byte) vectors, which cp.async cannot copy (fp16 131073 columns
# spilled 16 bytes; bf16 gained 1.8 points); its 4-byte fp32 ones (the 131073 above) do
# refill.
def norm_backward_refills_chunks(cfg: RowConfig, rms: bool, plain_loads: bool) -> bool:
    return cfg.staging == "smem" and cfg.stages == 1 and not (rms and plain_loads)


# Warp partials a CTA sends its peers in one cluster exchange (warps_per_row x
# cluster_size, one packet between SMs each) from which a looping kernel merges its
# warps first (merges_cta_first).
MIN_PACKETS_TO_MERGE_CTA_FIRST = 256


def merges_cta_first(cfg: RowConfig, buffers: int) -> bool:
    """Whether a cluster reduction merges the CTA's warps before the exchange (a block
    barrier, then one store a peer from the row's first warp) instead of sending every
    warp's partial to every peer: for kernels looping over row blocks (``buffers`` 2)
    on at least MIN_PACKETS_TO_MERGE_CTA_FIRST packets, one CTA per SM on long rows
    where nothing hides the exchange. H200, kernel alone (results/
    cluster_exchange_cta_first_H200_20261204.txt), 16-CTA clusters of 16 warps:
    LayerNorm bwd bf16 512x262144 69.4% -> 78.7% of the copy ceiling, fp16 66.9 ->
    73.6, RMSNorm bf16 89.3 -> 91.5, fp32 LayerNorm 68.3 -> 68.1; at 128 packets no
    gain (RMSNorm bf16 2048x65536 93.2 -> 92.4, LayerNorm 83.0 -> 82.9, fp32
    512x262144 76.3 -> 76.3); the one-block kernels were within a point except the
    softmax forward bf16 512x262144, which lost 2.1."""
    return buffers == 2 and cfg.cluster_size > 1 and cfg.warps_per_row > 1 \
        and cfg.warps_per_row * cfg.cluster_size >= MIN_PACKETS_TO_MERGE_CTA_FIRST


# Prefetched row statistics are loaded as the block before begins (beside its staged
# loads of the next rows where there are two buffers) for blocks of one row; blocks of
# several rows load them once the block's row sums are in, as before: loaded early, the
# statistics live through the whole block, and LayerNorm fp32 of 256 columns (4 rows per
# block, 80 registers) spilled 8 bytes (sm_90a report).
def row_stats_a_block_ahead(cfg: RowConfig) -> bool:
    return cfg.rows_per_block == 1


# Per-column sums in shared memory with a second staging buffer: prefetch paid where
# two CTAs per SM stayed resident (fp32 2048x65536 RMSNorm 65% -> 83%, bf16 2048x65536
# in 64-KiB shares 60% -> 67%) and lost at one (bf16 512x262144 53% -> 47%).
MIN_PREFETCH_CTAS_WITH_SMEM_SUMS = 2


def with_prefetch(cfg: RowConfig, kernel_for) -> RowConfig:
    """A looping kernel's config with two staging buffers (each CTA loads its next row
    block while it reduces and stores the current one) when they fit and keep at least
    as many row blocks in flight per SM as one buffer does: resident CTAs x stages.
    ``kernel_for(config)`` builds the kernel (a RowKernel: shared memory, CTAs per SM).

    Not for rows re-read from global memory (nothing staged), nor for kernels keeping
    per-column sums in shared memory (not sums_in_registers) that would be left with
    fewer than MIN_PREFETCH_CTAS_WITH_SMEM_SUMS CTAs per SM. H200 sweep of the
    RMSNorm backward with dweight (benchmarks/sweep_norm_backward.py): one-chunk shares
    (sums in registers) gained (32768x4096 bf16 67% -> 90% of the copy ceiling,
    8192x16384 58% -> 72%); the cross-entropy forward (no sums) gained with several
    chunks too (8192x16384 bf16 with the gradient 72% -> 75%)."""
    if cfg.staging == "global":
        return cfg
    double = dataclasses.replace(cfg, stages=2)
    kernel = kernel_for(double)
    if kernel.accumulators and not kernel.sums_in_registers \
            and kernel.ctas_per_sm() < MIN_PREFETCH_CTAS_WITH_SMEM_SUMS:
        return cfg
    if kernel.smem_bytes() > SMEM_BYTES_PER_CTA:
        return cfg
    if row_blocks_in_flight(double, kernel_for) >= row_blocks_in_flight(cfg, kernel_for):
        return double
    return cfg


# A looping norm backward left with one staging buffer (with_prefetch took no second)
# asks L2 for its next row block's rows once its own have landed (RowConfig.l2_prefetch,
# RowTiles.prefetch_ahead): they arrive while it reduces and stores, and its next loads
# hit L2. H200, kernels alone, A B B A (results/kernel_ab_l2_prefetch_H200_20261202.txt),
# % of the copy ceiling: RMSNorm fp32 512x262144 72.8 -> 77.6, 1024x131072 66.1 -> 77.6,
# 1024x98304 67.2 -> 76.4, bf16 512x196608 48.7 -> 59.2; LayerNorm fp32 1024x98304 59.2
# -> 71.9, bf16 1024x131072 41.2 -> 46.0. Not for rows re-read from global memory: their
# second pass reads from L2 what the prefetch evicts (sweep: LayerNorm fp32 512x262144
# 47.9 -> 45.5). One-block kernels asking for a later CTA's rows were mixed (softmax
# 128x1048576 forward bf16 +0.6 points, fp32 -9, backward -7 to -10; LayerNorm forward
# bf16 512x262144 +2-3, fp32 -2 to -14): rows in flight and prefetched outgrow L2.
# Vectors narrowed by a wider weight or output (bf16 rows with an fp32 weight) go
# without: not measured.
# (Whole ACCESS_BYTES vectors of every staged tensor only: a bulk prefetch starts and ends
# on 16 bytes.) With two staging buffers, ``past_two_buffers`` asks for the block after
# the one the second buffer loads (norm_backward_prefetches_past_buffers,
# ce_prefetches_past_buffers).
def with_l2_prefetch(cfg: RowConfig, *staged_elem_bytes: int,
                     past_two_buffers: bool = False) -> RowConfig:
    whole = all(whole_vectors(cfg, elem_bytes) for elem_bytes in staged_elem_bytes)
    if whole and cfg.staging != "global" and (cfg.stages == 1 or past_two_buffers):
        return dataclasses.replace(cfg, l2_prefetch=1)
    return cfg


# A looping norm backward with two staging buffers and its per-column sums in shared
# memory asks L2 for the row block after the second buffer's. H200, kernels alone, the
# op's own config with and without, timed in turn twice
# (results/kernel_ab_l2_prefetch_past_buffers_H200_20261202.txt), % of the copy ceiling:
# RMSNorm bf16 8192x16384 77.4 -> 84.1, 2048x65536 66.3 -> 71.8, 4096x32768 69.3 -> 75.7,
# fp32 2048x65536 83.5 -> 92.4; LayerNorm bf16 2048x65536 45.5 -> 46.9, fp32 2048x65536
# 59.8 -> 69.5. Where the sums stay in registers it lost with several CTAs per SM (RMSNorm
# bf16 32768x4096 89.8 -> 82.9, fp32 8192x16384 96.7 -> 91.0), was level or gained about
# a point at 3-4 (LayerNorm bf16 8192x16384, 32768x4096) and split at one (bf16
# 512x262144: LayerNorm +2.6, RMSNorm -1.1). Asking two iterations past the buffers gained
# less than one (LayerNorm bf16 2048x65536: the same) or lost.
def norm_backward_prefetches_past_buffers(cfg: RowConfig, accumulators: int) -> bool:
    return accumulators > 0 and not sums_in_registers(cfg)


# The looping cross-entropy forward with the gradient, fp32 logits, two staging buffers:
# the same ask of L2 (same file): fp32 131072x1024 91.5 -> 93.0, 32768x4096 88.5 -> 94.4;
# bf16 was level or lost (131072x1024 85.7 -> 86.2, 32768x4096 89.2 -> 88.2, 8192x16384
# 88.9 -> 88.4), and two iterations ahead lost 7-16 points everywhere. Only the shares
# measured: one chunk and at most two rows per block (shorter rows, many rows' small
# prefetches per block, and two-chunk shares were not timed); not rows with a partial
# last vector group (fp32 1000 columns with label smoothing spilled 8 bytes at its 96
# registers); not a staged weight row (not measured; it is one row broadcast to all).
def ce_prefetches_past_buffers(cfg: RowConfig, elem_bytes: int, stage_weight: bool) -> bool:
    return elem_bytes == 4 and cfg.stages == 2 and not cfg.needs_col_predicate \
        and cfg.num_chunks == 1 and cfg.rows_per_block <= 2 and not stage_weight


def row_blocks_in_flight(cfg: RowConfig, kernel_for) -> int:
    """Row blocks a looping kernel keeps in flight per SM: resident CTAs x stages
    (``kernel_for`` as in with_prefetch)."""
    return kernel_for(cfg).ctas_per_sm() * cfg.stages


def norm_backward_clustered_share(n_cols: int, widest: int, staged: int, accumulators: int,
                                  bytes_per_col: int, max_vec: int | None,
                                  cta_row_bytes: int | None, values_per_thread: int | None,
                                  max_threads_per_row: int | None, kernel_for) -> RowConfig:
    """A norm backward's share of ``n_cols`` columns (ops.norm.backward_config) from
    norm_backward_share (or a sweep's limits), with its staging buffers (``kernel_for``
    as in with_prefetch); SUM_THREADS_PER_ROW threads where that keeps the per-column
    sums in registers (see REGISTER_SUM_VALUES)."""
    tuned_bytes, vectors = norm_backward_share(staged, accumulators, n_cols)
    if cta_row_bytes is None:
        cta_row_bytes = tuned_bytes
    if values_per_thread is None and vectors is not None:
        # 16-byte vectors of the staged dtype: a wider weight or output (fp32 with bf16
        # rows) narrows the accesses, not the values a thread holds
        values_per_thread = vectors * (16 // staged) * (2 + accumulators)
    share = functools.partial(
        row_config, n_cols, widest, staged_tensors=2 + accumulators,
        bytes_per_col=bytes_per_col, max_vec=max_vec,
        looping=True, cta_row_bytes=cta_row_bytes, values_per_thread=values_per_thread)
    cfg = share(max_threads_per_row=max_threads_per_row)
    # sized for the largest variant (LayerNorm: two values per reduction)
    prefetched = with_prefetch(cfg, kernel_for)
    if max_threads_per_row is None and accumulators and not sums_in_registers(cfg):
        wider = share(max_threads_per_row=SUM_THREADS_PER_ROW)
        # (not for shares re-read from global memory, nor rows alone in shared memory
        # with a predicated tail: fp32 LayerNorm of 200000 columns spilled at the 128
        # registers a 512-thread CTA can have, 16 bytes with the residual gradient)
        if sums_in_registers(wider) and not wider.needs_col_predicate:
            wider = rows_alone_in_smem(wider, bytes_per_col - 4 * accumulators)
        if sums_in_registers(wider) and wider.staging != "global":
            wider = with_prefetch(wider, kernel_for)
            more_in_flight = row_blocks_in_flight(wider, kernel_for) \
                - row_blocks_in_flight(prefetched, kernel_for)
            # Two single-buffered shares both refill their chunks for the next block
            # (NormBackward.refills_chunks): at the same row blocks in flight the wider
            # one wins by keeping its sums in registers instead of shared memory.
            # RMSNorm fp32 512x262144 76.7% -> 90.4% of the copy ceiling (H200, kernel
            # alone). Not with a predicated tail (fp32 RMSNorm of 200000 columns spilled
            # 16 bytes).
            both_refill = wider.staging == prefetched.staging == "smem" \
                and wider.stages == prefetched.stages == 1 and not wider.needs_col_predicate
            if prefetched.staging == "global" or more_in_flight > 0 \
                    or (more_in_flight == 0 and both_refill):
                prefetched = wider
    return prefetched


# The fixed-order column sum of per-CTA partial rows (the norm backward's dweight /
# dbias, kernels/column_sum.py): 256 threads per CTA, each CTA owning a tile of
# columns. A tile is 8..128 columns wide: the widest that still yields about two CTAs
# per SM, so short rows get many row groups per column (loads in flight) and long rows
# few CTAs. 8 fp32 columns (32 bytes) keep every load a whole memory sector.
COLUMN_SUM_THREADS = 256
COLUMN_SUM_TARGET_CTAS = 264
COLUMN_SUM_TILES = (128, 64, 32, 16, 8)
# Each segment of a partial row (dweight | dbias) is padded to a multiple of 8
# columns: every segment then starts 32 bytes aligned, as the backward's widest fp32
# vector (8 values, one per 16-bit element of a 16-byte access) needs.
PARTIAL_COLUMN_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class ColumnSumConfig:
    n_cols: int
    segments: int  # sums per column (1: dweight or dbias, 2: both)
    padded: int  # columns per segment in a partial row
    cols_per_cta: int
    threads_per_block: int = COLUMN_SUM_THREADS
    cluster_size: int = 1
    staging: str = "registers"

    @property
    def width(self) -> int:
        return self.padded * self.segments


def column_sum_config(n_cols: int, segments: int) -> ColumnSumConfig:
    padded = -(-n_cols // PARTIAL_COLUMN_ALIGN) * PARTIAL_COLUMN_ALIGN
    width = padded * segments
    cols = next((c for c in COLUMN_SUM_TILES if width // c >= COLUMN_SUM_TARGET_CTAS),
                COLUMN_SUM_TILES[-1])
    return ColumnSumConfig(n_cols, segments, padded, cols)


# ------------------------------------------------------------------ cross-entropy
# The mean's denominator (kernels.mean_denominator): CTAs of MEAN_DENOMINATOR_THREADS
# threads, each with MEAN_TARGETS_IN_FLIGHT target loads issued before they are added,
# one round of loads per CTA up to MEAN_DENOMINATOR_MAX_CTAS. One CTA read the targets
# at 33-36 GB/s whatever its loads in flight (131072 int64 targets: 28.7 us, a sixth of
# the bf16 131072x1024 training step's kernels); a grid sums them as fast as the CTAs
# start. (8 loads in flight put a 64-bit value of the weighted variant on the stack
# once it ended in the grid sum; sm_90a, 32 registers.)
MEAN_DENOMINATOR_THREADS = 512
MEAN_TARGETS_IN_FLIGHT = 4
MEAN_DENOMINATOR_MAX_CTAS = 256


def mean_denominator_ctas(num_targets: int) -> int:
    """CTAs of the denominator's grid: one round of loads each up to the cap (more
    targets take more rounds), at least one CTA (it writes D for no targets too)."""
    per_cta = MEAN_DENOMINATOR_THREADS * MEAN_TARGETS_IN_FLIGHT
    return max(1, min(-(-num_targets // per_cta), MEAN_DENOMINATOR_MAX_CTAS))


@dataclasses.dataclass(frozen=True)
class MeanDenominatorConfig:
    weighted: bool
    threads_per_block: int = MEAN_DENOMINATOR_THREADS
    targets_in_flight: int = MEAN_TARGETS_IN_FLIGHT
    cluster_size: int = 1  # (fields the resource report prints)
    staging: str = "registers"


# Row bytes per CTA: 32 KiB halves the cluster of long 16-bit rows (131072 bf16 columns:
# 8 CTAs instead of 16, 57% vs 39% of the copy ceiling loss only, same sweep); the
# cross-entropy epilogue per row is longer than softmax's, so fewer, fuller CTAs win.
CE_CTA_ROW_BYTES = 32 * 1024
# ... and rows that would still take 16 CTAs run on 8 when each CTA's share stays within
# 40 KiB: 8192x151936 bf16 loss + gradient 48.9% -> 72.9% of the copy ceiling (16 x 18.5
# KiB -> 8 x 37 KiB; sweep_cross_entropy.py, results/cross_entropy_cluster_sweep_H200_
# 20261130.txt), as 4096x128256 bf16 (16 x 16 KiB 49.7%, 8 x 32 KiB 75.1%). Longer
# 8-CTA shares were not measured.
CE_NARROW_SHARE_BYTES = 40 * 1024
# ... and 4 vectors per thread before a short row takes more threads, fp32 rows too: the
# gradient lost with FP32_ROW_MIN_VECS_PER_THREAD's 2 (same A/B: fp32 131072x1024 91.4%
# -> 76.3%; with 2 for every dtype, bf16 32768x4096 86.6% -> 54.5%).
CE_MIN_VECS_PER_THREAD = MIN_VECS_PER_THREAD
# Row configs of the cross-entropy forward: the bounds above, and the threads per row
# it was measured with (GLOBAL_STAGED_THREADS_PER_ROW was measured on softmax).
_ce_row_config = functools.partial(row_config, cta_row_bytes=CE_CTA_ROW_BYTES,
                                   narrow_share_bytes=CE_NARROW_SHARE_BYTES,
                                   max_threads_per_row=MAX_THREADS_PER_ROW,
                                   min_vecs_per_thread=CE_MIN_VECS_PER_THREAD)
# The loss alone of rows of 128 KiB and more streams its shares (staged, they need 4+
# CTA clusters) of up to CE_STREAM_CTA_ROW_BYTES per CTA, each thread reading
# CE_STREAM_CHUNK_BYTES per chunk (four 16-byte vectors, as whole staged 16-bit chunks
# do). H200, bf16, timed as the runner times the loss (benchmarks/sweep_cross_entropy.py,
# results/cross_entropy_streamed_loss_sweep_H200_20261201.txt, two runs within 0.7%):
# 32 bytes a chunk and 256 KiB shares had given 2048x65536 (staged on 4 CTAs) 78.5%,
# 512x262144 80.1-80.4% and 8192x151936 87.7-88.2% (2 CTAs each); 64 bytes and 320 KiB
# give 85.1-85.4% (1 CTA), 87.0-87.3% (2 CTAs) and 94.4-94.5% (1 CTA, 297 KiB);
# 4096x128256 stays at 93.4-94.1% (1 CTA). (262144 columns on 1 CTA at 64 bytes fell to
# 74%: 512 CTAs of that share do not all fit at once.) fp32 chunks were 64 bytes already.
CE_STREAM_MIN_ROW_BYTES = 128 * 1024
CE_STREAM_CTA_ROW_BYTES = 320 * 1024
CE_STREAM_CHUNK_BYTES = 64
# Registers per thread of the plain streamed loss (z-loss at most) of 16-bit rows in
# whole chunks of whole 16-byte vectors: 4 CTAs of 256 threads per SM where the one-CTA
# shares took 80 (3 CTAs).
# H200, compare_trees --abba after a reading L2 flush, the loss alone / with its mean
# (results/cross_entropy_streamed_loss_registers_H200_20261204.txt): bf16 2048x65536
# 86.2 -> 90.4% / 81.7 -> 86.1%, 4096x65536 93.6 -> 98.6 / 89.7 -> 94.9, 1024x131072 88.5
# -> 92.7 / 86.1 -> 89.9, fp16 2048x65536 86.3 -> 90.9 / 81.4 -> 86.4; 512x262144 (2-CTA
# shares, 57 registers already) level.
# Not rows with a partial last chunk: at 64 registers bf16 128256 and 151936 (+4.7 /
# +4.2 points) spilled 8-64 bytes with int32 targets, 256000 40 bytes; nor fp32 (50257
# and 65536 spilled 16), nor other options (softcap with smoothing spilled 40-304), nor
# the narrower vectors of a misaligned tensor (bf16 65536 at 8, 4, 2 bytes: 16-40).
# Spread over 2-CTA clusters instead (64 KiB shares), 65536 columns ran slower than held.
STREAM_LOSS_REGISTERS = 64
# The loss alone of short rows: at least 8 vectors per thread in chunks of 4, at most
# 64 threads per row and 16 vectors per thread, blocks of at least 256 threads (H200
# sweeps, benchmarks/sweep_cross_entropy.py, results/cross_entropy_loss_sweep_H200_
# 20261130.txt). With the target set aside (kernels.cross_entropy): 131072x1024 bf16
# 84.9% of the copy ceiling (16 threads per row; 77.4% on 32), 32768x4096 bf16 85.7%
# (64; 78.9% on 32 threads in 128-thread blocks), 16384x8192 bf16 85.0%, fp32 92-97%.
# The default before (up to 256 threads, 4 vectors each): 60.1% and 60.3% bf16.
CE_LOSS_MAX_THREADS_PER_ROW = 64
CE_LOSS_MIN_VECS_PER_THREAD = 8
CE_LOSS_MAX_VECS_PER_THREAD = 16
CE_LOSS_VECS_PER_CHUNK = 4
CE_LOSS_MIN_THREADS_PER_BLOCK = 256

# The loss with its sum or mean, eagerly: the kernel adds the row losses over the grid
# (GridSum.grid_sum: CTA sums published without a fence, gathered by the last row
# block) instead of two launches after the kernel (a torch sum and a division), at any
# row count. The grid's last CTA taking a ticket after a fence in every CTA and reading
# every row's loss back had cost, kernels alone (results/kernel_ab_ce_reduced_H200_
# 20261130.txt), bf16 8192x16384 82.2 -> 89.3 us and 32768x4096 85.3 -> 98.4 us. Not
# with the weight row staged (class weights and label smoothing): with the epilogue
# those variants spilled 8-16 bytes (sm_90a, with the gradient: fp32 1000 and 50257
# columns, fp16 151936, two reloads inside the row-block loop; the loss alone: fp32
# 151936, a partial sum across the cluster reduction).
# CTA sums a thread of a gathering CTA loads at once (GridSum.grid_sum): 2 keep the
# gathering epilogue within the registers of the loss kernels it ends (sm_90a: with 8
# and a clamped address per slot the bf16 loss alone of short rows took 75-80 registers
# instead of 48; with 4, fp32 short rows 40 instead of 32 and the streamed bf16 loss of
# 128256 columns 56 instead of 44, one CTA per SM fewer).
GRID_SUM_SLOTS_IN_FLIGHT = 2
# At most this many CTAs of a grid_sum gather (and wait): the row blocks come in groups
# of at least one round of a gathering CTA's loads (threads x GRID_SUM_SLOTS_IN_FLIGHT).
# One gatherer for the whole grid took one L2 round trip per round (about 0.6 us; 16384
# CTAs cost 10 us).
GRID_SUM_GROUPS = 32


def grid_sum_slots(cfg, row_blocks, first_level: bool = False):
    """Slots (of GridSum.grid_sum's values) a launch of ``row_blocks`` CTAs (of
    ``cfg.threads_per_block`` threads) needs: one per CTA, then one per group, each
    level with room for the gathering CTA's loads past its last slot; ``first_level``:
    the first level's."""
    slack = cfg.threads_per_block * GRID_SUM_SLOTS_IN_FLIGHT
    first = row_blocks + slack
    return first if first_level else first + GRID_SUM_GROUPS + slack


def ce_reduces_in_kernel(num_rows: int, stage_weight: bool) -> bool:
    return num_rows > 0 and not stage_weight


def streamed_loss_row_config(n_cols: int, elem: int, max_vec: int | None = None) -> RowConfig:
    """The streamed loss alone (see CE_STREAM_CHUNK_BYTES): chunks of four whole 16-byte
    vectors per thread; narrower vectors (a misaligned or odd row) keep
    streamed_row_config's values per thread."""
    cfg = streamed_row_config(n_cols, elem, CE_STREAM_CTA_ROW_BYTES, max_vec,
                              values_per_thread=CE_STREAM_CHUNK_BYTES // elem)
    if whole_vectors(cfg, elem):
        return cfg
    return streamed_row_config(n_cols, elem, CE_STREAM_CTA_ROW_BYTES, max_vec)


def _short_loss_row_config(n_cols: int, elem: int, max_vec: int | None) -> RowConfig | None:
    """The loss-only config of a row short enough for CE_LOSS_MAX_THREADS_PER_ROW
    threads (see there), else None."""
    vec = vector_width(n_cols, elem, max_vec)
    vectors = math.ceil(n_cols / vec)
    if vectors > CE_LOSS_MAX_THREADS_PER_ROW * CE_LOSS_MAX_VECS_PER_THREAD:
        return None
    threads = min(CE_LOSS_MAX_THREADS_PER_ROW,
                  _next_pow2(math.ceil(vectors / CE_LOSS_MIN_VECS_PER_THREAD)))
    return _ce_row_config(n_cols, elem, max_vec=max_vec, max_threads_per_row=threads,
                          values_per_thread=CE_LOSS_VECS_PER_CHUNK * vec,
                          min_threads_per_block=CE_LOSS_MIN_THREADS_PER_BLOCK)


# With softcap the gradient pass needs every capped value again: re-capped from the staged
# logits it costs an ex2 and an rcp per value a second time (the SM's multi-function
# unit runs 16 per clock: at 6.5 per value it held the kernel near 0.41 clock per value
# per SM, the memory needs ~0.27). Rows a one-block share of at most KEPT_CAPPED_VALUES
# per thread in MAX_THREADS_PER_ROW threads can hold (clusters of up to 16 CTAs) keep
# the capped values in registers instead. H200, kernels alone, smoothing 0.1 + z-loss +
# softcap 30 (kernel_ab_cross_entropy_softcap_placeholders_H200_20261130.txt): bf16
# 4096x128256 48.5% -> 51.2% of the copy ceiling, 2048x65536 50.7% -> 54.2%, fp32
# 4096x128256 76.5% -> 82.3%. Shares of 512 threads (the 104 registers of the softcap
# gradient leave one such CTA per SM) lost: bf16 8192x151936 47.7% -> 25.8%, 512x262144
# 45.3% -> 25.6%; at 64 values per thread keeping them took 144 registers.
KEPT_CAPPED_VALUES = 32

# Softcaps up to this bound take s as every row's max (kernels.cross_entropy, fixed_max):
# capped logits lie in [-s, s], so exp(z - s) >= exp(-2 s) >= e^-80 ~ 1.8e-35 stays a
# normal fp32 (the exp2 flushes subnormals) and a row of C terms sums to at most C.
# Gemma's caps are 30 (final logits) and 50 (attention); larger ones keep the running max.
CE_FIXED_MAX_SOFTCAP = 40.0


def ce_fixed_max(softcap: float, cfg: RowConfig, stage_weight: bool, write_grad: bool) -> bool:
    """Whether the cross-entropy kernel on rows of config ``cfg`` takes the softcap (0:
    none) as the row max: with the gradient and for the streamed loss alone, of long rows
    and of odd 16-bit rows of 16K+ columns (odd_row_forward_share) (sm_90a: as many or
    fewer registers than the running max, 9-18% fewer instructions and MUFU); not with the
    weight row staged (that gradient kernel took 94 registers instead of 80, 2 instead of 3
    CTAs of 256 threads per SM at bf16 128256 columns), nor for the loss alone of short
    rows (fp32 32000 columns: 48 -> 64). The looping grid takes it too: its bf16 rows of
    16384 columns, which once spilled 8 bytes at 128 registers with it, no longer do, and
    take 2.1 fewer instructions and 0.36 fewer MUFU ops a value."""
    return caps_at_fixed_max(softcap, stage_weight) and (write_grad or cfg.staging == "global")


def caps_at_fixed_max(softcap: float, stage_weight: bool) -> bool:
    """Whether a softcap is one the kernel may take as its fixed max (ce_fixed_max: with
    the gradient always)."""
    return 0.0 < abs(softcap) <= CE_FIXED_MAX_SOFTCAP and not stage_weight


def holds_cap_shares(softcap: float, stage_weight: bool, write_grad: bool) -> bool:
    """Whether the cross-entropy forward with these options may hold long 16-bit rows in
    registers and stage their cap shares (HELD_SHARES_MIN_COLS): the gradient with a
    softcap taken as the fixed max."""
    return write_grad and caps_at_fixed_max(softcap, stage_weight)


# Registers per thread of the cross-entropy forward's looping grid: at 80, 16-bit rows of
# 1024 and 16384 columns spilled with the loss reduced in the kernel (and, below, fp16
# and ragged rows of the plain gradient); with softcap and the gradient, fp16 rows of
# 1000 columns spilled 8 bytes at 96.
CE_LOOP_REGISTERS = 96
# with softcap, or fp16 with label smoothing alone (its sum of z read apart: rows of 256
# columns spilled 40 bytes at 96; bf16 and fp32 did not)
CE_WIDE_GRAD_LOOP_REGISTERS = 104
# The plain per-row gradient (z-loss at most, no reduction over the rows) of rows one
# chunk holds, bf16 or held to two CTAs per SM by the default bound: one more CTA per SM
# (the kernel is latency-bound: ncu, benchmarks/NOTES.md, twenty-fifth session; bf16
# computes twice the values per byte of fp32). H200, kernel alone (results/kernel_ab_
# loop_registers_H200_20261202.txt): bf16 131072x1024 82.0% -> 85.6% of the copy
# ceiling, bf16 32768x4096 86.6% -> 89.2%, fp32 32768x4096 (2 -> 3 CTAs of 256 threads)
# 85.0% -> 88.7%; fp32 131072x1024 (5 -> 6) lost, 91.3% -> 90.3%, and seven CTAs (72
# registers) lost at bf16 4096. Not fp16 (its loss scale) nor ragged rows (their mask):
# they spilled 8-48 bytes at 80 (256-1024 columns); nor narrower accesses than 16 bytes
# (a misaligned row: not measured). Not the in-kernel sum or mean either: held to 80 it
# spilled until its epilogue was reworked, and the reworked training step replayed
# slower (bf16 131072x1024 161 -> 165 us).
CE_PLAIN_GRAD_LOOP_REGISTERS = 80
# Registers per thread the one-block shares of the fixed-max gradient are held to (4
# CTAs of 256 threads per SM): the kept values', and the 16-bit ones re-capped on the FMA
# pipe from shared memory where it leaves room for those 4 CTAs (kernels.cross_entropy;
# held cap shares take what their shared memory leaves, HELD_SHARES_MIN_COLS).
# Unbounded, fp32 rows of 128256 columns compiled to 80 (3 CTAs), the count at which
# the every-option kernel lost 8 points (fourteenth session), and bf16 rows of 151936
# (staged, before held shares) to 74.
CAPPED_GRAD_REGISTERS = 64


def _kept_values_row_config(n_cols: int, elem: int, max_vec: int | None) -> RowConfig | None:
    """The smallest cluster whose CTAs of MAX_THREADS_PER_ROW threads hold their share
    in one chunk of at most KEPT_CAPPED_VALUES per thread, or None; not for rows of
    one-element vectors (262143 bf16 columns compiled to 128 registers)."""
    cfg = _capped_grad_share(n_cols, elem, max_vec, KEPT_CAPPED_VALUES, KEPT_CAPPED_VALUES)
    return cfg if cfg is not None and cfg.staging == "registers" else None


def _capped_grad_share(n_cols: int, elem: int, max_vec: int | None, chunk_values: int,
                       thread_values: int, fewest_ctas: bool = False) -> RowConfig | None:
    """row_config's share of CTAs of MAX_THREADS_PER_ROW threads in chunks of
    ``chunk_values`` on the smallest cluster (wide_clusters; ``fewest_ctas``: of any
    size) whose CTAs hold at most ``thread_values`` a thread, for the softcapped
    gradient's kept and held shares; None for rows of one-element vectors."""
    if vector_width(n_cols, elem, max_vec) == 1:
        return None
    return row_config(n_cols, elem, max_vec=max_vec, values_per_thread=chunk_values,
                      min_vecs_per_thread=CE_MIN_VECS_PER_THREAD,
                      max_threads_per_row=MAX_THREADS_PER_ROW,
                      cta_row_bytes=MAX_THREADS_PER_ROW * thread_values * elem,
                      wide_clusters=True, fewest_ctas=fewest_ctas)


# The gradient of 16-bit rows of HELD_SHARES_MIN_COLS+ columns with a softcap the kernel
# takes as its fixed max: the logits are loaded straight into registers, at most
# HELD_CAP_SHARE_VALUES a thread in chunks of 16, and their cap shares r (fp32) are staged
# in shared memory for the gradient pass (kernels.cross_entropy, stages_cap_shares): the
# shared memory a staged row's logits took holds r instead, so the gradient pass neither
# caps again (4.2 instead of 5.2 multi-function-unit ops a value) nor holds r in
# registers (kept rows: 32 values a thread over twice the CTAs). H100, bf16, every
# option but class weights (results/cross_entropy_held_shares_H100_20261207.txt), % of
# the copy ceiling, kernels alone: 2048x65536 83.7 -> 85.3, 4096x128256 82.0 -> 84.7,
# 8192x151936 78.8 -> 80.0 (13-CTA clusters of 48 values, 4 CTAs per SM; 10 of 64 at 3
# per SM lost: 72.3), 512x262144 75.1 -> 78.1 (3 CTAs per SM at 80 registers); the step
# (runner, in-kernel mean) 81.5 -> 81.9, 78.4 -> 85.5, 75.8 -> 80.2, 70.4 -> 75.6. Not
# measured below 65536 columns (kept rows there); 4096x100000 level (74.2 -> 73.6).
HELD_SHARES_MIN_COLS = 65536
HELD_CAP_SHARE_VALUES = 64


# A held row stages the cap shares of at most this many bytes a CTA; the chunks past them
# (its last) keep their shares in registers for the gradient pass, so that 4 CTAs of
# CAPPED_GRAD_REGISTERS fit an SM where every chunk's shares (64 KiB at 64 values a
# thread) left room for 3 at 80 registers. With 4 per SM the fewest CTAs of 64 values
# (any cluster size) beat 48 values on more: 151936 on 10, not 13. H100, kernels alone
# as above (results/cross_entropy_held_recap_H100_20261207.txt): 2048x65536 85.7 -> 87.7,
# 4096x128256 84.9 -> 89.7, 512x262144 78.4 -> 82.9 (28 resident 16-CTA clusters, not
# 21), 8192x151936 80.3 -> 82.8 (10 CTAs; 80.3 on 13 at 4 per SM).
HELD_STAGED_SHARE_BYTES = 48 * 1024
# A held row's first pass takes the cap reciprocal of every HELD_FMA_CAP_STRIDE-th chunk
# on the FMA pipe (CrossEntropyForward.caps_on_fma), the others on the multi-function
# unit: sm_90a SASS of the bf16 every-option kernel, 64 values a thread, MUFU 267 -> 235
# a thread, 2032 -> 2224 instructions. H100, kernels alone, % of the copy ceiling
# (results/cross_entropy_held_fma_cap_H100_20261207.txt, chunks 1 and 3 then):
# 8192x151936 82.6 -> 84.1, 4096x128256 89.5 -> 90.1, 2048x65536 87.6 -> 88.0,
# 512x262144 82.5 -> 82.7. Every chunk (stride 1: MUFU 203, an 8-byte spill at 262144)
# lost 262144 (79.8). Then chunks 0 and 2, with the sum terms of 1 and 3 on the FMA pipe
# too in unpadded rows (sums_on_fma: MUFU 203, 2480 instructions at 262144, no spill;
# chunks 1 and 3 with sums of 0 and 2 spilled 40 bytes): 8192x151936 84.1 -> 85.0,
# 512x262144 82.5 -> 82.9, 2048x65536 88.1 -> 87.3 (results/cross_entropy_held_fma_exp_
# H100_20261207.txt).
HELD_FMA_CAP_STRIDE = 2


def staged_share_chunks(cfg: RowConfig) -> int:
    """How many of a held row's chunks (_held_shares_row_config: every chunk in
    registers) stage their cap shares (the first ones): those within
    HELD_STAGED_SHARE_BYTES, at least one."""
    chunk_bytes = 4 * cfg.thread_values_per_chunk * cfg.threads_per_block
    return max(1, min(cfg.num_chunks, HELD_STAGED_SHARE_BYTES // chunk_bytes))


def _held_shares_row_config(n_cols: int, elem: int, max_vec: int | None) -> RowConfig | None:
    """The smallest cluster, of any size, whose CTAs of MAX_THREADS_PER_ROW threads hold
    at most HELD_CAP_SHARE_VALUES values a thread in chunks of 16, every chunk held in
    registers (see HELD_SHARES_MIN_COLS), or None."""
    cfg = _capped_grad_share(n_cols, elem, max_vec, 16, HELD_CAP_SHARE_VALUES,
                             fewest_ctas=True) if elem == 2 else None
    if cfg is None or cfg.staging != "smem" or cfg.thread_values > HELD_CAP_SHARE_VALUES:
        return None
    return dataclasses.replace(cfg, register_chunks=cfg.num_chunks)


def cross_entropy_row_config(n_cols: int, elem: int, stage_weight: bool, write_grad: bool,
                             max_vec: int | None = None, softcap: bool = False,
                             held_shares: bool = False) -> RowConfig:
    """Row config of the cross-entropy forward (before prefetch sizing): logits are the
    one staged row tensor; with weighted label smoothing the fp32 weight row is staged
    beside them, so accesses are sized for fp32 (4 elements). The loss alone of long
    rows is streamed, not staged, and of short rows spread thin (CE_LOSS_*). The
    gradient with softcap keeps the capped values in registers where a share of
    KEPT_CAPPED_VALUES can hold them (rows of the looping grid too where that takes a
    cluster), and with ``held_shares`` (holds_cap_shares) holds long 16-bit rows'
    logits in registers and stages their cap shares (HELD_SHARES_MIN_COLS). The loss
    alone of odd 16-bit rows (no weight row) streams odd_row_forward_share's shares."""
    cfg = _clustered_ce_row_config(n_cols, elem, stage_weight, write_grad, max_vec, softcap,
                                   held_shares)
    if stage_weight or write_grad:
        return cfg
    share = functools.partial(row_config, n_cols, elem, max_vec=max_vec,
                              min_vecs_per_thread=CE_MIN_VECS_PER_THREAD)
    return odd_row_forward_share(share, cfg, elem, "streamed") or cfg


def _clustered_ce_row_config(n_cols: int, elem: int, stage_weight: bool, write_grad: bool,
                             max_vec: int | None, softcap: bool, held_shares: bool) -> RowConfig:
    """cross_entropy_row_config without its odd-row rule (see there)."""
    assert not held_shares or (softcap and write_grad and not stage_weight), \
        "held cap shares: the softcapped gradient without the weight row (holds_cap_shares)"
    if not write_grad and not stage_weight:
        if n_cols * elem >= CE_STREAM_MIN_ROW_BYTES:
            return streamed_loss_row_config(n_cols, elem, max_vec)
        short = _short_loss_row_config(n_cols, elem, max_vec)
        if short is not None:
            return short
    if stage_weight:
        return _ce_row_config(n_cols, 4, staged_tensors=2, bytes_per_col=elem + 4,
                              max_vec=max_vec)
    held = held_shares and n_cols >= HELD_SHARES_MIN_COLS \
        and _held_shares_row_config(n_cols, elem, max_vec)
    if held:
        return held
    # H200 sweeps (benchmarks/sweep_cross_entropy.py): 16 values per thread, in more and
    # smaller shared-memory chunks for rows split over a cluster (fp32 131072: 66% vs
    # 59% at 32 values, loss only), but 32 for 16-bit rows that fit one chunk of 32
    # values (4096 bf16 columns: 58% vs 41%: twice the bytes in flight per thread), with
    # the gradient in one looping CTA (8192x16384 bf16: 78% vs 67%; 32 values spilled in
    # other gradient shares), and for the loss alone of staged shares in whole 16-byte
    # vectors and whole chunks (results/cross_entropy_loss_chunk_bytes_H200_20261130.txt,
    # bf16: 8192x16384 83.4% -> 86.7%, 2048x65536 78.1% -> 81.2%, 4096x32768 83.4% ->
    # 86.0%). Shares with a partial last chunk (32000) were not measured apart from
    # run-order noise and keep 16; streamed shares were mixed (512x262144 71% -> 79%,
    # 128x524288 61% -> 53.5%) and keep 16 too.
    cfg = _ce_row_config(n_cols, elem, max_vec=max_vec, values_per_thread=16)
    if elem < 4:
        roomy = _ce_row_config(n_cols, elem, max_vec=max_vec, values_per_thread=32)
        whole_chunks_read = not write_grad and roomy.staging == "smem" \
            and whole_vectors(roomy, elem) and not roomy.needs_col_predicate
        if roomy.staging == "registers" or loops_over_row_blocks(roomy, write_grad) \
                or whole_chunks_read:
            cfg = roomy
    if softcap and write_grad and cfg.staging != "registers":
        kept = _kept_values_row_config(n_cols, elem, max_vec)
        # (the looping grid's one-CTA rows where the kept share needs a cluster)
        if kept is not None \
                and (kept.cluster_size > 1 or not loops_over_row_blocks(cfg, write_grad)):
            cfg = kept
    return cfg


# Linear + cross-entropy (ops.linear_cross_entropy): rows go through the LM head in
# chunks so that the (M, V) logits never exist whole. A chunk's logits take about as
# much memory as the hidden states they come from (M x H, so the loss adds about one
# activation's worth), with at least LINEAR_CE_MIN_CHUNK_ROWS rows; the rows split
# evenly (no short last chunk), each chunk at least that size. The floor is set by the
# weight's gradient: every chunk reads and writes it whole (V H elements) for 6 rows
# V H flops of GEMMs, a share of the step that depends only on the rows per chunk.
# H200, bf16, mean (results/linear_cross_entropy_chunk_sweep_H200_20261201.txt):
# 1024 rows 3-14% slower than one chunk (8192x4096x128256 42.7 ms, 4096x4096x32000
# 6.3 against 5.5), 2048 within 0-3% (41.3, 5.7), for 0.5 GB more chunk logits at
# V = 128256.
LINEAR_CE_MIN_CHUNK_ROWS = 2048


def linear_ce_chunk_rows(num_rows: int, hidden_size: int, vocab: int) -> int:
    """Rows per chunk of a linear + cross-entropy over ``num_rows`` rows (see above)."""
    if num_rows == 0:
        return 1
    wanted = max(LINEAR_CE_MIN_CHUNK_ROWS, math.ceil(num_rows * hidden_size / max(vocab, 1)))
    chunks = max(1, num_rows // wanted)
    return math.ceil(num_rows / chunks)


# The head's gradient sums over the chunks in the head's dtype by default, as Liger
# does: fp32 takes a weight-sized fp32 buffer (2 GiB at 128256 x 4096, the peak from
# 2.0 to 3.0 GiB) and 3-19% more time on the H200 (results/linear_cross_entropy_*.csv:
# the most where the GEMMs are smallest), for one rounding instead of one per chunk.
# fp16 sums in fp32 by default: its gradients are then computed in the forward, for
# the summed losses (ops.linear_cross_entropy), where a 16-bit sum makes the chunks run
# again in the backward (H200: 1.32-1.36x torch.compile's step).
def linear_ce_grad_accum_dtype(dtype):
    import torch

    return torch.float32 if ce_gradient_in_backward(dtype) else dtype


# Training losses compute their gradient in the forward pass, for the upstream gradient
# a plain backward() gives, except for fp16: a loss scaler's factor must reach the
# gradient before it is rounded to fp16, or its small values are lost (rescaled after
# the rounding: 2.0e-3 off fp64 in norm at 2048 x 8192 and a factor of 1024, 2.1e-4
# computed in the backward), so fp16 logits get theirs in the backward.
def ce_gradient_in_backward(dtype) -> bool:
    import torch

    return dtype == torch.float16
