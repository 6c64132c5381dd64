"""Refreshing admitted plans before a slot's arrivals are decided.

The shipped policy re-plans admitted jobs only when a newcomer does not fit
(admission.py) or a job lost ground (`_restore_allowances`). The authors'
simulator instead re-plans every admitted job at every slot with an arrival,
and trimming plans of jobs that ran ahead would hand capacity back earlier.
Both were measured and both lose (docs/scheduling.md, Ablation variants 2
and 3); they are kept as strategies so the ablation builds them, not patches.

A refresh runs at most once a slot, before that slot's first deadline
arrival that finds admitted jobs, and returns the plans it changed (with
the timeline they leave) or None to keep everything as it is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Protocol

from scheduler_service.policy.admission import Candidate, Replanned, plan_all
from scheduler_service.policy.jobs import JobStatus
from scheduler_service.policy.plan import cover

if TYPE_CHECKING:
    from scheduler_service.policy.elasticflow import ElasticFlowPolicy


class Refresh(Protocol):
    """New plans for admitted jobs before arrivals are decided, or None."""

    def before_arrivals(
        self, policy: ElasticFlowPolicy, slot: int, status: Mapping[str, JobStatus]
    ) -> Replanned | None: ...


@dataclass(frozen=True, slots=True)
class NoRefresh:
    """Plans stay as admitted until a newcomer needs a re-plan (shipped)."""

    def before_arrivals(
        self, policy: ElasticFlowPolicy, slot: int, status: Mapping[str, JobStatus]
    ) -> Replanned | None:
        return None


@dataclass(frozen=True, slots=True)
class ReplanAll:
    """Every admitted job re-planned from scratch, in the policy's re-plan
    order, as the authors' simulator does at each arrival; kept only if every
    job still gets a plan (ablation variant 2)."""

    def before_arrivals(
        self, policy: ElasticFlowPolicy, slot: int, status: Mapping[str, JobStatus]
    ) -> Replanned | None:
        cands = [policy.candidate(j, status, slot) for j in policy.guaranteed]
        strategies = policy.strategies
        replanned = plan_all(cands, slot, policy.topology.num_gpus, policy.clock,
                             order=strategies.order, shape=strategies.shape)
        return replanned if isinstance(replanned, Replanned) else None


@dataclass(frozen=True, slots=True)
class TrimAhead:
    """A job more than a slot of work ahead of its plan is re-planned alone,
    needing its remaining work and a whole allowance, so it gives back what
    it no longer needs; jobs due soonest first, or latest first (ablation
    variant 3). A job that cannot be re-planned keeps its plan."""

    latest_first: bool = False

    def before_arrivals(
        self, policy: ElasticFlowPolicy, slot: int, status: Mapping[str, JobStatus]
    ) -> Replanned | None:
        timeline, clock = policy.timeline.copy(), policy.clock
        plans = {}
        order = sorted(policy.guaranteed, key=lambda j: (policy.jobs[j].deadline, j), reverse=self.latest_first)
        for job_id in order:
            job, st, plan, levels = policy.jobs[job_id], status[job_id], policy.plans[job_id], policy.levels[job_id]
            assert job.deadline is not None
            allowance = policy.strategies.allowance.iterations(job, levels, clock)
            have = cover(plan, job.curve, slot, job.deadline, st.gpus, st.overhead_left, clock)
            if have - st.remaining <= allowance + job.curve.points[levels[0]] * clock.interval:
                continue
            timeline.add(plan.runs, sign=-1, since=slot)
            new = policy.plan_on(Candidate(job, st, levels, allowance), slot, timeline)
            timeline.add((new or plan).runs, since=slot)
            plans[job_id] = new or plan
        return Replanned(timeline, plans)


NO_REFRESH = NoRefresh()
REPLAN_ALL = ReplanAll()
TRIM_SOONEST_DUE = TrimAhead(latest_first=False)
TRIM_LATEST_DUE = TrimAhead(latest_first=True)
