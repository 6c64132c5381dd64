"""Rank 0's checkpoint saves, and what a save that fails means for the run.

A save fails for reasons of the store, not of the training: a full disk, a
folder made read-only, a bucket whose credentials expired. Crashing the rank
then (as an uncaught error did) threw away every iteration since the last
good save and restarted from it, again and again. Instead, a failed save is
said out loud (the rank's log and every progress line carry the path and the
error, and the flow logs it to the run's Prefect logs), the run trains on
where it is, and a stop it was asked for (a resize, a park) waits until a
save works: what the ranks did is only given up once it is on disk. After
MAX_FAILURES saves in a row have failed, the run ends with that error rather
than train on with nothing to fall back to; it is never sent back to an
older checkpoint for a failure that was the store's.

Periodic saves are written in the background (`save_later`), from a copy of
the state taken at the iteration boundary: the training loop does not wait
for the file, and what is saved is that iteration's state whatever the loop
does meanwhile. One is in flight at a time; every synchronous save (a stop,
the end) and every read of what was saved waits for it first (`join`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

from elasticflow_block.storage import CheckpointInfo, CheckpointStorage

log = logging.getLogger("elasticflow.worker")

MAX_FAILURES = 3  # saves in a row
RETRY_S = 30.0  # a stop waits this long before its save is tried again


class Saves:
    """Rank 0's saves of one segment: the last good one, and the failures since."""

    def __init__(self, storage: CheckpointStorage, run_key: str, max_failures: int = MAX_FAILURES,
                 retry_s: float = RETRY_S) -> None:
        self.storage, self.run_key = storage, run_key
        self.max_failures, self.retry_s = max_failures, retry_s
        self.failures = 0  # in a row
        self.error: str | None = None  # the last failure's, until a save works
        self.retry_at = 0.0  # a refused stop is reconsidered from then on
        self._pending: threading.Thread | None = None  # the background save in flight

    def save_later(self, iteration: int, state: dict[str, Any], done: Callable[[CheckpointInfo], None]) -> None:
        """`save` in a thread, `done` with its info if the store took it; after
        the one in flight, if any (a store slower than the interval slows the
        loop down rather than pile copies up)."""
        self.join()

        def work() -> None:
            info = self.save(iteration, state)
            if info is not None:
                done(info)

        self._pending = threading.Thread(target=work, name=f"checkpoint-{iteration}", daemon=True)
        self._pending.start()

    def join(self) -> None:
        """Until the background save in flight, if any, is done."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None

    def save(self, iteration: int, state: dict[str, Any]) -> CheckpointInfo | None:
        """The checkpoint at `iteration`, or None if the store refused it."""
        try:
            info = self.storage.save(self.run_key, iteration, state)
        except Exception as exc:  # whatever the store raises (OSError, fsspec's, torch's writer): the store's fault
            self.failures += 1
            self.error = (f"checkpoint save to {self.storage.folder(self.run_key)} failed "
                          f"({self.failures} in a row): {type(exc).__name__}: {exc}")
            self.retry_at = time.time() + self.retry_s
            log.error("%s", self.error)
            return None
        if self.error is not None:
            log.warning("checkpoint saves work again run_key=%s iteration=%d", self.run_key, iteration)
        self.failures, self.error = 0, None
        return info

    @property
    def exhausted(self) -> bool:
        return self.failures >= self.max_failures

    def may_retry(self) -> bool:
        return time.time() >= self.retry_at


def cpu_copy(state: Any) -> Any:
    """`state` with every tensor copied to the CPU, for a save in the background."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: cpu_copy(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cpu_copy(value) for value in state)
    return state
