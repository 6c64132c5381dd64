"""Themis: finish-time fairness through auctions of GPU leases.

Mahajan et al., NSDI'20. A job's unfairness is rho = T_shared / T_ideal:
how long it takes in the shared cluster over how long it would take alone
on an exclusive 1/N share (N = jobs contending). Themis hands GPUs out as
leases; whenever GPUs come free (a lease expires, a job finishes) it holds
an auction for them:

1. Visibility (the fairness knob f): only the ceil((1 - f) * M) bidders with
   the highest rho, out of the M jobs that hold no lease, take part; f = 0
   lets everyone bid (most efficient), f close to 1 lets only the most
   unfair bid (most fair).
2. Partial-allocation auction: each visible job bids what winning is worth
   to it, the factor by which it improves its rho (rho if it waits one more
   lease over rho if it runs now), and the auction picks the set of winners
   that fits the free GPUs and maximizes the product of those factors
   (Nash social welfare), solved exactly as a small knapsack.
3. Leftovers: GPUs no visible job could use go to the remaining jobs, most
   unfair first, so the cluster stays work-conserving.

Winners hold their GPUs for one lease: 10 minutes by default, rounded up to
whole scheduling intervals. A lease has to outlast a restart (about 30 s
here) many times over to be worth what it costs, and Themis's leases are of
that order (minutes, not seconds); shorter leases buy little fairness for
many more preemptions. On elasticVpollux_e, leases of 1 to 20 minutes give
the same deadline ratio, and 1-minute leases restart jobs 6-7 times as often.
f defaults to 0.8: the auction is among the most unfair fifth of the jobs.
Every job runs on the GPU count it asked for.
Deadline-unaware: deadlines are never read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler_service.policy.baselines.edf import requested_width
from scheduler_service.policy.interface import (
    Decision,
    RejectionReason,
    SchedulingPolicy,
    SchedulingReply,
    SchedulingRequest,
)
from scheduler_service.policy.jobs import Job
from scheduler_service.policy.overhead import PAPER_OVERHEAD
from scheduler_service.policy.topology import Topology

DEFAULT_LEASE_S = 600.0
DEFAULT_FAIRNESS_KNOB = 0.8


@dataclass(slots=True)
class _State:
    job: Job
    width: int
    remaining: float
    ideal_elapsed: float = 0.0  # seconds the progress so far would have taken on a 1/N share
    ideal_speed: float = 0.0  # iterations/s on the 1/N share at the last call
    gpus: int = 0
    lease_end: float = 0.0


def knapsack(bids: list[tuple[int, float]], capacity: int) -> list[int]:
    """Indices of the bids (GPUs, value >= 0) that fit `capacity` with the largest total value.

    Exact dynamic programming over GPU counts; ties go to earlier bids, so
    the answer is deterministic.
    """
    best = [0.0] * (capacity + 1)
    chosen: list[list[int]] = [[] for _ in range(capacity + 1)]
    for index, (gpus, value) in enumerate(bids):
        for room in range(capacity, gpus - 1, -1):
            candidate = best[room - gpus] + value
            if candidate > best[room] + 1e-12:
                best[room] = candidate
                chosen[room] = chosen[room - gpus] + [index]
    return chosen[capacity]


class ThemisPolicy(SchedulingPolicy):
    name = "themis"

    def __init__(
        self,
        topology: Topology,
        interval: float = 60.0,
        overhead=PAPER_OVERHEAD,
        lease_s: float = DEFAULT_LEASE_S,
        fairness_knob: float = DEFAULT_FAIRNESS_KNOB,
    ) -> None:
        super().__init__(topology, interval, overhead)
        if not 0.0 <= fairness_knob < 1.0:
            raise ValueError("the fairness knob f must be in [0, 1)")
        self.lease = max(1, math.ceil(lease_s / interval - 1e-9)) * interval
        self.fairness_knob = fairness_knob
        self.states: dict[str, _State] = {}

    def schedule(self, request: SchedulingRequest) -> SchedulingReply:
        now = request.now
        for job_id in request.finished:
            self.states.pop(job_id, None)
        for job_id, state in self.states.items():
            st = request.status.get(job_id)
            if st is not None:
                if state.ideal_speed > 0:
                    state.ideal_elapsed += (state.remaining - st.remaining) / state.ideal_speed
                state.remaining = st.remaining
        decisions = [self._admit(job) for job in request.arrivals]
        share = self.topology.num_gpus / max(1, len(self.states))
        for state in self.states.values():
            state.ideal_speed = state.job.curve.speed(state.width) * min(1.0, share / state.width)

        leased = {j: s for j, s in self.states.items() if s.gpus and s.lease_end > now + 1e-6}
        free = self.topology.num_gpus - sum(s.gpus for s in leased.values())
        bidders = [s for j, s in self.states.items() if j not in leased]
        winners = self._auction(bidders, free, now)
        for state in bidders:
            if state.job.job_id in winners:
                state.gpus, state.lease_end = state.width, now + self.lease
            else:
                state.gpus, state.lease_end = 0, 0.0

        alloc = {j: s.gpus for j, s in self.states.items()}
        waiting = any(not g for g in alloc.values())
        ends = [s.lease_end for s in self.states.values() if s.gpus and s.lease_end > now + 1e-6]
        jobs = {j: s.job for j, s in self.states.items()}
        return self.reply(request, decisions, alloc, jobs, wake_at=min(ends) if waiting and ends else None)

    def _admit(self, job: Job) -> Decision:
        width = requested_width(job, self.topology)
        if not width:
            return Decision(job_id=job.job_id, admitted=False, reason=RejectionReason.NO_USABLE_GPU_COUNT,
                            message="no measured GPU count fits the request or the cluster")
        self.states[job.job_id] = _State(job, width, job.iterations)
        return Decision(job_id=job.job_id, admitted=True, share=width)

    def rho(self, state: _State, now: float, delay: float = 0.0) -> float:
        """Finish-time fairness if the job ran from `now + delay` on its GPUs to the end."""
        shared = (now - state.job.submit_time) + delay + state.remaining / state.job.curve.speed(state.width)
        ideal = state.ideal_elapsed + state.remaining / state.ideal_speed
        return shared / ideal

    def _auction(self, bidders: list[_State], free: int, now: float) -> set[str]:
        """Winners among `bidders` for `free` GPUs: the visible auction, then the leftovers."""
        if not bidders or free <= 0:
            return set()
        by_unfairness = sorted(bidders, key=lambda s: (-self.rho(s, now), s.job.submit_time, s.job.job_id))
        if sum(s.width for s in by_unfairness) <= free:
            return {s.job.job_id for s in by_unfairness}
        visible = by_unfairness[: max(1, math.ceil((1.0 - self.fairness_knob) * len(by_unfairness) - 1e-9))]
        bids = [(s.width, math.log(self.rho(s, now, self.lease) / self.rho(s, now))) for s in visible
                if s.width <= free]
        fitting = [s for s in visible if s.width <= free]
        winners = {fitting[i].job.job_id for i in knapsack(bids, free)}
        free -= sum(s.width for s in fitting if s.job.job_id in winners)
        for state in by_unfairness:
            if state.job.job_id not in winners and state.width <= free:
                winners.add(state.job.job_id)
                free -= state.width
        return winners
