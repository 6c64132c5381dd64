"""The cluster-wide view the service keeps current in Prefect: one keyed
markdown artifact (`elasticflow-cluster`: GPU map, every admitted job's share,
MSS, progress, projected finish against its deadline, and the allocation over
time as an embedded plot).

It shows what the control loop knows (its run views: GPUs held, iteration,
projected finish, at-risk flag); whether a deadline is at risk is the
loop's to say (`RunFacts.at_risk`, the flag behind `RiskChanged`), not this view's. Everything here is keyed by
flow run id; names are only words on the page.
"""

from __future__ import annotations

import logging
from collections import deque
from datetime import datetime, timedelta, timezone
from typing import Any

from scheduler_service.contracts import Outcome, RunPhase
from scheduler_service.loop.run import RunFacts
from scheduler_service.policy.teams import TeamUse
from scheduler_service.worker.cluster import Cluster
from scheduler_service.worker.plot import AllocationSample, allocation_markdown, samples_from_changes
from scheduler_service.worker.render import ClusterSnapshot, JobView, TeamView, cluster_markdown, cluster_summary

log = logging.getLogger("prefect.workers.elasticflow.cluster_view")  # shown with the worker's own lines

ARTIFACT_KEY = "elasticflow-cluster"
DESCRIPTION = "ElasticFlow cluster"
REFRESH_S = 30.0  # progress alone refreshes the artifact at most this often
HISTORY = 500  # allocation samples kept for the plot
FINISHED_SHOWN = 20  # finished runs still listed, with whether they met their deadline


def _dt(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, timezone.utc)


