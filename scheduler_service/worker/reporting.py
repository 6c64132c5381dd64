"""What the service tells about its runs, in one order: the store first (the
truth a restarted worker and `elasticflow status` read), then Prefect
(states, labels, events, the history artifact), then the run's own log.

Telling Prefect is what takes time (a state, labels, an event, an artifact
per run), so every write goes on in the background where the poll never
waits for it, `ELASTICFLOW_PUBLISH_CONCURRENCY` requests at a time, each
run's in the order they were made (lanes.py): in a burst, a poll that waited
for hundreds of state writes left the runs created meanwhile untaken, and one
that waited for an admission's labels on a slow server launched the run two
minutes late. A worker stopped before Prefect heard of a rejection leaves the
run Scheduled, to be decided again by the next one.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from scheduler_service.contracts import (
    AllocationAction,
    EventName,
    Label,
    Outcome,
    Rejection,
    RunPhase,
    StateName,
    outcome_of,
)
from scheduler_service.loop.actions import Admitted, Command, GpusFreed, Rebased, RiskChanged
from scheduler_service.loop.run import RunFacts
from scheduler_service.worker.lanes import Lanes, details_of
from scheduler_service.worker.publish import Publisher
from scheduler_service.worker.registry import ServiceRun
from scheduler_service.worker.store import AllocationRecord, DecisionRecord, ServiceStore, StartRecord
from scheduler_service.worker.wording import clock, gpus_label, iso, outcome_line, outlook_line

log = logging.getLogger("prefect.workers.elasticflow.decisions")  # shown with the worker's own lines

VERBS = {AllocationAction.LAUNCH: "launched", AllocationAction.RESCALE: "resized: now",
         AllocationAction.PARK: "parked (checkpointed; it waits for its new GPUs),"}


# Decisions still to be told per request in flight before take-in holds back:
# a server that far behind tells a new admission so late that its launch,
# which waits for its Admitted state, would start later than planned.
BACKLOG_PER_REQUEST = 4
DRAIN_S = 5.0  # a graceful stop waits this long at most for Prefect to hear what already happened
DECISION_TIMES = 1000  # the policy calls whose duration the cluster view's figures are made of


class Reporter:
    def __init__(self, store: ServiceStore, publisher: Publisher, logger_for: Callable[[Any], Any],
                 task_group: Callable[[], Any], concurrency: int) -> None:
        self.store = store
        self.publisher = publisher
        self.logger_for = logger_for  # a flow run -> its Prefect logger
        self.task_group = task_group  # where background requests run (None: inline)
        self.publishing = anyio.Semaphore(concurrency)  # Prefect requests in flight
        self.lanes = Lanes()  # each run's writes in order; a launch waits for its run's
        self.untold = 0  # decisions waiting to be told to Prefect in the background
        self.backlog_limit = BACKLOG_PER_REQUEST * concurrency  # past it, take-in waits (swamped)
        self.decision_seconds: deque[float] = deque(maxlen=DECISION_TIMES)  # policy calls that decided runs

    # -- how it is told --------------------------------------------------------
    async def in_background(self, tell: Callable[..., Awaitable[None]], *args: Any, lane: str,
                            later: bool = False) -> None:
        """Tell Prefect without holding up the poll, within `publishing`'s
        requests in flight, after what was told before in the same `lane`
        (a run's id); inline before the worker's task group exists. What can
        come `later` (details of a decision already shown) waits until no
        decision is left to tell: on a loaded server it would otherwise hold
        the decisions back by a third."""
        async def gated() -> None:
            try:
                while later and self.untold:
                    await anyio.sleep(0.1)
                async with self.lanes.of(lane), self.publishing:
                    await tell(*args)
            except Exception:
                log.exception("could not tell Prefect about %s", lane)
            finally:
                self.untold -= not later

        self.untold += not later  # counted from now: a later one spawned next must see it
        group = self.task_group()
        if group is None:
            await gated()
        else:
            group.start_soon(gated)

    async def drain(self, timeout_s: float = DRAIN_S) -> bool:
        """Wait, at most `timeout_s` and even while being stopped, until
        everything told in the background has gone out (a graceful stop);
        whether it all did. The store holds it all already; what is still
        untold then is settled by the next worker's start (recovery.py)."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(timeout_s):
            while self.untold or len(self.lanes):
                await anyio.sleep(0.05)
            return True
        log.warning("stopping with %d decisions and %d runs' writes not yet told to Prefect: the next start settles "
                    "them", self.untold, len(self.lanes))
        return False

    def swamped(self) -> bool:
        """Whether Prefect's server is too far behind for more decisions now."""
        return self.untold >= self.backlog_limit

    def tell(self, run: ServiceRun, text: str, warning: bool = False) -> None:
        """A line in the run's own logs: the tab its page opens on, read without a click."""
        logger = self.logger_for(run.flow_run) if run.flow_run is not None else log
        try:
            (logger.warning if warning else logger.info)("ElasticFlow: %s", text)
        except Exception:
            log.info("flow run %s: %s", run.run_id, text)

    @staticmethod
    def _header(run: ServiceRun, guaranteed_finish: float | None = None) -> list[str]:
        deadline = iso(run.deadline) if run.deadline is not None else "none (best-effort)"
        lines = [f"**{run.model}**, {run.iterations:.0f} iterations, deadline {deadline}, "
                 f"minimum satisfactory share {run.share}"]
        if guaranteed_finish is not None:
            lines.append(f"guaranteed finish: {iso(guaranteed_finish)}")
        return lines

    async def _history(self, run: ServiceRun, action: AllocationAction, gpus: tuple[int, ...], iteration: int,
                       projected: float | None, guaranteed_finish: float | None = None) -> None:
        run.record(action.value, gpus_label(gpus), iteration, (iso(projected) or "-")[:19].replace("T", " "))
        await self.publisher.history(run, self._header(run, guaranteed_finish))

    async def _history_now(self, run: ServiceRun, action: AllocationAction, gpus: tuple[int, ...],
                           view: RunFacts | None, guaranteed_finish: float | None = None) -> None:
        """A row with where the run stands now, as the loop sees it."""
        await self._history(run, action, gpus, view.iteration if view is not None else 0,
                            view.projected_finish if view is not None else None, guaranteed_finish)

    # -- what is told ------------------------------------------------------------
    def taken_in(self, run: ServiceRun, batch_size: int) -> None:
        from scheduler_service.contracts import epoch_to_datetime

        team = getattr(run.request, "team", "")
        self.store.upsert_job(run.run_id, RunPhase.ARRIVED, flow_run_name=run.name, model=run.model,
                              global_batch_size=batch_size, iterations=run.iterations,
                              deadline=epoch_to_datetime(run.deadline), team=team or None)
        if team:
            self.publisher.relate_team(run.run_id, team)

    async def profiling(self, run: ServiceRun, now: float,
                        why: str = "profiling the throughput of this model on first use") -> None:
        self.store.upsert_job(run.run_id, RunPhase.PROFILING, message=why)
        await self._waiting_state(run, StateName.PROFILING, now, why)

    async def _waiting_state(self, run: ServiceRun, name: StateName, now: float, why: str) -> None:
        """A named Scheduled state, once per name (each write is a state row)."""
        if run.response is not None and run.show(name):
            await self.in_background(self.publisher.waiting_state, run, name, now, why, lane=run.run_id)

    async def rejected(self, run_id: str, flow_run: Any, rejection: Rejection, decision_s: float | None = None,
                       model: str | None = None) -> None:
        """Rejected: in the store, then Prefect (state and event, then labels) in the background."""
        text = rejection.state_message()
        known = {} if model is None else {"model": model}  # a run rejected at take-in: what it asked for
        decision = DecisionRecord(
            flow_run_id=run_id, admitted=False, reason=rejection.reason.value, message=rejection.message,
            earliest_feasible_deadline=rejection.earliest_feasible_deadline,
            decision_ms=None if decision_s is None else decision_s * 1000)
        self.store.decided(decision, RunPhase.REJECTED, flow_run_name=getattr(flow_run, "name", ""), message=text,
                           **known)
        if decision_s is not None:
            self.decision_seconds.append(decision_s)
        await self.in_background(self.publisher.rejected, run_id, rejection, lane=run_id)
        await self.in_background(self.publisher.rejection_labels, run_id, rejection, lane=run_id, later=True)
        log.info("rejected flow run %s: %s", run_id, text)
        try:  # also in the run's own logs, the tab its page opens on
            self.logger_for(flow_run).warning("ElasticFlow rejected this run: %s", text)
        except Exception:
            pass

    async def admitted(self, run: ServiceRun, action: Admitted, view: RunFacts | None, now: float) -> None:
        share = action.share
        if action.replanned:  # its one decision stands, and so does its phase (a running run stays running)
            self.store.upsert_job(run.run_id, share=share)
            await self.in_background(self.publisher.labels, run.run_id, {
                Label.MSS: share if share is not None else "best-effort"}, lane=run.run_id)
            return
        decision = DecisionRecord(flow_run_id=run.run_id, admitted=True, message=action.message, share=share,
                                  decision_ms=action.decision_s * 1000)
        self.store.decided(decision, RunPhase.ADMITTED, share=share, message=action.message)
        self.decision_seconds.append(action.decision_s)
        self.publisher.event(run.run_id, EventName.DECISION, {
            "admitted": True, "guaranteed": action.guaranteed, "mss": share, "message": action.message,
            "guaranteed_finish": iso(action.guaranteed_finish), "decision_ms": round(action.decision_s * 1000, 3),
            "allocation": action.gpus_now,
        })
        guaranteed = f"; guaranteed to finish by {clock(action.guaranteed_finish)}" \
            if action.guaranteed_finish is not None else ""
        self.tell(run, f"{action.message}{guaranteed}")
        await self._waiting_state(run, StateName.ADMITTED if action.guaranteed else StateName.BEST_EFFORT, now,
                                  action.message)  # before its launch's Pending
        await self.in_background(self.publisher.labels, run.run_id, {
            Label.MSS: share if share is not None else "best-effort", Label.ADMISSION: "admitted"}, lane=run.run_id)
        await self.in_background(self._history_now, run, AllocationAction.ADMITTED, (), view,
                                 action.guaranteed_finish, lane=details_of(run.run_id))

    async def guarantee_lost(self, run: ServiceRun) -> None:
        """It carries on best-effort, and says so on its page; it is never dropped."""
        text = ("its deadline can no longer be guaranteed on the cluster as it is now; it carries on best-effort "
                "and keeps its place")
        log.warning("flow run %s: %s", run.run_id, text)
        self.store.upsert_job(run.run_id, share=None, message=text)
        await self.in_background(self.publisher.labels, run.run_id, {Label.MSS: "best-effort",
                                                                     Label.GUARANTEE: "lost"}, lane=run.run_id)
        self.publisher.event(run.run_id, EventName.GUARANTEE_LOST, {"message": text, "deadline": iso(run.deadline)})
        self.tell(run, text, warning=True)

    async def waiting(self, run: ServiceRun, placed: bool, now: float) -> None:
        if run.response is None or run.shown_state == StateName.WAITING:
            return
        why = "waiting for its GPUs to be released" if placed else "waiting for spare GPUs"
        self.store.upsert_job(run.run_id, message=why)  # what `elasticflow status` says of it
        await self._waiting_state(run, StateName.WAITING, now, why)

    async def allocation(self, run: ServiceRun, command: Command, view: RunFacts | None, nodes: list[str],
                         at_risk: bool, now: float) -> None:
        """A launch, a resize, a park or a stop: a store row, its history, labels, an event, a line."""
        action, gpus = command.kind, command.gpus
        self.store.add(AllocationRecord(flow_run_id=run.run_id, action=action.value, gpus=gpus_label(gpus)))
        if action == AllocationAction.STOP:
            await self.in_background(self._history_now, run, action, (), view, lane=details_of(run.run_id))
            return
        self.store.upsert_job(run.run_id, RunPhase.RUNNING, gpus=gpus_label(gpus), at_risk=at_risk)
        await self.in_background(self._history_now, run, action, gpus, view, lane=details_of(run.run_id))
        await self.in_background(self.publisher.labels, run.run_id, {
            Label.GPUS: gpus_label(gpus), Label.WORLD_SIZE: len(gpus), Label.NODES: ",".join(nodes)},
            lane=details_of(run.run_id))
        self.publisher.event(run.run_id, EventName.ALLOCATION_CHANGED, {
            "action": action.value, "gpus": list(gpus), "world_size": len(gpus), "nodes": nodes}, nodes=nodes)
        finish = view.projected_finish if view is not None else None
        self.tell(run, f"{VERBS.get(action, action.value)} {outlook_line(run.deadline, finish, now, at_risk, gpus, nodes)}")

    def started(self, run: ServiceRun, took_s: float) -> None:
        """How long its start took: in the store only, for the next worker to recall."""
        self.store.add(StartRecord(flow_run_id=run.run_id, took_s=took_s))

    async def released(self, run: ServiceRun, view: RunFacts | None) -> None:
        """It acknowledged giving up every GPU (parked or stopped), still alive."""
        self.store.add(AllocationRecord(flow_run_id=run.run_id, action=AllocationAction.RELEASED.value, gpus=""))
        self.store.upsert_job(run.run_id, gpus="")
        await self.in_background(self._history_now, run, AllocationAction.RELEASED, (), view,
                                 lane=details_of(run.run_id))

    async def released_for_good(self, run: ServiceRun, release: GpusFreed) -> None:
        """Its process ended (or it left before it was launched): its GPUs are
        free, in the store first; how it ended is told once its final state is known."""
        self.store.upsert_job(run.run_id, RunPhase.FINISHED, gpus="")
        self.store.add(AllocationRecord(flow_run_id=run.run_id, action=AllocationAction.RELEASE.value, gpus=""))
        await self.in_background(self._history, run, AllocationAction.RELEASE, (), release.iteration, None,
                                 lane=details_of(run.run_id))

    def ended(self, run: ServiceRun, release: GpusFreed, state: str | None, why: str | None,
              now: float) -> Outcome:
        """How it ended, by one rule (contracts.outcome_of): in the store, the
        run's own log and an `elasticflow.run.ended` event."""
        outcome = outcome_of(state, release.iteration, release.iterations, run.deadline, now)
        self.store.upsert_job(run.run_id, outcome=outcome.value)
        self.tell(run, outcome_line(outcome, run.deadline, release.iteration, release.iterations, now, why),
                  warning=outcome in (Outcome.FAILED, Outcome.MISSED))
        self.publisher.event(run.run_id, EventName.RUN_ENDED, {
            "outcome": outcome.value, "state": state, "iteration": release.iteration,
            "iterations": release.iterations, "deadline": iso(run.deadline), "ended": iso(now)})
        return outcome

    def risk(self, run: ServiceRun, change: RiskChanged, view: RunFacts | None) -> None:
        """Automations and the run's own page hear of a deadline at risk, and of its recovery."""
        from scheduler_service.contracts import epoch_to_datetime

        event = EventName.DEADLINE_AT_RISK if change.at_risk else EventName.DEADLINE_RECOVERED
        self.store.upsert_job(run.run_id, at_risk=change.at_risk)  # what `elasticflow status` says of it
        finish, deadline = epoch_to_datetime(change.projected_finish), epoch_to_datetime(change.deadline)
        self.publisher.event(run.run_id, event, {
            "flow_run_name": run.name, "model": run.model, "projected_finish": iso(change.projected_finish),
            "deadline": iso(change.deadline), "iterations_done": view.iteration if view else 0,
            "iterations_total": run.iterations, "gpus": list(view.held) if view else [],
            "mss": view.share if view else None,
        })
        word = "at-risk" if change.at_risk else "recovered"
        log.warning("deadline %s: %s projected %s, due %s", word, run.name, finish, deadline)
        if finish is not None and deadline is not None:
            self.tell(run, f"deadline {word}: projected finish {finish:%H:%M:%S}, due {deadline:%H:%M:%S} UTC",
                      warning=change.at_risk)

    async def rebased(self, run: ServiceRun, rebased: Rebased, view: RunFacts | None, nodes: list[str]) -> None:
        """The cluster changed under it: the store says what it holds now (a
        restarted worker adopts it from there), and if it lost GPUs with a
        node, it is told so."""
        gpus = gpus_label(rebased.held)
        self.store.add(AllocationRecord(flow_run_id=run.run_id, action=AllocationAction.REBASED.value, gpus=gpus))
        self.store.upsert_job(run.run_id, gpus=gpus)
        await self.in_background(self._history_now, run, AllocationAction.REBASED, rebased.held, view,
                                 lane=details_of(run.run_id))
        await self.in_background(self.publisher.labels, run.run_id, {
            Label.GPUS: gpus, Label.WORLD_SIZE: len(rebased.held), Label.NODES: ",".join(nodes)},
            lane=details_of(run.run_id))
        if rebased.lost:
            gone = list(rebased.nodes)
            self.tell(run, f"its GPUs on {', '.join(gone) or 'a lost node'} are gone with the node; it goes on "
                           "from its last checkpoint where the next plan puts it", warning=True)
            self.publisher.event(run.run_id, EventName.NODES_LOST, {"nodes": gone}, nodes=gone)
