"""The `elasticflow` Prefect worker: admission, allocation, placement and
rescaling of `train` flow runs, on top of Prefect's process worker.

Built on prefect==3.9.1 and pinned there: deciding before a run starts
overrides `BaseWorker.get_and_submit_flow_runs` and uses the private helpers
`_get_scheduled_flow_runs`, `_submit_scheduled_flow_runs` and
`_propose_pending_state`.

Per poll (every `ELASTICFLOW_INTERVAL_S` seconds, the policy's slot length):
new scheduled runs are validated (`TrainParameters`) and turned into policy
jobs (throughput curve from the store, profiled on first use); once per slot
the pure `ElasticFlowPolicy` decides; `Scheduler.actuate` turns its placement
into launches and control-channel commands. This module only translates:
runs to jobs, decisions to states, labels, events and launches.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import anyio.abc
from pydantic import Field

from prefect.events import emit_event
from prefect.settings import PREFECT_WORKER_QUERY_SECONDS, temporary_settings
from prefect.states import Cancelled, Scheduled
from prefect.workers.process import ProcessJobConfiguration, ProcessVariables, ProcessWorker, ProcessWorkerResult

from scheduler_service.policy import Decision, Job, ThroughputCurve
from scheduler_service.policy.elasticflow import ElasticFlowPolicy
from scheduler_service.policy.overhead import RestartOverhead
from scheduler_service.store.db import elasticflow_home
from scheduler_service.worker import cluster as cluster_mod
from scheduler_service.worker.cancellation import Cancellations, process_id
from scheduler_service.worker.cluster_view import ClusterView, emit_risk
from scheduler_service.worker.scheduler import Action, PlanResult, Run, Scheduler
from scheduler_service.worker.store import AllocationRecord, DecisionRecord, ServiceStore

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun
    from prefect.client.schemas.responses import WorkerFlowRunResponse

INTERVAL_ENV = "ELASTICFLOW_INTERVAL_S"  # slot length (default 5 s)
POLL_ENV = "ELASTICFLOW_POLL_S"  # how often new runs are looked for and decided (default 1 s, at most a slot)
RESTART_ENV = "ELASTICFLOW_RESTART_S"  # restart cost the plans charge, plus 0.5 s to stop (default 2 s)
LAUNCH_ENV = "ELASTICFLOW_LAUNCH_S"  # launch -> first iteration of a new run (unset: 15 s, raised by starts seen)
PROFILE_ITERATIONS_ENV = "ELASTICFLOW_PROFILE_ITERATIONS"  # per GPU count when profiling on first use
PROFILE_TIMEOUT_ENV = "ELASTICFLOW_PROFILE_TIMEOUT_S"  # longest wait in Profiling, for GPUs or a measurement (600 s)
AT_RISK_ENV = "ELASTICFLOW_AT_RISK_S"  # a deadline is at risk when the projected finish is within this (60 s)

HISTORY_DESCRIPTION = "ElasticFlow allocation history"  # of each admitted run's own artifact
PUBLISH_CONCURRENCY = 8  # Prefect API requests in flight when publishing a burst of decisions
TRAIN_FLOW = "train"  # runs of other flows in the pool (pipelines) start at once, with no GPUs
ADMITTED = "Admitted"
AWAITING = "Waiting"
PROFILING = "Profiling"
REJECTED = "Rejected"


def _iso(seconds: float | None) -> str | None:
    """ISO-8601 of epoch seconds."""
    return None if seconds is None else datetime.fromtimestamp(seconds, timezone.utc).isoformat()


def _aware(moment: datetime) -> datetime:
    """A time read back from the store; SQLite hands it back naive, though it was written in UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _gpus_label(gpus: tuple[int, ...] | list[int]) -> str:
    return ",".join(map(str, gpus))


@dataclass
class _AwaitingProfile:
    """A run in Profiling: taken in, waiting for its model's throughput curve."""

    flow_run: FlowRun
    params: Any
    deadline: float | None
    iterations: float
    since: float

    @property
    def key(self) -> tuple[str, int, str]:
        return (self.params.model, self.params.hyperparameters.global_batch_size, self.params.device)


class ElasticFlowJobConfiguration(ProcessJobConfiguration):
    """A process job placed by the scheduler: the GPU set, world size and nodes
    are chosen by the service when it launches the run (values set here are
    overwritten)."""

    gpus: list[int] = Field(default_factory=list)
    world_size: int = Field(default=0)
    nodes: list[str] = Field(default_factory=list)
    # Flow runs must outlive a crashed worker (it adopts them when restarted):
    # output piped through the worker would break with it. Logs reach the API anyway.
    stream_output: bool = Field(default=False)


class ElasticFlowVariables(ProcessVariables):
    stream_output: bool = Field(
        default=False,
        description="Copy flow run output to the worker's output. Off: a run then survives a worker crash.",
    )
    gpus: list[int] = Field(
        default_factory=list, description="GPU ids chosen by the ElasticFlow scheduler (set by the service)."
    )
    world_size: int = Field(default=0, description="Number of GPUs chosen by the scheduler (set by the service).")
    nodes: list[str] = Field(default_factory=list, description="Nodes of the GPU set (set by the service).")


class ElasticFlowWorkerResult(ProcessWorkerResult):
    """Exit status of a training flow run process."""


class InvalidRun(ValueError):
    """A flow run the service cannot schedule; the message says why."""


