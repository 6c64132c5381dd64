"""A restarted worker plans with what its last life learnt of how long starts
take here, not with the default: every start is kept in the store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.service.offline import Entry, FlowRun, offline_worker

T0 = 1_000_000.0


def test_a_restarted_worker_recalls_how_long_starts_took(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlmodel import create_engine

    from flows.training.control import ControlAck, FileControlChannel
    from scheduler_service.store import save_curve
    from scheduler_service.worker.channels import observe
    from scheduler_service.worker.store import ServiceStore

    monkeypatch.delenv("ELASTICFLOW_LAUNCH_S", raising=False)  # learnt, as by default
    url = f"sqlite:///{tmp_path / 'elasticflow.db'}"
    first = offline_worker(tmp_path / "home", monkeypatch, store=ServiceStore(create_engine(url)))
    save_curve("mlp", 32, {1: 100.0, 2: 190.0})
    assert first.loop.start_cost.startup_s() == 15.0  # the default, nothing seen yet

    async def a_slow_start() -> None:
        entry = Entry(FlowRun({"model": "mlp", "iterations": 10_000, "deadline": "+1h"}, run_id="run-a"))
        await first.take_in.take([entry], T0)
        await first.decide(T0)
        channel = FileControlChannel("run-a", first.settings.home / "control")
        command = channel.latest()
        assert command is not None
        channel.acknowledge(ControlAck(seq=command.seq, iteration=0, gpus=command.gpus or []))
        await first.decide(T0 + 1, observe("run-a", channel))
        channel.publish_status({"run_key": "run-a", "iteration": 1, "total_iterations": 10_000,
                                "gpus": command.gpus, "event": "progress"})
        await first.decide(T0 + 40, observe("run-a", channel))  # its first iteration, 40 s after its launch

    asyncio.run(a_slow_start())
    (row,) = ServiceStore(create_engine(url)).recent_starts(10)
    assert row == pytest.approx(40.0)
    assert first.loop.start_cost.startup_s() == pytest.approx(row)

    again = offline_worker(tmp_path / "home", monkeypatch, store=ServiceStore(create_engine(url)))
    assert again.loop.start_cost.startup_s() == 15.0
    again.recall_starts(T0 + 100)  # as its setup does, before it adopts anything
    assert again.loop.start_cost.startup_s() == pytest.approx(row)
