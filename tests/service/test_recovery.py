"""Adoption after a restart, without a server: a stored run comes back on the
GPUs its control channel says it may be using, and runs that ended while no
worker watched are closed in the store."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from flows.training.control import ControlAck, FileControlChannel, GpuSlot
from scheduler_service.worker.recovery import Found, adopted_run
from scheduler_service.worker.store import RunRecord
from tests.stack import ROOT

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc).timestamp()


def _row() -> RunRecord:
    return RunRecord(flow_run_id="r1", flow_run_name="calm-otter", model="mlp", global_batch_size=32,
                     iterations=1000, deadline=datetime(2026, 12, 1, 13, 0), status="running", share=1,
                     submitted_at=datetime(2026, 12, 1, 11, 59))  # naive, as SQLite hands it back


def test_a_running_run_is_adopted_on_every_gpu_it_may_be_using(tmp_path: Path) -> None:
    channel = FileControlChannel("r1", tmp_path)
    first = channel.request("rescale", [0, 1])
    channel.acknowledge(ControlAck(seq=first.seq, iteration=10, gpus=[0, 1]))
    second = channel.request("rescale", [0])  # told to shrink, not acknowledged yet: still on both
    found = Found(final=False, running=True, cancelling=False, scheduled=False)
    run, adopted = adopted_run(_row(), found, str(tmp_path), {1: 10.0, 2: 19.0}, max_job_gpus=2, now=NOW)
    assert adopted.running and run.foreign_process and adopted.last_seq == second.seq
    assert adopted.held == (0, 1) and adopted.commanded == (0,) and adopted.pending_seq == second.seq
    assert run.deadline == datetime(2026, 12, 1, 13, 0, tzinfo=timezone.utc).timestamp()  # read as UTC
    assert adopted.job.deadline == run.deadline and adopted.job.curve.levels == (1, 2) and run.name == "calm-otter"


def _slot(node: str, index: int) -> GpuSlot:
    return GpuSlot(node=node, name=f"ray-{node}", ip="10.0.0.1", index=index)


def test_on_a_ray_cluster_a_run_is_adopted_on_where_its_gpus_are_not_on_their_old_ids(tmp_path: Path) -> None:
    """Node B (GPUs 2, 3 when the run was placed) died; node C joined and
    took ids 2, 3; the worker restarted. The run's old ids name C's GPUs now:
    read by id, it would be adopted on GPUs another run is given (Ray chaos,
    seed 3: GPU 3 double-booked after a raylet and a worker were killed)."""
    channel = FileControlChannel("r1", tmp_path)
    first = channel.request("rescale", [1, 3], placement=[_slot("A", 1), _slot("B", 1)])
    channel.acknowledge(ControlAck(seq=first.seq, iteration=10, gpus=[1, 3], placement=first.placement))
    now = (_slot("A", 0), _slot("A", 1), _slot("C", 0), _slot("C", 1))
    found = Found(final=False, running=True, cancelling=False, scheduled=False)
    _, adopted = adopted_run(_row(), found, str(tmp_path), {1: 10.0, 2: 19.0}, max_job_gpus=2, now=NOW, slots=now)
    assert adopted.held == (1,) and adopted.commanded == (1,)  # B's GPU went with B
    # Its ids alone, on one machine (no placement), are taken as they are.
    _, alone = adopted_run(_row(), found, str(tmp_path), {1: 10.0, 2: 19.0}, max_job_gpus=2, now=NOW)
    assert alone.held == (1, 3)


def test_an_admitted_run_still_waiting_is_adopted_holding_nothing(tmp_path: Path) -> None:
    found = Found(final=False, running=False, cancelling=False, scheduled=True)
    run, adopted = adopted_run(_row(), found, str(tmp_path), {1: 10.0}, max_job_gpus=2, now=NOW)
    assert not adopted.running and adopted.held == () and not run.foreign_process


class _Client:
    """Prefect's runs as a restarted worker reads them; the states it is told to set."""

    def __init__(self, states: dict[str, object]) -> None:
        self.states = states
        self.set: dict[str, str] = {}

    async def read_flow_run(self, run_id: object) -> object:
        from types import SimpleNamespace

        key = str(run_id)
        return SimpleNamespace(id=key, state=self.states[key], parameters={}, infrastructure_pid="1:2")

    async def read_flow_runs(self, flow_run_filter: object, limit: int) -> list[object]:
        wanted = {str(i) for i in flow_run_filter.id.any_}  # type: ignore[attr-defined]
        return [await self.read_flow_run(key) for key in self.states if key in wanted][:limit]

    async def set_flow_run_state(self, run_id: object, state: object, force: bool = False) -> None:
        self.states[str(run_id)] = state
        self.set[str(run_id)] = state.name  # type: ignore[attr-defined]


