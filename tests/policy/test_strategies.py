"""ElasticFlow's strategies: each alternative changes what the policy does in
the way its docstring says, and the ablation builds every variant through
the constructor."""

import importlib.util
import random
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from scheduler_service.policy import Job, JobStatus, RejectionReason, SchedulingRequest, ThroughputCurve, Topology, make_policy
from scheduler_service.policy.admission import Candidate, Refused, Replanned, plan_all
from scheduler_service.policy.elasticflow import ElasticFlowPolicy
from scheduler_service.policy.overhead import PAPER_OVERHEAD
from scheduler_service.policy.plan import Plan, Stretch, SlotClock, cover
from scheduler_service.policy.strategies import (
    BACKWARD_FILLED, DEADLINE_ORDER, FAST_PATH_FIRST, KEEP_FULL_ALLOWANCE, KEEP_WHAT_IS_LEFT, NO_ALLOWANCE,
    PINNED_AND_FRAGILE, PINNED_ONLY, REPLAN_ALL, REPLAN_FIRST, SHIPPED, TRIM_SOONEST_DUE, ElasticFlowStrategies,
    FreestWithin,
)
from scheduler_service.policy.timeline import Timeline

CURVE = ThroughputCurve({1: 1.0, 2: 1.9, 4: 3.4, 8: 5.5})
TOPO = Topology(1, 1, 8)
ROOT = Path(__file__).resolve().parents[2]


def job(job_id, iterations, deadline, submit=0.0):
    return Job(job_id, submit, iterations, deadline, CURVE)


def policy_with(**changes):
    return make_policy("elasticflow", TOPO, strategies=ElasticFlowStrategies(**changes))


def admitted_one_after_another(policy, jobs):
    """Each job arrives at time 0 after the previous one was decided; nothing trains."""
    out, status = [], {}
    for j in jobs:
        reply = policy.schedule(SchedulingRequest(0.0, [j], status=status))
        out.append(reply.decisions[0].admitted)
        status = {k: JobStatus(policy.jobs[k].iterations) for k in reply.allocation}
    return out


def test_least_laxity_re_plans_the_job_that_cannot_wait_first_and_admits_both():
    # Due at 20 min with much laxity; then one due at 40 min that needs the
    # whole cluster for most of it. Its fast path fails around the first plan;
    # the re-plan only works if it is planned first.
    soon, urgent = job("soon", 828, 1200.0), job("urgent", 10_757, 2400.0)
    assert admitted_one_after_another(make_policy("elasticflow", TOPO), [soon, urgent]) == [True, True]
    assert admitted_one_after_another(policy_with(order=DEADLINE_ORDER), [soon, urgent]) == [True, False]


def test_the_re_plan_order_names_a_different_job_it_cannot_plan():
    clock = SlotClock(60.0, PAPER_OVERHEAD)
    levels = CURVE.capped(8)
    cands = [Candidate(j, JobStatus(j.iterations), levels) for j in (job("loose", 550, 600.0), job("tight", 5800, 1200.0))]
    assert plan_all(cands, 0, 8, clock) == Refused("loose")
    assert plan_all(cands, 0, 8, clock, order=DEADLINE_ORDER) == Refused("tight")


def test_a_forward_plan_starts_now_below_its_share_and_a_backward_one_ends_at_the_deadline():
    a = job("a", 7000, 6000.0)  # more than 1 GPU delivers in 100 slots, less than 2 do
    forward = make_policy("elasticflow", TOPO)
    backward = policy_with(shape=BACKWARD_FILLED)
    for policy in (forward, backward):
        assert policy.schedule(SchedulingRequest(0.0, [a])).decisions[0].share == 2
    first, *rest = forward.plans["a"].runs
    assert (first.start, first.gpus) == (0, 1) and forward.plans["a"].end < 100
    (only,) = backward.plans["a"].runs
    assert only.gpus == 2 and only.end == 100 and only.start > 0


def test_without_an_allowance_a_job_that_fits_only_without_slack_is_admitted():
    # At 8 GPUs from slot 0, 1800 s deliver 5.5 * (1800 - 37) = 9696 iterations;
    # 9600 fit, 9600 plus one restart's allowance (5.5 * 37) do not.
    tight = job("tight", 9600, 1800.0)
    (shipped,) = make_policy("elasticflow", TOPO).schedule(SchedulingRequest(0.0, [tight])).decisions
    assert shipped.reason is RejectionReason.INFEASIBLE_ALONE
    assert policy_with(allowance=NO_ALLOWANCE).schedule(SchedulingRequest(0.0, [tight])).decisions[0].admitted


