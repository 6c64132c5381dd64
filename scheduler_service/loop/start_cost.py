"""What starting and resizing a run really cost, learnt from what was seen.

The plans charge a restart per start; a new run's start (a flow process,
imports, ranks) costs more, and the difference is kept in front of its
deadline (the launch reserve). Unless the operator set it, the reserve grows
to the longest of the last ten starts. The simulator's backend takes its
launch delay from the same `launch_s`, so a simulated start costs what the
service expects of one.

A resize that keeps some of a run's GPUs is made in place (no checkpoint,
the ranks that stay keep their processes) and costs a fraction of a
restart. The change under way is charged what it costs (`charge`): a resize
in place its own cost, a restart from a checkpoint (a parked run placed
again, a move to other GPUs) the plans' charge, each raised to the longest
of the last ten seen, since a charge under what it takes would let its plan
run late (Ray chaos, seed 3: restarts charged 2.5 s took 10-25 s on a loaded
machine, and a run with 85 s to its deadline was moved twice and missed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_LAUNCH_S = 15.0
SEEN = 10  # starts remembered


@dataclass(frozen=True, slots=True)
class SlowStart:
    """A start that took far longer than what admitted deadlines rest on."""

    took_s: float
    charged_s: float  # the restart the plans charge for it
    kept_s: float  # what new runs keep for a start from now on


class StartCost:
    def __init__(self, restart_cost: Callable[[int], float], launch_s: float | None,
                 in_place_cost: Callable[[int], float] | None = None) -> None:
        self.restart_cost = restart_cost  # the plans' charge for a start on n GPUs
        self.in_place_cost = in_place_cost or restart_cost  # and for a resize in place, at least
        self.launch_s = DEFAULT_LAUNCH_S if launch_s is None else launch_s
        self.learn = launch_s is None  # a value the operator set is kept as is
        self.starts: deque[float] = deque(maxlen=SEEN)  # seconds from launch to first iteration
        self.in_place: deque[float] = deque(maxlen=SEEN)  # a resize in place: command to first iteration
        self.restarts: deque[float] = deque(maxlen=SEEN)  # a restart from a checkpoint: the same
        self._warned_s = 0.0

    def charge(self, gpus: int, in_place: bool) -> float:
        """What a change of GPU set to `gpus` GPUs costs the run: a restart,
        or, when it keeps some of its GPUs, a resize in place."""
        if not in_place:
            return max(self.restart_cost(gpus), max(self.restarts, default=0.0))
        return max(self.in_place_cost(gpus), max(self.in_place, default=0.0))

    def resized(self, took_s: float, in_place: bool) -> None:
        """A change of GPU set reached its first iteration on the new set
        `took_s` after it was commanded: in place, or from a checkpoint."""
        (self.in_place if in_place else self.restarts).append(took_s)

    def reserve(self) -> float:
        """Seconds kept in front of a new run's deadline for its start, beyond
        the restart the plans charge."""
        seen = list(self.starts) if self.learn else []
        return max(0.0, max([self.launch_s, *seen]) - self.restart_cost(1))

    def startup_s(self) -> float:
        """About how long a run takes here from launch to its first iteration."""
        return self.reserve() + self.restart_cost(1)

    def recall(self, took_s: tuple[float, ...]) -> None:
        """Starts an earlier life of the service saw, oldest first (said
        nothing of: they were said then)."""
        self.starts.extend(took_s)
        self._warned_s = max(self.starts, default=0.0)

    def started(self, took_s: float, gpus: int) -> SlowStart | None:
        """A run reached its first iteration `took_s` after its launch; a
        SlowStart when that is far beyond what is charged and kept (said once
        per new worst)."""
        self.starts.append(took_s)
        charged = self.restart_cost(gpus or 1)
        if took_s > 1.5 * max(charged, self.launch_s) and took_s > 1.2 * self._warned_s:
            self._warned_s = took_s
            return SlowStart(took_s, charged, self.reserve() + charged)
        return None
