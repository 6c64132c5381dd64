"""The one interface every scheduling policy implements.

`schedule(request) -> reply`, in the manner of Ray's autoscaler: the caller
(the simulator, or the Prefect service) says what happened since the last
call and where every job stands; the policy answers with decisions for the
newcomers, GPUs and a placement for every active job, and when it next wants
to be asked. Time is a parameter, never read from a clock, so the same policy
object runs in simulation and for real.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Mapping, Sequence

from pydantic import BaseModel

from scheduler_service.contracts import RejectionReason
from scheduler_service.policy.jobs import Job, JobStatus
from scheduler_service.policy.overhead import PAPER_OVERHEAD
from scheduler_service.policy.placement import BuddyPlacer, Placement
from scheduler_service.policy.plan import SlotClock
from scheduler_service.policy.topology import Topology


class Decision(BaseModel):
    """What a user is told when their job arrives."""

    job_id: str
    admitted: bool
    guaranteed: bool = False  # admitted with a plan that meets the deadline
    reason: RejectionReason | None = None
    message: str = ""
    earliest_feasible_deadline: float | None = None  # seconds, same clock as the job's
    share: int | None = None  # the MSS: the plan's GPU cap
    guaranteed_finish: float | None = None  # when the plan completes (<= deadline)


@dataclass(frozen=True, slots=True)
class SchedulingRequest:
    now: float
    arrivals: Sequence[Job] = ()
    finished: Sequence[str] = ()
    status: Mapping[str, JobStatus] = field(default_factory=dict)  # every active job


@dataclass(slots=True)
class SchedulingReply:
    decisions: list[Decision]
    allocation: dict[str, int]  # GPUs per active job (0 = waiting)
    placement: Placement
    wake_at: float | None = None  # ask again then even if nothing happens
    projected_finish: dict[str, float] = field(default_factory=dict)


class SchedulingPolicy(ABC):
    """Base class: holds the topology, the slot clock and a buddy placer."""

    name: ClassVar[str]

    def __init__(self, topology: Topology, interval: float = 60.0, overhead=PAPER_OVERHEAD) -> None:
        self.topology = topology
        self.clock = SlotClock(interval, overhead)
        self.placer = BuddyPlacer(topology)

    @abstractmethod
    def schedule(self, request: SchedulingRequest) -> SchedulingReply: ...

    def hold(self, job_id: str, gpus: tuple[int, ...]) -> bool:
        """Keep a running job where it is (a restarted service adopting it)
        unless its width changes; False if those GPUs cannot be held."""
        return self.placer.hold(job_id, gpus)

    def speed(self, job: Job, gpus: int) -> float:
        """Iterations/s the job makes on `gpus` GPUs as this policy runs it: the
        curve, unless the policy changes how jobs train (Pollux's batch size)."""
        return job.curve.speed(gpus)

    def projected_finish(
        self, jobs: Mapping[str, Job], allocation: Mapping[str, int], status: Mapping[str, JobStatus], now: float
    ) -> dict[str, float]:
        """Finish time if every job kept its new allocation from now on."""
        out: dict[str, float] = {}
        for job_id, gpus in allocation.items():
            if not gpus:
                continue
            st = status.get(job_id) or JobStatus(jobs[job_id].iterations)
            delay = st.overhead_left if gpus == st.gpus else self.clock.overhead(gpus)
            out[job_id] = now + delay + st.remaining / self.speed(jobs[job_id], gpus)
        return out

    def reply(
        self,
        request: SchedulingRequest,
        decisions: Sequence[Decision],
        allocation: dict[str, int],
        jobs: Mapping[str, Job],
        wake_at: float | None = None,
        pinned: frozenset[str] | set[str] = frozenset(),
        placement: Placement | None = None,
    ) -> SchedulingReply:
        """The reply as every policy sends it: the allocation placed as buddy
        blocks (moving `pinned` jobs only if nothing else works) and when each
        job would finish at its new width; one place, so no policy forgets a
        job that has not reported a status yet (a newcomer). A policy whose
        placement can change the allocation (ElasticFlow gives back a grant
        rather than move a job that cannot afford the restart) places it
        first and passes `placement`, with the allocation as placed."""
        status = {j: request.status.get(j) or JobStatus(jobs[j].iterations) for j in allocation}
        return SchedulingReply(
            decisions=list(decisions),
            allocation=allocation,
            placement=self.placer.place(allocation, pinned) if placement is None else placement,
            wake_at=wake_at,
            projected_finish=self.projected_finish(jobs, allocation, status, request.now),
        )
