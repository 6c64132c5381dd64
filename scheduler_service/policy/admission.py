"""Admission control: admit a deadline job only if a plan exists that meets
its deadline without breaking any admitted job's plan.

Two attempts, cheapest first: plan the newcomer against the free timeline as
it is; if that fails, re-plan every admitted job and the newcomer on an
empty timeline (admitted jobs that ran ahead of their plans need less now,
which can make room). A rejection says which constraint failed and the
earliest deadline that would be admitted right now.

The re-plan goes in order of least laxity (time to the deadline less the
time the rest takes at the widest level), not of deadline: a job due later
that cannot wait is planned before one due sooner that can, so the jobs
with room to move are the ones laid around the others. On 100 generated
traces that admits 0.01-0.09 more of the jobs than deadline order at every
load, with the same guarantee (docs/scheduling.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping

from scheduler_service.policy.jobs import Job, JobStatus
from scheduler_service.policy.placement import BuddyAllocator
from scheduler_service.policy.plan import COVER_SLACK, Plan, SlotClock, fill, minimum_satisfactory_share
from scheduler_service.policy.timeline import Timeline


@dataclass(frozen=True, slots=True)
class Candidate:
    """A deadline job with where it stands now, ready to be planned.

    `slack` is how many iterations beyond the remaining ones its plan must
    cover: a newcomer gets a migration allowance; an admitted job keeps what
    it still has, so re-planning never asks more of it than its current plan
    gives. `previous` is that plan, the fallback when re-planning fails.
    """

    job: Job
    status: JobStatus
    levels: tuple[int, ...]
    slack: float = 0.0
    previous: Plan | None = None

    @property
    def need(self) -> float:
        return self.status.remaining + self.slack

    def laxity(self, now: float) -> float:
        """Seconds the job can still wait and finish at its widest level."""
        assert self.job.deadline is not None
        return self.job.deadline - now - self.need / self.job.curve.speed(self.levels[-1])

    def order(self, now: float) -> tuple[float, float, float, str]:
        """Re-plans go least laxity first; ties by deadline, then arrival."""
        assert self.job.deadline is not None
        return (self.laxity(now), self.job.deadline, self.job.submit_time, self.job.job_id)


def migration_allowance(job: Job, levels: tuple[int, ...], clock: SlotClock) -> float:
    """Iterations one unplanned restart can cost the job (a migration forced by
    fragmentation). New plans carry this much slack so a move never breaks them."""
    speed = job.curve.points
    return max(speed[g] * clock.overhead(g) for g in levels)


def plan_one(cand: Candidate, now_slot: int, timeline: Timeline, clock: SlotClock) -> Plan | None:
    assert cand.job.deadline is not None
    st = cand.status
    return minimum_satisfactory_share(
        cand.job.curve, cand.levels, cand.need, now_slot, cand.job.deadline,
        timeline, st.gpus, st.overhead_left, clock,
    )


def plan_all(
    cands: Iterable[Candidate], now_slot: int, capacity: int, clock: SlotClock, base: Timeline | None = None
) -> tuple[Timeline, dict[str, Plan]] | str:
    """MSS plans for all candidates, least laxity first, on `base` (what
    jobs left out of the re-plan hold) or an empty timeline; or the id of the
    first job that cannot be planned."""
    timeline = Timeline(capacity, now_slot) if base is None else base
    now = now_slot * clock.interval
    plans: dict[str, Plan] = {}
    for cand in sorted(cands, key=lambda c: c.order(now)):
        plan = plan_one(cand, now_slot, timeline, clock)
        if plan is None and cand.previous is not None and _fits(cand.previous, now_slot, timeline):
            plan = Plan(cand.previous.future(now_slot), cand.previous.share)  # keep what already worked
        if plan is None:
            return cand.job.job_id
        timeline.add(plan.runs)
        plans[cand.job.job_id] = plan
    return timeline, plans


def displace(
    cand: Candidate, movable: Iterable[Candidate], now_slot: int, timeline: Timeline, clock: SlotClock
) -> tuple[Timeline, dict[str, Plan]] | str:
    """Make room for `cand` by re-planning a few admitted jobs with later
    deadlines (`movable`, most promising first, each with its current plan
    as `previous`): take their plans out one by one until the newcomer fits,
    then re-plan them, least laxity first, around it. Costs a few plans, not
    one per admitted job; returns the newcomer's id if that does not work."""
    work = timeline.copy()
    removed: list[Candidate] = []
    for other in movable:
        assert other.previous is not None
        work.add(other.previous.runs, sign=-1, since=now_slot)
        removed.append(other)
        plan = plan_one(cand, now_slot, work, clock)
        if plan is None:
            continue
        trial = work.copy()
        trial.add(plan.runs)
        plans = {cand.job.job_id: plan}
        for moved in sorted(removed, key=lambda c: c.order(now_slot * clock.interval)):
            again = plan_one(moved, now_slot, trial, clock)
            if again is None:
                break
            trial.add(again.runs)
            plans[moved.job.job_id] = again
        else:
            return trial, plans
    return cand.job.job_id


def _fits(plan: Plan, now_slot: int, timeline: Timeline) -> bool:
    for run in plan.future(now_slot):
        start = max(run.start, now_slot)
        if any(free < run.gpus for _, _, free in timeline.backward(start, run.end)):
            return False
    return True


def earliest_deadline(cand: Candidate, now_slot: int, timeline: Timeline, clock: SlotClock) -> float:
    """The earliest slot boundary that, as a deadline, the job could be admitted with."""
    job, st = cand.job, cand.status
    top = cand.levels[-1]
    total = cand.need  # as plan_one asks

    def ok(end_slot: int) -> bool:
        _, work = fill(job.curve, cand.levels, total, now_slot, end_slot * clock.interval, top,
                       timeline, st.gpus, st.overhead_left, clock)
        return work >= total * (1 + COVER_SLACK)

    alone_s = total / job.curve.speed(top) + clock.overhead(top)
    lo = now_slot + 1
    hi = max(timeline.last_change, now_slot) + math.ceil(alone_s / clock.interval) + 1
    while not ok(hi):  # reservations can leave too little even past their end only if capacity < top
        hi = 2 * hi - now_slot
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo * clock.interval


def placeable(sizes: Iterable[int], num_gpus: int) -> bool:
    """Whether these power-of-two GPU counts fit the cluster as aligned blocks."""
    alloc = BuddyAllocator(num_gpus)
    return all(alloc.take(size) is not None for size in sorted((s for s in sizes if s), reverse=True))


def placeable_throughout(new: Plan, plans: Mapping[str, Plan], num_gpus: int) -> bool:
    """Check a concrete placement exists at every slot where the new plan changes width.

    On a power-of-two cluster any power-of-two sizes that sum to at most its
    GPUs pack as aligned blocks (largest first), and the timeline already
    bounds the sum, so there is nothing to check; that matters at 10,000
    admitted jobs, where the check walks every plan for every run.
    """
    if num_gpus & (num_gpus - 1) == 0:
        return True
    for run in new.runs:
        sizes = [p.gpus_at(run.start) for p in plans.values()]
        if not placeable(sizes + [run.gpus], num_gpus):
            return False
    return True
