"""Chronus (Gao et al., SoCC'21): lease-based SLO scheduling with MILP admission.

Server-centric: a job runs on exactly the GPUs it asked for, or waits. Time is
cut into leases (a multiple of the scheduling interval; 240 s by default, as
the ElasticFlow authors ran Chronus); a lease runs to its end, and at every
lease boundary each lease is renewed or taken back. A deadline (SLO) job is
admitted only if a mixed-integer program finds a lease schedule on its
requested GPU count that meets its deadline and every admitted deadline;
otherwise it is rejected at once. Jobs without a deadline are best-effort:
always admitted, and served from the GPUs the SLO jobs' leases leave free.
Run-time estimates carry Chronus's safety margin (10% by default, as in the
authors' runs) on top of the restart.

The program (chronus_leases.py, solved with the open-source HiGHS) decides
how many leases each job holds in each bucket of the future; each job must
hold enough leases ending by its deadline to finish. When
earliest-deadline-first already finds such a schedule the program would
too, so the solver is called only when EDF fails; lease renewal likewise
runs EDF's first lease when EDF meets every deadline (renewing running
leases first when that still does, since a renewal costs no restart) and
the program's otherwise (with shortfalls allowed and minimized, so it
always has an answer). An admitted job whose deadline can no longer be met
even alone loses its SLO and runs best-effort.
"""

from __future__ import annotations

import math
from typing import Mapping

from scheduler_service.policy.baselines.chronus_leases import Demand, alone_seconds, buckets_until, edf_schedule, solve
from scheduler_service.policy.baselines.edf import requested_width
from scheduler_service.policy.interface import (
    Decision,
    RejectionReason,
    SchedulingPolicy,
    SchedulingReply,
    SchedulingRequest,
)
from scheduler_service.policy.jobs import Job, JobStatus
from scheduler_service.policy.topology import Topology


