"""One object per flow run the service has taken in: created at take-in,
dropped when the run ends, so the worker's bookkeeping is the size of what is
in flight, never of what has ended.

Two deadlines live here, by name. `deadline` is the user's (epoch seconds).
`plan_deadline` is what the policy plans against: earlier by the launch
reserve (a new run's start costs more than the restart the plans charge) and
by the part of the slot already gone when it was decided (the policy plans
from the slot's boundary). Each shift is one function below; a time the
policy reports (an earliest feasible deadline) goes back to the user's clock
with `to_user_time`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

from flows.training.control import FileControlChannel, RunStatus
from scheduler_service.policy import Job


class Phase(str, Enum):
    PROFILING = "profiling"  # taken in, its model's throughput being measured
    WAITING = "waiting"  # handed to the scheduler (deciding, or admitted and waiting for GPUs)
    RUNNING = "running"  # launched: its process holds GPUs
    FINISHED = "finished"


def plan_deadline_with_reserve(deadline: float | None, launch_reserve_s: float) -> float | None:
    """A new run's deadline as the policy plans it: its start is paid in front of it."""
    return None if deadline is None else deadline - launch_reserve_s


def plan_deadline_mid_slot(plan_deadline: float | None, elapsed_s: float) -> float | None:
    """Planned from the slot's boundary, a run decided `elapsed_s` into the slot
    must not be credited the part of the slot already gone."""
    if plan_deadline is None:
        return None
    return plan_deadline - max(0.0, elapsed_s)


@dataclass(slots=True, eq=False)
class RunState:
    """Everything the service knows about one flow run."""

    run_id: str
    job: Job  # the policy's view; job.deadline is the plan deadline
    channel: FileControlChannel
    phase: Phase = Phase.WAITING
    held: tuple[int, ...] = ()  # GPUs it may be using right now
    target: tuple[int, ...] = ()  # where the policy wants it
    commanded: tuple[int, ...] = ()  # the last GPU set it was told to use
    pending_seq: int | None = None  # a command not yet acknowledged
    since: float = 0.0  # last (re)start: the restart overhead is paid from here
    share: int | None = None
    adopted: bool = False  # admitted by an earlier life of the service: never rejected now
    stopping: bool = False  # told to stop (it was cancelled): never commanded again
    deadline: float | None = field(default=None)  # the user's; None with a job deadline: the same
    # -- what the service shows of it -----------------------------------------
    name: str = ""
    flow_run: Any = None  # the Prefect FlowRun it was taken in from
    response: Any = None  # Prefect's WorkerFlowRunResponse, to launch it with
    foreign_process: bool = False  # running under a process an earlier worker launched
    shown_state: str | None = None  # the last pre-start state name written (each write is a row)
    history: list[dict[str, str]] = field(default_factory=list)  # its allocation-history artifact
    artifact_id: Any = None
    projected_finish: float | None = None  # the policy's, on its clock
    launched_at: float | None = None  # until its first iteration: what a start really costs
    params: Any = None  # its validated TrainParameters (profiling needs them)
    taken_in_at: float = 0.0

    def __post_init__(self) -> None:
        if self.deadline is None:
            self.deadline = self.job.deadline

    @property
    def plan_deadline(self) -> float | None:
        return self.job.deadline

    def plan_with(self, plan_deadline: float | None) -> None:
        self.job = replace(self.job, deadline=plan_deadline)

    def to_user_time(self, plan_time: float) -> float:
        """A time on the plan's deadline scale (an earliest feasible deadline) as the user's."""
        if self.deadline is None or self.plan_deadline is None:
            return plan_time
        return plan_time + (self.deadline - self.plan_deadline)

    def status(self) -> RunStatus | None:
        """What its rank 0 last reported; None before it trained."""
        return self.channel.status() if self.phase in (Phase.RUNNING, Phase.FINISHED) else None

    def iterations_done(self) -> int:
        status = self.status()
        return status.iteration if status is not None else 0


class RecentIds:
    """Ids of runs that ended lately, so a poll that still lists one (Prefect's
    view lags a state change) does not take it in twice. Bounded: the oldest
    are forgotten, by then no poll lists them."""

    def __init__(self, size: int = 4096) -> None:
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
