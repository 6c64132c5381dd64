"""The flow runs the service has taken in, keyed by flow run id, from take-in
to their end: what the service needs of each to talk to Prefect and to the
run (its flow run, its launch response, its control channel) and what it has
shown of it. How the run is scheduled is the control loop's (`loop/run.py`);
nothing here decides.

The registry is the size of what is in flight, never of what has ended:
ended runs leave only their id in a capped list of recent ones, so a poll
that still lists one (Prefect's view lags a state change) does not take it
in twice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from flows.training.control import FileControlChannel
from scheduler_service.contracts import StateName

HISTORY_COLUMNS = ("at", "action", "gpus", "iteration", "projected finish")


@dataclass(eq=False)
class ServiceRun:
    run_id: str
    name: str
    channel: FileControlChannel
    deadline: float | None  # the user's, epoch seconds; None: best-effort
    model: str = ""
    iterations: float = 0.0
    taken_in_at: float = 0.0
    flow_run: Any = None  # the Prefect FlowRun it was taken in from
    response: Any = None  # Prefect's WorkerFlowRunResponse, to launch it with (None: adopted)
    request: Any = None  # its validated parameters (intake.Request); profiling needs them
    foreign_process: bool = False  # running under a process an earlier worker launched
    shown_state: StateName | None = None  # the last pre-start state written (each write is a row)
    history: list[dict[str, str]] = field(default_factory=list)  # its allocation-history artifact's rows
    artifact_id: Any = None
    launch_gpus: tuple[int, ...] = ()  # the GPUs its launch placed it on
    share: int | None = None  # its minimum satisfactory share once admitted (None: best-effort)

    def polled(self, response: Any) -> None:
        """Listed again by a poll: launch it with the newest response."""
        self.response = response

    def show(self, state: StateName) -> bool:
        """Whether `state` is new for it (and so to be written); remembered as shown."""
        if self.shown_state == state:
            return False
        self.shown_state = state
        return True

    def admitted(self, share: int | None) -> None:
        self.share = share

    def launching(self, gpus: tuple[int, ...]) -> None:
        self.launch_gpus = gpus

    def record(self, action: str, gpus: str, iteration: int | str, projected: str,
               at: datetime | None = None) -> None:
        """One row of its allocation history."""
        self.history.append({"at": (at or datetime.now(timezone.utc)).strftime("%H:%M:%S"), "action": action,
                             "gpus": gpus or "-", "iteration": str(iteration), "projected finish": projected})

    def found_artifact(self, artifact_id: Any) -> None:
        self.artifact_id = artifact_id


RECENT_IDS = 4096  # ended runs remembered: more than one poll of Prefect ever lists


class RecentIds:
    """Ids of runs that ended lately. Bounded: the oldest are forgotten, by
    then no poll lists them."""

    def __init__(self, size: int | None = None) -> None:
        size = RECENT_IDS if size is None else size
        self.size = size
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, run_id: str) -> None:
        self._ids[run_id] = None
        self._ids.move_to_end(run_id)
        while len(self._ids) > self.size:
            self._ids.popitem(last=False)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


class RunRegistry:
    def __init__(self) -> None:
        self._runs: dict[str, ServiceRun] = {}
        self.recent = RecentIds()

    def add(self, run: ServiceRun) -> None:
        self._runs[run.run_id] = run

    def get(self, run_id: str) -> ServiceRun | None:
        return self._runs.get(run_id)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._runs

    def __iter__(self) -> Iterator[ServiceRun]:
        return iter(list(self._runs.values()))

    def __len__(self) -> int:
        return len(self._runs)

    def seen(self, run_id: str) -> bool:
        """In flight, or ended lately."""
        return run_id in self._runs or run_id in self.recent

    def forget(self, run_id: str) -> ServiceRun | None:
        """It ended (or was rejected): only its id is kept, for a while."""
        self.recent.add(run_id)
        return self._runs.pop(run_id, None)

    def sizes(self) -> dict[str, int]:
        return {"runs": len(self._runs), "recent": len(self.recent)}
