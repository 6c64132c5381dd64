"""After a worker restart: the runs an earlier life of the service admitted.

Runs the store says were admitted and Prefect says are still running (their
flow processes outlive the worker) are adopted with the GPUs they hold (the
last command and acknowledgement of their control channel), so no GPU is
handed out twice. Runs still waiting are taken in again as new arrivals;
finished ones are closed in the store, with a release row dated when they
ended if they held GPUs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable
from uuid import UUID

from flows.training.control import FileControlChannel, GpuSlot
from scheduler_service.contracts import AllocationAction, Outcome, RunPhase, StateName, outcome_of
from scheduler_service.loop.events import Adopted
from scheduler_service.worker.channels import current_ids, trained_at
from scheduler_service.worker.intake import policy_job
from scheduler_service.worker.registry import ServiceRun
from scheduler_service.worker.store import AllocationRecord, RunRecord, ServiceStore, aware

log = logging.getLogger("prefect.workers.elasticflow.recovery")  # shown with the worker's own lines

ADOPTED_SINCE_S = 3600.0  # an adopted run's restart is long paid
RECONCILED = 200  # released runs whose end is settled at a restart, newest first


@dataclass(frozen=True, slots=True)
class Found:
    """How a stored run stands in Prefect, reduced to what adoption needs."""

    final: bool  # ended (or gone from Prefect)
    running: bool  # its process may be training (Running, Pending, or Cancelling)
    cancelling: bool
    scheduled: bool
    ended_at: datetime | None = None
    control_dir: str | None = None
    paused: bool = False  # it checkpointed and went back to the queue when the stack stopped (pause.py)


def found_in(flow_run: Any | None) -> Found:
    state = flow_run.state if flow_run is not None else None
    if flow_run is None or state is None or state.is_final():
        return Found(final=True, running=False, cancelling=False, scheduled=False,
                     ended_at=state.timestamp if state is not None else None)
    return Found(final=False, running=state.is_running() or state.is_pending() or state.is_cancelling(),
                 cancelling=state.is_cancelling(), scheduled=state.is_scheduled(),
                 control_dir=(flow_run.parameters or {}).get("control_dir"),
                 paused=state.is_scheduled() and state.name == StateName.RESUMING)


def adopted_run(row: RunRecord, found: Found, control_root: str, points: dict[int, float], max_job_gpus: int,
                now: float, by_kind: dict[str, dict[int, float]] | None = None, team: str = "",
                slots: tuple[GpuSlot, ...] = ()) -> tuple[ServiceRun, Adopted]:
    """The run as the service keeps it, and as the loop must see it again: on
    the GPUs it may be using (acknowledged, or commanded and not acknowledged
    yet), by their ids in the cluster as it is now (`slots`, on Ray)."""
    channel = FileControlChannel(row.flow_run_id, found.control_dir or control_root)
    ack, command = channel.acknowledged(), channel.latest()
    commanded = current_ids(command.gpus, command.placement, slots) if command else ()
    held = tuple(sorted(set(current_ids(ack.gpus, ack.placement, slots) if ack else ()) | set(commanded)))
    pending = command.seq if command and (ack is None or ack.seq < command.seq) else None
    deadline = None if row.deadline is None else aware(row.deadline).timestamp()
    job = policy_job(row.flow_run_id, aware(row.submitted_at).timestamp(), row.iterations, deadline, points,
                     row.model, row.global_batch_size, max_job_gpus, by_kind, team)
    running = found.running
    run = ServiceRun(row.flow_run_id, row.flow_run_name, channel, deadline, model=row.model,
                     iterations=row.iterations, taken_in_at=job.submit_time, foreign_process=running,
                     share=row.share)
    adopted = Adopted(row.flow_run_id, job, row.share, running, held=held if running else (),
                      commanded=commanded if running else (), pending_seq=pending if running else None,
                      last_seq=command.seq if command else 0, cancelled=found.cancelling,
                      since=now - ADOPTED_SINCE_S)
    return run, adopted


async def recover(client: Any, store: ServiceStore, control_root: str, max_job_gpus: int, now: float,
                  alive: Callable[[str | None, str], bool], kinds: tuple[str, ...] = (), teams: bool = False,
                  stopped_at: float | None = None, slots: tuple[GpuSlot, ...] = ()
                  ) -> list[tuple[ServiceRun, Adopted]]:
    """The runs to adopt; the store is brought up to date for the rest.
    `alive(infrastructure_id, run_id)` says whether a run's process is really
    there: Prefect still says `Running` of a run whose process died with the
    machine or the stack. `stopped_at`: when the last stop of the stack
    began (pause.py): an admitted run that crashed since was ended by the
    stop (a signal that landed before its flow could pause), not by itself,
    and goes on from its checkpoint."""
    from prefect.exceptions import ObjectNotFound

    from scheduler_service.store import get_curves
    from scheduler_service.worker.intake import kind_curves, one_curve

    adopted = []
    for row in store.jobs(phases=(RunPhase.ARRIVED, RunPhase.PROFILING, RunPhase.ADMITTED, RunPhase.RUNNING)):
        try:
            flow_run = await client.read_flow_run(UUID(row.flow_run_id))
        except ObjectNotFound:
            flow_run = None
        found, phase = found_in(flow_run), RunPhase(row.status)
        if found.final and _crashed_by_stop(row, flow_run, stopped_at):
            if (trained_at := finished_training(row, found, control_root)) is not None:
                await _completed(client, store, row, found, control_root, trained_at)
                continue
            found, phase = await _resume(client, store, row, "it crashed when the stack stopped under it; it "
                                                             "continues from its last checkpoint"), RunPhase.ADMITTED
        if found.final:
            store.upsert_job(row.flow_run_id, RunPhase.FINISHED, gpus="",
                             outcome=settled(row, flow_run, found, control_root).value)
            if row.status == RunPhase.RUNNING:  # it ended while no worker watched: its GPUs went with it
                _released(store, row.flow_run_id, found.ended_at or datetime.now(timezone.utc))
            continue
        if phase in (RunPhase.ARRIVED, RunPhase.PROFILING):
            continue  # not decided yet: taken in again by the next poll
        if found.running and not found.cancelling and not alive(flow_run.infrastructure_pid, row.flow_run_id):
            if (trained_at := finished_training(row, found, control_root)) is not None:
                await _completed(client, store, row, found, control_root, trained_at)
                continue
            found, phase = await _resume(client, store, row), RunPhase.ADMITTED
        elif found.scheduled and phase == RunPhase.RUNNING:
            # A stop that lands as a run finishes: it paused after its rank 0 reported the last iteration.
            # It is done, not to be trained again from its checkpoint.
            if found.paused and (trained_at := finished_training(row, found, control_root)) is not None:
                await _completed(client, store, row, found, control_root, trained_at)
                continue
            phase = _never_started(store, row, found.paused)
        if not found.running and not (found.scheduled and phase == RunPhase.ADMITTED):
            store.upsert_job(row.flow_run_id, RunPhase.ARRIVED)
            continue  # not decided yet: taken in again by the next poll
        stored = get_curves(row.model, row.global_batch_size)
        points = one_curve(stored) or {1: 1e-9}
        team = (flow_run.work_queue_name or "") if teams and flow_run is not None else ""
        run, event = adopted_run(row, found, control_root, points, max_job_gpus, now, kind_curves(stored, kinds),
                                 team, slots)
        if found.running:  # as it stands: on its GPUs, not merely admitted
            store.upsert_job(row.flow_run_id, RunPhase.RUNNING, gpus=",".join(map(str, event.held)))
        adopted.append((run, event))
    await _reconcile_ended(client, store, control_root, alive)
    await _rejections_untold(client, store)
    return adopted


async def _rejections_untold(client: Any, store: ServiceStore) -> None:
    """Runs the store rejected whose Rejected state never reached Prefect
    (the worker died first): still Scheduled there, the next poll would take
    them in and decide them a second time. They get the state the stored
    decision said. The most recent RECONCILED only, read in one call."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.states import Cancelled

    rows = sorted(store.jobs(phases=(RunPhase.REJECTED,)), key=lambda r: aware(r.updated_at),
                  reverse=True)[:RECONCILED]
    if not rows:
        return
    messages = {row.flow_run_id: row.message for row in rows}
    flow_runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
        id=FlowRunFilterId(any_=[UUID(r) for r in messages])), limit=len(messages))
    for flow_run in flow_runs:
        if found_in(flow_run).final:
            continue
        try:
            await client.set_flow_run_state(flow_run.id, Cancelled(
                name=StateName.REJECTED.value, message=messages[str(flow_run.id)]), force=True)
        except Exception:
            log.exception("could not mark flow run %s Rejected", flow_run.id)
            continue
        log.warning("flow run %s: rejected before a stop, still %s in Prefect: marked Rejected", flow_run.id,
                    flow_run.state.name)


