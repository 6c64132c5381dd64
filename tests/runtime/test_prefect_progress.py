"""Prefect is a window onto training: a server that is down or hangs never
holds the loop that supervises the ranks, and no state of ours lands after the
run's end."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from flows.training.reporting.prefect_progress import Outbox, PrefectProgress
from flows.training.segment import SegmentResult


def _stopped(gpus: list[int], iteration: int) -> SegmentResult:
    return SegmentResult(reason="stopped", gpus=gpus, start_iteration=0, end_iteration=iteration)


def test_the_outbox_keeps_order_and_only_the_newest_of_a_key() -> None:
    gate, holding, made = threading.Event(), threading.Event(), []
    outbox = Outbox("test")
    outbox.put(lambda: holding.set() or gate.wait())  # holds the thread while the rest queue up
    assert holding.wait(5.0)
    for name, key in [("a1", "a"), ("e1", None), ("a2", "a"), ("s1", "state"), ("e2", None), ("s2", "state")]:
        outbox.put(lambda name=name: made.append(name), key=key)
    assert outbox.holds("state") and not outbox.holds("labels")
    gate.set()
    assert outbox.flush(5.0)
    assert made == ["a2", "e1", "s2", "e2"]  # each replaced in its place; keyless ones all made


def test_closing_drops_what_waits_and_waits_for_a_state_in_flight() -> None:
    release, made = threading.Event(), []

    def state() -> None:
        release.wait()
        made.append("state")

    outbox = Outbox("test")
    outbox.put(state, key="state")
    outbox.put(lambda: made.append("labels"), key="labels")
    threading.Timer(0.5, release.set).start()
    outbox.close(0.1, after=lambda key: key == "state")
    assert made == ["state"]  # the state landed before close returned; the labels never will
    outbox.put(lambda: made.append("late"))
    time.sleep(0.1)
    assert made == ["state"]


@pytest.fixture
def silent_server() -> str:
    """An API that takes connections and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/api"
    sock.close()


def test_a_hung_server_never_holds_training(silent_server: str, monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    from prefect.settings import (
        PREFECT_API_REQUEST_TIMEOUT,
        PREFECT_API_URL,
        PREFECT_CLIENT_MAX_RETRIES,
        temporary_settings,
    )

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    with temporary_settings({PREFECT_API_URL: silent_server, PREFECT_API_REQUEST_TIMEOUT: 3.0,
                             PREFECT_CLIENT_MAX_RETRIES: 0}):
        tracker = PrefectProgress("run", 100, flow_run_id=str(uuid.uuid4()), every_s=0.0, retry_after_s=0.0)
        start = time.monotonic()
        tracker.segment_started([0, 1], 0)
        for i in range(1, 21):
            tracker.on_iteration(i, 1.0 / i, time.time())
        tracker.segment_finished(_stopped([0, 1], 20))  # a resize: the Rescaling state is handed over
        tracker.segment_started([0], 20)
        for i in range(21, 41):
            tracker.on_iteration(i, 1.0 / i, time.time())
        supervised = time.monotonic() - start
        tracker.finished("completed")
        tracker.close(timeout_s=1.0)  # the artifact is in flight, the Rescaling state waits: dropped
        closed = time.monotonic() - start
    assert supervised < 2.0  # each call takes 3 s to time out: none was waited for here
    assert closed < 1.0 + 2.0  # nor at the end for more than the bound (a state in flight: one request more)
    assert tracker.snapshot().iteration == 40


def test_progress_never_fails_training_without_an_api(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        tracker = PrefectProgress("run", 10, flow_run_id=str(uuid.uuid4()), retry_after_s=3600)
        tracker.segment_started([0, 1], 0)  # refused connection: warns, does not raise
        assert tracker.flush(30.0)
        assert not tracker.enabled
        for i in range(1, 11):
            tracker.on_iteration(i, 1.0 / i, time.time())
        tracker.finished("completed")
        tracker.close()
    assert tracker.snapshot().iteration == 10


def test_closing_an_idle_outbox_ends_its_thread_and_events_are_capped() -> None:
    outbox = Outbox("test")
    outbox.close(1.0, after=lambda key: False)
    outbox._thread.join(2.0)  # noqa: SLF001 - the thread is what this checks
    assert not outbox._thread.is_alive()  # noqa: SLF001

    gate, holding, made = threading.Event(), threading.Event(), []
    outbox = Outbox("test")
    outbox.put(lambda: holding.set() or gate.wait())
    assert holding.wait(5.0)  # the thread is in that call: the rest wait
    for i in range(Outbox.MAX_WAITING + 10):
        outbox.put(lambda i=i: made.append(i))
    gate.set()
    assert outbox.flush(10.0)
    assert len(made) == Outbox.MAX_WAITING and made[0] == 10  # the oldest went


def test_routine_progress_and_segment_changes_stay_out_of_the_runs_log(
        caplog: pytest.LogCaptureFixture) -> None:
    """Issue 46: 97 of a 150-iteration run's 130 log lines were `training
    progress`, burying the decision and the resizes; routine progress is the
    artifact's, the labels' and the status file's, and a change of GPUs is
    the worker's to tell, with why (a resized run's story fits 15 lines)."""
    import logging

    from flows.training.coordinator.progress import ProgressTracker

    tracker = ProgressTracker("run-1", 100, min_interval_s=0.0)
    with caplog.at_level(logging.INFO, logger="elasticflow.progress"):
        tracker.segment_started([0, 1], 0)
        for i in range(1, 50):
            tracker.on_iteration(i, 1.0, time.time())
        tracker.segment_finished(SegmentResult(reason="stopped", start_iteration=0, end_iteration=49, gpus=[0, 1]))
        tracker.saves_changed("the checkpoint store is full")  # what a person acts on: said
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len(said) == 1 and said[0].startswith("the checkpoint store is full"), said
