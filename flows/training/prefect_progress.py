"""Progress published to Prefect: a progress artifact, flow-run labels and
`elasticflow.training.*` events, so the UI shows it and the scheduler can read it.

Prefect is a window onto training, not part of it: every call is guarded, the
first failure is logged as a warning, and after it Prefect publishing pauses for
`retry_after_s` so an unreachable API cannot slow the supervision loop.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from flows.training.progress import ProgressSnapshot, ProgressTracker
from flows.training.segment import SegmentResult
from scheduler_service.contracts import Label, training_event

log = logging.getLogger("elasticflow.progress")

ARTIFACT_KEY = "elasticflow-training-progress"


class PrefectProgress(ProgressTracker):
    def __init__(
        self, *args: Any, flow_run_id: str, retry_after_s: float = 60.0, every_s: float = 10.0, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.flow_run_id = flow_run_id
        self.every_s = every_s  # routine progress to Prefect; segment changes always go out
        self._last_sent = 0.0
        self.artifact_id: Any = None
        self.retry_after_s = retry_after_s
        self.paused_until = 0.0
        self._rescaling = False  # the flow run shows a `Rescaling` state until training resumes

    @property
    def enabled(self) -> bool:
        return time.time() >= self.paused_until

    def _safely(self, what: str, call: Callable[[], Any]) -> Any:
        if not self.enabled:
            return None
        try:
            return call()
        except Exception as exc:  # Prefect must never fail training
            self.paused_until = time.time() + self.retry_after_s
            log.warning(
                "Prefect %s failed; progress only in logs and the status file for %.0f s: %s",
                what,
                self.retry_after_s,
                exc,
            )
            return None

    # A resize shows in the run's state: the flow process sets it itself, so it
    # can never race the run's own end (the scheduler could: a state it wrote
    # after the run finished would reopen it).
    def segment_finished(self, result: SegmentResult) -> None:
        super().segment_finished(result)
        if result.reason == "stopped" and self.iteration < self.total:
            self._rescaling = True
            gpus = ",".join(map(str, result.gpus))
            self._safely("state", lambda: self._state(
                "Rescaling", f"checkpointed at iteration {self.iteration} on GPUs {gpus}; "
                "continuing on the GPU set the scheduler chose"))

    def on_iteration(self, iteration: int, loss: float, wall_t: float) -> None:
        super().on_iteration(iteration, loss, wall_t)
        if self._rescaling and self._safely("state", lambda: self._state(
                "Running", f"training on GPUs {','.join(map(str, self.gpus))} from iteration {iteration}")):
            self._rescaling = False

    def _state(self, name: str, message: str) -> bool:
        from uuid import UUID

        from prefect.client.orchestration import get_client
        from prefect.states import Running

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(UUID(self.flow_run_id), Running(name=name, message=message))
        return True

    def publish(
        self, snap: ProgressSnapshot, event: str, force: bool = False, extra: dict[str, object] | None = None
    ) -> None:
        super().publish(snap, event, force, extra)
        if not force and time.time() - self._last_sent < self.every_s:
            return
        self._last_sent = time.time()
        self._safely("artifact", lambda: self._artifact(snap))
        self._safely("labels", lambda: self._labels(snap))
        self._safely("event", lambda: self._event(snap, event, extra))

    def _artifact(self, snap: ProgressSnapshot) -> None:
        from prefect.artifacts import create_progress_artifact, update_progress_artifact

        description = (
            f"iteration {snap.iteration}/{snap.total_iterations} on GPUs {snap.gpus}; "
            f"{(snap.iterations_per_s or 0):.2f} it/s; projected finish {snap.projected_finish}"
        )
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(
                progress=snap.percent, key=ARTIFACT_KEY, description=description
            )
        else:
            update_progress_artifact(self.artifact_id, progress=snap.percent, description=description)

    def _labels(self, snap: ProgressSnapshot) -> None:
        from uuid import UUID

        from prefect.client.orchestration import get_client

        labels: dict[Label, str] = {
            Label.ITERATION: str(snap.iteration),
            Label.TOTAL_ITERATIONS: str(snap.total_iterations),
            Label.GPUS: ",".join(map(str, snap.gpus)),
        }
        if snap.iterations_per_s:
            labels[Label.ITERATIONS_PER_S] = f"{snap.iterations_per_s:.4f}"
        if snap.projected_finish:
            labels[Label.PROJECTED_FINISH] = snap.projected_finish.isoformat()
        if snap.on_track is not None:
            labels[Label.ON_TRACK] = str(snap.on_track).lower()
        with get_client(sync_client=True) as client:
            client.update_flow_run_labels(UUID(self.flow_run_id), {k.value: v for k, v in labels.items()})

    def _event(self, snap: ProgressSnapshot, event: str, extra: dict[str, object] | None) -> None:
        from prefect.events import emit_event

        emit_event(
            event=training_event(event),
            resource={"prefect.resource.id": f"prefect.flow-run.{self.flow_run_id}"},
            payload={**snap.model_dump(mode="json"), **(extra or {})},
        )
