"""What the scheduler service tells the rest of the world, typed once: a
run's phase (the store, `elasticflow status`, the control loop and the UI
say the same words), the names of the states it gives flow runs, its labels
and events, the actions of its allocation history, and a rejection (reason,
message, earliest feasible deadline).

The worker writes a rejection here and `train_model` (elasticflow_block)
reads it back here, through the run's labels, so neither parses the other's
prose. Only pydantic and the standard library: a pipeline imports this.
"""

from __future__ import annotations

import math
from datetime import datetime, timezone
from enum import Enum
from typing import Any, Mapping

from pydantic import BaseModel


class StateName(str, Enum):
    """Names of the states a `train` run shows besides Prefect's own: the
    service's before it starts (and the rejection, a Cancelled state); the
    flow's own while it moves to new GPUs (a Running state) and when a stop of
    the stack paused it (a Scheduled state the worker picks up again and
    Prefect's late-runs service leaves alone)."""

    PROFILING = "Profiling"
    ADMITTED = "Admitted"  # with a guarantee: its deadline will be met
    BEST_EFFORT = "Best-effort"  # taken without one (no deadline, or none it can be promised): "Admitted" misled
    WAITING = "Waiting"
    RESCALING = "Rescaling"
    RESUMING = "Resuming"
    REJECTED = "Rejected"


class AllocationAction(str, Enum):
    """One row of a run's allocation history (`ef_allocation`, its artifact)."""

    ADMITTED = "admitted"
    LAUNCH = "launch"
    RESCALE = "rescale"
    PARK = "park"
    STOP = "stop"
    RELEASED = "released"  # it acknowledged giving up every GPU (parked or stopped), still alive
    RELEASE = "release"  # its process ended: every GPU is free
    REBASED = "rebased"  # the cluster changed under it: what it holds now, by the GPUs' new ids


class RunPhase(str, Enum):
    """Where a run is in its life at the service. The values are what the
    store has always kept (`ef_job.status`); `shown` is the word `elasticflow
    status` prints, which says what the run waits for."""

    ARRIVED = "arrived"  # taken in, not decided yet
    PROFILING = "profiling"  # its model's throughput being measured before the decision
    ADMITTED = "admitted"  # admitted, waiting for GPUs
    RUNNING = "running"  # launched: its process holds GPUs
    RESCALING = "rescaling"  # running, moving to a new GPU set it has not acknowledged yet (never stored)
    REJECTED = "rejected"
    FINISHED = "finished"  # its process ended (or it left before it started)

    @property
    def shown(self) -> str:
        return _SHOWN.get(self, self.value)

    @property
    def live(self) -> bool:
        """Still the service's to watch after a restart."""
        return self in (RunPhase.ARRIVED, RunPhase.PROFILING, RunPhase.ADMITTED, RunPhase.RUNNING)


_SHOWN = {RunPhase.ARRIVED: "deciding", RunPhase.ADMITTED: "admitted-waiting"}


class Outcome(str, Enum):
    """How a run ended. One rule (`outcome_of`) for the worker's log line,
    `elasticflow status`, the cluster view and the `elasticflow.run.ended`
    event: the run's final Prefect state first, so a run that failed is never
    reported as having met its deadline because its status file reached the
    last iteration."""

    MET = "met"  # completed by its deadline
    MISSED = "missed"  # completed after its deadline
    DONE = "done"  # completed, best-effort
    FAILED = "failed"  # ended Failed or Crashed
    CANCELLED = "cancelled"
    STOPPED = "stopped"  # ended short of its last iteration, its final state not known


def outcome_of(state: str | None, iteration: float, iterations: float, deadline: float | None,
               ended_at: float) -> Outcome:
    """`state` is the final Prefect state's type (`COMPLETED`, `FAILED`,
    ...), None if it could not be read; then the iterations decide."""
    kind = (state or "").upper()
    if kind in ("FAILED", "CRASHED"):
        return Outcome.FAILED
    if kind in ("CANCELLED", "CANCELLING"):
        return Outcome.CANCELLED
    if kind == "COMPLETED" and iteration >= iterations or not kind and iteration >= iterations > 0:
        if deadline is None:
            return Outcome.DONE
        return Outcome.MET if ended_at <= deadline else Outcome.MISSED
    return Outcome.STOPPED


