"""A cluster of several GPU kinds: one policy per kind, and the kind of each job.

A job runs on one kind at a time, so every pool is its own cluster, planned
by its own instance of the chosen policy with the job's curve on that kind;
this policy decides only which kind a job goes to. The rule: a deadline job
is tried on the kinds in order of its least GPU-time there as a fraction of
that kind's GPUs (`share_of_pool`), largest first, and the first kind that
guarantees its deadline keeps it. That is the kind where it is slowest: a
job with a wide window can meet it on slow GPUs, which a job with a tight
window cannot use, so the fast kinds stay free for those (`KindOrder`; the
opposite order, cheapest first, left the slow kind idle and met fewer
deadlines on all six reference traces: docs/scheduling.md). A best-effort
job goes to the least crowded kind first (it reserves nothing, so only
crowding decides how fast it runs).

With `moves=True`, a deadline job no kind admits may still be admitted if
one admitted job moves to another kind for it: the mover is re-admitted
there first, paying a full start (its guarantee must hold there, or nothing
changes), and only then the newcomer on the room it left. Each trial runs on
copies of the two pools' policies, so a failed one changes nothing.
"""

from __future__ import annotations

import copy
from enum import Enum
from typing import Callable, Mapping, Sequence

from scheduler_service.policy.interface import (
    Decision, RejectionReason, SchedulingPolicy, SchedulingReply, SchedulingRequest,
)
from scheduler_service.policy.jobs import Job, JobStatus
from scheduler_service.policy.placement import Placement
from scheduler_service.policy.topology import MixedTopology, Pool, Topology

MOVES_TRIED = 4  # admitted jobs a rejected newcomer may try to move away, per kind


class KindOrder(str, Enum):
    """Which kind a deadline job is tried on first."""

    SLOWEST_FIRST = "slowest-first"  # the most of its pool: room on the fast kinds stays for tight windows
    LEAST_SHARE = "least-share"  # the least of its pool: where it is cheapest, spilling over when full


def share_of_pool(job: Job, pool: Pool) -> float | None:
    """The least GPU-seconds an iteration of `job` costs on `pool`, over the
    pool's GPUs: the fraction of that kind the job's work takes at its most
    efficient width. None if the job cannot run there."""
    if not job.runs_on(pool.kind):
        return None
    curve = job.on(pool.kind).curve
    levels = curve.capped(pool.topology.max_job_gpus)
    if not levels:
        return None
    return min(g / curve.speed(g) for g in levels) / pool.topology.num_gpus


