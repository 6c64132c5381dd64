"""Minimum Satisfactory Share: covers the job, fits the free timeline, and is minimal."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.policy.jobs import ThroughputCurve
from scheduler_service.policy.overhead import PAPER_OVERHEAD
from scheduler_service.policy.plan import Plan, Stretch, SlotClock, cover, fill, minimum_satisfactory_share
from scheduler_service.policy.timeline import Timeline

CLOCK = SlotClock(60.0, PAPER_OVERHEAD)
CURVE = ThroughputCurve({1: 1.0, 2: 1.8, 4: 3.2, 8: 5.0, 16: 6.0})


def test_curve_levels_drop_counts_that_do_not_speed_up():
    curve = ThroughputCurve({1: 46.9, 2: 37.6, 4: 56.3, 8: 23.2, 16: 32.5})
    assert curve.levels == (1, 4)


def test_timeline_reserve_and_release_round_trip():
    tl = Timeline(16)
    runs = (Stretch(10, 20, 4), Stretch(15, 30, 8))
    tl.add(runs)
    assert tl.free_at(12) == 12 and tl.free_at(17) == 4 and tl.free_at(25) == 8 and tl.free_at(30) == 16
    tl.add(runs, sign=-1)
    assert tl.segments() == [(0, 0)]


reservations = st.lists(
    st.tuples(st.integers(0, 200), st.integers(1, 120), st.sampled_from([1, 2, 4, 8])), max_size=12
)


@settings(max_examples=200, deadline=None)
@given(res=reservations, need=st.floats(100, 60000), deadline_slot=st.integers(5, 400), current=st.sampled_from([0, 2]))
def test_mss_covers_fits_and_is_minimal(res, need, deadline_slot, current):
    tl = Timeline(16)
    for start, length, gpus in res:
        if all(tl.free_at(s) >= gpus for s in range(start, start + length)):
            tl.add([Stretch(start, start + length, gpus)])
    deadline = deadline_slot * 60.0 - 17.0  # a deadline inside a slot
    levels = CURVE.capped(16)
    plan = minimum_satisfactory_share(CURVE, levels, need, 0, deadline, tl, current, 0.0, CLOCK)
    if plan is None:
        _, most = fill(CURVE, levels, need, 0, deadline, 16, tl, current, 0.0, CLOCK)
        assert most < need  # really infeasible, even at the widest cap
        return
    assert cover(plan, CURVE, 0, deadline, current, 0.0, CLOCK) >= need
    for run in plan.runs:
        assert run.gpus <= plan.share
        assert all(tl.free_at(s) >= run.gpus for s in range(run.start, run.end))
        assert run.start * 60.0 < deadline
    smaller = [q for q in levels if q < plan.share]
    if smaller:  # the next smaller cap misses the deadline
        _, work = fill(CURVE, levels, need, 0, deadline, smaller[-1], tl, current, 0.0, CLOCK)
        assert work < need * (1 + 1e-9)


def test_backward_filling_starts_as_late_as_possible_at_the_cheapest_width():
    tl = Timeline(8)
    plan = minimum_satisfactory_share(CURVE, CURVE.capped(8), 1.0 * 600, 0, 60.0 * 100, tl, 0, 0.0, CLOCK)
    assert plan is not None and plan.share == 1
    (run,) = plan.runs
    assert run.end == 100 and run.start == 89  # 600 s of work + a restart, rounded to slots


def test_a_share_above_the_lowest_level_runs_from_now_at_the_level_below_then_at_the_share():
    tl = Timeline(8)
    need, deadline = 7000.0, 60.0 * 100  # more than 1 GPU delivers in 100 slots, less than 2 do
    plan = minimum_satisfactory_share(CURVE, CURVE.capped(8), need, 0, deadline, tl, 0, 0.0, CLOCK)
    assert plan is not None and plan.share == 2
    below, at_share = plan.runs
    assert (below.start, below.gpus) == (0, 1) and (at_share.start, at_share.gpus) == (below.end, 2)
    filled, _ = fill(CURVE, CURVE.capped(8), need, 0, deadline, 2, tl, 0, 0.0, CLOCK)
    assert at_share.start == filled[0].start  # the switch is where the backward-filled plan starts
    assert at_share.end < 100  # so it finishes before the deadline, handing the last slots back
    assert cover(plan, CURVE, 0, deadline, 0, 0.0, CLOCK) >= need
    assert cover(Plan(plan.runs[:1] + (Stretch(at_share.start, at_share.end - 1, 2),), 2), CURVE, 0, deadline, 0, 0.0,
                 CLOCK) < need  # and not a slot later than it must


def test_running_at_the_planned_width_pays_no_new_restart():
    plan = Plan((Stretch(0, 10, 2),), 2)
    fresh = cover(plan, CURVE, 0, 600.0, 0, 0.0, CLOCK)
    running = cover(plan, CURVE, 0, 600.0, 2, 0.0, CLOCK)
    assert running - fresh == pytest.approx(1.8 * PAPER_OVERHEAD(2))
