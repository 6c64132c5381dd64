"""The scheduler's decisions and actions, told to Prefect and to the store:
an admission (state, labels, event, history), a rejection (with the reason
and the earliest deadline on the user's clock), and each allocation change.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio

from scheduler_service.contracts import AllocationAction, Rejection, ServiceReason, StateName
from scheduler_service.policy import Decision, RejectReason
from scheduler_service.worker.publish import gpus_label, iso
from scheduler_service.worker.run_state import RunState
from scheduler_service.worker.scheduler import Action, ActionKind, PlanResult
from scheduler_service.worker.store import AllocationRecord, DecisionRecord

if TYPE_CHECKING:
    from scheduler_service.worker.worker import ElasticFlowWorker

log = logging.getLogger("prefect.workers.elasticflow.decisions")  # shown with the worker's own lines



async def reject(worker: ElasticFlowWorker, flow_run: Any, rejection: Rejection,
                 decision_s: float | None = None) -> None:
    """The run is not admitted: Rejected, in the store, in its own logs; it is forgotten.

    Telling Prefect (state and event, then labels) goes on in the
    background: in a burst, a poll that waited for hundreds of rejections to
    be written left the runs created meanwhile untaken until it ended. The
    store has the decision first, and a worker stopped before Prefect heard
    of it leaves the run Scheduled, to be decided again by the next one."""
    run_id, text = str(flow_run.id), rejection.state_message()
    worker.forget(run_id)
    worker.store.upsert_job(run_id, flow_run_name=flow_run.name, status="rejected", message=text)
    worker.store.add(DecisionRecord(
        flow_run_id=run_id, admitted=False, reason=rejection.reason, message=rejection.message,
        earliest_feasible_deadline=rejection.earliest_feasible_deadline,
        decision_ms=None if decision_s is None else decision_s * 1000))
    await worker.in_background(worker.publisher.rejected, run_id, rejection)
    await worker.in_background(worker.publisher.rejection_labels, run_id, rejection, later=True)
    log.info("rejected flow run %s: %s", run_id, text)
    try:  # also in the run's own logs, the tab its page opens on
        worker.get_flow_run_logger(flow_run).warning("ElasticFlow rejected this run: %s", text)
    except Exception:
        pass


def rejection_of(worker: ElasticFlowWorker, decision: Decision, run: RunState, now: float) -> Rejection:
    """The policy's rejection on the user's clock, saying what actually failed:
    a deadline still ahead but closer than a start takes here has its own
    reason, and an infeasible run is told which GPU counts it can use."""
    reason = decision.reason.value if decision.reason else "rejected"
    message = decision.message
    startup = worker.start_cost.startup_s()
    if decision.reason is RejectReason.DEADLINE_PASSED and run.deadline is not None and run.deadline > now:
        reason = ServiceReason.SOONER_THAN_START_UP.value
        message = (f"the deadline is {run.deadline - now:.0f} s away, but a run takes about {startup:.0f} s to "
                   f"start here, and {run.margin.of(run.deadline - run.taken_in_at):.0f} s more are kept for safety")
    elif decision.reason in (RejectReason.INFEASIBLE_ALONE, RejectReason.NO_USABLE_GPU_COUNT):
        levels = run.job.curve.levels if run.job.curve.speed(1) > 1e-6 else ()
        usable = ", ".join(map(str, levels)) or "none"
        message += (f" (usable GPU counts at global batch {run.job.batch_size}: {usable}; a run uses no more GPUs "
                    f"than samples in its global batch, and only counts where its measured speed grows)")
    elif run.deadline is not None and startup:
        message += f" (a run takes about {startup:.0f} s to start here)"
    earliest = decision.earliest_feasible_deadline
    return Rejection.of(reason, message, None if earliest is None else run.to_user_time(earliest))


async def publish(worker: ElasticFlowWorker, result: PlanResult, now: float) -> None:
    """A burst of arrivals is decided in one policy call; telling Prefect is
    what takes time (a state, labels, an event, an artifact per run), so
    decisions go out at once, `ELASTICFLOW_PUBLISH_CONCURRENCY` requests at a
    time: admissions before this poll launches anything, rejections in the
    background; the store has each decision before Prefect hears of it."""
    if result.decisions:
        worker.decision_seconds.append(result.seconds)
    for run_id, finish in result.projected_finish.items():
        run = worker.runs.get(run_id)
        if run is not None:
            run.projected_finish = finish
    for run in result.downgraded:
        await _no_longer_guaranteed(worker, run)
    async def admit(decision: Decision, run: RunState) -> None:
        async with worker.publishing:
            await _admitted(worker, run, decision, result, now)

    async with anyio.create_task_group() as group:  # admissions before any launch; rejections in the background
        for decision in result.decisions:
            run = worker.runs.get(decision.job_id)
            if run is None:
                continue
            if decision.admitted:
                group.start_soon(admit, decision, run)
            else:
                await reject(worker, run.flow_run, rejection_of(worker, decision, run, now), result.seconds)


async def _no_longer_guaranteed(worker: ElasticFlowWorker, run: RunState) -> None:
    """An admitted run the policy can no longer guarantee (the cluster shrank,
    or a restarted service found it late): it carries on best-effort, and
    says so on its page; it is never dropped."""
    text = ("its deadline can no longer be guaranteed on the cluster as it is now; it carries on best-effort "
            "and keeps its place")
    log.warning("flow run %s: %s", run.run_id, text)
    worker.store.upsert_job(run.run_id, share=None, message=text)
    await worker.publisher.labels(run.run_id, {"elasticflow.mss": "best-effort", "elasticflow.guarantee": "lost"})
    worker.publisher.event(run.run_id, "elasticflow.guarantee.lost", {"message": text, "deadline": iso(run.deadline)})
    tell(worker, run, text, warning=True)


async def _admitted(worker: ElasticFlowWorker, run: RunState, decision: Decision, result: PlanResult,
                    now: float) -> None:
    share = decision.share
    worker.store.add(DecisionRecord(flow_run_id=run.run_id, admitted=True, message=decision.message, share=share,
                                    decision_ms=result.seconds * 1000))
    worker.store.upsert_job(run.run_id, status="admitted", share=share, message=decision.message)
    worker.publisher.event(run.run_id, "elasticflow.decision", {
        "admitted": True, "guaranteed": decision.guaranteed, "mss": share, "message": decision.message,
        "guaranteed_finish": iso(decision.guaranteed_finish), "decision_ms": round(result.seconds * 1000, 3),
        "allocation": result.allocation.get(run.run_id, 0),
    })
    guaranteed = f"; guaranteed to finish by {_clock(decision.guaranteed_finish)}" \
        if decision.guaranteed_finish is not None else ""
    tell(worker, run, f"{decision.message}{guaranteed}")
    async with anyio.create_task_group() as group:  # independent requests: the poll waits for the slowest only
        group.start_soon(worker.publisher.labels, run.run_id, {
            "elasticflow.mss": share if share is not None else "best-effort", "elasticflow.admission": "admitted"})
        if run.response is not None:
            group.start_soon(worker.publisher.waiting_state, run, StateName.ADMITTED, now, decision.message)
        group.start_soon(partial(worker.publisher.history, run, AllocationAction.ADMITTED, (), share=share,
                                 guaranteed_finish=decision.guaranteed_finish))


def tell(worker: ElasticFlowWorker, run: RunState, text: str, warning: bool = False) -> None:
    """A line in the run's own logs: the tab its page opens on, read without a click."""
    logger = worker.get_flow_run_logger(run.flow_run) if run.flow_run is not None else log
    try:
        (logger.warning if warning else logger.info)("ElasticFlow: %s", text)
    except Exception:
        log.info("flow run %s: %s", run.run_id, text)