class RejectionReason(str, Enum):
    """Why a run was not admitted: decided by the service before the policy
    sees a run, or by the policy. One enum for both: the policy's answer is
    what the run's page, `status`, the pipeline's error and the simulator's
    tables say, never mapped back by value."""

    INVALID_PARAMETERS = "invalid_parameters"
    PROFILING_FAILED = "profiling_failed"
    SOONER_THAN_START_UP = "deadline_sooner_than_start_up"  # in the future, but closer than a run takes to start
    DEADLINE_PASSED = "deadline_passed"
    INFEASIBLE_ALONE = "infeasible_even_on_an_idle_cluster"
    INSUFFICIENT_CAPACITY = "gpus_reserved_by_admitted_jobs"
    NO_USABLE_GPU_COUNT = "no_usable_gpu_count"
    WINDOW_IN_DEMAND = "window_too_busy_for_its_size"
    UNKNOWN_TEAM = "unknown_team"
    REJECTED = "rejected"  # a policy that gave no reason (a baseline)
    UNKNOWN = "unknown"  # read back from a run whose state says no reason (an older service)

    @classmethod
    def read(cls, value: object) -> "RejectionReason":
        try:
            return cls(str(getattr(value, "value", value)))
        except ValueError:
            return cls.UNKNOWN


class Label(str, Enum):
    """Flow-run labels the service writes (programs and automations read them)."""

    MSS = "elasticflow.mss"
    ADMISSION = "elasticflow.admission"
    GUARANTEE = "elasticflow.guarantee"
    GPUS = "elasticflow.gpus"
    WORLD_SIZE = "elasticflow.world_size"
    NODES = "elasticflow.nodes"
    REJECTION_REASON = "elasticflow.rejection.reason"
    REJECTION_EARLIEST = "elasticflow.rejection.earliest_feasible_deadline"
    # written by the training flow about its own progress
    ITERATION = "elasticflow.iteration"
    TOTAL_ITERATIONS = "elasticflow.total_iterations"
    ITERATIONS_PER_S = "elasticflow.iterations_per_s"
    PROJECTED_FINISH = "elasticflow.projected_finish"
    ON_TRACK = "elasticflow.on_track"


class EventName(str, Enum):
    """Events the service emits (an automation's trigger names these)."""

    DECISION = "elasticflow.decision"
    ALLOCATION_CHANGED = "elasticflow.allocation.changed"
    GUARANTEE_LOST = "elasticflow.guarantee.lost"
    DEADLINE_AT_RISK = "elasticflow.deadline.at-risk"
    DEADLINE_RECOVERED = "elasticflow.deadline.recovered"
    CLUSTER_CHANGED = "elasticflow.cluster.changed"
    NODES_LOST = "elasticflow.run.nodes-lost"
    RUN_ENDED = "elasticflow.run.ended"


CLUSTER_RESOURCE = "elasticflow.cluster"  # the resource cluster events are about


def node_resource(node: str) -> str:
    """A node as a related resource of an event."""
    return f"elasticflow.node.{node}"


def training_event(what: str) -> str:
    """An event the training flow emits about itself (`elasticflow.training.<what>`)."""
    return f"elasticflow.training.{what}"


EARLIEST = "; earliest feasible deadline "
DETAIL = " — "  # between a refusal's sentence for a person and the policy's detail
LABEL_REASON = Label.REJECTION_REASON.value
LABEL_EARLIEST = Label.REJECTION_EARLIEST.value
NO_DATE = "beyond any date"  # an earliest deadline past year 9999 (a run too long to finish)


