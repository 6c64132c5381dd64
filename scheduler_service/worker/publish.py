"""What the service shows in Prefect about a run: its state before it starts
(Profiling, Admitted, Waiting, Rejected), its labels, its events and its
allocation-history artifact.

Every call is one run's and none raises: a failed request is logged and the
poll goes on (Prefect's view lags at worst; the store has the truth).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone
from typing import Any
from uuid import UUID

from prefect.events import emit_event
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Scheduled

from scheduler_service.contracts import CLUSTER_RESOURCE, EventName, Label, Rejection, StateName, node_resource
from scheduler_service.markdown import markdown_table
from scheduler_service.worker.registry import HISTORY_COLUMNS, ServiceRun

log = logging.getLogger("prefect.workers.elasticflow.publish")  # shown with the worker's own lines

HISTORY_DESCRIPTION = "ElasticFlow allocation history"  # of each admitted run's own artifact
# Pauses before writing a Rejected state again once Prefect's client gave up on
# its own retries: a decision dropped there left its run Scheduled ("Late") for
# ever, its user never told (a server answering 503 to a quarter of the writes).
REJECTED_AGAIN_S = (2.0, 5.0, 10.0, 20.0, 30.0, 60.0)


class Publisher:
    """Prefect's client and what the worker needs to address events (its
    resource and the work pool's, as Prefect's own workers relate them)."""

    def __init__(self, client: Any, related: Any) -> None:
        self.client = client
        self.related = related  # () -> list of related resources (worker, work pool)
        self.teams: dict[str, str] = {}  # run -> its team, on a cluster shared by teams

    def relate_team(self, run_id: str, team: str) -> None:
        """The run's events name its team (its work queue) as a related resource from now on."""
        self.teams[run_id] = team

    def event(self, run_id: str, event: EventName, payload: dict[str, Any], nodes: list[str] | None = None) -> None:
        team = self.teams.get(run_id)
        extra = ({"prefect.resource.id": f"elasticflow.team.{team}", "prefect.resource.role": "team",
                  "prefect.resource.name": team},) if team else ()
        self._emit(f"prefect.flow-run.{run_id}", event, payload, nodes, extra)
        if event is EventName.RUN_ENDED or (event is EventName.DECISION and not payload.get("admitted", True)):
            self.teams.pop(run_id, None)

    def cluster_event(self, event: EventName, payload: dict[str, Any], nodes: list[str]) -> None:
        """About the cluster itself (nodes joined or lost), on the cluster's resource."""
        self._emit(CLUSTER_RESOURCE, event, payload, nodes)

    def _emit(self, resource: str, event: EventName, payload: dict[str, Any], nodes: list[str] | None,
              extra: tuple[dict[str, str], ...] = ()) -> None:
        related = [dict(r) for r in self.related()] + list(extra)
        related += [{"prefect.resource.id": node_resource(node), "prefect.resource.role": "node"}
                    for node in nodes or []]
        emit_event(event=event.value, resource={"prefect.resource.id": resource}, related=related, payload=payload)

    async def labels(self, run_id: str, labels: dict[Label, Any]) -> None:
        try:
            await self.client.update_flow_run_labels(UUID(run_id), {k.value: str(v) for k, v in labels.items()})
        except Exception:
            log.warning("could not label flow run %s", run_id, exc_info=True)

    async def waiting_state(self, run: ServiceRun, name: StateName, now: float, why: str) -> None:
        """Put a run that has not started in a named Scheduled state. Forced,
        since the pool's own rules would refuse Scheduled -> Scheduled; so
        first make sure the run is still Scheduled: a run cancelled in the UI
        must stay cancelled (and its launch waits in the run's lane)."""
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
        for pause in (*REJECTED_AGAIN_S, None):
            try:
                await self.client.set_flow_run_state(
                    UUID(run_id), Cancelled(name=StateName.REJECTED.value, message=rejection.state_message()),
                    force=True)
                break
            except ObjectNotFound:  # deleted meanwhile: nobody waits for its decision
                break
            except Exception:
                if pause is None:
                    log.exception("could not mark flow run %s Rejected", run_id)
                    break
                log.warning("could not mark flow run %s Rejected yet; trying again in %.0f s", run_id, pause)
                await asyncio.sleep(pause)
        self.event(run_id, EventName.DECISION, {
            "admitted": False, "reason": rejection.reason.value, "summary": rejection.summary,
            "message": rejection.message,
            "earliest_feasible_deadline": (rejection.earliest_feasible_deadline.isoformat()
                                           if rejection.earliest_feasible_deadline else None),
        })

    async def rejection_labels(self, run_id: str, rejection: Rejection) -> None:
        await self.labels(run_id, {**{Label(k): v for k, v in rejection.labels().items()},
                                   Label.ADMISSION: "rejected"})

    async def history(self, run: ServiceRun, header: list[str]) -> None:
        """Show the run's allocation history (its rows, under `header`) as the
        run's own artifact: one, updated in place."""
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        markdown = "\n".join([*header, "", markdown_table(
            HISTORY_COLUMNS, ([row[h] for h in HISTORY_COLUMNS] for row in run.history))])
        try:
            if run.artifact_id is not None:
                await self.client.update_artifact(run.artifact_id, ArtifactUpdate(data=markdown))
            else:
                artifact = await self.client.create_artifact(ArtifactCreate(
                    type="markdown", data=markdown, flow_run_id=UUID(run.run_id), description=HISTORY_DESCRIPTION))
                run.found_artifact(artifact.id)
                await self._keep_only(run.run_id, artifact.id)
        except Exception:
            log.warning("could not update the allocation artifact of %s", run.run_id, exc_info=True)

    async def _keep_only(self, run_id: str, artifact_id: Any) -> None:
        """A create carries no id of ours, and Prefect's client retries one
        that timed out or met a busy database after the server may have
        stored it: a run would then show two histories, one left behind. So
        after the one create of a run, any other history of it goes."""
        from prefect.exceptions import ObjectNotFound

        for extra in await self._histories(run_id):
            if extra.id != artifact_id:
                log.info("removing a second allocation history of %s (a retried create)", run_id)
                try:
                    await self.client.delete_artifact(extra.id)
                except ObjectNotFound:  # a retried delete: the first one went through
                    pass

    async def _histories(self, run_id: str) -> list[Any]:
        """The allocation-history artifacts Prefect holds of a run."""
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        artifacts = await self.client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)])))
        return [a for a in artifacts if a.description == HISTORY_DESCRIPTION]

    async def find_history(self, run: ServiceRun, rows: list[tuple[datetime, str, str]]) -> None:
        """An adopted run keeps its one allocation-history artifact: found again
        and continued (earlier rows from the store), not a second one begun."""
        try:
            ours = await self._histories(run.run_id)
        except Exception:
            log.warning("could not read the artifacts of %s", run.run_id, exc_info=True)
            return
        if ours:
            run.found_artifact(ours[0].id)
        for at, action, gpus in rows:
            run.record(action, gpus, "-", "-", at=at)
