"""Fifty submissions at once: every one is decided, the admitted ones run
without sharing a GPU and complete, the others are told when they could be met.
And a burst through a slow server: no admitted run misses its deadline."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from tests.service.conftest import Stack
from tests.slowproxy import slow_server

pytestmark = pytest.mark.slow

BURST = 50
SLOW_BURST = 30


async def _submit_all(count: int, parameters: dict) -> list[str]:
    from prefect.client.orchestration import get_client

    # Eight requests in flight: Prefect's own server on SQLite answers 503
    # ("database is locked") to fifty simultaneous writes. The worker still
    # finds all fifty waiting at its next poll.
    # Even so it sometimes does: a user's client would retry, so does this one.
    from prefect.exceptions import PrefectHTTPStatusError

    gate = asyncio.Semaphore(8)
    async with get_client() as client:
        deployment = await client.read_deployment_by_name("train/mlp")

        async def create(i: int) -> str:
            for attempt in range(5):
                try:
                    async with gate:
                        run = await client.create_flow_run_from_deployment(
                            deployment.id, parameters=parameters, name=f"burst-{i}")
                    return str(run.id)
                except PrefectHTTPStatusError as exc:
                    if exc.response.status_code != 503 or attempt == 4:
                        raise
                    await asyncio.sleep(1.0 + attempt)
            raise AssertionError("unreachable")

        return list(await asyncio.gather(*(create(i) for i in range(count))))


def _store(stack: Stack) -> Any:
    """A session on the stack's worker store (the truth `elasticflow status` reads)."""
    from sqlmodel import Session

    from scheduler_service.store.db import get_engine

    return Session(get_engine(f"sqlite:///{stack.home / 'elasticflow.db'}"))


def _outcomes(stack: Stack, run_ids: set[str]) -> dict[str, str | None]:
    """How each of `run_ids` ended, as the store says (contracts.Outcome values)."""
    from sqlmodel import select

    from scheduler_service.worker.store import RunRecord

    with _store(stack) as session:
        rows = session.exec(select(RunRecord).where(RunRecord.flow_run_id.in_(run_ids))).all()  # type: ignore[attr-defined]
        return {row.flow_run_id: row.outcome for row in rows}


def _records(stack: Stack) -> tuple[list, list]:
    from sqlmodel import select

    from scheduler_service.worker.store import AllocationRecord, DecisionRecord

    with _store(stack) as session:
        decisions = list(session.exec(select(DecisionRecord).order_by(DecisionRecord.id)).all())
        allocations = list(session.exec(select(AllocationRecord).order_by(AllocationRecord.id)).all())
    return decisions, allocations


def _longest_recent_start(stack: Stack) -> float:
    """The longest of the last ten starts (launch to first iteration) the worker recorded."""
    from sqlmodel import select

    from scheduler_service.worker.store import StartRecord

    with _store(stack) as session:
        starts = session.exec(select(StartRecord).order_by(StartRecord.id.desc()).limit(10)).all()  # type: ignore[union-attr]
    return max((start.took_s for start in starts), default=0.0)


def _timeline(stack: Stack, run_id: str) -> str:
    """What the store and the run's channel say of `run_id`, in time order:
    what a failed guarantee is read from (a CI run keeps no worker log)."""
    from sqlmodel import select

    from scheduler_service.worker.store import RunRecord, StartRecord

    decisions, allocations = _records(stack)
    with _store(stack) as session:
        job = session.get(RunRecord, run_id)
        starts = session.exec(select(StartRecord).where(StartRecord.flow_run_id == run_id)).all()
    lines = [f"{d.at:%H:%M:%S.%f} decided: {d.message}" for d in decisions if d.flow_run_id == run_id]
    lines += [f"{a.at:%H:%M:%S.%f} {a.action} [{a.gpus}]" for a in allocations if a.flow_run_id == run_id]
    lines += [f"{s.at:%H:%M:%S.%f} first iteration, {s.took_s:.1f} s after its launch" for s in starts]
    status = stack.home / "control" / run_id / "status.json"
    if status.exists():
        at = datetime.fromtimestamp(status.stat().st_mtime, timezone.utc)
        lines.append(f"{at:%H:%M:%S.%f} rank 0 said: {status.read_text()}")
    deadline = f"{job.deadline:%H:%M:%S}" if job is not None and job.deadline is not None else None
    return "\n".join([f"run {run_id}, deadline {deadline}, outcome {job.outcome if job else None}:", *sorted(lines)])


def _double_bookings(allocations: list) -> list[str]:
    """Replay the GPU changes in the order the worker made them: a launch must
    land on GPUs no other run was last told to use."""
    holding: dict[str, set[int]] = {}
    problems = []
    for record in allocations:
        gpus = {int(g) for g in record.gpus.split(",") if g}
        if record.action in ("launch", "rescale"):
            clash = {other: held & gpus for other, held in holding.items() if other != record.flow_run_id and held & gpus}
            if record.action == "launch" and clash:
                problems.append(f"{record.flow_run_id} launched on {sorted(gpus)} held by {clash}")
            holding[record.flow_run_id] = gpus
        else:  # park, released, release
            holding.pop(record.flow_run_id, None)
    return problems


