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


@dataclass(frozen=True, slots=True)
class SafetyMargin:
    """Room kept in front of an admitted run's deadline, so that a machine a
    little slower than its profile still finishes in time: a fraction of the
    run's window, and at least `floor_s` (a slot: a plan is revised no sooner)."""

    fraction: float = 0.0
    floor_s: float = 0.0

    def of(self, window_s: float) -> float:
        return max(self.floor_s, self.fraction * max(0.0, window_s))


NO_MARGIN = SafetyMargin()


def plan_deadline_for(deadline: float | None, window_from: float, reserve_s: float,
                      margin: SafetyMargin = NO_MARGIN) -> float | None:
    """The deadline the policy plans a run against: the user's, less what its
    start costs beyond a restart (`reserve_s`) and the safety margin on its
    window (from `window_from`, when it was taken in)."""
    if deadline is None:
        return None
    return deadline - reserve_s - margin.of(deadline - window_from)


def user_deadline_for(plan_time: float, window_from: float, reserve_s: float,
                      margin: SafetyMargin = NO_MARGIN) -> float:
    """The inverse: the user's deadline whose plan deadline is `plan_time`, so
    that an earliest feasible deadline told to a user is feasible when used
    (a later deadline has a wider window and so a wider margin)."""
    floor_only = plan_time + reserve_s + margin.floor_s
    if margin.fraction <= 0 or margin.fraction * (floor_only - window_from) <= margin.floor_s:
        return floor_only
    return (plan_time + reserve_s - margin.fraction * window_from) / (1.0 - margin.fraction)


def plan_deadline_mid_slot(reserve_s: float, elapsed_s: float) -> float:
    """Planned from the slot's boundary, a run decided `elapsed_s` into the
    slot must not be credited the part of the slot already gone: that much
    more is kept in front of its deadline."""
    return reserve_s + max(0.0, elapsed_s)


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
    reserve_s: float = 0.0  # kept in front of it: a start's cost beyond a restart, the part of a slot gone
    margin: SafetyMargin = NO_MARGIN
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
    taken_in_at: float = 0.0  # its window (for the margin) counts from here
    speed_ratio: float = 1.0  # its measured speed over its profile's, as the plans use it

    def __post_init__(self) -> None:
        if self.deadline is None:
            self.deadline = self.job.deadline

    @property
    def plan_deadline(self) -> float | None:
        return self.job.deadline

    def plan_with(self, plan_deadline: float | None) -> None:
        self.job = replace(self.job, deadline=plan_deadline)

    def replan(self) -> None:
        """The plan deadline from the user's, after `reserve_s` or `margin` changed."""
        self.plan_with(plan_deadline_for(self.deadline, self.taken_in_at, self.reserve_s, self.margin))

    def risk_margin(self, at_most_s: float, floor_s: float) -> float:
        """How close its projected finish may come to its deadline before it
        is at risk: `at_most_s` (ELASTICFLOW_AT_RISK_S), but no more than half
        the room its plan keeps in front of the deadline (start cost and safety
        margin), at least `floor_s` (a slot). A short run's plan ends within a
        minute of its deadline by design; it is at risk once it has lost half
        of that room, not from the start. A plan that keeps no room (margins
        set to 0) leaves `at_most_s` as it is."""
        if self.deadline is None or self.plan_deadline is None or self.deadline <= self.plan_deadline:
            return at_most_s
        return max(floor_s, min(at_most_s, (self.deadline - self.plan_deadline) / 2))

    def to_user_time(self, plan_time: float) -> float:
        """A time on the plan's deadline scale (an earliest feasible deadline) as the user's."""
        if self.deadline is None or self.plan_deadline is None:
            return plan_time
        return user_deadline_for(plan_time, self.taken_in_at, self.reserve_s, self.margin)

    def observe_speed(self, measured: float, gpus: int, profiled: float) -> bool:
        """Plan with the speed the run shows, not only its profile: a shared
        machine is slower than an idle one. Only slower (a profile is the best
        case), smoothed, and only a change of 3% or more is applied; True then."""
        if measured <= 0 or profiled <= 0 or gpus <= 0:
            return False
        ratio = 0.7 * self.speed_ratio + 0.3 * min(1.0, max(0.2, measured / profiled))
        if abs(ratio - self.speed_ratio) < 0.03 * self.speed_ratio:
            return False
        curve = self.job.curve
        base = {g: v / self.speed_ratio for g, v in curve.points.items()}
        self.speed_ratio = ratio
        self.job = replace(self.job, curve=type(curve)({g: v * ratio for g, v in base.items()}))
        return True

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
