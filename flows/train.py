"""The `train` Prefect flow: elastic DDP training on the GPU set it is given.

Deployed with entrypoint `flows.train.train` (a module path: no pull step).
Parameters are validated by `TrainParameters` before anything starts; each
training segment is a Prefect task; progress shows as an artifact, labels and
`elasticflow.training.*` events.
The scheduler steers a running flow through the file control channel (see
docs/training.md), never through database credentials.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from datetime import datetime
from typing import Any, Callable

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import Pause, TerminationSignal
from prefect.runtime import flow_run

from flows.training.control import FileControlChannel, default_control_root
from flows.training.coordinator.runtime import TrainResult, run_training
from flows.training.launch.pause import stack_stopping
from flows.training.launch.spec import LaunchSpec
from flows.training.params import TrainParameters
from flows.training.reporting.prefect_progress import PrefectProgress
from flows.training.segment import SegmentResult
from scheduler_service.contracts import StateName

log = logging.getLogger("elasticflow.train")
PAUSE_TELL_S = 20.0  # how long a pausing run tries to tell Prefect (a server restarting under a stop)


class SegmentCrashed(RuntimeError):
    """A segment whose ranks failed: its task ends Failed with the cause, and
    the run goes on from its last checkpoint (or ends, runtime.py says when)."""

    def __init__(self, result: SegmentResult) -> None:
        super().__init__(result.error or "the segment crashed")
        self.result = result


# How a segment that did not crash ended, as its task's state says it.
_ENDED_BECAUSE = {"completed": "the run's last iteration", "target": "its GPUs change",
                  "stopped": "told to stop", "terminated": "the run was stopped"}


@task(name="train-segment", cache_policy=NO_CACHE, persist_result=False)
def train_segment(launch: Callable[[], SegmentResult]) -> Any:
    """One launch of the DDP workers; restores from, and ends with, a checkpoint.

    It ends in a state named `Segment ended`, saying which iterations it
    trained and why it ended: Prefect logs a task's end as "Finished in state
    ...", and a plain Completed() in the middle of a run read as the run
    finishing (issue 46)."""
    from prefect.states import Completed

    result = launch()
    if result.reason in ("crashed", "save_failed"):  # Failed on the run's page, not Completed with a crash inside
        raise SegmentCrashed(result)
    gpus = ",".join(map(str, result.gpus))
    return Completed(name="Segment ended", data=result, message=(
        f"iterations {result.start_iteration}-{result.end_iteration} on GPUs {gpus}: "
        f"{_ENDED_BECAUSE.get(result.reason, result.reason)}"))


def _as_task(launch: Callable[[], SegmentResult], name: str) -> SegmentResult:
    """The segment as a Prefect task; without one while Prefect cannot be
    reached. Prefect is a window onto training: a server that is down (killed,
    restarting) when a segment starts or ends must not end the run (issue 43:
    an admitted run crashed on an HTTP error while its server restarted)."""
    ran: list[SegmentResult] = []
    started = False

    def once() -> SegmentResult:
        nonlocal started
        started = True
        ran.append(launch())
        return ran[-1]

    try:
        train_segment.with_options(task_run_name=name)(once)  # its state, named for the page: the result is ran's
        return ran[-1]
    except SegmentCrashed as crashed:
        return crashed.result
    except Exception as exc:
        if started and not ran:  # the launch itself failed: not Prefect's bookkeeping
            raise
        if ran:  # Prefect's calls after the segment (its task run's end): the segment is done all the same
            log.warning("Prefect could not be told how segment %s ended (%s); training goes on", name, exc)
            return ran[-1]
        # Prefect's calls before it (an HTTP error, "Failed to reach API"): nothing of the run ran yet
        log.warning("Prefect cannot be reached (%s): segment %s runs without a task run", exc, name)
        return once()


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
        logger.debug(  # the worker's lines tell a person what runs where; this is the operator's
            "training %s for %d iterations; run key %s; control channel %s",
            params.model,
            total,
            run_key,
            channel.folder,
        )
        return PrefectProgress(run_key, total, params.deadline, channel, flow_run_id=run_key)

    try:
        result = run_training(params, run_key, wrap_segment=_as_task, tracker_factory=tracker)
    except TerminationSignal:
        pause = _paused(run_key, params.control_dir) if stack_stopping() else None
        if pause is None:
            raise  # a cancellation, an operator's kill: as Prefect's engine says
        raise pause from None
    except Exception as exc:
        # Training that fails while the stack stops under it (`up --ray local:...` tears its Ray
        # cluster down, and a run that joins it then cannot) failed because of the stop, not of
        # itself: it pauses too. A run that fails for its own reasons fails again once resumed.
        pause = _paused(run_key, params.control_dir) if stack_stopping() else None
        if pause is None:
            raise
        log.warning("flow run %s failed while the stack stopped (%s: %s): paused", run_key, type(exc).__name__, exc)
        raise pause from None
    logger.info(
        "training %s after %d/%d iterations, %d rescales, %d restarts",
        result.status,
        result.iterations,
        result.total_iterations,
        len(result.rescales),
        result.restarts,
    )
    return result


def _paused(run_key: str, control_dir: str | None) -> Pause | None:
    """The stack stopped under this run, and its ranks have checkpointed:
    the run goes back to the queue in the same flow run (Scheduled,
    `Resuming`, a state the next worker's recovery picks up) rather than
    end Crashed. A run that is being cancelled stays cancelled. If Prefect
    cannot be told in time, the run stays Running and the next worker, which
    finds its process gone, resumes it the same way (recovery.py)."""
    from prefect.states import Scheduled

    from elasticflow_block.prefect_client import sync_client

    channel = FileControlChannel(run_key, control_dir or default_control_root())
    status = channel.status()
    reached = status.iteration if status is not None else 0
    message = (f"paused at iteration {reached}: the service stopped; it goes on from its last checkpoint "
               f"when the service is back")
    give_up = time.monotonic() + PAUSE_TELL_S
    while True:
        try:
            with sync_client() as client:
                state = client.read_flow_run(run_key).state  # type: ignore[arg-type]
                if state is not None and (state.is_cancelling() or state.is_final()):
                    return None  # cancelled (or ended) meanwhile: not a pause
                paused = Scheduled(name=StateName.RESUMING.value, message=message)
                told = client.set_flow_run_state(run_key, paused, force=True)  # type: ignore[arg-type]
            log.warning("flow run %s %s", run_key, message)
            return Pause(message, state=told.state)
        except Exception as exc:
            if time.monotonic() > give_up:
                log.warning("flow run %s paused at iteration %d; Prefect could not be told (%s)", run_key,
                            reached, exc)
                return Pause(message)
            time.sleep(1.0)


if __name__ == "__main__":
    os.environ.update(LaunchSpec(gpu_plan=[[0, 1], [0, 1, 2, 3], [0]], switch_at=[15, 30]).to_env())
    train(model="mlp", iterations=40, checkpoint_interval=5)
