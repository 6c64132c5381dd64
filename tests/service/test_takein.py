"""Take-in without a server: what can only fail later is refused at once,
naming the field, and the refusal says what the run asked for."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from scheduler_service.contracts import RunPhase
from tests.service.offline import Entry, FlowRun, offline_worker

NOW = 1_800_000_000.0


def _take(worker, parameters: dict) -> str:  # type: ignore[no-untyped-def]
    entry = Entry(FlowRun(parameters))
    asyncio.run(worker.take_in.take([entry], NOW))
    return str(entry.flow_run.id)


def test_a_checkpoint_store_block_nobody_saved_is_refused_before_the_run_holds_a_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = offline_worker(tmp_path, monkeypatch)
    run_id = _take(worker, {"model": "mlp", "iterations": 5, "checkpoint_store": "team-store"})
    (decision,) = worker.reporter.store.decisions(run_id)
    assert not decision.admitted and decision.reason == "invalid_parameters"
    assert decision.message.startswith("checkpoint_store: no CheckpointStore block named 'team-store' is saved")
    (row,) = worker.reporter.store.jobs()
    assert row.status == RunPhase.REJECTED and row.model == "mlp"  # shown as what it asked for, rejected


def test_cuda_asked_of_this_cpu_cluster_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = offline_worker(tmp_path, monkeypatch)
    run_id = _take(worker, {"model": "mlp", "iterations": 5, "device": "cuda"})
    (decision,) = worker.reporter.store.decisions(run_id)
    assert decision.reason == "invalid_parameters" and decision.message.startswith("device: 'cuda' was asked")


def test_new_runs_wait_in_the_queue_while_prefects_server_is_far_behind(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29, 2: decisions are told to Prefect in the background; once that
    many are still untold, take-in leaves new runs Scheduled in the queue
    (decided now, an admitted one would start when its decision is written,
    later than planned) and takes them in once the server caught up."""
    import anyio

    from scheduler_service.worker.reporting import Reporter
    from scheduler_service.worker.takein import TakeIn
    from tests.service.offline import OfflineClient, RecordingPublisher

    class Stuck(RecordingPublisher):
        """A server that takes no write until told to."""

        def __init__(self) -> None:
            super().__init__()
            self.go = anyio.Event()

        async def rejected(self, run_id: str, rejection: object) -> None:
            await self.go.wait()
            await super().rejected(run_id, rejection)

    worker = offline_worker(tmp_path, monkeypatch)
    entries = [Entry(FlowRun({"model": "no-such-model"})) for _ in range(40)]

    async def scenario() -> tuple[int, int, int]:
        publisher = Stuck()
        async with anyio.create_task_group() as group:
            reporter = Reporter(worker.reporter.store, publisher, lambda flow_run: worker._logger, lambda: group,
                                concurrency=4)  # 16 untold at most
            take_in = TakeIn(OfflineClient(), worker.settings, worker.registry, worker.loop, worker.profiler,
                             reporter, lambda: "cpu")
            first, _ = await take_in.take(entries, NOW)
            again, _ = await take_in.take(entries, NOW)  # still behind: nothing more
            publisher.go.set()
            while reporter.untold:
                await anyio.sleep(0.01)
            rest, _ = await take_in.take(entries, NOW)
        return first, again, rest

    first, again, rest = asyncio.run(scenario())
    assert (first, again) == (16, 0)
    assert rest == 24 and len(worker.reporter.store.decisions()) == 40
