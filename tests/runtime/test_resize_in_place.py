"""Resizes on local ranks beyond what both transports share (test_in_place.py):
a restart when asked, a stop while paused, parks and resizes the scheduler
asks for before a segment's task has ended, and NCCL on CUDA."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from elasticflow_block import CheckpointStorage
from flows.training.params import TrainParameters
from flows.training.coordinator.runtime import run_training
from flows.training.supervision import RunningSegment
from tests.runtime.conftest import N, assert_same_trajectory, process_alive, progress_iterations

pytestmark = pytest.mark.slow


def _run(params: TrainParameters, key: str) -> tuple[Any, list[RunningSegment], list[list[int]]]:
    """The result, every segment handed to the hook, and the rank pids each time."""
    seen: list[RunningSegment] = []
    pids: list[list[int]] = []

    def hook(segment: RunningSegment) -> None:
        seen.append(segment)
        pids.append(list(segment.pids))

    return run_training(params, key, segment_hook=hook), seen, pids


def test_checkpoint_restarts_when_asked_and_the_losses_agree(
    make_params: Callable[..., TrainParameters], reference: Any
) -> None:
    params = make_params(gpu_plan=[[0, 1], [0]], switch_at=[80], iterations=N, resize_in_place=False)
    result, seen, _ = _run(params, "restart")
    assert len(seen) == 2 and seen[0] is not seen[1]
    assert [r.how for r in result.rescales] == ["restart"]
    assert_same_trajectory(result.losses, reference())


def test_a_stop_while_paused_saves_where_the_ranks_stand(
    make_params: Callable[..., TrainParameters], reference: Any, tmp_path: Path
) -> None:
    """Parked at a resize (none of its GPUs stay): the paused ranks save and
    exit before the run goes on elsewhere from that checkpoint."""
    params = make_params(gpu_plan=[[0], [1]], switch_at=[70], iterations=N, checkpoint_interval=1000,
                         resize_in_place=True)
    result, seen, pids = _run(params, "moved")
    assert len(seen) == 2 and seen[0] is not seen[1]
    assert [r.how for r in result.rescales] == ["restart"]
    assert result.segments[0].checkpoint_iteration == 70 and result.segments[1].start_iteration == 70
    assert not process_alive(pids[0][0])
    assert progress_iterations(seen[1].transport.dir)[0] == 71  # type: ignore[attr-defined]
    assert_same_trajectory(result.losses, reference())


@pytest.mark.parametrize("in_place", [True, False])
def test_a_park_frees_the_gpus_before_the_segments_task_has_ended(
    make_params: Callable[..., TrainParameters], reference: Any, in_place: bool
) -> None:
    """The segment's task ends through Prefect, which once took 33 s behind a
    slow server while the run placed on the parked run's GPUs waited: by the
    time the task returns, the ranks have saved and gone and the park is
    acknowledged, whether the ranks paused for a resize in place or not."""
    import threading

    from flows.training.control import FileControlChannel
    from tests.runtime.conftest import when_iteration_reaches

    params = make_params(gpu_plan=[[0, 1]], iterations=N, checkpoint_interval=1000, resize_in_place=in_place)
    channel = FileControlChannel("parked", params.control_dir)
    seen: list[RunningSegment] = []
    at_task_end: list[tuple[Any, bool, list[int]]] = []  # the ack, any rank alive, the checkpoints

    def hook(segment: RunningSegment) -> None:
        seen.append(segment)
        if len(seen) == 1:
            when_iteration_reaches(segment, 20, lambda: channel.request("rescale", []))

    def task(go: Callable[[], Any], name: str) -> Any:
        result = go()
        if len(at_task_end) == 0:  # the first segment's task, before Prefect would hear that it ended
            at_task_end.append((channel.acknowledged(), any(process_alive(p) for p in seen[0].pids),
                                CheckpointStorage(params.checkpoint_store).iterations("parked")))
            threading.Timer(0.5, lambda: channel.request("rescale", [0, 1])).start()
        return result

    result = run_training(params, "parked", wrap_segment=task, segment_hook=hook, park_poll_s=0.05)
    assert result.status == "completed"
    ((ack, alive, saved),) = at_task_end
    stopped_at = result.segments[0].end_iteration
    assert ack is not None and ack.gpus == [] and ack.seq == 1 and not alive
    assert saved == [stopped_at] and result.segments[1].start_iteration == stopped_at
    assert_same_trajectory(result.losses, reference())


@pytest.mark.parametrize("to", [[0], [0, 1, 2, 3]])
def test_a_resize_the_scheduler_asks_for_is_made_in_place_before_the_segments_task_has_ended(
    make_params: Callable[..., TrainParameters], reference: Any, to: list[int]
) -> None:
    """A shrink or a grow that keeps GPUs: the ranks regroup right after the
    pause, inside the task of the segment they paused in, so the leavers'
    GPUs are free (and the command acknowledged) before Prefect hears that
    task end, and the run trains on meanwhile."""
    from flows.training.control import FileControlChannel
    from tests.runtime.conftest import when_iteration_reaches

    params = make_params(gpu_plan=[[0, 1]], iterations=N, checkpoint_interval=1000, resize_in_place=True)
    channel = FileControlChannel("steered", params.control_dir)
    seen: list[RunningSegment] = []
    before: list[int] = []
    at_task_end: list[tuple[Any, list[int], list[int]]] = []  # the ack, the ranks' pids then, those alive

    def hook(segment: RunningSegment) -> None:
        seen.append(segment)
        if len(seen) == 1:
            before.extend(segment.pids)
            when_iteration_reaches(segment, 20, lambda: channel.request("rescale", to))

    def task(go: Callable[[], Any], name: str) -> Any:
        result = go()
        if not at_task_end:
            pids = list(seen[0].pids)
            at_task_end.append((channel.acknowledged(), pids, [p for p in {*before, *pids} if process_alive(p)]))
        return result

    result = run_training(params, "steered", wrap_segment=task, segment_hook=hook)
    assert result.status == "completed" and result.restarts == 0
    ((ack, pids, alive),) = at_task_end
    assert ack is not None and ack.seq == 1 and ack.gpus == to
    assert len(pids) == len(to) and before[0] in pids and sorted(alive) == sorted(pids)  # leaver gone, joiners in
    assert len(seen) == 2 and seen[1] is seen[0] and [r.how for r in result.rescales] == ["in_place"]
    assert CheckpointStorage(params.checkpoint_store).iterations("steered") == [N]
    assert_same_trajectory(result.losses, reference())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL: one rank per GPU); this "
                    "machine has none: the NCCL path is then unchecked here (bench/rescale.py --device cuda)")
def test_on_cuda_survivors_keep_their_context_and_nccl_is_formed_again(
    make_params: Callable[..., TrainParameters], reference: Any
) -> None:
    params = make_params(gpu_plan=[[0], [0, 1], [1]], switch_at=[80, 160], iterations=N, device="cuda",
                         checkpoint_interval=1000, resize_in_place=True)
    result, seen, _ = _run(params, "cuda")
    assert result.status == "completed" and all(s is seen[0] for s in seen)
    assert [r.how for r in result.rescales] == ["in_place", "in_place"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(result.losses, reference()))
    assert worst <= 1e-3, f"CUDA against the CPU reference: {worst:.2e}"
