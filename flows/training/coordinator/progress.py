"""Progress of a training run: iterations done, throughput, projected finish.

`ProgressTracker` computes the figures and publishes them to the control
channel's status file, which the scheduler can read without Prefect. The Prefect
side (artifact, labels, events) lives in `prefect_progress` and is optional, so
the runtime works the same in a flow, a test or a benchmark.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from datetime import datetime, timedelta, timezone

from flows.training.control import FileControlChannel, RunStatus
from flows.training.segment import SegmentResult
from flows.training.supervision import ProgressLine

log = logging.getLogger("elasticflow.progress")


ProgressSnapshot = RunStatus  # what the UI and the scheduler want to know about a run right now


class ProgressTracker:
    """Turns per-iteration reports into snapshots; subclasses publish them elsewhere."""

    def __init__(
        self,
        run_key: str,
        total_iterations: int,
        deadline: datetime | None = None,
        channel: FileControlChannel | None = None,
        min_interval_s: float = 2.0,
    ) -> None:
        self.run_key, self.total, self.deadline, self.channel = run_key, total_iterations, deadline, channel
        self.min_interval_s = min_interval_s
        self.gpus: list[int] = []
        self.iteration = 0
        self.loss: float | None = None
        self._window: deque[tuple[int, float]] = deque(maxlen=20)
        self._last_publish = 0.0
        self.save_error: str | None = None  # while rank 0's checkpoint saves fail

    def snapshot(self, now: float | None = None) -> ProgressSnapshot:
        now = now if now is not None else time.time()
        rate = None
        if len(self._window) >= 2:
            (i0, t0), (i1, t1) = self._window[0], self._window[-1]
            rate = (i1 - i0) / (t1 - t0) if t1 > t0 else None
        finish = None
        if rate:
            finish = datetime.fromtimestamp(now, timezone.utc) + timedelta(seconds=(self.total - self.iteration) / rate)
        elif self.iteration >= self.total:
            finish = datetime.fromtimestamp(now, timezone.utc)
        on_track = (finish <= self.deadline) if (finish and self.deadline) else None
        return ProgressSnapshot(
            run_key=self.run_key,
            iteration=self.iteration,
            total_iterations=self.total,
            loss=self.loss,
            gpus=self.gpus,
            iterations_per_s=rate,
            projected_finish=finish,
            deadline=self.deadline,
            on_track=on_track,
            save_error=self.save_error,
        )

    # Hooks called by the runtime.
    def starts_at(self, iteration: int) -> None:
        """Where the run stands before any segment: its checkpoint. A run
        resumed at its last iteration trains nothing, and said "completed at
        iteration 0": the worker took that for a run stopped short."""
        self.iteration = iteration

    def segment_started(self, gpus: list[int], iteration: int) -> None:
        self.gpus, self.iteration = list(gpus), iteration
        self._window.clear()  # a new GPU count means a new rate
        self.publish(self.snapshot(), event="segment.started", force=True)

    def on_iteration(self, iteration: int, loss: float, wall_t: float) -> None:
        self.iteration, self.loss = iteration, loss
        self._window.append((iteration, wall_t))
        if time.time() - self._last_publish >= self.min_interval_s:
            self.publish(self.snapshot(), event="progress")

    def on_line(self, line: ProgressLine) -> None:
        """One of rank 0's progress lines: an iteration, and how its saves go."""
        if line.save_error != self.save_error:
            self.saves_changed(line.save_error)
        self.on_iteration(line.iteration, line.loss, line.t)

    def saves_changed(self, error: str | None) -> None:
        """Checkpoint saves began to fail, or work again: said at once, in the
        run's logs and its status (which the scheduler reads: a run that
        cannot save is not resized or parked)."""
        self.save_error = error
        if error:
            log.error("%s; training goes on where it is, and a resize waits until a save works run_key=%s",
                      error, self.run_key)
        else:
            log.warning("checkpoint saves work again run_key=%s", self.run_key)
        self.publish(self.snapshot(), event="checkpoint.failing" if error else "checkpoint.saved", force=True)

    def segment_finished(self, result: SegmentResult) -> None:
        if result.end_iteration >= 0:
            self.iteration = result.end_iteration
        self.publish(self.snapshot(), event="segment.finished", force=True, extra={"reason": result.reason})

    def rescaled(self, old: list[int], new: list[int], iteration: int, seconds: float | None) -> None:
        self.publish(
            self.snapshot(),
            event="rescaled",
            force=True,
            extra={"from_gpus": old, "to_gpus": new, "rescale_s": seconds},
        )

    def finished(self, status: str) -> None:
        self.publish(self.snapshot(), event=status, force=True)

    def close(self) -> None:
        """The run is over, one way or another: whatever publishes elsewhere in
        the background finishes here, before the run's own end is recorded."""

    def publish(
        self, snap: ProgressSnapshot, event: str, force: bool = False, extra: dict[str, object] | None = None
    ) -> None:
        self._last_publish = time.time()
        if self.channel:
            try:
                self.channel.publish_status({**snap.model_dump(mode="json"), "event": event, **(extra or {})})
            except OSError as exc:
                log.warning("cannot write status file run_key=%s error=%s", self.run_key, exc)
        # Progress is the artifact's, the labels' and the status file's: 97 of a 150-iteration
        # run's 130 log lines were it, burying the decision and the resizes. What a person acts
        # on is said where it happens: a change of GPUs and the outcome by the worker, with why,
        # a failing save by `saves_changed`.
        log.debug(
            "training %s run_key=%s iteration=%d/%d loss=%s it_per_s=%s gpus=%s",
            event,
            self.run_key,
            snap.iteration,
            snap.total_iterations,
            f"{snap.loss:.4f}" if snap.loss is not None else None,
            f"{snap.iterations_per_s:.3f}" if snap.iterations_per_s else None,
            snap.gpus,
        )