def _store_with(rows: list[RunRecord]) -> object:
    from sqlalchemy.pool import StaticPool
    from sqlmodel import create_engine

    from scheduler_service.worker.store import ServiceStore

    store = ServiceStore(create_engine("sqlite://", poolclass=StaticPool, connect_args={"check_same_thread": False}))
    for row in rows:
        store.upsert_job(row.flow_run_id, **{k: v for k, v in row.model_dump().items() if k != "flow_run_id"})
    return store


def test_runs_that_ended_half_told_are_settled_with_their_real_outcome(tmp_path: Path) -> None:
    """Store first, Prefect second, and a stop may come between: at the next
    start, a run the store still has running but Prefect has final, one
    released before its final state was read, and one released while Prefect
    still shows it Cancelling (its process gone) all end with the outcome
    their Prefect state says."""
    import asyncio
    import uuid

    from prefect.states import Cancelling, Completed, Failed

    from scheduler_service.worker.recovery import recover

    ids = [str(uuid.uuid4()) for _ in range(3)]
    done, failed, cancelling = ids
    rows = []
    for run_id, status in ((done, "running"), (failed, "finished"), (cancelling, "finished")):
        row = _row()
        row.flow_run_id, row.status = run_id, status
        row.deadline = datetime(2030, 1, 1, tzinfo=timezone.utc)
        row.submitted_at = datetime(2026, 12, 1, 11, 59, tzinfo=timezone.utc)
        rows.append(row)
    store = _store_with(rows)
    FileControlChannel(done, tmp_path).publish_status({"iteration": 1000, "total_iterations": 1000})
    client = _Client({done: Completed(), failed: Failed(message="rank 0 died"), cancelling: Cancelling()})
    adopted = asyncio.run(recover(client, store, str(tmp_path), 2, NOW, alive=lambda pid, run_id: False))
    assert adopted == []
    outcomes = {row.flow_run_id: (row.status, row.outcome) for row in store.jobs()}  # type: ignore[attr-defined]
    assert outcomes == {done: ("finished", "met"), failed: ("finished", "failed"),
                        cancelling: ("finished", "cancelled")}
    assert client.set == {cancelling: "Cancelled"}  # Prefect hears the end it missed, nothing else is touched
    assert [a.action for a in store.allocations(done)] == ["release"]  # type: ignore[attr-defined]


