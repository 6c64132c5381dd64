"""When the loop says a running run's deadline is at risk, and recovered:
from the run's own rate over minutes, once per flip, never flapping."""

from __future__ import annotations

import random

from scheduler_service.loop.actions import RiskChanged
from scheduler_service.loop.deadlines import SafetyMargin
from scheduler_service.loop.events import Progress
from scheduler_service.loop.run import LoopRun
from scheduler_service.policy import ThroughputCurve
from tests.loop.driver import T0, Driver, job

CURVE = ThroughputCurve({1: 10.0, 2: 18.0})


def _running(iterations: float, deadline_in_s: float) -> Driver:
    d = Driver()
    d.arrive(job("a", T0, iterations, T0 + deadline_in_s, CURVE))
    d.step(T0)
    d.ack("a", T0)
    return d


def test_a_deadline_goes_at_risk_and_recovers_once_each() -> None:
    d = _running(36_000, deadline_in_s=3600)  # 2,000 s of work on both GPUs at 18 it/s
    changes: list[RiskChanged] = []
    iteration, now = 0, T0
    for second in range(1, 1200):  # trains at its profile for a while, stalls, then catches up
        now = T0 + second
        iteration += 18 if second < 300 or second > 700 else 0
        d.report("a", now, iteration, (0, 1), rate=18.0)
        changes += d.new(d.step(now), RiskChanged).values()
    assert [c.at_risk for c in changes] == [True, False]  # told once each, not every step
    at_risk, recovered = changes
    assert at_risk.projected_finish is not None and at_risk.projected_finish > at_risk.deadline - 60


def test_a_short_run_on_its_plan_is_at_risk_only_once_it_loses_half_its_room() -> None:
    """A two-minute run's plan ends 12 s before its deadline (start cost and
    safety margin): inside a one-minute margin by design, so its margin is
    half that room, 6 s, and at least a slot."""
    run = LoopRun("urgent", job("urgent", T0, 1000, T0 + 120, CURVE), T0, reserve_s=12.0)
    assert run.plan_deadline == T0 + 108
    assert run.risk_margin(60, 5) == 6
    run = LoopRun("urgent", job("urgent", T0, 1000, T0 + 120, CURVE), T0, reserve_s=1.0,
                  margin=SafetyMargin(0.0, 0.0))
    assert run.risk_margin(60, 5) == 5  # a plan keeping 1 s: the slot is the floor
    best_effort = LoopRun("be", job("be", T0, 1000, None, CURVE), T0)
    assert best_effort.risk_margin(60, 5) == 60


def test_best_effort_and_waiting_runs_are_never_at_risk() -> None:
    d = Driver()
    d.arrive(job("patient", T0, 10**7, None, CURVE))
    d.arrive(job("urgent", T0, 20_000, T0 + 1200, CURVE))  # needs both GPUs: the best-effort one waits
    for second in range(0, 300, 5):
        d.report("urgent", T0 + second, 18 * second, (0, 1), rate=18.0)  # on its plan
        assert not d.new(d.step(T0 + second), RiskChanged)
        assert d.loop.view("patient", T0 + second).phase == "admitted"  # type: ignore[union-attr]


def test_a_noisy_rate_raises_no_flapping_alerts() -> None:
    """15 minutes of steady training on a noisy machine: the flow's own
    20-iteration projection swings by minutes either side of the deadline,
    the loop's (the plan, then a rate over two minutes, with hysteresis) does not."""
    d = _running(18 * 1000, deadline_in_s=1200)  # 1,000 s of work at 18 it/s: 200 s to spare
    rng = random.Random(7)
    changes = []
    for second in range(1, 900):
        now = T0 + second
        iteration = int(second * 18)
        noisy = now + (18_000 - iteration) / 18 * rng.uniform(0.6, 1.8)  # the flow's own, swinging
        d.handle(Progress("a", iteration, (0, 1), 18.0, noisy), now)
        changes += d.new(d.step(now), RiskChanged).values()
    assert changes == []


def test_after_a_resize_the_outlook_waits_for_a_rate_at_the_new_width() -> None:
    """The rate measured before a resize (at another width, with the restart's
    standstill in it) says nothing of the new set: the plan's projection, the
    one the resize's own line shows, stands until the new width shows its own.
    Before, a resize was logged "on track" and "at risk" 6 ms apart."""
    run = LoopRun("a", job("a", T0, 36_000, T0 + 3600, CURVE), T0)
    run.admit(1)
    run.acknowledge(run.launch((0,), T0), (0,))
    run.planned(T0 + 2500)
    for second in range(0, 601, 5):  # 10 it/s on one GPU, as profiled
        run.report(10 * second, (0,), 10.0, None)
        measured = run.projected_finish(T0 + second)
    assert measured == T0 + 600 + (36_000 - 6000) / 10  # its own rate, once shown for a while
    run.acknowledge(run.move((0, 1), T0 + 600), (0, 1))
    run.report(6000, (0, 1), None, None)
    assert run.projected_finish(T0 + 610) == T0 + 2500  # the plan's, not the old width's


def test_a_projection_swinging_across_both_bounds_within_seconds_flips_only_on_real_changes() -> None:
    """Issue 42: a resnet run went at risk, recovered, at risk, recovered
    within 9 s and met its deadline with time to spare. A slow model (an
    iteration every 3.3 s) measured over two minutes swings its projection
    by ~20 s between two iterations, across both bounds of a short run's
    margin: the value hysteresis alone flipped it hundreds of times. Now it
    goes at risk once when it really stalls, and recovers once when it
    really catches up."""
    d = Driver()
    d.arrive(job("a", T0, 600, T0 + 2012, ThroughputCurve({1: 0.2, 2: 0.3})))  # 2,000 s of work, 12 s to spare
    d.step(T0)
    d.ack("a", T0)
    changes: list[tuple[int, bool]] = []
    views = []
    done = 0.0
    for second in range(1, 1700):
        done += 0.0 if 600 <= second < 700 else 0.6 if second >= 900 else 0.3  # on plan, stalls, catches up
        d.report("a", T0 + second, int(done), (0, 1), rate=0.3)
        changes += [(second, c.at_risk) for c in d.new(d.step(T0 + second), RiskChanged).values()]
        views.append((len(changes) % 2 == 1, d.loop.view("a", T0 + second)))
    assert [at_risk for _, at_risk in changes] == [True, False]
    (went, _), (back, _) = changes
    assert 600 < went < 700 and back > 900
    assert all(view is not None and view.at_risk == flagged for flagged, view in views)  # what every display reads
