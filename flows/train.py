"""The `train` Prefect flow: elastic DDP training on the GPU set it is given.

Deploy with entrypoint `flows/train.py:train`. Parameters are validated by
`TrainParameters` before anything starts; each training segment is a Prefect
task; progress shows as an artifact, labels and `elasticflow.training.*` events.
The scheduler steers a running flow through the file control channel (see
docs/training.md), never through database credentials.
"""

from __future__ import annotations

import os
import uuid
from datetime import datetime
from typing import Any, Callable

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows.training.control import FileControlChannel
from flows.training.launch import LaunchSpec
from flows.training.params import TrainParameters
from flows.training.prefect_progress import PrefectProgress
from flows.training.runtime import TrainResult, run_training
from flows.training.segment import SegmentResult


class SegmentCrashed(RuntimeError):
    """A segment whose ranks failed: its task ends Failed with the cause, and
    the run goes on from its last checkpoint (or ends, runtime.py says when)."""

    def __init__(self, result: SegmentResult) -> None:
        super().__init__(result.error or "the segment crashed")
        self.result = result


@task(name="train-segment", cache_policy=NO_CACHE, persist_result=False)
def train_segment(launch: Callable[[], SegmentResult]) -> SegmentResult:
    """One launch of the DDP workers; restores from, and ends with, a checkpoint."""
    result = launch()
    if result.reason in ("crashed", "save_failed"):  # Failed on the run's page, not Completed with a crash inside
        raise SegmentCrashed(result)
    return result


def _as_task(launch: Callable[[], SegmentResult], name: str) -> SegmentResult:
    try:
        return train_segment.with_options(task_run_name=name)(launch)
    except SegmentCrashed as crashed:
        return crashed.result


def _forward_runtime_logs() -> None:
    """The runtime's own loggers (`elasticflow.*`: crashes, resizes, control
    commands) reach the run's Prefect logs, as its `get_run_logger` lines do:
    without this they went nowhere a user looks."""
    import logging

    from prefect.logging.handlers import APILogHandler

    runtime = logging.getLogger("elasticflow")
    if not any(isinstance(h, APILogHandler) for h in runtime.handlers):
        runtime.addHandler(APILogHandler())
    runtime.setLevel(min(runtime.getEffectiveLevel(), logging.INFO))


@flow(name="train", persist_result=False, log_prints=True)
def train(
    model: str = "resnet",
    dataset: str | dict[str, Any] | None = None,
    hyperparameters: dict[str, Any] | None = None,
    iterations: int | None = None,
    epochs: float | None = None,
    deadline: str | datetime | None = None,
    best_effort: bool = False,
    checkpoint_interval: int = 50,
    keep_checkpoints: int = 3,
    checkpoint_store: str | None = None,
    device: str = "auto",
    model_kwargs: dict[str, Any] | None = None,
    max_restarts: int = 3,
    loss: str | None = None,
    collate: str | None = None,
    evaluate: str | None = None,
) -> TrainResult:
    """Train `model` on `dataset` with a fixed global batch on whatever GPUs it is given.

    `loss` ('cross_entropy', 'model' or 'pkg.module:function'), `collate`
    and `evaluate` complete a user's task (docs/user-guide.md).

    The GPUs are the scheduler's to choose, never a parameter: it launches the
    run with a `LaunchSpec` (the deadline it admitted, or a fixed GPU plan when
    driven without a scheduler) and steers it through the control channel."""
    logger = get_run_logger()
    _forward_runtime_logs()
    launch = LaunchSpec.from_env()
    params = TrainParameters.model_validate(
        {
            k: v
            for k, v in dict(
                model=model,
                dataset=dataset,
                hyperparameters=hyperparameters,
                iterations=iterations,
                epochs=epochs,
                deadline=deadline,
                best_effort=best_effort,
                checkpoint_interval=checkpoint_interval,
                keep_checkpoints=keep_checkpoints,
                checkpoint_store=checkpoint_store,
                device=device,
                model_kwargs=model_kwargs,
                max_restarts=max_restarts,
                loss=loss,
                collate=collate,
                evaluate=evaluate,
            ).items()
            if v is not None
        } | launch.parameters(),
        context={"admitted": launch.admitted},
    )
    run_key = str(flow_run.id or uuid.uuid4())

    def tracker(total: int, channel: FileControlChannel) -> PrefectProgress:
        logger.info(
            "training %s for %d iterations; run key %s; control channel %s",
            params.model,
            total,
            run_key,
            channel.folder,
        )
        return PrefectProgress(run_key, total, params.deadline, channel, flow_run_id=run_key)

    result = run_training(params, run_key, wrap_segment=_as_task, tracker_factory=tracker)
    logger.info(
        "training %s after %d/%d iterations, %d rescales, %d restarts",
        result.status,
        result.iterations,
        result.total_iterations,
        len(result.rescales),
        result.restarts,
    )
    return result


if __name__ == "__main__":
    os.environ.update(LaunchSpec(gpu_plan=[[0, 1], [0, 1, 2, 3], [0]], switch_at=[15, 30]).to_env())
    train(model="mlp", iterations=40, checkpoint_interval=5)
