"""The skeleton every row-wise kernel shares: launch geometry, shared-memory staging,
per-chunk loads of the input rows and predicated stores of the output rows.

A kernel subclasses :class:`RowKernel`, lists the row tensors it stages, and writes its
math between ``RowTiles.values`` (fp32 registers of one chunk) and ``RowTiles.store``.
Grid: x = blocks of rows_per_block rows, y = the cluster's CTAs along the row.

Kernels that reduce over rows as well (the dweight of a norm backward), or whose CTAs
would otherwise be too short-lived (the cross-entropy forward of short rows), launch a
fixed number of row blocks instead and loop: CTA x handles row blocks x, x + grid_x, ...
(``RowTiles.begin_block``; shifted rows: a range of a ``ShiftClassOrder``, a class at a
time), reducing each row through a double-buffered ``ReductionSlot(..., buffers=2)``;
with two staging buffers (``cfg.stages``) the next block's loads are in flight while
the current block is reduced and stored (with one, ``RowTiles.refill_chunk`` loads each
chunk once the current block has read it). A norm backward keeps per-column sums in an
``accumulator`` until it writes them as a row of partial sums (shifted rows: a row a
class). Long shares that need each value once can instead be streamed chunk by
chunk through a dynamic loop (``RowTiles.load`` with a runtime chunk index).
"""

from __future__ import annotations

import copy

import cutlass
import cutlass.cute as cute
from cutlass.experimental.primitives.nvvm_wrapper import cp_async_bulk_prefetch
from cutlass import Boolean, Float32, Int32, Int64

from . import reduce as red
from . import tiling
from .config import (HELD_CHUNK_REGISTERS, LOOP_REGS_PER_THREAD, MAX_FENCED_CTAS_PER_SM,
                     SHIFT_CLASSES, RowConfig, fenced_smem_bytes, loop_ctas_per_sm,
                     sums_in_registers, whole_vectors, widens_by_integer_ops)
from .grid_sum import GridSum


def broadcast_rows(mV: cute.Tensor, num_rows, n_cols: int) -> cute.Tensor:
    """A per-column vector (N,) seen as an (M, N) tensor with row stride 0, so it tiles,
    partitions and stages exactly like the row tensors."""
    return cute.make_tensor(mV.iterator, cute.make_layout((num_rows, n_cols), stride=(0, 1)))


@cute.jit
def wait_for_previous_grid(let_next_launch: cutlass.Constexpr[bool] = True):
    """The start of a kernel launched with programmatic dependent launch (Hopper PDL:
    ``use_pdl``), whose CTAs may be scheduled while the kernel before it in the stream
    still runs: wait until that kernel has finished and its writes are visible, before
    this one touches global memory (so only the launch overlaps, whatever kernel came
    before); ``let_next_launch``: then let the next such kernel be scheduled too (else
    the kernel calls griddepcontrol_launch_dependents itself, or its end does)."""
    cute.arch.griddepcontrol_wait()
    if cutlass.const_expr(let_next_launch):
        cute.arch.griddepcontrol_launch_dependents()


