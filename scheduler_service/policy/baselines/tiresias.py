"""Tiresias: discretized two-dimensional least-attained-service (2D-LAS).

Gu et al., NSDI'19. Tiresias knows nothing about how long a job will run, so
it ranks jobs by what they have already received: attained service in GPUs
x seconds. Ranking on a continuous value would preempt constantly, so
service is discretized into priority queues: every job enters the top queue
and drops one queue each time its attained service passes the next
threshold. Queues are served in order; within a queue, jobs already running
keep their place ahead of waiting ones (no preemption inside a queue, as in
Tiresias's simulator), then FIFO by the time the job entered the queue. Each
job runs on exactly the GPU count it asked for and only if that fits
(smaller jobs behind a blocked one may use the rest). A job that
has waited longer than `promote_knob` times the time it has run, both counted
since it arrived or was last promoted, goes back to the top queue with its
counts reset (starvation avoidance, Tiresias's PromoteKnob).

The thresholds are Tiresias's simulator defaults, which the ElasticFlow
artifact reuses: three queues split at 3,250 and 7,200 GPU-seconds.
Tiresias leaves PromoteKnob to the operator (its simulator sweeps 1 to
1,000); the default here is 8, and None turns promotion off, as in the
ElasticFlow artifact's run of Tiresias.
Placement is consolidated: every job gets one aligned buddy block.
Deadline-unaware: a deadline is never looked at.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.policy.baselines.edf import requested_width
from scheduler_service.policy.interface import (
    Decision,
    RejectionReason,
    SchedulingPolicy,
    SchedulingReply,
    SchedulingRequest,
)
from scheduler_service.policy.jobs import Job
from scheduler_service.policy.overhead import PAPER_OVERHEAD
from scheduler_service.policy.topology import Topology

DEFAULT_THRESHOLDS = (3250.0, 7200.0)  # GPU-seconds; len + 1 queues
DEFAULT_PROMOTE_KNOB = 8.0


@dataclass(slots=True)
class _State:
    """What 2D-LAS tracks per job."""

    job: Job
    width: int
    queue: int = 0
    entered: tuple[float, int] = (0.0, 0)  # (time, arrival order) it entered its queue: FIFO key
    service: float = 0.0  # attained GPU-seconds since arrival or the last promotion
    waited: float = 0.0  # seconds spent waiting since arrival or the last promotion
    gpus: int = 0  # what it holds now


class TiresiasPolicy(SchedulingPolicy):
    name = "tiresias"

    def __init__(
        self,
        topology: Topology,
        interval: float = 60.0,
        overhead=PAPER_OVERHEAD,
        thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS,
        promote_knob: float | None = DEFAULT_PROMOTE_KNOB,
    ) -> None:
        super().__init__(topology, interval, overhead)
        if list(thresholds) != sorted(thresholds) or any(t <= 0 for t in thresholds):
            raise ValueError("queue thresholds must be positive and ascending")
        self.thresholds = tuple(thresholds)
        self.promote_knob = promote_knob
        self.states: dict[str, _State] = {}
        self._last = 0.0
        self._arrived = 0

    def schedule(self, request: SchedulingRequest) -> SchedulingReply:
        now = request.now
        for job_id in request.finished:
            self.states.pop(job_id, None)
        self._account(now - self._last)
        self._last = now
        decisions = [self._admit(job, now) for job in request.arrivals]

        alloc: dict[str, int] = {}
        free = self.topology.num_gpus
        for state in sorted(self.states.values(), key=lambda s: (s.queue, not s.gpus, s.entered)):
            gpus = state.width if state.width <= free else 0
            alloc[state.job.job_id] = gpus
            state.gpus = gpus
            free -= gpus
        jobs = {j: s.job for j, s in self.states.items()}
        return self.reply(request, decisions, alloc, jobs, wake_at=self._next_jump(now))

    def _admit(self, job: Job, now: float) -> Decision:
        width = requested_width(job, self.topology)
        if not width:
            return Decision(job_id=job.job_id, admitted=False, reason=RejectionReason.NO_USABLE_GPU_COUNT,
                            message="no measured GPU count fits the request or the cluster")
        self._arrived += 1
        self.states[job.job_id] = _State(job, width, entered=(now, self._arrived))
        return Decision(job_id=job.job_id, admitted=True, share=width)

    def _account(self, span: float) -> None:
        """Charge the last `span` seconds: service to runners, waiting to the rest; then move queues."""
        if span <= 0:
            return
        last_queue = len(self.thresholds)
        for state in self.states.values():
            if state.gpus:
                state.service += state.gpus * span
                while state.queue < last_queue and state.service >= self.thresholds[state.queue] - 1e-6:
                    state.queue += 1
                    state.entered = (self._last + span, state.entered[1])
            elif state.service > 0:  # waiting before the first run is not starvation
                state.waited += span
                if self._starved(state):
                    state.queue, state.service, state.waited = 0, 0.0, 0.0
                    state.entered = (self._last + span, state.entered[1])

    def _starved(self, state: _State) -> bool:
        if self.promote_knob is None or state.queue == 0 or state.service <= 0:
            return False
        ran_for = state.service / state.width
        return state.waited >= self.promote_knob * ran_for - 1e-6

    def _next_jump(self, now: float) -> float | None:
        """The first slot boundary at which some job changes queue: a demotion or a promotion."""
        soonest: float | None = None
        last_queue = len(self.thresholds)
        for state in self.states.values():
            at: float | None = None
            if state.gpus and state.queue < last_queue:
                at = now + (self.thresholds[state.queue] - state.service) / state.gpus
            elif not state.gpus and self.promote_knob is not None and state.queue and state.service > 0:
                at = now + self.promote_knob * state.service / state.width - state.waited
            if at is not None and (soonest is None or at < soonest):
                soonest = at
        if soonest is None:
            return None
        return max(self.clock.slot_after(soonest), self.clock.slot_of(now) + 1) * self.clock.interval
