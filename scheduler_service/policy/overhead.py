"""Restart overhead: the price of changing a job's GPU set.

The paper's artifact charges about 2 s (stop) + 27 s (checkpoint and restart)
+ 2 s per level of the communication tree when a job is started or moved onto
a different GPU set. Plans and the simulator use the same function, so a plan
that accounts for its restarts stays true when executed. A resize that keeps
some GPUs is made in place and costs less (`in_place`); plans still charge a
restart for every change they plan, for placement cannot promise that a grow
keeps a GPU, and only the change under way is charged at what it costs.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartOverhead:
    stop_s: float = 2.0
    restart_s: float = 27.0
    per_level_s: float = 2.0
    in_place_s: float | None = None  # a resize in place instead of `restart_s`; None: charged as a restart

    def __call__(self, gpus: int) -> float:
        if gpus <= 0:
            return 0.0
        return self.stop_s + self.restart_s + self.per_level_s * (math.log2(gpus) + 1)

    def in_place(self, gpus: int) -> float:
        """A resize that keeps some of the run's GPUs (flows/training/regroup.py):
        nothing saved or loaded, no process started for the ranks that stay,
        but the stop and a communication group formed again at every level."""
        if self.in_place_s is None or gpus <= 0:
            return self(gpus)
        return self.stop_s + self.in_place_s + self.per_level_s * (math.log2(gpus) + 1)


def keeps_gpus(before: Iterable[int], after: Iterable[int]) -> bool:
    """Whether a change from `before` to `after` is a resize in place: the
    runtime makes it so when the new set keeps a GPU of the old (regroup.py)."""
    return bool(set(before) & set(after))


PAPER_OVERHEAD = RestartOverhead()
NO_OVERHEAD = RestartOverhead(0.0, 0.0, 0.0)
