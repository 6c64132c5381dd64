"""A re-plan is not a decision: when the nodes change, every admitted run is
re-planned, and a running run stays running in the store, with its one
decision (issue 24: after a node joined, `status` showed a running run as
"admitted ... waiting for GPUs", its GPUs free)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from scheduler_service.contracts import RunPhase
from tests.service.offline import Entry, FlowRun, offline_worker

T0 = 1_000_000.0


async def _running(worker: Any, run_id: str) -> Any:
    """Take in a one-hour mlp run, decide it and acknowledge its launch: the command it runs under."""
    from flows.training.control import ControlAck, FileControlChannel

    await worker.take_in.take([Entry(FlowRun({"model": "mlp", "iterations": 100_000, "deadline": "+1h"},
                                             run_id=run_id))], T0)
    await worker.decide(T0)
    channel = FileControlChannel(run_id, worker.settings.home / "control")
    command = channel.latest()
    assert command is not None and command.gpus
    channel.acknowledge(ControlAck(seq=command.seq, iteration=0, gpus=command.gpus))
    await worker.decide(T0 + 1)
    return command


def test_a_running_run_stays_running_with_one_decision_when_the_nodes_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from scheduler_service.loop.events import ClusterChanged
    from scheduler_service.store import save_curve

    worker = offline_worker(tmp_path / "home", monkeypatch)
    save_curve("mlp", 32, {1: 100.0, 2: 190.0})
    run_id = "00000001"

    async def drive() -> None:
        await _running(worker, run_id)
        assert worker.reporter.store.jobs()[0].status == RunPhase.RUNNING.value
        # The same two slots, found again: every run is re-planned as after a restart.
        topology = worker.loop.topology
        await worker.decide(T0 + 5, [ClusterChanged(topology, {g: g for g in range(topology.num_gpus)})])
        await worker.decide(T0 + 6)

    asyncio.run(drive())
    (row,) = worker.reporter.store.jobs()
    assert row.status == RunPhase.RUNNING.value and row.gpus, (row.status, row.gpus, row.message)
    assert len(worker.reporter.store.decisions(run_id)) == 1


def test_the_store_follows_a_running_runs_gpus_to_their_new_ids_and_drops_those_of_a_lost_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ray chaos, seed 3: a run's node died; the store kept its old GPU id,
    the node that joined took that id, another run was given it, and the
    store (and a restarted worker, which adopts from it) had one GPU held by
    two runs."""
    from scheduler_service.contracts import AllocationAction
    from scheduler_service.loop.events import ClusterChanged
    from scheduler_service.readmodel import report
    from scheduler_service.store import save_curve

    from sqlmodel import create_engine

    from scheduler_service.worker.store import ServiceStore

    home = tmp_path / "home"
    home.mkdir()
    store = ServiceStore(create_engine(f"sqlite:///{home / 'elasticflow.db'}"))  # a file: `report` reads it
    worker = offline_worker(home, monkeypatch, store=store)
    save_curve("mlp", 32, {1: 100.0})  # one GPU is all it uses
    run_id = "00000002"

    async def drive() -> tuple[int, ...]:
        command = await _running(worker, run_id)
        topology = worker.loop.topology
        # The nodes found again in the other order: the same GPU has the other id.
        swap = {g: topology.num_gpus - 1 - g for g in range(topology.num_gpus)}
        await worker.decide(T0 + 5, [ClusterChanged(topology, swap)])
        moved = tuple(swap[g] for g in command.gpus)
        assert worker.reporter.store.jobs()[0].gpus == ",".join(map(str, moved))
        # Its node is gone (and one like it took its place): it holds nothing until it is placed again.
        await worker.decide(T0 + 6, [ClusterChanged(topology, {g: g for g in range(topology.num_gpus)
                                                                 if g not in moved}, ("node-1",))])
        return moved

    moved = asyncio.run(drive())
    assert moved != ()
    (row,) = worker.reporter.store.jobs()
    assert row.status == RunPhase.RUNNING.value and row.gpus == "", row.gpus
    assert worker.reporter.store.allocations(run_id)[-1].action == AllocationAction.REBASED.value
    (view,) = report(home).runs
    assert view.gpus == [] and "lost node" in view.detail, view
