"""The cluster-wide view the service keeps current in Prefect: one keyed
markdown artifact (`elasticflow-cluster`: GPU map, every admitted job's share,
MSS, progress, projected finish against its deadline, and the allocation over
time as an embedded plot), and `elasticflow.deadline.at-risk` /
`elasticflow.deadline.recovered` events an automation can act on.

Prefect OSS has no deployment SLAs (Prefect Cloud only), so the deadline is
mirrored as events: at risk when the projected finish passes the deadline
minus a margin. The projection is the run's own measured rate (its status
file) once it trains, the policy's plan before.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Callable

from scheduler_service.worker.cluster import Cluster
from scheduler_service.worker.render import (
    AllocationSample,
    ClusterSnapshot,
    JobView,
    allocation_markdown,
    cluster_markdown,
    deadline_risk,
    samples_from_changes,
)
from scheduler_service.worker.run_state import Phase, RunState

if TYPE_CHECKING:
    from scheduler_service.worker.worker import ElasticFlowWorker

log = logging.getLogger("prefect.workers.elasticflow.cluster_view")  # shown with the worker's own lines

ARTIFACT_KEY = "elasticflow-cluster"
DESCRIPTION = "ElasticFlow cluster"
REFRESH_S = 30.0  # progress alone refreshes the artifact at most this often
HISTORY = 500  # allocation samples kept for the plot
FINISHED_SHOWN = 20  # finished runs still listed, with whether they met their deadline
# A run's own rate, as the view projects with it: iterations over the last
# RATE_WINDOW_S of its status (at least RATE_MIN_SPAN_S of it), not the
# flow's 20-iteration window, which swings by hours right after a resize.
RATE_WINDOW_S = 120.0
RATE_MIN_SPAN_S = 30.0
# Hysteresis: at risk when the projection comes within the margin of the
# deadline, recovered only once it is back beyond RECOVER_FACTOR margins.
RECOVER_FACTOR = 1.5


def _dt(seconds: float | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, timezone.utc)


class Progress:
    """(time, iteration) samples of one run, to project its finish from a rate
    measured over minutes rather than over its last few iterations."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, int]] = deque()

    def projected(self, now: float, iteration: int, total: float) -> datetime | None:
        if not self.samples or iteration != self.samples[-1][1] or now - self.samples[-1][0] >= RATE_WINDOW_S / 4:
            self.samples.append((now, iteration))
        while len(self.samples) > 2 and now - self.samples[1][0] >= RATE_WINDOW_S:
            self.samples.popleft()
        (t0, i0), i1 = self.samples[0], self.samples[-1][1]
        if now - t0 < RATE_MIN_SPAN_S or i1 < i0:
            return None  # too little seen (or a restart from a checkpoint): the flow's own projection stands
        if i1 == i0:
            return _dt(now + RATE_WINDOW_S * 100)  # not moving (parked): it will not make it as things stand
        return _dt(now + (total - iteration) * (now - t0) / (i1 - i0))


