"""The `elasticflow` Prefect worker: a thin adapter between Prefect and the
control loop (scheduler_service/loop), which makes every decision.

Per poll (`ELASTICFLOW_POLL_S`; while a burst lasts, again at once): new
scheduled runs are taken in (intake.py; a model's first use is profiled,
profiling.py); what Prefect and the runs' control channels say becomes the
loop's events (watch.py, channels.py); the loop's actions are carried out
(execute.py: control-channel commands, launches, and through reporting.py
the store first, then Prefect); launches go to Prefect's process worker,
which starts the flow process that the execution backend (backend.py)
prepared. A restarted worker adopts what is still running (recovery.py).
Prefect's private worker methods are used only through prefect_api.py.
"""

from __future__ import annotations

import base64
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import anyio.abc
from prefect.settings import PREFECT_WORKER_QUERY_SECONDS, temporary_settings
from prefect.workers.process import ProcessWorker

from flows.training.launch.spec import LaunchSpec
from flows.training.launch.pause import stack_stopping, stopped_at
from scheduler_service.contracts import EventName, RejectionReason, RunPhase, epoch_to_datetime
from scheduler_service.loop import ControlLoop
from scheduler_service.loop.events import CancelRequested, Ended, Event, Leaving, ProfileFailed, StartsRecalled
from scheduler_service.loop.start_cost import SEEN
from scheduler_service.policy.topology import kinds_of
from scheduler_service.text import one_line_logs
from scheduler_service.worker import cluster as cluster_mod
from scheduler_service.worker import intake
from scheduler_service.worker.backend import Identified, InfrastructureGone, RankPlacement, backend_for
from scheduler_service.worker.channels import observe
from scheduler_service.worker.cluster_view import ClusterView
from scheduler_service.worker.configuration import (
    ElasticFlowJobConfiguration,
    ElasticFlowVariables,
    ElasticFlowWorkerResult,
)
from scheduler_service.worker.execute import Applied, Executor
from scheduler_service.worker.lease import PoolLease
from scheduler_service.worker.membership import follow
from scheduler_service.worker.prefect_api import runs_task_group, scheduled_runs, submit, synced
from scheduler_service.worker.profiling import Profiler, measure_where_runs_train
from scheduler_service.worker.publish import Publisher
from scheduler_service.worker.recovery import allocation_changes, recover
from scheduler_service.worker.registry import RunRegistry
from scheduler_service.worker.reporting import Reporter
from scheduler_service.worker.settings import SettingsError, load_settings
from scheduler_service.worker.store import ServiceStore, aware
from scheduler_service.worker.takein import TakeIn
from scheduler_service.worker.watch import PrefectWatch

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

