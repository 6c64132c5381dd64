"""The worker's own bookkeeping is the size of what is in flight: 10,000 runs
taken in, admitted, launched and ended leave nothing behind that grows with
their number. Prefect's API is replaced by a recorder here (what reaches
Prefect is tested against a real server in test_worker.py); the worker's
store is a real SQLite database, the control channels real files."""

from __future__ import annotations

import asyncio
import logging
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from scheduler_service.worker import decisions, intake
from tests.service.offline import FlowRun, RecordingPublisher, offline_worker

pytestmark = pytest.mark.slow

T0 = 1_000_000.0
POINTS = {1: 100.0, 2: 190.0}


async def _cycle(worker: Any, index: int, now: float) -> None:
    """One run through take-in, decision, launch, acknowledgement and its end."""
    from flows.training.control import ControlAck

    run_id = f"{index:08d}"
    request = intake.read_request({"model": "mlp", "iterations": 100, "deadline": "+1h"}, now)
    run = intake.new_run(run_id, f"run-{run_id}", request, str(worker.settings.home / "control"), now)
    run.flow_run = run.response = FlowRun(run_id=run_id)
    worker.runs[run_id] = run
    worker._ready(run, POINTS, now)
    result = worker.scheduler.plan(now)
    if result is not None:
        await decisions.publish(worker, result, now)
    for action in worker.scheduler.actuate(now):
        await decisions.apply(worker, action, now)
    command = run.channel.latest()
    if command is not None:
        run.channel.acknowledge(ControlAck(seq=command.seq, iteration=100, gpus=command.gpus or []))
    worker.view.due(worker.view.snapshot(worker.runs, now), now)
    await worker.finished(run_id)


def _traced() -> int:
    """Bytes traced now, less what a library's own background threads hold: a
    Ray driver connected earlier in this test process (tests/cluster) keeps
    allocating on its threads, which is not the worker's bookkeeping."""
    snapshot = tracemalloc.take_snapshot().filter_traces((tracemalloc.Filter(False, "*/site-packages/ray/*"),))
    return sum(stat.size for stat in snapshot.statistics("filename"))


def test_ten_thousand_ended_runs_leave_the_bookkeeping_as_it_was(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    worker = offline_worker(tmp_path, monkeypatch)
    worker.publisher = RecordingPublisher(keep_states=False)  # the recorder itself must not grow either

    async def drive(first: int, last: int) -> None:
        for i in range(first, last):
            await _cycle(worker, i, T0 + 10.0 * i)  # a slot apart: every plan is a fresh one

    # The worker's log lines would be kept by pytest's log capture, which grows
    # by itself: off for this test (they are not what it measures).
    logging.disable(logging.WARNING)
    # Traced from the start: a block allocated before tracing starts is not
    # counted when freed, and capped caches would then look as if they grew.
    tracemalloc.start()
    try:
        asyncio.run(drive(0, 5_000))
        before = _traced()
        sizes_before = worker.bookkeeping()
        asyncio.run(drive(5_000, 10_000))
        grown = _traced() - before
    finally:
        tracemalloc.stop()
        logging.disable(logging.NOTSET)
    sizes = worker.bookkeeping()
    print(f"bookkeeping after 5,000 runs {sizes_before}, after 10,000 {sizes}; "
          f"memory grown over the last 5,000: {grown / 1024:.0f} KiB")
    assert worker.publisher.calls > 10_000 * 5  # they really went through admission and launch
    assert sizes == sizes_before  # nothing per ended run stays (recent ids are capped)
    assert sizes["runs"] == 0 and sizes["scheduler.arrivals"] == 0
    assert grown < 256 * 1024  # and nothing per run elsewhere: under 50 bytes a run (a leak is KiBs a run)
