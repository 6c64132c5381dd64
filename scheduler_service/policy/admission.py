"""Admission control: admit a deadline job only if a plan exists that meets
its deadline without breaking any admitted job's plan.

Two attempts, cheapest first: plan the newcomer against the free timeline as
it is; if that fails, re-plan every admitted job and the newcomer in deadline
order on an empty timeline (admitted jobs that ran ahead of their plans need
less now, which can make room). A rejection says which constraint failed and
the earliest deadline that would be admitted right now.
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

    @property
    def order(self) -> tuple[float, float, str]:
        assert self.job.deadline is not None
        return (self.job.deadline, self.job.submit_time, self.job.job_id)


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
    cands: Iterable[Candidate], now_slot: int, capacity: int, clock: SlotClock
) -> tuple[Timeline, dict[str, Plan]] | str:
    """MSS plans for all candidates in deadline order on an empty timeline,
    or the id of the first job that cannot be planned."""
    timeline = Timeline(capacity, now_slot)
    plans: dict[str, Plan] = {}
    for cand in sorted(cands, key=lambda c: c.order):
        plan = plan_one(cand, now_slot, timeline, clock)
        if plan is None and cand.previous is not None and _fits(cand.previous, now_slot, timeline):
            plan = Plan(cand.previous.future(now_slot), cand.previous.share)  # keep what already worked
        if plan is None:
            return cand.job.job_id
        timeline.add(plan.runs)
        plans[cand.job.job_id] = plan
    return timeline, plans


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
    """Check a concrete placement exists at every slot where the new plan changes width."""
    for run in new.runs:
        sizes = [p.gpus_at(run.start) for p in plans.values()]
        if not placeable(sizes + [run.gpus], num_gpus):
            return False
    return True
