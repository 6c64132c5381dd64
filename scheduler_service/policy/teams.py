"""Teams that share a cluster: a guaranteed share each, lent while unused.

Each team's deadline runs are admitted against its own share only: one
instance of the chosen policy per team plans the team's runs on a cluster of
its share's size (MSS admission per team), so a team that floods the queue
fills its own share and no one else's. What a team does not use goes to the
other teams' runs as extra width and to best-effort runs, split between teams
in proportion to their shares (weighted max-min), within each team's
borrowing limit and each lender's lending limit.

The rule for loans: a guarantee never rests on borrowed GPUs. A run is
admitted only on its team's share; a borrowed GPU is extra width that a
guaranteed run may take only if its plan still holds when the GPU is taken
back at the next slot (`can_widen`). So the owner reclaims by planning: at the
slot its run needs the GPU, the lending pass has less to lend and the
borrower shrinks; the owner's plan pays the hand-over like any other start,
and no owner's run misses because of a loan.

Placement is the whole cluster's (one buddy tree): the teams' shares are
GPU counts, not GPU sets, so a team's runs go wherever the tree has room.
Guaranteed runs that cannot afford an unplanned restart are moved last, and
lent extras are given back first if placing them would move one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from scheduler_service.policy.allocation import next_level, step_cost
from scheduler_service.policy.elasticflow import ElasticFlowPolicy
from scheduler_service.policy.interface import (
    Decision, RejectionReason, SchedulingPolicy, SchedulingReply, SchedulingRequest,
)
from scheduler_service.policy.jobs import Job, JobStatus
from scheduler_service.policy.placement import Block
from scheduler_service.policy.topology import Topology


@dataclass(frozen=True, slots=True)
class TeamUse:
    """What a team holds as last placed: `held` GPUs, `borrowed` of them beyond its share."""

    name: str
    share: int
    held: int
    borrowed: int


@dataclass(frozen=True, slots=True)
class Team:
    """A team's guarantee: `share` GPUs; at most `borrowing_limit` GPUs more
    at once from the others (None: no limit), and at most `lending_limit` of
    its unused share lent at once (None: all of it)."""

    name: str
    share: int
    borrowing_limit: int | None = None
    lending_limit: int | None = None


class TeamsPolicy(SchedulingPolicy):
    """Per-team admission, cluster-wide lending and placement."""

    name = "teams"

    def __init__(self, topology: Topology, teams: Sequence[Team],
                 inner: Callable[[Topology], SchedulingPolicy]) -> None:
        if not teams:
            raise ValueError("a teams policy needs at least one team")
        first = inner(Topology(1, max(1, teams[0].share), 1))
        super().__init__(topology, first.clock.interval, first.clock.overhead)
        if sum(t.share for t in teams) > topology.num_gpus:
            raise ValueError(f"the teams' shares add up to {sum(t.share for t in teams)} GPUs; "
                             f"the cluster has {topology.num_gpus}")
        if len({t.name for t in teams}) != len(teams):
            raise ValueError("team names must be distinct")
        self.teams = {t.name: t for t in teams}
        self.inner: dict[str, SchedulingPolicy] = {
            t.name: first if i == 0 else inner(Topology(1, max(1, t.share), 1)) for i, t in enumerate(teams)}
        self.name = first.name  # type: ignore[misc]
        self.clock = first.clock
        self.jobs: dict[str, Job] = {}  # admitted, until finished
        self.lent: dict[str, int] = {}  # GPUs each team's runs hold beyond its share, as last placed

    # -- the one entry point -------------------------------------------------
    def schedule(self, request: SchedulingRequest) -> SchedulingReply:
        now = request.now
        finished: dict[str, list[str]] = {name: [] for name in self.teams}
        for job_id in request.finished:
            job = self.jobs.pop(job_id, None)
            if job is not None:
                finished[job.team].append(job_id)
        arrivals: dict[str, list[Job]] = {name: [] for name in self.teams}
        refused: list[Decision] = []
        for job in request.arrivals:
            if job.team not in self.teams:
                refused.append(Decision(job_id=job.job_id, admitted=False, reason=RejectionReason.UNKNOWN_TEAM,
                                        message=f"no team {job.team!r} here (teams: {', '.join(self.teams)})"))
            else:
                self.jobs[job.job_id] = job
                arrivals[job.team].append(job)
        replies = {}
        for name, policy in self.inner.items():
            mine = {j: st for j, st in request.status.items() if j in self.jobs and self.jobs[j].team == name}
            replies[name] = policy.schedule(SchedulingRequest(now, arrivals[name], finished[name], mine))
        decisions = refused + [self._said(name, d, now) for name, r in replies.items() for d in r.decisions]
        for d in decisions:
            if not d.admitted:
                self.jobs.pop(d.job_id, None)
        alloc = {j: g for r in replies.values() for j, g in r.allocation.items()}
        status = {j: request.status.get(j) or JobStatus(self.jobs[j].iterations) for j in alloc}
        base = dict(alloc)
        self._lend(alloc, status, now)
        placement = self._place(alloc, base, status, now)
        self.lent = {name: max(0, sum(alloc[j] for j in alloc if self.jobs[j].team == name) - t.share)
                     for name, t in self.teams.items()}
        wakes = [r.wake_at for r in replies.values() if r.wake_at is not None]
        return SchedulingReply(decisions=decisions, allocation=alloc, placement=placement,
                               wake_at=min(wakes, default=None),
                               projected_finish=self.projected_finish(self.jobs, alloc, status, now))

    def speed(self, job: Job, gpus: int) -> float:
        return self.inner[job.team].speed(job, gpus) if job.team in self.inner else job.curve.speed(gpus)

    def used(self) -> list[TeamUse]:
        """Each team's GPUs as last placed."""
        out = []
        for name, team in self.teams.items():
            held = sum(size for j, (_, size) in self.placer.blocks.items() if j in self.jobs
                       and self.jobs[j].team == name)
            out.append(TeamUse(name, team.share, held, self.lent.get(name, 0)))
        return out

    # -- lending ---------------------------------------------------------------
    def _lend(self, alloc: dict[str, int], status: Mapping[str, JobStatus], now: float) -> None:
        """The GPUs no team's plan holds, to the runs that gain most from
        them, team by team in proportion to shares (the team least served
        for its share first), within the limits."""
        held = {name: sum(g for j, g in alloc.items() if self.jobs[j].team == name) for name in self.teams}
        unowned = self.topology.num_gpus - sum(t.share for t in self.teams.values())
        lendable = {name: max(0, t.share - held[name]) if t.lending_limit is None
                    else min(t.lending_limit, max(0, t.share - held[name])) for name, t in self.teams.items()}
        spare = min(self.topology.num_gpus - sum(alloc.values()), unowned + sum(lendable.values()))
        levels = {j: self.jobs[j].curve.capped(self.topology.max_job_gpus) for j in alloc}
        while spare > 0:
            best: tuple[float, float, str, int] | None = None
            for job_id, gpus in alloc.items():
                job, team = self.jobs[job_id], self.teams[self.jobs[job_id].team]
                want = next_level(levels[job_id], gpus)
                if want is None or want - gpus > spare:
                    continue
                if team.borrowing_limit is not None and held[team.name] + want - gpus > team.share + team.borrowing_limit:
                    continue
                if not self._can_widen(job, want, status[job_id], now, self._lasts(want - gpus, lendable, unowned, now)):
                    continue
                served = held[team.name] / max(team.share, 1)
                cost = step_cost(job, levels[job_id], status[job_id].remaining, gpus, want)
                if best is None or (served, cost, job_id) < best[:3]:
                    best = (served, cost, job_id, want)
            if best is None:
                return
            _, _, job_id, want = best
            team_name = self.jobs[job_id].team
            spare -= want - alloc[job_id]
            held[team_name] += want - alloc[job_id]
            alloc[job_id] = want

    def _can_widen(self, job: Job, gpus: int, own: JobStatus, now: float, unclaimed: float) -> bool:
        policy = self.inner[job.team]
        return policy.can_widen(job.job_id, gpus, now, own, unclaimed) if isinstance(policy, ElasticFlowPolicy) \
            else True

    def _lasts(self, gpus: int, lendable: Mapping[str, int], unowned: int, now: float) -> float:
        """How long a loan of `gpus` GPUs lasts at least: forever from GPUs no
        team owns, else until the first lender whose share they may come
        from claims them (the least, as it is not known whose they will be)."""
        if gpus <= unowned:
            return float("inf")
        spans = [policy.unclaimed_for(gpus, now) for name, policy in self.inner.items()
                 if lendable.get(name, 0) > 0 and isinstance(policy, ElasticFlowPolicy)]
        return min(spans, default=0.0)

    # -- placement -------------------------------------------------------------
    def _place(self, alloc: dict[str, int], base: Mapping[str, int], status: Mapping[str, JobStatus], now: float):
        pinned: set[str] = set()
        growing: dict[str, Block] = {}
        for name, policy in self.inner.items():
            if isinstance(policy, ElasticFlowPolicy):
                pinned |= policy.cannot_move({j: g for j, g in alloc.items() if self.jobs[j].team == name},
                                             status, now)
                growing |= policy.grows_into({j: b for j, b in self.placer.blocks.items()
                                              if j in self.jobs and self.jobs[j].team == name}, now)
        while True:
            before = self.placer.snapshot()
            placement = self.placer.place(alloc, pinned, growing=growing)
            lent = [j for j in alloc if alloc[j] > base.get(j, 0)]
            if not placement.moved & pinned or not lent:
                break
            self.placer.restore(before)
            job_id = max(lent, key=lambda j: (alloc[j] - base.get(j, 0), j))
            alloc[job_id] = base.get(job_id, 0)
        for name, policy in self.inner.items():
            if isinstance(policy, ElasticFlowPolicy):
                policy.were_moved({j for j in placement.moved if self.jobs[j].team == name})
        return placement

    # -- what users are told ---------------------------------------------------
    def _said(self, team: str, decision: Decision, now: float) -> Decision:
        """A decision in the team's terms: a rejection names the team and its
        share, one for capacity says how much of the share is promised and
        for how long, and one the team's share cannot hold, though the
        cluster could, says so rather than "infeasible even on an idle
        cluster"."""
        if decision.admitted:
            return decision
        share, inner = self.teams[team].share, self.inner[team]
        update: dict[str, object] = {"message": f"team {team} ({share} guaranteed GPUs): {decision.message}"}
        job = self.jobs[decision.job_id]
        if decision.reason in (RejectionReason.INSUFFICIENT_CAPACITY, RejectionReason.WINDOW_IN_DEMAND) \
                and isinstance(inner, ElasticFlowPolicy) and job.deadline is not None:
            promised = inner.promises(now, job.deadline)
            runs = f"{promised.plans} admitted run{'s' if promised.plans != 1 else ''}"
            said = (f"team {team}: up to {promised.gpus} of its {share} guaranteed GPUs are promised to {runs} "
                    f"before this run's deadline (the last promise ends in {duration(promised.ends_in_s)})")
            # The pricing's reason says more than the count; the count says nothing more.
            update["message"] = said if decision.reason is RejectionReason.INSUFFICIENT_CAPACITY \
                else f"{said}; {decision.message}"
        if decision.reason is RejectionReason.INFEASIBLE_ALONE and share < self.topology.num_gpus:
            update["reason"] = RejectionReason.INSUFFICIENT_CAPACITY
            update["message"] = (f"team {team} ({share} guaranteed GPUs): even its whole share cannot finish it in "
                                 f"time ({decision.message}); a later "
                                 "deadline, or a team with a larger share")
        return decision.model_copy(update=update)


def duration(seconds: float) -> str:
    """A span for a person: 40 s, 12 min, 3 h 05 min."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    return f"{minutes} min" if minutes < 60 else f"{minutes // 60} h {minutes % 60:02d} min"