def test_a_run_stopped_after_it_trained_and_before_it_told_prefect_completed(tmp_path: Path) -> None:
    """Chaos found it: a stop 5 s after a run's last iteration killed its flow
    process before it told Prefect Completed, and the next start marked it
    Crashed, outcome failed. Its rank 0 had reported the whole run trained:
    it is Completed, met as of when it finished (not when the worker came
    back, past its deadline), whether the store still had it running or had
    released it; a run killed mid-training is still resumed."""
    import asyncio
    import os
    import uuid

    from prefect.states import Running

    from scheduler_service.worker.recovery import recover

    ids = [str(uuid.uuid4()) for _ in range(3)]
    held, released, midway = ids
    finished_at = datetime(2026, 12, 1, 12, 50, tzinfo=timezone.utc)
    rows = []
    for run_id, status in ((held, "running"), (released, "finished"), (midway, "running")):
        row = _row()
        row.flow_run_id, row.status = run_id, status
        row.deadline = datetime(2026, 12, 1, 13, 0, tzinfo=timezone.utc)  # before the restart below
        row.submitted_at = datetime(2026, 12, 1, 11, 59, tzinfo=timezone.utc)
        rows.append(row)
        channel = FileControlChannel(run_id, tmp_path)
        done = run_id != midway
        channel.publish_status({"iteration": 1000 if done else 400, "total_iterations": 1000,
                                "event": "completed" if done else "segment.finished"})
        os.utime(channel.status_path, (finished_at.timestamp(), finished_at.timestamp()))
    store = _store_with(rows)
    client = _Client({run_id: Running() for run_id in ids})
    restart = datetime(2026, 12, 1, 13, 30, tzinfo=timezone.utc).timestamp()
    adopted = asyncio.run(recover(client, store, str(tmp_path), 2, restart, alive=lambda pid, run_id: False))
    assert [run.run_id for run, _ in adopted] == [midway]  # back in the queue, to continue from its checkpoint
    assert client.set == {held: "Completed", released: "Completed", midway: "Resuming"}
    outcomes = {row.flow_run_id: (row.status, row.outcome, row.gpus) for row in store.jobs()}  # type: ignore[attr-defined]
    assert outcomes[held] == ("finished", "met", "") and outcomes[released] == ("finished", "met", "")
    assert outcomes[midway][:2] == ("admitted", None)
    (release,) = store.allocations(held)  # type: ignore[attr-defined]
    assert (release.action, release.at.replace(tzinfo=timezone.utc)) == ("release", finished_at)


def test_a_run_launched_but_never_started_keeps_its_one_decision(tmp_path: Path) -> None:
    """The worker was killed after it recorded a launch and before Prefect
    heard Pending (chaos found it): the run is still Scheduled, no process
    started. It is adopted as admitted, holding nothing, rather than taken
    in again and decided a second time."""
    import asyncio
    import uuid

    from prefect.states import Scheduled

    from scheduler_service.worker.recovery import recover

    row = _row()
    row.flow_run_id, row.gpus = str(uuid.uuid4()), "0,1"
    row.deadline = datetime(2030, 1, 1, tzinfo=timezone.utc)
    row.submitted_at = datetime(2026, 12, 1, 11, 59, tzinfo=timezone.utc)
    store = _store_with([row])
    client = _Client({row.flow_run_id: Scheduled()})
    adopted = asyncio.run(recover(client, store, str(tmp_path), 2, NOW, alive=lambda pid, run_id: False))
    assert [(run.run_id, event.running, event.held) for run, event in adopted] == [(row.flow_run_id, False, ())]
    (stored,) = store.jobs()  # type: ignore[attr-defined]
    assert (stored.status, stored.gpus) == ("admitted", "")
    assert [a.action for a in store.allocations(row.flow_run_id)] == ["release"]  # type: ignore[attr-defined]
    assert client.set == {}


def test_a_rejection_the_worker_died_before_telling_prefect_is_told_not_decided_again(tmp_path: Path) -> None:
    """Chaos found it: the store had a run rejected, its Rejected state was
    still in the background lane when the worker was killed, and the next
    life took the still-Scheduled run in and decided it a second time. It is
    marked Rejected with the stored reason instead; one Prefect already
    shows Rejected is left alone."""
    import asyncio
    import uuid

    from prefect.states import Cancelled, Scheduled

    from scheduler_service.worker.recovery import recover

    untold, told = str(uuid.uuid4()), str(uuid.uuid4())
    rows = []
    for run_id in (untold, told):
        row = _row()
        row.flow_run_id, row.status, row.gpus, row.share = run_id, "rejected", "", None
        row.message = "rejected (deadline_infeasible): the earliest deadline it would meet is 14:05"
        row.deadline = datetime(2026, 12, 1, 13, 0, tzinfo=timezone.utc)
        row.submitted_at = datetime(2026, 12, 1, 11, 59, tzinfo=timezone.utc)
        rows.append(row)
    store = _store_with(rows)
    client = _Client({untold: Scheduled(), told: Cancelled(name="Rejected")})
    adopted = asyncio.run(recover(client, store, str(tmp_path), 2, NOW, alive=lambda pid, run_id: False))
    assert adopted == [] and client.set == {untold: "Rejected"}
    assert client.states[untold].message == rows[0].message  # type: ignore[attr-defined]
    assert client.states[untold].is_final()  # type: ignore[attr-defined]


