"""What a start costs here, learnt from the starts the loop sees, and the
warning an operator gets when starts take far longer than the plans charge."""

from __future__ import annotations

import pytest

from scheduler_service.loop.actions import StartedSlowly
from scheduler_service.loop.start_cost import StartCost
from tests.loop.driver import SETTINGS, T0, Driver, job


def test_a_start_far_slower_than_charged_is_said_once_per_new_worst() -> None:
    cost = StartCost(lambda gpus: 2.5, launch_s=0.0)  # the stack's: 2.5 s charged, no launch reserve set
    assert cost.started(3.0, 1) is None  # within 1.5 x what is charged
    slow = cost.started(4.0, 1)
    assert slow is not None and (slow.took_s, slow.charged_s) == (4.0, 2.5)
    assert cost.started(4.5, 1) is None  # not 20% worse than the start already reported
    assert cost.started(6.0, 2) is not None


def test_a_learnt_reserve_keeps_the_longest_recent_start_beyond_the_charged_restart() -> None:
    cost = StartCost(lambda gpus: 2.5, launch_s=None)  # learnt, from the default until starts are seen
    assert cost.reserve() == 15.0 - 2.5
    for took in (20.0, 4.0, 3.0):
        cost.started(took, 1)
    assert cost.reserve() == 20.0 - 2.5  # the longest of the last ten
    for _ in range(10):
        cost.started(3.0, 1)
    assert cost.reserve() == 15.0 - 2.5  # the slow one is forgotten; never under the default
    fixed = StartCost(lambda gpus: 2.5, launch_s=5.0)
    fixed.started(60.0, 1)
    assert fixed.reserve() == 5.0 - 2.5  # what the operator set is kept as is


def test_the_loop_says_when_a_launch_took_far_longer_than_its_plan_charged() -> None:
    d = Driver()
    d.arrive(job("a", T0, 2000, T0 + 600))
    d.step(T0)  # launched at once on the idle cluster
    d.ack("a", T0)
    charged = d.loop.start_cost.restart_cost(2)
    actions = d.report("a", T0 + 10 * charged + SETTINGS.launch_s, 1, (0, 1))
    (slow,) = [a for a in actions if isinstance(a, StartedSlowly)]
    assert slow.took_s >= 10 * charged and slow.charged_s == charged
    assert not [a for a in d.report("a", T0 + 11 * charged + 5, 50, (0, 1)) if isinstance(a, StartedSlowly)]


def test_every_start_is_said_and_a_restarted_loop_recalls_them_before_it_plans() -> None:
    from scheduler_service.loop.actions import Started
    from scheduler_service.loop.events import StartsRecalled

    learnt = SETTINGS.model_copy(update={"launch_s": None})
    d = Driver(settings=learnt)
    d.arrive(job("a", T0, 2000, T0 + 600))
    d.step(T0)
    d.ack("a", T0)
    (started,) = [a for a in d.report("a", T0 + 30.0, 1, (0, 1)) if isinstance(a, Started)]
    assert started == Started("a", 30.0)  # the driver keeps it for the next life
    assert not [a for a in d.report("a", T0 + 31.0, 20, (0, 1)) if isinstance(a, Started)]  # once a start

    again = Driver(settings=learnt)  # a restarted service, before anything arrives
    assert again.loop.start_cost.startup_s() == 15.0  # the default
    again.handle(StartsRecalled((4.0, 30.0, 3.0)), T0 + 100)
    assert again.loop.start_cost.startup_s() == 30.0  # what the last life learnt
    assert not [a for a in again.log if isinstance(a, StartedSlowly)]  # said then, not again


def test_a_resize_in_place_is_charged_its_own_cost_raised_to_the_longest_seen() -> None:
    cost = StartCost(lambda gpus: 2.5, launch_s=None, in_place_cost=lambda gpus: 1.0)
    assert (cost.charge(2, in_place=False), cost.charge(2, in_place=True)) == (2.5, 1.0)
    cost.resized(1.6, in_place=True)
    assert (cost.charge(2, in_place=False), cost.charge(2, in_place=True)) == (2.5, 1.6)


