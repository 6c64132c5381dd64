"""What the scheduler service tells the rest of the world, typed once: the
names of the states it gives flow runs, the actions of its allocation
history, and a rejection (reason, message, earliest feasible deadline).

The worker writes a rejection here and `train_model` (elasticflow_block)
reads it back here, through the run's labels, so neither parses the other's
prose. Only pydantic and the standard library: a pipeline imports this.
"""

from __future__ import annotations

from datetime import datetime, timezone
from enum import Enum
from typing import Any, Mapping

from pydantic import BaseModel


class StateName(str, Enum):
    """Names of the states the service gives a `train` run before it starts
    (and of the rejection, a Cancelled state)."""

    PROFILING = "Profiling"
    ADMITTED = "Admitted"
    WAITING = "Waiting"
    RESCALING = "Rescaling"
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


class ServiceReason(str, Enum):
    """Rejections decided by the service itself, before the policy sees a run
    (the policy's own are `scheduler_service.policy.RejectReason`)."""

    INVALID_PARAMETERS = "invalid_parameters"
    PROFILING_FAILED = "profiling_failed"
    SOONER_THAN_START_UP = "deadline_sooner_than_start_up"  # in the future, but closer than a run takes to start


EARLIEST = "; earliest feasible deadline "
LABEL_REASON = "elasticflow.rejection.reason"
LABEL_EARLIEST = "elasticflow.rejection.earliest_feasible_deadline"
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

    reason: str  # a ServiceReason or policy RejectReason value
    message: str
    earliest_feasible_deadline: datetime | None = None
    beyond_any_date: bool = False  # the earliest deadline exists but is too far to be a date

    @classmethod
    def of(cls, reason: str, message: str, earliest_epoch: float | None) -> "Rejection":
        moment = epoch_to_datetime(earliest_epoch)
        return cls(reason=reason, message=message, earliest_feasible_deadline=moment,
                   beyond_any_date=earliest_epoch is not None and moment is None)

    def state_message(self) -> str:
        """What the Rejected state says to a person."""
        text = f"{self.reason}: {self.message}"
        if self.earliest_feasible_deadline is not None:
            text += f"{EARLIEST}{self.earliest_feasible_deadline.isoformat()}"
        elif self.beyond_any_date:
            text += f"{EARLIEST}{NO_DATE}"
        return text

    def labels(self) -> dict[str, str]:
        """The rejection as flow-run labels, for programs (`train_model`)."""
        out = {LABEL_REASON: self.reason}
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
        return cls(reason=str(labels[LABEL_REASON]), message=message or "",
                   earliest_feasible_deadline=datetime.fromisoformat(str(earliest)) if earliest else None)

    @classmethod
    def from_state_message(cls, message: str | None) -> "Rejection":
        """What `state_message()` wrote; a message in another shape keeps reason
        `unknown` rather than failing (the raw message still travels with it)."""
        text = (message or "").strip()
        head, sep, _ = text.partition(": ")
        reason = head if sep and head and " " not in head else "unknown"
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
