"""`elasticflow up` stopped with SIGINT at any moment around a run's
completion (issue 24): after the next start, the store (and so `elasticflow
status`), Prefect and the processes agree on every run, no GPU is held by a
run that ended, no run is lost or decided twice.

Twenty-four offsets around completions, in three stops of an 8-slot stack
training eight short runs each: their lengths are staggered (+10% a run), so
one stop lands at eight distances from eight completions, a few seconds
apart; each stop is shifted against the others (0.6 s before, at, 0.6 s after
the fourth run's completion). The offsets are measured (a run's work left at
the signal, at its last second's rate, or how long it had been finished) and
printed with any failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from tests.stack import MLP_CURVE, ROOT, stack_settings, wait_until

pytestmark = pytest.mark.slow

STOPS, RUNS = 3, 8
SHIFTS_S = (-0.6, 0.0, 0.6)  # each stop's signal against the completion of its fourth run


class Watch:
    """A stop's runs, polled every 50 ms: when each completed, and how much
    work each had left at a moment (its rate over the last second)."""

    def __init__(self, home: Path, runs: list[str]) -> None:
        self.home, self.runs = home, runs
        self.seen: dict[str, list[tuple[float, int]]] = {r: [] for r in runs}
        self.completed: dict[str, float] = {}

    def poll(self) -> None:
        now = time.time()
        for run in self.runs:
            status = _status(self.home, run)
            if not status or run in self.completed:
                continue
            if status["iteration"] >= status["total_iterations"]:
                self.completed[run] = now
            self.seen[run] = [s for s in self.seen[run] if now - s[0] <= 1.0] + [(now, status["iteration"])]

    def left_s(self, run: str) -> float:
        """Seconds of training it had left at the last poll (0: completed)."""
        if run in self.completed:
            return 0.0
        samples = self.seen[run]
        (t0, i0), (t1, i1) = samples[0], samples[-1]
        total = _status(self.home, run).get("total_iterations", i1)
        return (total - i1) * (t1 - t0) / (i1 - i0) if i1 > i0 and t1 > t0 else float("inf")

    def offsets(self, at: float) -> list[float]:
        """Each run's offset of `at` from its completion (negative: before it)."""
        return [round(at - self.completed[r] if r in self.completed else -self.left_s(r), 1) for r in self.runs]


def _status(home: Path, run_id: str) -> dict[str, Any]:
    try:
        return json.loads((home / "control" / run_id / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _audit(home: Path, ids: list[str]) -> Any:
    from prefect.client.orchestration import get_client

    from scheduler_service.stack.audit import audit, decision_counts, read_flow_runs

    async def read() -> Any:
        async with get_client() as client:
            return await read_flow_runs(client, ids)

    return audit(home, asyncio.run(read()), decision_counts(home), settle_s=0.0)


def _submit(iterations: int) -> str:
    from prefect.deployments import run_deployment

    deadline = datetime.now(timezone.utc) + timedelta(minutes=10)
    run = run_deployment("train/mlp", timeout=0, parameters={
        "iterations": iterations, "deadline": deadline.isoformat(), "checkpoint_interval": 200,
        "hyperparameters": {"global_batch_size": 32}, "device": "cpu"})
    return str(run.id)  # type: ignore[union-attr]


def test_a_stop_at_any_moment_around_a_completion_leaves_every_record_agreeing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from scheduler_service.stack.local import free_port, stack_env
    from scheduler_service.store import save_curve

    home, port = tmp_path / "home", free_port()
    settings = {k: v for k, v in stack_settings(tmp_path).items() if k != "ELASTICFLOW_CLUSTER"}
    settings["ELASTICFLOW_CPU_SLOTS"] = "8"
    environment = {**os.environ, **stack_env(home, port), **settings}
    for key, value in {**stack_env(home, port), **settings}.items():
        monkeypatch.setenv(key, value)
    log = tmp_path / "up.log"

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", "from scheduler_service.cli import main; main()", "up",
                                 "--home", str(home), "--port", str(port)], env=environment, cwd=ROOT,
                                stdout=open(log, "ab"), stderr=subprocess.STDOUT)

    worker_log = home / "logs" / "worker.log"
    starts = 0

    def started() -> None:
        nonlocal starts
        starts += 1
        wait_until(lambda: log.read_text(errors="replace").count("ElasticFlow worker started") >= starts  # deployed
                   and worker_log.read_text(errors="replace").count("started!") >= starts, 240,
                   f"the stack's start {starts}")

    ids: list[str] = []
    offsets: list[float] = []
    iterations = 3000  # a run's length at a first guess of the rate; then from what the last stop measured
    up = start()
    try:
        with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{port}/api",
                                         PREFECT_HOME: home / "prefect"}):
            for stop in range(STOPS + 1):
                started()
                if stop == 0:
                    save_curve("mlp", 32, MLP_CURVE)  # once the worker made the store
                if ids:  # the last stop's runs, after this start: every record agrees
                    try:
                        wait_until(lambda: not _audit(home, ids).violations, 180, "store and Prefect to agree")
                    except AssertionError:
                        problems = _audit(home, ids).lines()
                        raise AssertionError(f"after stop {stop}: {problems}; offsets {offsets}") from None
                if stop == STOPS:
                    break
                batch = [_submit(int(iterations * (1 + k * 0.1))) for k in range(RUNS)]
                ids += batch
                wait_until(lambda: all(_status(home, r).get("iterations_per_s") for r in batch), 240,
                           "the runs to train")
                watch, target, shift = Watch(home, batch), batch[3], SHIFTS_S[stop]
                started_at = time.time()
                while not (target in watch.completed and time.time() >= watch.completed[target] + shift
                           or shift < 0 and watch.left_s(target) <= -shift):
                    assert time.time() - started_at < 300, "the runs never came near completion"
                    time.sleep(0.05)
                    watch.poll()
                up.send_signal(signal.SIGINT)
                offsets += watch.offsets(time.time())
                rates = [_status(home, r).get("iterations_per_s") or 0 for r in batch]
                iterations = max(500, int(sum(rates) / len(rates) * 10.0))  # next stop: ~10 s of training a run
                assert up.wait(timeout=120) == 0, log.read_text()[-2000:]
                up = start()
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=120)
    before, after = [o for o in offsets if -3 <= o < 0], [o for o in offsets if 0 <= o <= 3]
    assert len(before) >= 3 and len(after) >= 3, f"too few stops within 3 s of a completion: {offsets}"
