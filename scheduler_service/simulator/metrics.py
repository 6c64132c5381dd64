"""Summary figures of a simulation, as the paper reports them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from scheduler_service.simulator.engine import Run

# The service's control loop; the bare policy (engine.py) with the paper's
# restart cost; or the bare policy counted as the authors' simulator counts
# (restarts free: it meets a job when its planner's estimate does, and that
# estimate leaves restarts out; data/reference/README.md).
Actuation = Literal["service", "ideal", "authors"]


class PolicyResult(BaseModel):
    policy: str
    actuation: Actuation = "ideal"
    trace: str = ""
    cluster: str = ""
    interval_s: float = 60.0
    jobs: int
    deadline_jobs: int
    best_effort_jobs: int
    met_deadline: int
    deadline_ratio: float  # met / deadline jobs; rejected ones count as missed
    admitted: int
    rejected: int
    admitted_missed: int  # admitted deadline jobs that still missed
    admitted_deadline: int = 0  # admitted deadline jobs: what admitted_missed is a share of
    avg_jct_s: float | None  # finished jobs, submit to finish
    gpu_utilization: float  # GPU-seconds held / (GPUs x makespan)
    use_by_kind: dict[str, float] = {}  # the same, per GPU kind of a mixed cluster
    ratio_by_team: dict[str, float] = {}  # the deadline ratio of each team's jobs, when jobs name teams
    one_queue: bool = False  # the teams' jobs run without their teams file, beside a run with it
    makespan_s: float
    restarts: int
    ticks: int
    wall_s: float
    note: str | None = None  # what the policy wants readers to know (e.g. a fallback it used)


def summarize(run: Run, trace: str = "", cluster: str = "", interval_s: float = 60.0,
              actuation: Actuation = "ideal") -> PolicyResult:
    records = run.records
    deadline = [r for r in records if r.job.deadline is not None]
    admitted = [r for r in records if r.decision is not None and r.decision.admitted]
    rejected = [r for r in records if r.decision is not None and not r.decision.admitted]
    met = sum(1 for r in deadline if r.met_deadline)
    admitted_missed = sum(1 for r in admitted if r.job.deadline is not None and not r.met_deadline)
    finished = [r for r in records if r.finish is not None]
    jct = [r.finish - r.job.submit_time for r in finished]  # type: ignore[operator]
    start = min((r.job.submit_time for r in records), default=0.0)
    end = max((r.finish for r in finished), default=start)  # type: ignore[type-var]
    makespan = max(end - start, 1e-9)
    held = sum(r.gpu_seconds for r in records)
    teams = sorted({r.job.team for r in deadline if r.job.team})
    ratio_by_team = {team: sum(1 for r in deadline if r.job.team == team and r.met_deadline)
                     / sum(1 for r in deadline if r.job.team == team) for team in teams}
    use_by_kind = {kind: sum(r.kind_seconds.get(kind, 0.0) for r in records) / (gpus * makespan)
                   for kind, gpus in run.kinds.items()}
    return PolicyResult(
        policy=run.policy, actuation=actuation, trace=trace, cluster=cluster, interval_s=interval_s,
        jobs=len(records), deadline_jobs=len(deadline), best_effort_jobs=len(records) - len(deadline),
        met_deadline=met, deadline_ratio=met / len(deadline) if deadline else 1.0,
        admitted=len(admitted), rejected=len(rejected), admitted_missed=admitted_missed,
        admitted_deadline=sum(1 for r in admitted if r.job.deadline is not None),
        avg_jct_s=sum(jct) / len(jct) if jct else None,
        gpu_utilization=held / (run.capacity * makespan) if run.capacity else 0.0, use_by_kind=use_by_kind,
        ratio_by_team=ratio_by_team,
        makespan_s=makespan, restarts=sum(r.restarts for r in records), ticks=run.ticks, wall_s=run.wall_s,
    )
