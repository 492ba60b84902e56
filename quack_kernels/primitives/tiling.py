"""Thread-value layouts, tiles, predicates and copies for row-wise kernels.

A chunk is a (rows_per_block, cols_per_chunk) tile. Thread ``t`` of a row owns the
vectors t, t + threads_per_row, t + 2 * threads_per_row, ... of that row, so for each
vector index the threads of a row touch consecutive 16-byte pieces: every load and
store instruction of a warp is one coalesced transaction of 32 x 16 B.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import arith, vector

from . import config
from .config import RowConfig


def chunk_tiler(cfg: RowConfig):
    return (cfg.rows_per_block, cfg.cols_per_chunk)


def chunk_tv_layout(cfg: RowConfig) -> cute.Layout:
    """(thread, value) -> position in the column-major chunk tile.

    thread = (t in row, row in block); value = (element in vector, vector index).
    """
    rows = cfg.rows_per_block
    return cute.make_layout(
        ((cfg.threads_per_row, rows), (cfg.vec, cfg.vecs_per_thread)),
        stride=((cfg.vec * rows, 1), (rows, cfg.vec * cfg.threads_per_row * rows)),
    )


def copies_async(dtype, cfg: RowConfig) -> bool:
    """config.copies_async for vectors of the cutlass type ``dtype``."""
    return config.copies_async(cfg, dtype.width // 8)


def g2s_copy_atom(dtype, cfg: RowConfig):
    """Global -> shared, one vector per instruction: cp.async where copies_async (the
    DSL's default cache mode, cp.async.ca), else plain loads and stores."""
    op = cute.nvgpu.cpasync.CopyG2SOp() if copies_async(dtype, cfg) \
        else cute.nvgpu.CopyUniversalOp()
    return cute.make_copy_atom(op, dtype, num_bits_per_copy=dtype.width * cfg.vec)


def vector_copy_atom(dtype, cfg: RowConfig):
    """Plain vectorized load/store (global <-> registers, shared -> registers)."""
    return cute.make_copy_atom(
        cute.nvgpu.CopyUniversalOp(), dtype, num_bits_per_copy=dtype.width * cfg.vec
    )


# L2 eviction policies of ld / st .L2::cache_hint: createpolicy.fractional.L2::evict_*
# with fraction 1.0, as CUTLASS encodes them (CacheHintSm90, cute/arch/copy_sm90_desc.hpp)
L2_POLICIES = {"evict_first": 0x12F0000000000000, "evict_last": 0x14F0000000000000}


def global_copy_atom(dtype, cfg: RowConfig, to_global: bool, l2_policy: str | None = None):
    """(atom, keyword arguments of its cute.copy) of a vectorized global load (or store,
    ``to_global``), with ``l2_policy`` (a key of L2_POLICIES) when given: the plain
    vector atom drops a cache policy, the G2R / R2G ones take it."""
    if l2_policy is None:
        return vector_copy_atom(dtype, cfg), {}
    op = cute.nvgpu.CopyR2GOp() if to_global else cute.nvgpu.CopyG2ROp()
    atom = cute.make_copy_atom(op, dtype, num_bits_per_copy=dtype.width * cfg.vec)
    return atom, dict(cache_policy=Int64(L2_POLICIES[l2_policy]))


def tiled_copy(atom, cfg: RowConfig):
    return cute.make_tiled_copy(atom, chunk_tv_layout(cfg), chunk_tiler(cfg))


def column_offset(tXcX: cute.Tensor, coord) -> int:
    """Column of this thread's value at ``coord`` relative to its first value: a
    compile-time constant of the partition's layout (an int 0 when every stride is 0,
    e.g. one value per thread). Comparisons against it need one live register per chunk
    (the room left in the row) instead of one column per value; kernels looping over
    row blocks would otherwise keep every column live across iterations (measured:
    128+ registers instead of 75)."""
    offset = tXcX.layout(coord)
    return offset[1] if isinstance(offset, tuple) else offset


@cute.jit
def vector_predicate(tXcX: cute.Tensor, n_cols: Int32,
                     inside: cutlass.Constexpr[bool] = True) -> cute.Tensor:
    """One flag per vector of this thread: does it start before ``n_cols`` (``inside``;
    else: at or past it)? Rows are a multiple of the vector width long, so a vector is
    either all in or all out, but for a shifted row's edge vectors (RowTiles)."""
    tXpX = cute.make_rmem_tensor(
        cute.make_layout(
            (cute.size(tXcX, mode=[0, 1]), cute.size(tXcX, mode=[1]), cute.size(tXcX, mode=[2])),
            stride=(cute.size(tXcX, mode=[2]), 0, 1),
        ),
        Boolean,
    )
    room = n_cols - tXcX[0][1]
    for v in cutlass.range_constexpr(cute.size(tXpX, mode=[0])):
        for k in cutlass.range_constexpr(cute.size(tXpX, mode=[2])):
            offset = column_offset(tXcX, ((0, v), 0, k))
            tXpX[v, 0, k] = offset < room if inside else offset >= room
    return tXpX


@cute.jit
def mask_out_of_row(values: cute.TensorSSA, tXcX: cute.Tensor, n_cols: Int32,
                    fill: Float32) -> cute.TensorSSA:
    """Replace the values of vectors past the row end by ``fill`` (the identity of the
    reduction that follows), so padding never enters a max or a sum. Each value takes
    the flag of its vector's first column (rows are whole vectors), so there is one
    comparison per vector, not per value."""
    assert cute.size(tXcX, mode=[1]) == 1, "one row per thread: flags at row index 0"
    inside = cute.make_rmem_tensor(cute.make_layout(tXcX.shape), Boolean)
    room = n_cols - tXcX[0][1]
    for e in cutlass.range_constexpr(cute.size(tXcX, mode=[0, 0])):
        for v in cutlass.range_constexpr(cute.size(tXcX, mode=[0, 1])):
            for k in cutlass.range_constexpr(cute.size(tXcX, mode=[2])):
                inside[(e, v), 0, k] = column_offset(tXcX, ((0, v), 0, k)) < room
    return cute.where(inside.load(), values, fill)


@cute.jit
def is_column(tXcX: cute.Tensor, col: Int32, relative: cutlass.Constexpr[bool]) -> cute.TensorSSA:
    """Per value of this thread's chunk: is it in column ``col``? ``relative``: compare
    offsets from the thread's first value (column_offset) instead of every value's
    coordinate: one live register per chunk instead of a column per value (fewer
    registers, more resident CTAs), but it spilled 8 bytes in the one-block
    cross-entropy forward at 262145 bf16 columns with every option on."""
    flags = cute.make_rmem_tensor(cute.make_layout(tXcX.shape), Boolean)
    offset = col - tXcX[0][1]
    for i in cutlass.range_constexpr(cute.size(flags)):
        if cutlass.const_expr(relative):
            flags[i] = offset == column_offset(tXcX, i)
        else:
            flags[i] = tXcX[i][1] == col
    return flags.load()


# A bf16 value is the high half of the fp32 of the same value, so a packed pair widens
# by one integer op a value (shift the low one up, mask the high one); the DSL's
# conversion first unpacks each pair (PRMT, then a shift: 1.5 instructions a value;
# LayerNorm bf16 forward of 262144 columns 1592 -> 1464 SASS instructions a thread).
# Where config.widens_by_integer_ops says so (RowTiles.to_fp32).
BF16_HIGH_MASK = -65536  # 0xFFFF0000 as an Int32


def to_fp32(values: cute.TensorSSA, by_integer_ops: bool) -> cute.TensorSSA:
    """``values`` converted to fp32 (the same shape); bf16 pairs by integer ops where
    ``by_integer_ops``."""
    count = cute.size(values.shape)
    if values.dtype is not cutlass.BFloat16 or count % 2 or not by_integer_ops:
        return values.to(Float32)
    words = values.bitcast(Int32)
    i32 = Int32.mlir_type
    words_type = ir.VectorType.get([count // 2], i32)
    low = arith.shli(words, arith.constant(words_type, ir.DenseElementsAttr.get_splat(
        words_type, ir.IntegerAttr.get(i32, 16))))
    high = arith.andi(words, arith.constant(words_type, ir.DenseElementsAttr.get_splat(
        words_type, ir.IntegerAttr.get(i32, BF16_HIGH_MASK))))
    # element 2k is word k's low half, 2k + 1 its high half
    pairs = vector.shuffle(low, high, [k // 2 + (k % 2) * (count // 2) for k in range(count)])
    widened = vector.bitcast(ir.VectorType.get([count], Float32.mlir_type), pairs)
    return cute.TensorSSA(widened, values.shape, Float32)
