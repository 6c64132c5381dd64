"""A re-plan is not a decision: when the nodes change, every admitted run is
re-planned, and a running run stays running in the store, with its one
decision (issue 24: after a node joined, `status` showed a running run as
"admitted ... waiting for GPUs", its GPUs free)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from scheduler_service.contracts import RunPhase
from tests.service.offline import Entry, FlowRun, offline_worker

T0 = 1_000_000.0


def test_a_running_run_stays_running_with_one_decision_when_the_nodes_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.training.control import ControlAck, FileControlChannel
    from scheduler_service.loop.events import ClusterChanged
    from scheduler_service.store import save_curve

    worker = offline_worker(tmp_path / "home", monkeypatch)
    save_curve("mlp", 32, {1: 100.0, 2: 190.0})
    run_id = "00000001"

    async def drive() -> None:
        await worker.take_in.take([Entry(FlowRun({"model": "mlp", "iterations": 100_000, "deadline": "+1h"},
                                                 run_id=run_id))], T0)
        await worker.decide(T0)
        channel = FileControlChannel(run_id, worker.settings.home / "control")
        command = channel.latest()
        assert command is not None and command.gpus
        channel.acknowledge(ControlAck(seq=command.seq, iteration=0, gpus=command.gpus))
        await worker.decide(T0 + 1)
        assert worker.reporter.store.jobs()[0].status == RunPhase.RUNNING.value
        # The same two slots, found again: every run is re-planned as after a restart.
        topology = worker.loop.topology
        await worker.decide(T0 + 5, [ClusterChanged(topology, {g: g for g in range(topology.num_gpus)})])
        await worker.decide(T0 + 6)

    asyncio.run(drive())
    (row,) = worker.reporter.store.jobs()
    assert row.status == RunPhase.RUNNING.value and row.gpus, (row.status, row.gpus, row.message)
    assert len(worker.reporter.store.decisions(run_id)) == 1
