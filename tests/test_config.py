"""The tiling heuristics: invariants that every kernel relies on."""

import dataclasses
import itertools

import pytest
import torch

from quack_kernels.primitives import config
from quack_kernels.primitives.config import (
    MAX_CLUSTER_SIZE,
    STAGING_SMEM_BYTES,
    VALUES_PER_THREAD,
    row_config,
    vector_width,
)

NS = [1, 2, 3, 7, 8, 64, 100, 769, 1000, 1024, 4096, 4097, 32000, 50257, 65536, 131073, 262144,
      524287, 524288, 800000, 1 << 20]


def test_vector_width_is_16_bytes_when_n_allows():
    assert vector_width(4096, 2) == 8 and vector_width(4096, 4) == 4
    assert vector_width(1000, 2) == 8 and vector_width(1002, 2) == 2 and vector_width(1001, 4) == 1
    assert vector_width(4096, 2, max_vec=2) == 2


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize("staged", [1, 2])
def test_config_invariants(n, elem_bytes, staged):
    cfg = row_config(n, elem_bytes, staged)
    assert n % cfg.vec == 0 and cfg.vec * elem_bytes <= 16
    assert cfg.cols_covered >= n  # the grid covers the row
    assert cfg.cols_covered - n < cfg.cols_per_chunk * cfg.cluster_size  # and no whole chunk idles
    assert cfg.threads_per_row & (cfg.threads_per_row - 1) == 0
    assert 1 <= cfg.cluster_size <= MAX_CLUSTER_SIZE
    assert cfg.threads_per_block <= 1024
    if cfg.staging == "smem":
        assert cfg.staging_smem_bytes(elem_bytes * staged) <= STAGING_SMEM_BYTES
        if cfg.num_chunks > config.MAX_CHUNKS_PER_SHARE:  # fewer chunks would not fit
            values = cfg.vec * cfg.vecs_per_thread * staged
            assert row_config(n, elem_bytes, staged, values_per_thread=2 * values).staging != "smem"
    # more values per thread than tuned only where they keep a share within its chunks
    values = cfg.vec * cfg.vecs_per_thread * staged
    assert values <= max(VALUES_PER_THREAD[elem_bytes], cfg.vec * staged) or (
        cfg.staging == "smem" and cfg.num_chunks > config.MAX_CHUNKS_PER_SHARE // 2)
    assert (cfg.num_chunks == 1) == (cfg.staging == "registers")


def test_cluster_grows_with_n_and_only_when_needed():
    sizes = [row_config(n, 2).cluster_size for n in (4096, 16384, 32768, 65536, 131072, 262144)]
    assert sizes == sorted(sizes) and sizes[0] == 1 and sizes[-1] == 16


def test_wide_cluster_shares_move_to_eight_ctas_unless_looping():
    def cluster(row_bytes, **kw):
        return config.cluster_size_for(row_bytes, config.CTA_ROW_BYTES, **kw)

    assert cluster((131072 + 1024) * 4) == 16  # 16 x 32.25 KiB: not measured
    assert cluster(262144 * 4) == 8  # 16 x 64 KiB -> 8 x 128 KiB
    assert cluster(262145 * 4) == 16  # 8 x (128 KiB + 4 B): not measured
    assert cluster(262144 * 4, looping=True) == 16
    assert cluster(262144 * 2) == 16  # 32-KiB shares stay on 16
    assert cluster(262144 * 8) == 16  # 8 x 256 KiB would not fit
    assert row_config(262144, 4).cluster_size == 8
    assert row_config(1 << 20, 2).cluster_size == 16


@pytest.mark.parametrize("looping", [False, True])
@pytest.mark.parametrize("elem_bytes", [2, 4])
def test_no_cta_of_a_cluster_is_past_the_row_end(elem_bytes, looping):
    """A share rounded up to whole threads and chunks keeps only the CTAs the row needs:
    every CTA of the cluster starts inside the row (49152 bf16 columns in 16 shares of
    4096 had left 4 empty), and the row stays covered."""
    narrowed = 0
    for n in [*range(1000, 300000, 997), 12288, 49152, 98304, 151936, 196608]:
        cfg = row_config(n, elem_bytes, 2, looping=looping)
        assert cfg.cols_covered >= n > cfg.cols_covered - cfg.cols_per_cta, (n, cfg)
        narrowed += cfg.cluster_size & (cfg.cluster_size - 1) != 0  # not a power of two
    assert narrowed  # the rule had CTAs to drop


def test_softmax_holds_a_chunk_in_registers_where_two_ctas_then_fit():
    """config.with_held_chunk: the fewest chunks held that leave room for two CTAs per
    SM, or one replacing a forward re-read from global memory; not on the forward's
    16-CTA clusters, nor for shares already small."""
    from quack_kernels.ops.softmax import backward_config, forward_config

    def held(config_for, n, dtype):
        cfg = config_for(n, dtype, log=False) if config_for is backward_config \
            else config_for(n, dtype)
        return cfg.staging, cfg.register_chunks

    assert held(forward_config, 262144, torch.float32) == ("smem", 1)  # 128 -> 96 KiB
    assert held(backward_config, 262144, torch.float32) == ("smem", 1)  # y, dy: 128 -> 96
    assert held(forward_config, 1 << 20, torch.float32) == ("smem", 1)  # 192 KiB staged
    assert held(forward_config, 1 << 20, torch.bfloat16) == ("smem", 0)  # 16 CTAs, forward
    assert held(forward_config, 524288, torch.float32) == ("smem", 0)  # 16 CTAs, forward
    assert held(backward_config, 131072, torch.float32) == ("smem", 1)  # 8 CTAs
    assert held(backward_config, 262144, torch.bfloat16) == ("smem", 2)  # 128 -> 96 KiB
    assert held(forward_config, 262144, torch.bfloat16) == ("smem", 0)  # 32-KiB shares
    assert held(forward_config, 131072, torch.float32) == ("registers", 0)
    assert held(forward_config, 1 << 21, torch.float32) == ("global", 0)  # 448 KiB left
    for n, dtype in ((262144, torch.float32), (1 << 20, torch.float32)):
        cfg = forward_config(n, dtype)
        assert cfg.staging_smem_bytes(4) == cfg.cols_per_chunk * (cfg.num_chunks - 1) * 4
        assert cfg.vec * cfg.vecs_per_thread * 4 <= config.HELD_CHUNK_BYTES_PER_THREAD
    cfg = backward_config(262144, torch.bfloat16, log=False)  # y, dy: 2 x 64 bytes a thread
    assert 2 * cfg.vec * cfg.vecs_per_thread * 4 <= config.HELD_CHUNK_BYTES_PER_THREAD
    assert cfg.staging_smem_bytes(4) <= config.TWO_CTA_STAGING_BYTES


def test_staging_paths_for_large_rows():
    assert row_config(4096, 2).staging == "registers"
    assert row_config(1 << 20, 2).staging == "smem"  # 128 KiB per CTA of 16
    assert row_config(1 << 20, 4).staging == "global"  # 256 KiB per CTA: re-read


def test_long_shares_take_more_values_not_more_chunks():
    # 262144 bf16 y and dy on 8 CTAs: 16 chunks of one vector per tensor -> 8 of two
    share = row_config(262144, 2, 2)
    assert (share.cluster_size, share.num_chunks, share.vecs_per_thread) == (8, 8, 2)
    assert share.cols_covered == 262144
    assert row_config(1 << 20, 2).num_chunks == config.MAX_CHUNKS_PER_SHARE
    # explicit values per thread and looping kernels keep their shares as asked
    assert row_config(262144, 2, 2, values_per_thread=16).num_chunks == 16
    assert row_config(262144, 2, 2, looping=True).vecs_per_thread == 1
    assert row_config(65536, 2, 2).vecs_per_thread == 1  # 2 chunks: unchanged


def test_narrow_share_bound_halves_sixteen_cta_clusters():
    row = 151936 * 2  # 16 shares of 18.5 KiB
    assert config.cluster_size_for(row, 32 * 1024) == 16
    assert config.cluster_size_for(row, 32 * 1024, narrow_share_bytes=40 * 1024) == 8
    assert config.cluster_size_for(row, 32 * 1024, looping=True, narrow_share_bytes=40 * 1024) == 16
    # the wide-share rule still applies next to it
    assert config.cluster_size_for(1 << 20, 16 * 1024, narrow_share_bytes=40 * 1024) == 8
    assert config.cluster_size_for(2 << 20, 16 * 1024, narrow_share_bytes=40 * 1024) == 16


def test_rows_reread_from_global_memory_take_more_threads():
    reread = row_config(1 << 20, 4)
    assert reread.threads_per_row == config.GLOBAL_STAGED_THREADS_PER_ROW
    assert reread.cols_covered == 1 << 20
    staged = row_config(1 << 20, 2)  # 128 KiB per CTA fits shared memory
    assert staged.threads_per_row == config.MAX_THREADS_PER_ROW
    assert row_config(1 << 20, 4, looping=True).threads_per_row == config.MAX_THREADS_PER_ROW
    assert row_config(1 << 20, 4, max_threads_per_row=128).threads_per_row == 128
    # the streamed loss keeps the threads it was measured with
    assert config.streamed_row_config(1 << 19, 2, 256 * 1024).threads_per_row == config.MAX_THREADS_PER_ROW


def test_short_fp32_rows_take_threads_before_vectors():
    """One fp32 tensor staged alone spreads to 2 vectors per thread
    (FP32_ROW_MIN_VECS_PER_THREAD) before rows share a block; the cross-entropy gradient,
    the looping kernels and everything else keep MIN_VECS_PER_THREAD."""
    cfg = row_config(1024, 4)
    assert (cfg.threads_per_row, cfg.vecs_per_thread, cfg.rows_per_block) == (128, 2, 1)
    assert row_config(1024, 4, min_vecs_per_thread=4).threads_per_row == 64
    assert row_config(1024, 4, looping=True).threads_per_row == 64  # looping kernels keep 4
    grad = config.cross_entropy_row_config(1024, 4, stage_weight=False, write_grad=True)
    assert grad.vecs_per_thread >= config.CE_MIN_VECS_PER_THREAD
    # 16-bit rows reach VALUES_PER_THREAD first: unchanged by the minimum
    assert row_config(4096, 2) == row_config(4096, 2, min_vecs_per_thread=4)
    # not for 16-bit rows read at fp32 width, two staged tensors, or the cross-entropy's
    # elementwise rescale
    assert row_config(1024, 4, bytes_per_col=2).threads_per_row == 64
    assert row_config(1024, 4, staged_tensors=2).threads_per_row == 64
    assert config.elementwise_row_config(1024, 4).threads_per_row == 64


def test_fp32_rows_of_4096_columns_take_512_threads():
    """FP32_ROW_THREADS_PER_ROW threads for an fp32 row alone on one CTA that they hold in
    exactly FP32_ROW_MIN_VECS_PER_THREAD whole 16-byte vectors each; idle vectors (2560
    columns), more vectors (8192), a cluster, narrower vectors, explicit limits, a looping
    kernel or two staged tensors keep 256."""
    fp32_row_share = row_config(4096, 4)
    assert (fp32_row_share.threads_per_row, fp32_row_share.vecs_per_thread,
            fp32_row_share.cluster_size) == (512, 2, 1)
    assert fp32_row_share.staging == "registers" and fp32_row_share.rows_per_block == 1
    for n in (2560, 4000, 8192):
        assert row_config(n, 4, cta_row_bytes=32 * 1024).threads_per_row == 256, n
    two_ctas = row_config(8192, 4)  # 1024 vectors a CTA, but over a cluster
    assert (two_ctas.cluster_size, two_ctas.threads_per_row) == (2, 256)
    # narrower vectors (misaligned rows), and callers choosing their own limits
    assert row_config(2048, 4, max_vec=2).threads_per_row == 256
    assert row_config(4096, 4, min_vecs_per_thread=2).threads_per_row == 256
    assert row_config(4096, 4, values_per_thread=8).threads_per_row == 256
    assert row_config(4096, 4, looping=True).threads_per_row == 256
    assert row_config(4096, 4, staged_tensors=2, cta_row_bytes=32 * 1024).threads_per_row == 256
    assert row_config(4096, 4, max_threads_per_row=256).threads_per_row == 256
    assert row_config(4096, 2).threads_per_row == 256  # 16-bit rows


def test_norm_forward_loads_columns_early_where_measured():
    """config.norm_forward_early_columns: RMSNorm, or LayerNorm's registers shares over
    a cluster; not h kept in registers with its residual, nor shares too wide to hold
    the weight through the row."""
    from quack_kernels.ops.norm import forward_config

    def early(n, rms, dtype, residual=False):
        cfg = forward_config(n, rms, dtype, dtype, residual, dtype, dtype, None if rms else dtype)
        staged = 1 + residual
        return config.norm_forward_early_columns(rms, staged, staged * dtype.itemsize, cfg)

    assert early(262144, True, torch.float32) and early(65536, True, torch.bfloat16)
    # a LayerNorm share kept in registers (of x alone such shares are staged instead:
    # config.staged_layer_norm_share)
    assert early(65536, False, torch.float32, residual=True)
    assert not early(65536, False, torch.bfloat16)  # ... staged in shared memory
    assert early(4096, True, torch.float32)  # one CTA holds the row: RMSNorm only
    assert not early(4096, False, torch.float32) and not early(1024, False, torch.bfloat16)
    assert early(65536, True, torch.bfloat16, residual=True)
    assert not early(262144, True, torch.bfloat16, residual=True)  # h kept in registers
    assert not early(1 << 20, True, torch.float32)  # re-read from global memory
    # more than EARLY_COLUMN_VALUES per thread held through the row (spilled at 1.1M)
    assert early(400000, True, torch.bfloat16) and not early(524288, True, torch.bfloat16)
    assert not early(1100000, True, torch.bfloat16)


def test_norm_forward_late_columns_where_measured():
    """config.norm_forward_columns_before_reduction: fp32 rows kept in registers with
    their residual; config.late_columns_together: output-pass columns of at most
    LATE_COLUMNS_TOGETHER_VALUES per thread and chunk."""
    from quack_kernels.ops.norm import forward_config

    def share(n, rms, dtype, residual):
        cfg = forward_config(n, rms, dtype, dtype, residual, dtype, dtype, None if rms else dtype)
        staged = 1 + residual
        return cfg, config.norm_forward_columns_before_reduction(staged, staged * dtype.itemsize, cfg)

    for rms in (True, False):
        cfg, before = share(262144, rms, torch.float32, True)
        assert cfg.staging == "registers" and before
        # shorter fp32 shares hold fewer values and would lose a CTA per SM
        assert not share(131073, rms, torch.float32, True)[1]
        assert not share(196608, rms, torch.float32, True)[1]
        cfg, before = share(262144, rms, torch.bfloat16, True)
        assert cfg.staging == "registers" and not before
        assert not config.late_columns_together(cfg)  # 64 values a thread
        assert not share(262144, rms, torch.float32, False)[1]  # x alone
        assert not share(65536, rms, torch.float32, True)[1]  # staged pair under 1 MiB
    # LayerNorm of x alone in shared memory: chunks together (fp32 ones cut to
    # LAYER_NORM_LONG_ROW_VALUES so that they are), a residual's register share not
    assert config.late_columns_together(share(262144, False, torch.bfloat16, False)[0])
    assert config.late_columns_together(share(262144, False, torch.float32, False)[0])
    assert not config.late_columns_together(share(131073, False, torch.float32, True)[0])


def test_layer_norm_registers_shares_over_a_cluster_are_staged():
    """config.staged_layer_norm_share: LayerNorm of x alone over a cluster of 4+ CTAs
    takes LAYER_NORM_STAGED_VALUES per thread for its cluster size, in shared memory,
    where it would be a registers share of whole vectors; 2-CTA clusters, narrower
    vectors and RMSNorm keep theirs."""
    from quack_kernels.ops.norm import forward_config

    def share(n, rms=False, dtype=torch.float32, max_vec=None):
        return forward_config(n, rms, dtype, dtype, False, dtype, dtype,
                              None if rms else dtype, max_vec)

    for n, cluster, values in ((32768, 4, 16), (65536, 8, 8), (131072, 16, 8)):
        cfg = share(n)
        assert cfg.staging == "smem" and cfg.cluster_size == cluster
        assert cfg.thread_values_per_chunk == values
        assert share(n, rms=True).staging == "registers"
    cfg = share(16384)  # 2-CTA clusters lost with the staged share
    assert cfg.staging == "registers" and cfg.cluster_size == 2
    assert share(65536, max_vec=2).staging == "registers"  # misaligned: not measured
    assert share(65537).staging == "registers"  # one-value vectors on 16 CTAs


def test_layer_norm_one_cta_shares_of_many_values_take_two_ctas():
    """config.staged_layer_norm_share: a one-CTA registers share of LayerNorm of x alone
    holding more than LAYER_NORM_ONE_CTA_MAX_VALUES per thread (fp32 rows of 7K-8K
    columns) is split over two CTAs of 16-KiB shares, as RMSNorm's; 28 values, narrower
    vectors and 16-bit rows keep one CTA."""
    from quack_kernels.ops.norm import forward_config

    def share(n, rms=False, dtype=torch.float32, max_vec=None):
        return forward_config(n, rms, dtype, dtype, False, dtype, dtype,
                              None if rms else dtype, max_vec)

    for n in (8000, 8192):  # 32 values on one CTA (8000: the last vectors idle)
        cfg = share(n)
        assert cfg.cluster_size == 2 and cfg.staging == "registers"
        assert cfg.thread_values_per_chunk <= config.LAYER_NORM_ONE_CTA_MAX_VALUES
        one_cta = row_config(n, 4, cta_row_bytes=config.LAYER_NORM_CTA_ROW_BYTES)
        assert one_cta.cluster_size == 1
        assert one_cta.thread_values_per_chunk > config.LAYER_NORM_ONE_CTA_MAX_VALUES
        assert share(n, rms=True) == cfg  # RMSNorm's 16-KiB share
    assert share(7168).cluster_size == 1  # 28 values: one CTA won
    assert share(8192, max_vec=2).cluster_size == 1  # misaligned: not measured
    assert share(8192, dtype=torch.bfloat16).cluster_size == 1


def test_rejects_empty_rows():
    with pytest.raises(ValueError):
        row_config(0, 2)


def test_loop_grid_fills_the_gpu_once():
    """The looping grid never asks for more CTAs than fit at once (a second wave would
    run mostly idle), and uses more than two per SM when they fit."""
    small = config.row_config(4096, 2, staged_tensors=3, bytes_per_col=8)
    ctas = config.loop_ctas_per_sm(small, 8 * 1024)
    assert ctas > 2
    assert config.loop_ctas_per_sm(small, 150 * 1024) == 1
    assert config.loop_ctas_per_sm(small, 8 * 1024, regs_per_thread=255) == 1
    assert config.loop_grid_rows(small, 1 << 20, 100) == 100  # never more than resident
    assert config.loop_grid_rows(small, 3, 100) == 3  # never more blocks than rows


class _StagingOnlyKernel:
    """Stands in for a RowKernel whose shared memory is its staged rows alone."""

    def __init__(self, cfg, bytes_per_col, accumulators=0):
        self.cfg, self.bytes_per_col, self.accumulators = cfg, bytes_per_col, accumulators
        self.sums_in_registers = config.sums_in_registers(cfg)

    def smem_bytes(self):
        return self.cfg.staging_smem_bytes(self.bytes_per_col)

    def ctas_per_sm(self):
        return config.loop_ctas_per_sm(self.cfg, self.smem_bytes())


@pytest.mark.parametrize("vec, threads, vecs_per_thread, chunks, in_registers", [
    (8, 256, 2, 1, True),     # one chunk per thread: always registers
    (8, 256, 2, 2, False),    # several chunks at the default threads: shared memory
    (8, 512, 2, 2, True),     # several chunks at SUM_THREADS_PER_ROW, 32 values each
    (4, 512, 2, 8, False),    # 64 values each: over REGISTER_SUM_VALUES
    (1, 512, 8, 2, False),    # one-value vectors: shared memory
])
def test_sums_in_registers(vec, threads, vecs_per_thread, chunks, in_registers):
    cfg = config.RowConfig(n_cols=vec * threads * vecs_per_thread * chunks * 16, vec=vec,
                           threads_per_row=threads, rows_per_block=1, cluster_size=16,
                           vecs_per_thread=vecs_per_thread, num_chunks=chunks,
                           staging="smem", stages=1)
    assert config.sums_in_registers(cfg) == in_registers


@pytest.mark.parametrize("n, bytes_per_col, values_per_thread, accumulators, stages", [
    (8192, 4, 64, 0, 2),    # one chunk of 32 KiB: 3 CTAs per SM with one buffer or two
    (8192, 8, 64, 0, 1),    # one chunk of 64 KiB: 3 CTAs x 1 buffer > 1 CTA x 2 buffers
    (8192, 16, 64, 0, 1),   # one chunk of 128 KiB: a second buffer does not fit
    (4096, 4, 16, 0, 2),    # two shared-memory chunks, no per-column sums
    (4096, 4, 16, 1, 2),    # two chunks with per-column sums in shared memory, and
                            # still many CTAs per SM with two buffers
    (4096, 24, 16, 0, 2),   # 96 KiB: 2 CTAs x 1 buffer = 1 CTA x 2 buffers
    (4096, 24, 16, 1, 1),   # the same with sums in shared memory: not at one CTA per SM
    (8192, 4, 64, 1, 2),    # one chunk: the sums live in registers
])
def test_prefetch_only_when_it_keeps_more_blocks_in_flight(
        n, bytes_per_col, values_per_thread, accumulators, stages):
    cfg = config.row_config(n, 2, staged_tensors=2, bytes_per_col=bytes_per_col,
                            values_per_thread=values_per_thread, cta_row_bytes=1 << 20)
    chosen = config.with_prefetch(
        cfg, lambda c: _StagingOnlyKernel(c, bytes_per_col, accumulators))
    assert chosen.stages == stages
    assert dataclasses.replace(chosen, stages=1) == cfg


def test_resident_row_blocks_takes_the_drivers_cluster_bound(monkeypatch):
    """A looping grid of clusters is sized by what the driver places at once (GPCs bound
    16-CTA clusters below SMs / 16), of single CTAs by the SM count alone."""
    import torch

    from quack_kernels.ops import common

    monkeypatch.setattr(common, "num_sms", lambda device: 132)
    asked = []
    monkeypatch.setattr(common, "resident_clusters",
                        lambda index, cluster, threads, smem: asked.append(smem) or 7)

    class Looping:
        def __init__(self, cfg):
            self.cfg = cfg

        def ctas_per_sm(self):
            return 1

        def launch_smem_bytes(self):
            return 130 * 1024

    cuda = torch.device("cuda", 0)
    clustered = config.row_config(262144, 2, staged_tensors=2, looping=True)
    assert clustered.cluster_size == 16
    assert common.resident_row_blocks(Looping(clustered), cuda) == 7  # not 132 // 16 = 8
    assert asked == [130 * 1024]  # asked with the shared memory the launch requests
    single = config.row_config(1024, 2)
    assert single.cluster_size == 1
    assert common.resident_row_blocks(Looping(single), cuda) == 132


@pytest.mark.parametrize("n", [1, 7, 8, 1000, 4096, 4097, 65536, 262144])
@pytest.mark.parametrize("segments", [1, 2])
def test_column_sum_tiles(n, segments):
    cfg = config.column_sum_config(n, segments)
    # segments start 32 bytes apart at least (the backward's widest fp32 vector)
    assert cfg.padded % config.PARTIAL_COLUMN_ALIGN == 0 and n <= cfg.padded < n + 8
    assert cfg.width == cfg.padded * segments
    assert cfg.cols_per_cta in config.COLUMN_SUM_TILES
    ctas = -(-cfg.width // cfg.cols_per_cta)
    # the widest tile that still gives ~2 CTAs per SM; the narrowest when none does
    wider = [c for c in config.COLUMN_SUM_TILES if c > cfg.cols_per_cta]
    assert all(cfg.width // c < config.COLUMN_SUM_TARGET_CTAS for c in wider)
    assert ctas >= config.COLUMN_SUM_TARGET_CTAS or cfg.cols_per_cta == min(config.COLUMN_SUM_TILES)


def test_layer_norm_forward_of_x_alone_takes_wider_shares():
    """Two reductions per row (LayerNorm) without a residual: 32-KiB CTA shares, half
    the cluster of the default; RMSNorm and rows with a residual keep the default."""
    from quack_kernels.ops import norm as norm_ops

    bf16 = torch.bfloat16
    layer = norm_ops.forward_config(16384, False, bf16, bf16, False, bf16, bf16, bf16)
    rms = norm_ops.forward_config(16384, True, bf16, bf16, False, bf16, bf16)
    layer_res = norm_ops.forward_config(16384, False, bf16, bf16, True, bf16, bf16, bf16)
    assert (layer.cluster_size, rms.cluster_size) == (1, 2)
    assert layer.cols_per_cta * 2 == 32 * 1024
    assert layer_res.cluster_size == norm_ops.forward_config(
        16384, True, bf16, bf16, True, bf16, bf16).cluster_size
    # rows up to 16 KiB are the same either way; the capped 16-CTA rows share their
    # cluster and CTA share, RMSNorm's in chunks of WIDE_SHARE_VALUES per thread
    assert norm_ops.forward_config(4096, False, bf16, bf16, False, bf16, bf16, bf16) == \
        norm_ops.forward_config(4096, True, bf16, bf16, False, bf16, bf16)
    wide_layer = norm_ops.forward_config(262144, False, bf16, bf16, False, bf16, bf16, bf16)
    wide_rms = norm_ops.forward_config(262144, True, bf16, bf16, False, bf16, bf16)
    assert (wide_layer.cluster_size, wide_layer.cols_per_cta) == \
        (wide_rms.cluster_size, wide_rms.cols_per_cta) == (16, 16384)
    assert (wide_layer.vec * wide_layer.vecs_per_thread,
            wide_rms.vec * wide_rms.vecs_per_thread) == (16, config.WIDE_SHARE_VALUES)


def test_norm_forward_keeps_sixteen_cta_clusters_for_mebibyte_rows():
    """A 1-MiB row of x alone (fp32 262144) stays on 16 CTAs for LayerNorm, where
    RMSNorm takes 8 by the softmax-measured rule."""
    from quack_kernels.ops import norm as norm_ops

    fp32 = torch.float32
    layer = norm_ops.forward_config(262144, False, fp32, fp32, False, fp32, fp32, fp32)
    rms = norm_ops.forward_config(262144, True, fp32, fp32, False, fp32, fp32)
    assert (layer.cluster_size, rms.cluster_size) == (16, 8)
    assert layer.staging == "smem" and layer.cols_per_cta * 4 == 64 * 1024


@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("x_dtype, r_dtype", [(torch.bfloat16, torch.bfloat16),
                                              (torch.float32, torch.float32),
                                              (torch.bfloat16, torch.float32)])
def test_norm_forward_keeps_long_residual_rows_in_registers(rms, x_dtype, r_dtype):
    """Rows with a residual whose staged pair is 1 MiB or more, up to
    RESIDUAL_REGISTER_MAX_COLS columns, keep h in registers (one chunk of up to 64
    values of each tensor per thread on 16 CTAs); shorter, longer and residual-free
    rows keep the default share."""
    import math

    from quack_kernels.ops import norm as norm_ops

    def cfg(n, residual=True):
        return norm_ops.forward_config(n, rms, x_dtype, r_dtype if residual else None,
                                       residual, x_dtype, x_dtype, None if rms else x_dtype)

    def ruled(n):  # the share the rule picks
        return config.row_config(n, max(x_dtype.itemsize, r_dtype.itemsize), staged_tensors=2,
                                 bytes_per_col=x_dtype.itemsize + r_dtype.itemsize,
                                 values_per_thread=config.RESIDUAL_REGISTER_VALUES,
                                 wide_clusters=True)

    most = config.RESIDUAL_REGISTER_MAX_COLS
    first = math.ceil(config.RESIDUAL_REGISTER_ROW_BYTES / (x_dtype.itemsize + r_dtype.itemsize))
    for n in (first, most):
        c = cfg(n)
        assert c == ruled(n)
        assert (c.cluster_size, c.num_chunks, c.staging) == (16, 1, "registers")
    long_row = cfg(most)
    assert long_row.vec * long_row.vecs_per_thread * 2 == config.RESIDUAL_REGISTER_VALUES
    for n in (first - 8, most + 8):
        assert cfg(n) != ruled(n)
    assert cfg(most, residual=False).staging != "registers"


def test_softmax_backward_rereads_dy_in_reverse_only_where_its_rows_outgrow_l2():
    """config.rereads_in_reverse: the fp32 softmax backward re-reads dy (y staged alone)
    last chunk first, with L2 hints, for rows of 1M columns (4 MB of dy: seven resident
    clusters' rows outgrow half of L2), not 800000 (3.05 MiB: lost there) nor 524288;
    the log_softmax (dy staged) and 16-bit rows (both staged) read nothing twice."""
    from quack_kernels.ops import softmax

    f32, bf16 = torch.float32, torch.bfloat16
    assert config.rereads_in_reverse(1000000, 4) and config.rereads_in_reverse(1 << 20, 4)
    assert not config.rereads_in_reverse(800000, 4)
    assert not config.rereads_in_reverse(1 << 20, 2)
    cases = {(1 << 20, f32, False): True, (1000000, f32, False): True,
             (800000, f32, False): False, (524288, f32, False): False,
             (1 << 20, f32, True): False, (1 << 20, bf16, False): False}
    for (n, dtype, log), expected in cases.items():
        kernel = softmax.backward_kernel(softmax.backward_config(n, dtype, log=log), dtype, log)[0]
        assert kernel.rereads_dy_in_reverse == expected, (n, dtype, log)


def test_softmax_forward_takes_wide_values_for_wide_16bit_shares():
    """config.wide_16bit_share: 16-bit softmax rows whose 16-CTA shares outgrow
    CTA_ROW_BYTES take WIDE_SHARE_VALUES per thread where staged; rows of 256 KiB,
    misaligned or fp32 rows, and rows re-read from global memory keep the default."""
    from quack_kernels.ops.softmax import forward_config

    def values(n, dtype=torch.bfloat16, max_vec=None):
        cfg = forward_config(n, dtype, max_vec)
        return cfg.vec * cfg.vecs_per_thread

    assert values(262144) == values(200000) == config.WIDE_SHARE_VALUES
    assert values(262144, torch.float16) == config.WIDE_SHARE_VALUES
    assert values(131072) == values(262144, max_vec=4) == 16
    assert values(262144, torch.float32) == 32  # fp32's own default
    assert values(1 << 21) == 16 and forward_config(1 << 21, torch.bfloat16).staging == "global"


@pytest.mark.parametrize("n", [200000, 262144, 1_100_000, 1_300_000, 1_600_000, 1 << 21])
def test_wide_16bit_shares_only_where_they_halve_the_chunks(n):
    """config.widened_16bit_share, the one rule of RMSNorm (x alone) and softmax: a
    16-bit share widened to WIDE_SHARE_VALUES per thread only where that stays staged in
    shared memory with fewer chunks. Past MAX_CHUNKS_PER_SHARE chunks (16-bit rows of
    1.05M-1.6M columns) the default already takes more values per thread, and rows
    re-read from global memory keep theirs: there both ops take the default share."""
    from quack_kernels.ops import norm, softmax

    dt = torch.bfloat16
    rms = norm.forward_config(n, True, dt, dt, False, dt, dt)
    default = config.row_config(n, 2, staged_tensors=1)
    assert rms == softmax.forward_config(n, dt)
    assert rms.num_chunks <= default.num_chunks
    widened = rms.vec * rms.vecs_per_thread == config.WIDE_SHARE_VALUES
    assert widened == (n <= 262144)
    assert widened or rms == default


def test_norm_backward_with_one_buffer_prefetches_its_next_block_to_l2():
    """config.with_l2_prefetch: a looping norm backward left with one staging buffer
    asks L2 for its next row block, except rows re-read from global memory, shares with
    a second buffer and their sums in registers, and vectors under 16 bytes of any
    staged tensor."""
    from quack_kernels.ops.norm import backward_config

    def share(n, h=torch.float32, dy=None, accumulators=1):
        return backward_config(n, h, dy or h, (h,), h, accumulators)

    for n, h, accumulators in ((262144, torch.float32, 1), (229376, torch.float32, 1),
                               (163840, torch.bfloat16, 1), (196608, torch.bfloat16, 1)):
        cfg = share(n, h, accumulators=accumulators)
        assert cfg.stages == 1 and cfg.staging != "global" and cfg.l2_prefetch == 1
    cfg = share(200000, accumulators=2)
    assert cfg.staging == "global" and cfg.l2_prefetch == 0
    cfg = share(4096, torch.bfloat16)
    assert cfg.stages == 2 and config.sums_in_registers(cfg) and cfg.l2_prefetch == 0
    cfg = share(131073)  # one-value vectors
    assert cfg.stages == 1 and cfg.staging != "global" and cfg.l2_prefetch == 0
    cfg = share(163840, torch.bfloat16, torch.float32)  # 8-byte vectors of bf16 h
    assert cfg.stages == 1 and cfg.staging != "global" and cfg.l2_prefetch == 0


def test_norm_backward_with_sums_in_shared_memory_prefetches_past_its_buffers():
    """config.norm_backward_prefetches_past_buffers: two staging buffers and per-column
    sums in shared memory ask L2 for one more row block (the shapes measured); sums in
    registers, and no sums (frozen weight), do not."""
    from quack_kernels.ops.norm import backward_config

    # the shapes measured, on the clustered shares they took before the register shares
    # (norm_backward_register_threads), which a sweep still reaches
    for n, dtype, accumulators in ((16384, torch.bfloat16, 1), (65536, torch.bfloat16, 1),
                                   (65536, torch.float32, 1), (65536, torch.float32, 2)):
        cfg = backward_config(n, dtype, dtype, (dtype,), dtype, accumulators, cta_row_bytes=(
            config.norm_backward_share(dtype.itemsize, accumulators, n)[0]))
        assert cfg.stages == 2 and not config.sums_in_registers(cfg)
        assert cfg.l2_prefetch == 1, (n, dtype, accumulators)
        frozen = backward_config(n, dtype, dtype, (dtype,), dtype, 0)
        assert frozen.stages != 2 or frozen.l2_prefetch == 0
    for n, dtype, accumulators in ((4096, torch.bfloat16, 1), (16384, torch.float32, 1),
                                   (16384, torch.bfloat16, 2), (65536, torch.bfloat16, 1),
                                   (262144, torch.bfloat16, 1)):
        cfg = backward_config(n, dtype, dtype, (dtype,), dtype, accumulators)
        assert cfg.stages == 2 and config.sums_in_registers(cfg)
        assert cfg.l2_prefetch == 0, (n, dtype, accumulators)


def test_cross_entropy_gradient_of_fp32_rows_prefetches_past_its_buffers():
    """config.ce_prefetches_past_buffers: the looping gradient of fp32 rows in whole
    vector groups asks L2 for one more row block; 16-bit rows, ragged rows, the loss
    alone and a staged weight row do not."""
    from quack_kernels.ops.cross_entropy import forward_config

    for n in (1024, 4096):
        cfg = forward_config(n, torch.float32, False, True)
        assert cfg.stages == 2 and cfg.l2_prefetch == 1
        assert forward_config(n, torch.bfloat16, False, True).l2_prefetch == 0
        assert forward_config(n, torch.float32, False, False).l2_prefetch == 0
        assert forward_config(n, torch.float32, True, True).l2_prefetch == 0
    ragged = forward_config(1000, torch.float32, False, True)
    assert ragged.stages == 2 and ragged.needs_col_predicate and ragged.l2_prefetch == 0


@pytest.mark.parametrize("ctas_per_sm", range(1, 17))
def test_fenced_shared_memory_holds_an_sm_to_the_planned_ctas(ctas_per_sm):
    """A looping launch of clusters asks for enough shared memory that the SM fits the
    CTAs its grid is sized for and not one more; a CTA that needs more keeps its own."""
    fenced = config.fenced_smem_bytes(1024, ctas_per_sm)
    per_cta = fenced + config.SMEM_RESERVED_PER_CTA
    assert ctas_per_sm * per_cta <= config.SMEM_BYTES_PER_SM < (ctas_per_sm + 1) * per_cta
    assert fenced % 128 == 0
    assert config.fenced_smem_bytes(fenced + 4096, ctas_per_sm) == fenced + 4096


def test_norm_backward_register_shares():
    """config.norm_backward_register_threads: rows of 4097-131072 columns in whole 16-byte
    vectors, with sums, take one chunk of REGISTER_SHARE_VALUES values per thread over
    512-thread CTAs (16-bit RMSNorm: 1024 where that makes two CTAs or more and pads the
    row no more), two staging buffers, no CTA past the row end; rows those shares would
    pad by a fifth or more (but 16-bit RMSNorm ones), 4096-column rows, 262144-column
    ones, odd ones (see the next test) and frozen weights keep the clustered shares."""
    from quack_kernels.ops.norm import backward_config

    threads = config.norm_backward_register_threads
    assert threads(2, 1, 65536, rms=True) == threads(2, 1, 32768, rms=True) == 1024
    assert threads(2, 1, 24000, rms=True) == 512  # 2 x 1024 would pad it by a quarter
    assert threads(2, 1, 16384, rms=True) == 512  # one 1024-thread CTA
    # 16-bit RMSNorm rows take 512-thread shares however much they pad
    assert threads(2, 1, 10000, rms=True) == threads(2, 1, 4104, rms=True) == 512
    assert threads(2, 1, 65536, rms=False) == threads(4, 1, 65536, rms=True) == 512
    assert threads(2, 2, 131072, rms=False) == threads(4, 2, 8192, rms=False) == 512
    for elem, sums, n in ((2, 2, 10000), (4, 1, 10000), (2, 1, 4096), (2, 2, 262144),
                          (4, 1, 262144), (2, 1, 65537), (2, 0, 65536)):
        assert threads(elem, sums, n, rms=sums == 1) is None, (elem, sums, n)
    for dtype in (torch.bfloat16, torch.float32):
        for n in (4104, 8192, 10000, 12288, 16384, 24000, 40000, 65536, 100000, 131072):
            for rms in (True, False):
                sums = 1 if rms else 2
                cfg = backward_config(n, dtype, dtype, (dtype,), dtype, sums, rms=rms)
                wanted = threads(dtype.itemsize, sums, n, rms)
                if wanted is None:
                    assert cfg.threads_per_row <= config.MAX_THREADS_PER_ROW
                    continue
                assert (cfg.threads_per_row, cfg.num_chunks, cfg.staging, cfg.stages) \
                    == (wanted, 1, "registers", 2), (n, dtype, rms)
                assert cfg.vec * cfg.vecs_per_thread == config.REGISTER_SHARE_VALUES
                assert cfg.cols_covered >= n > cfg.cols_covered - cfg.cols_per_cta
    # a wider weight narrows the accesses, not the values a thread holds
    mixed = backward_config(65536, torch.bfloat16, torch.bfloat16, (torch.bfloat16,),
                            torch.float32, 1, rms=True)
    assert (mixed.vec, mixed.vec * mixed.vecs_per_thread) == (4, config.REGISTER_SHARE_VALUES)
    # a misaligned tensor narrowing the staged dtype's accesses keeps the clustered share
    # (one-value vectors on 1024 threads spilled)
    for max_vec in (1, 2, 4):
        assert threads(2, 1, 65536, rms=True, max_vec=max_vec) is None
        narrowed = backward_config(65536, torch.bfloat16, torch.bfloat16, (torch.bfloat16,),
                                   torch.bfloat16, 1, max_vec, rms=True)
        assert narrowed.threads_per_row <= config.SUM_THREADS_PER_ROW
    assert threads(2, 1, 65536, rms=True, max_vec=8) == 1024


def test_norm_backward_odd_row_register_shares():
    """config.odd_row_register_share: odd 16-bit rows with per-column sums whose clustered
    share stages them in shared memory take one chunk of ODD_ROW_SHARES' threads x at most
    its values (RMSNorm 1024 x 15, LayerNorm 512 x 17) over the CTAs the row needs (two
    or more, at most a cluster); LayerNorm's 16-CTA register share of 50257 columns, fp32
    rows, even rows (misaligned ones too), frozen weights, the residual's gradients and
    rows one such CTA covers or a cluster cannot do not."""
    from quack_kernels.ops.norm import backward_config

    def share(n, dtype=torch.bfloat16, rms=True, sums=None, max_vec=None, outs=1):
        sums = (1 if rms else 2) if sums is None else sums
        return backward_config(n, dtype, dtype, (dtype,) * outs, dtype, sums, max_vec,
                               rms=rms)

    for n, rms, ctas in ((50257, True, 4), (131073, True, 9), (32001, True, 3),
                         (200001, True, 14), (131073, False, 16), (100001, False, 12),
                         (65537, False, 8)):
        threads, values = config.ODD_ROW_SHARES[rms]
        for dtype in (torch.bfloat16, torch.float16):
            cfg = share(n, dtype, rms)
            assert (cfg.threads_per_row, cfg.cluster_size, cfg.num_chunks, cfg.staging,
                    cfg.vec) == (threads, ctas, 1, "registers", 1), (n, dtype, rms, cfg)
            assert cfg.vecs_per_thread <= values
            assert cfg.cols_covered >= n > cfg.cols_covered - cfg.cols_per_cta
    assert share(50257, rms=False).threads_per_row == 256
    for rms, cfg in ((True, share(50257, torch.float32)), (True, share(262143)),
                     (False, share(139265, rms=False)), (True, share(4097)),
                     (True, share(50257, sums=0)), (True, share(50257, outs=3)),
                     (True, share(65536, max_vec=1)), (True, share(50258))):
        odd_share = (config.ODD_ROW_SHARES[rms][0], "registers")
        assert (cfg.threads_per_row, cfg.staging) != odd_share, cfg


# Odd 16-bit rows on config.odd_row_forward_share's shares: row length -> CTAs, by the
# row bytes a CTA (RMSNorm's re-read shares 16 KiB, LayerNorm's and softmax's staged
# ones 32 KiB; 131073 and 262143 columns take row_config's chunk counts to 13 and 16).
ODD_ROW_FORWARD_CTAS = {
    True: {16385: 3, 32001: 4, 50257: 7, 131073: 13, 262143: 16},
    False: {16385: 2, 32001: 2, 50257: 4, 131073: 13, 262143: 16}}


def test_odd_row_forward_shares(monkeypatch):
    """config.odd_row_forward_share: the norm forward of x alone and the softmax forward
    on odd 16-bit rows of 16K-256K columns that their clustered shares do not hold in
    registers take chunks of 8 values on 256 threads, RMSNorm re-reading x from global
    memory with 16 KiB of the row a CTA, LayerNorm and softmax staging it in shared
    memory with 32 KiB; fp32 rows, even rows, a residual, shorter and longer rows and
    shares already in registers (an fp32 weight's 4-byte accesses size the RMSNorm row
    50257 so) keep the share they had without the rule."""
    from quack_kernels.ops import softmax
    from quack_kernels.ops.norm import forward_config

    def share(n, rms=True, dtype=torch.bfloat16, residual=False, weight_dtype=None):
        return forward_config(n, rms, dtype, dtype, residual, dtype, weight_dtype or dtype,
                              None if rms else dtype)

    cases = ((50257, torch.float32, False, None), (50258, torch.bfloat16, False, None),
             (50257, torch.bfloat16, True, None), (16383, torch.bfloat16, False, None),
             (4097, torch.float16, False, None), (262145, torch.bfloat16, False, None),
             (2000001, torch.bfloat16, False, None))
    kept = [(n, rms, dtype, residual, weight) for rms in (True, False)
            for n, dtype, residual, weight in cases]
    # (LayerNorm's row of 16-bit x with an fp32 weight is staged: the rule takes it)
    kept.append((50257, True, torch.bfloat16, False, torch.float32))
    kept_softmax = [(50257, torch.float32), (50258, torch.bfloat16), (16383, torch.float16),
                    (262145, torch.bfloat16), (2000001, torch.bfloat16)]

    def configs():
        forward_config.cache_clear()
        softmax.forward_config.cache_clear()
        return ([share(*case) for case in kept],
                [softmax.forward_config(*case) for case in kept_softmax])

    monkeypatch.setattr(config, "ODD_ROW_FORWARD_MIN_COLS", 1 << 30)  # the rule off
    try:
        without_rule = configs()
    finally:
        monkeypatch.undo()
        forward_config.cache_clear()  # (no config of the rule off outlives the test)
        softmax.forward_config.cache_clear()
    assert configs() == without_rule
    assert share(50257, weight_dtype=torch.float32).staging == "registers"

    threads, values = config.ODD_ROW_FORWARD_THREADS, config.ODD_ROW_FORWARD_VALUES
    for rms in (True, False):
        staging = config.ODD_ROW_FORWARD_SHARES["reread" if rms else "staged"][1]
        for n, ctas in ODD_ROW_FORWARD_CTAS[rms].items():
            for cfg in (share(n, rms), share(n, rms, dtype=torch.float16)):
                assert (cfg.threads_per_row, cfg.vecs_per_thread, cfg.staging, cfg.vec,
                        cfg.register_chunks, cfg.cluster_size) == \
                    (threads, values, staging, 1, 0, ctas), (n, cfg)
                assert cfg.cols_covered >= n > cfg.cols_covered - cfg.cols_per_cta
    for n, ctas in ODD_ROW_FORWARD_CTAS[False].items():
        for dtype in (torch.bfloat16, torch.float16):
            cfg = softmax.forward_config(n, dtype)
            assert (cfg.threads_per_row, cfg.vecs_per_thread, cfg.staging, cfg.vec,
                    cfg.cluster_size) == (threads, values, "smem", 1, ctas), (n, cfg)


# The cross-entropy loss alone of odd 16-bit rows on the same shares, 32 KiB a CTA (65537
# and 100001 columns take row_config's chunk counts to 7 CTAs).
ODD_ROW_CROSS_ENTROPY_CTAS = {16385: 2, 32001: 2, 50257: 4, 65537: 7, 100001: 7, 131073: 13,
                              262143: 16}


def test_odd_row_cross_entropy_shares(monkeypatch):
    """config.cross_entropy_row_config: the loss alone of odd 16-bit rows of 16K-256K
    columns streams odd_row_forward_share's 8-value chunks on 256 threads from global
    memory, with or without softcap; the gradient, the staged class-weight row, fp32 and
    even rows, shorter and longer rows keep the share they had without the rule."""
    def configs(cases):
        return [config.cross_entropy_row_config(n, elem, stage_weight, write_grad, None, cap)
                for n, elem, stage_weight, write_grad, cap in cases]

    kept = [(n, elem, stage_weight, write_grad, cap)
            for n, elem, stage_weight in ((50257, 4, False), (50258, 2, False),
                                          (16383, 2, False), (262145, 2, False),
                                          (2000001, 2, False), (50257, 2, True))
            for write_grad in (False, True) for cap in (False, True)]
    kept += [(n, 2, False, True, cap) for n in ODD_ROW_CROSS_ENTROPY_CTAS
             for cap in (False, True)]  # the gradient
    monkeypatch.setattr(config, "ODD_ROW_FORWARD_MIN_COLS", 1 << 30)  # the rule off
    without_rule = configs(kept)
    monkeypatch.undo()
    assert configs(kept) == without_rule

    threads, values = config.ODD_ROW_FORWARD_THREADS, config.ODD_ROW_FORWARD_VALUES
    for n, ctas in ODD_ROW_CROSS_ENTROPY_CTAS.items():
        for cap in (False, True):
            cfg = config.cross_entropy_row_config(n, 2, False, False, None, cap)
            assert (cfg.threads_per_row, cfg.vecs_per_thread, cfg.staging, cfg.vec,
                    cfg.register_chunks, cfg.cluster_size) == \
                (threads, values, "global", 1, 0, ctas), (n, cap, cfg)
            assert cfg.cols_covered >= n > cfg.cols_covered - cfg.cols_per_cta


def test_norm_backward_rows_alone_in_shared_memory():
    """config.rows_alone_in_smem: a 512-thread share whose sums stay in registers stages
    its rows in shared memory where they fit without the sums (LayerNorm fp32 262144 and
    229376 columns: 16 B a column with the sums, 8 without), not with a predicated tail
    (200000 spilled); RMSNorm fp32 262144, whose rows and sums fit together on 256
    threads, takes the 512-thread share too (both single-buffered and refilling, at the
    same row blocks in flight)."""
    from quack_kernels.ops.norm import backward_config

    fp32 = torch.float32
    for n in (229376, 262144):
        cfg = backward_config(n, fp32, fp32, (fp32,), fp32, 2)
        assert (cfg.threads_per_row, cfg.staging, cfg.stages, cfg.l2_prefetch) \
            == (config.SUM_THREADS_PER_ROW, "smem", 1, 1), n
        assert config.sums_in_registers(cfg)
        assert cfg.staging_smem_bytes(8) <= config.STAGING_SMEM_BYTES \
            < cfg.staging_smem_bytes(16)
    assert backward_config(200000, fp32, fp32, (fp32,), fp32, 2).staging == "global"
    rms = backward_config(262144, fp32, fp32, (fp32,), fp32, 1, rms=True)
    assert (rms.threads_per_row, rms.staging, rms.stages) \
        == (config.SUM_THREADS_PER_ROW, "smem", 1)
    assert config.sums_in_registers(rms)
    staged = config.rows_alone_in_smem(
        dataclasses.replace(rms, staging="global", threads_per_row=512, num_chunks=4), 8)
    assert staged.staging == "smem"
    assert config.rows_alone_in_smem(staged, 16).staging == "global"


def test_cluster_partials_travel_as_whole_vectors():
    """A slot of a cluster exchange rounds up to vectors of 2 or 4 words (one st.async
    each); the bytes a CTA expects are the senders' slots."""
    from quack_kernels.primitives import reduce as red

    cluster = config.RowConfig(n_cols=262144, vec=8, threads_per_row=512, rows_per_block=1,
                               cluster_size=16, vecs_per_thread=2, num_chunks=2,
                               staging="smem", stages=2)
    one_cta = dataclasses.replace(cluster, cluster_size=1)
    words = {n: red.slot_words(cluster, n) for n in range(1, 8)}
    assert words == {1: 1, 2: 2, 3: 4, 4: 4, 5: 6, 6: 6, 7: 8}
    assert [red.store_vector(w) for w in (1, 2, 4, 6, 8)] == [1, 2, 4, 2, 4]
    assert all(red.slot_words(one_cta, n) == n for n in range(1, 8))  # no st.async there
    # one-block kernels: every warp of every CTA sends; looping ones: each CTA once
    assert red.scratch_tx_bytes(cluster, 3, 1) == 16 * 16 * 4 * 4
    assert red.scratch_tx_bytes(cluster, 3, 2) == 16 * 4 * 4
    assert red.scratch_slots(cluster, 2) == 16 + 16  # the peers', then the CTA's warps


def test_looping_kernels_merge_their_warps_before_wide_exchanges():
    """merges_cta_first: looping kernels (two scratch buffers) whose exchange carries at
    least MIN_PACKETS_TO_MERGE_CTA_FIRST warp partials a CTA (measured 256: gain, 128:
    none); never one-block kernels or CTAs of one warp per row."""
    cfg = config.RowConfig(n_cols=262144, vec=8, threads_per_row=512, rows_per_block=1,
                           cluster_size=16, vecs_per_thread=2, num_chunks=2, staging="smem",
                           stages=2)
    assert cfg.warps_per_row * cfg.cluster_size == config.MIN_PACKETS_TO_MERGE_CTA_FIRST
    assert config.merges_cta_first(cfg, 2)
    assert not config.merges_cta_first(cfg, 1)
    assert not config.merges_cta_first(dataclasses.replace(cfg, cluster_size=8), 2)
    assert not config.merges_cta_first(dataclasses.replace(cfg, cluster_size=1), 2)
    one_warp = dataclasses.replace(cfg, threads_per_row=32, vecs_per_thread=64, num_chunks=1)
    assert not config.merges_cta_first(one_warp, 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [4097, 16385, 50257, 131073, 262143])
def test_odd_16bit_softmax_rows_are_shifted_where_they_may_be(n, dtype):
    """config.shifted_row_share: the softmax of odd 16-bit rows that may be read from the
    16-byte boundary before each (``shifted``) takes the share of an aligned row of N + 7
    columns, whole vectors over a span covering every shift, one row a CTA, staged
    without held chunks (y and dy both in the backward); rows that may not keep the
    share they had."""
    from quack_kernels.ops import softmax

    per_access = 8
    for log in (False, True):
        for cfg, staged_bytes in ((softmax.forward_config(n, dtype, 1, True), 2),
                                  (softmax.backward_config(n, dtype, 1, True, log=log), 4)):
            assert cfg.row_shift and cfg.n_cols == n and cfg.vec == per_access, cfg
            assert cfg.cols_covered >= n + per_access - 1, cfg
            assert (cfg.rows_per_block, cfg.register_chunks, cfg.stages, cfg.l2_prefetch) == \
                (1, 0, 1, 0), cfg
            assert config.stages_in_smem(cfg, staged_bytes), cfg
        unshifted = softmax.backward_config(n, dtype, 1, False, log=log)
        assert not unshifted.row_shift and unshifted.vec == 1
    assert softmax.forward_config(n, dtype, 1) == softmax.forward_config(n, dtype, 1, False)


def test_shifted_rows_only_for_odd_16bit_rows_their_span_stages():
    """No shift for fp32 rows, rows of whole vectors, rows short enough to be held in
    registers (7, 769) or long enough that the backward's span holds chunks there
    (1000001)."""
    from quack_kernels.ops import softmax

    for n, dtype in ((50257, torch.float32), (50264, torch.bfloat16), (7, torch.bfloat16),
                     (769, torch.float16)):
        assert not softmax.forward_config(n, dtype, None, True).row_shift, (n, dtype)
        assert not softmax.backward_config(n, dtype, None, True, log=False).row_shift
    assert not softmax.backward_config(1000001, torch.bfloat16, 1, True, log=False).row_shift


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [16385, 50257, 131073, 262143])
def test_odd_16bit_cross_entropy_rows_are_shifted_where_they_may_be(n, dtype):
    """The cross-entropy of odd 16-bit rows that may be shifted takes the gradient's
    share of the aligned span, staged one row a CTA; the loss alone without softcap
    or smoothing the span's streamed share (its loads fill the edges: 16K columns and
    more), else the gradient's; with softcap the gradient keeps its capped values in
    registers where that share does (then no shift); never with the weight row staged."""
    from quack_kernels.ops import cross_entropy as ce

    span = -(-(n + 7) // 8) * 8
    for write_grad, softcap, smoothing in itertools.product((False, True), repeat=3):
        cfg = ce.forward_config(n, dtype, False, write_grad, softcap=softcap, shifted=True,
                                smoothing=smoothing)
        grad_share = ce.forward_config(span, dtype, False, True, softcap=softcap and write_grad)
        if not cfg.row_shift:
            assert write_grad and softcap and grad_share.staging == "registers", cfg
            continue
        streams = not (write_grad or softcap or smoothing)
        assert cfg.n_cols == n and cfg.vec == 8 and cfg.cols_covered >= n + 7, cfg
        assert (cfg.staging, cfg.rows_per_block, cfg.register_chunks, cfg.stages,
                cfg.l2_prefetch) == ("global" if streams else "smem", 1, 0, 1, 0), cfg
        assert not ce.forward_config(n, dtype, False, write_grad, softcap=softcap).row_shift
    streamed = ce.forward_config(n, dtype, False, False, shifted=True)
    assert streamed == dataclasses.replace(config.streamed_loss_row_config(span, 2), n_cols=n,
                                           row_shift=True)
    short = ce.forward_config(config.SHIFTED_STREAMED_LOSS_MIN_COLS - 1, dtype, False, False,
                              shifted=True)
    assert short.staging != "global" or not short.row_shift
    with pytest.raises(AssertionError):
        ce.forward_config(n, dtype, True, True, shifted=True)


def test_cross_entropy_shifts_shiftable_rows_without_the_weight_row(monkeypatch):
    """ops.cross_entropy.shifts_rows: shiftable logits and gradient rows, unless the
    weight row is staged beside them, or shifting is off."""
    from quack_kernels.ops import cross_entropy as ce

    rows = torch.empty(4, 1031, dtype=torch.bfloat16)
    monkeypatch.setattr(config, "SHIFTED_ODD_ROWS", True)
    assert ce.shifts_rows(rows, rows, False)
    assert not ce.shifts_rows(rows, rows, True)
    assert not ce.shifts_rows(rows, torch.empty(4, 1032, dtype=torch.bfloat16)[:, :1031], False)
    assert not ce.shifts_rows(torch.empty(4 * 1031 + 1, dtype=torch.bfloat16)[1:].view(4, 1031),
                              rows, False)  # (a misaligned base)
    monkeypatch.setattr(config, "SHIFTED_ODD_ROWS", False)
    assert not ce.shifts_rows(rows, rows, False)


@pytest.mark.parametrize("weight_dtype", [None, torch.float32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [2049, 4097, 12289, 16385, 50257, 131073, 262143])
def test_odd_16bit_norm_rows_are_shifted_where_they_may_be(n, dtype, weight_dtype):
    """The norm forward of odd 16-bit rows that may be shifted takes the share of the
    aligned span (config.shifted_row_share) with whole vectors of the rows whatever the
    weight's width, the rows staged in shared memory one a CTA, an fp32 weight and bias
    beside them (config.splices_shifted_columns; LayerNorm's prenorm of 262143 columns
    with them does not fit), but those of x alone below SHIFTED_RMS_NORM_X_MIN_COLS /
    SHIFTED_LAYER_NORM_X_MIN_COLS (config.norm_forward_shifts); rows that may not keep
    their one-value share."""
    from quack_kernels.kernels.norm import NormForward
    from quack_kernels.ops import norm
    from quack_kernels.ops.common import cutlass_dtype

    weight_dtype = weight_dtype or dtype
    for rms, residual in itertools.product((True, False), (False, True)):
        bias = None if rms else weight_dtype
        args = (n, rms, dtype, dtype, residual, dtype, weight_dtype, bias, 1, None)
        cfg = norm.forward_config(*args, True)
        unshifted = norm.forward_config(*args)
        assert not unshifted.row_shift and unshifted.vec == 1
        if n == 262143 and not rms and residual and weight_dtype == torch.float32:
            assert cfg == unshifted  # (its staged fp32 weight and bias do not fit)
            continue
        if not residual and n < (config.SHIFTED_RMS_NORM_X_MIN_COLS if rms
                                 else config.SHIFTED_LAYER_NORM_X_MIN_COLS):
            assert cfg == unshifted  # (config.norm_forward_shifts: it lost there)
            continue
        assert cfg.row_shift and cfg.n_cols == n and cfg.vec == 8, cfg
        assert cfg.cols_covered >= n + 7, cfg
        assert (cfg.rows_per_block, cfg.register_chunks, cfg.stages, cfg.l2_prefetch) == \
            (1, 0, 1, 0), cfg
        columns = tuple(cutlass_dtype(d) for d in (weight_dtype, bias) if d is not None)
        kernel = NormForward(cfg, rms, cutlass_dtype(dtype), cutlass_dtype(dtype),
                             cutlass_dtype(dtype), residual, residual, columns)
        staged_columns = 0 if weight_dtype == dtype else 4 * len(columns)
        assert kernel.smem_bytes() > cfg.cols_per_cta * (2 * (1 + residual) + staged_columns)
        assert kernel.smem_bytes() <= config.SMEM_BYTES_PER_CTA


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [2049, 16385, 50257, 131073])
def test_odd_16bit_norm_backward_rows_are_shifted_where_they_may_be(n, dtype):
    """The norm backward of odd 16-bit rows that may be shifted takes the looping share
    of the aligned span (config.shifted_row_share, looping): one row a CTA, one chunk in
    registers or chunks in shared memory, one or two staging buffers, no L2 prefetch; the
    weight staged (at the CTA's shift) and its launch within shared memory."""
    from quack_kernels.ops import norm

    for rms, dres in itertools.product((True, False), (False, True)):
        sums = 1 if rms else 2
        outs = (dtype,) * (3 if dres else 1)
        cfg = norm.backward_config(n, dtype, dtype, outs, dtype, sums, 1, rms=rms, shifted=True)
        assert not norm.backward_config(n, dtype, dtype, outs, dtype, sums, 1, rms=rms).row_shift
        assert cfg.row_shift and cfg.n_cols == n and cfg.vec == 8, cfg
        assert cfg.cols_covered >= n + 7 and cfg.staging in ("smem", "registers"), cfg
        assert (cfg.rows_per_block, cfg.register_chunks, cfg.l2_prefetch) == (1, 0, 0), cfg
        kernel = norm._backward_kernel_object(cfg, rms, dtype, dtype, True, not rms, dtype)
        assert kernel.weight_staged and not kernel.holds_weight
        assert kernel.launch_smem_bytes() <= config.SMEM_BYTES_PER_CTA


def test_shifted_looping_grids_write_a_partial_row_per_cta_and_class():
    """config.partial_sum_rows: a looping grid of any size over shifted rows (not rounded
    to the 8 shift classes) writes its per-column sums a row per CTA and class
    (rows.ShiftClassOrder: CTA b's class c as row b + c, 7 more than the CTAs); other
    grids a row per row of their blocks."""
    shifted = config.RowConfig(n_cols=4097, vec=8, threads_per_row=256, rows_per_block=1,
                               cluster_size=1, vecs_per_thread=2, num_chunks=1,
                               staging="registers", row_shift=True)
    for resident, rows in ((7, 14), (15, 22), (132, 132 + 7), (8, 15), (264, 264 + 7)):
        assert config.loop_grid_rows(shifted, 100000, resident) == resident
        assert config.partial_sum_rows(shifted, resident) == rows
    unshifted = dataclasses.replace(shifted, row_shift=False)
    assert config.shift_classes(shifted) == 8 and config.shift_classes(unshifted) == 1
    assert config.partial_sum_rows(unshifted, 15) == 15
    assert config.partial_sum_rows(dataclasses.replace(unshifted, rows_per_block=4), 15) == 60


def test_norm_shifts_shiftable_rows_where_switched_on(monkeypatch):
    """ops.norm.shifts_rows: shiftable rows (ops.common.shiftable), and per-column
    vectors on 16 bytes, where config.SHIFTED_NORM_ROWS is on."""
    from quack_kernels.ops import norm

    rows = torch.empty(4, 1031, dtype=torch.bfloat16)
    weight = torch.empty(1032, dtype=torch.bfloat16)
    assert rows.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
    monkeypatch.setattr(config, "SHIFTED_NORM_ROWS", True)
    assert norm.shifts_rows(rows, torch.empty_like(rows))
    assert not norm.shifts_rows(rows, torch.empty(4, 1032, dtype=torch.bfloat16)[:, :1031])
    assert norm.shifts_rows(rows, columns=(weight[:1031], None))
    assert not norm.shifts_rows(rows, columns=(weight[:1031], weight[1:]))
    monkeypatch.setattr(config, "SHIFTED_NORM_ROWS", False)
    assert not norm.shifts_rows(rows, torch.empty_like(rows))


def test_shiftable_rows(monkeypatch):
    """ops.common.shiftable: 16-byte-aligned bases and rows of stride N (one row: any
    stride), where config.SHIFTED_ODD_ROWS is on; nothing where it is off."""
    from quack_kernels.ops.common import shiftable

    monkeypatch.setattr(config, "SHIFTED_ODD_ROWS", False)
    assert not shiftable(torch.empty(3, 1031, dtype=torch.bfloat16)) and not shiftable()
    monkeypatch.setattr(config, "SHIFTED_ODD_ROWS", True)
    assert shiftable()

    flat = torch.empty(64 * 1031 + 8, dtype=torch.bfloat16)
    assert flat.data_ptr() % 16 == 0
    rows = flat[:64 * 1031].view(64, 1031)
    assert shiftable(rows) and shiftable(rows, flat[8:].view(-1)[:64 * 1031].view(64, 1031))
    assert not shiftable(flat[1:64 * 1031 + 1].view(64, 1031))  # misaligned base
    assert not shiftable(rows, flat[1:64 * 1031 + 1].view(64, 1031))
    assert not shiftable(rows[:, :1030])  # rows of stride 1031, 1030 long
    assert shiftable(rows[3:4] if rows[3:4].data_ptr() % 16 == 0 else rows[8:9, :1030])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_layer_norm_backward_one_vector_past_a_full_cluster_is_shifted(dtype):
    """LayerNorm's backward with dweight and dbias of odd 16-bit rows whose span is past
    16 CTAs' power-of-two shares (262143 columns: 32769 vectors) takes
    config.shifted_sums_share: whole warps (not a power of two), a cluster that covers
    the span, the sums in shared memory beside the rows and the weight not staged (read
    spliced, so only a 16-bit one), with a residual's gradients too; shorter spans,
    RMSNorm and rows no such cluster holds keep their shares."""
    from quack_kernels.ops import norm

    def config_of(n, outs=1, weight_dtype=dtype, rms=False, accumulators=2):
        return norm.backward_config(n, dtype, dtype, (dtype,) * outs, weight_dtype,
                                    accumulators, rms=rms, shifted=True)

    for n in (262139, 262143, 262145, 290817):
        cfg = config_of(n)
        assert cfg.row_shift and cfg.vec == 8 and cfg.vecs_per_thread == 1, (n, cfg)
        assert cfg.threads_per_row % 32 == 0 and cfg.threads_per_row & (cfg.threads_per_row - 1)
        assert cfg.cluster_size <= config.MAX_CLUSTER_SIZE and cfg.cols_covered >= n + 7, cfg
        kernel = norm._backward_kernel_object(cfg, False, dtype, dtype, True, True, dtype)
        assert not kernel.weight_staged and not kernel.sums_in_registers
        assert kernel.launch_smem_bytes() <= config.SMEM_BYTES_PER_CTA
        # (the kernel's warps: at most 3 a scheduler, 168 registers a thread)
        assert cfg.threads_per_row <= 3 * 4 * 32, cfg
        assert config_of(n, outs=3) == config_of(n, outs=3, weight_dtype=None) == cfg
        assert not config_of(n, weight_dtype=torch.float32).row_shift
        assert config_of(n, rms=True, accumulators=1).threads_per_row in (256, 512)
    for n in (262143, 327675, 400001, 442361):
        # (RMSNorm and one sum: their wider CTAs spilled; an fp32 dx: 32-byte vectors)
        for rms, accumulators in ((True, 1), (False, 1)):
            cfg = config_of(n, rms=rms, accumulators=accumulators)
            assert cfg.threads_per_row & (cfg.threads_per_row - 1) == 0, cfg
        for outs in ((torch.float32,), (dtype, torch.float32, dtype)):
            cfg = norm.backward_config(n, dtype, dtype, outs, dtype, 2, shifted=True)
            assert cfg.threads_per_row & (cfg.threads_per_row - 1) == 0, (outs, cfg)
    assert not config_of(400001).row_shift  # (14 warps: past SPAN_SUMS_MAX_THREADS)
    assert config.shifted_sums_share(262137, 2) is None  # (a span of 32768 vectors)
    assert config_of(262137).threads_per_row == 512
    assert config.shifted_sums_share(262144, 2) is None
    assert not config_of(300001).row_shift  # (past shared memory)


def test_norm_forward_loads_columns_a_chunk_ahead_on_staged_shares_of_many_chunks():
    """config.norm_forward_columns_ahead: LayerNorm's staged shares of more than two
    chunks whose columns are loaded together in the output pass (the measured wins:
    bf16 32K-256K columns, fp32 64K-512K) load them a chunk ahead; shares of two chunks
    (fp32 32768, lost), register shares and shares holding their columns do not."""
    from quack_kernels.kernels.norm import NormForward
    from quack_kernels.ops import norm
    from quack_kernels.ops.norm import cutlass_dtype

    def ahead(n, dtype, residual=False, rms=False, shifted=False, column_dtype=None):
        column_dtype = column_dtype or dtype
        cfg = norm.forward_config(n, rms, dtype, dtype, residual, dtype, column_dtype,
                                  None if rms else column_dtype, shifted=shifted)
        assert cfg.row_shift == shifted
        dt, ct = cutlass_dtype(dtype), cutlass_dtype(column_dtype)
        kernel = NormForward(cfg, rms, dt, dt, dt, residual, residual,
                             (ct,) if rms else (ct, ct))
        return kernel.columns_ahead

    bf16, f32 = torch.bfloat16, torch.float32
    assert all(ahead(n, bf16) for n in (32768, 65536, 131072, 262144))
    assert ahead(65536, f32) and ahead(131072, f32) and ahead(131072, bf16, residual=True)
    assert not ahead(32768, f32)  # two chunks
    assert not ahead(65536, bf16, residual=True)  # two chunks
    assert not ahead(4096, bf16)  # a register share
    assert not ahead(262144, f32, residual=True)  # a register share
    assert not ahead(262144, bf16, rms=True)  # RMSNorm holds its weight from the start
    assert not ahead(50257, bf16)  # odd rows: narrow vectors ...
    assert not ahead(50257, bf16, shifted=True)  # ... or shifted
    # fp32 rows past 131K columns: chunks of 16 or 8 values instead of 32, so that they
    # do; 16 where those cover no more columns than 8 would (fewer chunks, no more tail)
    assert all(ahead(n, f32) for n in (150000, 196608, 200000, 262144, 524288))

    def fp32_values(n):
        return norm.forward_config(n, False, f32, f32, False, f32, f32, f32) \
            .thread_values_per_chunk

    wide, narrow = config.LATE_COLUMNS_TOGETHER_VALUES, config.LAYER_NORM_LONG_ROW_VALUES
    assert all(fp32_values(n) == wide for n in (196608, 262144, 300000, 524288, 786432))
    assert all(fp32_values(n) == narrow for n in (150000, 200000))  # 16 pad more
    # not 16-bit shares widened past MAX_CHUNKS_PER_SHARE (1M columns: 64 values, 8
    # chunks)
    long_bf16 = norm.forward_config(1 << 20, False, bf16, bf16, False, bf16, bf16, bf16)
    assert long_bf16.num_chunks <= config.MAX_CHUNKS_PER_SHARE
    assert long_bf16.thread_values_per_chunk > config.LATE_COLUMNS_TOGETHER_VALUES
    # bf16 rows with an fp32 weight: 4-value vectors, whole in the columns' width, in
    # chunks of 16 from 16K columns (fp32's 32 before)
    for n in (16384, 65536, 262144):
        mixed = norm.forward_config(n, False, bf16, bf16, False, bf16, f32, f32)
        assert mixed.vec == 4 and mixed.thread_values_per_chunk == wide
        assert ahead(n, bf16, column_dtype=f32)
    assert not ahead(65536, bf16, residual=True, column_dtype=f32)  # a register share
    assert ahead(196608, bf16, residual=True, column_dtype=f32)  # staged, 3 chunks
    # ... in at most LAYER_NORM_LONG_ROW_MAX_CHUNKS chunks (987136: 31 of 8 or 16 of 16)
    for n in (557056, 987136, 1048576):
        mixed = norm.forward_config(n, False, bf16, bf16, False, bf16, f32, f32)
        assert mixed.num_chunks <= config.LAYER_NORM_LONG_ROW_MAX_CHUNKS
        assert mixed.thread_values_per_chunk <= wide
    # not where the loads ahead would be narrower than whole vectors: 16-bit x with an
    # fp32 output (4-value vectors of 16-bit x and columns) keeps fp32's 32 values
    for columns in (bf16, None):
        out_fp32 = norm.forward_config(262144, False, bf16, bf16, False, f32, columns, columns)
        assert out_fp32.vec == 4 and out_fp32.thread_values_per_chunk == 32
    staged = norm.forward_config(262144, False, bf16, bf16, False, bf16, bf16, bf16)
    assert config.norm_forward_columns_ahead(staged, 2)
    assert not config.norm_forward_columns_ahead(dataclasses.replace(staged, staging="global"), 2)
