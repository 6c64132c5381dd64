"""How `train_model` ends when it does not return a model: typed errors a
pipeline can handle (a rejection carries the reason and the earliest SLA that
would be met), and the Failed state a pipeline returns for a refusal, so that
an expected refusal reads as an answer in the run's logs, not a crash.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from prefect.exceptions import FailedRun

from elasticflow_block.deadline import DeadlinePlan, SLATooClose
from scheduler_service.contracts import RejectionReason, StateName


class TrainingError(RuntimeError):
    """The training subflow run did not produce a model. Carries the run and its final state."""

    def __init__(self, message: str, flow_run_id: str | None, state_type: str | None, state_name: str | None) -> None:
        super().__init__(message)
        self.message, self.flow_run_id, self.state_type, self.state_name = message, flow_run_id, state_type, state_name

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.message, self.flow_run_id, self.state_type, self.state_name))


class TrainingFailed(TrainingError):
    """Failed, Crashed, cancelled by a person, or completed without a usable checkpoint."""


class TrainingRejected(TrainingError):
    """The scheduler refused the deadline; nothing ran and no GPU was held.

    `reason` is the scheduler's reason code (`infeasible_even_on_an_idle_cluster`,
    `gpus_reserved_by_admitted_jobs`, `deadline_passed`, `invalid_parameters`, ...),
    `message` the whole state message, and `earliest_feasible_deadline` the
    earliest training deadline the scheduler could have met (None when the
    reason has none, e.g. invalid parameters). `earliest_feasible_sla` adds the
    time reserved for the downstream steps back: the SLA the pipeline could promise.
    """

    def __init__(
        self,
        message: str,
        flow_run_id: str | None,
        reason: RejectionReason | str,
        earliest_feasible_deadline: datetime | None,
        plan: DeadlinePlan | None = None,
    ) -> None:
        reason = RejectionReason.read(reason)  # its code, never the enum's repr, in what a person reads
        super().__init__(f"training rejected ({reason.value}): {message}", flow_run_id, "CANCELLED",
                         StateName.REJECTED.value)
        self.message, self.reason, self.earliest_feasible_deadline, self.plan = (
            message, reason, earliest_feasible_deadline, plan,
        )

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.message, self.flow_run_id, self.reason, self.earliest_feasible_deadline, self.plan))

    @property
    def earliest_feasible_sla(self) -> datetime | None:
        if self.earliest_feasible_deadline is None or self.plan is None:
            return None
        return self.earliest_feasible_deadline + self.plan.reserved


_REFUSALS: set[str] = set()  # messages of the Failed states refusal_state() made in this process


def refusal_state(refusal: SLATooClose | TrainingRejected) -> Any:
    """The Failed state for a pipeline flow to return when its training was
    refused: named after the refusal (`SLATooClose`, `TrainingRejected`), its
    message the whole reason, with the earliest feasible SLA of a rejection.

    Returned rather than raised, so that the flow engine does not log it as an
    exception with a traceback; the line Prefect's engine still logs for any
    failed flow run (the traceback of its own re-raise) is dropped for these
    states by _RefusalsWithoutTraceback.
    """
    from prefect.states import Failed

    message = str(refusal)
    if isinstance(refusal, TrainingRejected):
        earliest = refusal.earliest_feasible_sla
        message += f"; earliest feasible SLA {earliest.isoformat() if earliest else 'unknown'}"
    _REFUSALS.add(message)
    return Failed(name=type(refusal).__name__, message=message)


class _RefusalsWithoutTraceback(logging.Filter):
    """A refused SLA is an answer, not a bug: its message says everything, and
    a traceback in the run's logs reads like a crash. Prefect logs one for the
    task that raised the refusal (the line stays, without its traceback), and
    one for a flow run that returned refusal_state() ("Engine execution exited
    with unexpected exception" around its own FailedRun: the line goes, as the
    "Finished in state" line before it says the same)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, (SLATooClose, TrainingRejected)):
            record.exc_info, record.exc_text = None, None
        elif isinstance(error, FailedRun) and str(error) in _REFUSALS:
            return False
        return True


for _name in ("prefect.task_runs", "prefect.flow_runs"):
    logging.getLogger(_name).addFilter(_RefusalsWithoutTraceback())