def outlook_line(run: RunState, now: float, margin_s: float, gpus: tuple[int, ...], nodes: list[str]) -> str:
    """Where the run stands, in one line: GPUs and nodes, projected finish against the deadline."""
    where = f"on {len(gpus)} GPU{'s' if len(gpus) != 1 else ''} {gpus_label(gpus)} ({', '.join(nodes)})" \
        if gpus else "holding no GPUs"
    finish = run.projected_finish
    if run.deadline is None:
        return f"{where}; best-effort" + (f", projected finish {_clock(finish)}" if finish else "")
    if finish is None:
        return f"{where}; deadline {_clock(run.deadline)}"
    spare = run.deadline - finish
    verdict = ("late" if spare < 0 or now > run.deadline else "at risk" if spare < margin_s else "on track")
    return (f"{where}; projected finish {_clock(finish)}, deadline {_clock(run.deadline)}: {verdict} "
            f"({_span(abs(spare))} {'to spare' if spare >= 0 else 'late'})")


def outcome_line(run: RunState, now: float) -> str:
    """How the run ended against its deadline, as its GPUs are released."""
    status = run.status()
    done = status.iteration if status is not None else 0
    if done < run.job.iterations:
        return f"ended after {done}/{run.job.iterations:.0f} iterations (stopped); its GPUs are free"
    if run.deadline is None:
        return f"finished at {_clock(now)} (best-effort); its GPUs are free"
    spare = run.deadline - now
    return (f"finished at {_clock(now)}: deadline {'met' if spare >= 0 else 'missed'} "
            f"({_span(abs(spare))} {'to spare' if spare >= 0 else 'late'}); its GPUs are free")


