"""The `elasticflow` Prefect worker: it translates flow runs to policy jobs,
and the scheduler's decisions to states, labels, events and launches.

Per poll (`ELASTICFLOW_POLL_S`; while a burst lasts, again at once): new
scheduled runs are taken in (intake.py;
a model's first use is profiled, profiling.py); the scheduler (scheduler.py,
over the pure policy) decides at once for arrivals and once per slot for
everyone; decisions and actions go to Prefect and the store (decisions.py,
publish.py); launches go to Prefect's process worker, which starts the flow
process that the execution backend (backend.py) prepared. Cancelled runs
Prefect cannot stop are stopped (stopping.py); a restarted worker adopts what
is still running (recovery.py). Prefect's private worker methods are used
only through prefect_api.py.
"""

from __future__ import annotations

import base64
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional

import anyio.abc
from prefect.settings import PREFECT_WORKER_QUERY_SECONDS, temporary_settings
from prefect.workers.process import ProcessWorker

from flows.training.launch import LaunchSpec
from scheduler_service.contracts import AllocationAction, Rejection, ServiceReason, StateName, epoch_to_datetime
from scheduler_service.policy import make_policy
from scheduler_service.policy.overhead import RestartOverhead
from scheduler_service.worker import cluster as cluster_mod
from scheduler_service.worker import decisions, intake, membership, recovery, stopping
from scheduler_service.worker.backend import Identified, InfrastructureGone, Placement, backend_for
from scheduler_service.worker.cluster_view import ClusterView, show_cluster
from scheduler_service.worker.configuration import (
    ElasticFlowJobConfiguration,
    ElasticFlowVariables,
    ElasticFlowWorkerResult,
)
from scheduler_service.worker.prefect_api import runs_task_group, scheduled_runs, submit, synced
from scheduler_service.worker.profiling import Profiler, measure_in_processes
from scheduler_service.worker.publish import Publisher
from scheduler_service.worker.run_state import Phase, RecentIds, RunState, SafetyMargin
from scheduler_service.worker.scheduler import Scheduler
from scheduler_service.worker.settings import load_settings
from scheduler_service.worker.start_cost import StartCost
from scheduler_service.worker.store import AllocationRecord, ServiceStore

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

BURST_ROUNDS = 5  # looks in one poll at most, while each takes in new runs
TRAIN_FLOW = "train"  # runs of other flows in the pool (pipelines) start at once, with no GPUs
# The project's own documentation where it is installed, and a logo that
# needs no server (the UI shows it in the work pool type gallery).
DOCS_URL = (Path(__file__).resolve().parents[2] / "docs" / "service.md").as_uri()
LOGO_URL = "data:image/svg+xml;base64," + base64.b64encode(
    b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 64 64"><rect width="64" height="64" rx="12" '
    b'fill="#1f6feb"/><path d="M14 46V18h18v6H21v5h10v6H21v5h11v6zm22 0V18h16v6h-9v5h8v6h-8v11z" '
    b'fill="#fff"/></svg>').decode()