def test_the_loop_charges_a_resize_that_keeps_gpus_as_in_place_and_learns_what_it_took() -> None:
    from scheduler_service.policy.overhead import RestartOverhead

    settings = SETTINGS.model_copy(update={"overhead": RestartOverhead(0.25, 0.5, 0.0, in_place_s=0.1)})
    d = Driver(gpus=4, settings=settings)
    d.arrive(job("a", T0, 20000, None))
    d.step(T0)
    d.ack("a", T0)
    d.report("a", T0 + 0.5, 5, (0, 1))
    run = d.loop.runs["a"]
    run.retarget((1,))  # as a plan giving one of its GPUs to another run would (no plan is due in this slot)
    d.step(T0 + 0.6)
    assert d.commands["a"].gpus == (1,) and run.in_place
    assert d.loop.start_cost.charge(1, run.in_place) == 0.25 * 2 + 0.1  # both stops and the regroup
    d.ack("a", T0 + 0.7)
    d.report("a", T0 + 1.2, 6, (1,))  # its first iteration on the new set
    assert list(d.loop.start_cost.in_place) == [pytest.approx(0.6)]
    run.retarget((2, 3))  # none of its GPUs: a restart from its checkpoint
    d.step(T0 + 1.3)
    assert d.commands["a"].gpus == (2, 3) and not run.in_place
    assert d.loop.start_cost.charge(2, in_place=False) == 0.25 * 2 + 0.5  # nothing seen of a restart yet
    d.ack("a", T0 + 2.0)
    d.report("a", T0 + 21.3, 7, (2, 3))  # a restart on a loaded machine: 20 s from the command
    # Charged what it took from now on (Ray chaos, seed 3: restarts charged 2.5 s took 10-25 s).
    assert d.loop.start_cost.charge(2, in_place=False) == pytest.approx(20.0)
    assert d.loop.start_cost.charge(1, in_place=True) == pytest.approx(0.6)  # in place: its own


def test_a_deadline_the_work_meets_but_not_the_start_here_is_rejected_as_sooner_than_start_up() -> None:
    """Issue 42: 500 mlp iterations (under a second) due in 20 s were refused
    as infeasible even on an idle cluster; the start is what does not fit.
    The reason names it, with the start-up measured here, and the earliest
    deadline it gives is one the loop admits."""
    from scheduler_service.contracts import RejectionReason
    from scheduler_service.loop import LoopSettings
    from scheduler_service.loop.actions import Admitted, Rejected
    from scheduler_service.loop.events import StartsRecalled
    from scheduler_service.policy import ThroughputCurve
    from scheduler_service.policy.overhead import RestartOverhead

    service = LoopSettings(interval_s=5.0, overhead=RestartOverhead(0.5, 2.0, 0.0, in_place_s=1.0), poll_s=1.0,
                           launch_s=None, safety_margin=0.05)  # the worker's defaults
    mlp = ThroughputCurve({1: 800.0, 2: 1400.0})
    d = Driver(settings=service)
    d.arrive(job("soon", T0, 500, T0 + 20, mlp))
    (rejected,) = d.new(d.step(T0), Rejected).values()
    assert rejected.reason is RejectionReason.SOONER_THAN_START_UP  # was infeasible_even_on_an_idle_cluster
    assert "15 s to start" in rejected.message and "500 iterations" in rejected.message  # the default start-up

    d.handle(StartsRecalled((22.0, 9.0)), T0)  # starts seen here: the longest took 22 s
    d.arrive(job("sooner", T0, 500, T0 + 20, mlp))
    (rejected,) = d.new(d.step(T0), Rejected).values()
    assert rejected.reason is RejectionReason.SOONER_THAN_START_UP and "22 s to start" in rejected.message
    earliest = rejected.earliest_feasible_deadline
    assert earliest is not None and T0 + 22 < earliest < T0 + 60

    d.arrive(job("later", T0 + 1, 500, earliest, mlp))
    assert "later" in d.new(d.step(T0 + 1), Admitted)

    d.arrive(job("long", T0 + 2, 1_000_000, T0 + 200, mlp))  # the work itself does not fit: the reason stays
    (infeasible,) = d.new(d.step(T0 + 2), Rejected).values()
    assert infeasible.reason is RejectionReason.INFEASIBLE_ALONE
