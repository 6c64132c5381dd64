"""The free-GPU timeline F(t): GPUs not yet reserved by admitted jobs' plans.

A step function over scheduling slots, kept as sorted breakpoints because
plans are long runs of constant width: a few hundred breakpoints describe
months of reservations, where a per-slot array would hold millions of cells.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Iterator

from scheduler_service.policy.plan import Stretch


class Timeline:
    def __init__(self, capacity: int, origin: int = 0) -> None:
        self.capacity = capacity
        # Segment i covers slots [_starts[i], _starts[i+1]) (the last is unbounded)
        # with _used[i] GPUs reserved.
        self._starts: list[int] = [origin]
        self._used: list[int] = [0]

    def copy(self) -> "Timeline":
        other = Timeline(self.capacity)
        other._starts, other._used = list(self._starts), list(self._used)
        return other

    def free_at(self, slot: int) -> int:
        i = bisect_right(self._starts, slot) - 1
        return self.capacity - self._used[max(i, 0)]

    def free_for(self, slot: int, gpus: int, hi: int) -> int:
        """Slots from `slot` (at most to `hi`) during which `gpus` GPUs stay unreserved."""
        for start, end, free in self.forward(slot, hi):
            if free < gpus:
                return start - slot
        return hi - slot

    @property
    def last_change(self) -> int:
        """From this slot on nothing is reserved."""
        return self._starts[-1]

    def backward(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """Segments (start, end, free) covering [lo, hi), latest first."""
        starts, used, cap = self._starts, self._used, self.capacity
        i = bisect_right(starts, hi - 1) - 1
        end = hi
        while i >= 0 and end > lo:
            start = max(starts[i], lo)
            yield start, end, cap - used[i]
            end = start
            i -= 1

    def forward(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """Segments (start, end, free) covering [lo, hi), earliest first
        (like `backward`, nothing before the origin)."""
        starts, used, cap = self._starts, self._used, self.capacity
        t = max(lo, starts[0])
        i = bisect_right(starts, t) - 1
        while t < hi:
            end = min(starts[i + 1] if i + 1 < len(starts) else hi, hi)
            yield t, end, cap - used[i]
            t = end
            i += 1

    def _split(self, slot: int) -> int:
        """Index of the segment starting exactly at `slot`, creating it if needed."""
        i = bisect_right(self._starts, slot) - 1
        if i >= 0 and self._starts[i] == slot:
            return i
        if i < 0:  # before the origin: nothing reserved there
            self._starts.insert(0, slot)
            self._used.insert(0, 0)
            return 0
        self._starts.insert(i + 1, slot)
        self._used.insert(i + 1, self._used[i])
        return i + 1

    def add(self, runs: tuple[Stretch, ...] | list[Stretch], sign: int = 1, since: int | None = None) -> None:
        """Reserve (sign=+1) or release (sign=-1) the runs' GPUs, from `since` on."""
        for run in runs:
            start = run.start if since is None else max(run.start, since)
            if start >= run.end or run.gpus == 0:
                continue
            a = self._split(start)
            b = self._split(run.end)
            used = self._used
            for k in range(a, b):
                used[k] += sign * run.gpus
            self._merge(b)
            self._merge(a)

    def _merge(self, k: int) -> None:
        """Join segment k with the one before it if they hold the same; only
        the edges of a changed range can have become equal, so merging there
        keeps the list minimal without scanning it (admission at 10,000 jobs)."""
        if 0 < k < len(self._starts) and self._used[k] == self._used[k - 1]:
            del self._starts[k]
            del self._used[k]

    def advance(self, slot: int) -> None:
        """Forget the past before `slot` (it can no longer be planned)."""
        i = bisect_right(self._starts, slot) - 1
        if i > 0:
            del self._starts[:i]
            del self._used[:i]
        if self._starts[0] < slot:
            self._starts[0] = slot

    def segments(self) -> list[tuple[int, int]]:
        """(start, reserved GPUs) pairs; for tests and reports."""
        return list(zip(self._starts, self._used))