def _clock(seconds: float) -> str:
    return (iso(seconds) or "beyond any date")[:19].replace("T", " ") + " UTC"


def _span(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


async def apply(worker: ElasticFlowWorker, action: Action, now: float) -> bool:
    """Show an action in Prefect and the store; True if the run is to be launched now."""
    run = worker.runs.get(action.run_id)
    if run is None:
        return False
    if action.kind is ActionKind.AWAIT:
        if run.response is not None and run.shown_state != StateName.WAITING.value:
            why = "waiting for its GPUs to be released" if action.gpus else "waiting for spare GPUs"
            worker.store.upsert_job(run.run_id, message=why)  # what `elasticflow status` says of it
            await worker.publisher.waiting_state(run, StateName.WAITING, now, why)
        return False
    allocation = action.kind.allocation
    assert allocation is not None
    gpus = gpus_label(action.gpus)
    worker.store.add(AllocationRecord(flow_run_id=run.run_id, action=allocation.value, gpus=gpus))
    if allocation is AllocationAction.RELEASED:
        await worker.publisher.history(run, allocation, action.gpus)
        worker.store.upsert_job(run.run_id, gpus="")
        return False
    nodes = worker.cluster.nodes_of(action.gpus)
    worker.store.upsert_job(run.run_id, status="running", gpus=gpus)
    async with anyio.create_task_group() as group:
        group.start_soon(worker.publisher.history, run, allocation, action.gpus)
        group.start_soon(worker.publisher.labels, run.run_id, {
            "elasticflow.gpus": gpus, "elasticflow.world_size": len(action.gpus), "elasticflow.nodes": ",".join(nodes)})
    worker.publisher.event(run.run_id, "elasticflow.allocation.changed", {
        "action": allocation.value, "gpus": list(action.gpus), "world_size": len(action.gpus), "nodes": nodes,
    }, nodes=nodes)
    verb = {AllocationAction.LAUNCH: "launched", AllocationAction.RESCALE: "resized: now",
            AllocationAction.PARK: "parked (checkpointed; it waits for its new GPUs),"}.get(allocation, allocation.value)
    tell(worker, run, f"{verb} {outlook_line(run, now, worker.view.risk_margin_s(run), action.gpus, nodes)}")
    if allocation is AllocationAction.LAUNCH:
        run.launched_at = time.time()
        return True
    return False
