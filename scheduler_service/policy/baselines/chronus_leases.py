"""Chronus's lease model: buckets of future leases, what packs into one, the
earliest-deadline-first lease schedule and the mixed-integer program.

These share one model of time (bucket bounds, lease length, what "ends by
the deadline" means), so they live together; the policy (chronus.py) asks
them whether a set of SLO demands can be met and who holds the next lease.

The program (solved with the open-source HiGHS, one thread, fixed seed, node-
and time-limited) decides how many leases each job holds in each bucket of
the future: the current lease alone, then single leases, then buckets that
double in length up to the latest deadline, split at every deadline, so it
stays small however far the deadlines are. In each bucket the leases held must
pack into the cluster (`packs`); each job must hold enough leases ending by
its deadline to finish.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import highspy
import numpy as np

from scheduler_service.solver import quiet_highs

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
