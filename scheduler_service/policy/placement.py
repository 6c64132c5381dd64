"""Buddy placement: every job gets one aligned power-of-two block of GPU ids.

An aligned block is compact in the topology (one node, or whole neighbouring
nodes), so a job runs at the speed its curve was profiled at wherever it
lands. With power-of-two sizes, any set of requests whose total fits the
cluster can be placed once jobs may be moved (placing largest first packs them
without holes), so admission can reason in GPU counts and `place` proves it
with a concrete placement. Moves cost a restart, so `place` keeps every job
that did not change size where it is and moves as few jobs as it can.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from scheduler_service.policy.jobs import floor_pow2, is_power_of_two
from scheduler_service.policy.topology import Topology

Block = tuple[int, int]  # (first GPU id, size)


class PlacementError(ValueError):
    """The requests cannot be placed: more GPUs asked than the cluster has, or a bad size."""


@dataclass(slots=True)
class Placement:
    blocks: dict[str, Block] = field(default_factory=dict)
    moved: set[str] = field(default_factory=set)  # kept their size but changed GPUs

    def gpus(self, job_id: str) -> tuple[int, ...]:
        first, size = self.blocks[job_id]
        return tuple(range(first, first + size))


class BuddyAllocator:
    """Free lists of aligned blocks by size, splitting and merging buddies."""

    def __init__(self, num_gpus: int) -> None:
        self.num_gpus = num_gpus
        self._free: dict[int, set[int]] = {}
        # The cluster may not be a power of two (e.g. 48 nodes): cover it with
        # maximal aligned blocks, largest first.
        start, size = 0, floor_pow2(num_gpus)
        while start < num_gpus:
            while start + size > num_gpus or start % size:
                size >>= 1
            self._free.setdefault(size, set()).add(start)
            start += size
        self._top = {start: size for size, starts in self._free.items() for start in starts}

    def take(self, size: int, avoid: tuple[Block, ...] = ()) -> int | None:
        """Allocate an aligned block; lowest address among the smallest fitting
        free blocks, outside every block of `avoid` if any such block is free."""
        if avoid:
            free = sorted((have, base) for have, starts in self._free.items() if have >= size for base in starts)
            clear = (sub for have, base in free for sub in range(base, base + have, size)
                     if not _overlaps((sub, size), avoid))
            start = next(clear, None)
            if start is not None:
                self.take_at(start, size)
                return start
        candidates = [s for s, starts in self._free.items() if s >= size and starts]
        if not candidates:
            return None
        have = min(candidates)
        start = min(self._free[have])
        self._free[have].discard(start)
        while have > size:  # split, keep the upper half free
            have >>= 1
            self._free.setdefault(have, set()).add(start + have)
        return start

    def take_at(self, start: int, size: int) -> bool:
        """Allocate exactly [start, start+size) if it is free."""
        for have, starts in sorted(self._free.items()):
            if have < size:
                continue
            base = start - start % have
            if base in starts:
                starts.discard(base)
                while have > size:
                    have >>= 1
                    upper = base + have
                    if start >= upper:
                        self._free.setdefault(have, set()).add(base)
                        base = upper
                    else:
                        self._free.setdefault(have, set()).add(upper)
                return True
        return False

    def give(self, start: int, size: int) -> None:
        while True:
            if self._top.get(start) == size:
                break
            buddy = start ^ size
            starts = self._free.get(size)
            if starts is None or buddy not in starts:
                break
            starts.discard(buddy)
            start = min(start, buddy)
            size <<= 1
        self._free.setdefault(size, set()).add(start)

    def free_gpus(self) -> int:
        return sum(size * len(starts) for size, starts in self._free.items())


class BuddyPlacer:
    """Keeps the current placement and moves it to a new set of job sizes."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._alloc = BuddyAllocator(topology.num_gpus)
        self.blocks: dict[str, Block] = {}
        self._pinned: frozenset[str] | set[str] = frozenset()
        self._fragile: frozenset[str] | set[str] = frozenset()
        self._growing: Mapping[str, Block] = {}

    def place(
        self,
        sizes: Mapping[str, int],
        pinned: frozenset[str] | set[str] = frozenset(),
        fragile: frozenset[str] | set[str] = frozenset(),
        growing: Mapping[str, Block] = {},
    ) -> Placement:
        """Place every job with a positive size; jobs absent or at 0 release their GPUs.

        A resized job stays inside (or grows around) its old block when it can.
        When fragmentation forces moves, jobs in `pinned` (those that cannot
        afford a restart) are moved only if nothing else works, and jobs in
        `fragile` (those that can afford one but not two) only after all others.
        A job put somewhere new avoids, where it can, the block another job
        will grow into (`growing`: job -> that block, from the plans): put
        there, it would be moved when that job grows. On ITP cluster07 (128
        GPUs, the paper's policy through the loop) a job moved for one planned
        growth landed where the next would need it, was moved again, and
        missed its deadline by 13 s.
        """
        total = 0
        for job_id, size in sizes.items():
            if size and not is_power_of_two(size):
                raise PlacementError(f"job {job_id}: {size} GPUs is not a power of two")
            total += size
        if total > self.topology.num_gpus:
            raise PlacementError(f"{total} GPUs requested, the cluster has {self.topology.num_gpus}")

        self._pinned, self._fragile, self._growing = pinned, fragile, growing
        previous: dict[str, int] = {}
        for job_id in [j for j, (_, size) in self.blocks.items() if sizes.get(j, 0) != size]:
            start, size = self.blocks.pop(job_id)
            self._alloc.give(start, size)
            previous[job_id] = start
        todo = sorted(
            ((size, job_id) for job_id, size in sizes.items() if size and job_id not in self.blocks),
            key=lambda item: (-item[0], item[1]),
        )
        moved: set[str] = set()
        for size, job_id in todo:
            old = previous.get(job_id)
            if old is not None and self._alloc.take_at(old - old % size, size):
                self.blocks[job_id] = (old - old % size, size)
            else:
                self._put(job_id, size, moved)
        return Placement(dict(self.blocks), moved)

    def hold(self, job_id: str, gpus: tuple[int, ...] | list[int]) -> bool:
        """Record that `job_id` already runs on `gpus` (a service restarted while
        it trained), so the next placement keeps it there if its size is
        unchanged instead of moving it, which would cost a restart. Only an
        aligned power-of-two block that is free can be held; otherwise False and
        the job is placed like a newcomer."""
        ordered = sorted(gpus)
        size = len(ordered)
        if not size or not is_power_of_two(size) or job_id in self.blocks:
            return False
        start = ordered[0]
        if start % size or ordered != list(range(start, start + size)) or start + size > self.topology.num_gpus:
            return False
        if not self._alloc.take_at(start, size):
            return False
        self.blocks[job_id] = (start, size)
        return True

    def snapshot(self) -> tuple[dict[str, Block], dict[int, set[int]]]:
        """State to `restore` after a trial placement."""
        return dict(self.blocks), {size: set(starts) for size, starts in self._alloc._free.items()}

    def restore(self, state: tuple[dict[str, Block], dict[int, set[int]]]) -> None:
        self.blocks = dict(state[0])
        self._alloc._free = {size: set(starts) for size, starts in state[1].items()}

    def _make_room(self, size: int, job_id: str, moved: set[str]) -> None:
        """Free GPUs suffice but are fragmented: clear the aligned block whose
        occupants are fewest (then smallest), give it to `job_id`, and re-place
        the occupants elsewhere (recursively, smaller each time)."""
        owner: dict[int, str] = {}
        for other, (start, bsize) in self.blocks.items():
            for gpu in range(start, start + bsize):
                owner[gpu] = other
        best: tuple[int, int, int, int, int] | None = None
        for base in range(0, self.topology.num_gpus - size + 1, size):
            occupants = {owner[g] for g in range(base, base + size) if g in owner}
            if any(self.blocks[j][1] >= size for j in occupants):
                continue
            key = (len(occupants & self._pinned), len(occupants & self._fragile), len(occupants),
                   sum(self.blocks[j][1] for j in occupants), base)
            if best is None or key < best:
                best = key
        if best is None:
            raise PlacementError(f"no aligned block of {size} GPUs can be cleared")
        base = best[-1]
        evicted = sorted(
            ((self.blocks[j][1], j) for j in {owner[g] for g in range(base, base + size) if g in owner}),
            key=lambda item: (-item[0], item[1]),
        )
        for _, other in evicted:
            self._alloc.give(*self.blocks.pop(other))
        if not self._alloc.take_at(base, size):
            raise PlacementError(f"block {base}+{size} was not free after clearing it")
        self.blocks[job_id] = (base, size)
        for bsize, other in evicted:
            moved.add(other)
            self._put(other, bsize, moved)

    def _put(self, job_id: str, size: int, moved: set[str]) -> None:
        start = self._alloc.take(size, tuple(b for j, b in self._growing.items() if j != job_id))
        if start is None:
            self._make_room(size, job_id, moved)
        else:
            self.blocks[job_id] = (start, size)


def _overlaps(block: Block, others: tuple[Block, ...]) -> bool:
    start, size = block
    return any(start < o_start + o_size and o_start < start + size for o_start, o_size in others)
