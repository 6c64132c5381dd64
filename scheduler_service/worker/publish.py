"""What the service shows in Prefect about a run: its state before it starts
(Profiling, Admitted, Waiting, Rejected), its labels, its events and its
allocation-history artifact.

Every call is one run's and none raises: a failed request is logged and the
poll goes on (Prefect's view lags at worst; the store has the truth).
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any
from uuid import UUID

from prefect.events import emit_event
from prefect.states import Cancelled, Scheduled

from scheduler_service.contracts import AllocationAction, Rejection, StateName, epoch_to_datetime
from scheduler_service.markdown import markdown_table
from scheduler_service.worker.run_state import RunState

log = logging.getLogger("prefect.workers.elasticflow.publish")  # shown with the worker's own lines

HISTORY_DESCRIPTION = "ElasticFlow allocation history"  # of each admitted run's own artifact
HISTORY_COLUMNS = ("at", "action", "gpus", "iteration", "projected finish")


def iso(seconds: float | None) -> str | None:
    """ISO-8601 of epoch seconds (None past any date)."""
    moment = epoch_to_datetime(seconds)
    return None if moment is None else moment.isoformat()


def gpus_label(gpus: tuple[int, ...] | list[int]) -> str:
    return ",".join(map(str, gpus))


class Publisher:
    """Prefect's client and what the worker needs to address events (its
    resource and the work pool's, as Prefect's own workers relate them)."""

    def __init__(self, client: Any, related: Any) -> None:
        self.client = client
        self.related = related  # () -> list of related resources (worker, work pool)

    def event(self, run_id: str, event: str, payload: dict[str, Any], nodes: list[str] | None = None) -> None:
        self._emit(f"prefect.flow-run.{run_id}", event, payload, nodes)

    def cluster_event(self, event: str, payload: dict[str, Any], nodes: list[str]) -> None:
        """About the cluster itself (nodes joined or lost), on the cluster's resource."""
        self._emit("elasticflow.cluster", event, payload, nodes)

    def _emit(self, resource: str, event: str, payload: dict[str, Any], nodes: list[str] | None) -> None:
        related = [dict(r) for r in self.related()]
        related += [{"prefect.resource.id": f"elasticflow.node.{node}", "prefect.resource.role": "node"}
                    for node in nodes or []]
        emit_event(event=event, resource={"prefect.resource.id": resource}, related=related, payload=payload)

    async def labels(self, run_id: str, labels: dict[str, Any]) -> None:
        try:
            await self.client.update_flow_run_labels(UUID(run_id), {k: str(v) for k, v in labels.items()})
        except Exception:
            log.warning("could not label flow run %s", run_id, exc_info=True)

    async def waiting_state(self, run: RunState, name: StateName, now: float, why: str) -> None:
        """Put a run that has not started in a named Scheduled state, once per
        name (each write is a state row). Forced, since the pool's own rules
        would refuse Scheduled -> Scheduled; so first make sure the run is
        still Scheduled: a run cancelled in the UI must stay cancelled."""
        if run.shown_state == name.value:
            return
        run.shown_state = name.value
        try:
            current = (await self.client.read_flow_run(UUID(run.run_id))).state
            if current is None or not current.is_scheduled():
                return
            await self.client.set_flow_run_state(
                UUID(run.run_id), Scheduled(name=name.value, scheduled_time=datetime.fromtimestamp(now, timezone.utc),
                                            message=why), force=True)
        except Exception:
            log.exception("could not set flow run %s to %s", run.run_id, name.value)

    async def rejected(self, run_id: str, rejection: Rejection) -> None:
        """The Rejected state, then the event. The state is the decision a
        person and `train_model` wait for, and its message carries the reason
        and the earliest deadline too (`Rejection.from_state_message`), so the
        labels (`rejection_labels`) may follow it: in a burst, writing them
        first held every state back by a third."""
        try:
            await self.client.set_flow_run_state(
                UUID(run_id), Cancelled(name=StateName.REJECTED.value, message=rejection.state_message()), force=True)
        except Exception:
            log.exception("could not mark flow run %s Rejected", run_id)
        self.event(run_id, "elasticflow.decision", {
            "admitted": False, "reason": rejection.reason, "message": rejection.message,
            "earliest_feasible_deadline": (rejection.earliest_feasible_deadline.isoformat()
                                           if rejection.earliest_feasible_deadline else None),
        })

    async def rejection_labels(self, run_id: str, rejection: Rejection) -> None:
        await self.labels(run_id, {**rejection.labels(), "elasticflow.admission": "rejected"})

    async def history(self, run: RunState, action: AllocationAction, gpus: tuple[int, ...] | list[int],
                      share: int | None = None, guaranteed_finish: float | None = None) -> None:
        """Append to the run's allocation history and show it as the run's
        artifact: when, what, GPUs, iteration reached, projected finish."""
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        status = run.status()
        projected = run.projected_finish if action != AllocationAction.RELEASE else None
        run.history.append({
            "at": datetime.now(timezone.utc).strftime("%H:%M:%S"), "action": action.value,
            "gpus": gpus_label(gpus) or "-", "iteration": str(status.iteration if status is not None else 0),
            "projected finish": (iso(projected) or "-")[:19].replace("T", " "),
        })
        job = run.job
        deadline = iso(run.deadline) if run.deadline is not None else "none (best-effort)"
        lines = [f"**{job.model}**, {job.iterations:.0f} iterations, deadline {deadline}, "
                 f"minimum satisfactory share {run.share if run.share is not None else share}"]
        if guaranteed_finish is not None:
            lines.append(f"guaranteed finish: {iso(guaranteed_finish)}")
        lines += ["", markdown_table(HISTORY_COLUMNS, ([row[h] for h in HISTORY_COLUMNS] for row in run.history))]
        markdown = "\n".join(lines)
        try:
            if run.artifact_id is not None:
                await self.client.update_artifact(run.artifact_id, ArtifactUpdate(data=markdown))
            else:
                artifact = await self.client.create_artifact(ArtifactCreate(
                    type="markdown", data=markdown, flow_run_id=UUID(run.run_id), description=HISTORY_DESCRIPTION))
                run.artifact_id = artifact.id
        except Exception:
            log.warning("could not update the allocation artifact of %s", run.run_id, exc_info=True)

    async def find_history(self, run: RunState, rows: list[tuple[datetime, str, str]]) -> None:
        """An adopted run keeps its one allocation-history artifact: found again
        and continued (earlier rows from the store), not a second one begun."""
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        try:
            artifacts = await self.client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run.run_id)])))
        except Exception:
            log.warning("could not read the artifacts of %s", run.run_id, exc_info=True)
            return
        ours = [a for a in artifacts if a.description == HISTORY_DESCRIPTION]
        if ours:
            run.artifact_id = ours[0].id
        run.history = [{"at": at.strftime("%H:%M:%S"), "action": action, "gpus": gpus or "-", "iteration": "-",
                        "projected finish": "-"} for at, action, gpus in rows]