async def _reconcile_ended(client: Any, store: ServiceStore, control_root: str,
                           alive: Callable[[str | None, str], bool]) -> None:
    """Runs the store has released but a stop left half told: one released
    before its final Prefect state was read gets its outcome; one Prefect
    still shows live, its process gone, gets its final state. The most
    recent RECONCILED only: an older store has rows from before outcomes."""
    from prefect.exceptions import ObjectNotFound
    from prefect.states import Cancelled, Crashed

    rows = [r for r in store.jobs(phases=(RunPhase.FINISHED,)) if r.outcome is None]
    for row in sorted(rows, key=lambda r: aware(r.updated_at), reverse=True)[:RECONCILED]:
        try:
            flow_run = await client.read_flow_run(UUID(row.flow_run_id))
        except ObjectNotFound:
            continue
        found = found_in(flow_run)
        if not found.final:
            if alive(flow_run.infrastructure_pid, row.flow_run_id):
                continue  # still stopping: the worker that adopts nothing of it will see it end
            if not found.cancelling and (trained_at := finished_training(row, found, control_root)) is not None:
                await _completed(client, store, row, found, control_root, trained_at)
                continue
            final = Cancelled(message="its process is gone") if found.cancelling else \
                Crashed(message="its process ended while no worker watched")
            try:
                await client.set_flow_run_state(UUID(row.flow_run_id), final, force=True)
            except Exception:
                log.exception("could not settle the final state of flow run %s", row.flow_run_id)
                continue
            log.warning("flow run %s: released before a stop, still %s in Prefect: marked %s", row.flow_run_id,
                        flow_run.state.name, final.name)
            flow_run = await client.read_flow_run(UUID(row.flow_run_id))
            found = found_in(flow_run)
        store.upsert_job(row.flow_run_id, outcome=settled(row, flow_run, found, control_root).value)


