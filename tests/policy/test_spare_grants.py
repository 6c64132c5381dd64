"""Spare GPUs for a run its plan gives nothing now (its plan lies later in its
window): granted when no plan claims them before a start is paid, never a
risk to its guarantee, and never a reason to move a guaranteed run instead."""

from __future__ import annotations

from scheduler_service.policy.allocation import (
    affords_restarts, falls_short, grant_is_safe, grant_rescues, unclaimed_s,
)
from scheduler_service.policy.jobs import Job, JobStatus, ThroughputCurve
from scheduler_service.policy.overhead import RestartOverhead
from scheduler_service.policy.plan import Plan, Stretch, SlotClock
from scheduler_service.policy.timeline import Timeline

CLOCK = SlotClock(2.0, RestartOverhead(2.0, 0.5, 0.0))  # the test stack's: 2 s slots, 2.5 s a start
CURVE = ThroughputCurve({1: 1000.0})
JOB = Job("late", 0.0, 5000.0, 600.0, CURVE)
LATE_PLAN = Plan((Stretch(295, 299, 1),), 1)  # its 5 s of work planned in the window's last 8 s (5,500 iterations)


def test_a_run_planned_late_takes_spare_gpus_no_plan_claims_before_a_start_is_paid() -> None:
    idle = Timeline(2)
    idle.add(LATE_PLAN.runs)
    assert unclaimed_s(idle, 0, 1, CLOCK) > CLOCK.overhead(1)
    assert grant_is_safe(JOB, LATE_PLAN, JobStatus(5000.0), 1, 0, CLOCK, unclaimed_s(idle, 0, 1, CLOCK))
    # Both GPUs claimed by another run's plan from the next slot: a start there would be taken back unpaid.
    busy = idle.copy()
    busy.add((Stretch(1, 200, 2),))
    assert unclaimed_s(busy, 0, 1, CLOCK) == 2.0
    assert not grant_is_safe(JOB, LATE_PLAN, JobStatus(5000.0), 1, 0, CLOCK, unclaimed_s(busy, 0, 1, CLOCK))


def test_a_run_on_spare_gpus_its_plan_does_not_need_can_always_be_moved() -> None:
    """Pinned, such runs made placement move guaranteed runs instead: two
    admitted runs of ITP cluster07 (16 x 8) missed through the service's loop."""
    assert affords_restarts(JOB, LATE_PLAN, JobStatus(5000.0, 1, 0.0), 1, 0, CLOCK, restarts=2)
    short = Plan((Stretch(298, 299, 1),), 1)  # covers less than what is left: it is not spare to it
    assert not affords_restarts(JOB, short, JobStatus(60_000.0, 1, 0.0), 1, 0, CLOCK)


def test_free_for_counts_the_slots_a_width_stays_unreserved() -> None:
    timeline = Timeline(4)
    timeline.add((Stretch(3, 10, 2), Stretch(5, 8, 2)))
    assert timeline.free_for(0, 2, 20) == 5  # 2 free until slot 5, where all 4 are taken
    assert timeline.free_for(0, 3, 20) == 3
    assert timeline.free_for(10, 4, 20) == 10  # nothing reserved from slot 10 on


def test_a_run_its_plan_no_longer_carries_gets_the_idle_gpus_its_one_chance() -> None:
    """A CI burst: a run that started a minute late fell short of its plan,
    was parked, and was refused the idle GPUs as "not safe" for a plan it
    could no longer meet: it sat idle until its deadline passed."""
    from scheduler_service.policy import SchedulingRequest, Topology, make_policy
    from scheduler_service.policy.registry import DEFAULT_POLICY

    curve = ThroughputCurve({1: 100.0, 2: 190.0})
    for name in ("elasticflow", DEFAULT_POLICY):
        policy = make_policy(name, Topology(1, 1, 2), interval=2.0, overhead=RestartOverhead(2.0, 0.5, 0.0))
        (decision,) = policy.schedule(SchedulingRequest(0.0, [Job("a", 0.0, 190 * 60, 120.0, curve)])).decisions
        assert decision.guaranteed
        # At 100 s it holds nothing with 20 s of work left on both GPUs: 22.5 s with the start, due in 20.
        reply = policy.schedule(SchedulingRequest(100.0, status={"a": JobStatus(190 * 20, 0, 0.0)}))
        assert reply.allocation["a"] == 2, name
    short = Plan((Stretch(0, 10, 1),), 1)  # 20 s on 1 GPU: 20,000 iterations less its start
    assert falls_short(JOB, short, JobStatus(25_000.0, 1, 0.0), 0, CLOCK)
    assert not falls_short(JOB, short, JobStatus(5000.0, 1, 0.0), 0, CLOCK)


def test_a_grant_to_a_run_that_falls_short_must_do_more_than_where_it_is_in_the_time_it_lasts() -> None:
    wide = Job("w", 0.0, 60_000.0, 600.0, ThroughputCurve({1: 1000.0, 2: 1900.0}))
    short = Plan((Stretch(0, 10, 1),), 1)
    behind = JobStatus(60_000.0, 1, 0.0)
    assert grant_rescues(wide, short, behind, 2, 0, CLOCK, unclaimed_s=10.0)  # 1,900/s for 7.5 s > 1,000/s for 10
    assert not grant_rescues(wide, short, behind, 2, 0, CLOCK, unclaimed_s=4.0)  # claimed before it pays its start
    parked = JobStatus(60_000.0, 0, 0.0)
    assert grant_rescues(wide, short, parked, 2, 0, CLOCK, unclaimed_s=4.0)  # anything beats nothing
    assert not grant_rescues(wide, short, JobStatus(5000.0, 1, 0.0), 2, 0, CLOCK, unclaimed_s=10.0)  # on its plan


def test_a_run_behind_a_plan_that_has_ended_keeps_the_gpus_it_trains_on() -> None:
    """The Ray stack this session: a run that started 43 s late was behind a
    plan that had it done by now (nothing planned for it any more); keeping
    its 4 GPUs was judged against its 4 GPUs, never worth it, and it was
    parked beside them 7 s before its deadline, then put back."""
    from scheduler_service.policy import SchedulingRequest, Topology, make_policy
    from scheduler_service.policy.registry import DEFAULT_POLICY

    curve = ThroughputCurve({1: 10.0, 2: 19.0, 4: 36.0})
    for name in ("elasticflow", DEFAULT_POLICY):
        policy = make_policy(name, Topology(1, 2, 2), interval=6.0)
        (decision,) = policy.schedule(SchedulingRequest(0.0, [Job("a", 0.0, 3000, 200.0, curve)])).decisions
        assert decision.guaranteed and decision.share == 4
        for now in (60.0, 190.0, 198.0):  # its plan ends at 192 s, half its work still to do
            reply = policy.schedule(SchedulingRequest(now, status={"a": JobStatus(1500, 4, 0.0)}))
            assert reply.allocation["a"] == 4, (name, now)
