"""Chronus (Gao et al., SoCC'21): lease-based SLO scheduling with MILP admission.

Server-centric: a job runs on exactly the GPUs it asked for, or waits. Time is
cut into leases (a multiple of the scheduling interval); at every lease
boundary each running job's lease is renewed or taken back. A deadline (SLO)
job is admitted only if a mixed-integer program finds a lease schedule on its
requested GPU count that meets its deadline and every admitted deadline;
otherwise it is rejected at once. Jobs without a deadline are best-effort:
always admitted, and served from the GPUs the SLO jobs' leases leave free.

The program (solved with the open-source HiGHS, one thread, fixed seed, node-
and time-limited) decides how many leases each job holds in each bucket of
the future: the current lease alone, then single leases, then buckets that
double in length up to the latest deadline, so it stays small however far the
deadlines are. In each bucket the leases held must fit the cluster; each job
must hold enough leases ending by its deadline to finish, restart included.
When earliest-deadline-first already finds such a schedule the program would
too, so the solver is called only when EDF fails; lease renewal likewise runs
EDF's first lease when EDF meets every deadline and the program's otherwise
(with shortfalls allowed and minimized, so it always has an answer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import highspy
import numpy as np

from scheduler_service.policy.baselines.edf import requested_width
from scheduler_service.policy.interface import (
    Decision,
    RejectReason,
    SchedulingPolicy,
    SchedulingReply,
    SchedulingRequest,
)
from scheduler_service.policy.jobs import Job, JobStatus
from scheduler_service.policy.topology import Topology

# Leases of length one before the buckets start doubling.
FINE_LEASES = 8
# Weight of one second of unmet demand against everything else the renewal
# program prefers (renewing running leases, starting work early).
SHORTFALL_WEIGHT = 1e3
SEED = 0


@dataclass(frozen=True, slots=True)
class Bucket:
    """Leases [first, first + count) of the future; the first may be partly gone."""

    first: int
    count: int
    seconds: float  # usable seconds of each lease in the bucket


@dataclass(frozen=True, slots=True)
class Demand:
    """One SLO job as the program sees it."""

    job_id: str
    width: int
    need: float  # seconds of running still required, restart included
    last_lease: int  # leases < last_lease end by the deadline
    order: tuple[float, float, str]
    running: bool


def buckets_until(now: float, lease: float, last: int) -> list[Bucket]:
    """The current lease, FINE_LEASES single leases, then doubling buckets up to lease `last`."""
    first = math.floor(now / lease + 1e-9)
    out = [Bucket(first, 1, (first + 1) * lease - now)]
    start, size = first + 1, 1
    while start < last:
        if start > first + FINE_LEASES:
            size *= 2
        out.append(Bucket(start, min(size, last - start), lease))
        start += out[-1].count
    return out


def usable(demand: Demand, bucket: Bucket) -> int:
    """Leases of the bucket that end by the job's deadline."""
    return max(0, min(bucket.count, demand.last_lease - bucket.first))