BURST_ROUNDS = 5  # looks in one poll at most, while each takes in new runs
CLUSTER_VIEW = "cluster-view"  # the lane of the cluster artifact's refreshes
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
        self.backend = backend_for(settings)
        self.cluster = self.backend.cluster() or cluster_mod.load(settings.cluster, settings.cpu_slots)
        try:
            self.loop = ControlLoop(self.cluster.topology, settings.loop())
        except ValueError as exc:  # a teams file whose shares the cluster cannot hold
            raise SettingsError(f"ELASTICFLOW_TEAMS={settings.teams}: {exc}") from None
        self.registry = RunRegistry()  # every run in flight, from take-in to its end
        self.profiler = Profiler(measure_where_runs_train(self.cluster.device, settings.profile_iterations,
                                                          settings.profile_timeout_s, lambda: self.cluster,
                                                          settings.ray_address),
                                 self.cluster.device, settings.profile_timeout_s)
        self.view = ClusterView(self.cluster, margin_s=self.loop.risk.at_risk_s)
        self.reporter: Reporter = None  # type: ignore[assignment]  # these talk to Prefect: made in setup
        self.executor: Executor = None  # type: ignore[assignment]
        self.watch: PrefectWatch = None  # type: ignore[assignment]
        self.take_in: TakeIn = None  # type: ignore[assignment]
        self.lease: PoolLease | None = None  # taken in setup: one worker per pool

    # -- lifecycle -------------------------------------------------------------
    async def start(self, *args: Any, **kwargs: Any) -> None:
        with temporary_settings(updates={PREFECT_WORKER_QUERY_SECONDS: self.settings.effective_poll_s}):
            await super().start(*args, **kwargs)

    async def setup(self) -> None:
        os.umask(0o077)  # the store, control channels and logs it creates are the service's alone
        one_line_logs(self._logger)  # no run's name or message forges a line of worker.log (text.py)
        store = ServiceStore()
        self.lease = PoolLease(store.engine, self._work_pool_name, self.settings.lease_s)
        taken_over = self.lease.take()  # before anything of the pool is touched: PoolHeld names its holder
        try:
            await self._set_up(store)
        except BaseException:
            self.lease.release()
            raise
        if taken_over:
            self._logger.warning(taken_over)
        self.lease.keep(on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM))  # Prefect's worker stops cleanly

    async def _set_up(self, store: ServiceStore) -> None:
        import importlib

        await super().setup()
        self.connect(store, Publisher(self.client, lambda: self._event_related_resources(include_self=True)),
                     self.client)
        settings, restart_s = self.settings, self.loop.policy.clock.overhead(1)
        self._logger.info("ElasticFlow scheduler: %s (%s), policy %s, slot %.1f s, %s backend",
                          self.cluster.describe(), self.cluster.source, settings.policy,
                          settings.interval_s, self.backend.name)
        self.cluster.publish(settings.home, self.loop.settings.teams)
        await self._adopt()
        self.backend.open(settings.home)
        # The first take-in would otherwise pay for importing the train flow's
        # parameter model (and torch with it): about 4 s on a small machine.
        await anyio.to_thread.run_sync(importlib.import_module, "flows.training.params")
        for warning in settings.warnings(restart_s):
            self._logger.warning(warning)

    def connect(self, store: ServiceStore, publisher: Publisher, client: Any) -> None:
        """Make what tells the store and Prefect, and reads Prefect: setup
        connects the real ones; tests without a server, recorders."""
        self.reporter = Reporter(store, publisher, self.get_flow_run_logger, lambda: runs_task_group(self),
                                 self.settings.publish_concurrency)
        self.watch = PrefectWatch(client, self.backend)
        self.executor = Executor(self.loop, self.registry, self.reporter, lambda: self.cluster, self.watch,
                                 self.view, self.clock, self.profiler)
        self.take_in = TakeIn(client, self.settings, self.registry, self.loop, self.profiler, self.reporter,
                              lambda: self.cluster.device)

    def recall_starts(self, now: float) -> None:
        """What the last life learnt of how long starts take here (the store keeps each)."""
        self.loop.handle(StartsRecalled(self.reporter.store.recent_starts(SEEN)), now)

    async def _adopt(self) -> None:
        """Adopt what an earlier life of the worker left running or admitted, and the cluster plot's recent past."""
        store, now = self.reporter.store, self.clock()
        self.recall_starts(now)  # before any run is planned again
        for run, event in await recover(self.client, store, str(self.settings.home / "control"),
                                        self.cluster.topology.max_job_gpus, now, self.backend.alive,
                                        kinds_of(self.cluster.topology), self.settings.teams is not None,
                                        stopped_at(self.settings.home), self.cluster.slots):
            self.registry.add(run)
            await self.executor.apply(self.loop.handle(event, now), now)
            where = f"on GPUs {','.join(map(str, event.held))}" if event.running else "still waiting for GPUs"
            self._logger.info("adopted %s flow run %s %s", "running" if event.running else "admitted",
                              run.run_id, where)
            await self.reporter.publisher.find_history(run, [(aware(r.at), r.action, r.gpus)
                                                             for r in store.allocations(run.run_id)])
        self.view.restore(*allocation_changes(store))

    async def teardown(self, *exc_info: Any) -> None:
        if self.reporter is not None:  # what already happened reaches Prefect before the client closes
            await self.reporter.drain()
        self.profiler.close()
        self.backend.close()
        await super().teardown(*exc_info)
        if self.lease is not None:  # last: the next worker may take the pool once this one is done with it
            self.lease.release()

    # -- the poll: take in, tell the loop, act -----------------------------------
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
        took_in, launches = await self.take_in.take(responses, now)
        events, gone_elsewhere = await self._watched({str(entry.flow_run.id) for entry in responses}, now)
        applied = await self.decide(now, events)
        for run_id in gone_elsewhere:  # released first, then its Prefect state settled
            await self.reporter.in_background(self.watch.settle, run_id, "and its process is gone", lane=run_id)
        await self.executor.tell_how_they_ended(applied)
        launches += applied.launches
        if not self.reporter.lanes.busy(CLUSTER_VIEW):  # a slow server: skip a refresh rather than queue them
            names = {run.run_id: run.name for run in self.registry}
            await self.reporter.in_background(self.view.show, self.client, self.loop.views(now), names, now,
                                              self.loop.teams(), lane=CLUSTER_VIEW)
        return took_in, await submit(self, launches)

    async def _watched(self, scheduled: set[str], now: float) -> tuple[list[Event], list[str]]:
        """What happened since the last poll, as the loop's events: runs that
        left the queue, ended elsewhere or are to be stopped; profiles done;
        what launched runs say on their channels; nodes that came or went.
        And the runs whose process ended without this worker seeing it."""
        views = {view.run_id: view for view in self.loop.views(now)}
        running = {run.run_id: run for run in self.registry
                   if run.run_id in views and views[run.run_id].phase == RunPhase.RUNNING}
        waiting = [run.run_id for run in self.registry if run.run_id not in running]
        events: list[Event] = [e for run_id, run in running.items()
                                for e in observe(run_id, run.channel, self.cluster.slots)]
        events += [Ended(run_id) for run_id in await self.watch.vanished(waiting, scheduled)]
        foreign = [run_id for run_id, run in running.items() if run.foreign_process]
        ended = await self.watch.ended(foreign)
        stopping = await self.watch.cancelling({i: run.foreign_process for i, run in running.items()}, now)
        events += [Leaving(run_id) for run_id in stopping.leaving]
        events += [Ended(run_id) for run_id in [*ended, *stopping.gone]]
        events += [CancelRequested(run_id) for run_id in stopping.stop]
        outcomes, reservations = self.profiler.poll(now, self.loop, self.loop.topology.max_job_gpus)
        events += reservations
        for outcome in outcomes:
            if outcome.points is None:
                events.append(ProfileFailed(outcome.run.run_id, outcome.reason or RejectionReason.PROFILING_FAILED,
                                            outcome.message))
            else:
                by_kind = intake.kind_curves({"": outcome.points}, kinds_of(self.loop.topology))
                events.append(intake.arrival(outcome.run, outcome.points, self.loop.topology.max_job_gpus, now,
                                             by_kind, outcome.measured_up_to))
        for run_id in [e.run_id for e in events if isinstance(e, Ended)]:
            self.profiler.forget(run_id)
            if run_id not in views:  # never decided: nothing of it is the loop's
                self.registry.forget(run_id)
        changed = await anyio.to_thread.run_sync(self.backend.changed, now)
        if changed is not None:
            change = follow(self.cluster, changed)
            self.cluster = changed
            self.view.follow(changed)
            changed.publish(self.settings.home, self.loop.settings.teams)
            self._logger.warning("cluster changed: %s", change.describe())
            self.reporter.publisher.cluster_event(EventName.CLUSTER_CHANGED, {
                "lost": change.gone, "joined": change.joined, "topology": changed.describe()},
                nodes=[*change.gone, *change.joined])
            events.append(change.event)
        return events, [*ended, *stopping.gone]

    async def decide(self, now: float, events: list[Event] | None = None) -> Applied:
        """Tell the loop what happened, step it, and carry out what it decides."""
        return await self.executor.apply(self.loop.tick(events or [], now), now)

    def clock(self) -> float:
        """Now, on the loop's clock: epoch seconds."""
        return time.time()

    # -- launching and ending --------------------------------------------------
    async def _propose_pending_state(self, flow_run: FlowRun) -> bool:
        async with self.reporter.lanes.of(str(flow_run.id)):  # after its Admitted state, written in the background
            ok = await super()._propose_pending_state(flow_run)
        if not ok:  # cancelled meanwhile: its GPUs were never used
            await self.executor.tell_how_they_ended(await self.ended(str(flow_run.id)))
        return ok

    async def run(self, flow_run: FlowRun, configuration: ElasticFlowJobConfiguration,
                  task_status: Optional[anyio.abc.TaskStatus[Any]] = None) -> ElasticFlowWorkerResult:
        run_id = str(flow_run.id)
        if not await self.watch.still_to_launch(flow_run):
            await self.executor.tell_how_they_ended(await self.ended(run_id))
            if task_status is not None:
                task_status.started(0)  # no process: Prefect records no PID and releases its slot
            return ElasticFlowWorkerResult(identifier="", status_code=0)
        placed = self.registry.get(run_id)
        if placed is not None:
            gpus = placed.launch_gpus
            self.backend.prepare(configuration.env, RankPlacement(run_id, gpus, tuple(self.cluster.nodes_of(gpus))),
                                 LaunchSpec(deadline=epoch_to_datetime(placed.deadline), admitted=True))
            configuration.env["ELASTICFLOW_HOME"] = str(self.settings.home)
        from prefect.utilities.processutils import command_to_string, get_sys_executable

        # Prefect's default launcher is a workspace supervisor that then execs a
        # second interpreter for the engine (Prefect imported twice). Ours runs the
        # engine in one, in its own session, and starts the run's DDP ranks first
        # so that they import torch while the engine starts (flows/training/launch/boot.py).
        # It is always ours: a command from job variables would run as the stack's
        # user (configuration.py).
        configuration.command = command_to_string([get_sys_executable(), "-m", "flows.training.launch.boot"])
        configuration._command_configured = True
        try:
            result = await super().run(flow_run, configuration, Identified(task_status, self.backend))
        finally:
            if stack_stopping(self.settings.home):  # it paused: the next start's recovery resumes it (pause.py)
                self._logger.info("flow run %s: its process exited while the stack stops; left to the next start",
                                  run_id)
            else:
                ended = await self.ended(run_id)  # its GPUs are free: in the store first
                await self.watch.settle(flow_run.id, "and its process has exited")
                await self.executor.tell_how_they_ended(ended)
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

    async def ended(self, run_id: str) -> Applied:
        """The run's process exited (or it never started): its GPUs are free and
        it is forgotten, after its channel's last word (the iteration it
        reached). The GPUs are handed on at once, not at the next poll: the
        poll's own reads of Prefect (its filters are POSTs, refused with a 503
        and retried with a growing backoff on a loaded server) held it up to
        15 s a poll in a slow-server burst, and once so long that two
        admitted runs waited beside the free GPUs until their deadlines had
        passed (tests/service/test_handover.py)."""
        now = self.clock()
        self.profiler.forget(run_id)
        run = self.registry.get(run_id)
        events = [*(observe(run_id, run.channel, self.cluster.slots) if run is not None else []), Ended(run_id)]
        applied = await self.decide(now, events)
        self.registry.forget(run_id)
        await submit(self, applied.launches)
        return applied

    def bookkeeping(self) -> dict[str, int]:
        """Sizes of what the worker keeps, for the test that it does not grow with ended runs."""
        return {**self.registry.sizes(), **{f"loop.{k}": v for k, v in self.loop.sizes().items()},
                "flow_names": len(self.take_in.flow_names), "lanes": len(self.reporter.lanes),
                **{f"profiler.{k}": v for k, v in self.profiler.sizes().items()}}