class RowKernel(GridSum):
    """Base for kernels over rows of ``cfg.n_cols`` elements. Subclasses set
    ``self.cfg`` and ``self.staged_dtypes`` (dtypes of the row tensors kept on chip,
    in the order the kernel passes them to RowTiles)."""

    cfg: RowConfig
    staged_dtypes: tuple
    reductions: int = 1  # cluster reductions per kernel (scratch + an mbarrier per buffer each)
    values_per_reduction: int = 1
    scratch_buffers: int = 1  # 2 for kernels looping over row blocks
    accumulators: int = 0  # fp32 per-column accumulators (see RowTiles.accumulator)
    column_dtypes: tuple = ()  # per-column vectors staged (RowTiles.stage_[shifted_]columns)
    grid_sums: int = 0  # fp32 values summed over the grid at the end (block_sum scratch)
    loop_registers: int = LOOP_REGS_PER_THREAD  # per thread, when looping over row blocks
    block_registers: int | None = None  # per thread of a one-block-per-CTA launch, if held
    # launched with programmatic dependent launch (see wait_for_previous_grid): the
    # kernel body must then call begin() before it touches global memory
    programmatic_launch: bool = False
    _ctas_per_sm = None

    @property
    def sums_in_registers(self) -> bool:
        """Where the accumulators live (RowTiles.accumulator): config.sums_in_registers."""
        return sums_in_registers(self.cfg)

    @property
    def staged_bytes_per_col(self) -> int:
        """Bytes per column of the staged row tensors, all of them together."""
        return sum(d.width // 8 for d in self.staged_dtypes)

    def smem_bytes(self) -> int:
        staged = self.cfg.staging_smem_bytes(self.staged_bytes_per_col)
        if self.cfg.staging == "global":
            staged = 0
        scratch = self.reductions * 4 * self.scratch_buffers \
            * red.scratch_words(self.cfg, self.values_per_reduction, self.scratch_buffers)
        accumulated = 0
        if not self.sums_in_registers:
            accumulated = self.accumulators * self.cfg.rows_per_block * self.cfg.cols_per_cta * 4
        columns = self.cfg.rows_per_block * self.cfg.cols_per_cta * sum(
            d.width // 8 for d in self.column_dtypes)
        allocations = 2 * len(self.staged_dtypes) + 2 * self.reductions \
            + self.accumulators * self.cfg.num_chunks \
            + len(self.column_dtypes)
        grid_sums = 0
        if self.grid_sums:  # grid_sum's block_sum scratch
            grid_sums = self.cfg.threads_per_block // 32 * self.grid_sums * 4
            allocations += 1
        # (an allocation's alignment within 16 bytes each; a slot's mbarriers, 8 bytes a
        # scratch buffer, within its own and the 64 to spare)
        return staged + scratch + accumulated + columns + grid_sums + 16 * allocations + 64

    @property
    def launches_clusters(self) -> bool:
        """Whether the CTAs of a row launch as a cluster: several of them, exchanging
        partials through a reduction (without one they are independent and need no
        co-scheduling)."""
        return self.cfg.cluster_size > 1 and bool(self.reductions)

    def launch_smem_bytes(self) -> int:
        """Dynamic shared memory of a looping launch: smem_bytes, for a launch of clusters
        of at most MAX_FENCED_CTAS_PER_SM CTAs per SM fenced to ctas_per_sm
        (config.fenced_smem_bytes)."""
        if self.launches_clusters and self.ctas_per_sm() <= MAX_FENCED_CTAS_PER_SM:
            return fenced_smem_bytes(self.smem_bytes(), self.ctas_per_sm())
        return self.smem_bytes()

    def ctas_per_sm(self) -> int:
        """Resident CTAs per SM a looping launch of this kernel is sized for: the
        fewest that shared memory, threads and ``loop_registers`` allow (remembered:
        hosts size every looping launch with it)."""
        if self._ctas_per_sm is None:
            self._ctas_per_sm = loop_ctas_per_sm(self.cfg, self.smem_bytes(), self.loop_registers)
        return self._ctas_per_sm

    def launch(self, kernel, num_rows, stream, grid_rows=None):
        """``grid_rows``: blocks of rows to launch when the kernel loops over row blocks
        (default one block per rows_per_block rows). A looping grid is sized for
        ``ctas_per_sm`` resident CTAs, so the compiler is held to the registers that
        many need (a CTA that does not fit would run as a second, mostly idle wave); a
        one-block launch only where the kernel sets ``block_registers``, or holds chunks
        in registers (HELD_CHUNK_REGISTERS)."""
        cfg = self.cfg
        occupancy = {}
        smem = self.smem_bytes()
        registers = self.block_registers
        if registers is None and cfg.register_chunks:
            registers = HELD_CHUNK_REGISTERS
        # carveout given so that the DSL does not query a device for it (CPU builds)
        if grid_rows is None:
            grid_rows = cute.ceil_div(num_rows, cfg.rows_per_block)
            if registers is not None:
                occupancy = dict(min_blocks_per_mp=loop_ctas_per_sm(
                    cfg, self.smem_bytes(), registers), preferred_smem_carveout=100)
        else:
            occupancy = dict(min_blocks_per_mp=self.ctas_per_sm(), preferred_smem_carveout=100)
            smem = self.launch_smem_bytes()
        kernel.launch(
            grid=[grid_rows, cfg.cluster_size, 1],
            block=[cfg.threads_per_block, 1, 1],
            cluster=[1, cfg.cluster_size, 1] if self.launches_clusters else None,
            smem=smem,
            stream=stream,
            use_pdl=self.programmatic_launch,
            **occupancy,
        )

    @cute.jit
    def begin(self):
        """A kernel body's first call: with ``programmatic_launch``, wait_for_previous_grid."""
        if cutlass.const_expr(self.programmatic_launch):
            wait_for_previous_grid()

    def row_block_iterations(self, num_rows, grid_rows):
        """(this CTA's first row block, its iterations) in a looping grid of ``grid_rows``
        row blocks: blocks first, first + grid_rows, ... below the last."""
        first_block = cute.arch.block_idx()[0]
        num_blocks = (num_rows + self.cfg.rows_per_block - 1) // self.cfg.rows_per_block
        # counting iterations (not row blocks) keeps a division out of the loop
        return first_block, (num_blocks - first_block + grid_rows - 1) // grid_rows

    @cute.jit
    def for_each_row_block(self, num_rows, grid_rows, body, *args, carry=None, blocks=None):
        """The loop of a looping grid of ``grid_rows`` row blocks: this CTA calls
        ``body(block_row, iteration, *args)`` for row blocks block_idx.x, + grid_rows,
        ... (``body``: one method, since names bound, or objects whose methods are
        called, directly in a dynamic loop body become loop-carried values); ``blocks``
        (first, end, origin): for positions first, first + 1, ..., end - 1 of a class of
        shifted rows (RowTiles.in_class), position p being iteration p - origin (the loop
        bound is also the view's end: no more registers live in the loop than the flat
        grid's). With ``carry`` (a tuple of scalars) the call is ``carry =
        body(block_row, iteration, *args, carry=carry)``: values one iteration hands the
        next, such as loads issued an iteration ahead; ``body`` returns a tuple of the
        same structure and types."""
        if cutlass.const_expr(blocks is None):
            first_block, iterations = self.row_block_iterations(num_rows, grid_rows)
            for iteration in cutlass.range(iterations, unroll=1):
                if cutlass.const_expr(carry is None):
                    body(first_block + iteration * grid_rows, iteration, *args)
                else:
                    carry = body(first_block + iteration * grid_rows, iteration, *args,
                                 carry=carry)
        else:
            first, end, origin = blocks
            for position in cutlass.range(first, end, unroll=1):
                if cutlass.const_expr(carry is None):
                    body(position, position - origin, *args)
                else:
                    carry = body(position, position - origin, *args, carry=carry)


class ShiftClassOrder:
    """The order a looping grid of G row blocks visits shifted rows in (cfg.row_shift, a
    row a block). Row r starts r * stride values past the rows' base, so r mod
    SHIFT_CLASSES (its class) fixes its shift; a CTA stages per-column vectors at its
    rows' shift and keeps per-column sums lined up with it, so it visits rows a class at
    a time (``segment``; RowTiles.in_class). The order runs class by class (positions
    [class_start(c), class_start(c + 1)) are the rows c, c + 8, ...) and CTA b visits a
    contiguous range of about M / G positions: its rows change class only where its
    range crosses a class start, at most SHIFT_CLASSES - 1 times over the whole grid,
    whatever its size. It writes its sums of class c as row b + c: unique, as a later
    CTA's classes are never below an earlier one's (config.partial_sum_rows: G + 7
    rows, written_classes names each CTA's). A grid of a multiple of 8 row blocks splits
    each class among G / 8 CTAs of its own instead (``splits_classes``): every CTA
    visits one class, as main's interleaved order did (CTA b: rows b, b + G, ...), which
    ran 2-6 points faster there than class by class on the H100 (fp16 4096x32001
    RMSNorm 85.0% against 79.2% of the copy ceiling,
    results/norm_backward_class_major_H100_20261205.txt). The choice is made once a CTA
    (``keep``), so it costs the loops no register (the two orders in one kernel as two
    loops spilled the 16-bit LayerNorm backward of 4097 columns at its 80 registers).
    """

    def __init__(self, num_rows, grid_rows, cta=None, kept=None):
        """``cta``: this CTA's block index (a plain int: the order computed on the host,
        as tests check it; else the kernel's block_idx.x). ``kept``: the CTA's range
        and written classes (and the class sizes, where ``keep`` kept them) as ``keep``
        stored them, read instead of computed."""
        self.grid_rows = grid_rows
        sizes_kept = kept is not None and cute.size(kept) > KEPT_ORDER_VALUES
        # classes hold per_class rows, the first ``longer`` of them one more
        self.per_class = kept[4] if sizes_kept else num_rows // SHIFT_CLASSES
        self.longer = kept[5] if sizes_kept else num_rows % SHIFT_CLASSES
        self.cta = cute.arch.block_idx()[0] if cta is None else cta
        if kept is not None:
            self.first, self.end = kept[0], kept[1]
            return
        # (32-bit arithmetic: a 64-bit division is a call, its stack frame a spill)
        self.splits_classes = grid_rows % SHIFT_CLASSES == 0
        # class split: CTA b takes part b % ctas_per_class of class b // ctas_per_class
        ctas_per_class = cutlass.max(grid_rows // SHIFT_CLASSES, 1)
        self.own_class = self.cta // ctas_per_class
        self.leads_class = self.cta % ctas_per_class == 0
        class_first, class_end = _balanced_part(
            self.per_class + _select(self.own_class < self.longer, 1, 0),
            ctas_per_class, self.cta % ctas_per_class)
        # class by class: ranges of num_rows // grid_rows positions, the first
        # (num_rows % grid_rows) one longer
        first, end = _balanced_part(num_rows, grid_rows, self.cta)
        start = self.class_start(self.own_class)
        self.first = _select(self.splits_classes, start + class_first, first)
        self.end = _select(self.splits_classes, start + class_end, end)

    def keep(self, smem, sizes: bool = False) -> cute.Tensor:
        """This CTA's range and written classes (first, end, first class, end class)
        stored in shared memory, for a loop over classes to read in each class (``kept``
        of a new order): held in registers, the compiler hoists them out of that loop
        and keeps them live across the loop over rows inside it, which spilled the
        16-bit LayerNorm backward of 131073 columns at its 128 registers. With ``sizes``
        the class sizes (per_class, longer) too, for the same reason: computed from the
        row count they spilled 8 bytes of the 16-bit backward of 262143 columns with a
        residual's gradients (LayerNorm at 128 registers, RMSNorm at 255); not kept
        by default, as loaded from shared memory they cost one-chunk register shares
        10-15 points (see NormBackward.keeps_class_sizes). Every thread stores the same
        values, so each reads back its own without a barrier."""
        kept = smem.allocate_tensor(Int32, cute.make_layout(kept_order_values(sizes)),
                                    byte_alignment=16)
        kept[0], kept[1] = self.first, self.end
        kept[2], kept[3] = self.written_classes()
        if cutlass.const_expr(sizes):
            kept[4], kept[5] = self.per_class, self.longer
        return kept

    @staticmethod
    def writes(kept: cute.Tensor, shift_class):
        """Whether the CTA that ``kept`` its order writes class ``shift_class``."""
        return (kept[2] <= shift_class) & (shift_class < kept[3])

    def class_start(self, shift_class):
        """The first position of class ``shift_class`` (class by class)."""
        return shift_class * self.per_class + cutlass.min(shift_class, self.longer)

    def shift_class(self, position):
        """The class at ``position`` of the order (class by class; not defined at -1,
        CTA 0's first - 1, which written_classes discards)."""
        long_end = self.longer * (self.per_class + 1)  # past the classes one row longer
        return _select(position < long_end, position // (self.per_class + 1),
                       self.longer + (position - long_end) // cutlass.max(self.per_class, 1))

    def segment(self, shift_class):
        """(first, end) positions of this CTA's rows of class ``shift_class`` (first ==
        end: none); the rows are shift_class + SHIFT_CLASSES (position -
        class_start(shift_class)), and the CTA writes their sums as partial row cta +
        shift_class."""
        first = cutlass.max(self.first, self.class_start(shift_class))
        return first, cutlass.max(first, cutlass.min(self.end, self.class_start(shift_class + 1)))

    def written_classes(self):
        """[first, end) classes whose partial-sum rows this CTA writes (segment): its own
        (in its range), and before them the last class of the CTA before it (a zero row
        where this range starts at a class start), and, for the grid's last CTA, every
        class past its last (zero rows: fewer than SHIFT_CLASSES in all). Where the grid
        splits_classes: its own class, and before it, for the CTA leading a class but the
        first, the class before (a zero row: rows b + b // (G / 8) skip one there)."""
        first = _select(self.cta == 0, 0, self.shift_class(self.first - 1))
        end = _select(self.cta == self.grid_rows - 1, SHIFT_CLASSES,
                      self.shift_class(self.end - 1) + 1)
        # class split: its class, and the zero row before it where it leads the class
        split_first = self.own_class - _select(self.leads_class & (self.own_class > 0), 1, 0)
        return (_select(self.splits_classes, split_first, first),
                _select(self.splits_classes, self.own_class + 1, end))


KEPT_ORDER_VALUES = 4  # Int32 values ShiftClassOrder.keep stores (without the sizes)


def kept_order_values(sizes: bool) -> int:
    """Int32 values ShiftClassOrder.keep stores, with the class sizes or not (two more,
    padded to 16 bytes)."""
    return 2 * KEPT_ORDER_VALUES if sizes else KEPT_ORDER_VALUES


def _balanced_part(count, parts, part):
    """[first, end) of part ``part`` of ``count`` items split into ``parts`` contiguous
    parts, the first count % parts of them one longer."""
    size, longer = count // parts, count % parts
    first = part * size + cutlass.min(part, longer)
    return first, first + size + _select(part < longer, 1, 0)


def _select(condition, if_true, if_false):
    """cutlass.select_ (plain ints as Int32: left to the DSL, the order's arithmetic
    widened and spilled the LayerNorm backward of 4097 columns), or the plain choice
    where ``condition`` is a Python bool (a ShiftClassOrder computed on the host)."""
    if isinstance(condition, bool):
        return if_true if condition else if_false
    as_int32 = lambda v: Int32(v) if isinstance(v, int) else v  # noqa: E731
    return cutlass.select_(condition, as_int32(if_true), as_int32(if_false))


class ReductionSlot:
    """Scratch (and, for clusters, an armed mbarrier per scratch buffer) for
    row_allreduce. A cluster's CTAs then each arrive on the cluster barrier that the
    kernel's ``cute.arch.cluster_wait()`` completes before the first remote store:
    ``arrive`` is this thread's arrival, made once (a kernel with several slots passes
    it to the last one only: a second arrival before the wait is undefined)."""

    def __init__(self, smem, cfg: RowConfig, num_values: int, buffers: int = 1,
                 arrive: bool = True):
        self.cfg = cfg
        self.buffers = buffers
        self.scratch = smem.allocate_tensor(
            Float32, red.scratch_layout(cfg, num_values, buffers), byte_alignment=16
        )
        self.mbar = None
        if cfg.cluster_size > 1:
            # A barrier per buffer: exchange k + 2, the next on this barrier, is sent only
            # once every warp of the row finished exchange k + 1, so its bytes never
            # land on an exchange still open. With one barrier for both buffers a peer's
            # bytes for exchange k + 1 could count toward exchange k before the bytes
            # of a slower peer had landed (a stale read, and the LayerNorm fp32 backward
            # hung in back-to-back launches on 128-thread cluster shares).
            self.mbar = smem.allocate_array(Int64, num_elems=buffers)
            red.cluster_reduction_setup(self.mbar, buffers,
                                        red.scratch_tx_bytes(cfg, num_values, buffers), arrive)

    def allreduce(self, values, combine, identity, iteration=None):
        """``iteration``: the loop counter of a kernel looping over row blocks (needs
        ``buffers=2``: exchange k uses buffer and barrier k % 2, whose phase k // 2 it
        waits for); None for a single reduction per kernel."""
        if iteration is None:
            return red.row_allreduce(values, combine, identity, self.cfg, self.scratch, self.mbar)
        assert self.buffers == 2, "a looped reduction needs ReductionSlot(..., buffers=2)"
        buffer = iteration % 2
        scratch = self.scratch[None, None, None, buffer]
        mbar = self.mbar + buffer if cutlass.const_expr(self.mbar is not None) else None
        return red.row_allreduce(values, combine, identity, self.cfg, scratch, mbar,
                                 phase=iteration // 2, rearm=True)


class RowTiles:
    """This thread's view of the rows of one block: tiles of every staged tensor per
    chunk, the column predicates, and the shared-memory staging buffers.

    ``pad``: a value written into the staging buffers past the row end (one
    shared-memory store per vector, by the few threads holding any), so that
    ``values(..., fill=pad)`` needs no per-value select: the identity of the reduction
    the kernel runs first (-inf for a max). Written once the chunk's copies landed,
    since a predicated-off cp.async zero-fills its vector (so a fill of 0 needs no pad:
    values() reads those zeros). Not for one-value vectors (odd rows), where a store per
    vector costs as much as a select per value.

    ``integer_widening``: whether bf16 values are widened by integer ops (to_fp32):
    None where config.widens_by_integer_ops says so; False keeps the DSL's conversion,
    True takes the integer ops on any share.

    Shifted rows (``cfg.row_shift``, config.shifted_row_share): the tiles start at the
    16-byte boundary at or before the row's first value, ``shift`` values before it, so
    the row is columns [shift, row_end) of them; the pad also covers the values outside
    that range in the row's two edge vectors (they belong to the rows beside it), and
    ``store`` writes those two vectors value by value. Per-column vectors line up with
    it through ``shifted_column_values`` (spliced in registers) or
    ``stage_shifted_columns`` (shared memory), per-column results go back through
    ``store_shifted_columns``. A looping grid visits shifted rows a class at a time
    (in_class: rows of one shift)."""

    def __init__(self, cfg: RowConfig, staged: list, smem, pad: float | None = None,
                 integer_widening: bool | None = None):
        self.cfg = cfg
        self.widens_by_integer_ops = widens_by_integer_ops(cfg) if integer_widening is None \
            else integer_widening
        padded = cfg.staging != "global" and cfg.needs_col_predicate and cfg.vec > 1
        self.pad = pad if padded else None
        tidx = cute.arch.thread_idx()[0]
        block_row = cute.arch.block_idx()[0]
        self.cta_rank = cute.arch.block_idx()[1] if cutlass.const_expr(cfg.cluster_size > 1) else 0
        tiler = tiling.chunk_tiler(cfg)
        self.num_rows = staged[0].shape[0]
        self.row_step, self.blocks_end = cfg.rows_per_block, None  # (see in_class)
        self.shift, self.row_end = 0, cfg.n_cols
        if cutlass.const_expr(cfg.row_shift):
            assert (self.pad is not None or cfg.staging == "global") and cfg.rows_per_block == 1, \
                "shifted rows: one row a CTA, its edges padded in shared memory or by load()"
            # (every tensor of the kernel has the row stride of the first: the host's
            # condition for shifting)
            self.row_stride = staged[0].stride[0]
            self.coord_shape = (self.num_rows, cfg.cols_covered)
        else:
            self.coord_shape = staged[0].shape
        coords = cute.make_identity_tensor(self.coord_shape)
        self.block_row = block_row
        self.tidx = tidx
        self.staged = staged
        self.smem_tiles = []
        # (tensor index, chunk) -> raw values of a register chunk (cfg.register_chunks)
        self.held = {}
        assert cfg.register_chunks == 0 or (cfg.staging == "smem" and cfg.stages == 1), \
            "register chunks: one staging buffer of a share in shared memory"
        for mX in staged:
            if cutlass.const_expr(cfg.staging != "global" and cfg.smem_chunks > 0):
                self.smem_tiles.append(
                    smem.allocate_tensor(
                        mX.element_type,
                        cute.make_ordered_layout((*tiler, cfg.smem_chunks, cfg.stages),
                                                 order=(1, 0, 2, 3)),
                        byte_alignment=16,
                    )
                )
        # Per chunk: coordinate partition, shared by all tensors (same shape).
        self.copy_g2s = [tiling.tiled_copy(tiling.g2s_copy_atom(m.element_type, cfg), cfg) for m in staged]
        self.copy_vec = [tiling.tiled_copy(tiling.vector_copy_atom(m.element_type, cfg), cfg) for m in staged]
        thr = self.copy_vec[0].get_slice(tidx)
        self.coords = [
            thr.partition_S(cute.local_tile(coords, tiler, (block_row, self.chunk_index(c))))
            for c in range(cfg.num_chunks)]
        self.row = self.coords[0][(0, 0), 0, 0][0]
        self.row_in_bounds = cute.elem_less(self.row, self.num_rows)
        if cutlass.const_expr(cfg.row_shift):
            self._place_shifted_row()
        self.preds = [tiling.vector_predicate(tXcX, self.row_end) for tXcX in self.coords]
        self.stage = 0  # staging buffer of this view (cfg.stages of them)

    def _place_shifted_row(self):
        """The span of this view's shifted row: its start, ``shift`` values before the
        row, on the 16-byte boundary at or before it."""
        start = Int64(self.row) * self.row_stride
        self.shift = Int32(start & (self.cfg.vec - 1))
        self.row_end = self.shift + self.cfg.n_cols
        self.span_start = start - Int64(self.shift)

    def in_class(self, order: ShiftClassOrder, shift_class, segment, stage):
        """The view of this CTA's rows of class ``shift_class`` of a looping grid's
        ``order`` (shifted rows; ``segment``: their positions, order.segment's), at the
        first of them, staged in buffer ``stage``:
        at_block then moves along the class (positions one apart, rows SHIFT_CLASSES
        apart, all of one shift), and positions past this CTA's rows of the class are
        out of bounds."""
        assert self.cfg.row_shift and self.cfg.rows_per_block == 1
        first, end = segment
        view = copy.copy(self)
        view.block_row, view.blocks_end, view.stage = first, end, stage
        view.row_step = SHIFT_CLASSES
        view.row = shift_class + SHIFT_CLASSES * (first - order.class_start(shift_class))
        view.row_in_bounds = first < end
        view._place_shifted_row()
        view.preds = [tiling.vector_predicate(tXcX, view.row_end) for tXcX in self.coords]
        return view

    def at_block(self, block_row, stage=0):
        """The same tiles moved to row block ``block_row``, staged in buffer ``stage``
        (kernels looping over row blocks; shared-memory buffers, predicates and copies
        are shared). A shifted row's view keeps its shift: a looping grid of shifted rows
        visits a class of rows at a time (in_class; block_after refuses others), a grid of
        one row block a CTA asks for its own block."""
        view = copy.copy(self)
        view.block_row = block_row
        view.stage = stage
        view.row = self.row + (block_row - self.block_row) * self.row_step
        if cutlass.const_expr(self.blocks_end is None):
            view.row_in_bounds = cute.elem_less(view.row, self.num_rows)
        else:
            view.row_in_bounds = block_row < self.blocks_end
        if cutlass.const_expr(self.cfg.row_shift):
            view.span_start = Int64(view.row) * self.row_stride - Int64(self.shift)
        return view

    def block_after(self, block_row, grid_rows):
        """The row block this CTA visits after ``block_row`` in a looping grid of
        ``grid_rows`` row blocks: ``grid_rows`` blocks on, or the next position of its
        class (in_class; a looping grid of shifted rows visits them a class at a time)."""
        assert not (self.cfg.row_shift and self.blocks_end is None), \
            "a looping grid of shifted rows visits them a class at a time: in_class"
        return block_row + (1 if self.blocks_end is not None else grid_rows)

    def begin_block(self, block_row, grid_rows, iteration, refills: bool = False):
        """The view of row block ``block_row``, iteration ``iteration`` of a looping grid
        of ``grid_rows`` blocks, with its loads under way: with two staging buffers they
        were issued an iteration earlier (the first block's before the loop) and the
        next block's are issued here; with one buffer they are issued now, or, where the
        kernel ``refills`` each chunk once read (refill_chunk), they already were."""
        if self.cfg.stages == 2:
            tiles = self.at_block(block_row, iteration % 2)
            self.at_block(self.block_after(block_row, grid_rows), (iteration + 1) % 2).issue_loads()
            return tiles
        tiles = self.at_block(block_row)
        if not refills:
            tiles.issue_loads()
        return tiles

    def refill_chunk(self, chunk: int, grid_rows):
        """Start the copies of ``chunk`` of this CTA's next row block (``grid_rows``
        blocks on) into the one staging buffer, as one commit group: call once this
        thread has read the chunk for the last time (its values used), in chunk order,
        so that the next block's wait_chunk counts its groups as issue_loads' (a kernel
        that refills issues the first block's loads before its loop and none in
        begin_block). No register chunks: issue_loads alone loads those."""
        assert self.cfg.stages == 1 and self.cfg.staging == "smem" \
            and self.cfg.register_chunks == 0
        self.at_block(self.block_after(self.block_row, grid_rows))._issue_chunk(chunk)

    @property
    def leads_row(self):
        """One thread per row (the first of the row, in the cluster's first CTA): the one
        that writes per-row outputs such as statistics."""
        first = self.tidx % self.cfg.threads_per_row == 0
        if cutlass.const_expr(self.cfg.cluster_size > 1):
            first = first & (self.cta_rank == 0)
        return first & self.row_in_bounds

    def broadcast_rows(self, mV: cute.Tensor) -> cute.Tensor:
        """``mV`` (N,) as an (M, N) tensor of this block's geometry (see broadcast_rows)."""
        return broadcast_rows(mV, self.num_rows, self.cfg.n_cols)

    def chunk_index(self, chunk: int):
        return self.cta_rank * self.cfg.num_chunks + chunk

    def _gmem_tile(self, mX, chunk: int):
        if cutlass.const_expr(self.cfg.row_shift):
            return cute.local_tile(self._row_span(mX), tiling.chunk_tiler(self.cfg),
                                   (0, self.chunk_index(chunk)))
        return cute.local_tile(mX, tiling.chunk_tiler(self.cfg), (self.block_row, self.chunk_index(chunk)))

    def _row_span(self, mX: cute.Tensor) -> cute.Tensor:
        """This CTA's row of ``mX`` from the 16-byte boundary ``shift`` values before it:
        whole vectors for the copies (see the class)."""
        cfg = self.cfg
        start = cute.assume(self.span_start, divby=cfg.vec)
        return cute.make_tensor(mX.iterator + start, cute.make_layout(
            (1, cfg.cols_covered), stride=(cfg.cols_covered, 1)))

    def in_registers(self, chunk: int) -> bool:
        """Whether ``chunk`` is held in registers rather than staged (cfg.register_chunks)."""
        return self.cfg.staging == "smem" and chunk >= self.cfg.smem_chunks

    def _smem_slot(self, i: int, chunk: int):
        assert not self.in_registers(chunk), "a register chunk has no staging buffer"
        slot = chunk if self.cfg.staging == "smem" else 0
        return self.smem_tiles[i][None, None, slot, self.stage]

    @property
    def load_groups(self) -> int:
        """cp.async commit groups one ``issue_loads`` makes (one per staged chunk)."""
        if self.cfg.staging == "global":
            return 0
        return self.cfg.smem_chunks

    @cute.jit
    def issue_loads(self):
        """Start the copies of every staged chunk into this view's staging buffer
        (_issue_chunk): one commit group per chunk, committed even for a block past the last
        row, so the number of groups in flight is known at compile time. In "global"
        staging nothing is staged and values() loads directly. Each thread later reads
        back only what it copied, so a buffer is free again for this thread's next copy
        once it has read it: no block barrier. Register chunks are loaded last (their
        values are used last), straight into registers."""
        cfg = self.cfg
        if cutlass.const_expr(cfg.staging != "global"):
            for c in cutlass.range_constexpr(self.load_groups):
                self._issue_chunk(c)
            for c in cutlass.range_constexpr(cfg.num_chunks):
                if cutlass.const_expr(self.in_registers(c)):
                    for i, _ in enumerate(self.staged):
                        # past the row end: the pad, as a staged chunk reads there
                        self.held[i, c] = self.load(
                            self.staged[i], c, fill=0.0 if self.pad is None else self.pad,
                            raw=True)

    @cute.jit
    def _issue_chunk(self, c: cutlass.Constexpr[int]):
        """The copies of staged chunk ``c`` of this view: cp.async, one commit group
        (committed past the last row too: the groups in flight stay known). Vectors too
        narrow for cp.async (tiling.copies_async) are loaded into registers, all of the
        chunk's before the first shared-memory store (copied vector by vector, each
        store waited for its load: one load in flight per thread, and the 16-bit
        LayerNorm backward of 50257 columns ran at 8% of the copy ceiling)."""
        narrow = []
        for i, mX in enumerate(self.staged):
            thr = self.copy_g2s[i].get_slice(self.tidx)
            tXgX = thr.partition_S(self._gmem_tile(mX, c))
            tXsX = thr.partition_D(self._smem_slot(i, c))
            if cutlass.const_expr(tiling.copies_async(mX.element_type, self.cfg)):
                if self.row_in_bounds:
                    cute.copy(self.copy_g2s[i], tXgX, tXsX, pred=self.preds[c])
            else:
                narrow.append((i, tXgX, tXsX, cute.make_fragment_like(tXgX)))
        if cutlass.const_expr(len(narrow) > 0):
            if self.row_in_bounds:
                # (names of their own: the DSL carries a name reassigned in a branch)
                for tensor, src, _, landing in narrow:
                    landing.fill(0)
                    cute.copy(self.copy_g2s[tensor], src, landing, pred=self.preds[c])
                for _, _, dst, landing in narrow:
                    cute.autovec_copy(landing, dst)
        cute.arch.cp_async_commit_group()

    def prefetch_ahead(self, grid_rows=None, also=()):
        """Where cfg.l2_prefetch is set: prefetch_to_l2 of the block that many ahead, or,
        in a looping kernel (``grid_rows`` given), of the block that many iterations
        past those its staging buffers hold (one buffer: the next iteration's; two: the
        one after). ``also``: tensors read from global memory beside the staged ones."""
        cfg = self.cfg
        if cutlass.const_expr(cfg.l2_prefetch):
            assert not cfg.row_shift, "a shifted row's span starts before it"
            tensors = [*self.staged, *also]
            if not all(whole_vectors(cfg, mX.element_type.width // 8) for mX in tensors):
                # (a bulk prefetch starts and ends on 16 bytes: config.with_l2_prefetch)
                raise ValueError("RowConfig.l2_prefetch needs whole 16-byte vectors of every "
                                 f"prefetched tensor (vec={cfg.vec})")
            ahead = cfg.l2_prefetch
            if cutlass.const_expr(grid_rows is not None):
                ahead = grid_rows * (cfg.stages - 1 + cfg.l2_prefetch)
            self.prefetch_to_l2(ahead, tensors)

    @cute.jit
    def prefetch_to_l2(self, blocks_ahead, tensors: cutlass.Constexpr):
        """Ask L2 for this CTA's columns of the staged rows of the row block
        ``blocks_ahead`` after this one (a later CTA's, or this CTA's in a later iteration):
        one bulk prefetch per row and tensor, by the row's first thread; nothing past the
        last row. The bytes arrive while this block is reduced and stored, so that the
        later block's own loads find them in L2. Whole 16-byte vectors only (checked by
        prefetch_ahead)."""
        cfg = self.cfg
        first_col = self.chunk_index(0) * cfg.cols_per_chunk
        row = self.row + blocks_ahead * cfg.rows_per_block
        cols = cutlass.min(cfg.cols_per_cta, cfg.n_cols - first_col)
        if (self.tidx % cfg.threads_per_row == 0) & (row < self.num_rows) & (cols > 0):
            for mX in tensors:
                ptr = mX.iterator + cute.crd2idx((row, first_col), mX.layout)
                cp_async_bulk_prefetch(ptr, cols * (mX.element_type.width // 8))

    def stage_columns(self, smem, mV: cute.Tensor) -> cute.Tensor:
        """This CTA's columns of the per-column vector ``mV`` (N,), every chunk, copied
        into shared memory once (and waited for) by kernels that read it for every row
        block; read back with ``column_values``. Call before the first ``issue_loads``.
        Vectors past the row end read as 0 (a predicated-off cp.async zero-fills, so
        vectors of at least 4 bytes only). Each of a block's rows holds its own copy."""
        cfg = self.cfg
        assert tiling.copies_async(mV.element_type, cfg), "only cp.async zero-fills"
        assert not cfg.row_shift, "a shifted row's columns: stage_shifted_columns"
        sV = self.column_buffer(smem, mV.element_type)
        copy = tiling.tiled_copy(tiling.g2s_copy_atom(mV.element_type, cfg), cfg)
        thr = copy.get_slice(self.tidx)
        rows = self.broadcast_rows(mV)
        for c in range(cfg.num_chunks):
            cute.copy(copy, thr.partition_S(self._gmem_tile(rows, c)),
                      thr.partition_D(sV[None, None, c]), pred=self.preds[c])
        cute.arch.cp_async_commit_group()
        cute.arch.cp_async_wait_group(0)
        return sV

    def column_buffer(self, smem, dtype) -> cute.Tensor:
        """Shared memory for this CTA's columns of a per-column vector, every chunk."""
        cfg = self.cfg
        return smem.allocate_tensor(
            dtype,
            cute.make_ordered_layout((*tiling.chunk_tiler(cfg), cfg.num_chunks), order=(1, 0, 2)),
            byte_alignment=16)

    def stage_shifted_columns(self, smem, mV: cute.Tensor) -> cute.Tensor:
        """This CTA's columns of the per-column vector ``mV`` (N,) lined up with its
        shifted row (restage_shifted_columns) in a buffer of their own, read back in
        whole vectors with ``column_values``."""
        sV = self.column_buffer(smem, mV.element_type)
        self.restage_shifted_columns(sV, mV)
        return sV

    @cute.jit
    def restage_shifted_columns(self, sV: cute.Tensor, mV: cute.Tensor):
        """Fill ``sV`` (stage_shifted_columns) at this view's shift: tile column p holds
        mV[p - shift] (0 outside the vector). The row's shift moves each of mV's values
        to another vector's place, so the values are copied one by one, by consecutive
        threads (coalesced 2-byte loads, conflict-free stores), and the block barrier
        here makes them visible to the threads that read them (the row's copies may be
        in flight meanwhile). Another shift's values there must be read by every thread
        first (a barrier before)."""
        cfg = self.cfg
        assert cfg.row_shift and cfg.rows_per_block == 1, "one shifted row a CTA"
        share = cute.make_tensor(sV.iterator, cute.make_layout(cfg.cols_per_cta))
        first = self.cta_rank * cfg.cols_per_cta - self.shift  # mV's column at share column 0
        for i in cutlass.range(cfg.cols_per_cta // cfg.threads_per_block, unroll_full=True):
            at = i * cfg.threads_per_block + self.tidx
            col = first + at
            value = mV[cutlass.max(cutlass.min(col, Int32(cfg.n_cols - 1)), Int32(0))]
            inside = (col >= 0) & (col < cfg.n_cols)
            share[at] = cutlass.select_(inside, value, mV.element_type(0))
        cute.arch.barrier()

    @cute.jit
    def shifted_column_values(self, mV: cute.Tensor, chunk: cutlass.Constexpr[int],
                              raw: cutlass.Constexpr[bool] = False) -> cute.TensorSSA:
        """fp32 values (``raw``: in mV's own dtype) of the per-column vector ``mV`` (N,)
        lined up with this thread's vectors of ``chunk`` of a shifted row: tile vector j
        holds mV[vec j - shift, vec (j + 1) - shift), the tail of mV's aligned vector
        j - 1 and the head of its vector j. Both are loaded whole (mV's base on 16
        bytes: the host's condition; mostly L1 hits, each vector is the next thread's
        vector before) and spliced in registers, in the one branch of ``vec`` that the
        CTA's shift takes (uniform: no divergence). Columns before mV read as 0; those
        past its end are unspecified (past the row end: no output takes them)."""
        cfg = self.cfg
        tXcX = self.coords[chunk]
        tiled = tiling.tiled_copy(tiling.vector_copy_atom(mV.element_type, cfg), cfg)
        thr = tiled.get_slice(self.tidx)
        pieces = []
        for vectors_back in (0, 1):
            start = mV.iterator + (-cfg.vec * vectors_back)
            view = cute.make_tensor(start, cute.make_layout((self.num_rows, cfg.n_cols + cfg.vec),
                                                            stride=(0, 1)))
            src = thr.partition_S(cute.local_tile(view, tiling.chunk_tiler(cfg),
                                                  (self.block_row, self.chunk_index(chunk))))
            piece = cute.make_fragment_like(src)
            piece.fill(0)
            # vectors starting inside mV (the one before: from the tiles' second vector)
            inside = tiling.vector_predicate(tXcX, cfg.n_cols + cfg.vec * vectors_back)
            if cutlass.const_expr(vectors_back == 1 and chunk == 0):
                inside[0, 0, 0] = inside[0, 0, 0] & (self._vector_start(chunk, 0, 0) >= cfg.vec)
            cute.copy(tiled, src, piece, pred=inside)
            pieces.append(piece)
        own, before = pieces
        # shift 0 takes ``own`` as it is; another shift overwrites it in its branch (every
        # value written on every path: ptxas then reads no register uninitialised)
        spliced = cute.make_fragment_like(own)
        spliced.store(own.load())
        for shift in cutlass.range_constexpr(1, cfg.vec):
            if self.shift == shift:
                for k in cutlass.range_constexpr(cute.size(tXcX, mode=[2])):
                    for v in cutlass.range_constexpr(cute.size(tXcX, mode=[0, 1])):
                        for e in cutlass.range_constexpr(cfg.vec):
                            spliced[(e, v), 0, k] = own[(e - shift, v), 0, k] if e >= shift \
                                else before[(cfg.vec + e - shift, v), 0, k]
        values = spliced.load()
        return values if cutlass.const_expr(raw) else self.to_fp32(values)

    @cute.jit
    def store_shifted_columns(self, mP: cute.Tensor, row, chunk: cutlass.Constexpr[int],
                              values: cute.TensorSSA):
        """Write this thread's per-column ``values`` of ``chunk`` of a shifted row (such as
        sums over the rows of one shift a CTA visits) to row ``row`` of ``mP`` (N
        per-column values a row) at their own columns, tile column less the shift: one
        value a store, since the shift moves them off the vector boundaries (a few times
        a CTA)."""
        cfg = self.cfg
        tXcX = self.coords[chunk]
        held = cute.make_rmem_tensor(cute.make_layout(tXcX.shape), Float32)
        held.store(values)
        for k in cutlass.range_constexpr(cute.size(tXcX, mode=[2])):
            for v in cutlass.range_constexpr(cute.size(tXcX, mode=[0, 1])):
                start = self._vector_start(chunk, v, k) - self.shift
                for e in cutlass.range_constexpr(cfg.vec):
                    if (start + e >= 0) & (start + e < cfg.n_cols):
                        mP[row, start + e] = held[(e, v), 0, k].to(mP.element_type)

    @cute.jit
    def column_values(self, sV: cute.Tensor, chunk: cutlass.Constexpr[int],
                      raw: cutlass.Constexpr[bool] = False) -> cute.TensorSSA:
        """fp32 values (``raw``: in sV's own dtype) of chunk ``chunk`` of a
        ``stage_columns`` or ``stage_shifted_columns`` vector."""
        thr = tiling.tiled_copy(tiling.vector_copy_atom(sV.element_type, self.cfg),
                                self.cfg).get_slice(self.tidx)
        src = thr.partition_S(sV[None, None, chunk])
        values = cute.make_fragment_like(src)
        cute.autovec_copy(src, values)
        return values.load() if cutlass.const_expr(raw) else self.to_fp32(values.load())

    @cute.jit
    def _pad_row_end(self, i: cutlass.Constexpr[int], chunk: cutlass.Constexpr[int]):
        """Write ``pad`` over this thread's vectors of ``chunk`` past the row end."""
        tXsX = self.copy_vec[i].get_slice(self.tidx).partition_D(self._smem_slot(i, chunk))
        padding = cute.make_fragment_like(tXsX)
        padding.fill(self.pad)
        outside = tiling.vector_predicate(self.coords[chunk], self.row_end, inside=False)
        cute.copy(self.copy_vec[i], padding, tXsX, pred=outside)
        if cutlass.const_expr(self.cfg.row_shift):
            self._copy_edge_values(chunk, padding, tXsX, in_row=False)

    @cute.jit
    def _copy_edge_values(self, chunk, src: cute.Tensor, dst: cute.Tensor,
                          in_row: cutlass.Constexpr[bool]):
        """Copy ``src``'s values of this thread's edge vectors in ``chunk`` (an int or a
        runtime index) of a shifted row (_edge_vector) to ``dst`` value by value: those in
        the row (``in_row``), or those outside it (the rows' beside it). A branch only the
        edges' threads take."""
        tXcX = self.chunk_coords(chunk)
        for k in cutlass.range_constexpr(cute.size(tXcX, mode=[2])):
            for v in cutlass.range_constexpr(cute.size(tXcX, mode=[0, 1])):
                if self._edge_vector(chunk, v, k):
                    for e in cutlass.range_constexpr(self.cfg.vec):
                        if self._value_in_row(chunk, v, k, e, in_row):
                            dst[(e, v), 0, k] = src[(e, v), 0, k]

    def _value_in_row(self, chunk: int, v: int, k: int, e: int, in_row: bool):
        """Whether value e of this thread's vector (v, k) in ``chunk`` is in the row
        (``in_row``; else: outside it)."""
        column = self._vector_start(chunk, v, k) + e
        if in_row:
            return (column >= self.shift) & (column < self.row_end)
        return (column < self.shift) | (column >= self.row_end)

    def _vector_start(self, chunk, v: int, k: int):
        """Column (of the tiles) of this thread's vector (v, k) in ``chunk``."""
        tXcX = self.chunk_coords(chunk)
        return tXcX[0][1] + tiling.column_offset(tXcX, ((0, v), 0, k))

    def _edge_vector(self, chunk, v: int, k: int):
        """Whether this thread's vector (v, k) in ``chunk`` (an int or a runtime index) of
        a shifted row holds some of the row but not all of it: the row starts or ends
        inside it."""
        cfg = self.cfg
        start = self._vector_start(chunk, v, k)
        edge = (start < self.row_end) & (start + cfg.vec > self.row_end)
        first_chunk = chunk == 0 if isinstance(chunk, int) else True
        if first_chunk and tiling.column_offset(self.chunk_coords(chunk), ((0, v), 0, k)) < cfg.vec:
            # (only a thread's first vector in a CTA's first chunk can start before the row)
            edge = edge | (start < self.shift)
        return edge

    def to_fp32(self, values: cute.TensorSSA) -> cute.TensorSSA:
        """``values`` (a chunk's, in their own dtype) widened to fp32 as this view's
        kernel widens them."""
        return tiling.to_fp32(values, self.widens_by_integer_ops)

    def wait_chunk(self, chunk: int):
        """Wait until this thread's copies of ``chunk`` have landed; with two staging
        buffers the next row block's loads (issued after this block's, see begin_block)
        may stay in flight."""
        if cutlass.const_expr(self.cfg.staging != "global" and not self.in_registers(chunk)):
            prefetched = self.load_groups if self.cfg.stages == 2 else 0
            cute.arch.cp_async_wait_group(self.load_groups - 1 - chunk + prefetched)
            if cutlass.const_expr(self.pad is not None):
                for i in range(len(self.staged)):
                    self._pad_row_end(i, chunk)

    @cute.jit
    def values(self, i: cutlass.Constexpr[int], chunk: cutlass.Constexpr[int], fill: cutlass.Constexpr = None,
               mask_rows: cutlass.Constexpr[bool] = False,
               raw: cutlass.Constexpr[bool] = False) -> cute.TensorSSA:
        """fp32 values (``raw``: in the tensor's own dtype) of staged tensor ``i`` in
        ``chunk``; past the row end they are ``fill`` when given (else unspecified; not
        with ``raw``). ``mask_rows``: rows past M read as 0 (the staging buffer of a row
        never loaded may hold anything, NaN included)."""
        cfg = self.cfg
        assert not (raw and fill is not None), "raw values are not filled"
        if cutlass.const_expr(cfg.staging == "global"):
            x = self.load(self.staged[i], chunk, raw=True)
        elif cutlass.const_expr(self.in_registers(chunk)):
            assert not mask_rows, "a register chunk's rows past M read as the pad"
            x = self.held[i, chunk]
        else:
            thr = self.copy_vec[i].get_slice(self.tidx)
            tXrX = cute.make_fragment_like(thr.partition_S(self._gmem_tile(self.staged[i], chunk)))
            if cutlass.const_expr(mask_rows):
                tXrX.fill(0)
                if self.row_in_bounds:
                    cute.autovec_copy(thr.partition_S(self._smem_slot(i, chunk)), tXrX)
            else:
                cute.autovec_copy(thr.partition_S(self._smem_slot(i, chunk)), tXrX)
            x = tXrX.load()
        if cutlass.const_expr(raw):
            return x
        x = self.to_fp32(x)
        if cutlass.const_expr(fill is not None and cfg.needs_col_predicate):
            if cutlass.const_expr(self.pad is not None):
                assert fill == self.pad, "values() past the row end are the staging pad"
            elif cutlass.const_expr(fill != 0.0):
                x = tiling.mask_out_of_row(x, self.coords[chunk], cfg.n_cols, fill)
            # (0 past the row end with no select: a predicated-off cp.async zero-fills its
            # vector, plain-load staging and load() fill 0 before their predicated copies)
        return x

    @cute.jit
    def in_row_sum(self, i: cutlass.Constexpr[int], chunk: cutlass.Constexpr[int]) -> Float32:
        """Sum of this thread's fp32 values of staged tensor ``i`` in ``chunk`` that lie in
        the row. A shifted row's pad is no sum's identity, so its vectors are summed
        whole where they lie inside the row (a select per vector) and its two edge
        vectors value by value, in a branch only their threads take."""
        if cutlass.const_expr(not self.cfg.row_shift):
            return red.thread_reduce(self.values(i, chunk, fill=0.0), cute.ReductionOp.ADD, 0.0)
        tXcX = self.coords[chunk]
        values = cute.make_rmem_tensor(cute.make_layout(tXcX.shape), Float32)
        values.store(self.values(i, chunk))
        whole = self._whole_vectors_in_row(chunk)
        total = cute.make_rmem_tensor(cute.make_layout(1), Float32)
        total[0] = Float32(0.0)
        for k in cutlass.range_constexpr(cute.size(tXcX, mode=[2])):
            for v in cutlass.range_constexpr(cute.size(tXcX, mode=[0, 1])):
                vector_sum = values[(0, v), 0, k]
                for e in cutlass.range_constexpr(1, self.cfg.vec):
                    vector_sum = vector_sum + values[(e, v), 0, k]
                total[0] = total[0] + cutlass.select_(whole[v, 0, k], vector_sum, Float32(0.0))
                if self._edge_vector(chunk, v, k):
                    for e in cutlass.range_constexpr(self.cfg.vec):
                        if self._value_in_row(chunk, v, k, e, in_row=True):
                            total[0] = total[0] + values[(e, v), 0, k]
        return total[0]

    @cute.jit
    def mask_outside_row(self, values: cute.TensorSSA, chunk: cutlass.Constexpr[int],
                         fill: Float32) -> cute.TensorSSA:
        """``values`` (fp32, this thread's of ``chunk``) with those outside the row
        replaced by ``fill`` (the identity of the reduction that follows): vectors past
        the row end (tiling.mask_out_of_row); a shifted row's whole vectors by one flag
        each, its two edge vectors value by value, in a branch only their threads take."""
        if cutlass.const_expr(not self.cfg.row_shift):
            return tiling.mask_out_of_row(values, self.coords[chunk], self.cfg.n_cols, fill)
        tXcX = self.coords[chunk]
        inside = cute.make_rmem_tensor(cute.make_layout(tXcX.shape), Boolean)
        whole = self._whole_vectors_in_row(chunk)
        for k in cutlass.range_constexpr(cute.size(tXcX, mode=[2])):
            for v in cutlass.range_constexpr(cute.size(tXcX, mode=[0, 1])):
                for e in cutlass.range_constexpr(self.cfg.vec):
                    inside[(e, v), 0, k] = whole[v, 0, k]
                if self._edge_vector(chunk, v, k):
                    for e in cutlass.range_constexpr(self.cfg.vec):
                        inside[(e, v), 0, k] = self._value_in_row(chunk, v, k, e, in_row=True)
        return cute.where(inside.load(), values, fill)

    def first_value_in_row(self):
        """Whether this thread's first value (of its first chunk) lies in the row: a
        shifted row's first thread may start on the values of the row before it."""
        if cutlass.const_expr(not self.cfg.row_shift):
            return Boolean(True)
        return self._value_in_row(0, 0, 0, 0, in_row=True)

    def values_in_row(self) -> Int32:
        """How many of this thread's values lie inside the row (whole vectors are in or
        out: cfg.vec values per in-row flag; a shifted row's edge vectors partly)."""
        cfg = self.cfg
        if cutlass.const_expr(cfg.row_shift):
            return self._shifted_values_in_row()
        if not cfg.needs_col_predicate:
            return Int32(cfg.thread_values)
        count = Int32(0)
        for c in range(cfg.num_chunks):
            for i in range(cute.size(self.preds[c])):
                count = count + cutlass.select_(self.preds[c][i], Int32(cfg.vec), Int32(0))
        return count

    def _shifted_values_in_row(self) -> Int32:
        """values_in_row of a shifted row: each vector's values before the row end, less
        the ``shift`` values before the row in its first vector (the span's first)."""
        cfg = self.cfg
        count = Int32(0)
        for c in range(cfg.num_chunks):
            tXcX = self.coords[c]
            for k in range(cute.size(tXcX, mode=[2])):
                for v in range(cute.size(tXcX, mode=[0, 1])):
                    before_end = self.row_end - self._vector_start(c, v, k)
                    count = count + cutlass.min(cutlass.max(before_end, Int32(0)), Int32(cfg.vec))
        starts_span = self._vector_start(0, 0, 0) == 0
        return count - cutlass.select_(starts_span, self.shift, Int32(0))

    def holds_column(self, chunk: int, col: Int32):
        """(does this thread hold column ``col`` of its row in ``chunk``, the column's
        offset from the thread's first value); ``col`` negative: none. A thread holds
        vectors t, t + threads_per_row, ... (tiling.chunk_tv_layout)."""
        cfg = self.cfg
        tile_col = col + self.shift if cutlass.const_expr(cfg.row_shift) else col
        offset = tile_col - self.coords[chunk][0][1]
        stride = cfg.vec * cfg.threads_per_row
        assert stride & (stride - 1) == 0, "a column's place found by a mask"
        held = (offset >= 0) & (offset < stride * cfg.vecs_per_thread) \
            & ((offset & (stride - 1)) < cfg.vec)
        if cutlass.const_expr(cfg.row_shift):
            held = held & (col >= 0)  # (-1 + shift would be the row before's last value)
        return held, offset

    @cute.jit
    def take_column(self, i: cutlass.Constexpr[int], chunk: cutlass.Constexpr[int], col: Int32,
                    fill: cutlass.Constexpr[float]) -> Float32:
        """Staged tensor ``i``'s value (fp32) at column ``col`` of this thread's row, if
        this thread staged that column in ``chunk`` (else 0), replaced in the staging
        buffer by ``fill``, so that ``values`` reads ``fill`` there. Call after
        ``wait_chunk(chunk)``; no barrier is needed, since each thread reads back only
        what it copied itself."""
        held, offset = self.holds_column(chunk, col)
        value = Float32(0.0)
        if cutlass.const_expr(self.in_registers(chunk)):
            # (the values compared inside the branch: only the warp holding the column
            # pays for them; is_column takes no shift)
            assert not self.cfg.row_shift, "a shifted row's register chunk"
            raw = self.held[i, chunk]
            landing = cute.make_rmem_tensor(raw.shape, raw.dtype)
            landing.store(raw)
            if held:
                at = tiling.is_column(self.coords[chunk], col, True)
                x = landing.load()
                value = red.thread_reduce(cute.where(at, x.to(Float32), Float32(0.0)),
                                          cute.ReductionOp.ADD, 0.0)
                landing.store(cute.where(at, raw.dtype(fill), x))
            self.held[i, chunk] = landing.load()
        elif held:
            cfg = self.cfg
            tile = self._smem_slot(i, chunk)
            at = (self.tidx // cfg.threads_per_row,
                  self.tidx % cfg.threads_per_row * cfg.vec + offset)
            value = Float32(tile[at])
            tile[at] = tile.element_type(fill)
        return value

    @cute.jit
    def store_column(self, mY: cute.Tensor, col: Int32, value: Float32):
        """Write ``value`` to column ``col`` of this thread's row of mY if this thread
        holds that column (in any chunk). Call after the row's ``store``s: it replaces
        what the vector store wrote there (same thread, same address: program order)."""
        held = Boolean(False)
        for c in cutlass.range_constexpr(self.cfg.num_chunks):
            held = held | self.holds_column(c, col)[0]
        if held & self.row_in_bounds:
            mY[self.row, col] = value.to(mY.element_type)

    def chunk_coords(self, chunk):
        """Coordinates of this thread's values in ``chunk``: precomputed for a
        compile-time chunk, computed for a runtime index (a dynamic loop streaming a
        long share chunk by chunk)."""
        if isinstance(chunk, int):
            return self.coords[chunk]
        tile = cute.local_tile(cute.make_identity_tensor(self.coord_shape),
                               tiling.chunk_tiler(self.cfg), (self.block_row, self.chunk_index(chunk)))
        return self.copy_vec[0].get_slice(self.tidx).partition_S(tile)

    def chunk_predicate(self, chunk):
        """Per-vector in-row flags of ``chunk`` (see chunk_coords)."""
        if isinstance(chunk, int):
            return self.preds[chunk]
        return tiling.vector_predicate(self.chunk_coords(chunk), self.row_end)

    @cute.jit
    def load(self, mX: cute.Tensor, chunk, fill: cutlass.Constexpr = 0.0,
             guard_rows: cutlass.Constexpr[bool] = True,
             raw: cutlass.Constexpr[bool] = False,
             l2_policy: cutlass.Constexpr = None) -> cute.TensorSSA:
        """fp32 values (``raw``: in mX's own dtype) of an unstaged (M, N) tensor (or a
        ``broadcast_rows`` vector, with ``guard_rows=False``) in ``chunk`` (an int, or a
        runtime index), read straight from global memory; vectors past the row end (and
        rows past M when guarded) read as ``fill``, as do the values of a shifted row's
        edge vectors outside it. ``l2_policy``: a key of tiling.L2_POLICIES."""
        atom, hint = tiling.global_copy_atom(mX.element_type, self.cfg, False, l2_policy)
        tiled = tiling.tiled_copy(atom, self.cfg)
        thr = tiled.get_slice(self.tidx)
        tXgX = thr.partition_S(self._gmem_tile(mX, chunk))
        tXrX = cute.make_fragment_like(tXgX)
        tXrX.fill(fill)
        # (the predicate is built where it is used: a register tensor cannot enter a
        # runtime branch from outside it)
        if cutlass.const_expr(guard_rows):
            if self.row_in_bounds:
                cute.copy(tiled, tXgX, tXrX, pred=self.chunk_predicate(chunk), **hint)
        else:
            cute.copy(tiled, tXgX, tXrX, pred=self.chunk_predicate(chunk), **hint)
        if cutlass.const_expr(self.cfg.row_shift):
            padding = cute.make_fragment_like(tXrX)
            padding.fill(fill)
            self._copy_edge_values(chunk, padding, tXrX, in_row=False)
        return tXrX.load() if cutlass.const_expr(raw) else self.to_fp32(tXrX.load())

    def accumulator(self, smem, chunk: int, in_registers: bool) -> cute.Tensor:
        """fp32 per-column sums of this thread's values in ``chunk`` that live across
        row blocks: in registers, or in shared memory when the share's sums would not
        fit there (each thread only touches its own elements, so no barrier is needed).
        Zero-initialised."""
        if in_registers:
            acc = self._register_fragment(chunk)
        else:
            sAcc = smem.allocate_tensor(
                Float32, cute.make_ordered_layout(tiling.chunk_tiler(self.cfg), order=(1, 0)),
                byte_alignment=16)
            acc = self.copy_vec[0].get_slice(self.tidx).partition_S(sAcc)
        acc.fill(0.0)
        return acc

    def kept_in_registers(self, values: cute.TensorSSA, chunk: int) -> cute.Tensor:
        """fp32 ``values`` of this thread's part of ``chunk`` kept in registers across
        row blocks (e.g. a per-column vector that every block reads); ``.load()`` them."""
        fragment = self._register_fragment(chunk)
        fragment.store(values)
        return fragment

    def _register_fragment(self, chunk: int) -> cute.Tensor:
        thr = self.copy_vec[0].get_slice(self.tidx)
        return cute.make_rmem_tensor(
            thr.partition_S(self._gmem_tile(self.staged[0], chunk)).shape, Float32)

    @cute.jit
    def store(self, mY: cute.Tensor, chunk: cutlass.Constexpr[int], values: cute.TensorSSA,
              guard_rows: cutlass.Constexpr[bool] = True, l2_policy: cutlass.Constexpr = None):
        """Convert to mY's dtype and write the in-bounds vectors of ``chunk`` (all rows
        of the block when ``guard_rows=False``, e.g. rows of partial sums). ``l2_policy``:
        a key of tiling.L2_POLICIES (not for shifted rows)."""
        assert l2_policy is None or not self.cfg.row_shift, \
            "a shifted row's store takes no L2 policy"
        atom, hint = tiling.global_copy_atom(mY.element_type, self.cfg, True, l2_policy)
        tiled = tiling.tiled_copy(atom, self.cfg)
        thr = tiled.get_slice(self.tidx)
        tYgY = thr.partition_D(self._gmem_tile(mY, chunk))
        tYrY = cute.make_fragment_like(tYgY)
        tYrY.store(values.to(mY.element_type))
        if cutlass.const_expr(self.cfg.row_shift):
            if self.row_in_bounds:
                self._store_shifted(tiled, tYrY, tYgY, chunk)
        elif cutlass.const_expr(guard_rows):
            if self.row_in_bounds:
                cute.copy(tiled, tYrY, tYgY, pred=self.preds[chunk], **hint)
        else:
            cute.copy(tiled, tYrY, tYgY, pred=self.preds[chunk], **hint)

    @cute.jit
    def _store_shifted(self, tiled, tYrY: cute.Tensor, tYgY: cute.Tensor,
                       chunk: cutlass.Constexpr[int]):
        """A shifted row's store: whole vectors inside the row, its two edge vectors
        value by value (their other values are the rows' beside it)."""
        cute.copy(tiled, tYrY, tYgY, pred=self._whole_vectors_in_row(chunk))
        self._copy_edge_values(chunk, tYrY, tYgY, in_row=True)

    def _whole_vectors_in_row(self, chunk: int) -> cute.Tensor:
        """Per-vector flags of ``chunk`` of a shifted row: does the vector lie wholly
        inside the row (not an edge vector, nor past the row end)?"""
        inside = tiling.vector_predicate(self.coords[chunk], self.row_end - self.cfg.vec + 1)
        if chunk == 0:
            # the first vector of the row, where it starts inside it (shift > 0)
            inside[0, 0, 0] = inside[0, 0, 0] & (self._vector_start(chunk, 0, 0) >= self.shift)
        return inside
