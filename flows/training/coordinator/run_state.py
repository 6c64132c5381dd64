"""A run between its segments: where it is, what the scheduler last said
(read from its control channel, applied, acknowledged once the ranks it
takes GPUs from are gone), and what it did so far: its segments, resizes,
restarts and losses. `runtime.Training` drives it; the segments' ranks are
the `Ranks`'."""

from __future__ import annotations

import logging
import time
from typing import Literal

from pydantic import BaseModel, Field

from elasticflow_block.storage import CheckpointStorage
from flows.training.control import ControlAck, FileControlChannel, GpuSlot
from flows.training.params import TrainParameters
from flows.training.coordinator.progress import ProgressTracker
from flows.training.coordinator.ranks import Ranks
from flows.training.segment import SegmentResult
from flows.training.supervision import Failure, RunningSegment

log = logging.getLogger("elasticflow.runtime")

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


class RunState:
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
        self.parked = False  # time spent parked is not rescale cost (set by `park`, cleared by `ended`)
        self.unacked: ControlAck | None = None  # applied, told once the ranks it takes GPUs from are gone
        self.stop_asked = False  # the scheduler said stop: nothing trains again

    def park(self) -> None:
        """Parked by the scheduler: its time until the next segment is not a resize's."""
        self.parked = True

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
        self.unacked = ControlAck(seq=command.seq, iteration=self.iteration, gpus=self.override,
                                  placement=command.placement)
        log.debug("control command applied run_key=%s seq=%d gpus=%s", self.run_key, command.seq, self.override)
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
