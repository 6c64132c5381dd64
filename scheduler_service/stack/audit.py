"""Do the store, Prefect and the processes tell the same story?

After a fault (a killed worker, a stopped stack, a lost node) three records
of a run can drift apart: the service's store (what `elasticflow status`
shows), the flow run's state in Prefect, and the processes still running.
`audit` reads all three and names every run where they disagree. It is what
the stop-at-any-moment test and `bench/chaos.py` assert on, and what an
operator can run after an incident (`elasticflow audit`).

Prefect is read by the caller (`read_flow_runs`) and handed in, so the rules
are plain code over plain data.
"""

from __future__ import annotations

from collections import Counter
from datetime import datetime, timedelta, timezone
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from scheduler_service.readmodel import RunView, report
from scheduler_service.contracts import Outcome, RunPhase
from scheduler_service.stack.groups import groups_of

ENDED = (RunPhase.FINISHED, RunPhase.REJECTED)
# The Prefect state types each recorded outcome may come from.
OUTCOME_STATES = {Outcome.MET: {"COMPLETED"}, Outcome.MISSED: {"COMPLETED"}, Outcome.DONE: {"COMPLETED"},
                  Outcome.FAILED: {"FAILED", "CRASHED"}, Outcome.CANCELLED: {"CANCELLED"},
                  Outcome.STOPPED: {"FAILED", "CRASHED", "CANCELLED", "PAUSED"}}
UNDECIDED = {"SCHEDULED", "PENDING"}  # Prefect states of a run the worker may not have taken in yet


class Problem(str, Enum):
    LOST = "lost"  # Prefect has it, ended or started, and the store never took it in
    DECISIONS = "decisions"  # not exactly one admission decision
    DISAGREE = "disagree"  # the store (and status) and Prefect tell different stories
    DOUBLE_BOOKED = "double_booked"  # a GPU held by two live runs
    HELD_BY_ENDED = "held_by_ended"  # an ended run still holds GPUs in the store
    OUTLIVED = "outlived"  # a process of an ended run still alive
    MISSED = "missed"  # an admitted deadline run missed it, and no fault is known to have cost it
    TRAINED_BUT_FAILED = "trained_but_failed"  # its rank 0 reported every iteration, its outcome says failed
    FAILED = "failed"  # ended failed or crashed, not cancelled, and no fault it could not survive explains it


class Violation(BaseModel):
    problem: Problem
    run: str
    detail: str


class PrefectRun(BaseModel):
    """What the audit needs of a flow run in Prefect."""

    id: str
    state_type: str  # StateType value: COMPLETED, RUNNING, ...
    state_name: str
    final: bool
    since: datetime  # when it entered this state


class Audit(BaseModel):
    runs: int
    violations: list[Violation]

    def lines(self) -> list[str]:
        return [f"{v.problem.value}: {v.run}: {v.detail}" for v in self.violations]


def prefect_run(flow_run: Any) -> PrefectRun:
    state = flow_run.state
    return PrefectRun(id=str(flow_run.id), state_type=state.type.value, state_name=state.name or "",
                      final=state.is_final(), since=state.timestamp)


def audit(home: Path, prefect: list[PrefectRun], decisions: dict[str, int] | None = None,
          excused: dict[str, str] | None = None, settle_s: float = 30.0, now: datetime | None = None) -> Audit:
    """Every violation among the runs Prefect knows (`prefect`) and the store
    keeps. `decisions`: decision rows per run, read from the store after its
    runs when not given: read before them, a run decided in between was seen
    admitted with no decision (chaos counted one such); `excused`: runs a
    known fault hit (they may miss their deadline); a change younger than
    `settle_s` is given time (the worker writes the store within a poll of it)."""
    now = now or datetime.now(timezone.utc)
    settled = lambda since: (now - since) > timedelta(seconds=settle_s)  # noqa: E731
    views = {v.flow_run_id: v for v in report(home).runs}
    if decisions is None:
        decisions = decision_counts(home)  # a decision and its run's phase are one write: this sees both
    found: list[Violation] = []
    for run in prefect:
        view = views.get(run.id)
        if view is None:
            # Cancelled while no worker had taken it in (the stack down, say): it never
            # reached the scheduler, so there is nothing for the store to agree on.
            if run.state_type not in UNDECIDED | {"CANCELLED"} and settled(run.since):
                found.append(Violation(problem=Problem.LOST, run=run.id,
                                       detail=f"Prefect says {run.state_name}; the store never took it in"))
            continue
        found += _compare(view, run, settled(run.since))
        if view.phase not in (RunPhase.ARRIVED, RunPhase.PROFILING) and decisions.get(run.id, 0) != 1:
            found.append(Violation(problem=Problem.DECISIONS, run=run.id,
                                   detail=f"{decisions.get(run.id, 0)} decisions recorded"))
        if view.outcome is Outcome.FAILED and view.iteration and view.iteration >= (view.total_iterations or 0) > 0:
            found.append(Violation(problem=Problem.TRAINED_BUT_FAILED, run=run.id,
                                   detail=f"rank 0 reported {view.iteration}/{view.total_iterations} iterations; "
                                          f"Prefect says {run.state_name}"))
        if view.outcome is Outcome.MISSED and run.id not in (excused or {}):
            found.append(Violation(problem=Problem.MISSED, run=run.id,
                                   detail=f"finished {view.finished_at}, deadline {view.deadline}"))
    found += _gpus(list(views.values()))
    found += _survivors(home, views, {r.id: r for r in prefect}, settled)
    return Audit(runs=len(prefect), violations=found)


