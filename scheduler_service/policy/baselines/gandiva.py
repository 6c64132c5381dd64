"""Gandiva: time-slicing with suspend/resume, packing and migration.

Xiao et al., OSDI'18. Gandiva admits every job at once on the GPU count it
asked for and, when the cluster is oversubscribed, shares it in time: jobs
are suspended and resumed round-robin, one quantum at a time, so every job
keeps making progress instead of waiting in a queue. What this module does:

- Time-slicing: jobs stand in one rotation. Each quantum, jobs are taken
  from the front while they fit (a job that does not fit lets smaller ones
  behind it run); the jobs that ran then go to the back, so the ones that
  waited run next. With room for everyone nobody is suspended and nothing
  rotates. The policy asks to be woken at every quantum boundary (a
  multiple of the interval) while anyone waits. The quantum is one
  interval by default: 60 s on the paper's traces, the period at which the
  ElasticFlow artifact's Gandiva rotates too. A suspended job pays the full
  restart when it resumes, as every job whose GPUs change does here.
- Packing: Gandiva packs jobs of the same size onto the same servers
  (affinity), which here is the buddy placer keeping same-size blocks
  together. Gandiva's other packing, two jobs sharing one GPU's memory
  and cycles, cannot be expressed: a GPU belongs to one job in our
  placements, so it is left out.
- Migration: when departures leave the free GPUs fragmented, jobs are moved
  to make an aligned block for the next one (the placer's `_make_room`).

No deadline awareness: deadlines are never read.
"""

from __future__ import annotations

from collections import deque

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


class GandivaPolicy(SchedulingPolicy):
    name = "gandiva"

    def __init__(
        self, topology: Topology, interval: float = 60.0, overhead=PAPER_OVERHEAD, quantum_slots: int = 1
    ) -> None:
        super().__init__(topology, interval, overhead)
        if quantum_slots < 1:
            raise ValueError("the quantum is a whole number of scheduling intervals, at least one")
        self.quantum = quantum_slots * interval
        self.jobs: dict[str, Job] = {}
        self.width: dict[str, int] = {}
        self.rotation: deque[str] = deque()  # front runs first
        self.running: dict[str, int] = {}
        self.next_switch: float | None = None  # the end of the current quantum

    def schedule(self, request: SchedulingRequest) -> SchedulingReply:
        now = request.now
        for job_id in request.finished:
            self.jobs.pop(job_id, None)
            self.running.pop(job_id, None)
        if request.finished:
            self.rotation = deque(j for j in self.rotation if j in self.jobs)
        decisions = [self._admit(job) for job in request.arrivals]

        if self.next_switch is not None and now >= self.next_switch - 1e-6:
            self._rotate()
            self.running = {}
        alloc = self._fill()
        waiting = any(not gpus for gpus in alloc.values())
        if not waiting:
            self.next_switch = None
        elif self.next_switch is None or now >= self.next_switch - 1e-6:
            self.next_switch = now + self.quantum

        return self.reply(request, decisions, alloc, self.jobs, wake_at=self.next_switch)

    def _admit(self, job: Job) -> Decision:
        width = requested_width(job, self.topology)
        if not width:
            return Decision(job_id=job.job_id, admitted=False, reason=RejectionReason.NO_USABLE_GPU_COUNT,
                            message="no measured GPU count fits the request or the cluster")
        self.jobs[job.job_id] = job
        self.width[job.job_id] = width
        self.rotation.append(job.job_id)
        return Decision(job_id=job.job_id, admitted=True, share=width)

    def _rotate(self) -> None:
        """End of a quantum: the jobs that ran go to the back, in their order,
        and every GPU is handed out again from the front."""
        ran = [j for j in self.rotation if self.running.get(j)]
        self.rotation = deque([j for j in self.rotation if not self.running.get(j)] + ran)

    def _fill(self) -> dict[str, int]:
        """Front to back, everyone that fits runs.

        Between quantum boundaries a job that runs keeps running: only GPUs
        that are free (departures) go to waiting jobs, so nobody is
        suspended early.
        """
        free = self.topology.num_gpus - sum(self.running.values())
        alloc: dict[str, int] = {}
        for job_id in self.rotation:
            held = self.running.get(job_id, 0)
            if held:
                alloc[job_id] = held
                continue
            width = self.width[job_id]
            alloc[job_id] = width if width <= free else 0
            free -= alloc[job_id]
        self.running = {j: g for j, g in alloc.items() if g}
        return alloc
