"""Take-in: the runs a poll finds, before the control loop decides them.

A training run is validated as the flow will validate it (intake.py),
registered, and handed to the loop with its throughput curve, or profiled
first on its model's first use; one that cannot be scheduled is rejected at
once, naming the field, and the poll goes on with the others. Runs of other
flows in the pool (a pipeline) need no GPUs and start at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio

from scheduler_service.contracts import Rejection, RejectionReason
from scheduler_service.loop import ControlLoop
from scheduler_service.loop.events import Ended
from scheduler_service.policy.topology import kinds_of
from scheduler_service.text import shown
from scheduler_service.worker import intake
from scheduler_service.worker.configuration import ALLOWED, forbidden
from scheduler_service.worker.profiling import Profiler
from scheduler_service.worker.registry import RunRegistry
from scheduler_service.worker.reporting import Reporter
from scheduler_service.worker.settings import WorkerSettings

log = logging.getLogger("prefect.workers.elasticflow")  # the worker's own lines

TRAIN_FLOW = "train"  # runs of other flows in the pool (pipelines) start at once, with no GPUs


class TakeIn:
    def __init__(self, client: Any, settings: WorkerSettings, registry: RunRegistry, loop: ControlLoop,
                 profiler: Profiler, reporter: Reporter, device: Callable[[], str]) -> None:
        self.client = client
        self.device = device  # the cluster's, as it is now: "cuda" or "cpu"
        self.settings = settings
        self.registry = registry
        self.loop = loop
        self.profiler = profiler
        self.reporter = reporter
        self.flow_names: dict[Any, str] = {}  # flow id -> name (a handful of flows)
        self.held_back = False  # new runs left in the queue while Prefect's server catches up

    async def take(self, responses: list[Any], now: float) -> tuple[int, list[Any]]:
        """How many new training runs it took in, and the other runs to launch at once."""
        at_once, took_in = [], 0
        deployments: dict[Any, Any] = {}  # deployment id -> its job variables, read once a poll
        for entry in responses:
            run_id = str(entry.flow_run.id)
            known = self.registry.get(run_id)
            if known is not None:
                known.polled(entry)
                continue
            start = entry.flow_run.next_scheduled_start_time or entry.flow_run.expected_start_time
            if self.registry.seen(run_id) or (start is not None and start.timestamp() > now):
                continue
            await self._bound_name(entry.flow_run)
            refused = await self._job_variables(entry.flow_run, deployments)
            if refused is not None:
                await self.reject(entry.flow_run, refused, now)
                continue
            if await self._flow_name(entry.flow_run) != TRAIN_FLOW:
                log.info("launching flow run %s (%s): not a training run, it needs no GPUs", run_id,
                         entry.flow_run.name)
                self.registry.recent.add(run_id)
                at_once.append(entry)
                continue
            if self._hold_back():
                continue
            await self._one(entry, now)
            took_in += 1
        return took_in, at_once

    async def _bound_name(self, flow_run: Any) -> None:
        """A run's name is kept bounded and escaped (text.py), here and in
        Prefect: a 10 MB name crashed its run in Prefect's own events
        (EventTooLarge) while the store kept its GPUs, and a newline in one
        forged lines in worker.log. Renamed once, before anything of the run
        is written anywhere."""
        name = flow_run.name or ""
        kept = shown(name)
        if kept == name:
            return
        log.warning("flow run %s: its name (%d characters) is kept as %s", flow_run.id, len(name), kept)
        try:
            await self.client.update_flow_run(flow_run.id, name=kept)
        except Exception:
            log.warning("could not rename flow run %s in Prefect; the service keeps the bounded name", flow_run.id,
                        exc_info=True)
        flow_run.name = kept  # what Prefect's launch of it sends in its events and labels

    async def _job_variables(self, flow_run: Any, deployments: dict[Any, Any]) -> str | None:
        """Why the run's or its deployment's job variables refuse it, if they
        do: one a user may not set (its command, environment, working folder:
        configuration.py) is refused before anything of the run starts. Any
        run of the pool, training or not."""
        own = getattr(flow_run, "job_variables", None) or {}
        deployment_id = getattr(flow_run, "deployment_id", None)
        if deployment_id is not None and deployment_id not in deployments:
            try:
                deployments[deployment_id] = (await self.client.read_deployment(deployment_id)).job_variables
            except Exception:  # the launch drops them anyway (configuration.py)
                log.warning("could not read the deployment of flow run %s to check its job variables",
                            flow_run.id, exc_info=True)
                deployments[deployment_id] = {}
        given = [("its deployment's", deployments.get(deployment_id) or {}), ("the run's", own)]
        for whose, variables in given:
            names = forbidden(variables)
            if names:
                return (f"job_variables: {', '.join(map(repr, names))} in {whose} job variables may not be set "
                        f"(a user may set only {', '.join(sorted(ALLOWED))}); what every run needs there, the "
                        "operator sets in the pool's base job template")
        return None

    def _hold_back(self) -> bool:
        """Leave new runs in the queue, Scheduled, while Prefect's server is
        far behind (reporting.py): decided now, an admitted run would start
        only once its decision is written, later than its plan says. They
        are decided when it has caught up, against the time left then."""
        swamped = self.reporter.swamped()
        if swamped != self.held_back:
            self.held_back = swamped
            if swamped:
                log.warning(
                    "Prefect's server is %d decisions behind: new runs wait in the queue until it catches up, rather "
                    "than be admitted to start late. If Prefect's server runs on SQLite, a burst this size needs PostgreSQL "
                    "(docs/operating.md, 'Prefect's server on PostgreSQL')", self.reporter.untold)
            else:
                log.info("Prefect's server has caught up: taking in new runs again")
        return swamped

    async def _one(self, entry: Any, now: float) -> None:
        """Take in one run; whatever goes wrong is that run's: rejected, and the poll goes on."""
        flow_run = entry.flow_run
        try:
            await self._take_in(entry, now)
        except Exception as exc:
            log.exception("could not take in flow run %s", flow_run.id)
            await self.reject(flow_run, f"{type(exc).__name__}: {exc}", now)

    async def _take_in(self, entry: Any, now: float) -> None:
        from scheduler_service.store import get_curves
        from scheduler_service.store.throughput import partial_kinds

        flow_run = entry.flow_run
        try:
            request = await anyio.to_thread.run_sync(intake.read_request, flow_run.parameters, now)
            if self.settings.teams is not None:  # its team is its work queue
                request = replace(request, team=flow_run.work_queue_name or "")
            await anyio.to_thread.run_sync(intake.confine, request, self.settings.roots, self.settings.schemes)
            intake.check_device(request, self.device())
            await self._check_block(request)
        except intake.InvalidRun as exc:
            await self.reject(flow_run, str(exc), now)
            return
        run = intake.new_run(str(flow_run.id), flow_run.name, request, str(self.settings.home / "control"), now,
                             flow_run=flow_run, response=entry)
        self.registry.add(run)
        self.reporter.taken_in(run, request.batch_size)
        stored = await anyio.to_thread.run_sync(get_curves, request.model, request.batch_size)
        kinds = kinds_of(self.loop.topology)
        points, by_kind = intake.one_curve(stored), intake.kind_curves(stored, kinds)
        if points and (by_kind or not kinds):
            narrow = None  # a partial curve (one kind only): used for what it measured, completed when GPUs are free
            if not kinds and (await anyio.to_thread.run_sync(partial_kinds, request.model, request.batch_size)
                              & set(stored)):
                narrow = max(points)
                self.profiler.complete_later(request, narrow)
            self.loop.handle(intake.arrival(run, points, self.loop.topology.max_job_gpus, now, by_kind, narrow), now)
            self.profiler.measure_later(request, [kind for kind in kinds if kind not in stored])
            return
        self.profiler.wait_for(run)
        await self.reporter.profiling(run, now)

    async def _check_block(self, request: intake.Request) -> None:
        """A checkpoint store named by block must be saved: a run that names
        one nobody saved fails in its first segment, after it held GPUs."""
        from prefect.exceptions import ObjectNotFound

        from elasticflow_block.block import CheckpointStore

        name = intake.block_name(request)
        if name is None:
            return
        try:
            await self.client.read_block_document_by_name(name, CheckpointStore.get_block_type_slug())
        except ObjectNotFound:
            raise intake.InvalidRun(f"checkpoint_store: no CheckpointStore block named {name!r} is saved "
                                    "(CheckpointStore(url=...).save(name), or give a URL or an absolute path)") from None
        except Exception:
            log.warning("could not read block %r; the run's flow will", name, exc_info=True)

    async def reject(self, flow_run: Any, why: str, now: float) -> None:
        """Its parameters cannot be scheduled: rejected, naming the field, and forgotten."""
        run_id = str(flow_run.id)
        self.registry.forget(run_id)
        self.profiler.forget(run_id)
        self.loop.handle(Ended(run_id), now)  # if it was handed over already, it is no longer the loop's
        model = (flow_run.parameters or {}).get("model") if isinstance(flow_run.parameters, dict) else None
        await self.reporter.rejected(run_id, flow_run, Rejection.of(RejectionReason.INVALID_PARAMETERS, why, None),
                                     model=shown(model) if model is not None else "")

    async def _flow_name(self, flow_run: Any) -> str:
        """Only `train` runs are scheduled; a pipeline deployed to the same pool runs at once."""
        if flow_run.flow_id not in self.flow_names:
            try:
                self.flow_names[flow_run.flow_id] = (await self.client.read_flow(flow_run.flow_id)).name
            except Exception:
                log.warning("could not read the flow of run %s; scheduling it as training", flow_run.id,
                            exc_info=True)
                return TRAIN_FLOW
        return self.flow_names[flow_run.flow_id]
