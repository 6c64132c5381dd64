"""Greedy allocation of spare GPUs, by least extra GPU-time per added GPU.

Each admitted job first gets what its plan reserves for now. Spare GPUs then
go, one doubling at a time, to the job for which the doubling costs the least
extra GPU-time (throughput is concave, so every doubling costs more than the
one before: diminishing returns). A job that already runs at a width keeps it
first when it can, because every change costs a restart.

Extra GPUs must never endanger a deadline. A grant is safe when the job's plan
still covers its remaining iterations after paying for the restart the grant
causes now and for one more restart when the grant is taken back later; the
simulator's tests check that every admitted job meets its deadline. A job
whose plan gives it nothing now is the exception: taking spare GPUs back
leaves it where its plan left it, so it needs no slack, only GPUs that stay
unclaimed for longer than a start.
"""

from __future__ import annotations

import heapq
from typing import Callable, Collection, Mapping

from scheduler_service.policy.jobs import Job, JobStatus
from scheduler_service.policy.placement import Block
from scheduler_service.policy.plan import Plan, SlotClock, cover
from scheduler_service.policy.timeline import Timeline


def step_cost(job: Job, levels: tuple[int, ...], remaining: float, have: int, want: int) -> float:
    """Extra GPU-seconds per added GPU of running the rest at `want` instead of `have`."""
    speed = job.curve.points
    base = have / speed[have] if have else levels[0] / speed[levels[0]]
    return remaining * (want / speed[want] - base) / (want - have)


def next_level(levels: tuple[int, ...], have: int) -> int | None:
    for level in levels:
        if level > have:
            return level
    return None


def keep(order: list[str], status: Mapping[str, JobStatus], alloc: dict[str, int], spare: int,
         safe: Callable[[str, int], bool]) -> int:
    """Each job in `order` keeps the width it runs at, if the spare GPUs
    cover it: every change costs a restart. Mutates `alloc`; returns the
    GPUs still spare."""
    for job_id in order:
        have, current = alloc.get(job_id, 0), status[job_id].gpus
        if current > have and current - have <= spare and safe(job_id, current):
            alloc[job_id] = current
            spare -= current - have
    return spare


def grow(
    order: list[str],
    jobs: Mapping[str, Job],
    levels: Mapping[str, tuple[int, ...]],
    status: Mapping[str, JobStatus],
    alloc: dict[str, int],
    spare: int,
    safe: Callable[[str, int], bool],
) -> int:
    """Keep current widths where possible, then hand out the rest greedily.

    `order` breaks ties (and sets who keeps first). Mutates `alloc`; returns
    the GPUs still spare.
    """
    spare = keep(order, status, alloc, spare, safe)
    heap: list[tuple[float, int, str, int]] = []
    for rank, job_id in enumerate(order):
        want = next_level(levels[job_id], alloc.get(job_id, 0))
        if want is not None:
            have = alloc.get(job_id, 0)
            cost = step_cost(jobs[job_id], levels[job_id], status[job_id].remaining, have, want)
            heap.append((cost, rank, job_id, want))
    heapq.heapify(heap)
    while heap and spare > 0:
        _, rank, job_id, want = heapq.heappop(heap)
        have = alloc.get(job_id, 0)
        if want - have > spare or not safe(job_id, want):
            continue
        alloc[job_id] = want
        spare -= want - have
        nxt = next_level(levels[job_id], want)
        if nxt is not None:
            cost = step_cost(jobs[job_id], levels[job_id], status[job_id].remaining, want, nxt)
            heapq.heappush(heap, (cost, rank, job_id, nxt))
    return spare


def grant_is_safe(job: Job, plan: Plan, st: JobStatus, gpus: int, slot: int, clock: SlotClock,
                  unclaimed_s: float = 0.0) -> bool:
    """Running the job on `gpus` GPUs from `slot` keeps its plan sufficient:
    the plan still covers what is left after the restart this causes now and
    one more for when the grant is taken back. `unclaimed_s`: how long no
    plan claims that many GPUs from now (the free timeline)."""
    assert job.deadline is not None
    if unclaimed_s > clock.overhead(gpus) and waits_for_its_plan(job, plan, st, slot, clock):
        # Taking spare GPUs back leaves it as it is now, idle with less to do,
        # and its plan's first start is charged already: no slack is needed,
        # only GPUs that no plan claims before a start is paid (granted for
        # less, the starts and parks are churn the others pay for; such a
        # grant is then judged as any other, below). Asking for two restarts'
        # worth of slack kept a 60-iteration run idle on an idle cluster for
        # ten minutes, its plan at the end of its window.
        return True
    speed, overhead = job.curve.points, clock.overhead
    have = cover(plan, job.curve, slot, job.deadline, st.gpus, st.overhead_left, clock)
    now_cost = speed[gpus] * (st.overhead_left if gpus == st.gpus else overhead(gpus))
    later_cost = max((speed[r.gpus] * overhead(r.gpus) for r in plan.runs if r.end > slot), default=0.0)
    # A grant lasts at least one interval (callers decide at most once per
    # interval), in which the job outruns its plan by this much:
    ahead = (speed[gpus] - job.curve.speed(plan.gpus_at(slot))) * clock.interval
    return st.remaining + now_cost + later_cost <= have + ahead


def falls_short(job: Job, plan: Plan, st: JobStatus, slot: int, clock: SlotClock) -> bool:
    """Its plan no longer covers what is left, from where it stands (it
    started or ran slower than planned, and no re-plan found it room; or it
    caught up on a grant, and handed back now it would not)."""
    assert job.deadline is not None
    return cover(plan, job.curve, slot, job.deadline, st.gpus, st.overhead_left, clock) < st.remaining


