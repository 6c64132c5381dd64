"""Standby workers: started ahead, handed a segment on stdin, gone with the launcher."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.training.datasets import DatasetSpec
from flows.training.coordinator.launcher import WorkerPool, local_segment
from flows.training.params import Hyperparameters
from flows.training.segment import SegmentSpec

pytestmark = pytest.mark.slow


def _spec(tmp_path: Path, iterations: int) -> SegmentSpec:
    return SegmentSpec(
        run_key="pool",
        model="mlp",
        dataset=DatasetSpec(name="synthetic-vectors"),
        hyperparameters=Hyperparameters(global_batch_size=8),
        total_iterations=iterations,
        stop_at=iterations,
        checkpoint_interval=100,
        checkpoint_url=str(tmp_path / "ck"),
    )


def test_a_standby_runs_the_next_segment_and_a_missing_one_starts_cold(tmp_path: Path) -> None:
    pool = WorkerPool()
    try:
        pool.refill(1)
        standby_pid = pool._standby[0].pid
        segment = local_segment(_spec(tmp_path, 3), [0, 1], pool=pool)
        segment.start()
        assert segment.pids[0] == standby_pid and segment.pids[1] != standby_pid
        assert pool.size == 0
        result = segment.wait()
        assert result.reason == "completed" and result.end_iteration == 3
        assert (segment.transport.dir / "rank1.log").exists()  # the hand-over redirected its output
    finally:
        pool.close()


def test_standbys_exit_when_the_launcher_goes(tmp_path: Path) -> None:
    pool = WorkerPool()
    pool.refill(1)
    proc = pool._standby[0]
    assert proc.stdin is not None
    proc.stdin.close()  # what the launcher's death looks like from the standby
    assert proc.wait(timeout=60) == 0
    pool.close()


def test_a_segment_that_does_not_end_in_its_time_is_stopped_and_reported(tmp_path: Path) -> None:
    segment = local_segment(_spec(tmp_path, 1_000_000), [0, 1], pool=WorkerPool())
    segment.start()
    result = segment.wait(timeout_s=3.0)
    assert result.reason == "crashed" and "did not finish in 3 s" in (result.error or "")
    assert all(r.proc.poll() is not None for r in segment.ranks)  # nothing left holding the GPUs


def test_a_profile_past_its_time_raises_instead_of_blocking_the_service() -> None:
    from flows.training.coordinator.profiler import profile_throughput

    with pytest.raises(RuntimeError, match="did not finish"):
        profile_throughput("mlp", 8, [1, 2], iterations=100_000, warmup=2, device="cpu", timeout_s=2.0,
                           dataset={"name": "synthetic-vectors"})


def test_a_worker_gone_before_taking_its_segment_fails_the_segment_at_once(tmp_path: Path) -> None:
    import subprocess
    import sys

    pool = WorkerPool()
    # A "standby" that exits cleanly a moment after it is handed a segment, without ever reading it.
    pool._standby.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"],
                                          stdin=subprocess.PIPE))
    segment = local_segment(_spec(tmp_path, 1_000_000), [0, 1], pool=pool)
    try:
        segment.start()
        result = segment.wait(timeout_s=120.0)  # without the check: the other rank waits in its rendezvous
    finally:
        pool.close()
    assert result.reason == "crashed" and "worker rank 0 never took its segment" in (result.error or "")
    assert all(r.proc.poll() is not None for r in segment.ranks)
