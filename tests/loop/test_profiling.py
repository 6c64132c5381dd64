"""Profiling's decisions are the loop's: a run on a partial curve is not
refused for GPU counts never measured, and a run whose profile failed is
rejected by the loop, as every run is decided there."""

from __future__ import annotations

from scheduler_service.contracts import RejectionReason
from scheduler_service.loop.actions import ProfileNeeded, Rejected
from scheduler_service.loop.events import Arrived, ProfileFailed
from scheduler_service.policy import ThroughputCurve
from tests.loop.driver import T0, Driver, job

MEASURED_ON_ONE = ThroughputCurve({1: 20.0})  # GPU 1 was busy when the model was profiled


def test_a_run_the_policy_refuses_only_for_counts_its_partial_curve_never_measured_needs_more_profiling() -> None:
    d = Driver()
    needs_two = job("a", T0, 3000, T0 + 120, MEASURED_ON_ONE)  # 150 s on one GPU; two would make it
    d.handle(Arrived("a", needs_two, T0, measured_up_to=1), T0)
    actions = d.step(T0)
    assert d.new(actions, ProfileNeeded) == {"a": ProfileNeeded("a", 1)} and not d.new(actions, Rejected)
    assert d.loop.view("a", T0) is None  # no longer the loop's until it arrives again

    d.handle(Arrived("b", job("b", T0, 3000, T0 + 120, MEASURED_ON_ONE), T0), T0)  # a whole curve: the truth
    (rejected,) = d.new(d.step(T0), Rejected).values()
    assert rejected.reason is RejectionReason.INFEASIBLE_ALONE


def test_a_failed_or_timed_out_profile_is_rejected_by_the_loop() -> None:
    d = Driver()
    (rejected,) = d.handle(ProfileFailed("a", RejectionReason.PROFILING_FAILED, "no GPUs were free for 600 s"), T0)
    assert rejected == Rejected("a", RejectionReason.PROFILING_FAILED, "no GPUs were free for 600 s", None, None)
