"""ElasticFlow for overload: admit a guaranteable job only if it is worth
the capacity it would reserve.

First-come MSS admission takes every job it can guarantee, so under overload
a few jobs with large reservations in busy windows crowd out many small ones
that arrive later. This policy prices a plan by the slots it would reserve:
each GPU-second costs more the more of its slot admitted jobs already hold,
exponentially (p(u) = (mu^u - 1) / (mu - 1), 0 when idle, 1 when full), the
price of online admission with capacities (Awerbuch, Azar and Plotkin; the
online-knapsack threshold of Zhou, Chakrabarty and Lukose has the same
shape). Every job is worth the same (one met deadline), so it is admitted
when its plan's price, in seconds of the whole cluster, is at most `budget`.
A run over half the cluster pays for its GPUs at the prices they reach as
it takes them, so that one job holding the whole of an idle cluster for
days is not free.
On a lightly loaded cluster prices are near zero and it admits what the
paper's policy admits; decisions stay immediate and admitted jobs keep their
guarantee (only the admission test is stricter).
"""

from __future__ import annotations

import math
from dataclasses import replace

from scheduler_service.policy.admission import Candidate, earliest_deadline, placeable_throughout
from scheduler_service.policy.elasticflow import ElasticFlowPolicy
from scheduler_service.policy.interface import Decision, RejectionReason
from scheduler_service.policy.overhead import PAPER_OVERHEAD
from scheduler_service.policy.plan import Overhead, Plan
from scheduler_service.policy.strategies import SHIPPED, ElasticFlowStrategies
from scheduler_service.policy.timeline import Timeline
from scheduler_service.policy.topology import Topology

WIDE = 0.5  # a run over this share of the cluster pays the integral of the price over what it takes
SEARCH_DOUBLINGS = 6  # windows up to 64x the asked one
SEARCH_STEPS = 8


def plan_price(plan: Plan, others: Timeline, slot: int, interval: float, mu: float) -> float:
    """Seconds of the whole cluster the plan costs at the current prices.

    Each GPU pays its slot's price as the slot is, Awerbuch, Azar and
    Plotkin's price, a first-order estimate that holds for requests small
    beside the capacity. A run over half the cluster (`WIDE`), which leaves
    no room for another like it, pays the integral of the price over the
    share it takes: priced at the slot as it was, a 16-GPU job on an idle
    16-GPU cluster cost nothing, and on Alibaba's openb126 such a job held
    the whole cluster for 46 hours while 19 later jobs were turned away. The
    integral from a fifth of the cluster up (1/ln(mu), the analysis's bound)
    also priced out the short half-cluster jobs of generated 16-GPU traces,
    which fit (docs/evaluation.md)."""
    cap = others.capacity
    cost = 0.0
    for run in plan.runs:
        for a, b, free in others.forward(max(run.start, slot), run.end):
            used = 1.0 - free / cap
            if run.gpus <= WIDE * cap:
                cost += run.gpus * (b - a) * (mu ** used - 1.0) / (mu - 1.0)
            else:
                taken = min(1.0, used + run.gpus / cap)
                cost += cap * (b - a) * (_price_integral(taken, mu) - _price_integral(used, mu))
    return cost * interval / cap


def _price_integral(u: float, mu: float) -> float:
    """The integral of p(x) = (mu^x - 1) / (mu - 1) from 0 to u."""
    return ((mu ** u - 1.0) / math.log(mu) - u) / (mu - 1.0)


class ElasticFlowOverload(ElasticFlowPolicy):
    name = "elasticflow-overload"
    mu = 100.0  # price of a full slot over an idle one, plus one
    budget_s = 300.0  # what one met deadline is worth, in seconds of the whole cluster

    def __init__(self, topology: Topology, interval: float = 60.0, overhead: Overhead = PAPER_OVERHEAD, *,
                 strategies: ElasticFlowStrategies = SHIPPED) -> None:
        super().__init__(topology, interval, overhead, strategies=strategies)

    def _refuse(self, cand: Candidate, plan: Plan, others: Timeline, slot: int) -> Decision | None:
        if plan_price(plan, others, slot, self.clock.interval, self.mu) <= self.budget_s:
            return None
        busy = 1.0 - _mean_free(plan, others, slot)
        peak = max((run.gpus for run in plan.runs), default=0)
        return self._reject(
            cand.job, RejectionReason.WINDOW_IN_DEMAND,
            f"it could be guaranteed, but its plan would hold {plan_gpu_hours(plan, self.clock.interval):.1f} "
            f"GPU-hours, up to {peak} of the {others.capacity} GPUs, in slots already {busy:.0%} reserved: more "
            "than one job is worth at these prices; a later deadline spreads it thinner over more slots",
            self._earliest(cand, slot),
        )

    def _earliest(self, cand: Candidate, slot: int) -> float | None:
        """The earliest deadline found that this policy would admit now:
        capacity-feasible on the current timeline and within budget. Prices
        fall as the deadline moves into emptier slots, so double the window
        until one passes, then bisect; every answer was checked."""
        job = cand.job
        assert job.deadline is not None
        now = slot * self.clock.interval

        def admits(deadline: float) -> bool:
            trial = replace(cand, job=replace(job, deadline=deadline))
            plan = self.plan_on(trial, slot, self.timeline)
            return (plan is not None and placeable_throughout(plan, self.plans, self.topology.num_gpus)
                    and plan_price(plan, self.timeline, slot, self.clock.interval, self.mu) <= self.budget_s)

        lo = max(job.deadline, earliest_deadline(cand, slot, self.timeline, self.clock))
        if admits(lo):
            return lo
        window = max(lo - now, self.clock.interval)
        for _ in range(SEARCH_DOUBLINGS):
            hi = now + 2 * window
            if admits(hi):
                break
            lo, window = hi, 2 * window
        else:
            return None
        for _ in range(SEARCH_STEPS):
            mid = self.clock.slot_after((lo + hi) / 2) * self.clock.interval
            if mid >= hi or mid <= lo:
                break
            if admits(mid):
                hi = mid
            else:
                lo = mid
        return hi


def plan_gpu_hours(plan: Plan, interval: float) -> float:
    return sum((r.end - r.start) * r.gpus for r in plan.runs) * interval / 3600


def _mean_free(plan: Plan, others: Timeline, slot: int) -> float:
    """Free share of the cluster over the plan's slots, weighted by its GPUs."""
    weight = free_sum = 0.0
    for run in plan.runs:
        for a, b, free in others.forward(max(run.start, slot), run.end):
            weight += run.gpus * (b - a)
            free_sum += run.gpus * (b - a) * free / others.capacity
    return free_sum / weight if weight else 1.0