def test_a_decision_and_its_phase_are_one_write(tmp_path: Path) -> None:
    """A worker killed between the decision row and the run's new phase left
    an admitted run that read undecided, and its next life decided it again.
    A process SIGKILLed as it commits leaves neither; one that commits leaves both."""
    import subprocess
    import sys

    from scheduler_service.contracts import RunPhase
    from scheduler_service.store.db import get_engine
    from scheduler_service.worker.store import ServiceStore

    url = f"sqlite:///{tmp_path / 'store.db'}"  # the service's own kind of store
    store = ServiceStore(get_engine(url))
    store.upsert_job("r1", RunPhase.ARRIVED)
    decide = (
        "import os, signal, sys\n"
        "from sqlalchemy import event\n"
        "from scheduler_service.contracts import RunPhase\n"
        "from scheduler_service.store.db import get_engine\n"
        "from scheduler_service.worker.store import DecisionRecord, ServiceStore\n"
        "store = ServiceStore(get_engine(sys.argv[1]))\n"
        "if sys.argv[2] == 'kill':\n"
        "    event.listen(store.engine, 'commit', lambda c: os.kill(os.getpid(), signal.SIGKILL))\n"
        "store.decided(DecisionRecord(flow_run_id='r1', admitted=True), RunPhase.ADMITTED, share=2)\n")
    killed = subprocess.run([sys.executable, "-c", decide, url, "kill"], cwd=ROOT, timeout=60)
    assert killed.returncode == -9
    assert store.decisions("r1") == [] and store.jobs()[0].status == "arrived"
    subprocess.run([sys.executable, "-c", decide, url, "commit"], cwd=ROOT, timeout=60, check=True)
    assert len(store.decisions("r1")) == 1 and store.jobs()[0].status == "admitted"


@pytest.mark.parametrize(("iteration", "event", "judged_at"), [
    (1000, "completed", "trained"), (400, "completed", None), (1000, "segment.finished", None)])
def test_a_deadline_is_judged_when_rank_0_reported_the_run_trained(
        tmp_path: Path, iteration: int, event: str, judged_at: str | None) -> None:
    """A run through a slow server trained 56 s before its deadline and was
    counted late: its flow process needed a minute more to tell Prefect.
    The moment that counts is rank 0's report of the last iteration."""
    import os

    from scheduler_service.worker.channels import trained_at

    channel = FileControlChannel("r1", tmp_path)
    channel.publish_status({"iteration": iteration, "total_iterations": 1000, "event": event})
    os.utime(channel.status_path, (1_800_000_000.0, 1_800_000_000.0))
    assert trained_at(channel, 1000) == (1_800_000_000.0 if judged_at else None)


