"""ElasticFlow: MSS admission, greedy allocation of the rest, buddy placement.

The policy keeps one plan per admitted deadline job, all reserved in a free
timeline. Invariant, checked on every step: each guaranteed job's plan, from
now on, covers its remaining iterations after paying for every restart it
implies. Plans are replaced only by other plans that hold the same invariant,
so an admitted job meets its deadline when throughputs are as profiled.

Mechanisms with measured alternatives (the re-plan order, the plan shape,
the migration allowance, placement tiers, refreshes, the layout choice) are
strategies the policy is built with (`strategies=`, strategies.py); the
defaults are the policy as shipped.

Policies composed of several (teams.py) ask it through five small hooks
(`can_widen`, `unclaimed_for`, `cannot_move`, `grows_into`, `were_moved`) that read its plans: they stay in
this module, with the state they read, rather than splitting it.

One module of about 500 lines for that reason: admission, the restoring of
allowances, allocation (which jobs keep their width, including those whose
deadline lapsed, and who grows) and placement each read and change the same
plans, timeline and guaranteed set, and the invariant above is about all of
them at once. The computations are already elsewhere (admission.py,
allocation.py, plan.py, placement.py); what is left here is the state and
the order of the steps, which split in two would each take the policy whole.

With `admission=False` (the paper's ablation) nothing is rejected: a job that
cannot be planned gets whatever its cap can still take before its deadline,
in deadline order, and can crowd out later jobs.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from typing import Mapping

from scheduler_service.policy.admission import (
    Candidate, Refused, Replanned, displace, earliest_deadline, placeable_throughout, plan_all, plan_one,
)
from scheduler_service.policy.allocation import (
    cannot_afford_restarts, grant_is_safe, grant_rescues, grow, growth_blocks, keep, narrower_for_now, unclaimed_s)
from scheduler_service.policy.interface import (
    Decision, RejectionReason, SchedulingPolicy, SchedulingReply, SchedulingRequest,
)
from scheduler_service.policy.jobs import Job, JobStatus
from scheduler_service.policy.overhead import PAPER_OVERHEAD
from scheduler_service.policy.placement import Block, Placement
from scheduler_service.policy.promises import Promises, promised
from scheduler_service.policy.plan import Overhead, Plan, cover, fill
from scheduler_service.policy.strategies import SHIPPED, ElasticFlowStrategies
from scheduler_service.policy.timeline import Timeline
from scheduler_service.policy.topology import Topology


REPLAN_ALL_UP_TO = 1_000  # admitted jobs; see _replan_with
DISPLACE_AT_MOST = 4


class ElasticFlowPolicy(SchedulingPolicy):
    name = "elasticflow"

    def __init__(
        self,
        topology: Topology,
        interval: float = 60.0,
        overhead: Overhead = PAPER_OVERHEAD,
        admission: bool = True,
        *,
        strategies: ElasticFlowStrategies = SHIPPED,
    ) -> None:
        super().__init__(topology, interval, overhead)
        self.admission = admission
        self.strategies = strategies
        self.timeline = Timeline(topology.num_gpus)
        self.jobs: dict[str, Job] = {}
        self.levels: dict[str, tuple[int, ...]] = {}
        self.plans: dict[str, Plan] = {}  # deadline jobs with a reservation
        self.guaranteed: set[str] = set()  # those whose plan meets the deadline
        self.by_deadline: list[tuple[float, str]] = []  # (deadline, id) of admitted deadline jobs, sorted
        self.moved: set[str] = set()  # guaranteed jobs the last placement moved, or brought back from a grant
        self._on_grants: set[str] = set()  # jobs the last step gave more than their plan
        self._refreshed: int | None = None  # the last slot whose plans strategies.refresh renewed

    # -- the one entry point -------------------------------------------------
    def schedule(self, request: SchedulingRequest) -> SchedulingReply:
        now = request.now
        slot = self.clock.slot_of(now)
        status = dict(request.status)
        for job_id in request.finished:
            self._forget(job_id, slot)
        self.timeline.advance(slot)
        for job_id in [j for j in self.plans if self.jobs[j].deadline <= now]:  # type: ignore[operator]
            self._demote(job_id, slot)  # a missed deadline: keep training, best-effort
        self._restore_allowances(slot, status)
        decisions = []
        for job in sorted(request.arrivals, key=lambda j: (j.submit_time, j.job_id)):
            status.setdefault(job.job_id, JobStatus(job.iterations))
            decisions.append(self._arrive(job, slot, status))
            if not decisions[-1].admitted and job.job_id not in self.jobs:  # nothing of it stays (for months)
                self.levels.pop(job.job_id, None)
        alloc = self._allocate(slot, status)
        placement = self._place(slot, alloc, status)  # may give grants back: before anything reads alloc
        self._on_grants = {j for j, gpus in alloc.items() if j in self.plans and gpus > self.plans[j].gpus_at(slot)}
        wake = self._next_rise(slot, alloc)
        return self.reply(request, decisions, alloc, self.jobs,
                          wake_at=None if wake is None else wake * self.clock.interval, placement=placement)

    # -- admission -----------------------------------------------------------
    def levels_for(self, job: Job) -> tuple[int, ...]:
        """The GPU counts this policy may give the job: every useful power of two."""
        return job.curve.capped(self.topology.max_job_gpus)

    def plan_on(self, cand: Candidate, slot: int, timeline: Timeline) -> Plan | None:
        """The candidate's plan on `timeline`, in this policy's plan shape."""
        return plan_one(cand, slot, timeline, self.clock, self.strategies.shape)

    def _allowance(self, job: Job, levels: tuple[int, ...]) -> float:
        return self.strategies.allowance.iterations(job, levels, self.clock)

    def candidate(self, job_id: str, status: Mapping[str, JobStatus], slot: int) -> Candidate:
        """An admitted job, to be re-planned keeping the slack `strategies.replan_keeps` says."""
        job, st, levels = self.jobs[job_id], status[job_id], self.levels[job_id]
        plan = self.plans.get(job_id)
        slack = 0.0
        if plan is not None and job_id in self.guaranteed:
            have = cover(plan, job.curve, slot, job.deadline, st.gpus, st.overhead_left, self.clock)  # type: ignore[arg-type]
            slack = self.strategies.replan_keeps.slack(self._allowance(job, levels), have - st.remaining)
        return Candidate(job, st, levels, slack, plan if job_id in self.guaranteed else None)

    def _refresh(self, slot: int, status: Mapping[str, JobStatus]) -> None:
        """Let `strategies.refresh` renew admitted plans, once a slot, just
        before the first deadline arrival that finds admitted jobs (the
        authors' simulator re-plans at each arrival; refresh.py)."""
        if self._refreshed == slot or not self.guaranteed:
            return
        self._refreshed = slot
        refreshed = self.strategies.refresh.before_arrivals(self, slot, status)
        if refreshed is not None:
            self.timeline = refreshed.timeline
            self.plans.update(refreshed.plans)

    def _arrive(self, job: Job, slot: int, status: dict[str, JobStatus]) -> Decision:
        if job.deadline is not None:
            self._refresh(slot, status)
        levels = self.levels_for(job)
        if not levels:
            return self._reject(job, RejectionReason.NO_USABLE_GPU_COUNT,
                                f"no measured GPU count of {job.model or 'this model'} fits the cluster")
        self.levels[job.job_id] = levels
        if job.deadline is None:
            self.jobs[job.job_id] = job
            return Decision(job_id=job.job_id, admitted=True, message="best-effort: runs on spare GPUs")
        now = slot * self.clock.interval
        cand = Candidate(job, status[job.job_id], levels, self._allowance(job, levels))
        if job.deadline <= now:  # still says what deadline would have been accepted now
            return self._reject(job, RejectionReason.DEADLINE_PASSED, "the deadline has already passed",
                                self._earliest(cand, slot))
        if not self.admission:
            self.jobs[job.job_id] = job
            self._replan_in_deadline_order(slot, status)
            plan = self.plans[job.job_id]
            if job.job_id in self.guaranteed:
                return self._admit(job, plan)
            return Decision(job_id=job.job_id, admitted=True, share=plan.share,
                            message="admitted without a guarantee (admission control is off)")
        empty = Timeline(self.topology.num_gpus, slot)
        if self.plan_on(cand, slot, empty) is None:
            return self._reject(
                job, RejectionReason.INFEASIBLE_ALONE,
                f"even alone, on {levels[-1]} GPU{'s' if levels[-1] > 1 else ''} (the most it can use of "
                f"{self.topology.num_gpus}), "
                f"it cannot finish {job.iterations:.0f} iterations in time",
                earliest_deadline(cand, slot, empty, self.clock),
            )
        fast = self.plan_on(cand, slot, self.timeline)
        if fast is not None and not placeable_throughout(fast, self.plans, self.topology.num_gpus):
            fast = None
        chosen = self.strategies.layout.choose(
            fast, lambda: self._replan_with(cand, slot, status), self.timeline, slot, self.clock)
        if isinstance(chosen, Plan):
            refusal = self._refuse(cand, chosen, self.timeline, slot)
            if refusal is not None:
                return refusal
            self._reserve(job, chosen, guaranteed=True)
            return self._admit(job, chosen)
        if chosen is not None:
            own = chosen.plans[job.job_id]
            chosen.timeline.add(own.runs, sign=-1)  # what the others leave
            refusal = self._refuse(cand, own, chosen.timeline, slot)
            chosen.timeline.add(own.runs)
            if refusal is not None:
                return refusal
            self._adopt(job, chosen)
            return self._admit(job, own)
        return self._reject(
            job, RejectionReason.INSUFFICIENT_CAPACITY,
            f"the GPUs it would need before its deadline are reserved by {len(self.guaranteed)} admitted jobs",
            self._earliest(cand, slot),
        )

    def _replan_with(self, cand: Candidate, slot: int, status: Mapping[str, JobStatus]) -> Replanned | Refused:
        """Re-plan admitted jobs together with the newcomer. Up to
        REPLAN_ALL_UP_TO admitted jobs, all of them in the strategies' order on
        an empty timeline (which also drops what jobs that ran ahead no longer
        need). Beyond, that costs tens of milliseconds a decision, so only the
        DISPLACE_AT_MOST admitted jobs due soonest after the newcomer that
        hold slots in its window are re-planned around it (bench/admission.py)."""
        order, shape = self.strategies.order, self.strategies.shape
        if len(self.guaranteed) <= REPLAN_ALL_UP_TO:
            return plan_all([self.candidate(j, status, slot) for j in self.guaranteed] + [cand],
                            slot, self.topology.num_gpus, self.clock, order=order, shape=shape)
        return self._displace(cand, slot, status)

    def _displace(self, cand: Candidate, slot: int, status: Mapping[str, JobStatus]) -> Replanned | Refused:
        """Room for `cand` from the few admitted jobs due soonest after it."""
        order, shape = self.strategies.order, self.strategies.shape
        assert cand.job.deadline is not None
        end = self.clock.slot_after(cand.job.deadline)
        movable = []
        for i in range(bisect_right(self.by_deadline, (cand.job.deadline, "\uffff")), len(self.by_deadline)):
            job_id = self.by_deadline[i][1]
            plan = self.plans.get(job_id)
            if job_id in self.guaranteed and plan is not None and any(r.start < end and r.end > slot for r in plan.runs):
                movable.append(self.candidate(job_id, status, slot))
                if len(movable) == DISPLACE_AT_MOST:
                    break
        return displace(cand, movable, slot, self.timeline, self.clock, order=order, shape=shape)

    def _earliest(self, cand: Candidate, slot: int) -> float | None:
        """The earliest deadline this policy would admit the job with now."""
        return earliest_deadline(cand, slot, self.timeline, self.clock)

    def _refuse(self, cand: Candidate, plan: Plan, others: Timeline, slot: int) -> Decision | None:
        """A rejection for a job that could be guaranteed, or None to admit it.
        The paper's policy admits every job it can guarantee; an overload
        policy overrides this (see overload.py)."""
        return None

    def _replan_in_deadline_order(self, slot: int, status: Mapping[str, JobStatus]) -> None:
        """Without admission control: every deadline job, in deadline order,
        gets its MSS if it still has one, else all its cap can take before its
        deadline, at the expense of later jobs (EDF's domino effect)."""
        timeline = Timeline(self.topology.num_gpus, slot)
        self.plans, self.guaranteed = {}, set()
        deadline_jobs = [j for j in self.jobs.values() if j.deadline is not None and j.deadline > slot * self.clock.interval]
        for job in sorted(deadline_jobs, key=lambda j: (j.deadline, j.submit_time, j.job_id)):
            levels = self.levels[job.job_id]
            cand = Candidate(job, status[job.job_id], levels, self._allowance(job, levels))
            plan = self.plan_on(cand, slot, timeline)
            if plan is None:
                top = cand.levels[-1]
                runs, _ = fill(job.curve, cand.levels, cand.status.remaining, slot, job.deadline, top,  # type: ignore[arg-type]
                               timeline, cand.status.gpus, cand.status.overhead_left, self.clock)
                plan = Plan(runs, top)
            else:
                self.guaranteed.add(job.job_id)
            timeline.add(plan.runs)
            self.plans[job.job_id] = plan
        self.timeline = timeline

    def _admit(self, job: Job, plan: Plan) -> Decision:
        finish = min(plan.end * self.clock.interval, job.deadline or 0.0)
        return Decision(
            job_id=job.job_id, admitted=True, guaranteed=True, share=plan.share, guaranteed_finish=finish,
            message=f"admitted with a minimum satisfactory share of {plan.share} GPU(s)",
        )

    def promises(self, now: float, until: float) -> Promises:
        """What the admitted plans hold until `until`: what a refusal for capacity can tell."""
        return promised(self.plans.values(), self.timeline, self.clock, now, until)

    @staticmethod
    def _reject(job: Job, reason: RejectionReason, message: str, earliest: float | None = None) -> Decision:
        return Decision(job_id=job.job_id, admitted=False, reason=reason, message=message,
                        earliest_feasible_deadline=earliest)

    def _reserve(self, job: Job, plan: Plan, guaranteed: bool) -> None:
        self.jobs[job.job_id] = job
        self.plans[job.job_id] = plan
        self.timeline.add(plan.runs)
        if guaranteed:
            self.guaranteed.add(job.job_id)
            insort(self.by_deadline, (job.deadline, job.job_id))

    def _adopt(self, job: Job, replanned: Replanned) -> None:
        self.timeline = replanned.timeline
        self.jobs[job.job_id] = job
        self.plans.update(replanned.plans)
        self.guaranteed.add(job.job_id)
        insort(self.by_deadline, (job.deadline, job.job_id))

    def _forget(self, job_id: str, slot: int) -> None:
        plan = self.plans.pop(job_id, None)
        if plan is not None:
            self.timeline.add(plan.runs, sign=-1, since=slot)
        if job_id in self.guaranteed:
            key = (self.jobs[job_id].deadline, job_id)
            i = bisect_right(self.by_deadline, key) - 1
            if i >= 0 and self.by_deadline[i] == key:
                del self.by_deadline[i]
        self.guaranteed.discard(job_id)
        self.jobs.pop(job_id, None)
        self.levels.pop(job_id, None)

    def _demote(self, job_id: str, slot: int) -> None:
        job = self.jobs[job_id]
        self._forget(job_id, slot)
        self.jobs[job_id] = job
        self.levels[job_id] = self.levels_for(job)

    def _restore_allowances(self, slot: int, status: Mapping[str, JobStatus]) -> None:
        """Give a job that lost ground against its plan a whole migration
        allowance again: one the last placement moved (an unplanned restart,
        paid out of its allowance) or, in the service, one that ran slower than
        planned (a launch slower than the restart charged, a speed below its
        profile) until its plan no longer covers it. It is re-planned alone on
        the free timeline, if there is room, so the next move does not find it
        with no slack; a moved job that finds no room, and could not pay for
        one more restart at its width, takes it from the jobs due soonest
        after it (`_rescue`; asked of every moved job, it reshuffled enough
        plans to cost the paper's policy 0.048 on dev102); otherwise it keeps its plan (and is
        pinned sooner). Kept on what was left of its allowance, a bert job of
        ITP cluster04 (128 GPUs, bare `elasticflow`) was moved again while
        pinned, when fragmentation left no other way, and missed by 218
        iterations. Off in `strategies`, such a job stays on the slack it has left."""
        moved, self.moved = self.moved, set()
        if not self.strategies.restore_allowances:
            return
        for job_id in sorted(self.guaranteed):
            job, st, plan, levels = self.jobs[job_id], status[job_id], self.plans[job_id], self.levels[job_id]
            have = cover(plan, job.curve, slot, job.deadline, st.gpus, st.overhead_left, self.clock)  # type: ignore[arg-type]
            if job_id not in moved and have >= st.remaining:
                continue  # on its plan
            allowance = self._allowance(job, levels)
            if have - st.remaining >= allowance:
                continue
            self.timeline.add(plan.runs, sign=-1, since=slot)
            new = self.plan_on(Candidate(job, st, levels, allowance), slot, self.timeline)
            if new is None and job_id in moved and self._pinned(job, st, have) \
                    and self._rescue(Candidate(job, st, levels, allowance), slot, status):
                continue  # its allowance back from the jobs due after it: the next forced move is paid for
            if new is None and have < st.remaining:  # short of its plan: room without the allowance, alone or not
                new = self.plan_on(Candidate(job, st, levels, 0.0), slot, self.timeline)
                if new is None and self._rescue(Candidate(job, st, levels, 0.0), slot, status):
                    continue
            self.plans[job_id] = plan = new or plan
            self.timeline.add(plan.runs, since=slot)

    def _pinned(self, job: Job, st: JobStatus, have: float) -> bool:
        """Its plan's slack no longer pays one more restart at the width it runs
        at: placement would move it only when nothing else works, and then it misses."""
        return bool(st.gpus) and have - st.remaining < job.curve.points[st.gpus] * self.clock.overhead(st.gpus)

    def _rescue(self, cand: Candidate, slot: int, status: Mapping[str, JobStatus]) -> bool:
        """A guaranteed job whose plan no longer covers what it has left (a
        move it could not afford: placement found no other way), or a moved
        one short of its allowance, which finds
        no room alone takes room from the few jobs due soonest after it, as a
        newcomer that does not fit would on a busy cluster (re-planning every
        job instead reshuffles plans the next arrivals are decided against:
        0.564 against 0.569 on ITP cluster03, 128 GPUs, bare policy); True
        if that gave everyone a plan. Without it, such a job
        ran out of plan seconds of work short of the end and waited hours on
        a full cluster (ITP cluster03 on 128 GPUs, through the service's loop)."""
        job_id = cand.job.job_id
        self.guaranteed.discard(job_id)  # it is the newcomer here
        replanned = self._displace(cand, slot, status)
        self.guaranteed.add(job_id)
        if not isinstance(replanned, Replanned):
            return False
        self.timeline = replanned.timeline
        self.plans.update(replanned.plans)
        return True

    # -- what a policy composed of several asks (teams.py) ------------------------
    def can_widen(self, job_id: str, gpus: int, now: float, own: JobStatus, unclaimed: float = 0.0) -> bool:
        """Whether running `job_id` on `gpus` GPUs, more than its plan gives it,
        keeps its guarantee even if the GPUs are taken back when their owner
        claims them, `unclaimed` seconds from now (GPUs lent from outside
        this policy's cluster: their owner says how long)."""
        if job_id not in self.guaranteed:
            return True
        return grant_is_safe(self.jobs[job_id], self.plans[job_id], own, gpus, self.clock.slot_of(now), self.clock,
                             unclaimed)

    def unclaimed_for(self, gpus: int, now: float) -> float:
        """How long from now no plan of this policy claims `gpus` of its GPUs: what a loan of them lasts."""
        return unclaimed_s(self.timeline, self.clock.slot_of(now), gpus, self.clock)

    def cannot_move(self, alloc: Mapping[str, int], status: Mapping[str, JobStatus], now: float) -> set[str]:
        """Guaranteed jobs that keep their width and could not afford one unplanned restart now."""
        return cannot_afford_restarts(self.guaranteed, self.jobs, self.plans, alloc, status,
                                      self.clock.slot_of(now), self.clock)

    def grows_into(self, blocks: Mapping[str, Block], now: float) -> dict[str, Block]:
        """Where its guaranteed jobs, placed at `blocks`, will grow (`growth_blocks`)."""
        return growth_blocks(blocks, self.plans, self.guaranteed, self.clock.slot_of(now))

    def were_moved(self, job_ids: set[str]) -> None:
        """A placement made outside this policy moved these jobs: their next
        step restores their migration allowance, as after its own moves."""
        self.moved |= job_ids & self.guaranteed

    # -- allocation ----------------------------------------------------------
    def _safe(self, job_id: str, gpus: int, slot: int, own: JobStatus) -> bool:
        """Granting `gpus` now keeps a guaranteed job's plan sufficient (allocation.py)."""
        return job_id not in self.guaranteed or grant_is_safe(
            self.jobs[job_id], self.plans[job_id], own, gpus, slot, self.clock,
            unclaimed_s(self.timeline, slot, gpus, self.clock))

    def _place(self, slot: int, alloc: dict[str, int], status: Mapping[str, JobStatus]) -> Placement:
        """Place the allocation; if that would move a job that cannot afford a
        restart, give back the largest new grant of spare GPUs and try again.
        Which jobs are spared, and in which tiers, is `strategies.tiers`."""
        def cannot_afford(restarts: int) -> set[str]:
            return cannot_afford_restarts(self.guaranteed, self.jobs, self.plans, alloc, status, slot, self.clock,
                                          restarts)

        pinned, fragile = self.strategies.tiers.split(cannot_afford)
        growing = growth_blocks(self.placer.blocks, self.plans, self.guaranteed, slot)
        while True:
            before = self.placer.snapshot()
            placement = self.placer.place(alloc, pinned, fragile, growing)
            self.moved = (placement.moved & self.guaranteed) | self._grants_ended(slot, alloc, status)
            if not placement.moved & pinned:
                return placement
            base = {j: (self.plans[j].gpus_at(slot) if j in self.plans else 0) for j in alloc}
            grants = [j for j, gpus in alloc.items() if gpus > base[j]]
            if not grants:
                narrower = narrower_for_now(alloc, status, self.levels, placement.moved - pinned,
                                            lambda j, g: self._safe(j, g, slot, status[j]))
                if narrower is None:
                    return placement
                self.placer.restore(before)
                alloc[narrower[0]] = narrower[1]
                continue
            self.placer.restore(before)
            # New grants go back first, then extras a job already held; largest first.
            job_id = max(grants, key=lambda j: (alloc[j] != status[j].gpus, alloc[j] - base[j], j))
            alloc[job_id] = base[job_id]

    def _grants_ended(self, slot: int, alloc: Mapping[str, int], status: Mapping[str, JobStatus]) -> set[str]:
        """Guaranteed jobs brought back to their plan's width from spare GPUs
        they ran on beyond it: the grant's two restarts (there and back) were
        paid out of their slack, as a move's is, so their allowance is
        restored the same way. Left on what remained, a job of ITP cluster06
        (128 GPUs, the paper's policy through the loop) went from 573
        iterations of slack to 66, and the move that fragmentation then forced
        on it made it miss. (Asking a grant to leave that slack instead cost
        0.05 of the deadline ratio under noise: jobs behind their plan no
        longer got the spare GPUs.)"""
        return {j for j in self._on_grants & self.guaranteed
                if 0 < alloc.get(j, 0) == self.plans[j].gpus_at(slot) < status[j].gpus}

    def _allocate(self, slot: int, status: Mapping[str, JobStatus]) -> dict[str, int]:
        alloc = {job_id: plan.gpus_at(slot) for job_id, plan in self.plans.items()}
        spare = self.topology.num_gpus - sum(alloc.values())
        assert spare >= 0, "plans over-reserve the cluster"

        def safe(job_id: str, gpus: int) -> bool:  # a grant of spare GPUs, beyond the plan
            st = status[job_id]
            return self._safe(job_id, gpus, slot, st) or (job_id in self.guaranteed and grant_rescues(
                self.jobs[job_id], self.plans[job_id], st, gpus, slot, self.clock,
                unclaimed_s(self.timeline, slot, gpus, self.clock)))

        best_effort = sorted((j for j in self.jobs if j not in self.plans),
                             key=lambda j: (self.jobs[j].deadline is None, self.jobs[j].submit_time, j))
        for job_id in best_effort:
            alloc.setdefault(job_id, 0)
        # A job whose deadline lapsed keeps the GPUs it runs on before anyone
        # grows past a plan: parked for another's extra width, a run 90
        # iterations from its end waited for a 20,000-iteration one.
        lapsed = [j for j in best_effort if self.jobs[j].deadline is not None]
        spare = keep(lapsed, status, alloc, spare, safe)
        deadline_jobs = sorted(self.plans, key=lambda j: (self.jobs[j].deadline, j))
        spare = grow(deadline_jobs, self.jobs, self.levels, status, alloc, spare, safe)
        grow(best_effort, self.jobs, self.levels, status, alloc, spare, safe)
        return alloc

    def _next_rise(self, slot: int, alloc: Mapping[str, int]) -> int | None:
        rises = [r for j, plan in self.plans.items() if (r := plan.next_rise(slot, alloc.get(j, 0))) is not None]
        return min(rises, default=None)


class ElasticFlowNoAdmission(ElasticFlowPolicy):
    name = "elasticflow-noadmit"

    def __init__(self, topology: Topology, interval: float = 60.0, overhead: Overhead = PAPER_OVERHEAD, *,
                 strategies: ElasticFlowStrategies = SHIPPED) -> None:
        super().__init__(topology, interval, overhead, admission=False, strategies=strategies)