class KindsPolicy(SchedulingPolicy):
    """Routes jobs to per-kind policies and merges their replies."""

    name = "kinds"

    def __init__(self, topology: MixedTopology, inner: Callable[[Topology], SchedulingPolicy],
                 order: KindOrder = KindOrder.SLOWEST_FIRST, moves: bool = False) -> None:
        self.topology = topology  # type: ignore[assignment]
        self.order = order
        self.moves = moves
        self.inner: dict[str, SchedulingPolicy] = {p.kind: inner(p.topology) for p in topology.pools}
        first = self.inner[topology.pools[0].kind]
        self.name = first.name  # type: ignore[misc]  # reported as the policy it runs on every kind
        self.clock = first.clock
        self.jobs: dict[str, Job] = {}  # as submitted, every kind's curve
        self.kind: dict[str, str] = {}  # the kind each admitted job is planned on
        self.held: dict[str, str] = {}  # adopted jobs still on GPUs of this kind: tried there first

    # -- the one entry point -------------------------------------------------
    def schedule(self, request: SchedulingRequest) -> SchedulingReply:
        finished: dict[str, list[str]] = {k: [] for k in self.inner}
        for job_id in request.finished:
            kind = self.kind.pop(job_id, None)
            self.jobs.pop(job_id, None)
            if kind is not None:
                finished[kind].append(job_id)
        status = {k: self._status_on(k, request.status) for k in self.inner}
        replies: dict[str, SchedulingReply] = {}
        decisions: dict[str, Decision] = {}
        tried: dict[str, list[tuple[str, Decision]]] = {}
        waiting: dict[str, list[str]] = {}  # job -> kinds still to try, best first
        for job in sorted(request.arrivals, key=lambda j: (j.submit_time, j.job_id)):
            self.jobs[job.job_id] = job
            waiting[job.job_id] = self._order(job)
            tried[job.job_id] = []
            if not waiting[job.job_id]:
                self.jobs.pop(job.job_id)
                decisions[job.job_id] = Decision(
                    job_id=job.job_id, admitted=False, reason=RejectionReason.NO_USABLE_GPU_COUNT,
                    message=f"no throughput curve of {job.model or 'this model'} on any GPU kind here "
                            f"({', '.join(self.inner)})")
        first_round = True
        while first_round or any(waiting.values()):
            batch: dict[str, list[Job]] = {k: [] for k in self.inner}
            for job_id, kinds in waiting.items():
                if kinds:
                    kind = kinds.pop(0)
                    batch[kind].append(self.jobs[job_id].on(kind))
            for kind, policy in self.inner.items():
                if not (first_round or batch[kind]):
                    continue
                arrivals = batch[kind]
                for job in arrivals:
                    status[kind].setdefault(job.job_id, request.status.get(job.job_id) or JobStatus(job.iterations))
                reply = policy.schedule(SchedulingRequest(request.now, arrivals, finished[kind] if first_round else (),
                                                          status[kind]))
                replies[kind] = reply
                for decision in reply.decisions:
                    tried[decision.job_id].append((kind, decision))
                    if decision.admitted:
                        self.kind[decision.job_id] = kind
                        decisions[decision.job_id] = decision
                        waiting[decision.job_id] = []
                    else:
                        status[kind].pop(decision.job_id, None)
            first_round = False
        for job_id, attempts in tried.items():
            if job_id in decisions:
                continue
            job = self.jobs[job_id]
            full = [kind for kind, d in attempts if d.reason is RejectionReason.INSUFFICIENT_CAPACITY]
            moved = self._move_for(job, full, request, status, replies) if self.moves and full else None
            if moved is not None:
                decisions[job_id] = moved
            else:
                decisions[job_id] = self._rejection(job_id, attempts)
                self.jobs.pop(job_id, None)
        return self._merge(request, [decisions[j.job_id] for j in request.arrivals if j.job_id in decisions], replies)

    def hold(self, job_id: str, gpus: tuple[int, ...]) -> bool:
        if not gpus:
            return False
        pool = self.topology.pool_of(gpus[0])
        if not all(pool.holds(g) for g in gpus):
            return False
        self.held[job_id] = pool.kind
        return self.inner[pool.kind].hold(job_id, tuple(g - pool.first_gpu for g in gpus))

    def speed(self, job: Job, gpus: int) -> float:
        kind = self.kind.get(job.job_id, job.kind)
        return self.inner[kind].speed(job.on(kind), gpus) if kind in self.inner else job.curve.speed(gpus)

    # -- routing -------------------------------------------------------------
    def _order(self, job: Job) -> list[str]:
        """The kinds to try the job on, best first (see the module's rule)."""
        costs = {p.kind: share_of_pool(job, p) for p in self.topology.pools}
        usable = [k for k, c in costs.items() if c is not None]
        held = self.held.pop(job.job_id, None)
        if held in usable:
            return [held] + [k for k in self._order_by_cost(job, usable, costs) if k != held]
        return self._order_by_cost(job, usable, costs)

    def _order_by_cost(self, job: Job, usable: list[str], costs: Mapping[str, float | None]) -> list[str]:
        if job.deadline is None:
            crowd = {k: sum(1 for j in self.kind.values() if j == k) / self.topology.pool(k).topology.num_gpus
                     for k in usable}
            return sorted(usable, key=lambda k: (crowd[k], costs[k], k))
        sign = -1.0 if self.order is KindOrder.SLOWEST_FIRST else 1.0
        return sorted(usable, key=lambda k: (sign * costs[k], k))  # type: ignore[operator]

    def _status_on(self, kind: str, status: Mapping[str, JobStatus]) -> dict[str, JobStatus]:
        """The statuses of the jobs planned on `kind`; one whose GPUs are of
        another kind (moved there, not restarted yet) starts afresh."""
        out = {}
        for job_id, st in status.items():
            if self.kind.get(job_id) != kind:
                continue
            out[job_id] = st if not st.gpus or st.kind in ("", kind) else JobStatus(st.remaining)
        return out

    def _rejection(self, job_id: str, attempts: Sequence[tuple[str, Decision]]) -> Decision:
        """Every kind refused: the earliest deadline any kind would accept,
        what each kind said, and a reason that is true of the cluster (not
        "infeasible even on an idle cluster" when one kind failed only for
        lack of room)."""
        if len(attempts) == 1:
            return attempts[0][1]
        said = "; ".join(f"on {kind}: {d.message}" for kind, d in attempts)
        earliest = [d.earliest_feasible_deadline for _, d in attempts if d.earliest_feasible_deadline is not None]
        telling = [d for _, d in attempts if d.reason is not RejectionReason.INFEASIBLE_ALONE] or [d for _, d in attempts]
        best = min(telling, key=lambda d: (d.earliest_feasible_deadline is None, d.earliest_feasible_deadline or 0.0))
        return best.model_copy(update={"message": f"tried {', '.join(k for k, _ in attempts)}: {said}",
                                       "earliest_feasible_deadline": min(earliest, default=None)})

    # -- moves between kinds -------------------------------------------------
    def _move_for(self, job: Job, full: list[str], request: SchedulingRequest,
                  status: dict[str, dict[str, JobStatus]], replies: dict[str, SchedulingReply]) -> Decision | None:
        """Admit `job` on one of the kinds whose admitted jobs left it no room
        (`full`: not those that refused it for other reasons, such as keeping
        room for later arrivals) after moving one admitted job off it, or None."""
        for here in full:
            movers = [j for j, k in self.kind.items() if k == here and self.jobs[j].deadline is not None
                      and any(self.jobs[j].runs_on(k) for k in self.inner if k != here) and j in status[here]]
            movers.sort(key=lambda j: (status[here][j].remaining, j))
            for mover in movers[:MOVES_TRIED]:
                for there in self._order(self.jobs[mover]):
                    if there == here:
                        continue
                    decision = self._try_move(job, mover, here, there, request, status, replies)
                    if decision is not None:
                        return decision
        return None

    def _try_move(self, job: Job, mover: str, here: str, there: str, request: SchedulingRequest,
                  status: dict[str, dict[str, JobStatus]], replies: dict[str, SchedulingReply]) -> Decision | None:
        saved = copy.deepcopy(self.inner[here]), copy.deepcopy(self.inner[there])
        now, moving = request.now, self.jobs[mover].on(there)
        left_here = {j: s for j, s in status[here].items() if j != mover}
        on_there = dict(status[there])
        on_there[mover] = JobStatus(status[here][mover].remaining)  # a full start on the other kind
        reply_there = self.inner[there].schedule(SchedulingRequest(now, [moving], (), on_there))
        if any(d.guaranteed for d in reply_there.decisions):
            self.inner[here].schedule(SchedulingRequest(now, (), [mover], left_here))
            left_here[job.job_id] = request.status.get(job.job_id) or JobStatus(job.iterations)
            reply_here = self.inner[here].schedule(SchedulingRequest(now, [job.on(here)], (), left_here))
            decision = reply_here.decisions[0]
            if decision.admitted:
                self.kind[mover], self.kind[job.job_id] = there, here
                status[here], status[there] = left_here, on_there
                replies[here], replies[there] = reply_here, reply_there
                return decision.model_copy(update={
                    "message": f"{decision.message}, on {here}, after run {mover} moved to {there}"})
        self.inner[here], self.inner[there] = saved
        return None

    # -- the reply -----------------------------------------------------------
    def _merge(self, request: SchedulingRequest, decisions: list[Decision],
               replies: Mapping[str, SchedulingReply]) -> SchedulingReply:
        allocation: dict[str, int] = {}
        placement = Placement()
        wakes = []
        projected: dict[str, float] = {}
        for pool in self.topology.pools:
            reply = replies[pool.kind]
            for job_id, gpus in reply.allocation.items():
                if self.kind.get(job_id, pool.kind) != pool.kind:
                    continue  # moved off this kind in this very step
                allocation[job_id] = gpus
                if job_id in reply.placement.blocks:
                    first, size = reply.placement.blocks[job_id]
                    placement.blocks[job_id] = (pool.first_gpu + first, size)
            placement.moved |= reply.placement.moved
            projected.update({j: t for j, t in reply.projected_finish.items() if self.kind.get(j) == pool.kind})
            if reply.wake_at is not None:
                wakes.append(reply.wake_at)
        for job_id, kind in self.kind.items():  # moved: a new start on its new kind
            if job_id in request.status and request.status[job_id].kind not in ("", kind):
                placement.moved.add(job_id)
        return SchedulingReply(decisions=decisions, allocation=allocation, placement=placement,
                               wake_at=min(wakes, default=None), projected_finish=projected)
