"""The ElasticFlow policy's mechanisms that have measured alternatives, as
one typed set of strategies the policy is built with.

The defaults are the policy as shipped. Every other choice is a variant that
was measured and not kept (docs/scheduling.md, Ablation); they stay as
strategies, the way Gavel gives each policy its own small class, so that the
ablation (bench/ablation.py) builds each one through the constructor instead
of patching private code, and a variant cannot leak into the shipped policy.

    ElasticFlowPolicy(topology, strategies=ElasticFlowStrategies(order=DEADLINE_ORDER))
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.policy.allowance import (
    KEEP_FULL_ALLOWANCE,
    KEEP_WHAT_IS_LEFT,
    NO_ALLOWANCE,
    ONE_RESTART,
    PINNED_AND_FRAGILE,
    PINNED_ONLY,
    MigrationAllowance,
    PlacementTiers,
    ReplanSlack,
)
from scheduler_service.policy.layout import FAST_PATH_FIRST, REPLAN_FIRST, FreestWithin, LayoutChoice
from scheduler_service.policy.planning import (
    BACKWARD_FILLED,
    DEADLINE_ORDER,
    FRONT_LOADED,
    LEAST_LAXITY,
    PlanShape,
    ReplanOrder,
)
from scheduler_service.policy.refresh import NO_REFRESH, REPLAN_ALL, TRIM_LATEST_DUE, TRIM_SOONEST_DUE, Refresh


@dataclass(frozen=True, slots=True)
class ElasticFlowStrategies:
    """How ElasticFlow re-plans, lays out plans, keeps slack for migrations,
    spares jobs in placement, refreshes plans and admits a newcomer."""

    order: ReplanOrder = LEAST_LAXITY  # the re-plan of everyone (planning.py)
    shape: PlanShape = FRONT_LOADED  # every plan (planning.py)
    allowance: MigrationAllowance = ONE_RESTART  # slack a new plan carries (allowance.py)
    replan_keeps: ReplanSlack = KEEP_WHAT_IS_LEFT  # of it, what a re-planned job keeps (allowance.py)
    tiers: PlacementTiers = PINNED_AND_FRAGILE  # who placement moves last (allowance.py)
    restore_allowances: bool = True  # a job that lost ground gets a whole allowance again
    refresh: Refresh = NO_REFRESH  # admitted plans, before a slot's arrivals (refresh.py)
    layout: LayoutChoice = FAST_PATH_FIRST  # fast path or re-plan for a newcomer (layout.py)


SHIPPED = ElasticFlowStrategies()

__all__ = [
    "BACKWARD_FILLED", "DEADLINE_ORDER", "FAST_PATH_FIRST", "FRONT_LOADED", "KEEP_FULL_ALLOWANCE",
    "KEEP_WHAT_IS_LEFT", "LEAST_LAXITY", "NO_ALLOWANCE", "NO_REFRESH", "ONE_RESTART", "PINNED_AND_FRAGILE",
    "PINNED_ONLY", "REPLAN_ALL", "REPLAN_FIRST", "SHIPPED", "TRIM_LATEST_DUE", "TRIM_SOONEST_DUE",
    "ElasticFlowStrategies", "FreestWithin",
]
