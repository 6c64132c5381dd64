"""Profiling on first use, without a server: runs of one model share one
measurement, its GPUs are reserved while it runs, and a failure or a wait
past the timeout is that run's rejection with the reason."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from scheduler_service.contracts import RejectionReason
from scheduler_service.loop import ControlLoop, LoopSettings
from scheduler_service.loop.events import Reserved
from scheduler_service.policy import Topology
from scheduler_service.worker.intake import Request, new_run, read_request
from scheduler_service.worker.profiling import Outcome, Profiler

NOW = 1_800_000_000.0


class Profiling:
    """A profiler beside the control loop it reserves GPUs in, as the worker drives them."""

    def __init__(self, measure, timeout_s: float = 600.0) -> None:  # type: ignore[no-untyped-def]
        self.loop = ControlLoop(Topology(1, 1, 2), LoopSettings(policy="elasticflow", interval_s=2.0))
        self.profiler = Profiler(measure, device="cpu", timeout_s=timeout_s)

    def poll(self, now: float) -> list[Outcome]:
        outcomes, reservations = self.profiler.poll(now, self.loop, max_job_gpus=2)
        for event in reservations:
            self.loop.handle(event, now)
        return outcomes

    def reserved(self) -> set[int]:
        return {gpu for gpu, holder in self.loop.gpu_map().items() if holder.startswith("service:")}


def _run(tmp: Path, run_id: str, batch: int = 32):  # type: ignore[no-untyped-def]
    request = read_request({"model": "mlp", "iterations": 50, "hyperparameters": {"global_batch_size": batch}}, NOW)
    return new_run(run_id, run_id, request, str(tmp), NOW)


def _until(profiling: Profiling, now: float, count: int) -> list:  # type: ignore[type-arg]
    for _ in range(200):
        outcomes = profiling.poll(now)
        if outcomes:
            return outcomes
        time.sleep(0.02)
    raise AssertionError("no outcome")


def test_runs_of_one_model_share_one_measurement_on_reserved_gpus(tmp_path: Path) -> None:
    release, calls = threading.Event(), []

    def measure(request: Request, gpus: list[int]) -> dict[int, float]:
        calls.append(tuple(gpus))
        release.wait(5)
        return {1: 10.0, 2: 18.0}

    profiling = Profiling(measure)
    profiling.profiler.wait_for(_run(tmp_path, "a"))
    profiling.profiler.wait_for(_run(tmp_path, "b"))
    assert profiling.poll(NOW) == []
    assert profiling.reserved() == {0, 1}  # nobody is launched onto them meanwhile
    release.set()
    outcomes = _until(profiling, NOW + 1, 2)
    assert sorted(o.run.run_id for o in outcomes) == ["a", "b"] and calls == [(0, 1)]
    assert all(o.points == {1: 10.0, 2: 18.0} for o in outcomes)
    assert profiling.reserved() == set() and profiling.profiler.sizes() == {"waiting": 0, "running": 0,
                                                                            "queued": 0, "blocked": 0}


def test_a_failed_measurement_rejects_its_runs_with_the_users_error(tmp_path: Path) -> None:
    def measure(request: Request, gpus: list[int]) -> dict[int, float]:
        raise RuntimeError("CUDA out of memory in your model")

    profiling = Profiling(measure)
    profiling.profiler.wait_for(_run(tmp_path, "a"))
    (outcome,) = _until(profiling, NOW, 1)
    assert outcome.points is None and outcome.reason is RejectionReason.PROFILING_FAILED
    assert "RuntimeError: CUDA out of memory in your model" in outcome.message


def test_no_free_gpus_for_longer_than_the_timeout_is_a_rejection_naming_the_holders(tmp_path: Path) -> None:
    profiling = Profiling(lambda request, gpus: {1: 1.0}, timeout_s=60.0)
    profiling.loop.handle(Reserved("someone else", (0, 1)), NOW)
    profiling.profiler.wait_for(_run(tmp_path, "a"))
    assert profiling.poll(NOW + 30) == []
    (outcome,) = profiling.poll(NOW + 61)
    assert outcome.reason is RejectionReason.PROFILING_FAILED and "held: 0: service:someone else" in outcome.message
    assert profiling.profiler.sizes()["queued"] == 0  # its only run gave up: nothing left waiting to be measured