def edf_schedule(demands: Sequence[Demand], buckets: Sequence[Bucket], gpus: int) -> tuple[bool, list[str]]:
    """Earliest deadline first, as early as possible, on lease-GPU area per bucket.

    Returns whether every demand is met and the jobs holding the current lease.
    """
    area = [gpus * b.count for b in buckets]
    now: list[str] = []
    ok = True
    for d in sorted(demands, key=lambda d: d.order):
        left = d.need
        for i, b in enumerate(buckets):
            if left <= 1e-9:
                break
            take = min(usable(d, b), area[i] // d.width, math.ceil(left / b.seconds - 1e-9))
            if take <= 0:
                continue
            area[i] -= take * d.width
            left -= take * b.seconds
            if i == 0:
                now.append(d.job_id)
        ok = ok and left <= 1e-9
    return ok, now


@dataclass(frozen=True, slots=True)
class Solution:
    found: bool  # a schedule within the constraints (hard demands met)
    penalty: float  # unmet demand, as a fraction of each soft job's need, summed
    now: tuple[str, ...]  # jobs holding the current lease


def solve(
    demands: Sequence[Demand],
    buckets: Sequence[Bucket],
    gpus: int,
    soft: frozenset[str],
    node_limit: int,
    time_limit_s: float,
) -> Solution:
    """The lease program. Variables: leases y[j, b] of job j in bucket b
    (integers), and an unmet demand u[j] >= 0 per job, fixed at 0 unless
    the job is in `soft`.

    With nothing soft it only looks for a schedule. Otherwise it minimizes the
    unmet demand (relative to each job's need), then prefers renewing running
    leases and using the current lease.
    """
    nj, nb = len(demands), len(buckets)
    ny = nj * nb
    nvar = ny + nj
    lower = np.zeros(nvar)
    upper = np.empty(nvar)
    cost = np.zeros(nvar)
    for j, d in enumerate(demands):
        for b, bucket in enumerate(buckets):
            upper[j * nb + b] = usable(d, bucket)
        upper[ny + j] = d.need if d.job_id in soft else 0.0
        if soft:
            cost[ny + j] = SHORTFALL_WEIGHT / d.need
            cost[j * nb] = -(2.0 if d.running else 1.0)
    rows_lo, rows_hi, starts, index, value = [], [], [], [], []
    for b, bucket in enumerate(buckets):  # leases held fit the cluster
        starts.append(len(index))
        for j, d in enumerate(demands):
            index.append(j * nb + b)
            value.append(float(d.width))
        rows_lo.append(-highspy.kHighsInf)
        rows_hi.append(float(gpus * bucket.count))
    for j, d in enumerate(demands):  # each job gets its need by its deadline
        starts.append(len(index))
        for b, bucket in enumerate(buckets):
            index.append(j * nb + b)
            value.append(bucket.seconds)
        index.append(ny + j)
        value.append(1.0)
        rows_lo.append(d.need)
        rows_hi.append(highspy.kHighsInf)

    h = highspy.Highs()
    for option, setting in (("output_flag", False), ("threads", 1), ("random_seed", SEED),
                            ("mip_max_nodes", node_limit), ("time_limit", time_limit_s)):
        h.setOptionValue(option, setting)
    h.addVars(nvar, lower, upper)
    h.changeColsCost(nvar, np.arange(nvar, dtype=np.int32), cost)
    h.changeColsIntegrality(ny, np.arange(ny, dtype=np.int32),
                            np.array([highspy.HighsVarType.kInteger] * ny))
    h.addRows(len(rows_lo), np.array(rows_lo), np.array(rows_hi), len(index),
              np.array(starts, dtype=np.int32), np.array(index, dtype=np.int32), np.array(value))
    h.run()
    if h.getInfo().primal_solution_status != 2:  # no feasible point found
        return Solution(False, math.inf, ())
    x = h.getSolution().col_value
    penalty = sum(x[ny + j] / d.need for j, d in enumerate(demands))
    now = tuple(d.job_id for j, d in enumerate(demands) if x[j * nb] > 0.5)
    return Solution(True, penalty, now)


class ChronusPolicy(SchedulingPolicy):
    name = "chronus"

    def __init__(
        self,
        topology: Topology,
        interval: float = 60.0,
        lease_intervals: int = 1,
        node_limit: int = 500,
        time_limit_s: float = 2.0,
        **kwargs,
    ) -> None:
        super().__init__(topology, interval, **kwargs)
        if lease_intervals < 1:
            raise ValueError("a lease is a positive number of scheduling intervals")
        self.lease = interval * lease_intervals
        self.node_limit = node_limit
        self.time_limit_s = time_limit_s
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
        alloc, solved = self._renew(now, status)
        running = {j for j, g in alloc.items() if g and status[j].gpus == g}
        wake = None
        if solved:
            wake = (math.floor(now / self.lease + 1e-9) + 1) * self.lease
        deadlines = [self.jobs[j].deadline for j in self.slo]
        if deadlines:  # a missed deadline turns the job best-effort: re-plan then
            due = math.ceil(min(deadlines) / self.clock.interval - 1e-9) * self.clock.interval  # type: ignore[arg-type]
            wake = due if wake is None else min(wake, due)
        return SchedulingReply(
            decisions=decisions,
            allocation=alloc,
            placement=self.placer.place(alloc, pinned=running),
            wake_at=wake,
            projected_finish=self.projected_finish(self.jobs, alloc, status, now),
        )

    # -- admission ------------------------------------------------------------
    def _demand(self, job_id: str, st: JobStatus) -> Demand:
        job, width = self.jobs[job_id], self.width[job_id]
        restart = st.overhead_left if st.gpus == width else self.clock.overhead(width)
        assert job.deadline is not None
        return Demand(job_id, width, st.remaining / job.curve.speed(width) + restart,
                      math.floor(job.deadline / self.lease + 1e-9),
                      (job.deadline, job.submit_time, job_id), st.gpus == width)

    def _arrive(self, job: Job, now: float, status: Mapping[str, JobStatus]) -> Decision:
        width = requested_width(job, self.topology)
        if not width:
            return Decision(job_id=job.job_id, admitted=False, reason=RejectReason.NO_USABLE_GPU_COUNT,
                            message=f"no measured power-of-two GPU count up to the {job.requested_gpus} requested")
        self.jobs[job.job_id] = job
        self.width[job.job_id] = width
        if job.deadline is None:
            return Decision(job_id=job.job_id, admitted=True, share=width,
                            message="best-effort: runs on GPUs the SLO jobs' leases leave free")
        if job.deadline <= now:
            return self._reject(job, RejectReason.DEADLINE_PASSED, "the deadline has already passed")
        new = self._demand(job.job_id, status[job.job_id])
        alone = buckets_until(now, self.lease, new.last_lease)
        if not edf_schedule([new], alone, self.topology.num_gpus)[0]:
            earliest = (alone[0].first + math.ceil(new.need / self.lease) + 1) * self.lease
            return self._reject(job, RejectReason.INFEASIBLE_ALONE,
                                f"{new.need:.0f} s on {width} GPUs do not fit in the leases before the deadline",
                                earliest)
        admitted = [self._demand(j, status[j]) for j in sorted(self.slo)]
        if not self._admissible(admitted, new, now):
            return self._reject(job, RejectReason.INSUFFICIENT_CAPACITY,
                                f"no lease schedule on {width} GPUs meets this deadline and every admitted one")
        self.slo.add(job.job_id)
        return Decision(job_id=job.job_id, admitted=True, guaranteed=True, share=width,
                        message=f"a lease schedule on {width} GPUs meets every admitted deadline")

    def _reject(self, job: Job, reason: RejectReason, message: str, earliest: float | None = None) -> Decision:
        self.jobs.pop(job.job_id, None)
        self.width.pop(job.job_id, None)
        return Decision(job_id=job.job_id, admitted=False, reason=reason, message=message,
                        earliest_feasible_deadline=earliest)

    def _admissible(self, admitted: list[Demand], new: Demand, now: float) -> bool:
        """A schedule exists for all with the newcomer; or, when the admitted jobs
        alone already fall short (restarts they did not plan for), the
        newcomer fits without making their shortfall any worse."""
        everyone = admitted + [new]
        buckets = buckets_until(now, self.lease, max(d.last_lease for d in everyone))
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

    # -- lease renewal --------------------------------------------------------
    def _renew(self, now: float, status: Mapping[str, JobStatus]) -> tuple[dict[str, int], bool]:
        """Who holds the next lease: SLO jobs by the schedule, then the rest."""
        gpus = self.topology.num_gpus
        demands = []
        for job_id in sorted(self.slo):
            d = self._demand(job_id, status[job_id])
            if edf_schedule([d], buckets_until(now, self.lease, d.last_lease), gpus)[0]:
                demands.append(d)
            else:  # cannot finish in time even alone: its SLO is lost, it runs best-effort
                self.slo.discard(job_id)
        solved = False
        chosen: list[str] = []
        if demands:
            buckets = buckets_until(now, self.lease, max(d.last_lease for d in demands))
            ok, chosen = edf_schedule(demands, buckets, gpus)
            if not ok:
                plan = solve(demands, buckets, gpus, frozenset(self.slo), self.node_limit, self.time_limit_s)
                if plan.found:
                    chosen, solved = list(plan.now), True
        never = float("inf")
        rest = sorted(self.jobs.values(), key=lambda j: (j.job_id not in self.slo,
                                                          j.deadline if j.job_id in self.slo else never,
                                                          j.submit_time, j.job_id))
        alloc = {j: 0 for j in self.jobs}
        free = gpus
        for job_id in chosen + [j.job_id for j in rest]:
            width = self.width[job_id]
            if not alloc[job_id] and width <= free:
                alloc[job_id] = width
                free -= width
        return alloc, solved