def epoch_to_datetime(seconds: float | None) -> datetime | None:
    """An aware UTC time, or None when there is none or it is past any date."""
    if seconds is None:
        return None
    try:
        return datetime.fromtimestamp(seconds, timezone.utc)
    except (OverflowError, OSError, ValueError):
        return None


class Rejection(BaseModel):
    """Why a run was not admitted, and the earliest deadline that would have been."""

    reason: RejectionReason
    message: str  # the policy's detail: the constraint that failed
    earliest_feasible_deadline: datetime | None = None
    beyond_any_date: bool = False  # the earliest deadline exists but is too far to be a date
    summary: str = ""  # the sentence for a person it leads with (phrases.refusal)

    @classmethod
    def of(cls, reason: object, message: str, earliest_epoch: float | None, deadline: float | None = None,
           now: float | None = None) -> "Rejection":
        """From the loop's answer; with `now` (and the run's deadline), led by
        the sentence for a person. The earliest deadline is rounded up to the
        second: a time to the microsecond reads as noise, and rounded down it
        would no longer be feasible."""
        from scheduler_service.phrases import refusal
        from scheduler_service.text import MESSAGE_LIMIT, shown

        earliest = None if earliest_epoch is None else float(math.ceil(earliest_epoch))
        moment = epoch_to_datetime(earliest)
        beyond, why = earliest_epoch is not None and moment is None, RejectionReason.read(reason)
        summary = "" if now is None else refusal(why, moment, beyond, epoch_to_datetime(deadline),
                                                 datetime.fromtimestamp(now, timezone.utc))
        # the message may quote what a user gave: bounded, escaped
        return cls(reason=why, message=shown(message, MESSAGE_LIMIT), earliest_feasible_deadline=moment,
                   beyond_any_date=beyond, summary=summary)

    def state_message(self) -> str:
        """What the Rejected state says to a person: the sentence for them,
        then the reason, the policy's detail and the earliest deadline."""
        text = f"{self.summary}{DETAIL}" if self.summary else ""
        text += f"{self.reason.value}: {self.message}"
        if self.earliest_feasible_deadline is not None:
            text += f"{EARLIEST}{self.earliest_feasible_deadline.isoformat()}"
        elif self.beyond_any_date:
            text += f"{EARLIEST}{NO_DATE}"
        return text

    def labels(self) -> dict[str, str]:
        """The rejection as flow-run labels, for programs (`train_model`)."""
        out = {LABEL_REASON: self.reason.value}
        if self.earliest_feasible_deadline is not None:
            out[LABEL_EARLIEST] = self.earliest_feasible_deadline.isoformat()
        return out

    @classmethod
    def from_labels(cls, labels: Mapping[str, Any], message: str | None) -> "Rejection":
        """Read back what `labels()` wrote; a run without them (rejected by an
        older service) is read from its state message."""
        if LABEL_REASON not in labels:
            return cls.from_state_message(message)
        earliest = labels.get(LABEL_EARLIEST)
        return cls(reason=RejectionReason.read(labels[LABEL_REASON]), message=message or "",
                   earliest_feasible_deadline=datetime.fromisoformat(str(earliest)) if earliest else None)

    @classmethod
    def from_state_message(cls, message: str | None) -> "Rejection":
        """What `state_message()` wrote; a message in another shape keeps reason
        `unknown` rather than failing (the raw message still travels with it)."""
        text = (message or "").strip()
        head, sep, _ = text.rsplit(DETAIL, 1)[-1].partition(": ")
        reason = RejectionReason.read(head) if sep and head and " " not in head else RejectionReason.UNKNOWN
        earliest: datetime | None = None
        if EARLIEST in text:
            stamp = text.rsplit(EARLIEST, 1)[1].strip().rstrip(".")
            try:
                earliest = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
            except ValueError:
                earliest = None
            if earliest is not None and earliest.tzinfo is None:
                earliest = earliest.replace(tzinfo=timezone.utc)
        return cls(reason=reason, message=text, earliest_feasible_deadline=earliest)
