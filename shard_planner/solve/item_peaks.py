"""The linear model's peak of a one-unit-per-item cover with one item changed, in O(1) per trial.

:func:`cpsat.item_greedy_cover` tries, item by item, faster options until one fits: thousands of covers
that differ from the current one in a single item (Llama 70B's screen: ~6,700, 1 s of
:func:`linear.evaluate` at O(items) each). :class:`ItemCoverPeaks` answers each trial from prefix and
suffix maxima of the current cover, and rebuilds them (O(items)) only when an item changes.

The peak is :func:`linear.evaluate`'s, regrouped. With the cover's units in item order, S_j the stack of the
units before j, and per unit

    A_j = max(fwd_j + gather_{j+1} [forward prefetch >= 1], copy_j + prev_out_{j-1})
    B_j = max(bwd_j + regather_{j-1} + rs_in_{j+1}, rs_j + regather_{j-1})

(terms of units outside the cover 0), the peak is the largest of the optimizer step,
``shared + loss + S_n`` and ``shared + max_j(S_j + A_j) + extra_f``, ``shared + max_j(S_j + B_j) + extra_b``,
where ``shared`` = base + the units' root terms (+ one process group when any unit reshards to an int) and
``extra_f``, ``extra_b`` are the prefetch depths' multiples of the largest gather. Changing unit i moves
S_j by the change of its stack for j > i, and A_j, B_j only for j in i-1..i+1: the rest are the cached
maxima. Every term is an integer (MiB), so the answer equals :func:`linear.evaluate`'s exactly
(tests/solve/test_item_peaks.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

from shard_planner.solve.linear import LinearModel

_NEG = float("-inf")


class ItemCoverPeaks:
    """Peaks of ``cover`` (one single-item candidate per item, in item order) and of its one-item
    variants (:meth:`with_item`); :meth:`set` changes an item."""

    def __init__(self, lm: LinearModel, cover: Sequence[int]):
        self.lm, self.cover = lm, list(cover)
        self.gather_next = lm.forward_depth >= 1
        self.f_mult, self.b_mult = max(0, lm.forward_depth - 1), lm.backward_depth - 1
        self._rebuild()

    def _rebuild(self) -> None:
        co = [self.lm.coeffs[k] for k in self.cover]
        self.co, n = co, len(co)
        self.starts = list(accumulate((c.stack_mib for c in co), initial=0))  # S_0..S_n
        self.root = sum(c.root_mib for c in co)
        self.int_reshard = sum(1 for c in co if c.uses_int_reshard)
        self.gathers = [c.gather_mib for c in co]
        # S_j + A_j and S_j + B_j (the module docstring) for every j at once, each neighbour's term as a
        # list shifted by one (0 beyond the ends)
        nxt_gather = self.gathers[1:] + [0] if self.gather_next else [0] * n
        prev_out = [0] + [c.prev_out_mib for c in co[:-1]]
        regather = [0] + [c.regather_mib for c in co[:-1]]
        nxt_rs_in = [c.rs_in_mib for c in co[1:]] + [0]
        self.xs = [s + max(c.fwd_mib + g, c.copy_mib + p) for s, c, g, p in zip(self.starts, co, nxt_gather, prev_out)]
        self.ys = [s + max(c.bwd_mib + r + q, c.rs_mib + r) for s, c, r, q in zip(self.starts, co, regather, nxt_rs_in)]
        self._maxima()

    def _maxima(self) -> None:
        """The prefix and suffix maxima of the gathers and of S_j + A_j, S_j + B_j."""
        xs, ys, gathers = self.xs, self.ys, self.gathers
        self.gather_before = list(accumulate(gathers, max, initial=_NEG))  # max over units < j
        self.gather_after = list(accumulate(reversed(gathers), max, initial=_NEG))[::-1]  # over units >= j
        self.x_before, self.y_before = (list(accumulate(v, max, initial=_NEG)) for v in (xs, ys))
        self.x_after, self.y_after = (list(accumulate(reversed(v), max, initial=_NEG))[::-1] for v in (xs, ys))

    def _x_y(self, j: int) -> tuple[int, int]:
        """S_j + A_j and S_j + B_j of the current cover (the module docstring)."""
        co, n = self.co, len(self.co)
        c = co[j]
        nxt = co[j + 1] if j + 1 < n else None
        prev = co[j - 1] if j > 0 else None
        regather = prev.regather_mib if prev is not None else 0
        s = self.starts[j]
        return (s + max(c.fwd_mib + (nxt.gather_mib if self.gather_next and nxt is not None else 0),
                        c.copy_mib + (prev.prev_out_mib if prev is not None else 0)),
                s + max(c.bwd_mib + regather + (nxt.rs_in_mib if nxt is not None else 0), c.rs_mib + regather))

    def with_item(self, i: int, k: int) -> int:
        """The linear peak (MiB) of the cover with item ``i``'s unit replaced by candidate ``k``."""
        lm, old, new = self.lm, self.co[i], self.lm.coeffs[k]
        n, delta = len(self.co), new.stack_mib - old.stack_mib
        ints = self.int_reshard - old.uses_int_reshard + new.uses_int_reshard
        shared = lm.base_mib + self.root - old.root_mib + new.root_mib + (lm.process_group_mib if ints else 0)
        gmax = max(self.gather_before[i], self.gather_after[i + 1], new.gather_mib)
        # Units i-1..i+1 change their A and B (the module docstring's, unit i's terms replaced by ``new``);
        # their neighbours i-2 and i+2 come along as context.
        co, gather_next = self.co, self.gather_next
        lo, hi = max(0, i - 1), min(n, i + 2)
        x, y = self.x_before[lo], self.y_before[lo]
        for j in range(lo, hi):
            c = new if j == i else co[j]
            nxt = (new if j + 1 == i else co[j + 1]) if j + 1 < n else None
            prev = (new if j - 1 == i else co[j - 1]) if j > 0 else None
            regather = prev.regather_mib if prev is not None else 0
            s = self.starts[j] + (delta if j > i else 0)
            x = max(x, s + max(c.fwd_mib + (nxt.gather_mib if gather_next and nxt is not None else 0),
                               c.copy_mib + (prev.prev_out_mib if prev is not None else 0)))
            y = max(y, s + max(c.bwd_mib + regather + (nxt.rs_in_mib if nxt is not None else 0), c.rs_mib + regather))
        x, y = max(x, self.x_after[hi] + delta), max(y, self.y_after[hi] + delta)
        return max(lm.optimizer_mib, shared + lm.loss_mib + self.starts[n] + delta,
                   shared + x + self.f_mult * gmax, shared + y + self.b_mult * gmax)

    def set(self, i: int, k: int) -> None:
        """Item ``i`` takes candidate ``k``: S_j moves by the change of its stack for j > i, A_j and B_j
        change for j in i-1..i+1 only (the module docstring); then the maxima again. The same integers as
        a rebuild of the new cover."""
        if self.cover[i] == k:
            return
        old, new = self.co[i], self.lm.coeffs[k]
        delta, n = new.stack_mib - old.stack_mib, len(self.co)
        self.cover[i], self.co[i], self.gathers[i] = k, new, new.gather_mib
        self.root += new.root_mib - old.root_mib
        self.int_reshard += new.uses_int_reshard - old.uses_int_reshard
        if delta:
            self.starts[i + 1:] = [s + delta for s in self.starts[i + 1:]]
            self.xs[i + 2:] = [x + delta for x in self.xs[i + 2:]]
            self.ys[i + 2:] = [y + delta for y in self.ys[i + 2:]]
        for j in range(max(0, i - 1), min(n, i + 2)):
            self.xs[j], self.ys[j] = self._x_y(j)
        self._maxima()
