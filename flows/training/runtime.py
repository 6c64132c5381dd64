"""The elastic training loop, independent of Prefect.

`run_training` runs a job as a sequence of segments. Before each segment it
decides the GPU set: the latest control-channel command if the scheduler has
spoken, else the standalone `gpu_plan`. Each segment restores the latest
checkpoint, so a relaunch on a different GPU set, or after a crash, continues
the same training. The Prefect flow in `flows.train` wraps this loop and runs
each segment as a task.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from pydantic import BaseModel, Field

from elasticflow_block.storage import CheckpointStorage, resolve_checkpoint_url
from flows.training.control import ControlAck, FileControlChannel, GpuSlot, default_control_root
from flows.training.datasets import load_dataset
from flows.training.launcher import POOL, ProgressCallback, Segment, prune_segment_dirs
from flows.training.params import TrainParameters
from flows.training.progress import ProgressTracker
from flows.training.ray_nodes import RAY_ADDRESS_ENV
from flows.training.segment import SegmentResult, SegmentSpec

log = logging.getLogger("elasticflow.runtime")

# Runs a zero-argument segment launch, e.g. as a Prefect task; gets a display name.
SegmentWrapper = Callable[[Callable[[], SegmentResult], str], SegmentResult]


STANDBY_ENV = "ELASTICFLOW_STANDBY_WORKERS"  # standby workers kept warm; default: largest planned GPU set


class RescaleRecord(BaseModel):
    """One change of GPU set, with the time it cost."""

    iteration: int
    from_gpus: list[int]
    to_gpus: list[int]
    cause: Literal["plan", "control"]
    seconds: float | None = Field(description="stop seen at a boundary -> new segment ready for its first iteration")


class TrainResult(BaseModel):
    run_key: str
    status: Literal["completed", "stopped", "preempted"]
    iterations: int
    total_iterations: int
    losses: list[float] = Field(description="global mean loss at every iteration since the run began")
    segments: list[SegmentResult]
    rescales: list[RescaleRecord]
    restarts: int


class _Termination:
    """Turns SIGTERM on the flow process into a graceful stop of the workers.

    Workers checkpoint at the next boundary; afterwards the previous handler
    gets the signal as if we were not there. Only installable from the main
    thread.

    Under Prefect's engine nothing is installed: Prefect's own SIGTERM bridge
    must stay in place, because the runner acknowledges a cancellation only
    while it is (otherwise a cancelled run ends Crashed, not Cancelled). Its
    `TerminationSignal` reaches `run_training`'s segment, which stops the
    workers the same way (they checkpoint) before the exception goes on.
    """

    def __init__(self) -> None:
        self.segment: Segment | None = None
        self.received = False
        self.previous: Any = None
        self.installed = False

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread() and not _prefect_bridge_installed():
            self.previous = signal.signal(signal.SIGTERM, self._handle)
            self.installed = True

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True
        if self.segment:
            self.segment.request_stop()

    def restore_and_forward(self) -> None:
        if not self.installed:
            return
        signal.signal(signal.SIGTERM, self.previous)
        self.installed = False
        if self.received:
            if callable(self.previous):
                self.previous(signal.SIGTERM, None)
            elif self.previous == signal.SIG_DFL:
                os.kill(os.getpid(), signal.SIGTERM)


def _prefect_bridge_installed() -> bool:
    """Whether SIGTERM is Prefect's bridge (a flow run under Prefect's engine)."""
    from prefect.utilities.engine import _prefect_sigterm_handler

    return signal.getsignal(signal.SIGTERM) is _prefect_sigterm_handler


def _standby_target(
    params: TrainParameters, override: list[int] | None, gpus: list[int], next_switch: int | None
) -> int:
    """How many warm workers the next relaunch will want: the next planned GPU set
    when the plan says, the current size when the scheduler steers (a guess),
    none after the last planned segment. `ELASTICFLOW_STANDBY_WORKERS` overrides."""
    if STANDBY_ENV in os.environ:
        return int(os.environ[STANDBY_ENV])
    if override is not None:
        return len(gpus)
    if next_switch is not None:
        return len(params.planned_gpus(next_switch)[0])
    return 0


def default_device(requested: str) -> Literal["cpu", "cuda"]:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available here")
    return "cuda" if requested == "cuda" else "cpu"


def run_training(
    params: TrainParameters,
    run_key: str,
    wrap_segment: SegmentWrapper | None = None,
    tracker_factory: Callable[[int, FileControlChannel], ProgressTracker] | None = None,
    park_poll_s: float = 1.0,
    segment_hook: Callable[[Segment], None] | None = None,
) -> TrainResult:
    """Train `params` to completion (or until stopped), segment by segment."""
    data_size = len(load_dataset(params.dataset))  # type: ignore[arg-type]
    total = params.total_iterations(data_size)
    checkpoint_url = resolve_checkpoint_url(params.checkpoint_store)
    storage = CheckpointStorage(checkpoint_url, keep=params.keep_checkpoints)
    control_root = Path(params.control_dir) if params.control_dir else default_control_root()
    channel = FileControlChannel(run_key, control_root)
    segments_dir = channel.folder / "segments"  # worker logs, progress and results, newest 5 kept
    if tracker_factory:
        tracker = tracker_factory(total, channel)
    else:
        tracker = ProgressTracker(run_key, total, params.deadline, channel)
    device = default_device(params.device)
    ack = channel.acknowledged()
    applied_seq = ack.seq if ack else 0
    override: list[int] | None = ack.gpus if ack else None  # a restarted flow keeps the scheduler's last word
    latest = channel.latest()  # on a cluster, where those GPUs are
    where: list[GpuSlot] | None = latest.placement if latest and ack and latest.seq == ack.seq else None
    cluster = None
    if os.environ.get(RAY_ADDRESS_ENV):
        from flows.training.ray_ranks import RayRanks

        cluster = RayRanks(os.environ[RAY_ADDRESS_ENV], run_key, channel)
    placement: list[GpuSlot] = []  # the current segment's, on a cluster
    done = storage.iterations(run_key)
    iteration = done[-1] if done else 0
    history: list[float] = []
    segments: list[SegmentResult] = []
    rescales: list[RescaleRecord] = []
    restarts = 0
    previous: SegmentResult | None = None
    cause: Literal["plan", "control"] = "plan"
    parked = False  # time spent parked is not rescale cost
    termination = _Termination()
    termination.install()

    def launch(spec: SegmentSpec, gpus: list[int], on_progress: ProgressCallback, standby: int) -> SegmentResult:
        nonlocal placement
        if cluster is not None:
            placement = cluster.placement(gpus, where)
            segment: Any = cluster.segment(spec, gpus, placement)
        else:
            segment = Segment(spec, gpus, workdir=segments_dir)
        termination.segment = segment
        refilled = False

        def progress(iteration: int, loss: float, wall_t: float) -> None:
            # Once this segment trains, warm the next one's workers; earlier, their
            # imports would only slow this segment's start.
            nonlocal refilled
            if not refilled:
                if cluster is None:
                    POOL.refill(standby)
                elif standby:
                    cluster.refill(placement)
                refilled = True
            on_progress(iteration, loss, wall_t)

        try:  # a TerminationSignal can land anywhere here, even between handing out two workers' orders
            segment.start()
            if segment_hook:
                segment_hook(segment)
            return segment.wait(progress)
        except BaseException:
            segment.kill(grace_s=30.0)  # let workers checkpoint before we go
            raise
        finally:
            termination.segment = None
            prune_segment_dirs(segments_dir, keep=5)

    status: Literal["completed", "stopped", "preempted"] = "completed"
    try:
        while iteration < total:
            command = channel.pending(applied_seq)
            if command:
                applied_seq = command.seq
                if command.action == "stop":
                    channel.acknowledge(ControlAck(seq=command.seq, iteration=iteration, gpus=[]))
                    status = "stopped"
                    break
                override, cause = list(command.gpus or []), "control"
                where = command.placement
                channel.acknowledge(ControlAck(seq=command.seq, iteration=iteration, gpus=override))
                log.info("control command applied run_key=%s seq=%d gpus=%s", run_key, command.seq, override)
            if override == []:  # parked by the scheduler: hold no workers until told
                parked = True
                time.sleep(park_poll_s)
                continue
            planned, next_switch = params.planned_gpus(iteration)
            gpus = override if override is not None else planned
            stop_at = total if override is not None or next_switch is None else next_switch
            spec = SegmentSpec.of_run(
                params,
                run_key=run_key,
                total_iterations=total,
                stop_at=stop_at,
                checkpoint_url=checkpoint_url,
                device=device,
                control_dir=str(control_root),
                applied_seq=applied_seq,
            )
            tracker.segment_started(gpus, iteration)
            name = f"segment-{len(segments)}-it{iteration}-gpus{'_'.join(map(str, gpus))}"
            standby = _standby_target(params, override, gpus, next_switch)
            if wrap_segment:
                result = wrap_segment(lambda s=spec, g=gpus, n=standby: launch(s, g, tracker.on_iteration, n), name)
            else:
                result = launch(spec, gpus, tracker.on_iteration, standby)
            tracker.segment_finished(result)
            segments.append(result)
            if result.reason == "crashed":
                restarts += 1
                log.warning(
                    "segment crashed run_key=%s restart=%d/%d error=%s",
                    run_key,
                    restarts,
                    params.max_restarts,
                    result.error,
                )
                if restarts > params.max_restarts:
                    raise RuntimeError(f"training crashed {restarts} times; last error: {result.error}")
                done = storage.iterations(run_key)
                iteration = done[-1] if done else 0
                previous = None
                if cluster is not None and cluster.lost_nodes():
                    # A node of this run is gone: its GPUs are no one's to train on. The
                    # scheduler re-plans on the smaller cluster and says where to go on.
                    log.warning("run_key=%s lost nodes of %s; waiting for a new placement", run_key,
                                ",".join(sorted({s.name for s in placement})))
                    while channel.pending(applied_seq) is None:
                        time.sleep(park_poll_s)
                continue
            if previous is not None and previous.gpus != result.gpus:
                seconds = None
                if not parked and (previous.timings.stop_seen_t is not None or previous.reason == "target"):
                    stop_t = previous.timings.stop_seen_t or max(
                        previous.timings.iteration_end_t.values(), default=None
                    )
                    seconds = result.timings.loaded_t - stop_t if stop_t else None
                record = RescaleRecord(
                    iteration=result.start_iteration,
                    from_gpus=previous.gpus,
                    to_gpus=result.gpus,
                    cause=cause,
                    seconds=seconds,
                )
                rescales.append(record)
                tracker.rescaled(record.from_gpus, record.to_gpus, record.iteration, seconds)
            history = result.history
            iteration = result.end_iteration
            previous, parked = result, False
            if result.reason == "terminated" or termination.received:
                status = "preempted"
                break
    except BaseException:
        termination.received = False  # already failing: just put the handler back
        termination.restore_and_forward()
        raise
    finally:
        if cluster is not None:
            cluster.close()
    tracker.finished(status)
    termination.restore_and_forward()  # checkpoint is safe: now let SIGTERM do what it would have done
    return TrainResult(
        run_key=run_key,
        status=status,
        iterations=iteration,
        total_iterations=total,
        losses=history,
        segments=segments,
        rescales=rescales,
        restarts=restarts,
    )
