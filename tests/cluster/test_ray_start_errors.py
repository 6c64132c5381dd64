"""Whatever Ray says when ranks cannot start is a crash the run restarts
from, never the run's failure. A chaos run on Ray (raylet and server kills)
once failed an admitted run at iteration 0: the Ray transport caught a
named few of Ray's errors at a start, and any other (a node dead, a worker
crashed, a runtime environment not set up on a node going away) ended the
flow. No cluster needed: Ray's answers are what is replaced here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flows.training.control import GpuSlot
from flows.training.datasets import DatasetSpec
from flows.training.params import Hyperparameters
from flows.training.segment import SegmentSpec


SLOTS = [GpuSlot(node="n1", name="node-1", ip="127.0.0.1", index=i) for i in range(2)]  # two ranks on one node


def _spec(tmp_path: Path) -> SegmentSpec:
    return SegmentSpec(run_key="start-errors", model="mlp", dataset=DatasetSpec(name="synthetic-vectors"),
                       hyperparameters=Hyperparameters(global_batch_size=8), total_iterations=10, stop_at=10,
                       checkpoint_interval=5, checkpoint_url=str(tmp_path / "ck"))


class _Method:
    def remote(self, *args: Any) -> str:
        return "a reference"


class _Actor:
    where = free_port = _Method()


class _Pool:
    """Hands out actors; after `fails_after` of them, fails as Ray does when
    it cannot even be asked."""

    def __init__(self, error: Exception | None = None, fails_after: int = 0) -> None:
        self.error, self.fails_after = error, fails_after
        self.made: list[_Actor] = []

    def take(self, slot: GpuSlot) -> Any:
        if self.error is not None and len(self.made) >= self.fails_after:
            raise self.error
        self.made.append(_Actor())
        return self.made[-1]


def _errors() -> list[Any]:
    import ray.exceptions as e

    return [
        pytest.param(e.NodeDiedError("the node died"), True, id="node-died"),
        pytest.param(e.RuntimeEnvSetupError("the runtime env agent went away"), True, id="runtime-env"),
        pytest.param(e.WorkerCrashedError(), True, id="worker-crashed"),
        pytest.param(e.ActorUnschedulableError("its node was given up"), True, id="unschedulable"),
        pytest.param(e.GetTimeoutError("no answer"), False, id="silent"),
    ]


@pytest.mark.parametrize(("error", "died"), _errors())
def test_any_error_of_rays_at_a_start_is_a_crash_to_restart_from(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception, died: bool) -> None:
    from flows.training.coordinator import ray_ranks
    from flows.training.coordinator.segment_machine import Segment

    def ray_says(*args: Any, **kwargs: Any) -> Any:
        raise error

    monkeypatch.setattr(ray_ranks.ray, "get", ray_says)
    monkeypatch.setattr(ray_ranks.ray, "kill", lambda actor, **kwargs: None)  # the ranks here are stand-ins
    segment = Segment(_spec(tmp_path), [0, 1], ray_ranks.RayActors(_Pool()), SLOTS)  # type: ignore[arg-type]
    segment.start()  # raised `error` before: the flow failed with it
    assert segment.start_error is not None and type(error).__name__ in segment.start_error
    assert segment.died is died  # dead ranks: the run waits for Ray's word on their nodes
    result = segment.wait()
    assert result.reason == "crashed"


def test_ranks_ray_cannot_even_create_are_a_crash_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.exceptions

    from flows.training.coordinator import ray_ranks
    from flows.training.coordinator.segment_machine import Segment

    killed: list[Any] = []
    monkeypatch.setattr(ray_ranks.ray, "kill", lambda actor, **kwargs: killed.append(actor))
    pool = _Pool(ray.exceptions.RaySystemError("the GCS cannot be reached"), fails_after=1)
    segment = Segment(_spec(tmp_path), [0, 1], ray_ranks.RayActors(pool), SLOTS)  # type: ignore[arg-type]
    segment.start()
    assert segment.start_error is not None and "RaySystemError" in segment.start_error
    assert killed == pool.made  # the one made before Ray failed is not left behind
    assert segment.wait().reason == "crashed"
