"""The elastic training loop, independent of Prefect.

`run_training` runs a job as a sequence of segments. Before each segment it
decides the GPU set: the latest control-channel command if the scheduler has
spoken, else the standalone `gpu_plan`. A new GPU set that keeps some of the
old one is taken in place where the ranks can (`Ranks.in_place`): the ranks
on kept GPUs pause at the stop with their state, and the segment goes on
with newcomers (launcher.Segment.regroup). Otherwise, and after a crash, a
segment restores the latest checkpoint, so a relaunch continues the same
training. Where the ranks run (processes here, or Ray actors on a
cluster's nodes) is chosen once (`ranks.ranks_for`); the loop does not know
which. The Prefect flow in `flows.train` wraps this loop and runs each segment
as a task.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Literal

import torch
from pydantic import BaseModel, Field

from elasticflow_block.home import elasticflow_home
from elasticflow_block.storage import CheckpointStorage, resolve_checkpoint_url
from flows.training import identity
from flows.training.control import ControlAck, FileControlChannel, GpuSlot, default_control_root
from flows.training.params import TrainParameters
from flows.training.progress import ProgressTracker
from flows.training.ranks import Ranks, ranks_for
from flows.training.segment import SegmentResult, SegmentSpec
from flows.training.supervision import Failure, ProgressCallback, ProgressLine, RunningSegment
from flows.training.task_check import dataset_size
from flows.training.termination import Termination

log = logging.getLogger("elasticflow.runtime")

# Runs a zero-argument segment launch, e.g. as a Prefect task; gets a display name.
SegmentWrapper = Callable[[Callable[[], SegmentResult], str], SegmentResult]
Status = Literal["completed", "stopped", "preempted"]


class CheckpointSaveFailed(RuntimeError):
    """Rank 0 could not save a checkpoint, several times in a row (saving.py):
    the run ends Failed with the store's error, and is not retried."""


class RescaleRecord(BaseModel):
    """One change of GPU set, with the time it cost."""

    iteration: int
    from_gpus: list[int]
    to_gpus: list[int]
    cause: Literal["plan", "control"]
    how: Literal["restart", "in_place"] = Field("restart", description="from a checkpoint, or ranks that stayed")
    seconds: float | None = Field(description="stop seen at a boundary -> new segment ready for its first iteration")


class TrainResult(BaseModel):
    run_key: str
    status: Status
    iterations: int
    total_iterations: int
    losses: list[float] = Field(description="global mean loss at every iteration since the run began")
    segments: list[SegmentResult]
    rescales: list[RescaleRecord]
    restarts: int
    metrics: dict[str, float] = Field(default_factory=dict, description="the task's evaluation (`evaluate`), if any")


def _upcoming(params: TrainParameters, override: list[int] | None, gpus: list[int],
              next_switch: int | None) -> list[int]:
    """The GPUs the next segment will likely want warm ranks on: the current
    set when the scheduler steers (a guess), the next planned set when the
    plan says, none after the last planned segment."""
    if override is not None:
        return list(gpus)
    if next_switch is not None:
        return params.planned_gpus(next_switch)[0]
    return []


def default_device(requested: str) -> Literal["cpu", "cuda"]:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available here")
    return "cuda" if requested == "cuda" else "cpu"