def test_fifty_submissions_at_once_are_all_decided_and_no_gpu_is_double_booked(stack: Stack) -> None:
    # 90 s of work each at one slot's profiled rate, due in 120 s: each slot
    # holds one; the rest must be turned away with a later feasible deadline.
    deadline = datetime.now(timezone.utc) + timedelta(seconds=120)
    run_ids = asyncio.run(_submit_all(BURST, {"iterations": 20 * 90, "deadline": deadline.isoformat(),
                                              "checkpoint_interval": 2000}))
    wanted = set(run_ids)

    def decided() -> dict:
        decisions, _ = _records(stack)
        latest = {d.flow_run_id: d for d in decisions if d.flow_run_id in wanted}
        return latest if len(latest) == BURST else {}

    latest = stack.wait_until(decided, 180, f"all {BURST} submissions to be decided")
    admitted = [r for r, d in latest.items() if d.admitted]
    rejected = [d for d in latest.values() if not d.admitted]
    # 2 slots x 120 s hold 2 runs of 90 slot-seconds planned at once; a
    # submission decided after an admitted run finished early (the CPU beats its
    # seeded profile) may take its place, never more at once (checked below).
    # How many finish early while the burst is decided depends on the machine's
    # load (6 on a loaded CI run): the bound says most are turned away.
    assert 1 <= len(admitted) <= BURST // 5, len(admitted)
    # Most are turned away because the admitted ones hold the slots; on a busy
    # machine the last few may be decided when too little time is left at all
    # (closer than a start takes, or past).
    reasons = [d.reason for d in rejected]
    assert reasons.count("gpus_reserved_by_admitted_jobs") >= len(rejected) // 2, reasons
    assert set(reasons) <= {"gpus_reserved_by_admitted_jobs", "infeasible_even_on_an_idle_cluster",
                            "deadline_sooner_than_start_up", "deadline_passed"}, reasons
    for decision in rejected:
        later = decision.earliest_feasible_deadline.replace(tzinfo=timezone.utc)
        assert later > deadline  # what it could have had instead, to act on

    for run_id in run_ids:
        run = stack.wait_final(run_id, 240)
        if run_id in admitted:
            assert run.state.is_completed(), (run_id, run.state)
        else:
            assert run.state.name == "Rejected" and "earliest feasible deadline" in run.state.message
    _, allocations = _records(stack)
    assert not _double_bookings([a for a in allocations if a.flow_run_id in wanted])
    launched = {a.flow_run_id for a in allocations if a.action == "launch"}
    assert launched & wanted == set(admitted)  # nothing rejected ever ran


def test_a_burst_through_a_slow_server_leaves_every_admitted_run_meeting_its_deadline(
    stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Issue 29, 2: every request to Prefect 0.2 s slower and a quarter of the
    writes answered 503, which Prefect's client retries with a growing backoff
    (the worker's and its runs'), on the embedded default (SQLite, the start
    cost learnt, not set): no Prefect write holds the poll, so every admitted
    run starts when it was planned to, and none misses its deadline."""
    stack.wait_idle()
    log = tmp_path_factory.mktemp("slow") / "worker.log"
    with slow_server(stack.api_url, 0.2, unavailable=0.25) as slow, \
            stack.worker_through(slow, log, ELASTICFLOW_LAUNCH_S=None):
        # The worker keeps the longest of the last ten starts it saw in front of every deadline.
        # A start through this server is its Prefect requests retried with a growing back-off:
        # 13-39 s here against 5-10 s without it, and in CI once long enough that an admitted
        # run of the burst, planned on the starts of a fast server, missed. One run through the
        # slow server first, so that the burst is planned on starts like its own.
        stack.wait_final(stack.submit("slow-start", iterations=100), 300)
        # Room for such a start: after the burst above on a loaded machine it was 102 s, and a
        # fixed +150 s admitted nothing.
        deadline = datetime.now(timezone.utc) + timedelta(seconds=150 + max(0.0, _longest_recent_start(stack) - 30))
        run_ids = asyncio.run(_submit_all(SLOW_BURST, {"iterations": 20 * 60, "deadline": deadline.isoformat(),
                                                       "checkpoint_interval": 2000}))
        finals = {run_id: stack.wait_final(run_id, 300) for run_id in run_ids}
        decisions, _ = _records(stack)
        admitted = {d.flow_run_id for d in decisions if d.flow_run_id in finals and d.admitted}
        assert admitted, "nothing admitted"

        def told() -> dict[str, str | None] | None:  # once each final state is read, in the background
            found = _outcomes(stack, admitted)
            return found if len(found) == len(admitted) and None not in found.values() else None

        # The worker reads each final state through the same slow server, its
        # reads retried with a growing back-off: on a loaded CI machine the
        # last outcome was written 66 s after its run's final state.
        outcomes = stack.wait_until(told, 180, "how every admitted run ended")
    missed = [run_id for run_id in admitted if outcomes[run_id] != "met"]
    assert not missed, "\n\n".join(_timeline(stack, run_id) for run_id in missed)
    assert all(finals[run_id].state.is_completed() for run_id in admitted)