def grant_rescues(job: Job, plan: Plan, st: JobStatus, gpus: int, slot: int, clock: SlotClock,
                  unclaimed_s: float) -> bool:
    """A grant beyond the plan to a job that falls short on it: it misses on
    its plan whatever it gets, so the grant cannot cost it a guarantee, and it
    is its one chance not to miss; worth it if it does more work, start paid,
    in the time no plan claims the GPUs than the job does where it is.
    Refused such grants as unsafe, a run of a CI burst that started a minute
    late was parked and sat beside two idle GPUs until its deadline passed."""
    planned = plan.gpus_at(slot)
    if gpus <= planned or not falls_short(job, plan, st, slot, clock):
        return False
    # Against what it would do without the grant: its plan's width now, a start paid if it is not
    # there. Measured against the width it holds, keeping that width was never worth it, and a run
    # behind a plan that had ended (it thought the run done) was parked beside the four idle GPUs it
    # had just trained on.
    def work(width: int) -> float:
        if not width:
            return 0.0
        start = st.overhead_left if width == st.gpus else clock.overhead(width)
        return job.curve.speed(width) * max(0.0, unclaimed_s - start)

    return work(gpus) > work(planned)


def waits_for_its_plan(job: Job, plan: Plan, st: JobStatus, slot: int, clock: SlotClock) -> bool:
    """Its plan gives it nothing now and, started from nothing, still covers
    what is left: whatever spare GPUs it runs on until then are not its plan's."""
    assert job.deadline is not None
    return plan.gpus_at(slot) == 0 and cover(plan, job.curve, slot, job.deadline, 0, 0.0, clock) >= st.remaining


def unclaimed_s(timeline: Timeline, slot: int, gpus: int, clock: SlotClock) -> float:
    """How long, from `slot`, no plan claims `gpus` GPUs (only as far as it
    takes to tell whether a start on them would be paid off)."""
    needed = int(clock.overhead(gpus) // clock.interval) + 2
    return timeline.free_for(slot, gpus, slot + needed) * clock.interval


def affords_restarts(
    job: Job, plan: Plan, st: JobStatus, gpus: int, slot: int, clock: SlotClock, restarts: int = 1
) -> bool:
    """Whether the job, running on `gpus` GPUs now, could absorb `restarts`
    unplanned restarts (migrations) and still meet its plan: what placement
    asks before it moves the job."""
    assert job.deadline is not None
    if waits_for_its_plan(job, plan, st, slot, clock):
        return True  # on spare GPUs its plan does not need: moved or parked, it is where its plan left it
    need = st.remaining + (restarts - 1) * job.curve.points[gpus] * clock.overhead(gpus)
    if gpus == plan.gpus_at(slot):
        # Following the plan, but paying a fresh restart for the run under way.
        return cover(plan, job.curve, slot, job.deadline, -1, 0.0, clock) >= need
    return grant_is_safe(job, plan, JobStatus(need, -1, 0.0), gpus, slot, clock)


def cannot_afford_restarts(
    guaranteed: Collection[str], jobs: Mapping[str, Job], plans: Mapping[str, Plan], alloc: Mapping[str, int],
    status: Mapping[str, JobStatus], slot: int, clock: SlotClock, restarts: int = 1,
) -> set[str]:
    """Guaranteed jobs that stay at their width and could not absorb
    `restarts` unplanned restarts (migrations) now: placement moves them last."""
    pinned = set()
    for job_id in guaranteed:
        gpus, st = alloc.get(job_id, 0), status[job_id]
        if gpus and gpus == st.gpus and not affords_restarts(jobs[job_id], plans[job_id], st, gpus, slot, clock,
                                                             restarts):
            pinned.add(job_id)
    return pinned


def growth_blocks(blocks: Mapping[str, Block], plans: Mapping[str, Plan], guaranteed: Collection[str],
                  slot: int) -> dict[str, Block]:
    """For each placed guaranteed job whose plan grows later, the aligned
    block it will grow into around where it is: a job put there now would be
    moved when it grows (placement keeps newcomers out of it, BuddyPlacer.place)."""
    growing = {}
    for job_id, (start, size) in blocks.items():
        plan = plans.get(job_id)
        if job_id not in guaranteed or plan is None:
            continue
        wider = max((r.gpus for r in plan.future(slot + 1)), default=0)
        if wider > size:
            growing[job_id] = (start - start % wider, wider)
    return growing


def narrower_for_now(
    alloc: Mapping[str, int], status: Mapping[str, JobStatus], levels: Mapping[str, tuple[int, ...]],
    movable: Collection[str], safe: Callable[[str, int], bool],
) -> tuple[str, int] | None:
    """The plans themselves would move a pinned job (fragmentation). Undo it
    by running some job narrower than its plan for now, if one can afford
    that: a planned growth postponed, or a job that moves anyway at the level
    below. Widest first; None if no job can."""
    options = []
    for job_id, gpus in alloc.items():
        current = status[job_id].gpus
        if 0 < current < gpus:
            options.append((job_id, current))
        elif job_id in movable:
            below = [g for g in levels[job_id] if g < gpus]
            if below:
                options.append((job_id, below[-1]))
    options.sort(key=lambda o: (-alloc[o[0]], o[0]))
    return next(((j, g) for j, g in options if safe(j, g)), None)
