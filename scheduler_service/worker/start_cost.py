"""What starting a run really costs here, learnt from the starts seen.

The plans charge a restart per start; a new run's start (a flow process,
imports, ranks) costs more, and the difference is kept in front of its
deadline (the launch reserve). Unless the operator set it, the reserve grows
to the longest of the last ten starts, and the worker warns when a start
took far longer than what admitted deadlines rest on.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable

from scheduler_service.worker.run_state import RunState

log = logging.getLogger("prefect.workers.elasticflow.start_cost")  # shown with the worker's own lines

DEFAULT_LAUNCH_S = 15.0
SEEN = 10  # starts remembered


class StartCost:
    def __init__(self, restart_cost: Callable[[int], float], launch_s: float | None) -> None:
        self.restart_cost = restart_cost  # the plans' charge for a start on n GPUs
        self.launch_s = DEFAULT_LAUNCH_S if launch_s is None else launch_s
        self.learn = launch_s is None  # a value the operator set is kept as is
        self.starts: deque[float] = deque(maxlen=SEEN)  # seconds from launch to first iteration
        self._warned_s = 0.0

    def reserve(self) -> float:
        """Seconds kept in front of a new run's deadline for its start, beyond
        the restart the plans charge."""
        seen = list(self.starts) if self.learn else []
        return max(0.0, max([self.launch_s, *seen]) - self.restart_cost(1))

    def startup_s(self) -> float:
        """About how long a run takes here from launch to its first iteration."""
        return self.reserve() + self.restart_cost(1)

    def observe(self, runs: Iterable[RunState], now: float) -> None:
        """Runs launched that are now up (a first iteration): what their start cost."""
        for run in runs:
            if run.launched_at is not None and run.iterations_done() > 0:
                self.started(run.run_id, now - run.launched_at, len(run.commanded))
                run.launched_at = None

    def started(self, run_id: str, took_s: float, gpus: int) -> None:
        """A run reached its first iteration `took_s` after its launch."""
        self.starts.append(took_s)
        charged = self.restart_cost(gpus or 1)
        if took_s > 1.5 * max(charged, self.launch_s) and took_s > 1.2 * self._warned_s:
            self._warned_s = took_s
            log.warning(
                "flow run %s took %.1f s from launch to its first iteration; plans charge %.1f s per start and "
                "keep %.1f s for a launch: admitted runs with tight deadlines may miss them. New runs now keep "
                "the most of the last ten starts; set ELASTICFLOW_LAUNCH_S to what starts cost here",
                run_id, took_s, charged, self.reserve() + charged)