class _Run:
    """A run between its segments: where it is, what the scheduler last said,
    and what it did so far."""

    def __init__(self, params: TrainParameters, run_key: str, channel: FileControlChannel,
                 storage: CheckpointStorage, park_poll_s: float) -> None:
        self.params, self.run_key, self.channel, self.storage = params, run_key, channel, storage
        self.park_poll_s = park_poll_s
        ack = channel.acknowledged()
        self.applied_seq = ack.seq if ack else 0
        self.override: list[int] | None = ack.gpus if ack else None  # a restarted flow keeps the scheduler's word
        latest = channel.latest()  # on a cluster, where those GPUs are
        self.where: list[GpuSlot] | None = latest.placement if latest and ack and latest.seq == ack.seq else None
        self.iteration = self.checkpointed()
        self.history: list[float] = []
        self.segments: list[SegmentResult] = []
        self.rescales: list[RescaleRecord] = []
        self.restarts = 0
        self.previous: SegmentResult | None = None
        self.cause: Literal["plan", "control"] = "plan"
        self.parked = False  # time spent parked is not rescale cost
        self.unacked: ControlAck | None = None  # applied, told once the ranks it takes GPUs from are gone
        self.stop_asked = False  # the scheduler said stop: nothing trains again

    def checkpointed(self) -> int:
        """The iteration of the newest checkpoint: where the next segment starts."""
        done = self.storage.iterations(self.run_key)
        return done[-1] if done else 0

    def take_command(self) -> bool:
        """Apply the scheduler's newest command, if there is one; False once one said stop."""
        command = self.channel.pending(self.applied_seq)
        if command is None:
            return not self.stop_asked
        self.applied_seq = command.seq
        if command.action == "stop":
            self.stop_asked = True
            self.unacked = ControlAck(seq=command.seq, iteration=self.iteration, gpus=[])
            return False
        self.override, self.cause, self.where = list(command.gpus or []), "control", command.placement
        self.unacked = ControlAck(seq=command.seq, iteration=self.iteration, gpus=self.override)
        log.info("control command applied run_key=%s seq=%d gpus=%s", self.run_key, command.seq, self.override)
        return True

    def let_go(self, segment: RunningSegment, result: SegmentResult) -> bool:
        """The ranks stopped for the scheduler's newest command: it is applied
        here, inside the segment's task, not once Prefect has heard the task
        end (through a slow server that once took 33 s, while the run placed
        on those GPUs waited and missed its deadline). When the ranks are
        gone, or the command takes every GPU they hold (a park, a stop, a
        move elsewhere), paused ranks save first and it is acknowledged at
        once. True when paused ranks keep some GPUs: the caller regroups them
        now, and acknowledges once the leavers are gone."""
        command = self.channel.pending(self.applied_seq)
        if command is None or not (result.paused or result.reason == "stopped"):
            return False
        self.iteration = result.end_iteration  # what the acknowledgement says; `ended` sets it alike after the task
        self.take_command()
        if result.paused and command.action != "stop" and set(command.gpus or []) & set(segment.gpus):
            return True
        if result.paused:
            segment.release()  # the loop's release reads the same record of where they saved
        self.acknowledge()
        return False

    def acknowledge(self) -> None:
        """Tell the scheduler its command is applied: only once the ranks it
        takes GPUs from are gone, for the scheduler then hands them out."""
        if self.unacked is not None:
            self.channel.acknowledge(self.unacked)
            self.unacked = None

    def next_segment(self, total: int) -> tuple[list[int], int, list[int]]:
        """The next segment's GPUs, the iteration it stops at, and the GPUs its successor will likely want."""
        planned, next_switch = self.params.planned_gpus(self.iteration)
        gpus = self.override if self.override is not None else planned
        stop_at = total if self.override is not None or next_switch is None else next_switch
        return gpus, stop_at, _upcoming(self.params, self.override, gpus, next_switch)

    def crashed(self, result: SegmentResult, ranks: Ranks, trained: bool) -> None:
        """Go on from the last checkpoint, on a new placement if the crash took a
        node along. A rank that raised an error before the segment trained at
        all (building the model, reading the data, a bad setting) would raise
        it again: the run ends at once rather than launch three more times."""
        self.restarts += 1
        if result.failure == Failure.FAILED.value and not trained:
            raise RuntimeError(f"training failed before its first iteration, not retried (the same error would "
                               f"come again): {result.error}")
        log.warning("segment crashed run_key=%s restart=%d/%d error=%s", self.run_key, self.restarts,
                    self.params.max_restarts, result.error)
        if self.restarts > self.params.max_restarts:
            raise RuntimeError(f"training crashed {self.restarts} times; last error: {result.error}")
        self.iteration, self.previous = self.checkpointed(), None
        lost = ranks.lost_nodes()
        if lost:
            # Its GPUs there are no one's to train on. The scheduler re-plans
            # on the smaller cluster and says where to go on.
            log.warning("run_key=%s lost nodes %s; waiting for a new placement", self.run_key, ",".join(lost))
            while self.channel.pending(self.applied_seq) is None:
                time.sleep(self.park_poll_s)

    def ended(self, result: SegmentResult, tracker: ProgressTracker) -> None:
        """A segment that ran to its end: a resize if its GPUs differ from the one before."""
        previous = self.previous
        if previous is not None and sorted(previous.gpus) != sorted(result.gpus):
            record = RescaleRecord(iteration=result.start_iteration, from_gpus=previous.gpus, to_gpus=result.gpus,
                                   cause=self.cause, how="in_place" if result.in_place else "restart",
                                   seconds=None if self.parked else _rescale_s(previous, result))
            self.rescales.append(record)
            tracker.rescaled(record.from_gpus, record.to_gpus, record.iteration, record.seconds)
        self.history, self.iteration = result.history, result.end_iteration
        self.previous, self.parked = result, False

    def released(self, result: SegmentResult | None) -> None:
        """The paused ranks saved and exited: the next segment starts from that checkpoint."""
        if result is not None:  # the paused segment's record, now with where it saved
            self.segments[-1] = result
            if result.reason == "save_failed":
                raise CheckpointSaveFailed(f"{result.error}; the run ends at iteration {result.end_iteration} "
                                           f"rather than train on with no checkpoint to resume from")
        self.iteration = self.checkpointed()

    def result(self, status: Status, total: int) -> TrainResult:
        return TrainResult(run_key=self.run_key, status=status, iterations=self.iteration, total_iterations=total,
                           losses=self.history, segments=self.segments, rescales=self.rescales,
                           restarts=self.restarts, metrics=self.segments[-1].metrics if self.segments else {})


