"""The worker's own bookkeeping is the size of what is in flight: 1,000 runs
taken in, admitted, launched and ended leave nothing behind that grows with
their number. Prefect's API is replaced by a recorder here (what reaches
Prefect is tested against a real server in test_worker.py); the worker's
store is a real SQLite database, the control channels real files."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from tests.service.offline import ROOT, Entry, FlowRun, RecordingPublisher, offline_worker

pytestmark = pytest.mark.slow

T0 = 1_000_000.0
POINTS = {1: 100.0, 2: 190.0}
# Measured once every capped list is full (registry.RecentIds, the decisions'
# times, the cluster view's samples and names: capped near RECENT here rather
# than at 4,096, 1,000 and 500, so that the suite spends half a minute on it,
# not 7), so that nothing may grow over the runs after it.
RECENT, FULL, RUNS = 256, 600, 1_000


class _Clock:
    """The worker's clock, set by each cycle: the loop sees one time line,
    never the test's times mixed with the wall clock's (whether the wall's
    slot had already been planned in made the last run's end linger or not)."""

    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


async def _cycle(worker: Any, clock: _Clock, index: int, now: float) -> None:
    """One run through take-in, decision, launch, acknowledgement and its end."""
    from flows.training.control import ControlAck

    from flows.training.control import FileControlChannel

    run_id = f"{index:08d}"
    entry = Entry(FlowRun({"model": "mlp", "iterations": 100, "deadline": "+1h"}, run_id=run_id))
    await worker.take_in.take([entry], now)
    await worker.decide(now)
    channel = FileControlChannel(run_id, worker.settings.home / "control")
    command = channel.latest()
    if command is not None:
        channel.acknowledge(ControlAck(seq=command.seq, iteration=100, gpus=command.gpus or []))
    clock.now = now + 0.5
    await worker.decide(clock.now)
    names = {run.run_id: run.name for run in worker.registry}
    worker.view.due(worker.view.snapshot(worker.loop.views(now), names, now), now)
    await worker.ended(run_id)


def _traced() -> tracemalloc.Snapshot:
    return tracemalloc.take_snapshot().filter_traces((tracemalloc.Filter(False, tracemalloc.__file__),))


def measure(home: str) -> dict[str, Any]:
    """RUNS runs through a fresh offline worker; what it keeps after FULL and
    after all, and what the runs after FULL added to the heap (with where,
    the largest growths first)."""
    from scheduler_service.store import save_curve

    from scheduler_service.worker import cluster_view, registry, reporting

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(registry, "RECENT_IDS", RECENT)
    monkeypatch.setattr(reporting, "DECISION_TIMES", RECENT)
    monkeypatch.setattr(cluster_view, "HISTORY", RECENT // 2)  # the plot's samples, and the names they show
    publisher = RecordingPublisher(keep_states=False)  # the recorder itself must not grow either
    worker = offline_worker(Path(home), monkeypatch, publisher)
    clock = _Clock()
    monkeypatch.setattr(worker, "clock", clock)
    save_curve("mlp", 32, POINTS)

    async def drive(first: int, last: int) -> None:
        for i in range(first, last):
            await _cycle(worker, clock, i, T0 + 10.0 * i)  # a slot apart: every plan is a fresh one
        clock.now = T0 + 10.0 * last
        await worker.decide(clock.now)  # the next slot's plan: the last run's end is forgotten there

    logging.disable(logging.WARNING)  # the worker's lines are not what this measures
    # Traced from the start: a block allocated before tracing starts is not
    # counted when freed, and capped caches would then look as if they grew.
    tracemalloc.start()
    try:
        asyncio.run(drive(0, FULL))
        before, sizes_before = _traced(), worker.bookkeeping()
        asyncio.run(drive(FULL, RUNS))
        after = _traced()
    finally:
        tracemalloc.stop()
        logging.disable(logging.NOTSET)
    growth = after.compare_to(before, "lineno")
    return {"sizes_before": sizes_before, "sizes": worker.bookkeeping(), "calls": publisher.calls,
            "grown": sum(stat.size_diff for stat in growth),
            "where": [str(stat) for stat in growth[:8]]}


def test_a_thousand_ended_runs_leave_the_bookkeeping_as_it_was(tmp_path: Path) -> None:
    # In a fresh interpreter: what this measures is the worker's bookkeeping,
    # not what earlier tests left running in this process (a Ray driver's
    # threads, Prefect's log and event workers) allocating meanwhile.
    code = ("import json, sys; from tests.service.test_bookkeeping import measure; "
            "print(json.dumps(measure(sys.argv[1])))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                         timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    sizes, grown = result["sizes"], result["grown"]
    print(f"bookkeeping after {FULL:,} runs {result['sizes_before']}, after {RUNS:,} {sizes}; "
          f"memory grown over the last {RUNS - FULL:,}: {grown / 1024:.0f} KiB")
    assert result["calls"] > RUNS * 5  # they really went through admission and launch
    assert sizes == result["sizes_before"]  # nothing per ended run stays (recent ids are capped)
    assert sizes["runs"] == 0 and sizes["loop.runs"] == 0 and sizes["loop.arrivals"] == 0 and sizes["loop.gone"] == 0
    # and nothing per run elsewhere: under 160 bytes a run (a leak is KiBs a run)
    assert grown < 160 * (RUNS - FULL), "\n".join(result["where"])