def _compare(view: RunView, run: PrefectRun, settled: bool) -> list[Violation]:
    """The store's phase and outcome against the run's Prefect state."""
    said = f"store says {view.phase.value}{f' ({view.outcome.value})' if view.outcome else ''}, " \
           f"Prefect says {run.state_name}"
    wrong = (
        (run.final and view.phase not in ENDED)
        or (not run.final and view.phase in ENDED)
        or (view.phase is RunPhase.REJECTED and run.state_name != "Rejected")
        or (view.phase is RunPhase.FINISHED and view.outcome is not None
            and run.state_type not in OUTCOME_STATES[view.outcome])
    )
    return [Violation(problem=Problem.DISAGREE, run=run.id, detail=said)] if wrong and settled else []


def _gpus(views: list[RunView]) -> list[Violation]:
    found = []
    live = [v for v in views if v.phase not in ENDED]
    for view in views:
        if view.phase in ENDED and view.gpus:
            found.append(Violation(problem=Problem.HELD_BY_ENDED, run=view.flow_run_id,
                                   detail=f"{view.phase.value}, holds GPUs {view.gpus}"))
    held = Counter(g for v in live for g in v.gpus)
    for view in live:
        shared = sorted(g for g in view.gpus if held[g] > 1)
        if shared:
            others = [v.flow_run_id for v in live if v is not view and set(v.gpus) & set(shared)]
            found.append(Violation(problem=Problem.DOUBLE_BOOKED, run=view.flow_run_id,
                                   detail=f"GPUs {shared} also held by {others}"))
    return found


def _survivors(home: Path, views: dict[str, RunView], prefect: dict[str, PrefectRun], settled: Any) -> list[Violation]:
    """Process groups recorded for runs that ended in both records a while ago."""
    found = []
    for group in groups_of(home):
        run_id = group.what.removeprefix("flow run ").strip()
        run, view = prefect.get(run_id), views.get(run_id)
        if run is None or view is None or not group.what.startswith("flow run "):
            continue
        if run.final and view.phase in ENDED and settled(run.since):
            found.append(Violation(problem=Problem.OUTLIVED, run=run_id,
                                   detail=f"processes {group.members()} alive, {run.state_name} since {run.since}"))
    return found


async def read_flow_runs(client: Any, ids: list[str] | None = None, pool: str = "gpus") -> list[PrefectRun]:
    """The training runs of the work pool (or the runs `ids`), as the audit
    needs them; a pipeline's own flow runs use no GPUs and are not the store's."""
    from uuid import UUID

    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterId,
        WorkPoolFilter,
        WorkPoolFilterName,
    )

    from scheduler_service.worker.takein import TRAIN_FLOW

    runs: list[Any] = []
    if ids is not None:
        for i in range(0, len(ids), 200):
            runs += await client.read_flow_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(r) for r in ids[i:i + 200]])), limit=200)
    else:
        offset = 0
        while True:
            page = await client.read_flow_runs(work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])),
                                               flow_filter=FlowFilter(name=FlowFilterName(any_=[TRAIN_FLOW])),
                                               limit=200, offset=offset)
            runs += page
            offset += len(page)
            if len(page) < 200:
                break
    return [prefect_run(r) for r in runs if r.state is not None]


def decision_counts(home: Path) -> dict[str, int]:
    """Decision rows per run in the store at `home`."""
    from scheduler_service.readmodel import store_url
    from scheduler_service.store.db import get_engine
    from scheduler_service.worker.store import ServiceStore

    rows = ServiceStore(get_engine(store_url(home))).decisions()
    return dict(Counter(r.flow_run_id for r in rows))