class ChronusPolicy(SchedulingPolicy):
    name = "chronus"

    def __init__(
        self,
        topology: Topology,
        interval: float = 60.0,
        lease_s: float = 240.0,
        estimate_margin: float = 1.1,
        node_limit: int = 500,
        time_limit_s: float = 2.0,
        **kwargs,
    ) -> None:
        super().__init__(topology, interval, **kwargs)
        if lease_s <= 0 or estimate_margin < 1:
            raise ValueError("a lease must be positive and the estimate margin at least 1")
        self.lease = max(1, round(lease_s / interval)) * interval
        self.node_limit = node_limit
        self.time_limit_s = time_limit_s
        self.estimate_margin = estimate_margin
        self.jobs: dict[str, Job] = {}
        self.width: dict[str, int] = {}
        self.slo: set[str] = set()  # admitted deadline jobs whose deadline is still ahead

    # -- the one entry point --------------------------------------------------
    def schedule(self, request: SchedulingRequest) -> SchedulingReply:
        now = request.now
        for job_id in request.finished:
            self.jobs.pop(job_id, None)
            self.width.pop(job_id, None)
            self.slo.discard(job_id)
        self.slo = {j for j in self.slo if self.jobs[j].deadline > now}  # type: ignore[operator]
        status = dict(request.status)
        decisions = []
        for job in sorted(request.arrivals, key=lambda j: (j.submit_time, j.job_id)):
            status.setdefault(job.job_id, JobStatus(job.iterations))
            decisions.append(self._arrive(job, now, status))
        alloc, renew_next = self._renew(now, status)
        running = {j for j, g in alloc.items() if g and status[j].gpus == g}
        wake = None
        if renew_next:
            wake = (math.floor(now / self.lease + 1e-9) + 1) * self.lease
        deadlines = [d for d in (self.jobs[j].deadline for j in self.slo) if d is not None]
        if deadlines:  # a missed deadline turns the job best-effort: re-plan then
            due = math.ceil(min(deadlines) / self.clock.interval - 1e-9) * self.clock.interval
            wake = due if wake is None else min(wake, due)
        return self.reply(request, decisions, alloc, self.jobs, wake_at=wake, pinned=running)

    # -- admission ------------------------------------------------------------
    def _demand(self, job_id: str, st: JobStatus) -> Demand:
        job, width = self.jobs[job_id], self.width[job_id]
        restart = st.overhead_left if st.gpus == width else self.clock.overhead(width)
        assert job.deadline is not None
        return Demand(job_id, width, st.remaining / job.curve.speed(width) * self.estimate_margin + restart,
                      math.floor(job.deadline / self.lease + 1e-9),
                      (job.deadline, job.submit_time, job_id), st.gpus == width)

    def _arrive(self, job: Job, now: float, status: Mapping[str, JobStatus]) -> Decision:
        width = requested_width(job, self.topology)
        if not width:
            return Decision(job_id=job.job_id, admitted=False, reason=RejectionReason.NO_USABLE_GPU_COUNT,
                            message=f"no measured power-of-two GPU count up to the {job.requested_gpus} requested")
        self.jobs[job.job_id] = job
        self.width[job.job_id] = width
        if job.deadline is None:
            return Decision(job_id=job.job_id, admitted=True, share=width,
                            message="best-effort: runs on GPUs the SLO jobs' leases leave free")
        if job.deadline <= now:
            return self._reject(job, RejectionReason.DEADLINE_PASSED, "the deadline has already passed")
        new = self._demand(job.job_id, status[job.job_id])
        if alone_seconds(new, now, self.lease) < new.need - 1e-9:
            earliest = (math.floor(now / self.lease + 1e-9) + math.ceil(new.need / self.lease) + 1) * self.lease
            return self._reject(job, RejectionReason.INFEASIBLE_ALONE,
                                f"{new.need:.0f} s on {width} GPUs do not fit in the leases before the deadline",
                                earliest)
        admitted = [self._demand(j, status[j]) for j in sorted(self.slo)]
        if not self._admissible(admitted, new, now):
            return self._reject(job, RejectionReason.INSUFFICIENT_CAPACITY,
                                f"no lease schedule on {width} GPUs meets this deadline and every admitted one",
                                self._lease_time(self._earliest_lease_end(admitted, new, now)))
        self.slo.add(job.job_id)
        return Decision(job_id=job.job_id, admitted=True, guaranteed=True, share=width,
                        message=f"a lease schedule on {width} GPUs meets every admitted deadline")

    def _lease_time(self, lease: int | None) -> float | None:
        return None if lease is None else lease * self.lease

    def _reject(self, job: Job, reason: RejectionReason, message: str, earliest: float | None = None) -> Decision:
        self.jobs.pop(job.job_id, None)
        self.width.pop(job.job_id, None)
        return Decision(job_id=job.job_id, admitted=False, reason=reason, message=message,
                        earliest_feasible_deadline=earliest)

    def _admissible(self, admitted: list[Demand], new: Demand, now: float) -> bool:
        """A schedule exists for all with the newcomer; or, when the admitted jobs
        alone already fall short (restarts they did not plan for), the
        newcomer fits without making their shortfall any worse."""
        everyone = admitted + [new]
        buckets = buckets_until(now, self.lease, [d.last_lease for d in everyone])
        gpus = self.topology.num_gpus
        if edf_schedule(everyone, buckets, gpus)[0]:
            return True
        if solve(everyone, buckets, gpus, frozenset(), self.node_limit, self.time_limit_s).found:
            return True
        if not admitted or edf_schedule(admitted, buckets, gpus)[0]:
            return False
        slack = frozenset(d.job_id for d in admitted)
        before = solve(admitted, buckets, gpus, slack, self.node_limit, self.time_limit_s)
        after = solve(everyone, buckets, gpus, slack, self.node_limit, self.time_limit_s)
        return after.found and after.penalty <= before.penalty + 1e-6

    def _earliest_lease_end(self, admitted: list[Demand], new: Demand, now: float) -> int | None:
        """The earliest lease boundary that, as the newcomer's deadline, lets EDF
        meet every deadline (the admission test's first, cheapest attempt);
        None when EDF cannot meet the admitted deadlines even without it."""
        gpus = self.topology.num_gpus
        if admitted and not edf_schedule(admitted, buckets_until(now, self.lease, [d.last_lease for d in admitted]),
                                         gpus)[0]:
            return None

        def fits(last: int) -> bool:
            moved = Demand(new.job_id, new.width, new.need, last, (last * self.lease, *new.order[1:]), new.running)
            everyone = admitted + [moved]
            return edf_schedule(everyone, buckets_until(now, self.lease, [d.last_lease for d in everyone]), gpus)[0]

        lo, step = new.last_lease + 1, 1
        hi = lo
        while not fits(hi):  # past every admitted deadline plus its own run it fits
            if step > 1 << 40:
                return None
            lo, hi, step = hi + 1, hi + step, step * 2
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        return hi

    # -- lease renewal --------------------------------------------------------
    def _at_boundary(self, now: float) -> bool:
        return abs(now / self.lease - round(now / self.lease)) < 1e-9

    def _renew(self, now: float, status: Mapping[str, JobStatus]) -> tuple[dict[str, int], bool]:
        """Who holds the next lease: SLO jobs by the schedule, then the rest.

        Also says whether the next lease boundary must be a tick: when the
        schedule came from the solver, or when an SLO job waits (the schedule
        may give it the next lease)."""
        gpus = self.topology.num_gpus
        demands = []
        for job_id in sorted(self.slo):
            d = self._demand(job_id, status[job_id])
            if alone_seconds(d, now, self.lease) >= d.need - 1e-9:
                demands.append(d)
            else:  # cannot finish in time even alone: its SLO is lost, it runs best-effort
                self.slo.discard(job_id)
        solved = False
        first: list[str] = []
        # Leases run to their end: between boundaries only free GPUs are handed out.
        chosen = [] if self._at_boundary(now) else sorted(j for j, st in status.items() if st.gpus)
        if demands:
            buckets = buckets_until(now, self.lease, [d.last_lease for d in demands])
            ok, first = edf_schedule(demands, buckets, gpus, renew=True)
            if not ok:
                ok, first = edf_schedule(demands, buckets, gpus)
            if not ok:
                plan = solve(demands, buckets, gpus, frozenset(self.slo), self.node_limit, self.time_limit_s)
                if plan.found:
                    first, solved = list(plan.now), True
            chosen += first
        never = float("inf")
        rest = sorted(self.jobs.values(), key=lambda j: (j.job_id not in self.slo,
                                                          j.deadline if j.job_id in self.slo else never,
                                                          j.submit_time, j.job_id))
        alloc = {j: 0 for j in self.jobs}
        free = gpus
        for job_id in chosen + [j.job_id for j in rest]:
            width = self.width.get(job_id, 0)
            if job_id in alloc and not alloc[job_id] and width <= free:
                alloc[job_id] = width
                free -= width
        return alloc, solved or any(not alloc[d.job_id] for d in demands)