class ClusterView:
    def __init__(self, cluster: Cluster, margin_s: float, floor_s: float = 0.0) -> None:
        self.cluster = cluster
        self.margin = timedelta(seconds=margin_s)
        self.floor_s = floor_s  # no run's at-risk margin is below this (a slot)
        self.samples: deque[AllocationSample] = deque(maxlen=HISTORY)
        self.deadlines: dict[str, datetime] = {}
        self.at_risk: set[str] = set()
        self.artifact_id: Any = None
        self._last_allocation: dict[str, int] | None = None
        self._last_progress: dict[str, int] = {}
        self._last_sent = 0.0
        self._live: dict[str, tuple[JobView, RunState]] = {}  # last view of each unfinished run
        self._progress: dict[str, Progress] = {}  # of each unfinished run
        self.finished: deque[JobView] = deque(maxlen=FINISHED_SHOWN)

    def risk_margin_s(self, run: RunState) -> float:
        """The run's own at-risk margin: the view's, or half the room its plan keeps if less."""
        return run.risk_margin(self.margin.total_seconds(), self.floor_s)

    def restore(self, changes: list[tuple[datetime, str, int]], deadlines: dict[str, datetime]) -> None:
        """After a restart: the plot's history from the store's allocation rows
        `(at, run name, GPUs held from then on)`, so it does not start empty."""
        self.samples.extend(samples_from_changes(changes)[-HISTORY:])
        self.deadlines.update(deadlines)
        if self.samples:
            self._last_allocation = dict(self.samples[-1].gpus)

    def snapshot(self, runs: dict[str, RunState], now: float) -> ClusterSnapshot:
        """The cluster now; the projected finish is the run's own measured rate
        once it trains, the policy's plan before."""
        jobs = []
        for run_id, run in runs.items():
            if run.phase in (Phase.FINISHED, Phase.PROFILING):
                continue
            status = run.status()
            # The run's own rate once it has shown one for a while; until then
            # the plan's projection, which does not swing; the flow's last.
            finish = _dt(run.projected_finish) or (status.projected_finish if status is not None else None)
            if status is not None and status.iteration > 0:
                own = self._progress.setdefault(run_id, Progress()).projected(now, status.iteration, run.job.iterations)
                finish = own or finish
            jobs.append(JobView(
                name=run.name or run_id[:8], flow_run_id=run_id, model=run.job.model or "?",
                status=run.phase.value if isinstance(run.phase, Phase) else str(run.phase), share=run.share,
                gpus=sorted(run.held), iterations_done=float(status.iteration if status is not None else 0),
                iterations_total=run.job.iterations, projected_finish=finish,
                deadline=_dt(run.deadline),
                at_risk_within=timedelta(seconds=self.risk_margin_s(run)),
            ))
        self._retire({job.flow_run_id for job in jobs}, now)
        self._progress = {job.flow_run_id: self._progress[job.flow_run_id] for job in jobs
                          if job.flow_run_id in self._progress}
        self._live = {job.flow_run_id: (job, runs[job.flow_run_id]) for job in jobs}
        topology = self.cluster.topology
        return ClusterSnapshot(at=_dt(now), topology=topology.describe(), nodes=list(self.cluster.nodes),
                               gpus_per_node=topology.gpus_per_node, jobs=[*jobs, *self.finished])

    def _retire(self, live: set[str], now: float) -> None:
        """Runs gone since the last snapshot stay listed, with the iteration
        their status file reached and when they ended: "finished" if that was
        the last iteration, "stopped" if not (cancelled, failed, stopped), so a
        run that never got there is not shown as having met its deadline."""
        for run_id, (job, run) in self._live.items():
            if run_id in live:
                continue
            status = run.channel.status()
            done = float(status.iteration if status is not None and status.iteration else job.iterations_done)
            ended = "finished" if job.iterations_total > 0 and done >= job.iterations_total else "stopped"
            self.finished.appendleft(job.model_copy(update=dict(
                status=ended, gpus=[], iterations_done=done, projected_finish=_dt(now))))

    def risk_changes(self, snapshot: ClusterSnapshot) -> list[tuple[str, JobView]]:
        """("at-risk" | "recovered", job) for each admitted job whose outlook flipped."""
        changes = []
        for job in snapshot.jobs:
            if job.deadline is None or job.status != "running":
                continue
            margin = self.margin if job.at_risk_within is None else job.at_risk_within
            risky = deadline_risk(job.projected_finish, job.deadline, margin)
            safe = not deadline_risk(job.projected_finish, job.deadline, margin * RECOVER_FACTOR)
            if risky and job.flow_run_id not in self.at_risk:
                self.at_risk.add(job.flow_run_id)
                changes.append(("at-risk", job))
            elif safe and job.flow_run_id in self.at_risk:
                self.at_risk.discard(job.flow_run_id)
                changes.append(("recovered", job))
        live = {job.flow_run_id for job in snapshot.jobs}
        self.at_risk &= live
        return changes

    def due(self, snapshot: ClusterSnapshot, now: float) -> bool:
        """Record an allocation sample if GPUs changed hands; True if the artifact
        should be rewritten now (allocation changed, or progress moved and
        REFRESH_S has passed)."""
        allocation = {job.name: len(job.gpus) for job in snapshot.jobs if job.gpus}
        progress = {job.flow_run_id: int(job.iterations_done) for job in snapshot.jobs}
        for job in snapshot.jobs:
            if job.deadline is not None:
                self.deadlines[job.name] = job.deadline
        if len(self.deadlines) > 2 * HISTORY:  # only runs the plot can still show need theirs
            shown = {name for sample in self.samples for name in sample.gpus} | {job.name for job in snapshot.jobs}
            self.deadlines = {name: d for name, d in self.deadlines.items() if name in shown}
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
            plot = allocation_markdown(window, self.deadlines, self.cluster.topology.num_gpus, snapshot.at)
        return cluster_markdown(snapshot, self.margin) + ("\n\n" + plot if plot else "")

    async def publish(self, client: Any, markdown: str) -> None:
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
                    return
            await client.update_artifact(self.artifact_id, ArtifactUpdate(data=markdown))
        except Exception:
            log.warning("could not update the cluster artifact", exc_info=True)


def emit_risk(emit: Callable[[str, str, dict[str, Any]], None], change: str, job: JobView) -> None:
    emit(job.flow_run_id, f"elasticflow.deadline.{change}", {
        "flow_run_name": job.name, "model": job.model,
        "projected_finish": job.projected_finish.isoformat() if job.projected_finish else None,
        "deadline": job.deadline.isoformat() if job.deadline else None,
        "iterations_done": job.iterations_done, "iterations_total": job.iterations_total,
        "gpus": job.gpus, "mss": job.share,
    })


async def show_cluster(worker: ElasticFlowWorker, now: float) -> None:
    """Keep the cluster artifact current; tell automations, and the run's own
    page, about deadlines at risk."""
    import anyio

    from scheduler_service.worker.decisions import tell

    worker.start_cost.observe(worker.runs.values(), time.time())
    snapshot = worker.view.snapshot(worker.runs, now)
    for change, job in worker.view.risk_changes(snapshot):
        emit_risk(worker.publisher.event, change, job)
        log.warning("deadline %s: %s projected %s, due %s", change, job.name, job.projected_finish, job.deadline)
        if job.flow_run_id in worker.runs and job.projected_finish is not None and job.deadline is not None:
            tell(worker, worker.runs[job.flow_run_id], f"deadline {change}: projected finish "
                 f"{job.projected_finish:%H:%M:%S}, due {job.deadline:%H:%M:%S} UTC", warning=change == "at-risk")
    if worker.view.due(snapshot, now):
        markdown = await anyio.to_thread.run_sync(worker.view.markdown, snapshot, now)  # renders a plot
        await worker.view.publish(worker.client, markdown)