class ElasticFlowWorker(ProcessWorker):
    type = "elasticflow"
    job_configuration = ElasticFlowJobConfiguration  # type: ignore[assignment]
    job_configuration_variables = ElasticFlowVariables  # type: ignore[assignment]
    _description = (
        "ElasticFlow: deadline-aware admission, elastic GPU allocation and buddy placement of "
        "`train` flow runs; runs them where the placement says and resizes them in place."
    )
    _display_name = "ElasticFlow"
    _documentation_url = DOCS_URL
    _logo_url = LOGO_URL

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("prefetch_seconds", 0)
        super().__init__(*args, **kwargs)
        self.settings = settings = load_settings()
        self.interval = settings.interval_s
        # Spare GPUs are granted only if the grant pays for its restart and for
        # the one taken back within a slot: the slot must exceed two restarts.
        self.overhead = RestartOverhead(stop_s=0.5, restart_s=settings.restart_s, per_level_s=0.0)
        self.start_cost = StartCost(self.overhead, settings.launch_s)
        self.backend = backend_for(settings)
        self.cluster = self.backend.cluster() or cluster_mod.load(settings.cluster, settings.cpu_slots)
        self.policy = make_policy(settings.policy, self.cluster.topology, interval=self.interval,
                                  overhead=self.overhead)
        self.scheduler = Scheduler(self.policy, locate=lambda gpus: self.cluster.locate(gpus))
        topology = self.cluster.topology
        self.profiler = Profiler(self.scheduler, measure_in_processes(
            self.cluster.device, settings.profile_iterations, settings.profile_timeout_s), topology.num_gpus,
            topology.max_job_gpus, self.cluster.device, settings.profile_timeout_s)
        # Deadline at risk: projected finish within the margin of the deadline, or half the room
        # a run's plan keeps if less (RunState.risk_margin); at least a slot: closer than that,
        # the next plan may not have had its say yet.
        self.view = ClusterView(self.cluster, margin_s=max(self.interval, settings.at_risk_s), floor_s=self.interval)
        self.runs: dict[str, RunState] = {}  # every run in flight, from take-in to its end
        self.recent = RecentIds()  # ended lately: a lagging poll must not take them in again
        self.flow_names: dict[Any, str] = {}  # flow id -> name (a handful of flows)
        self.decision_seconds: deque[float] = deque(maxlen=1000)
        self.store: ServiceStore = None  # type: ignore[assignment]  # opened in setup
        self.publisher: Publisher = None  # type: ignore[assignment]
        self.publishing = anyio.Semaphore(settings.publish_concurrency)  # Prefect requests in flight
        self.untold = 0  # decisions waiting to be told to Prefect in the background

    # -- lifecycle -------------------------------------------------------------
    async def start(self, *args: Any, **kwargs: Any) -> None:
        with temporary_settings(updates={PREFECT_WORKER_QUERY_SECONDS: self.settings.effective_poll_s}):
            await super().start(*args, **kwargs)

    async def setup(self) -> None:
        import importlib
        import os

        os.umask(0o077)  # the store, control channels and logs it creates are the service's alone
        await super().setup()
        self.store = ServiceStore()
        self.publisher = Publisher(self.client, lambda: self._event_related_resources(include_self=True))
        self._logger.info("ElasticFlow scheduler: %s (%s), policy %s, slot %.1f s, %s backend",
                          self.cluster.topology.describe(), self.cluster.source, self.settings.policy,
                          self.interval, self.backend.name)
        self.cluster.publish(self.settings.home)
        await recovery.adopt(self)
        self.backend.open(self.settings.home)
        # The first take-in would otherwise pay for importing the train flow's
        # parameter model (and torch with it): about 4 s on a small machine.
        await anyio.to_thread.run_sync(importlib.import_module, "flows.training.params")
        if self.interval < 2 * self.overhead(1):
            self._logger.warning(
                "slot %.1f s is under two restarts (%.1f s): no spare GPUs will be granted early; raise "
                "ELASTICFLOW_INTERVAL_S or lower ELASTICFLOW_RESTART_S", self.interval, 2 * self.overhead(1))

    async def teardown(self, *exc_info: Any) -> None:
        self.profiler.close()
        self.backend.close()
        await super().teardown(*exc_info)

    # -- the poll: take in, decide, actuate ------------------------------------
    async def get_and_submit_flow_runs(self) -> list[FlowRun]:
        if not synced(self):
            return await super().get_and_submit_flow_runs()
        submitted: list[FlowRun] = []
        for _ in range(BURST_ROUNDS):  # while a burst lasts, look again at once rather than after a poll's pause
            took_in, launched = await self._poll_once()
            submitted += launched
            if not took_in:
                break
        return submitted

    async def _poll_once(self) -> tuple[int, list[FlowRun]]:
        """One look: how many training runs it took in, and what it launched."""
        responses = await scheduled_runs(self)
        now = self.clock()
        launches = []
        took_in = 0
        for entry in responses:
            run_id = str(entry.flow_run.id)
            if run_id in self.runs:
                self.runs[run_id].response = entry
                continue
            start = entry.flow_run.next_scheduled_start_time or entry.flow_run.expected_start_time
            if run_id in self.recent or (start is not None and start.timestamp() > now):
                continue
            if await self._flow_name(entry.flow_run) != TRAIN_FLOW:
                self._logger.info("launching flow run %s (%s): not a training run, it needs no GPUs",
                                  run_id, entry.flow_run.name)
                self.recent.add(run_id)
                launches.append(entry)
                continue
            await self._take_in_one(entry, now)
            took_in += 1
        await stopping.forget_vanished(self, {str(entry.flow_run.id) for entry in responses})
        await stopping.watch_foreign(self)
        await stopping.watch_cancelling(self, now)
        for outcome in self.profiler.poll(now):
            if outcome.points is None:
                await decisions.reject(self, outcome.run.flow_run, Rejection.of(
                    (outcome.reason or ServiceReason.PROFILING_FAILED).value, outcome.message, None))
            else:
                self._ready(outcome.run, outcome.points, now)
        changed = await anyio.to_thread.run_sync(self.backend.changed, now)
        if changed is not None:
            membership.follow(self, changed)
        result = self.scheduler.plan(now)
        if result is not None:
            await decisions.publish(self, result, now)
        for action in self.scheduler.actuate(now):
            if await decisions.apply(self, action, now):
                launches.append(self.runs[action.run_id].response)
        await show_cluster(self, now)
        return took_in, await submit(self, [entry for entry in launches if entry is not None])

    async def _take_in_one(self, entry: Any, now: float) -> None:
        """Take in one run; whatever goes wrong is that run's: rejected, and the poll goes on."""
        try:
            await self._take_in(entry, now)
        except Exception as exc:
            self._logger.exception("could not take in flow run %s", entry.flow_run.id)
            self.forget(str(entry.flow_run.id))
            await decisions.reject(self, entry.flow_run, Rejection.of(
                ServiceReason.INVALID_PARAMETERS.value, f"{type(exc).__name__}: {exc}", None))

    async def _take_in(self, entry: Any, now: float) -> None:
        from scheduler_service.store import get_curve

        flow_run = entry.flow_run
        try:
            request = await anyio.to_thread.run_sync(intake.read_request, flow_run.parameters, now)
            await anyio.to_thread.run_sync(intake.confine, request, self.settings.roots, self.settings.schemes)
        except intake.InvalidRun as exc:
            await decisions.reject(self, flow_run, Rejection.of(ServiceReason.INVALID_PARAMETERS.value, str(exc), None))
            return
        run = intake.new_run(str(flow_run.id), flow_run.name, request, str(self.settings.home / "control"), now)
        run.flow_run, run.response = flow_run, entry
        self.runs[run.run_id] = run
        self.store.upsert_job(run.run_id, flow_run_name=run.name, model=request.model,
                              global_batch_size=request.batch_size, iterations=request.iterations,
                              deadline=epoch_to_datetime(run.deadline), status="arrived")
        points = await anyio.to_thread.run_sync(get_curve, request.model, request.batch_size)
        if points:
            self._ready(run, points, now)
            return
        self.profiler.wait_for(run)
        why = "profiling the throughput of this model on first use"
        self.store.upsert_job(run.run_id, message=why)
        await self.publisher.waiting_state(run, StateName.PROFILING, now, why)

    def _ready(self, run: RunState, points: dict[int, float], now: float) -> None:
        margin = SafetyMargin(self.settings.safety_margin, floor_s=self.interval)
        self.scheduler.arrive(intake.ready(run, points, self.cluster.topology.max_job_gpus,
                                           self.start_cost.reserve(), now, margin))

    async def _flow_name(self, flow_run: FlowRun) -> str:
        """Only `train` runs are scheduled; a pipeline deployed to the same pool runs at once."""
        if flow_run.flow_id not in self.flow_names:
            try:
                self.flow_names[flow_run.flow_id] = (await self.client.read_flow(flow_run.flow_id)).name
            except Exception:
                self._logger.warning("could not read the flow of run %s; scheduling it as training", flow_run.id,
                                     exc_info=True)
                return TRAIN_FLOW
        return self.flow_names[flow_run.flow_id]

    async def in_background(self, tell: Callable[..., Awaitable[None]], *args: Any, later: bool = False) -> None:
        """Tell Prefect without holding up the poll, within `publishing`'s
        requests in flight; inline before the worker's task group exists.
        What can come `later` (details of a decision already shown) waits
        until no decision is left to tell: on a loaded server it would
        otherwise hold the decisions back by a third."""
        async def gated() -> None:
            try:
                while later and self.untold:
                    await anyio.sleep(0.1)
                async with self.publishing:
                    await tell(*args)
            finally:
                self.untold -= not later

        self.untold += not later  # counted from now: a later one spawned next must see it
        group = runs_task_group(self)
        if group is None:
            await gated()
        else:
            group.start_soon(gated)

    def clock(self) -> float:
        """Now, on the policy's clock: epoch seconds."""
        return time.time()

    # -- launching and ending --------------------------------------------------
    async def _propose_pending_state(self, flow_run: FlowRun) -> bool:
        ok = await super()._propose_pending_state(flow_run)
        if not ok:  # cancelled meanwhile: its GPUs were never used
            await self.finished(str(flow_run.id))
        return ok

    async def run(self, flow_run: FlowRun, configuration: ElasticFlowJobConfiguration,
                  task_status: Optional[anyio.abc.TaskStatus[Any]] = None) -> ElasticFlowWorkerResult:
        run_id = str(flow_run.id)
        if not await stopping.still_to_launch(self, flow_run):
            await self.finished(run_id)
            if task_status is not None:
                task_status.started(0)  # no process: Prefect records no PID and releases its slot
            return ElasticFlowWorkerResult(identifier="", status_code=0)
        placed = self.runs.get(run_id)
        if placed is not None:
            gpus = tuple(placed.commanded)
            self.backend.prepare(configuration.env, Placement(run_id, gpus, tuple(self.cluster.nodes_of(gpus))),
                                 LaunchSpec(deadline=epoch_to_datetime(placed.deadline), admitted=True))
            configuration.env["ELASTICFLOW_HOME"] = str(self.settings.home)
        if not configuration._command_configured:
            from prefect.utilities.processutils import command_to_string, get_sys_executable

            # Prefect's default launcher is a workspace supervisor that then execs a
            # second interpreter for the engine (Prefect imported twice). Ours runs the
            # engine in one, in its own session, and starts the run's DDP ranks first
            # so that they import torch while the engine starts (flows/training/boot.py).
            configuration.command = command_to_string([get_sys_executable(), "-m", "flows.training.boot"])
            configuration._command_configured = True
        try:
            result = await super().run(flow_run, configuration, Identified(task_status, self.backend))
        finally:
            await self.finished(run_id)
            await stopping.settle(self, flow_run.id, "and its process has exited")
        return ElasticFlowWorkerResult(identifier=result.identifier, status_code=result.status_code)

    async def kill_infrastructure(self, infrastructure_pid: str, configuration: ElasticFlowJobConfiguration,
                                  grace_seconds: int = 30) -> None:
        """Prefect's own cancellation paths: stop the run's processes where they live."""
        from prefect.exceptions import InfrastructureNotFound

        run_id = configuration.env.get("PREFECT__FLOW_RUN_ID")
        try:
            await anyio.to_thread.run_sync(self.backend.kill, infrastructure_pid, run_id, float(grace_seconds))
        except InfrastructureGone:
            raise InfrastructureNotFound(f"no process of this flow run at {infrastructure_pid}") from None

    async def finished(self, run_id: str) -> None:
        """The run's process exited (or it never started): its GPUs are free and it is forgotten."""
        run = self.runs.get(run_id)
        if run is not None and run_id in self.scheduler.runs and run.phase != Phase.FINISHED:
            decisions.tell(self, run, decisions.outcome_line(run, time.time()))
            await self.publisher.history(run, AllocationAction.RELEASE, ())
            self.scheduler.finish(run_id)
            self.store.upsert_job(run_id, status="finished", gpus="")
            self.store.add(AllocationRecord(flow_run_id=run_id, action=AllocationAction.RELEASE.value, gpus=""))
        self.forget(run_id)

    def forget(self, run_id: str) -> None:
        """Drop the run's bookkeeping (the scheduler drops its own at its next plan)."""
        self.runs.pop(run_id, None)
        self.profiler.forget(run_id)
        self.scheduler.withdraw(run_id)
        self.recent.add(run_id)

    def bookkeeping(self) -> dict[str, int]:
        """Sizes of what the worker keeps, for the test that it does not grow with ended runs."""
        return {"runs": len(self.runs), "scheduler.runs": len(self.scheduler.runs),
                "scheduler.arrivals": len(self.scheduler.arrivals), "recent": len(self.recent),
                "flow_names": len(self.flow_names), **{f"profiler.{k}": v for k, v in self.profiler.sizes().items()}}