class ClusterView:
    def __init__(self, cluster: Cluster, margin_s: float) -> None:
        self.cluster = cluster
        self.margin = timedelta(seconds=margin_s)
        self.samples: deque[AllocationSample] = deque(maxlen=HISTORY)
        self.deadlines: dict[str, datetime] = {}  # by run id, for the plot's dashed lines
        self.names: dict[str, str] = {}  # by run id: what the plot calls it
        self.artifact_id: Any = None
        self._last_allocation: dict[str, int] | None = None
        self._last_progress: dict[str, int] = {}
        self._last_sent = 0.0
        self._live: dict[str, JobView] = {}  # last view of each unfinished run
        self._outcomes: dict[str, Outcome] = {}  # of runs that ended since the last snapshot
        self.finished: deque[JobView] = deque(maxlen=FINISHED_SHOWN)

    def follow(self, cluster: Cluster) -> None:
        """The cluster changed (nodes joined or left)."""
        self.cluster = cluster

    def restore(self, changes: list[tuple[datetime, str, str, int]], deadlines: dict[str, datetime]) -> None:
        """After a restart: the plot's history from the store's allocation rows
        `(at, run id, run name, GPUs held from then on)`, so it does not start empty."""
        self.names.update({run_id: name for _, run_id, name, _ in changes})
        self.samples.extend(samples_from_changes([(at, run_id, gpus) for at, run_id, _, gpus in changes])[-HISTORY:])
        self.deadlines.update(deadlines)
        if self.samples:
            self._last_allocation = dict(self.samples[-1].gpus)

    def snapshot(self, views: list[RunFacts], names: dict[str, str], now: float,
                 teams: list[TeamUse] | None = None) -> ClusterSnapshot:
        """The cluster now, as the loop sees it."""
        jobs = []
        for view in views:
            if view.phase in (RunPhase.FINISHED, RunPhase.PROFILING):
                continue
            jobs.append(JobView(
                name=names.get(view.run_id) or view.run_id[:8], flow_run_id=view.run_id, model=view.model or "?",
                status=view.phase.value if view.phase == RunPhase.RUNNING else view.phase.shown, share=view.share,
                gpus=sorted(view.held), iterations_done=float(view.iteration), iterations_total=view.iterations,
                projected_finish=_dt(view.projected_finish), deadline=_dt(view.deadline),
                at_risk=view.at_risk,
            ))
        self._retire({job.flow_run_id for job in jobs}, now)
        self._live = {job.flow_run_id: job for job in jobs}
        topology = self.cluster.topology
        sizes, kinds = self.cluster.node_sizes(), self.cluster.node_kinds()
        return ClusterSnapshot(at=_dt(now), topology=topology.describe(), nodes=list(self.cluster.nodes),
                               gpus_per_node=max(sizes), jobs=[*jobs, *self.finished],
                               node_gpus=sizes if len(set(sizes)) > 1 else [],
                               node_kinds=kinds if any(kinds) else [],
                               teams=[TeamView(name=t.name, share=t.share, held=t.held, borrowed=t.borrowed)
                                      for t in teams or []])

    def ended(self, run_id: str, iteration: int, outcome: Outcome) -> None:
        """The run ended at `iteration`, as `outcome` says (contracts.outcome_of)."""
        job = self._live.get(run_id)
        if job is not None:
            self._outcomes[run_id] = outcome
            self._live[run_id] = job.model_copy(update=dict(iterations_done=float(iteration)))

    def _retire(self, live: set[str], now: float) -> None:
        """Runs gone since the last snapshot stay listed, with the iteration
        they reached, when they ended and how: "finished" if they completed,
        else what their final state says (failed, cancelled) or "stopped", so
        a run that did not complete is never shown as having met its deadline."""
        for run_id, job in self._live.items():
            if run_id in live:
                continue
            outcome = self._outcomes.pop(run_id, None)
            done = job.iterations_done
            if outcome is None:  # not told how it ended: what its iterations say
                reached = job.iterations_total > 0 and done >= job.iterations_total
                outcome = Outcome.DONE if reached else Outcome.STOPPED
            ended = "finished" if outcome in (Outcome.MET, Outcome.MISSED, Outcome.DONE) else outcome.value
            self.finished.appendleft(job.model_copy(update=dict(
                status=ended, gpus=[], iterations_done=done, projected_finish=_dt(now))))

    def due(self, snapshot: ClusterSnapshot, now: float) -> bool:
        """Record an allocation sample if GPUs changed hands; True if the artifact
        should be rewritten now (allocation changed, or progress moved and
        REFRESH_S has passed)."""
        allocation = {job.flow_run_id: len(job.gpus) for job in snapshot.jobs if job.gpus}
        progress = {job.flow_run_id: int(job.iterations_done) for job in snapshot.jobs}
        for job in snapshot.jobs:
            self.names[job.flow_run_id] = job.name
            if job.deadline is not None:
                self.deadlines[job.flow_run_id] = job.deadline
        if len(self.names) > 2 * HISTORY:  # only runs the plot can still show need theirs
            shown = {run for sample in self.samples for run in sample.gpus} | {job.flow_run_id for job in snapshot.jobs}
            self.names = {run: name for run, name in self.names.items() if run in shown}
            self.deadlines = {run: d for run, d in self.deadlines.items() if run in shown}
        if allocation != self._last_allocation:
            self.samples.append(AllocationSample(at=snapshot.at, gpus=allocation))
            self._last_allocation = allocation
            return True
        return progress != self._last_progress and now - self._last_sent >= REFRESH_S

    def markdown(self, snapshot: ClusterSnapshot, now: float) -> str:
        self._last_progress = {job.flow_run_id: int(job.iterations_done) for job in snapshot.jobs}
        self._last_sent = now
        plot = ""
        if self.samples:
            window = [s for s in self.samples if s.at >= snapshot.at - timedelta(hours=6)] or [self.samples[-1]]
            plot = allocation_markdown(window, self.deadlines, self.cluster.topology.num_gpus, snapshot.at,
                                       names=self.names)
        return cluster_markdown(snapshot, self.margin) + ("\n\n" + plot if plot else "")

    async def show(self, client: Any, views: list[RunFacts], names: dict[str, str], now: float,
                   teams: list[TeamUse] | None = None) -> None:
        """Keep the artifact current: rewritten when GPUs change hands, or now and then as runs progress."""
        import anyio

        snapshot = self.snapshot(views, names, now, teams)
        if self.due(snapshot, now):
            markdown = await anyio.to_thread.run_sync(self.markdown, snapshot, now)  # renders a plot
            await self.publish(client, markdown, cluster_summary(snapshot))

    def description(self, summary: str) -> str:
        """What the artifact's key page shows (Prefect's page for a key shows
        the description and the versions, not the data): the view in one
        line and a link to the whole of it."""
        link = f" · [open the GPU map, the jobs and the plot](/artifacts/artifact/{self.artifact_id})" \
            if self.artifact_id is not None else ""
        return f"{DESCRIPTION}: {summary}{link}"

    async def publish(self, client: Any, markdown: str, summary: str = "") -> None:
        """Create the keyed artifact once (or find the latest after a restart),
        then update it in place: no new version per refresh."""
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

        try:
            if self.artifact_id is None:
                found = await client.read_artifacts(
                    artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[ARTIFACT_KEY])), limit=1,
                    sort="CREATED_DESC")
                if found:
                    self.artifact_id = found[0].id
                else:
                    artifact = await client.create_artifact(ArtifactCreate(
                        key=ARTIFACT_KEY, type="markdown", data=markdown, description=DESCRIPTION))
                    self.artifact_id = artifact.id
            await client.update_artifact(self.artifact_id, ArtifactUpdate(data=markdown,
                                                                           description=self.description(summary)))
        except Exception:
            log.warning("could not update the cluster artifact", exc_info=True)
