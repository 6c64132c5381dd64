"""The stack's supervisor: an exit is noticed and said, the process is started
again after its backoff, and quick exits in a row back off further."""

from __future__ import annotations

from pathlib import Path

from scheduler_service.stack.supervisor import BACKOFF_S, Supervised


def test_an_exited_process_is_restarted_after_a_growing_backoff(tmp_path: Path) -> None:
    # `prefect --version` exits at once: a process that keeps crashing
    quick = Supervised("worker", ["--version"], {}, tmp_path / "worker.log", tmp_path)
    quick.start()
    assert quick.process is not None and quick.process.wait(timeout=300) == 0
    first = quick.check()
    assert first is not None and "the worker exited with status 0" in first and f"in {BACKOFF_S[0]:.0f} s" in first
    assert quick.check() is None  # not due yet, said once
    assert quick.restart_at is not None
    restarted = quick.check(now=quick.restart_at)
    assert restarted is not None and "the worker restarted" in restarted and "restart 1" in restarted
    assert quick.process.wait(timeout=300) == 0
    again = quick.check()
    assert again is not None and f"in {BACKOFF_S[1]:.0f} s" in again  # a second quick exit waits longer
    quick.stop()
    assert quick.check() is None  # stopped: nothing is due
