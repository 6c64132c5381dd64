"""Progress published to Prefect: a progress artifact, flow-run labels and
`elasticflow.training.*` events, so the UI shows it and the scheduler can read it.

Prefect is a window onto training, not part of it. Every call goes out on a
thread of its own (`Outbox`), never on the loop that supervises the ranks: a
Prefect call waited for there held that loop, so the flow read no progress and
a run looked stalled to the scheduler while its server answered slowly (a
burst through a slow server left one run `Rescaling` for minutes). The first
failure is logged as a warning, and after it Prefect publishing pauses for
`retry_after_s` so an unreachable API is not asked again at every iteration.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from collections import deque
from typing import Any, Callable

from flows.training.coordinator.progress import ProgressSnapshot, ProgressTracker
from flows.training.segment import SegmentResult
from scheduler_service.contracts import Label, StateName, training_event

log = logging.getLogger("elasticflow.progress")

ARTIFACT_KEY = "elasticflow-training-progress"
CLOSE_S = 10.0  # at the run's end, how long what is still waiting may take to go out


class Outbox:
    """Calls made one at a time on a thread of their own, in the order given,
    except that a call with a `key` takes the place of one of the same key
    still waiting: of routine progress only the newest matters, and of two
    states only the last. Calls without a key (events) are each worth making,
    up to `MAX_WAITING` of them: beyond, the oldest go (a server that answers
    slower than a run reports must not cost the flow's memory)."""

    MAX_WAITING = 500

    def __init__(self, name: str) -> None:
        self._ready = threading.Condition()
        self._waiting: deque[tuple[str | None, Callable[[], Any]]] = deque()
        self._in_flight: str | None = None  # the key of the call being made, "" if it has none; None: idle
        self._closed = False
        self._shed = 0  # calls dropped for room, told once
        # The creator's context goes along: Prefect's settings and the flow
        # run's context (an artifact belongs to the run it is created in).
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._serve,), name=name, daemon=True)
        self._thread.start()

    def put(self, call: Callable[[], Any], key: str | None = None) -> None:
        with self._ready:
            if self._closed:
                return
            for i, (waiting_key, _) in enumerate(self._waiting):
                if key is not None and waiting_key == key:
                    self._waiting[i] = (key, call)
                    return
            if len(self._waiting) >= self.MAX_WAITING:
                oldest = next((i for i, (k, _) in enumerate(self._waiting) if k is None), None)
                if oldest is not None:
                    del self._waiting[oldest]
                    self._shed += 1
                    if self._shed == 1:
                        log.warning("Prefect is far behind: the oldest progress events are dropped")
            self._waiting.append((key, call))
            self._ready.notify_all()

    def holds(self, key: str) -> bool:
        """Whether a call of `key` waits or is being made."""
        with self._ready:
            return self._in_flight == key or any(k == key for k, _ in self._waiting)

    def flush(self, timeout_s: float) -> bool:
        """Until nothing waits and no call is being made, at most `timeout_s`;
        whether so (a test, or a caller that wants Prefect told before it goes on)."""
        end = time.monotonic() + timeout_s
        with self._ready:
            while self._waiting or self._in_flight is not None:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._ready.wait(left)
            return True

    def close(self, timeout_s: float, after: Callable[[str | None], bool], join_s: float = 120.0) -> None:
        """Take no more; let what waits go out for `timeout_s`, then drop it,
        and wait (at most `join_s`) for the call being made if `after(its
        key)` says it must not land after the caller returns (a state after
        the run's final one would reopen the run)."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()  # an idle thread ends now
        if self.flush(timeout_s):
            return
        with self._ready:
            dropped = len(self._waiting)
            self._waiting.clear()
            self._ready.notify_all()
            in_flight = self._in_flight
        if dropped:
            log.warning("Prefect is slow: %d progress updates dropped at the run's end", dropped)
        if in_flight is not None and after(in_flight):
            self._thread.join(join_s)
            if self._thread.is_alive():
                log.warning("a state change to Prefect is still unanswered after %.0f s; it may land after the "
                            "run's end", timeout_s + join_s)

    def _serve(self) -> None:
        while True:
            with self._ready:
                while not self._waiting and not self._closed:
                    self._ready.wait()
                if not self._waiting:
                    return
                key, call = self._waiting.popleft()
                self._in_flight = key if key is not None else ""
            try:
                call()
            except Exception:  # the caller's call guards itself; this thread must not die
                log.exception("Prefect call failed")
            finally:
                with self._ready:
                    self._in_flight = None
                    self._ready.notify_all()


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
        # The flow run shows a `Rescaling` state from a resize until training
        # resumes: resizes so far (this thread's count), and the last one a
        # `Running` state was shown after (the outbox's).
        self._resizes = 0
        self._resumed = 0
        self._outbox = Outbox(f"prefect-progress-{flow_run_id[:8]}")

    @property
    def enabled(self) -> bool:
        return time.time() >= self.paused_until

    def flush(self, timeout_s: float = CLOSE_S) -> bool:
        """Until every call handed over so far is made; whether in `timeout_s`."""
        return self._outbox.flush(timeout_s)

    def close(self, timeout_s: float = CLOSE_S) -> None:
        """No state may reach Prefect after this returns: the flow's own end
        sets the final one, and a `Running` after it would reopen the run."""
        self._outbox.close(timeout_s, after=lambda key: key == "state")

    def _safely(self, what: str, call: Callable[[], Any]) -> Callable[[], Any]:
        """`call` as the outbox makes it: skipped while Prefect is paused (an
        unreachable API is not asked at every iteration), never raising (Prefect
        must never fail training)."""
        def guarded() -> Any:
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
        return guarded

    # A resize shows in the run's state: the flow process sets it itself, so it
    # can never race the run's own end (the scheduler could: a state it wrote
    # after the run finished would reopen it; `close` makes sure ours do not).
    def segment_finished(self, result: SegmentResult) -> None:
        super().segment_finished(result)
        if result.reason == "stopped" and self.iteration < self.total:
            self._resizes += 1
            gpus = ",".join(map(str, result.gpus))
            how = "stopped" if result.paused else "checkpointed"  # paused ranks save only if they cannot go on
            self._outbox.put(self._safely("state", lambda: self._state(
                StateName.RESCALING.value, f"{how} at iteration {self.iteration} on GPUs {gpus}; "
                "continuing on the GPU set the scheduler chose")), key="state")

    def on_iteration(self, iteration: int, loss: float, wall_t: float) -> None:
        super().on_iteration(iteration, loss, wall_t)
        if self._resumed < self._resizes and self.enabled and not self._outbox.holds("state"):
            gpus, resize = ",".join(map(str, self.gpus)), self._resizes

            def running() -> None:
                if self._state("Running", f"training on GPUs {gpus} from iteration {iteration}"):
                    self._resumed = resize  # else asked again at an iteration after the pause

            self._outbox.put(self._safely("state", running), key="state")

    def _state(self, name: str, message: str) -> bool:
        from uuid import UUID

        from prefect.states import Running

        from elasticflow_block.prefect_client import sync_client

        with sync_client() as client:
            client.set_flow_run_state(UUID(self.flow_run_id), Running(name=name, message=message))
        return True

    def publish(
        self, snap: ProgressSnapshot, event: str, force: bool = False, extra: dict[str, object] | None = None
    ) -> None:
        super().publish(snap, event, force, extra)
        if not force and time.time() - self._last_sent < self.every_s:
            return
        self._last_sent = time.time()
        # Events are each worth sending; the artifact and labels only as they stand now.
        self._outbox.put(self._safely("artifact", lambda: self._artifact(snap)), key="artifact")
        self._outbox.put(self._safely("labels", lambda: self._labels(snap)), key="labels")
        self._outbox.put(self._safely("event", lambda: self._event(snap, event, extra)))

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

        from elasticflow_block.prefect_client import sync_client

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
        with sync_client() as client:
            client.update_flow_run_labels(UUID(self.flow_run_id), {k.value: v for k, v in labels.items()})

    def _event(self, snap: ProgressSnapshot, event: str, extra: dict[str, object] | None) -> None:
        from prefect.events import emit_event

        emit_event(
            event=training_event(event),
            resource={"prefect.resource.id": f"prefect.flow-run.{self.flow_run_id}"},
            payload={**snap.model_dump(mode="json"), **(extra or {})},
        )
