"""Runs that end or leave before the scheduler is done with them: the
worker's side of stopping cancelled runs (the steps themselves are in
`cancellation.py`, behind the execution backend), and of ending runs whose
process is gone: adopted runs are not the worker's children, so their end is
read from Prefect; runs cancelled before their launch, or before they got
GPUs, are never launched.

`settle` ends a run still `Cancelling` whose process is gone or never
started, or one whose process was stopped for a cancellation (its engine then
reports `Crashed`): `Cancelled`, with the canceller's message. Without it
such runs stayed `Cancelling` for ever: an engine refuses a run already
`Cancelling` and exits without ending it, and Prefect's worker settles that
only with `enable_cancellation`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect.states import Cancelled

from scheduler_service.contracts import AllocationAction
from scheduler_service.worker.run_state import Phase

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

    from scheduler_service.worker.worker import ElasticFlowWorker

log = logging.getLogger("prefect.workers.elasticflow.stopping")  # shown with the worker's own lines


async def settle(worker: ElasticFlowWorker, flow_run_id: Any, when: str) -> bool:
    """End a cancelled run whose process is gone `Cancelled`; True if it did."""
    stop = worker.backend.forget(str(flow_run_id))
    try:
        state = (await worker.client.read_flow_run(flow_run_id)).state
        stopped_by_us = stop is not None and stop.terminated is not None and state is not None and state.is_crashed()
        if state is None or not (state.is_cancelling() or stopped_by_us):
            return False
        message = stop.message if stop is not None else (state.message or "cancelled")
        await worker.client.set_flow_run_state(flow_run_id, Cancelled(message=message), force=stopped_by_us)
    except Exception:
        log.warning("could not settle the cancellation of flow run %s", flow_run_id, exc_info=True)
        return False
    log.info("flow run %s was cancelled %s; marked Cancelled", flow_run_id, when)
    return True


async def ended_elsewhere(worker: ElasticFlowWorker, run_id: str, how: str) -> None:
    """A run's process (not the worker's child) is gone: its GPUs are free,
    and if it was cancelled it ends Cancelled (`how` it ended, for the log)."""
    await worker.finished(run_id)
    await settle(worker, UUID(run_id), how)


async def watch_foreign(worker: ElasticFlowWorker) -> None:
    """Runs under processes an earlier worker launched: ended when Prefect says so."""
    from prefect.exceptions import ObjectNotFound

    for run in [r for r in worker.runs.values() if r.foreign_process and r.run_id in worker.scheduler.runs]:
        try:
            flow_run = await worker.client.read_flow_run(UUID(run.run_id))
            done = flow_run is None or flow_run.state is None or flow_run.state.is_final()
        except ObjectNotFound:
            done = True
        except Exception:
            log.warning("could not read flow run %s", run.run_id, exc_info=True)
            continue
        if done:
            await ended_elsewhere(worker, run.run_id, "and its process has exited")


async def watch_cancelling(worker: ElasticFlowWorker, now: float) -> None:
    """Running runs left `Cancelling` (adopted ones, or cancelled as they
    launched: see cancellation.py) are stopped here: told on their control
    channel, then signalled. An adopted one whose process is gone is ended."""
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    running = [UUID(r) for r, run in worker.scheduler.runs.items() if run.phase == Phase.RUNNING]
    if not running:
        return
    try:
        flow_runs = await worker.client.read_flow_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=running),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CANCELLING]))))
    except Exception:
        log.warning("could not read which runs are cancelling", exc_info=True)
        return
    for flow_run in flow_runs:
        run = worker.scheduler.runs.get(str(flow_run.id))
        if run is None or run.phase != Phase.RUNNING:  # ended while we read
            continue
        try:
            await _step(worker, flow_run, run.foreign_process, now)
        except Exception:  # one run's trouble must not stop the poll
            log.exception("could not stop cancelled flow run %s", flow_run.id)


async def _step(worker: ElasticFlowWorker, flow_run: Any, foreign: bool, now: float) -> None:
    run_id = str(flow_run.id)
    message = flow_run.state.message if flow_run.state is not None else None
    step = worker.backend.stop_step(run_id, flow_run.infrastructure_pid, message, now, foreign)
    if step == "stop" and worker.scheduler.stop(run_id):
        run = worker.runs.get(run_id)
        if run is not None:
            await worker.publisher.history(run, AllocationAction.STOP, ())
        log.info("flow run %s is Cancelling and Prefect's worker does not stop it: told it to stop", run_id)
    elif step in ("terminated", "killed"):
        log.warning("flow run %s is Cancelling and did not stop when told: %s its process", run_id, step)
    elif step == "gone" and foreign:
        await ended_elsewhere(worker, run_id, "and its process is gone")


async def still_to_launch(worker: ElasticFlowWorker, flow_run: FlowRun) -> bool:
    """False for a run cancelled (or ended by hand) since we made it Pending:
    Prefect's launcher goes by the state it polled. A `Cancelling` one is
    ended `Cancelled` here, as nothing else would end it."""
    try:
        state = (await worker.client.read_flow_run(flow_run.id)).state
    except Exception:
        log.warning("could not read flow run %s before its launch; launching it", flow_run.id, exc_info=True)
        return True
    if state is not None and state.is_cancelling():
        return not await settle(worker, flow_run.id, "before its process started")
    if state is not None and state.is_final():
        log.info("flow run %s is %s since it was made Pending; not launched", flow_run.id, state.name)
        return False
    return True


async def forget_vanished(worker: ElasticFlowWorker, scheduled: set[str]) -> None:
    """Runs not started yet that left the Scheduled state without us
    (cancelled or deleted in the UI) give back their reservation."""
    from prefect.exceptions import ObjectNotFound

    for run in [r for r in worker.runs.values() if r.phase in (Phase.WAITING, Phase.PROFILING)
                and r.run_id not in scheduled]:
        try:
            flow_run = await worker.client.read_flow_run(UUID(run.run_id))
        except ObjectNotFound:
            flow_run = None
        except Exception:
            continue
        if flow_run is None or flow_run.state is None or not flow_run.state.is_scheduled():
            log.info("flow run %s left the queue before it got GPUs; forgetting it", run.run_id)
            await worker.finished(run.run_id)
