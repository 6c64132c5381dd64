"""Plans and the Minimum Satisfactory Share (MSS).

A plan says how many GPUs a job holds in each future slot. The MSS is found
by the paper's progressive filling: at a cap q, walk the free timeline
backwards from the deadline, taking min(q, what is free) in each slot, until
the job's remaining iterations are covered; the smallest q that covers is the
MSS. Because throughput is concave in GPUs, fewer GPUs for longer is the
cheapest plan in GPU-time.

The plan then reserved is that share moved forward, as the authors'
simulator lays it out: the level below q from now until where the filled
plan starts, q after, ending as soon as the work is covered. A plan filled
backwards holds the slots just before its deadline, which are the ones that
jobs arriving later with similar deadlines need; moved forward it uses what
is free now and hands the future back early. On 100 generated traces that
is worth 0.03-0.21 of deadline ratio at every load (docs/scheduling.md).

Every maximal run of constant width pays one restart overhead at its start,
except a run that begins now at the width the job already runs at. Charging
that conservatively is what lets an admitted plan hold when it is executed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

from scheduler_service.policy.jobs import ThroughputCurve

if TYPE_CHECKING:
    from scheduler_service.policy.timeline import Timeline

# Relative slack on every coverage test, so float rounding never turns an
# exactly-covered plan into a deadline miss.
COVER_SLACK = 1e-9
# Plans are built to cover a little more than the test asks, so the test holds
# even at epoch-seconds magnitudes where a float second is only ~1e-7 exact.
FILL_MARGIN = 1e-6


@dataclass(frozen=True, slots=True)
class Stretch:
    """`gpus` GPUs held over slots [start, end)."""

    start: int
    end: int
    gpus: int


@dataclass(frozen=True, slots=True)
class Plan:
    runs: tuple[Stretch, ...]  # ascending, non-overlapping; gaps hold nothing
    share: int  # the cap q that produced it: the job's MSS level

    def gpus_at(self, slot: int) -> int:
        for run in self.runs:
            if run.start <= slot < run.end:
                return run.gpus
            if run.start > slot:
                break
        return 0

    def next_rise(self, slot: int, above: int) -> int | None:
        """First slot after `slot` where the plan wants more than `above` GPUs."""
        for run in self.runs:
            if run.end > slot + 1 and run.gpus > above:
                return max(run.start, slot + 1)
        return None

    @property
    def end(self) -> int:
        return self.runs[-1].end if self.runs else 0

    def future(self, slot: int) -> tuple[Stretch, ...]:
        return tuple(r for r in self.runs if r.end > slot)


Overhead = Callable[[int], float]  # seconds of restart for a job moving to that many GPUs


@dataclass(frozen=True, slots=True)
class SlotClock:
    """Slot length and restart cost: the two facts that turn runs into work."""

    interval: float
    overhead: Overhead

    def slot_of(self, seconds: float) -> int:
        x = seconds / self.interval
        return math.floor(x + 1e-12 * max(1.0, abs(x)))  # a hair below a boundary is on it

    def slot_after(self, seconds: float) -> int:
        """The first slot boundary at or after `seconds`."""
        x = seconds / self.interval
        return math.ceil(x - 1e-12 * max(1.0, abs(x)))


def floor_level(levels: tuple[int, ...], gpus: int) -> int:
    for level in reversed(levels):
        if level <= gpus:
            return level
    return 0


def _work(curve: ThroughputCurve, gpus: int, seconds: float, charge: float) -> float:
    return curve.points[gpus] * max(0.0, seconds - charge)


def _span(start: int, end: int, deadline: float, dt: float) -> float:
    """Usable seconds of slots [start, end) before the deadline, computed from
    slot counts so that large absolute times lose no precision."""
    return (end - start) * dt - max(0.0, end * dt - deadline)


def cover(
    plan: Plan,
    curve: ThroughputCurve,
    now_slot: int,
    deadline: float,
    current_gpus: int,
    overhead_left: float,
    clock: SlotClock,
) -> float:
    """Iterations the plan delivers from `now_slot` to the deadline.

    A run already under way at the job's current width is charged only the
    unpaid rest of its restart; every other run pays a full restart.
    """
    dt = clock.interval
    total = 0.0
    for run in plan.runs:
        if run.end <= now_slot:
            continue
        start = max(run.start, now_slot)
        seconds = _span(start, run.end, deadline, dt)
        if start == now_slot and run.gpus == current_gpus:
            charge = overhead_left
        else:
            charge = clock.overhead(run.gpus)
        total += _work(curve, run.gpus, seconds, charge)
    return total


def fill(
    curve: ThroughputCurve,
    levels: tuple[int, ...],
    need: float,
    now_slot: int,
    deadline: float,
    cap: int,
    timeline: Timeline,
    current_gpus: int,
    overhead_left: float,
    clock: SlotClock,
) -> tuple[tuple[Stretch, ...], float]:
    """Progressive filling at cap `cap`: the latest-starting plan that covers
    `need`, or the most the timeline allows if nothing covers it.

    Returns the runs (ascending) and the iterations they deliver.
    """
    dt = clock.interval
    end_slot = clock.slot_after(deadline)
    if end_slot <= now_slot or need <= 0:
        return (), 0.0
    need *= 1 + FILL_MARGIN
    runs: list[Stretch] = []  # built latest first
    closed = 0.0
    run_gpus = 0
    run_end = end_slot
    start = run_end  # where the current run would have to begin to cover the rest
    width = [floor_level(levels, f) for f in range(cap + 1)]  # hot loop: no search per segment
    for a, b, free in timeline.backward(now_slot, end_slot):
        g = width[min(cap, free)] if free > 0 else 0
        if g != run_gpus:
            if run_gpus:
                closed += _work(curve, run_gpus, _span(b, run_end, deadline, dt), clock.overhead(run_gpus))
                runs.append(Stretch(b, run_end, run_gpus))
            run_gpus, run_end = g, b
            if g:
                tail = max(0.0, run_end * dt - deadline)  # part of the last slot past the deadline
                start = run_end - math.ceil(((need - closed) / curve.points[g] + clock.overhead(g) + tail) / dt)
        if g and start >= a and start > now_slot:
            runs.append(Stretch(start, run_end, g))
            runs.reverse()
            return tuple(runs), closed + _work(curve, g, _span(start, run_end, deadline, dt), clock.overhead(g))
    if run_gpus:  # the earliest run reaches now
        seconds = _span(now_slot, run_end, deadline, dt)
        charge = overhead_left if run_gpus == current_gpus else clock.overhead(run_gpus)
        closed += _work(curve, run_gpus, seconds, charge)
        runs.append(Stretch(now_slot, run_end, run_gpus))
    runs.reverse()
    return tuple(runs), closed


def minimum_satisfactory_share(
    curve: ThroughputCurve,
    levels: tuple[int, ...],
    need: float,
    now_slot: int,
    deadline: float,
    timeline: Timeline,
    current_gpus: int,
    overhead_left: float,
    clock: SlotClock,
) -> Plan | None:
    """The MSS plan, moved forward, or None when no cap meets the deadline on this timeline."""
    plan = filled_share(curve, levels, need, now_slot, deadline, timeline, current_gpus, overhead_left, clock)
    if plan is None:
        return None
    return front_load(plan, curve, levels, need, now_slot, deadline, timeline, current_gpus, overhead_left, clock)


def filled_share(
    curve: ThroughputCurve,
    levels: tuple[int, ...],
    need: float,
    now_slot: int,
    deadline: float,
    timeline: Timeline,
    current_gpus: int,
    overhead_left: float,
    clock: SlotClock,
) -> Plan | None:
    """The MSS plan as progressive filling lays it, backwards from the
    deadline, or None when no cap meets the deadline on this timeline. Its
    share and start are what every plan shape is built from."""
    if not levels:
        return None
    args = (now_slot, deadline)
    top_runs, top_work = fill(curve, levels, need, *args, levels[-1], timeline, current_gpus, overhead_left, clock)
    if top_work < need * (1 + COVER_SLACK):
        return None  # even the widest cap fails: no need to try the narrower ones
    plan = Plan(top_runs, levels[-1])
    for cap in levels[:-1]:
        runs, work = fill(curve, levels, need, *args, cap, timeline, current_gpus, overhead_left, clock)
        if work >= need * (1 + COVER_SLACK):
            plan = Plan(runs, cap)
            break
    return plan


def front_load(
    plan: Plan,
    curve: ThroughputCurve,
    levels: tuple[int, ...],
    need: float,
    now_slot: int,
    deadline: float,
    timeline: Timeline,
    current_gpus: int,
    overhead_left: float,
    clock: SlotClock,
) -> Plan:
    """`plan` (filled backwards at its share q) laid out from now instead: the
    level below q until the slot where `plan` starts, q from there, each capped
    by what is free, ending once `need` is covered. A plan at the lowest level
    has nothing below it and stays as filled; so does one that the forward
    layout cannot cover (its narrower runs, each paying a restart, can
    deliver less than the filled plan)."""
    q = plan.share
    if q == levels[0] or not plan.runs:
        return plan
    below = max(level for level in levels if level < q)
    start_q = plan.runs[0].start
    target = need * (1 + FILL_MARGIN)
    dt = clock.interval
    runs: list[Stretch] = []
    work = 0.0
    for a, b, g in _forward_runs(timeline, levels, now_slot, clock.slot_after(deadline), start_q, below, q):
        charge = overhead_left if (a == now_slot and g == current_gpus) else clock.overhead(g)
        gain = _work(curve, g, _span(a, b, deadline, dt), charge)
        if work + gain >= target:
            end = min(b, a + max(1, math.ceil(((target - work) / curve.points[g] + charge) / dt)))
            while end < b and work + _work(curve, g, _span(a, end, deadline, dt), charge) < target:
                end += 1  # float rounding of the estimate above
            runs.append(Stretch(a, end, g))
            return Plan(tuple(runs), q)
        runs.append(Stretch(a, b, g))
        work += gain
    return plan


def _forward_runs(
    timeline: Timeline, levels: tuple[int, ...], lo: int, hi: int, switch: int, before: int, after: int
) -> Iterator[tuple[int, int, int]]:
    """Maximal runs (start, end, GPUs > 0) over [lo, hi) at cap `before` until
    slot `switch` and `after` from it, each slot at the largest level that is
    free, earliest first."""
    run: list[int] | None = None
    for a, b, free in timeline.forward(lo, hi):
        for x, y, cap in ((a, min(b, switch), before), (max(a, switch), b, after)):
            if x >= y:
                continue
            g = floor_level(levels, min(cap, free)) if free > 0 else 0
            if run is not None and run[2] == g:
                run[1] = y
                continue
            if run is not None and run[2]:
                yield run[0], run[1], run[2]
            run = [x, y, g]
    if run is not None and run[2]:
        yield run[0], run[1], run[2]
