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

The program (solved with the open-source HiGHS, one thread, fixed seed, node-
and time-limited) decides how many leases each job holds in each bucket of
the future: the current lease alone, then single leases, then buckets that
double in length up to the latest deadline, split at every deadline, so it
stays small however far the deadlines are. In each bucket the leases held must
pack into the cluster (`packs`); each job must hold enough leases ending by
its deadline to finish. When earliest-deadline-first already finds such a
schedule the program would too, so the solver is called only when EDF fails;
lease renewal likewise runs EDF's first lease when EDF meets every deadline
(renewing running leases first when that still does, since a renewal costs
no restart) and the program's otherwise (with shortfalls allowed and minimized, so it
always has an answer). An admitted job whose deadline can no longer be met
even alone loses its SLO and runs best-effort.

One module, though over 400 lines: the lease buckets, the program built on
them and the renewal that reads its answer share one model of time (bucket
bounds, lease length, what "ends by the deadline" means); apart, each would
have to re-derive the others' conventions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import highspy

from scheduler_service.solver import quiet_highs
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


def buckets_until(now: float, lease: float, cuts: Iterable[int]) -> list[Bucket]:
    """The current lease, FINE_LEASES single leases, then doubling buckets up to
    the last cut, split at every cut (each job's last lease), so that within a
    bucket every job may use all of its leases or none."""
    first = math.floor(now / lease + 1e-9)
    cuts = set(cuts)
    last = max(cuts, default=first + 1)
    bounds = {c for c in cuts if c > first}
    edge, size = first + 1, 1
    while edge < last:
        bounds.add(edge)
        if edge > first + FINE_LEASES:
            size *= 2
        edge += size
    bounds.add(max(last, first + 1))
    edges = sorted(bounds)
    out = [Bucket(first, 1, (first + 1) * lease - now)]
    out += [Bucket(a, b - a, lease) for a, b in zip(edges, edges[1:])]
    return out


def usable(demand: Demand, bucket: Bucket) -> int:
    """Leases of the bucket that end by the job's deadline."""
    return max(0, min(bucket.count, demand.last_lease - bucket.first))


