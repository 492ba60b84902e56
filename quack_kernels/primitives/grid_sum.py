"""A sum over every CTA of a grid within one launch, bitwise reproducible.

Each CTA adds its threads' values and publishes them as tagged words (value and ready
flag in one 64-bit store, reduce.tagged_word); gathering CTAs poll the words in a fixed
order, add them, and zero them for the stream's next launch. No atomics, no second
launch, no grid-wide barrier: only CTAs of higher index wait, for CTAs of lower index.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, Int64

from . import reduce as red
from .config import GRID_SUM_GROUPS, GRID_SUM_SLOTS_IN_FLIGHT, grid_sum_slots


class GridSum:
    """Mixin of kernels whose grid adds values over all of its CTAs (grid x; y is the
    cluster's CTAs along a row, only rank 0 takes part). Needs ``self.cfg`` with
    ``threads_per_block``: the launch's CTA size."""

    @cute.jit
    def grid_sum(self, values: tuple, partials: cute.Tensor, scratch: cute.Tensor):
        """(whether this CTA holds the result, the sum of ``values`` over every thread
        of the grid's CTAs of cluster rank 0), for a grid-wide result with no second
        launch. Each CTA adds its threads' values (block_sum; ``scratch`` as there) and
        thread 0 publishes them as red.tagged_word (value and ready flag in one store),
        so a CTA ends without a fence or an atomic (one of each per CTA, and the last
        CTA reading every row back, cost up to 13 us per launch at 8192 CTAs). The
        CTAs come in groups (config.GRID_SUM_GROUPS); each group's last CTA polls its group's words until they are ready, adds them and its own, and
        publishes the group's sum the same way; the grid's last CTA adds the
        groups'. Each gathering is one round of loads per GRID_SUM_SLOTS_IN_FLIGHT x
        threads CTAs, in an order fixed by the grid and block sizes (bitwise
        reproducible), and zeroes the words it read for the stream's next launch.
        ``partials``: int64, len(values) words per slot of config.grid_sum_slots, all 0
        at launch. A gathering CTA waits only for CTAs of lower index, started before it
        in practice, and there are at most GRID_SUM_GROUPS of them. Every thread calls
        it; the result is valid in every thread of the holding CTA."""
        n = len(values)
        block = cute.arch.block_idx()
        last = cute.arch.grid_dim()[0] - 1
        one_round = self.cfg.threads_per_block * GRID_SUM_SLOTS_IN_FLIGHT
        spread = (last + GRID_SUM_GROUPS) // GRID_SUM_GROUPS  # row blocks / groups, rounded up
        group_size = cutlass.select_(spread > one_round, spread, Int32(one_round))
        group = block[0] // group_size
        leader = group * group_size + group_size - 1
        leader = cutlass.select_(leader < last, leader, last)
        holds = (block[0] == last) & (block[1] == 0)
        result = values
        if block[1] == 0:  # rows are led by the first CTA of a cluster
            total = red.block_sum(values, scratch)
            result = total
            second_level = n * grid_sum_slots(self.cfg, last + 1, first_level=True)
            if block[0] == leader:
                gathered = self._gather(partials, 0, group * group_size, block[0], n, scratch)
                result = tuple(g + t for g, t in zip(gathered, total))
                if block[0] == last:
                    groups = self._gather(partials, second_level, 0, group, n, scratch)
                    result = tuple(g + r for g, r in zip(groups, result))
                else:
                    self._publish(partials, second_level + group * n, result)
            else:
                self._publish(partials, block[0] * n, total)
        return holds, result

    @cute.jit
    def _publish(self, partials: cute.Tensor, at: Int32, values: tuple):
        """Thread 0 stores ``values`` as tagged words at ``partials[at:]``."""
        if cute.arch.thread_idx()[0] == 0:
            for j in cutlass.range_constexpr(len(values)):
                cute.arch.store(partials.iterator + (at + j), red.tagged_word(values[j]),
                                sem="relaxed", scope="gpu")

    @cute.jit
    def _gather(self, partials: cute.Tensor, offset: Int32, start: Int32, end: Int32, n: int,
                scratch: cute.Tensor) -> tuple:
        """The sum of the n-value slots start .. end - 1 at ``partials[offset:]``, each
        polled until its words are ready and then zeroed, in every thread. Warp-uniform
        control only (the same trip count in every thread, the polling loop's exit voted
        over the warp): a lane-dependent spin loop had the compiler reconverge the warps
        with a WARPSYNC before block_sum's shuffles."""
        threads = self.cfg.threads_per_block
        tidx = cute.arch.thread_idx()[0]
        gathered = (Float32(0.0),) * n
        for first in cutlass.range(start, end, threads * GRID_SUM_SLOTS_IN_FLIGHT, unroll=1):
            # slots at constant offsets from one base (one address register); a slot
            # past the end (grid_sum_slots leaves room for them) counts as ready and 0
            base = offset + (first + tidx) * n
            inside = [first + k * threads + tidx < end for k in range(GRID_SUM_SLOTS_IN_FLIGHT)]
            words, ready = self._load_grid_words(partials, base, inside, n)
            while not cute.arch.vote_all_sync(ready):
                words, ready = self._load_grid_words(partials, base, inside, n)
            for k in cutlass.range_constexpr(GRID_SUM_SLOTS_IN_FLIGHT):
                gathered = tuple(
                    g + cutlass.select_(inside[k], red.word_value(words[k * n + j]), Float32(0.0))
                    for j, g in enumerate(gathered))
                if inside[k]:
                    for j in cutlass.range_constexpr(n):
                        cute.arch.store(partials.iterator + (base + (k * threads * n + j)),
                                        Int64(0), sem="relaxed", scope="gpu")
        cute.arch.barrier()  # block_sum's scratch again
        return red.block_sum(gathered, scratch)

    @cute.jit
    def _load_grid_words(self, partials: cute.Tensor, base: Int32, inside: list, n: int):
        """_gather's words of the slots at ``base`` + k threads (all loaded before any
        is used, so their loads are in flight together) and whether every one inside
        the range is ready."""
        threads = self.cfg.threads_per_block
        words = []
        ready = Boolean(True)
        for k in cutlass.range_constexpr(len(inside)):
            for j in cutlass.range_constexpr(n):
                words.append(cute.arch.load(partials.iterator + (base + (k * threads * n + j)),
                                            Int64, sem="relaxed", scope="gpu"))
        for k in cutlass.range_constexpr(len(inside)):
            for j in cutlass.range_constexpr(n):
                ready = ready & (red.word_ready(words[k * n + j]) | ~inside[k])
        return tuple(words), ready