def settled(row: RunRecord, flow_run: Any | None, found: Found, control_root: str,
            ended_at: datetime | None = None) -> Outcome:
    """How a run that ended while no worker told it ended: by the one rule
    (contracts.outcome_of), from its final Prefect state and the iteration
    its rank 0 last reported, at `ended_at` (else when Prefect's state says)."""
    channel = FileControlChannel(row.flow_run_id, found.control_dir or control_root)
    status = channel.status()
    iteration = status.iteration if status is not None else 0
    state = flow_run.state.type.value if flow_run is not None and flow_run.state is not None else "CRASHED"
    deadline = None if row.deadline is None else aware(row.deadline).timestamp()
    ended = (ended_at or found.ended_at or datetime.now(timezone.utc)).timestamp()
    return outcome_of(state, iteration, row.iterations, deadline, ended)


def finished_training(row: RunRecord, found: Found, control_root: str) -> datetime | None:
    """When its rank 0 reported the whole run trained, if it did
    (channels.trained_at). A stop that kills its flow process just after
    (before it tells Prefect Completed) leaves a finished run that only
    looks crashed."""
    at = trained_at(FileControlChannel(row.flow_run_id, found.control_dir or control_root), row.iterations)
    return None if at is None else datetime.fromtimestamp(at, timezone.utc)