def _rescale_s(previous: SegmentResult, result: SegmentResult) -> float | None:
    """Stop seen at a boundary (or the planned last iteration) -> the new segment ready."""
    if previous.timings.stop_seen_t is None and previous.reason != "target":
        return None
    stop_t = previous.timings.stop_seen_t or max(previous.timings.iteration_end_t.values(), default=None)
    return result.timings.loaded_t - stop_t if stop_t else None


def _local_identity(
    params: TrainParameters, run_key: str, channel: FileControlChannel, storage: CheckpointStorage
) -> identity.RankIdentity | None:
    """The account this run's local ranks take (`ELASTICFLOW_RANK_USER`). Ray
    actors run as their node's Ray processes do: that is the cluster's to set."""
    if params.ray_address:
        if identity.configured_user():
            log.warning("%s is not applied on Ray: rank actors run as the Ray node's user (docs/ray.md)",
                        identity.RANK_USER_ENV)
        return None
    folders = [channel.folder, *filter(None, [storage.local_folder(run_key)])]
    return identity.for_run(run_key, folders, elasticflow_home())


def run_training(
    params: TrainParameters,
    run_key: str,
    wrap_segment: SegmentWrapper | None = None,
    tracker_factory: Callable[[int, FileControlChannel], ProgressTracker] | None = None,
    park_poll_s: float = 1.0,
    segment_hook: Callable[[RunningSegment], None] | None = None,
) -> TrainResult:
    """Train `params` to completion (or until stopped), segment by segment."""
    total = params.iterations or params.total_iterations(dataset_size(params))
    checkpoint_url = resolve_checkpoint_url(params.checkpoint_store)
    control_root = Path(params.control_dir) if params.control_dir else default_control_root()
    channel = FileControlChannel(run_key, control_root)
    tracker = (tracker_factory(total, channel) if tracker_factory
               else ProgressTracker(run_key, total, params.deadline, channel))
    device = default_device(params.device)
    storage = CheckpointStorage(checkpoint_url, keep=params.keep_checkpoints)
    run = _Run(params, run_key, channel, storage, park_poll_s)
    ranks = ranks_for(params.ray_address, run_key, channel, _local_identity(params, run_key, channel, storage))
    termination = Termination()
    termination.install()

    trained = False  # the last segment launched did at least one iteration
    live: RunningSegment | None = None  # paused in memory at its stop, for a resize in place
    ahead: tuple[SegmentSpec, list[int], list[int]] | None = None  # the next segment, decided in the last one's task
    regrouped: RunningSegment | None = None  # and already going on in place, for the next launch to wait on

    def release() -> None:
        nonlocal live
        if live is not None:
            paused, live = live, None
            run.released(paused.release())

    def next_segment() -> tuple[SegmentSpec, list[int], list[int]]:
        gpus, stop_at, upcoming = run.next_segment(total)
        spec = SegmentSpec.of_run(params, run_key=run_key, total_iterations=total, stop_at=stop_at,
                                  checkpoint_url=checkpoint_url, device=device, control_dir=str(control_root),
                                  applied_seq=run.applied_seq, in_place=params.resize_in_place and ranks.in_place)
        return spec, gpus, upcoming

    def regroup_now(segment: RunningSegment) -> None:
        """The scheduler's command keeps some of the paused ranks' GPUs: they
        regroup at once, inside the task of the segment they paused in, and
        the command is acknowledged once the leavers are gone."""
        nonlocal ahead, live, regrouped
        ahead = next_segment()
        spec, gpus, _ = ahead
        if segment.regroup(spec, gpus, run.where):
            live, regrouped = None, segment
        else:  # a rank is gone: the others save, and the next launch goes on from the checkpoint
            segment.release()  # recorded by that launch's release, once this segment's result is
        run.acknowledge()

    def launch(spec: SegmentSpec, gpus: list[int], upcoming: list[int], on_progress: ProgressCallback
               ) -> SegmentResult:
        nonlocal trained, live, regrouped
        paused, fresh = live, False
        if regrouped is not None:
            segment, regrouped = regrouped, None
        elif paused is not None and paused.regroup(spec, gpus, run.where):
            segment, live = paused, None
        else:  # none of its GPUs stay, or a rank is gone: from its checkpoint
            release()
            segment, fresh = ranks.segment(spec, gpus, run.where), True
        run.acknowledge()  # the ranks that leave are gone: their GPUs may go to others
        termination.segment = segment
        trained = False

        def progress(line: ProgressLine) -> None:
            nonlocal trained
            if not trained:  # once this segment trains: earlier, warm-ups only slow its start
                ranks.refill(upcoming)
                trained = True
            on_progress(line)

        try:  # a TerminationSignal can land anywhere here, even between handing out two workers' orders
            if fresh:
                segment.start()
            if segment_hook:
                segment_hook(segment)
            result = segment.wait(progress)
            if result.paused:
                live = segment
            if run.let_go(segment, result):
                regroup_now(segment)
            return result
        except BaseException:
            segment.kill(grace_s=30.0)  # let workers checkpoint before we go
            raise
        finally:
            termination.segment = None

    status: Status = "completed"
    failed = False
    try:
        while run.iteration < total:
            if ahead is None:
                if not run.take_command():
                    release()
                    run.acknowledge()
                    status = "stopped"
                    break
                if run.override == []:  # parked by the scheduler: hold no workers until told
                    release()
                    run.acknowledge()
                    run.parked = True
                    time.sleep(park_poll_s)
                    continue
                ahead = next_segment()
            (spec, gpus, upcoming), ahead = ahead, None
            tracker.segment_started(gpus, run.iteration)
            name = f"segment-{len(run.segments)}-it{run.iteration}-gpus{'_'.join(map(str, gpus))}"

            def go(s: SegmentSpec = spec, g: list[int] = gpus, u: list[int] = upcoming) -> SegmentResult:
                return launch(s, g, u, tracker.on_line)

            result = wrap_segment(go, name) if wrap_segment else go()
            tracker.segment_finished(result)
            run.segments.append(result)
            if result.reason == "crashed" and termination.received:  # its stop reached ranks still starting
                status = "preempted"
                break
            if result.reason == "crashed":
                run.crashed(result, ranks, trained)
                continue
            if result.reason == "save_failed":  # the store's fault: an older checkpoint would only lose work
                raise CheckpointSaveFailed(f"{result.error}; the run ends at iteration {result.end_iteration} "
                                           f"rather than train on with no checkpoint to resume from")
            run.ended(result, tracker)
            if result.reason == "terminated" or termination.received:
                status = "preempted"
                break
    except BaseException:
        failed = True
        termination.received = False  # already failing: just put the handler back
        termination.restore_and_forward()
        raise
    finally:
        try:
            if live is not None:  # never left behind: its ranks save and exit
                live.release()
            if regrouped is not None:  # regrouped for a launch that never came: stopped where it stands
                regrouped.kill(grace_s=30.0)
            run.acknowledge()
        finally:
            ranks.close()
            if failed:  # once the ranks are gone: their GPUs never wait for Prefect
                tracker.close()
    tracker.finished(status)
    tracker.close()
    termination.restore_and_forward()  # checkpoint is safe: now let SIGTERM do what it would have done
    return run.result(status, total)
