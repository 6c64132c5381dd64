"""Real DDP (gloo, separate processes) resized, steered, signalled and killed.

The reference is the same job on one worker slot, never resized: every other
run must reproduce its loss at every iteration (up to float reduction order).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable

import pytest

from elasticflow_block import CheckpointStorage
from flows.training.control import FileControlChannel
from flows.training.params import TrainParameters
from flows.training.coordinator.runtime import run_training
from flows.training.supervision import RunningSegment
from tests.runtime.conftest import N, assert_same_trajectory, progress_iterations, process_alive, when_iteration_reaches

pytestmark = pytest.mark.slow

def test_resized_2_4_1_follows_the_never_resized_trajectory(
    make_params: Callable[..., TrainParameters], reference: Any
) -> None:
    params = make_params(gpu_plan=[[0, 1], [0, 1, 2, 3], [0]], switch_at=[80, 160], iterations=N)
    result = run_training(params, "resized")
    assert result.status == "completed" and result.iterations == N
    assert [(s.gpus, s.start_iteration, s.end_iteration) for s in result.segments] == [
        ([0, 1], 0, 80),
        ([0, 1, 2, 3], 80, 160),
        ([0], 160, N),
    ]
    assert [(r.from_gpus, r.to_gpus, r.iteration) for r in result.rescales] == [
        ([0, 1], [0, 1, 2, 3], 80),
        ([0, 1, 2, 3], [0], 160),
    ]
    assert all(r.seconds is not None and r.seconds > 0 for r in result.rescales)
    assert_same_trajectory(result.losses, reference())
    assert result.losses[-1] < result.losses[0]


def test_control_channel_parks_then_moves_a_running_job(
    make_params: Callable[..., TrainParameters], reference: Any
) -> None:
    params = make_params(gpu_plan=[[0]], iterations=N, checkpoint_interval=50)
    channel = FileControlChannel("steered", params.control_dir)
    hooks: list[RunningSegment] = []
    alive_while_parked: list[bool] = []

    def resume_when_parked() -> None:
        try:
            deadline = time.time() + 60
            while time.time() < deadline:
                ack = channel.acknowledged()
                if ack and ack.gpus == []:
                    time.sleep(0.5)  # parked for a while: no workers may be held
                    alive_while_parked.append(any(process_alive(pid) for pid in hooks[0].pids))
                    return
                time.sleep(0.01)
        finally:
            channel.request("rescale", [0, 1])  # always, so a failure here cannot hang the run

    def on_segment(segment: RunningSegment) -> None:
        hooks.append(segment)
        if len(hooks) == 1:
            when_iteration_reaches(segment, 20, lambda: channel.request("rescale", []))
            threading.Thread(target=resume_when_parked, daemon=True).start()

    result = run_training(params, "steered", segment_hook=on_segment, park_poll_s=0.05)
    assert result.status == "completed"
    assert alive_while_parked == [False]
    first, second = result.segments
    assert first.reason == "stopped" and first.gpus == [0] and 20 <= first.end_iteration < N
    assert second.gpus == [0, 1] and second.start_iteration == first.end_iteration
    assert first.checkpoint_iteration == first.end_iteration  # saved where it stopped, not at the interval
    assert channel.acknowledged().seq == 2 and channel.acknowledged().gpus == [0, 1]
    assert result.rescales[0].cause == "control"
    assert result.rescales[0].seconds is None  # time parked is not rescale cost
    status = channel.status()
    assert status is not None and status.iteration == N and status.event == "completed"
    assert_same_trajectory(result.losses, reference())


def test_stop_command_checkpoints_and_ends_the_run(make_params: Callable[..., TrainParameters], reference: Any) -> None:
    params = make_params(iterations=N, checkpoint_interval=1000)
    channel = FileControlChannel("stopped", params.control_dir)

    def on_segment(segment: RunningSegment) -> None:
        when_iteration_reaches(segment, 10, lambda: channel.request("stop"))

    result = run_training(params, "stopped", segment_hook=on_segment)
    assert result.status == "stopped" and 10 <= result.iterations < N
    storage = CheckpointStorage(params.checkpoint_store)
    assert storage.iterations("stopped")[-1] == result.iterations
    assert_same_trajectory(result.losses, reference()[: result.iterations])


def test_a_run_resumed_at_its_last_iteration_reports_it_and_trains_nothing(
    make_params: Callable[..., TrainParameters],
) -> None:
    """A stop of the stack caught a run that had trained its last iteration
    but not yet exited; resumed, it said "completed" at iteration 0, and the
    worker recorded it stopped after 0 iterations while Prefect said Completed."""
    params = make_params(iterations=8, checkpoint_interval=4)
    assert run_training(params, "again").iterations == 8
    channel = FileControlChannel("again", params.control_dir)
    result = run_training(params, "again")
    assert (result.status, result.iterations) == ("completed", 8)
    status = channel.status()
    assert status is not None and (status.iteration, status.total_iterations) == (8, 8)


def test_sigterm_to_the_flow_process_checkpoints_then_defers_to_the_old_handler(
    make_params: Callable[..., TrainParameters], reference: Any
) -> None:
    params = make_params(iterations=N, checkpoint_interval=1000)
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:

        def on_segment(segment: RunningSegment) -> None:
            when_iteration_reaches(segment, 10, lambda: os.kill(os.getpid(), signal.SIGTERM))

        result = run_training(params, "preempted", segment_hook=on_segment)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert result.status == "preempted" and result.segments[0].reason == "terminated"
    assert received == [signal.SIGTERM]  # Prefect's handler (here: ours) still runs, after the checkpoint
    assert CheckpointStorage(params.checkpoint_store).iterations("preempted")[-1] == result.iterations
    resumed = run_training(params, "preempted")  # the rescheduled run picks up where it stopped
    assert resumed.status == "completed" and resumed.segments[0].start_iteration == result.iterations
    assert_same_trajectory(resumed.losses, reference())


def test_under_prefects_sigterm_bridge_the_workers_checkpoint_and_the_bridge_stays_in_charge(
    make_params: Callable[..., TrainParameters], reference: Any
) -> None:
    """Prefect acknowledges a cancellation only while its own SIGTERM handler is
    installed; so under the engine the runtime leaves it there, and Prefect's
    TerminationSignal stops the segment the same way: workers checkpoint first."""
    from prefect.exceptions import TerminationSignal
    from prefect.utilities.engine import _prefect_sigterm_handler, capture_sigterm

    params = make_params(iterations=N, checkpoint_interval=1000)
    handlers: list[object] = []

    def on_segment(segment: RunningSegment) -> None:
        handlers.append(signal.getsignal(signal.SIGTERM))
        when_iteration_reaches(segment, 10, lambda: os.kill(os.getpid(), signal.SIGTERM))

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # what capture_sigterm re-sends to
    try:
        with pytest.raises(TerminationSignal), capture_sigterm():
            run_training(params, "cancelled", segment_hook=on_segment)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert handlers == [_prefect_sigterm_handler]
    done = CheckpointStorage(params.checkpoint_store).iterations("cancelled")
    assert done and 10 <= done[-1] < N  # stopped at a boundary after iteration 10, with a checkpoint there
    resumed = run_training(params, "cancelled")
    assert resumed.status == "completed" and resumed.segments[0].start_iteration == done[-1]
    assert_same_trajectory(resumed.losses, reference())


def test_kill_9_of_a_worker_resumes_from_the_last_checkpoint(
    make_params: Callable[..., TrainParameters], reference: Any
) -> None:
    interval = 10
    params = make_params(gpu_plan=[[0, 1]], iterations=N, checkpoint_interval=interval)
    segments: list[Any] = []  # local segments: their folders are read below

    def on_segment(segment: RunningSegment) -> None:
        segments.append(segment)
        if len(segments) == 1:
            when_iteration_reaches(segment, 25, lambda: os.kill(segment.pids[1], signal.SIGKILL))

    result = run_training(params, "killed", segment_hook=on_segment)
    assert result.status == "completed" and result.restarts == 1
    assert [s.reason for s in result.segments] == ["crashed", "completed"]
    assert result.segments[0].error.startswith("worker rank 1 exited with -9")  # the cause, not the casualties
    done_before = progress_iterations(segments[0].transport.dir)
    done_after = progress_iterations(segments[1].transport.dir)
    resumed_from = result.segments[1].start_iteration
    assert resumed_from % interval == 0 and resumed_from <= done_before[-1]
    repeated = done_before[-1] - resumed_from
    assert 0 <= repeated <= interval, f"{repeated} iterations redone"
    assert done_after == list(range(resumed_from + 1, N + 1))  # nothing lost, nothing skipped
    assert_same_trajectory(result.losses, reference())


def test_repeated_crashes_give_up_with_the_error(make_params: Callable[..., TrainParameters]) -> None:
    params = make_params(model="tests.runtime.user_models:fails_later", dataset="synthetic-vectors", max_restarts=0)
    with pytest.raises(RuntimeError, match=r"(?s)crashed 1 times.*failed after training had begun"):
        run_training(params, "flaky")


def test_a_failure_before_the_first_iteration_is_not_retried(make_params: Callable[..., TrainParameters]) -> None:
    """A model that cannot be built (a bad setting) fails the same way in every
    launch: one launch, not four, and the error says why it was not retried."""
    params = make_params(model="tests.runtime.user_models:broken", dataset="synthetic-vectors", max_restarts=3)
    started = []
    with pytest.raises(RuntimeError, match=r"(?s)before its first iteration, not retried.*cannot be built"):
        run_training(params, "broken", segment_hook=started.append)
    assert len(started) == 1