class ElasticFlowWorker(ProcessWorker):
    type = "elasticflow"
    job_configuration = ElasticFlowJobConfiguration  # type: ignore[assignment]
    job_configuration_variables = ElasticFlowVariables  # type: ignore[assignment]
    _description = (
        "ElasticFlow: deadline-aware admission, elastic GPU allocation and buddy placement of "
        "`train` flow runs; runs them as local processes and resizes them in place."
    )
    _display_name = "ElasticFlow"
    _documentation_url = "https://github.com/"  # docs/service.md in the project
    _logo_url = "https://raw.githubusercontent.com/PrefectHQ/prefect/main/docs/images/logos/prefect-logo-mark-solid-white-500.png"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("prefetch_seconds", 0)
        super().__init__(*args, **kwargs)
        self.interval = float(os.environ.get(INTERVAL_ENV) or 5.0)
        self.poll_s = min(self.interval, float(os.environ.get(POLL_ENV) or 1.0))
        restart = float(os.environ.get(RESTART_ENV) or 2.0)
        # Spare GPUs are granted only if the grant pays for its restart and for
        # the one taken back within a slot: the slot must exceed two restarts.
        self.overhead = RestartOverhead(stop_s=0.5, restart_s=restart, per_level_s=0.0)
        # A new run's start (a flow process, imports, workers) costs more than a
        # resize of a running one; the difference is kept in front of its deadline.
        self.launch_s = float(os.environ.get(LAUNCH_ENV) or 15.0)
        self._learn_starts = not os.environ.get(LAUNCH_ENV)  # a value set by the operator is kept as is
        self._starts: list[float] = []  # seconds from launch to first iteration, latest last
        self.cluster = cluster_mod.load()
        self.policy = ElasticFlowPolicy(self.cluster.topology, interval=self.interval, overhead=self.overhead)
        self.scheduler = Scheduler(self.policy)
        self.store: ServiceStore | None = None
        self.home = elasticflow_home()
        self._seen: set[str] = set()  # flow runs already taken in (or rejected)
        self._responses: dict[str, WorkerFlowRunResponse] = {}
        self._state_name: dict[str, str] = {}  # last waiting-state name written per run
        self._profiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="elasticflow-profile")
        self._profiles: dict[tuple[str, int, str], Future[dict[int, float]]] = {}
        self._to_profile: dict[tuple[str, int, str], Any] = {}  # models waiting for free GPUs to profile on
        self._profile_blocked: set[tuple[str, int, str]] = set()  # already logged as waiting for GPUs
        self._profiling: dict[str, _AwaitingProfile] = {}
        self.profile_timeout = float(os.environ.get(PROFILE_TIMEOUT_ENV) or 600.0)
        self.decision_seconds: list[float] = []
        self._projected: dict[str, float] = {}  # policy's projected finish per run (policy clock)
        self._history: dict[str, list[dict[str, str]]] = {}  # allocation history per run, for its artifact
        self._artifacts: dict[str, Any] = {}  # run id -> artifact id
        self._adopted: set[str] = set()  # running runs found after a restart (not our children)
        self._cancellations = Cancellations()  # Cancelling runs Prefect's worker cannot stop
        self._flow_names: dict[Any, str] = {}  # flow id -> flow name
        self._names: dict[str, str] = {}  # flow run id -> flow run name, for the cluster view
        self._launched_at: dict[str, float] = {}  # launch -> first iteration: what a start really costs
        self._warned_start_s = 0.0
        self._forkserver: tuple[subprocess.Popen[bytes], Path] | None = None
        # Deadline at risk: projected finish within the margin of the deadline (at least a slot:
        # closer than that, the next plan may not have had its say yet).
        self.view = ClusterView(self.cluster, margin_s=max(self.interval, float(os.environ.get(AT_RISK_ENV) or 60.0)))

    # -- lifecycle -------------------------------------------------------------
    async def start(self, *args: Any, **kwargs: Any) -> None:
        with temporary_settings(updates={PREFECT_WORKER_QUERY_SECONDS: self.poll_s}):
            await super().start(*args, **kwargs)

    async def setup(self) -> None:
        await super().setup()
        self.store = ServiceStore()
        self._logger.info(
            "ElasticFlow scheduler: %s (%s), slot %.1f s", self.cluster.topology.describe(), self.cluster.source,
            self.interval,
        )
        await self._recover()
        self._forkserver = self._start_forkserver()
        # The first take-in would otherwise pay for importing the train flow's
        # parameter model (and torch with it): about 4 s on a small machine.
        await anyio.to_thread.run_sync(importlib.import_module, "flows.training.params")
        if self.interval < 2 * self.overhead(1):
            self._logger.warning(
                "slot %.1f s is under two restarts (%.1f s): no spare GPUs will be granted early; "
                "raise %s or lower %s", self.interval, 2 * self.overhead(1), INTERVAL_ENV, RESTART_ENV,
            )

    def _start_forkserver(self) -> tuple[subprocess.Popen[bytes], Path] | None:
        """The warm start of flow processes: started now, it imports while the
        worker waits for runs; until its socket exists flow processes start cold."""
        from flows.training.boot import WARM_ENV
        from flows.training.forkserver import launch

        if os.environ.get(WARM_ENV, "1") == "0":
            return None
        process, path = launch(self.home)
        self._logger.info("warm start: fork server pid %d at %s (log %s)", process.pid, path,
                          self.home / "logs" / "forkserver.log")
        return process, path

    async def teardown(self, *exc_info: Any) -> None:
        self._profiler.shutdown(wait=False, cancel_futures=True)
        if self._forkserver is not None:  # it stops taking runs; the running ones keep their relay
            self._forkserver[0].terminate()
        await super().teardown(*exc_info)

    # -- the poll: take in, decide, actuate ------------------------------------
    async def get_and_submit_flow_runs(self) -> list["FlowRun"]:
        if not self._has_successfully_synced:
            return await super().get_and_submit_flow_runs()
        responses = await self._get_scheduled_flow_runs()
        self._last_polled_time = datetime.now(timezone.utc)  # type: ignore[assignment]
        now = self.clock()
        launches = []
        for entry in responses:
            run_id = str(entry.flow_run.id)
            self._responses[run_id] = entry
            self._names[run_id] = entry.flow_run.name
            start = entry.flow_run.next_scheduled_start_time or entry.flow_run.expected_start_time
            if run_id in self._seen or (start is not None and start.timestamp() > now):
                continue
            self._seen.add(run_id)
            if await self._flow_name(entry.flow_run) != TRAIN_FLOW:
                self._logger.info("launching flow run %s (%s): not a training run, it needs no GPUs",
                                  run_id, entry.flow_run.name)
                launches.append(entry)
                continue
            await self._take_in(entry.flow_run, now)
        await self._forget_vanished({str(entry.flow_run.id) for entry in responses})
        await self._watch_adopted()
        await self._watch_cancelling(now)
        await self._collect_profiles(now)
        result = self.scheduler.plan(now)
        if result is not None:
            await self._publish(result, now)
        for action in self.scheduler.actuate(now):
            if await self._apply(action, now):
                launches.append(self._responses[action.run_id])
        await self._show_cluster(now)
        if not launches:
            return []
        return await self._submit_scheduled_flow_runs(flow_run_response=launches)

    async def _recover(self) -> None:
        """After a restart: runs the store says were admitted and Prefect says are
        still running (their flow processes outlive the worker) are adopted with
        the GPUs they hold (last command and acknowledgement of their control
        channel), so no GPU is handed out twice. Runs still waiting are taken in
        again as new arrivals; finished ones are closed in the store."""
        from uuid import UUID

        from flows.training.control import FileControlChannel
        from prefect.exceptions import ObjectNotFound
        from scheduler_service.store import get_curve

        assert self.store is not None
        now = self.clock()
        for row in self.store.jobs():
            if row.status not in ("admitted", "running"):
                continue
            try:
                flow_run = await self.client.read_flow_run(UUID(row.flow_run_id))
            except ObjectNotFound:
                flow_run = None
            state = flow_run.state if flow_run is not None else None
            if flow_run is None or state is None or state.is_final():
                self.store.upsert_job(row.flow_run_id, status="finished", gpus="")
                if row.status == "running":  # it ended while no worker watched: its GPUs went with it
                    ended = state.timestamp if state is not None else datetime.now(timezone.utc)
                    self.store.add(AllocationRecord(flow_run_id=row.flow_run_id, action="release", gpus="", at=ended))
                continue
            # A run cancelled while no worker watched still runs until it is stopped (_watch_cancelling).
            running = state.is_running() or state.is_pending() or state.is_cancelling()
            if not running and not (state.is_scheduled() and row.status == "admitted"):
                self.store.upsert_job(row.flow_run_id, status="arrived")
                continue  # not decided yet: taken in again by the next poll
            channel = FileControlChannel(
                row.flow_run_id, (flow_run.parameters or {}).get("control_dir") or str(self.home / "control")
            )
            ack, command = channel.acknowledged(), channel.latest()
            commanded = tuple(command.gpus or []) if command else ()
            held = tuple(sorted(set(ack.gpus if ack else ()) | set(commanded)))
            pending = command.seq if command and (ack is None or ack.seq < command.seq) else None
            points = get_curve(row.model, row.global_batch_size) or {1: 1e-9}
            limit = min(row.global_batch_size, self.cluster.topology.max_job_gpus)
            curve = ThroughputCurve({g: v for g, v in points.items() if g <= limit} or {1: 1e-9})
            job = Job(job_id=row.flow_run_id, submit_time=_aware(row.submitted_at).timestamp(),
                      iterations=row.iterations,
                      deadline=None if row.deadline is None else _aware(row.deadline).timestamp(), curve=curve,
                      model=row.model, batch_size=row.global_batch_size)
            run = Run(row.flow_run_id, job, channel, held=held if running else (),
                      commanded=commanded if running else (), pending_seq=pending if running else None,
                      since=now - 3600.0, share=row.share)
            self.scheduler.adopt(run, running=running, cancelled=state.is_cancelling())
            self._seen.add(row.flow_run_id)
            if running:
                self._adopted.add(row.flow_run_id)  # not our child: its end is read from Prefect
                self._logger.info("adopted running flow run %s on GPUs %s", row.flow_run_id, _gpus_label(held))
            else:
                self._logger.info("adopted admitted flow run %s, still waiting for GPUs", row.flow_run_id)
            await self._restore_history(row.flow_run_id)
        self._restore_view()

    def _restore_view(self) -> None:
        """The cluster plot's last hours from the store: a restart does not wipe it."""
        assert self.store is not None
        jobs = {row.flow_run_id: row for row in self.store.jobs()}
        rows = self.store.allocations(since=datetime.now(timezone.utc) - timedelta(hours=6))

        def name(run_id: str) -> str:
            row = jobs.get(run_id)
            return (row.flow_run_name if row is not None and row.flow_run_name else run_id[:8])

        changes = [(_aware(r.at), name(r.flow_run_id), len([g for g in r.gpus.split(",") if g])) for r in rows]
        deadlines = {name(i): _aware(row.deadline) for i, row in jobs.items() if row.deadline is not None}
        self.view.restore(changes, deadlines)

    async def _restore_history(self, run_id: str) -> None:
        """An adopted run keeps its one allocation-history artifact: found again
        and continued (earlier rows from the store), not a second one begun."""
        from uuid import UUID

        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        assert self.store is not None
        try:
            artifacts = await self.client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)])))
        except Exception:
            self._logger.warning("could not read the artifacts of %s", run_id, exc_info=True)
            return
        ours = [a for a in artifacts if a.description == HISTORY_DESCRIPTION]
        if ours:
            self._artifacts[run_id] = ours[0].id
        self._history[run_id] = [
            {"at": _aware(r.at).strftime("%H:%M:%S"),
             "action": r.action, "gpus": r.gpus or "-", "iteration": "-", "projected finish": "-"}
            for r in self.store.allocations(run_id)
        ]

    async def _watch_adopted(self) -> None:
        """Adopted runs are not our child processes: their end is read from Prefect."""
        from uuid import UUID

        from prefect.exceptions import ObjectNotFound

        for run_id in list(self._adopted):
            if run_id not in self.scheduler.runs:
                continue  # not planned yet
            try:
                flow_run: FlowRun | None = await self.client.read_flow_run(UUID(run_id))
                done = flow_run is None or flow_run.state is None or flow_run.state.is_final()
            except ObjectNotFound:
                flow_run, done = None, True
            if done:
                await self._adopted_ended(run_id, flow_run, "and its process has exited")

    async def _adopted_ended(self, run_id: str, flow_run: FlowRun | None, how: str) -> None:
        """An adopted run's process is gone: its GPUs are free, and if it was
        cancelled it ends Cancelled (`how` it ended, for the log)."""
        self._adopted.discard(run_id)
        await self._finished(run_id)
        if flow_run is not None:
            await self._settle_cancelling(flow_run, how)

    async def _watch_cancelling(self, now: float) -> None:
        """Running runs left `Cancelling` (adopted ones, or cancelled as they
        launched: see cancellation.py) are stopped here: told on their control
        channel, then signalled. An adopted one whose process is gone is ended."""
        from uuid import UUID

        from prefect.client.schemas.filters import (
            FlowRunFilter, FlowRunFilterId, FlowRunFilterState, FlowRunFilterStateType,
        )
        from prefect.client.schemas.objects import StateType

        running_ids = [UUID(r) for r, run in self.scheduler.runs.items() if run.phase == "running"]
        if not running_ids:
            return
        try:
            flow_runs = await self.client.read_flow_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=running_ids),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CANCELLING])),
            ))
        except Exception:
            self._logger.warning("could not read which runs are cancelling", exc_info=True)
            return
        for flow_run in flow_runs:
            run_id, adopted = str(flow_run.id), str(flow_run.id) in self._adopted
            run = self.scheduler.runs.get(run_id)
            if run is None or run.phase != "running":  # ended while we read
                continue
            try:
                await self._step_cancelling(flow_run, adopted, now)
            except Exception:  # one run's trouble must not stop the poll
                self._logger.exception("could not stop cancelled flow run %s", run_id)

    async def _step_cancelling(self, flow_run: FlowRun, adopted: bool, now: float) -> None:
        run_id = str(flow_run.id)
        message = flow_run.state.message if flow_run.state is not None else None
        step = self._cancellations.step(run_id, process_id(flow_run.infrastructure_pid), message, now, adopted)
        if step == "stop" and self.scheduler.stop(run_id):
            await self._record(run_id, "stop", ())
            self._logger.info("flow run %s is Cancelling and Prefect's worker does not stop it: told it to stop",
                              run_id)
        elif step in ("terminated", "killed"):
            self._logger.warning("flow run %s is Cancelling and did not stop when told: %s its process",
                                 run_id, step)
        elif step == "gone" and adopted:
            await self._adopted_ended(run_id, flow_run, "and its process is gone")

    async def _forget_vanished(self, scheduled: set[str]) -> None:
        """Admitted runs waiting for GPUs that left the Scheduled state without us
        (cancelled or deleted in the UI) give back their reservation."""
        from uuid import UUID

        from prefect.exceptions import ObjectNotFound

        for run_id in [r for r, run in self.scheduler.runs.items() if run.phase == "waiting" and r not in scheduled]:
            try:
                flow_run = await self.client.read_flow_run(UUID(run_id))
            except ObjectNotFound:
                flow_run = None
            if flow_run is None or flow_run.state is None or not flow_run.state.is_scheduled():
                self._logger.info("flow run %s left the queue before it got GPUs; forgetting it", run_id)
                await self._finished(run_id)

    async def _flow_name(self, flow_run: FlowRun) -> str:
        """The name of the run's flow: only `train` runs are scheduled; a pipeline
        deployed to the same pool (it calls `train` as a subflow) runs at once."""
        if flow_run.flow_id not in self._flow_names:
            try:
                self._flow_names[flow_run.flow_id] = (await self.client.read_flow(flow_run.flow_id)).name
            except Exception:
                self._logger.warning("could not read the flow of run %s; scheduling it as training", flow_run.id,
                                     exc_info=True)
                return TRAIN_FLOW
        return self._flow_names[flow_run.flow_id]

    def _check_start_cost(self) -> None:
        """The plans charge `overhead` per start; warn when runs take longer to
        reach their first iteration, since admitted deadlines rest on it."""
        for run_id, launched in list(self._launched_at.items()):
            run = self.scheduler.runs.get(run_id)
            status = (run.channel.status() if run is not None else None) or {}
            if run is None or run.phase == "finished":
                del self._launched_at[run_id]
            elif int(status.get("iteration") or 0) > 0:  # type: ignore[call-overload]
                del self._launched_at[run_id]
                took, charged = time.time() - launched, self.overhead(len(run.commanded) or 1)
                self._starts = [*self._starts[-9:], took]
                if took > 1.5 * max(charged, self.launch_s) and took > 1.2 * self._warned_start_s:
                    self._warned_start_s = took
                    self._logger.warning(
                        "flow run %s took %.1f s from launch to its first iteration; plans charge %.1f s per "
                        "start and keep %.1f s for a launch: admitted runs with tight deadlines may miss them. "
                        "New runs now keep the most of the last ten starts; set %s to what starts cost here",
                        run_id, took, charged, self.launch_reserve() + charged, LAUNCH_ENV)

    def launch_reserve(self) -> float:
        """Seconds kept in front of a new run's deadline for its start, beyond the
        restart the plans charge: `ELASTICFLOW_LAUNCH_S` if set; else 15 s or
        the longest of the last ten starts seen, whichever is larger."""
        seen = self._starts if self._learn_starts else []
        return max(0.0, max([self.launch_s, *seen]) - self.overhead(1))

    async def _show_cluster(self, now: float) -> None:
        """Keep the cluster artifact current; tell automations about deadlines at risk."""
        self._check_start_cost()
        snapshot = self.view.snapshot(self.scheduler.runs, self._names, self._projected, now)
        for change, job in self.view.risk_changes(snapshot):
            emit_risk(self._event, change, job)
            self._logger.warning("deadline %s: %s projected %s, due %s", change, job.name,
                                 job.projected_finish, job.deadline)
        if self.view.due(snapshot, now):
            markdown = await anyio.to_thread.run_sync(self.view.markdown, snapshot, now)  # renders a plot
            await self.view.publish(self.client, markdown)

    def clock(self) -> float:
        """Now, on the policy's clock: epoch seconds."""
        return time.time()

    async def _take_in(self, flow_run: FlowRun, now: float) -> None:
        run_id = str(flow_run.id)
        try:
            params, iterations, deadline = await anyio.to_thread.run_sync(self._parse, flow_run, now)
        except InvalidRun as exc:
            await self._reject(flow_run, "invalid_parameters", str(exc), None, now)
            return
        except Exception as exc:  # e.g. a dataset that cannot be read to count its epochs
            await self._reject(flow_run, "invalid_parameters", f"{type(exc).__name__}: {exc}", None, now)
            return
        assert self.store is not None
        self.store.upsert_job(
            run_id, flow_run_name=flow_run.name, model=params.model,
            global_batch_size=params.hyperparameters.global_batch_size, iterations=iterations,
            deadline=None if deadline is None else datetime.fromtimestamp(deadline, timezone.utc),
            status="arrived",
        )
        key = (params.model, params.hyperparameters.global_batch_size, params.device)
        curve = await anyio.to_thread.run_sync(self._stored_curve, params)
        if curve is None:
            if key not in self._profiles:
                self._to_profile.setdefault(key, params)  # started once GPUs are free (_collect_profiles)
            self._profiling[run_id] = _AwaitingProfile(flow_run, params, deadline, iterations, since=now)
            await self._wait_state(flow_run.id, PROFILING, now, "profiling the throughput of this model on first use")
            return
        self._queue(flow_run, params, deadline, iterations, curve, now)

    def _parse(self, flow_run: FlowRun, now: float) -> tuple[Any, float, float | None]:
        """Validate a run's parameters like the flow will; the deadline is kept
        apart so that a past one reaches the policy and gets its reason."""
        from pydantic import ValidationError

        from flows.training.datasets import load_dataset
        from flows.training.params import TrainParameters, parse_deadline

        raw = {k: v for k, v in (flow_run.parameters or {}).items() if v is not None}
        deadline_raw = raw.pop("deadline", None)
        try:
            params = TrainParameters.model_validate(raw)
            deadline = None
            if deadline_raw not in (None, ""):
                if raw.get("best_effort"):
                    raise ValueError("a best-effort job has no deadline; drop one of deadline and best_effort")
                moment = parse_deadline(deadline_raw, datetime.fromtimestamp(now, timezone.utc))
                deadline = moment.timestamp()
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(map(str, e['loc'])) or 'parameters'}: {e['msg']}" for e in exc.errors(include_url=False)
            )
            raise InvalidRun(problems) from None
        except ValueError as exc:
            raise InvalidRun(f"deadline: {exc}") from None
        iterations = params.iterations
        if iterations is None:
            iterations = params.total_iterations(len(load_dataset(params.dataset)))
        return params, float(iterations), deadline

    def _usable(self, params: Any, points: dict[int, float]) -> dict[int, float]:
        """Points the run can use: no more GPUs than samples in a global batch."""
        limit = min(params.hyperparameters.global_batch_size, self.cluster.topology.max_job_gpus)
        return {g: s for g, s in points.items() if g <= limit and s > 0}

    def _stored_curve(self, params: Any) -> dict[int, float] | None:
        from scheduler_service.store import get_curve

        points = get_curve(params.model, params.hyperparameters.global_batch_size)
        return self._usable(params, points) if points else None

    def _profile(self, params: Any, gpus: list[int]) -> dict[int, float]:
        from flows.training.profiler import profile_throughput
        from scheduler_service.store import save_curve

        counts = [1 << k for k in range(len(gpus).bit_length())]
        iterations = int(os.environ.get(PROFILE_ITERATIONS_ENV) or 8)
        curve = profile_throughput(
            params.model, params.hyperparameters.global_batch_size, counts, iterations=iterations,
            warmup=min(3, iterations - 2), device=self.cluster.device, model_kwargs=params.model_kwargs,
            dataset=params.dataset.model_dump() if params.dataset is not None else None, gpu_ids=gpus,
            timeout_s=self.profile_timeout,
        )
        save_curve(params.model, params.hyperparameters.global_batch_size, curve, device=self.cluster.device)
        return curve

    def _start_profiles(self) -> None:
        """Profile new models on GPUs nobody uses, reserved meanwhile so no run
        is launched or grown onto them: on a busy cluster a profile waits, or
        measures the GPU counts that are free (more: `elasticflow profile`)."""
        for key, params in list(self._to_profile.items()):
            top = min(self.cluster.topology.max_job_gpus, params.hyperparameters.global_batch_size,
                      4 if self.cluster.device == "cpu" else self.cluster.topology.max_job_gpus)
            gpus = self.scheduler.free_block(self.cluster.topology.num_gpus, top)
            if not gpus:
                if key not in self._profile_blocked:
                    self._profile_blocked.add(key)
                    self._logger.info("profiling %s@%s waits for free GPUs (held: %s)", key[0], key[1],
                                      self._holders())
                continue
            self._profile_blocked.discard(key)
            del self._to_profile[key]
            name = f"profiling {key[0]}@{key[1]}"
            self.scheduler.reserved[name] = gpus
            self._logger.info("%s on GPUs %s", name, _gpus_label(gpus))
            self._profiles[key] = self._profiler.submit(self._profile, params, list(gpus))

    async def _collect_profiles(self, now: float) -> None:
        for key, future in self._profiles.items():  # done: its GPUs go back to the runs
            if future.done():
                self.scheduler.reserved.pop(f"profiling {key[0]}@{key[1]}", None)
        self._start_profiles()
        for run_id, waiting in list(self._profiling.items()):
            params = waiting.params
            future = self._profiles.get(waiting.key)
            if future is None and now - waiting.since > self.profile_timeout:
                # Never started: the GPUs stayed busy. A profile that started ends
                # by itself (it has the same timeout) and is reported below.
                del self._profiling[run_id]
                await self._reject(
                    waiting.flow_run, "profiling_failed",
                    f"no GPUs were free to profile {params.model} at global batch "
                    f"{params.hyperparameters.global_batch_size} for {now - waiting.since:.0f} s (held: "
                    f"{self._holders()}); submit it again later, or measure it first with `elasticflow profile`",
                    None, now)
                continue
            if future is None or not future.done():
                continue
            del self._profiling[run_id]
            try:
                points = self._usable(params, future.result())
            except Exception as exc:  # profiling is the user's model running: any error is theirs to see
                await self._reject(waiting.flow_run, "profiling_failed", f"{type(exc).__name__}: {exc}", None, now)
                continue
            self._queue(waiting.flow_run, params, waiting.deadline, waiting.iterations, points, now)
        needed = {w.key for w in self._profiling.values()}
        for key in [k for k, f in self._profiles.items() if f.done() and k not in needed]:
            del self._profiles[key]
        for key in [k for k in self._to_profile if k not in needed]:  # its runs gave up waiting
            del self._to_profile[key]

    def _holders(self) -> str:
        """Who holds which GPU, for messages about GPUs that are not free."""
        return ", ".join(f"{gpu}: {holder}" for gpu, holder in sorted(self.scheduler.gpu_map().items())) or "none"

    def _queue(self, flow_run: FlowRun, params: Any, deadline: float | None, iterations: float,
               points: dict[int, float], now: float) -> None:
        from flows.training.control import FileControlChannel

        try:
            curve = ThroughputCurve(points)
        except ValueError:
            curve = ThroughputCurve({1: 1e-9})  # nothing measurable: the policy says no usable GPU count
        reserve = self.launch_reserve() if deadline is not None else 0.0
        job = Job(job_id=str(flow_run.id), submit_time=now, iterations=iterations,
                  deadline=None if deadline is None else deadline - reserve, curve=curve,
                  model=params.model, batch_size=params.hyperparameters.global_batch_size)
        root = params.control_dir or str(self.home / "control")
        self.scheduler.arrive(Run(str(flow_run.id), job, FileControlChannel(str(flow_run.id), root), reserve=reserve))

    # -- decisions and actions -> Prefect ---------------------------------------
    async def _publish(self, result: PlanResult, now: float) -> None:
        if result.decisions:
            self.decision_seconds.append(result.seconds)
        self._projected.update(result.projected_finish)
        for decision in result.decisions:
            if decision.admitted:
                await self._admitted(decision, result, now)
        # A burst of arrivals is decided in one policy call; telling Prefect is
        # what takes time (a state, an event per run), so rejections go out
        # together, a few requests at a time.
        gate = anyio.Semaphore(PUBLISH_CONCURRENCY)

        async def reject(decision: Decision) -> None:
            async with gate:
                entry = self._responses[decision.job_id]
                run = result.arrivals.get(decision.job_id)
                reserve = run.reserve if run is not None else 0.0  # policy deadline -> the user's
                earliest = decision.earliest_feasible_deadline
                message = decision.message
                if reserve and self.launch_reserve():
                    message += f" (a run takes about {self.launch_reserve() + self.overhead(1):.0f} s to start here)"
                await self._reject(entry.flow_run, decision.reason.value if decision.reason else "rejected",
                                   message, None if earliest is None else earliest + reserve, now, decision,
                                   result.seconds)

        async with anyio.create_task_group() as group:
            for decision in result.decisions:
                if not decision.admitted:
                    group.start_soon(reject, decision)

    async def _admitted(self, decision: Decision, result: PlanResult, now: float) -> None:
        assert self.store is not None
        run_id = decision.job_id
        share = decision.share
        self.store.add(DecisionRecord(flow_run_id=run_id, admitted=True, message=decision.message, share=share,
                                      decision_ms=result.seconds * 1000))
        self.store.upsert_job(run_id, status="admitted", share=share, message=decision.message)
        await self._labels(run_id, {"elasticflow.mss": share if share is not None else "best-effort",
                                    "elasticflow.admission": "admitted"})
        self._event(run_id, "elasticflow.decision", {
            "admitted": True, "guaranteed": decision.guaranteed, "mss": share, "message": decision.message,
            "guaranteed_finish": _iso(decision.guaranteed_finish), "decision_ms": round(result.seconds * 1000, 3),
            "allocation": result.allocation.get(run_id, 0),
        })
        entry = self._responses.get(run_id)  # none for a run adopted after a restart
        logger = self.get_flow_run_logger(entry.flow_run) if entry is not None else self._logger
        logger.info("ElasticFlow: %s", decision.message)
        if entry is not None:
            await self._wait_state(entry.flow_run.id, ADMITTED, now, decision.message)
        await self._record(run_id, "admitted", (), share=share, guaranteed_finish=decision.guaranteed_finish)

    async def _reject(self, flow_run: FlowRun, reason: str, message: str, earliest: float | None, now: float,
                      decision: Decision | None = None, seconds: float | None = None) -> None:
        assert self.store is not None
        run_id = str(flow_run.id)
        text = f"{reason}: {message}"
        if earliest is not None:
            text += f"; earliest feasible deadline {_iso(earliest)}"
        state = Cancelled(name=REJECTED, message=text)
        try:
            await self.client.set_flow_run_state(flow_run.id, state, force=True)
        except Exception:
            self._logger.exception("could not mark flow run %s Rejected", run_id)
        self.store.upsert_job(run_id, flow_run_name=flow_run.name, status="rejected", message=text)
        self.store.add(DecisionRecord(
            flow_run_id=run_id, admitted=False, reason=reason, message=message,
            earliest_feasible_deadline=None if earliest is None else datetime.fromtimestamp(earliest, timezone.utc),
            decision_ms=None if seconds is None else seconds * 1000,
        ))
        self._event(run_id, "elasticflow.decision", {
            "admitted": False, "reason": reason, "message": message, "earliest_feasible_deadline": _iso(earliest),
        })
        self._logger.info("rejected flow run %s: %s", run_id, text)
        try:  # also in the run's own logs, the tab its page opens on
            self.get_flow_run_logger(flow_run).warning("ElasticFlow rejected this run: %s", text)
        except Exception:
            pass

    async def _apply(self, action: Action, now: float) -> bool:
        """Show an action in Prefect; True if the run is to be launched now."""
        assert self.store is not None
        run_id = action.run_id
        if action.kind == "await":
            entry = self._responses.get(run_id)
            if entry is not None:
                why = "waiting for its GPUs to be released" if action.gpus else "waiting for spare GPUs"
                await self._wait_state(entry.flow_run.id, AWAITING, now, why)
            return False
        gpus = _gpus_label(action.gpus)
        self.store.add(AllocationRecord(flow_run_id=run_id, action=action.kind, gpus=gpus))
        await self._record(run_id, action.kind, action.gpus)
        if action.kind == "released":
            self.store.upsert_job(run_id, gpus="")
            return False
        self.store.upsert_job(run_id, status="running", gpus=gpus)
        await self._labels(run_id, {"elasticflow.gpus": gpus, "elasticflow.world_size": len(action.gpus)})
        self._event(run_id, "elasticflow.allocation.changed", {
            "action": action.kind, "gpus": list(action.gpus), "world_size": len(action.gpus),
            "nodes": self.cluster.nodes_of(action.gpus),
        })
        if action.kind == "launch":
            self._launched_at[run_id] = time.time()
        return action.kind == "launch"

    async def _record(self, run_id: str, action: str, gpus: tuple[int, ...] | list[int], share: int | None = None,
                      guaranteed_finish: float | None = None) -> None:
        """Append to the run's allocation history and show it as the run's artifact:
        when, what, GPUs, iteration reached, projected finish against the deadline."""
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        run = self.scheduler.runs.get(run_id)
        status = (run.channel.status() if run is not None else None) or {}
        projected = self._projected.get(run_id) if action != "release" else None
        self._history.setdefault(run_id, []).append({
            "at": datetime.now(timezone.utc).strftime("%H:%M:%S"), "action": action,
            "gpus": _gpus_label(gpus) or "-", "iteration": str(status.get("iteration", 0)),
            "projected finish": (_iso(projected) or "-")[:19].replace("T", " "),
        })
        lines = []
        if run is not None:
            job = run.job
            deadline = _iso(run.deadline) if run.deadline is not None else "none (best-effort)"
            lines.append(f"**{job.model}**, {job.iterations:.0f} iterations, deadline {deadline}, "
                         f"minimum satisfactory share {run.share if run.share is not None else share}")
        if guaranteed_finish is not None:
            lines.append(f"guaranteed finish: {_iso(guaranteed_finish)}")
        rows = self._history[run_id]
        header = list(rows[0])
        lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row[h] for h in header) + " |" for row in rows]
        markdown = "\n".join(lines)
        from uuid import UUID

        try:
            if run_id in self._artifacts:
                await self.client.update_artifact(self._artifacts[run_id], ArtifactUpdate(data=markdown))
            else:
                artifact = await self.client.create_artifact(ArtifactCreate(
                    type="markdown", data=markdown, flow_run_id=UUID(run_id),
                    description=HISTORY_DESCRIPTION,
                ))
                self._artifacts[run_id] = artifact.id
        except Exception:
            self._logger.warning("could not update the allocation artifact of %s", run_id, exc_info=True)

    async def _wait_state(self, flow_run_id: Any, name: str, now: float, why: str) -> None:
        """Put a run that has not started in a named Scheduled state, once per name
        (each write is a state row). Forced, since the pool's own rules would
        refuse Scheduled -> Scheduled; so first make sure the run is still
        Scheduled: a run cancelled in the UI must stay cancelled."""
        run_id = str(flow_run_id)
        if self._state_name.get(run_id) == name:
            return
        self._state_name[run_id] = name
        scheduled = datetime.fromtimestamp(now, timezone.utc)
        try:
            current = (await self.client.read_flow_run(flow_run_id)).state
            if current is None or not current.is_scheduled():
                return
            await self.client.set_flow_run_state(
                flow_run_id, Scheduled(name=name, scheduled_time=scheduled, message=why), force=True
            )
        except Exception:
            self._logger.exception("could not set flow run %s to %s", run_id, name)

    async def _labels(self, run_id: str, labels: dict[str, Any]) -> None:
        from uuid import UUID

        try:
            await self.client.update_flow_run_labels(UUID(run_id), {k: str(v) for k, v in labels.items()})
        except Exception:
            self._logger.warning("could not label flow run %s", run_id, exc_info=True)

    @staticmethod
    def _event(run_id: str, event: str, payload: dict[str, Any]) -> None:
        emit_event(event=event, resource={"prefect.resource.id": f"prefect.flow-run.{run_id}"}, payload=payload)

    # -- launching and finishing -----------------------------------------------
    async def _propose_pending_state(self, flow_run: FlowRun) -> bool:
        ok = await super()._propose_pending_state(flow_run)
        if not ok:  # cancelled meanwhile: its GPUs were never used
            await self._finished(str(flow_run.id))
        return ok

    async def run(
        self,
        flow_run: FlowRun,
        configuration: ProcessJobConfiguration,
        task_status: Optional[anyio.abc.TaskStatus[int]] = None,
    ) -> ProcessWorkerResult:
        run_id = str(flow_run.id)
        if not await self._still_to_launch(flow_run):
            await self._finished(run_id)
            if task_status is not None:
                task_status.started(0)  # no process: Prefect records no PID and releases its slot
            return ElasticFlowWorkerResult(identifier="", status_code=0)
        placed = self.scheduler.runs.get(run_id)
        if placed is not None and isinstance(configuration, ElasticFlowJobConfiguration):
            gpus = list(placed.commanded)
            configuration.gpus, configuration.world_size = gpus, len(gpus)
            configuration.nodes = self.cluster.nodes_of(gpus)
            configuration.env.update({
                "ELASTICFLOW_HOME": str(self.home),
                "ELASTICFLOW_GPUS": _gpus_label(gpus),
                "ELASTICFLOW_WORLD_SIZE": str(len(gpus)),
                "ELASTICFLOW_NODES": ",".join(configuration.nodes),
                # The deadline it was admitted with: a relative one (`+10m`) stays
                # what it meant at submission, and a late start still trains.
                "ELASTICFLOW_DEADLINE": _iso(placed.deadline) or "",
            })
        if self._forkserver is not None and isinstance(configuration, ElasticFlowJobConfiguration):
            from flows.training.boot import FORKSERVER_ENV

            # A forked process keeps what its interpreter read at start (sys.path,
            # TMPDIR, thread counts...) from the worker's environment; a run whose
            # job variables change any of it starts cold. Prefect settings are
            # compared by the server itself.
            own = sorted(k for k, v in configuration.env.items()
                         if not k.startswith(("PREFECT_", "ELASTICFLOW_")) and os.environ.get(k) != v)
            if own:
                self._logger.info("flow run %s starts cold: its job variables set %s", run_id, ", ".join(own))
            else:
                configuration.env[FORKSERVER_ENV] = str(self._forkserver[1])
        if not configuration._command_configured:
            from prefect.utilities.processutils import command_to_string, get_sys_executable

            # Prefect's default launcher is a workspace supervisor that then execs a
            # second interpreter for the engine (Prefect imported twice). Ours runs the
            # engine in one, in its own session, and starts the run's DDP workers first
            # so that they import torch while the engine starts (flows/training/boot.py).
            configuration.command = command_to_string([get_sys_executable(), "-m", "flows.training.boot"])
            configuration._command_configured = True
        try:
            result = await super().run(flow_run, configuration, task_status)
        finally:
            await self._finished(run_id)
            await self._settle_cancelling(flow_run, "and its process has exited")
        return ElasticFlowWorkerResult(identifier=result.identifier, status_code=result.status_code)

    async def _still_to_launch(self, flow_run: FlowRun) -> bool:
        """False for a run cancelled (or ended by hand) since we made it Pending:
        Prefect's launcher goes by the state it polled. A `Cancelling` one is
        ended `Cancelled` here, as nothing else would end it."""
        try:
            state = (await self.client.read_flow_run(flow_run.id)).state
        except Exception:
            self._logger.warning("could not read flow run %s before its launch; launching it", flow_run.id,
                                 exc_info=True)
            return True
        if state is not None and state.is_cancelling():
            return not await self._settle_cancelling(flow_run, "before its process started")
        if state is not None and state.is_final():
            self._logger.info("flow run %s is %s since it was made Pending; not launched", flow_run.id, state.name)
            return False
        return True

    async def _settle_cancelling(self, flow_run: FlowRun, when: str) -> bool:
        """End a run still `Cancelling` whose process is gone or never started, or
        one whose process we stopped for a cancellation (its engine then reports
        `Crashed`): `Cancelled`, with the canceller's message. True if it did.
        Without this such runs stayed `Cancelling` for ever: an engine refuses a
        run already `Cancelling` and exits without ending it, and Prefect's worker
        settles that only with `enable_cancellation`."""
        stop = self._cancellations.forget(str(flow_run.id))
        try:
            state = (await self.client.read_flow_run(flow_run.id)).state
            stopped_by_us = (stop is not None and stop.terminated is not None
                             and state is not None and state.is_crashed())
            if state is None or not (state.is_cancelling() or stopped_by_us):
                return False
            message = stop.message if stop is not None else (state.message or "cancelled")
            await self.client.set_flow_run_state(flow_run.id, Cancelled(message=message), force=stopped_by_us)
        except Exception:
            self._logger.warning("could not settle the cancellation of flow run %s", flow_run.id, exc_info=True)
            return False
        self._logger.info("flow run %s was cancelled %s; marked Cancelled", flow_run.id, when)
        return True

    async def _finished(self, run_id: str) -> None:
        if run_id in self.scheduler.runs and self.scheduler.runs[run_id].phase != "finished":
            await self._record(run_id, "release", ())
            self.scheduler.finish(run_id)
            if self.store is not None:
                self.store.upsert_job(run_id, status="finished", gpus="")
                self.store.add(AllocationRecord(flow_run_id=run_id, action="release", gpus=""))
        for table in (self._history, self._artifacts, self._projected):
            table.pop(run_id, None)
