"""One lane per run for what the service writes to Prefect about it.

Every Prefect write goes on in the background, so that a slow server never
holds the poll (a burst on SQLite held it for two minutes on one admission's
labels, and the run launched that late and missed). Writes about one run
must still land in the order they were made: its Admitted state before the
Pending that Prefect's launch proposes, the history artifact's rows in
order. A lane is a first-come first-served lock per run; the launch takes
its run's lane too, so it waits for that run's writes, and only for those.

A run has two lanes: its states and the labels of its decision (its MSS,
admitted or rejected, a guarantee lost: what an automation on its state
change reads) in one; the labels of where it runs and its history
artifact's rows (`details_of`) in the other. The launch needs the first
written, not the second: on a slow server (every request 0.2 s slower, a
quarter answered 503 and retried with a growing back-off) a burst's
launches waited 2.4-9.5 s with every write in one lane, 0.0-6.8 s so (a
start there is 13-39 s, and the run's deadline pays it all).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio


class Lanes:
    def __init__(self) -> None:
        self._locks: dict[str, anyio.Lock] = {}
        self._users: dict[str, int] = {}  # holding or waiting: the lane goes when none is left

    @asynccontextmanager
    async def of(self, key: str) -> AsyncIterator[None]:
        """Hold `key`'s lane: after everything that asked for it before."""
        lock = self._locks.setdefault(key, anyio.Lock())
        self._users[key] = self._users.get(key, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[key] -= 1
            if not self._users[key]:
                del self._users[key], self._locks[key]

    def busy(self, key: str) -> bool:
        """Whether something holds or waits for `key`'s lane."""
        return key in self._locks

    def __len__(self) -> int:
        return len(self._locks)


def details_of(run_id: str) -> str:
    """The lane of a run's placement labels and history rows, beside its states'."""
    return f"{run_id}/details"
