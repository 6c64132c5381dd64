"""The elastic training loop, independent of Prefect.

`run_training` runs a job as a sequence of segments. Before each segment it
decides the GPU set: the latest control-channel command if the scheduler has
spoken, else the standalone `gpu_plan`. A new GPU set that keeps some of the
old one is taken in place where the ranks can (`Ranks.in_place`): the ranks
on kept GPUs pause at the stop with their state, and the segment goes on
with newcomers (segment_machine.Segment.regroup). Otherwise, and after a crash, a
segment restores the latest checkpoint, so a relaunch continues the same
training. Where the ranks run (processes here, or Ray actors on a
cluster's nodes) is chosen once (`ranks.ranks_for`); the loop does not know
which. The Prefect flow in `flows.train` wraps this loop and runs each segment
as a task. A run's state between segments is `run_state.RunState`'s; what a
run holds while it trains (the segment paused in memory, the next one
decided early) is `Training`'s.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Literal

import torch

from elasticflow_block.home import elasticflow_home
from elasticflow_block.storage import CheckpointStorage, resolve_checkpoint_url
from flows.training.launch import identity
from flows.training.control import FileControlChannel, default_control_root
from flows.training.params import TrainParameters
from flows.training.coordinator.progress import ProgressTracker
from flows.training.coordinator.ranks import ranks_for
from flows.training.coordinator.run_state import CheckpointSaveFailed, RunState, Status, TrainResult
from flows.training.segment import SegmentResult, SegmentSpec
from flows.training.supervision import ProgressCallback, ProgressLine, RunningSegment
from flows.training.task_check import dataset_size
from flows.training.coordinator.termination import Termination

log = logging.getLogger("elasticflow.runtime")

# Runs a zero-argument segment launch, e.g. as a Prefect task; gets a display name.
SegmentWrapper = Callable[[Callable[[], SegmentResult], str], SegmentResult]
Segment = tuple[SegmentSpec, list[int], list[int]]  # its spec, its GPUs, the GPUs its successor will likely want

__all__ = ["CheckpointSaveFailed", "Status", "TrainResult", "default_device", "run_training"]


def default_device(requested: str) -> Literal["cpu", "cuda"]:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but CUDA is not available here")
    return "cuda" if requested == "cuda" else "cpu"


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


class Training:
    """One run's training, segment by segment, until it completes or is
    stopped: what it holds while it trains is its fields."""

    def __init__(self, params: TrainParameters, run_key: str, wrap_segment: SegmentWrapper | None,
                 tracker_factory: Callable[[int, FileControlChannel], ProgressTracker] | None, park_poll_s: float,
                 segment_hook: Callable[[RunningSegment], None] | None) -> None:
        self.params, self.run_key, self.park_poll_s = params, run_key, park_poll_s
        self.wrap_segment, self.segment_hook = wrap_segment, segment_hook
        self.total = params.iterations or params.total_iterations(dataset_size(params))
        self.checkpoint_url = resolve_checkpoint_url(params.checkpoint_store)
        self.control_root = Path(params.control_dir) if params.control_dir else default_control_root()
        channel = FileControlChannel(run_key, self.control_root)
        self.tracker = (tracker_factory(self.total, channel) if tracker_factory
                        else ProgressTracker(run_key, self.total, params.deadline, channel))
        self.device = default_device(params.device)
        storage = CheckpointStorage(self.checkpoint_url, keep=params.keep_checkpoints)
        self.run = RunState(params, run_key, channel, storage, park_poll_s)
        self.tracker.starts_at(self.run.iteration)
        self.ranks = ranks_for(params.ray_address, run_key, channel, _local_identity(params, run_key, channel, storage))
        self.termination = Termination()
        self.trained = False  # the last segment launched did at least one iteration
        self.live: RunningSegment | None = None  # paused in memory at its stop, for a resize in place
        self.ahead: Segment | None = None  # the next segment, decided in the last one's task
        self.regrouped: RunningSegment | None = None  # and already going on in place, for the next launch to wait on

    def release(self) -> None:
        if self.live is not None:
            paused, self.live = self.live, None
            self.run.released(paused.release())

    def next_segment(self) -> Segment:
        gpus, stop_at, upcoming = self.run.next_segment(self.total)
        spec = SegmentSpec.of_run(self.params, run_key=self.run_key, total_iterations=self.total, stop_at=stop_at,
                                  checkpoint_url=self.checkpoint_url, device=self.device,
                                  control_dir=str(self.control_root), applied_seq=self.run.applied_seq,
                                  in_place=self.params.resize_in_place and self.ranks.in_place)
        return spec, gpus, upcoming

    def regroup_now(self, segment: RunningSegment) -> None:
        """The scheduler's command keeps some of the paused ranks' GPUs: they
        regroup at once, inside the task of the segment they paused in, and
        the command is acknowledged once the leavers are gone."""
        self.ahead = self.next_segment()
        spec, gpus, _ = self.ahead
        if segment.regroup(spec, gpus, self.run.where):
            self.live, self.regrouped = None, segment
        else:  # a rank is gone: the others save, and the next launch goes on from the checkpoint
            segment.release()  # recorded by that launch's release, once this segment's result is
        self.run.acknowledge()

    def launch(self, spec: SegmentSpec, gpus: list[int], upcoming: list[int], on_progress: ProgressCallback
               ) -> SegmentResult:
        paused, fresh = self.live, False
        if self.regrouped is not None:
            segment, self.regrouped = self.regrouped, None
        elif paused is not None and paused.regroup(spec, gpus, self.run.where):
            segment, self.live = paused, None
        else:  # none of its GPUs stay, or a rank is gone: from its checkpoint
            self.release()
            segment, fresh = self.ranks.segment(spec, gpus, self.run.where), True
        self.run.acknowledge()  # the ranks that leave are gone: their GPUs may go to others
        self.termination.watch(segment)
        self.trained = False

        def progress(line: ProgressLine) -> None:
            if not self.trained:  # once this segment trains: earlier, warm-ups only slow its start
                self.ranks.refill(upcoming)
                self.trained = True
            on_progress(line)

        try:  # a TerminationSignal can land anywhere here, even between handing out two workers' orders
            if fresh:
                segment.start()
            if self.segment_hook:
                self.segment_hook(segment)
            result = segment.wait(progress)
            if result.paused:
                self.live = segment
            if self.run.let_go(segment, result):
                self.regroup_now(segment)
            return result
        except BaseException:
            segment.kill(grace_s=30.0)  # let workers checkpoint before we go
            raise
        finally:
            self.termination.watch(None)

    def segments(self) -> Status:
        """Segments until the run completes, is stopped, or is preempted."""
        run, tracker = self.run, self.tracker
        while run.iteration < self.total:
            if self.ahead is None:
                if not run.take_command():
                    self.release()
                    run.acknowledge()
                    return "stopped"
                if run.override == []:  # parked by the scheduler: hold no workers until told
                    self.release()
                    run.acknowledge()
                    run.park()
                    time.sleep(self.park_poll_s)
                    continue
                self.ahead = self.next_segment()
            (spec, gpus, upcoming), self.ahead = self.ahead, None
            tracker.segment_started(gpus, run.iteration)
            name = f"segment-{len(run.segments)}-it{run.iteration}-gpus{'_'.join(map(str, gpus))}"

            def go(s: SegmentSpec = spec, g: list[int] = gpus, u: list[int] = upcoming) -> SegmentResult:
                return self.launch(s, g, u, tracker.on_line)

            result = self.wrap_segment(go, name) if self.wrap_segment else go()
            tracker.segment_finished(result)
            run.segments.append(result)
            if result.reason == "crashed" and self.termination.received:  # its stop reached ranks still starting
                return "preempted"
            if result.reason == "crashed":
                run.crashed(result, self.ranks, self.trained)
                continue
            if result.reason == "save_failed":  # the store's fault: an older checkpoint would only lose work
                raise CheckpointSaveFailed(f"{result.error}; the run ends at iteration {result.end_iteration} "
                                           f"rather than train on with no checkpoint to resume from")
            run.ended(result, tracker)
            if result.reason == "terminated" or self.termination.received:
                return "preempted"
        return "completed"

    def __call__(self) -> TrainResult:
        self.termination.install()
        failed = False
        try:
            status = self.segments()
        except BaseException:
            failed = True
            self.termination.give_up()  # already failing: just put the handler back
            raise
        finally:
            try:
                if self.live is not None:  # never left behind: its ranks save and exit
                    self.live.release()
                if self.regrouped is not None:  # regrouped for a launch that never came: stopped where it stands
                    self.regrouped.kill(grace_s=30.0)
                self.run.acknowledge()
            finally:
                self.ranks.close()
                if failed:  # once the ranks are gone: their GPUs never wait for Prefect
                    self.tracker.close()
        self.tracker.finished(status)
        self.tracker.close()
        self.termination.restore_and_forward()  # checkpoint is safe: now let SIGTERM do what it would have done
        return self.run.result(status, self.total)


def run_training(
    params: TrainParameters,
    run_key: str,
    wrap_segment: SegmentWrapper | None = None,
    tracker_factory: Callable[[int, FileControlChannel], ProgressTracker] | None = None,
    park_poll_s: float = 1.0,
    segment_hook: Callable[[RunningSegment], None] | None = None,
) -> TrainResult:
    """Train `params` to completion (or until stopped), segment by segment."""
    return Training(params, run_key, wrap_segment, tracker_factory, park_poll_s, segment_hook)()
