"""How the planner lays out a plan and orders a re-plan: two strategies of
the ElasticFlow policy, each a small class with one method.

The shipped ones are the measured winners (docs/scheduling.md, Ablation):
plans moved forward from now, and a re-plan of everyone least laxity first.
The others are what the policy did before issue 13, kept so the ablation can
build them as configurations instead of patching the planner.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from scheduler_service.policy.plan import Plan, SlotClock, front_load

if TYPE_CHECKING:
    from scheduler_service.policy.admission import Candidate
    from scheduler_service.policy.timeline import Timeline

OrderKey = tuple[float, float, float, str]


class ReplanOrder(Protocol):
    """In which order a re-plan of many jobs gives each its plan: the jobs
    planned first get the free timeline, the later ones what is left."""

    def key(self, cand: Candidate, now: float) -> OrderKey: ...


@dataclass(frozen=True, slots=True)
class LeastLaxity:
    """Least laxity first, ties by deadline, then arrival. A job due later
    that cannot wait is planned before one due sooner that can, so the jobs
    with room to move are laid around the others (shipped)."""

    def key(self, cand: Candidate, now: float) -> OrderKey:
        assert cand.job.deadline is not None
        return (cand.laxity(now), cand.job.deadline, cand.job.submit_time, cand.job.job_id)


@dataclass(frozen=True, slots=True)
class DeadlineOrder:
    """Earliest deadline first, ties by arrival: plans a job due soon with days
    of laxity before one due later that cannot wait (ablation variant 6)."""

    def key(self, cand: Candidate, now: float) -> OrderKey:
        assert cand.job.deadline is not None
        return (cand.job.deadline, cand.job.submit_time, 0.0, cand.job.job_id)  # 0.0: no laxity term


class PlanShape(Protocol):
    """How the slots of a job's minimum satisfactory share are laid out in
    time, given the plan progressive filling found for `cand` (backwards
    from its deadline, at its share)."""

    def lay_out(self, filled: Plan, cand: Candidate, now_slot: int, timeline: Timeline, clock: SlotClock) -> Plan: ...


@dataclass(frozen=True, slots=True)
class FrontLoaded:
    """The share moved forward (`plan.front_load`): runs on what is free now
    and hands the slots before the deadline, which later jobs with similar
    deadlines need, back early (shipped)."""

    def lay_out(self, filled: Plan, cand: Candidate, now_slot: int, timeline: Timeline, clock: SlotClock) -> Plan:
        job, st = cand.job, cand.status
        assert job.deadline is not None
        return front_load(filled, job.curve, cand.levels, cand.need, now_slot, job.deadline, timeline,
                          st.gpus, st.overhead_left, clock)


@dataclass(frozen=True, slots=True)
class BackwardFilled:
    """The plan as progressive filling lays it, holding the slots just before
    the deadline: the paper's description and the policy before issue 13
    (ablation variant 1)."""

    def lay_out(self, filled: Plan, cand: Candidate, now_slot: int, timeline: Timeline, clock: SlotClock) -> Plan:
        return filled


LEAST_LAXITY = LeastLaxity()
DEADLINE_ORDER = DeadlineOrder()
FRONT_LOADED = FrontLoaded()
BACKWARD_FILLED = BackwardFilled()