def test_a_re_plan_keeps_what_is_left_of_the_allowance_or_all_of_it():
    assert KEEP_WHAT_IS_LEFT.slack(100.0, 30.0) == 30.0
    assert KEEP_WHAT_IS_LEFT.slack(100.0, -5.0) == 0.0
    assert KEEP_WHAT_IS_LEFT.slack(100.0, 500.0) == 100.0
    assert KEEP_FULL_ALLOWANCE.slack(100.0, 30.0) == 100.0


def test_placement_tiers_spare_fragile_jobs_only_with_the_middle_tier():
    cannot_afford = {1: {"a"}, 2: {"a", "b"}}.__getitem__
    assert PINNED_AND_FRAGILE.split(cannot_afford) == ({"a"}, {"b"})
    assert PINNED_ONLY.split(cannot_afford) == ({"a"}, set())


def test_with_restores_off_a_moved_job_keeps_the_plan_it_has():
    a = job("a", 3600, 14_400.0)
    for restore, changed in ((True, True), (False, False)):
        policy = policy_with(restore_allowances=restore)
        policy.schedule(SchedulingRequest(0.0, [a]))
        before = policy.plans["a"]
        remaining = cover(before, CURVE, 1, 14_400.0, 1, 0.0, policy.clock) - policy.strategies.allowance.iterations(
            a, policy.levels["a"], policy.clock) / 4
        policy.moved = {"a"}  # placement moved it: most of its slack is spent
        policy.schedule(SchedulingRequest(60.0, [], status={"a": JobStatus(remaining, 1)}))
        assert (policy.plans["a"] != before) is changed


@pytest.mark.parametrize("refresh", [REPLAN_ALL, TRIM_SOONEST_DUE])
def test_a_refresh_hands_back_what_a_job_that_ran_ahead_no_longer_needs_before_an_arrival(refresh):
    def held(plan: Plan) -> int:
        return sum((r.end - r.start) * r.gpus for r in plan.runs)

    results = {}
    for name, strategies in (("shipped", SHIPPED), ("refresh", ElasticFlowStrategies(refresh=refresh))):
        policy = make_policy("elasticflow", TOPO, strategies=strategies)
        policy.schedule(SchedulingRequest(0.0, [job("a", 3600, 14_400.0)]))
        admitted = held(policy.plans["a"])
        ahead = {"a": JobStatus(1000, 8)}  # it ran on spare GPUs: far ahead of its plan
        policy.schedule(SchedulingRequest(60.0, [], status=ahead))
        assert held(policy.plans["a"]) == admitted  # no arrival, no refresh
        policy.schedule(SchedulingRequest(60.0, [job("b", 100, 7200.0, submit=60.0)], status=ahead))
        results[name] = (admitted, held(policy.plans["a"]))
    assert results["shipped"][1] == results["shipped"][0]
    assert results["refresh"][1] < results["refresh"][0]


def test_the_fast_path_first_never_computes_the_re_plan_it_does_not_need():
    def replan():
        raise AssertionError("the re-plan was computed")

    clock = SlotClock(60.0, PAPER_OVERHEAD)
    fast = Plan((Stretch(0, 10, 4),), 4)
    assert FAST_PATH_FIRST.choose(fast, replan, Timeline(8), 0, clock) is fast


def test_the_layout_choices_pick_the_re_plan_or_the_freer_layout():
    clock = SlotClock(60.0, PAPER_OVERHEAD)
    fast = Plan((Stretch(0, 10, 4),), 4)
    full = Timeline(8)
    full.add([Stretch(0, 60, 8)])
    busier, freer = Replanned(full, {}), Replanned(Timeline(8), {})
    assert REPLAN_FIRST.choose(fast, lambda: busier, Timeline(8), 0, clock) is busier
    assert REPLAN_FIRST.choose(fast, lambda: Refused("x"), Timeline(8), 0, clock) is fast
    assert FreestWithin(1.0).choose(fast, lambda: busier, Timeline(8), 0, clock) is fast
    assert FreestWithin(1.0).choose(fast, lambda: freer, Timeline(8), 0, clock) is freer
    assert FreestWithin(1.0).choose(None, lambda: Refused("x"), Timeline(8), 0, clock) is None