async def _completed(client: Any, store: ServiceStore, row: RunRecord, found: Found, control_root: str,
                     trained_at: datetime) -> None:
    """Its process ended after training finished and before it told Prefect:
    Completed, with the outcome of when it finished (not of when this worker
    found it), and its GPUs released as of then."""
    from prefect.states import Completed

    try:
        await client.set_flow_run_state(UUID(row.flow_run_id), Completed(
            message="training finished; its process ended before it told Prefect"), force=True)
    except Exception:
        log.exception("could not mark flow run %s Completed", row.flow_run_id)
        return
    log.warning("flow run %s: finished training at %s and ended before telling Prefect: marked Completed",
                row.flow_run_id, trained_at.isoformat(timespec="seconds"))
    if row.status == RunPhase.RUNNING:
        _released(store, row.flow_run_id, trained_at)
    flow_run = await client.read_flow_run(UUID(row.flow_run_id))
    store.upsert_job(row.flow_run_id, RunPhase.FINISHED, gpus="",
                     outcome=settled(row, flow_run, found, control_root, trained_at).value)


def _released(store: ServiceStore, run_id: str, at: datetime) -> None:
    store.add(AllocationRecord(flow_run_id=run_id, action=AllocationAction.RELEASE.value, gpus="", at=at))


def _never_started(store: ServiceStore, row: RunRecord, paused: bool = False) -> RunPhase:
    """Launched in the store, Scheduled in Prefect: the worker died between
    recording the launch and Prefect's Pending, so no process ever started
    (Prefect starts one only after Pending); or the run paused when the
    stack stopped (`paused`: it checkpointed and went back to the queue). The
    run keeps its decision (deciding it again would record a second one, with
    a guarantee the first did not promise; the loop re-plans it with the time
    lost) and waits for GPUs; the ones it held are released."""
    if paused:
        log.warning("flow run %s paused when the stack stopped; it goes on from its last checkpoint",
                    row.flow_run_id)
    else:
        log.info("flow run %s was launched but never started; it waits for GPUs again", row.flow_run_id)
    _released(store, row.flow_run_id, datetime.now(timezone.utc))
    store.upsert_job(row.flow_run_id, RunPhase.ADMITTED, gpus="")
    return RunPhase.ADMITTED


def _crashed_by_stop(row: RunRecord, flow_run: Any | None, stopped_at: float | None) -> bool:
    """An admitted run that ended Crashed after the last stop of the stack began."""
    state = flow_run.state if flow_run is not None else None
    return (stopped_at is not None and state is not None and state.is_crashed()
            and row.status in (RunPhase.ADMITTED, RunPhase.RUNNING) and state.timestamp.timestamp() >= stopped_at)


async def _resume(client: Any, store: ServiceStore, row: RunRecord, message: str = (
        "its process was gone when the worker restarted; it continues from its last checkpoint")) -> Found:
    """A run Prefect says is running whose process is gone: its GPUs are free,
    and it goes back to the queue as an admitted run, to continue from its
    last checkpoint in the same flow run when it gets GPUs again."""
    from prefect.states import Scheduled

    try:
        await client.set_flow_run_state(UUID(row.flow_run_id), Scheduled(name=StateName.RESUMING.value, message=message),
                                        force=True)
    except Exception:
        log.exception("could not put flow run %s back in the queue", row.flow_run_id)
    log.warning("flow run %s: %s", row.flow_run_id, message)
    if row.status == RunPhase.RUNNING:
        _released(store, row.flow_run_id, datetime.now(timezone.utc))
    store.upsert_job(row.flow_run_id, RunPhase.ADMITTED, gpus="")
    return Found(final=False, running=False, cancelling=False, scheduled=True)


def allocation_changes(store: ServiceStore, hours: float = 6.0) -> tuple[list[tuple[datetime, str, str, int]],
                                                                          dict[str, datetime]]:
    """The cluster plot's last hours from the store, so a restart does not wipe it:
    (when, run id, run name, GPUs held from then on) and each run's deadline, by id."""
    jobs = {row.flow_run_id: row for row in store.jobs()}

    def name(run_id: str) -> str:
        row = jobs.get(run_id)
        return row.flow_run_name if row is not None and row.flow_run_name else run_id[:8]

    rows = store.allocations(since=datetime.now(timezone.utc) - timedelta(hours=hours))
    changes = [(aware(r.at), r.flow_run_id, name(r.flow_run_id), len([g for g in r.gpus.split(",") if g]))
               for r in rows]
    deadlines = {i: aware(row.deadline) for i, row in jobs.items() if row.deadline is not None}
    return changes, deadlines