def packs(held: Sequence[tuple[int, int]], count: int, gpus: int, classes: Sequence[int]) -> bool:
    """Whether leases (width, leases) held in a bucket of `count` leases can fit.

    Area alone is exact for one lease (power-of-two widths always pack), but
    over many leases it lets two 8-GPU jobs share a 16-GPU cluster with a
    4-GPU job. So for every width class W, count in W-sized units: jobs at
    least W wide take w/W units per lease, and narrower jobs take at least
    one unit in every lease they run in and at least their area / W in all.
    """
    if sum(w * y for w, y in held) > gpus * count:
        return False
    for unit in classes:
        wide = sum(w // unit * y for w, y in held if w >= unit)
        narrow = [(w, y) for w, y in held if w < unit and y]
        lost = max(max((y for _, y in narrow), default=0), sum(w * y for w, y in narrow) / unit)
        if wide + lost > gpus // unit * count + 1e-9:
            return False
    return True


def alone_seconds(demand: Demand, now: float, lease: float) -> float:
    """Seconds of leases ending by the deadline, on an otherwise idle cluster."""
    first = math.floor(now / lease + 1e-9)
    if demand.last_lease <= first:
        return 0.0
    return (first + 1) * lease - now + (demand.last_lease - first - 1) * lease


def width_classes(demands: Iterable[Demand]) -> list[int]:
    widths = sorted({d.width for d in demands})
    return widths[1:]


def edf_schedule(
    demands: Sequence[Demand], buckets: Sequence[Bucket], gpus: int, renew: bool = False
) -> tuple[bool, list[str]]:
    """Earliest deadline first, as early as possible, leases packed per bucket.

    With `renew`, jobs holding a lease now keep the current one before EDF
    hands out the rest (a renewal costs no restart). Returns whether every
    demand is met and the jobs holding the current lease.
    """
    classes = width_classes(demands)
    held: list[list[tuple[int, int]]] = [[] for _ in buckets]
    left = {d.job_id: d.need for d in demands}
    now: list[str] = []
    order = sorted(demands, key=lambda d: d.order)
    if renew and buckets:
        for d in order:
            if d.running and usable(d, buckets[0]) and packs(held[0] + [(d.width, 1)], 1, gpus, classes):
                held[0].append((d.width, 1))
                left[d.job_id] -= buckets[0].seconds
                now.append(d.job_id)
    ok = True
    for d in order:
        for i, b in enumerate(buckets):
            if left[d.job_id] <= 1e-9:
                break
            if i == 0 and d.job_id in now:
                continue
            hi = min(usable(d, b), math.ceil(left[d.job_id] / b.seconds - 1e-9))
            lo = hi if packs(held[i] + [(d.width, hi)], b.count, gpus, classes) else 0
            while lo < hi:  # the most leases that still pack (packing is monotone)
                mid = (lo + hi + 1) // 2
                if packs(held[i] + [(d.width, mid)], b.count, gpus, classes):
                    lo = mid
                else:
                    hi = mid - 1
            if lo <= 0:
                continue
            held[i].append((d.width, lo))
            left[d.job_id] -= lo * b.seconds
            if i == 0:
                now.append(d.job_id)
        ok = ok and left[d.job_id] <= 1e-9
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
    (integers), an unmet demand u[j] >= 0 per job, fixed at 0 unless the job
    is in `soft`, and the units z[b, W] that `packs` charges narrow jobs.

    With nothing soft it only looks for a schedule. Otherwise it minimizes the
    unmet demand (relative to each job's need), then prefers renewing running
    leases and using the current lease.
    """
    nj, nb = len(demands), len(buckets)
    classes = width_classes(demands)
    ny = nj * nb
    nz = nb * len(classes)  # W-units lost to narrower jobs, per bucket and class
    nvar = ny + nj + nz
    lower = np.zeros(nvar)
    upper = np.full(nvar, highspy.kHighsInf)
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
    for b, bucket in enumerate(buckets):  # packing by width class, as in `packs`
        for k, unit in enumerate(classes):
            z = ny + nj + b * len(classes) + k
            narrow = [j for j, d in enumerate(demands) if d.width < unit]
            for j in narrow:  # z >= y[j, b]
                starts.append(len(index))
                index += [z, j * nb + b]
                value += [1.0, -1.0]
                rows_lo.append(0.0)
                rows_hi.append(highspy.kHighsInf)
            starts.append(len(index))  # z >= narrow area / unit
            index.append(z)
            value.append(1.0)
            for j in narrow:
                index.append(j * nb + b)
                value.append(-demands[j].width / unit)
            rows_lo.append(0.0)
            rows_hi.append(highspy.kHighsInf)
            starts.append(len(index))  # wide units + z fit the bucket
            index.append(z)
            value.append(1.0)
            for j, d in enumerate(demands):
                if d.width >= unit:
                    index.append(j * nb + b)
                    value.append(float(d.width // unit))
            rows_lo.append(-highspy.kHighsInf)
            rows_hi.append(float(gpus // unit * bucket.count))

    h = quiet_highs()
    for option, setting in (("random_seed", SEED), ("mip_max_nodes", node_limit), ("time_limit", time_limit_s)):
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
        if alone_seconds(new, now, self.lease) < new.need - 1e-9:
            earliest = (math.floor(now / self.lease + 1e-9) + math.ceil(new.need / self.lease) + 1) * self.lease
            return self._reject(job, RejectReason.INFEASIBLE_ALONE,
                                f"{new.need:.0f} s on {width} GPUs do not fit in the leases before the deadline",
                                earliest)
        admitted = [self._demand(j, status[j]) for j in sorted(self.slo)]
        if not self._admissible(admitted, new, now):
            return self._reject(job, RejectReason.INSUFFICIENT_CAPACITY,
                                f"no lease schedule on {width} GPUs meets this deadline and every admitted one",
                                self._lease_time(self._earliest_lease_end(admitted, new, now)))
        self.slo.add(job.job_id)
        return Decision(job_id=job.job_id, admitted=True, guaranteed=True, share=width,
                        message=f"a lease schedule on {width} GPUs meets every admitted deadline")

    def _lease_time(self, lease: int | None) -> float | None:
        return None if lease is None else lease * self.lease

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

