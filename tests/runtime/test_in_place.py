"""Resizes in place (issue 26) on both transports, one set of tests: ranks as
processes on this machine, and as Ray actors on the 2-node loopback cluster
(tests/ray_cluster.py), where a grow lands newcomers on the other node. The
ranks on GPUs that stay keep their process and state, those that join get it
from them, those that leave are gone, and the losses are the never-resized
run's at every iteration; a rank lost while they regroup sends the run back
to its last checkpoint, and a termination racing a regroup leaves no process.
Both transports drive the one `segment_machine.Segment`."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any, Callable

import pytest

from elasticflow_block import CheckpointStorage
from flows.training.coordinator.runtime import run_training
from flows.training.params import TrainParameters
from flows.training.supervision import RunningSegment
from tests.runtime.conftest import assert_same_trajectory, process_alive, small_mlp

pytestmark = pytest.mark.slow

ITERATIONS = 60


@pytest.fixture(params=["processes", pytest.param("ray", marks=[pytest.mark.xdist_group("ray")])])
def make_params(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., TrainParameters]:
    """The small MLP run, on local processes or on the Ray cluster."""
    on_ray = {"ray_address": request.getfixturevalue("ray_address")} if request.param == "ray" else {}
    return lambda **overrides: small_mlp(tmp_path, **{**on_ray, "resize_in_place": True, **overrides})


def _run(params: TrainParameters, key: str, hook: Callable[[RunningSegment], None] | None = None
         ) -> tuple[Any, list[RunningSegment], list[list[int]]]:
    """The result, every segment handed to the hook, and the rank pids each time."""
    seen: list[RunningSegment] = []
    pids: list[list[int]] = []

    def record(segment: RunningSegment) -> None:
        seen.append(segment)
        pids.append(list(segment.pids))
        if hook:
            hook(segment)

    return run_training(params, key, segment_hook=record), seen, pids


@pytest.mark.parametrize("plan, kept", [
    ([[0, 1], [0, 1, 2, 3], [2]], [[0, 1], [2]]),  # grow (onto the other node, on Ray), shrink to a newcomer
    ([[0, 1], [1, 2]], [[1]]),  # move: GPU 1 stays, 0 leaves, 2 joins
])
def test_ranks_that_stay_keep_their_process_and_the_losses_are_the_never_resized_ones(
    make_params: Callable[..., TrainParameters], reference: Any, plan: list[list[int]], kept: list[list[int]]
) -> None:
    switch_at = [20, 40][: len(plan) - 1]
    params = make_params(gpu_plan=plan, switch_at=switch_at, iterations=ITERATIONS, checkpoint_interval=1000)
    result, seen, pids = _run(params, "in-place")
    assert result.status == "completed" and result.restarts == 0
    assert len(seen) == len(plan) and all(s is seen[0] for s in seen)  # one segment, resized
    assert [sorted(s.gpus) for s in result.segments] == [sorted(p) for p in plan]
    assert [r.how for r in result.rescales] == ["in_place"] * (len(plan) - 1)
    assert all(r.seconds is not None and r.seconds > 0 for r in result.rescales)
    for before, after, gpus, stay in zip(pids, pids[1:], plan, kept):
        assert {before[gpus.index(g)] for g in stay} <= set(after)  # the same processes, state in memory
    assert not [p for ps in pids for p in ps if process_alive(p)]  # leavers at their resize, the rest at the end
    assert CheckpointStorage(params.checkpoint_store).iterations("in-place") == [ITERATIONS]  # no resize saved
    assert_same_trajectory(result.losses, reference(ITERATIONS))


def test_a_newcomer_killed_while_it_joins_sends_the_run_back_to_its_checkpoint(
    make_params: Callable[..., TrainParameters], reference: Any
) -> None:
    params = make_params(gpu_plan=[[0, 1], [0, 1, 2]], switch_at=[25], iterations=ITERATIONS, checkpoint_interval=10)
    killed: list[int] = []

    def kill_newcomer(segment: RunningSegment) -> None:
        if len(segment.gpus) == 3 and not killed:  # just regrouped: the newcomer is joining
            killed.append(segment.pids[-1])
            os.kill(segment.pids[-1], signal.SIGKILL)

    result, _, pids = _run(params, "lost", kill_newcomer)
    assert killed and result.status == "completed" and result.restarts == 1
    assert [s.reason for s in result.segments] == ["target", "crashed", "target", "completed"]
    resumed = result.segments[2]
    assert resumed.start_iteration == 20 and not resumed.in_place  # the newest checkpoint before the resize
    assert not [p for ps in pids for p in ps if process_alive(p)]
    assert_same_trajectory(result.losses, reference(ITERATIONS))


def test_a_termination_racing_a_resize_in_place_leaves_no_process(
    make_params: Callable[..., TrainParameters]
) -> None:
    """SIGTERM on the flow process (a cancellation) just as the ranks regroup:
    survivors, newcomers and leavers are all gone when the run returns."""
    params = make_params(gpu_plan=[[0, 1], [0, 2, 3]], switch_at=[20], iterations=100_000, checkpoint_interval=10)
    received: list[int] = []

    def terminate(segment: RunningSegment) -> None:
        if len(segment.gpus) == 3 and not received:
            os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        result, _, pids = _run(params, "raced", terminate)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert received == [signal.SIGTERM]
    assert result.status == "preempted" and result.iterations < 100_000
    everyone = {p for ps in pids for p in ps}
    assert len(everyone) == 4 and not [p for p in everyone if process_alive(p)]
    assert CheckpointStorage(params.checkpoint_store).iterations("raced")
