"""Earliest deadline first, on the GPU count each job asked for.

Server-centric: a job runs on exactly its requested GPUs or waits. `edf`
admits everything and preempts later deadlines for earlier ones; `edf-admit`
adds ElasticFlow's admission control on the fixed width (the paper's
"admission control alone matters" ablation).
"""

from __future__ import annotations

from scheduler_service.policy.elasticflow import ElasticFlowPolicy
from scheduler_service.policy.interface import (
    Decision,
    SchedulingPolicy,
    SchedulingReply,
    SchedulingRequest,
)
from scheduler_service.policy.jobs import Job
from scheduler_service.policy.topology import Topology


def requested_width(job: Job, topology: Topology) -> int:
    """The job's requested GPU count, as the largest measured power of two not above it."""
    cap = min(job.requested_gpus, topology.max_job_gpus)
    widths = [g for g, speed in job.curve.points.items() if g <= cap and speed > 0 and g & (g - 1) == 0]
    return max(widths, default=0)


class EDFPolicy(SchedulingPolicy):
    name = "edf"

    def __init__(self, topology: Topology, interval: float = 60.0, **kwargs) -> None:
        super().__init__(topology, interval, **kwargs)
        self.jobs: dict[str, Job] = {}
        self.width: dict[str, int] = {}

    def schedule(self, request: SchedulingRequest) -> SchedulingReply:
        for job_id in request.finished:
            self.jobs.pop(job_id, None)
        decisions = []
        for job in request.arrivals:
            width = requested_width(job, self.topology)
            if not width:
                decisions.append(Decision(job_id=job.job_id, admitted=False, message="no measured GPU count fits"))
                continue
            self.jobs[job.job_id] = job
            self.width[job.job_id] = width
            decisions.append(Decision(job_id=job.job_id, admitted=True, share=width))
        never = float("inf")
        order = sorted(self.jobs.values(), key=lambda j: (j.deadline if j.deadline is not None else never,
                                                          j.submit_time, j.job_id))
        free = self.topology.num_gpus
        alloc: dict[str, int] = {}
        for job in order:
            width = self.width[job.job_id]
            alloc[job.job_id] = width if width <= free else 0
            free -= alloc[job.job_id]
        return self.reply(request, decisions, alloc, self.jobs)


class EDFAdmitPolicy(ElasticFlowPolicy):
    """ElasticFlow's planner and admission, restricted to the requested width."""

    name = "edf-admit"

    def levels_for(self, job: Job) -> tuple[int, ...]:
        width = requested_width(job, self.topology)
        return (width,) if width else ()
