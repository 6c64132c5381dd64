"""Restart overhead: the price of changing a job's GPU set.

The paper's artifact charges about 2 s (stop) + 27 s (checkpoint and restart)
+ 2 s per level of the communication tree when a job is started or moved onto
a different GPU set. Plans and the simulator use the same function, so a plan
that accounts for its restarts stays true when executed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RestartOverhead:
    stop_s: float = 2.0
    restart_s: float = 27.0
    per_level_s: float = 2.0

    def __call__(self, gpus: int) -> float:
        if gpus <= 0:
            return 0.0
        return self.stop_s + self.restart_s + self.per_level_s * (math.log2(gpus) + 1)


PAPER_OVERHEAD = RestartOverhead()
NO_OVERHEAD = RestartOverhead(0.0, 0.0, 0.0)