def test_a_run_the_stop_crashed_resumes_and_one_crashed_before_it_stays_failed(tmp_path: Path) -> None:
    """A stop of the stack is a pause (issue 43): an admitted run whose flow
    the stop's signal crashed before it could pause goes back to the queue,
    admitted, to continue from its checkpoint; one that crashed before the
    stop began crashed on its own and ends failed; a paused one (Scheduled,
    `Resuming`) waits for GPUs again, its GPUs released."""
    import asyncio
    import uuid

    from prefect.states import Crashed, Scheduled

    from scheduler_service.contracts import StateName
    from scheduler_service.worker.recovery import recover

    stop = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
    by_stop, before, paused = (str(uuid.uuid4()) for _ in range(3))
    rows = []
    for run_id in (by_stop, before, paused):
        row = _row()
        row.flow_run_id = run_id
        row.deadline = datetime(2030, 1, 1, tzinfo=timezone.utc)
        row.submitted_at = datetime(2026, 12, 1, 11, 59, tzinfo=timezone.utc)
        rows.append(row)
    store = _store_with(rows)
    crashed_late, crashed_early = Crashed(message="aborted by a termination signal"), Crashed(message="oom")
    crashed_late.timestamp = stop.replace(second=5)  # type: ignore[assignment]
    crashed_early.timestamp = stop.replace(minute=0, hour=11)  # type: ignore[assignment]
    client = _Client({by_stop: crashed_late, before: crashed_early, paused: Scheduled(name=StateName.RESUMING.value)})
    adopted = asyncio.run(recover(client, store, str(tmp_path), 2, NOW, alive=lambda pid, run_id: False,
                                  stopped_at=stop.timestamp()))
    assert sorted(run.run_id for run, _ in adopted) == sorted([by_stop, paused])
    assert all(not event.running for _, event in adopted)  # admitted, waiting for GPUs
    statuses = {row.flow_run_id: (row.status, row.outcome) for row in store.jobs()}  # type: ignore[attr-defined]
    assert statuses == {by_stop: ("admitted", None), before: ("finished", "failed"), paused: ("admitted", None)}
    assert client.set == {by_stop: StateName.RESUMING.value}  # back in the queue, in the same flow run
    for run_id in (by_stop, paused, before):  # their GPUs were freed once
        assert [a.action for a in store.allocations(run_id)] == ["release"]  # type: ignore[attr-defined]


def test_a_run_the_stop_paused_after_its_last_iteration_is_completed_not_trained_again(tmp_path: Path) -> None:
    """The stop-at-any-moment test found it: a stop that landed as a run
    finished paused it (Scheduled, `Resuming`) after its rank 0 had reported
    the last iteration, and the next start resumed it: it trained again from
    its checkpoint and ended `stopped` at 0 of its total. Such a run is
    Completed, met as of when it finished; a run paused midway is resumed."""
    import asyncio
    import os
    import uuid

    from prefect.states import Scheduled

    from scheduler_service.contracts import StateName
    from scheduler_service.worker.recovery import recover

    done, midway = str(uuid.uuid4()), str(uuid.uuid4())
    finished_at = datetime(2026, 12, 1, 12, 50, tzinfo=timezone.utc)
    rows = []
    for run_id in (done, midway):
        row = _row()
        row.flow_run_id, row.status = run_id, "running"
        row.deadline = datetime(2026, 12, 1, 13, 0, tzinfo=timezone.utc)
        row.submitted_at = datetime(2026, 12, 1, 11, 59, tzinfo=timezone.utc)
        rows.append(row)
        channel = FileControlChannel(run_id, tmp_path)
        channel.publish_status({"iteration": 1000 if run_id == done else 400, "total_iterations": 1000,
                                "event": "completed" if run_id == done else "segment.finished"})
        os.utime(channel.status_path, (finished_at.timestamp(), finished_at.timestamp()))
    store = _store_with(rows)
    client = _Client({run_id: Scheduled(name=StateName.RESUMING.value) for run_id in (done, midway)})
    restart = datetime(2026, 12, 1, 12, 55, tzinfo=timezone.utc).timestamp()
    adopted = asyncio.run(recover(client, store, str(tmp_path), 2, restart, alive=lambda pid, run_id: False))
    assert [run.run_id for run, _ in adopted] == [midway]
    assert client.set.get(done) == "Completed"
    outcomes = {row.flow_run_id: (row.status, row.outcome) for row in store.jobs()}  # type: ignore[attr-defined]
    assert outcomes[done] == ("finished", "met") and outcomes[midway] == ("admitted", None)