def test_the_policy_admits_by_the_layout_and_places_by_the_tiers_its_strategies_choose():
    class Neither:
        def choose(self, fast, replan, timeline, slot, clock):
            return None

    class Recorded:
        def __init__(self):
            self.asked = []

        def split(self, cannot_afford):
            self.asked.append((cannot_afford(1), cannot_afford(2)))
            return PINNED_ONLY.split(cannot_afford)

    (decision,) = policy_with(layout=Neither()).schedule(SchedulingRequest(0.0, [job("a", 3600, 7200.0)])).decisions
    assert decision.reason is RejectionReason.INSUFFICIENT_CAPACITY  # it fits an idle cluster, but no layout was chosen
    tiers = Recorded()
    policy = policy_with(tiers=tiers)
    policy.schedule(SchedulingRequest(0.0, [job("a", 3600, 7200.0)]))
    policy.schedule(SchedulingRequest(60.0, [], status={"a": JobStatus(3600, policy.placer.blocks["a"][1])}))
    assert len(tiers.asked) == 2


@pytest.mark.parametrize("name", ["elasticflow", "elasticflow-overload", "elasticflow-noadmit"])
def test_every_elasticflow_policy_is_built_with_the_strategies_it_is_given(name):
    strategies = ElasticFlowStrategies(order=DEADLINE_ORDER)
    assert make_policy(name, TOPO).strategies == SHIPPED
    assert make_policy(name, TOPO, strategies=strategies).strategies is strategies


def _ablation(monkeypatch):
    """bench/ablation.py as a module (its dataclasses need it in sys.modules; it adds bench/ to the path)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = importlib.util.spec_from_file_location("ablation_under_test", ROOT / "bench" / "ablation.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def _policy_code() -> dict[str, object]:
    """Every attribute of the policy's modules and classes, to see that nothing was patched."""
    names = ["admission", "allocation", "allowance", "elasticflow", "layout", "plan", "planning", "refresh"]
    modules = [sys.modules[f"scheduler_service.policy.{n}"] for n in names]
    out = {f"{m.__name__}.{k}": v for m in modules for k, v in vars(m).items()}
    out.update({f"ElasticFlowPolicy.{k}": v for k, v in vars(ElasticFlowPolicy).items()})
    return out


def test_the_ablation_builds_every_variant_through_the_constructor_and_each_runs(monkeypatch):
    from scheduler_service.simulator.engine import simulate
    from scheduler_service.simulator.metrics import summarize

    ablation = _ablation(monkeypatch)
    rng, jobs, t = random.Random(7), [], 0.0
    for i in range(30):
        t += rng.expovariate(1 / 300)
        duration = rng.uniform(300, 6000)
        jobs.append(Job(str(i), t, duration * CURVE.speed(1), t + rng.uniform(0.4, 1.5) * duration, CURVE))
    code = _policy_code()
    for key, variant in ablation.VARIANTS.items():
        changed = [f.name for f in fields(ElasticFlowStrategies)
                   if getattr(variant.strategies, f.name) != getattr(SHIPPED, f.name)]
        changed += ["overhead"] if variant.overhead != PAPER_OVERHEAD else []
        assert len(changed) == (0 if key == "shipped" else 1), (key, changed)
        policy = variant.policy(TOPO, 60.0)
        assert type(policy) is ElasticFlowPolicy and policy.strategies is variant.strategies
        assert policy.clock.overhead == variant.overhead  # what the simulator charges, too
        result = summarize(simulate(jobs, policy))
        assert result.admitted > 0, key
    assert _policy_code() == code


def test_a_job_short_of_its_plan_is_re_planned_without_its_allowance_when_only_that_fits():
    # Admitted with a restart's allowance to spare; then (moved, slower than
    # planned) it has more left than its plan covers, and more than its window
    # holds with the allowance on top, but not more than the window holds.
    a = job("a", 9000, 3600.0)
    policy = make_policy("elasticflow", TOPO)
    assert policy.schedule(SchedulingRequest(0.0, [a])).decisions[0].admitted
    window = CURVE.speed(8) * (3600.0 - 60.0)  # from slot 1, on 8 GPUs already
    have = cover(policy.plans["a"], CURVE, 1, 3600.0, 8, 0.0, policy.clock)
    remaining = window - 50
    assert have < remaining and remaining + policy.strategies.allowance.iterations(a, policy.levels["a"], policy.clock) > window
    policy.moved = {"a"}
    policy.schedule(SchedulingRequest(60.0, [], status={"a": JobStatus(remaining, 8)}))
    assert cover(policy.plans["a"], CURVE, 1, 3600.0, 8, 0.0, policy.clock) >= remaining
