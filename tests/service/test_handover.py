"""A run's end hands its GPUs on at once, without waiting for the worker's
next poll: the poll reads Prefect (its filters are POSTs, which a loaded
server refuses with a 503 and the client retries with a growing backoff),
and in a slow-server burst it was held long enough that two admitted runs
waited beside the free GPUs until their deadlines had passed. Prefect's API
is a recorder here (tests/service/offline.py); the store and the control
channels are real."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.service.offline import Entry, FlowRun, offline_worker

T0 = 1_000_000.0


def test_the_gpus_of_a_run_that_ends_go_to_the_run_waiting_for_them_before_the_next_poll(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flows.training.control import ControlAck, FileControlChannel
    from scheduler_service.store import save_curve
    from scheduler_service.worker import worker as worker_module

    worker = offline_worker(tmp_path, monkeypatch)
    save_curve("mlp", 32, {1: 100.0, 2: 190.0})
    now = [T0]
    monkeypatch.setattr(worker, "clock", lambda: now[0])
    submitted: list[Any] = []

    async def submit(_: Any, responses: list[Any]) -> list[Any]:
        submitted.extend(responses)
        return []

    monkeypatch.setattr(worker_module, "submit", submit)

    def channel(run_id: str) -> FileControlChannel:
        return FileControlChannel(run_id, worker.settings.home / "control")

    async def scenario() -> None:
        first = Entry(FlowRun({"model": "mlp", "iterations": 100_000, "deadline": "+1h"}, run_id="first"))
        await worker.take_in.take([first], now[0])
        await worker.decide(now[0])
        command = channel("first").latest()
        assert command is not None and len(command.gpus) == 2  # both GPUs, its plan's and the spare one
        channel("first").acknowledge(ControlAck(seq=command.seq, iteration=0, gpus=command.gpus))

        waiting = Entry(FlowRun({"model": "mlp", "iterations": 1_000}, run_id="waiting"))  # best-effort
        now[0] += 1.0
        await worker.take_in.take([waiting], now[0])
        await worker.decide(now[0])
        assert channel("waiting").latest() is None  # the first keeps its width: nothing is spare

        now[0] += 300.0  # the first ends, well into a later slot, while no poll comes
        await worker.ended("first")
        command = channel("waiting").latest()
        assert command is not None and command.gpus, "the freed GPUs waited for the next poll"
        assert [entry.flow_run.id for entry in submitted] == ["waiting"]  # handed to Prefect to start

    asyncio.run(scenario())
