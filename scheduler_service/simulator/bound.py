"""An upper bound on the deadline ratio that any scheduler could reach on a trace.

A linear-programming relaxation: job j meets its deadline to an extent
x_j in [0, 1]; doing so needs at least its least GPU-time that finishes
within its window (the cheapest mix of GPU counts, restarts ignored), spent
inside its window, never more GPUs at once than its largest level, while the
GPUs used by all jobs in any period never exceed the cluster. Any real
schedule is a feasible point with integral x, so max sum(x) / deadline jobs
bounds every policy. Windows are widened to a coarse time grid (which only
loosens the bound) to keep the LP under a few hundred thousand variables.

With `integral=True` each x_j is 0 or 1 (a MILP): a job meets its deadline
or not, as in any real schedule, so the bound is still a bound and is
tighter where large jobs against a small cluster let the LP count fractions
of them (docs/evaluation.md, "The 16-GPU case"). Only small instances solve
in reasonable time; `time_limit_s` stops the search and the best bound
HiGHS proved so far is reported (still a bound), with `exact` False.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from pydantic import BaseModel

from scheduler_service.policy.jobs import Job
from scheduler_service.policy.topology import Topology

MAX_VARIABLES = 300_000  # HiGHS solves this in seconds on 2 cores


class BoundResult(BaseModel):
    trace: str = ""
    cluster: str = ""
    deadline_jobs: int
    infeasible_alone: int  # cannot finish by the deadline even with every GPU it can use
    bound: float  # upper bound on the deadline ratio
    grid_s: float
    variables: int
    solve_s: float
    integral: bool = False
    exact: bool = True  # False: a MILP stopped at its time limit; `bound` is its proven bound, not its optimum
    chosen: list[str] = []  # integral: the jobs the best schedule found meets (what hindsight would pick)


def least_gpu_time(job: Job, max_gpus: int) -> float | None:
    """Least GPU-seconds that finish the job inside its window, mixing at most
    two GPU counts over time (an LP over counts has such an optimum); None if
    even the widest count is too slow."""
    assert job.deadline is not None
    window = job.deadline - job.submit_time
    levels = [g for g in job.curve.capped(max_gpus)]
    speed = job.curve.points
    best: float | None = None
    for i, a in enumerate(levels):
        if job.iterations / speed[a] <= window:  # one count alone
            cost = a * job.iterations / speed[a]
            best = cost if best is None else min(best, cost)
        for b in levels[i + 1:]:
            # t_a + t_b = window and speed_a t_a + speed_b t_b = iterations
            t_b = (job.iterations - speed[a] * window) / (speed[b] - speed[a])
            if 0 <= t_b <= window:
                cost = a * (window - t_b) + b * t_b
                best = cost if best is None else min(best, cost)
    return best


def deadline_ratio_bound(jobs: Sequence[Job], topology: Topology, grid_s: float | None = None, *,
                         integral: bool = False, time_limit_s: float | None = None) -> BoundResult:
    import time

    import highspy

    from scheduler_service.solver import quiet_highs

    started = time.perf_counter()
    capacity = topology.num_gpus
    deadline_jobs = [j for j in jobs if j.deadline is not None]
    usable: list[tuple[Job, float]] = []
    for job in deadline_jobs:
        need = least_gpu_time(job, topology.max_job_gpus)
        if need is not None:
            usable.append((job, need))
    infeasible = len(deadline_jobs) - len(usable)
    if not usable:
        return BoundResult(deadline_jobs=len(deadline_jobs), infeasible_alone=infeasible, bound=0.0,
                           grid_s=0.0, variables=0, solve_s=time.perf_counter() - started)
    start = min(j.submit_time for j, _ in usable)
    total_window = sum(j.deadline - j.submit_time for j, _ in usable)  # type: ignore[operator]
    grid = grid_s or max(1.0, total_window / max(MAX_VARIABLES - 3 * len(usable), len(usable)))
    # Widen windows outward to the grid: a looser relaxation, still a bound.
    edges = sorted({math.floor((j.submit_time - start) / grid) for j, _ in usable}
                   | {math.ceil((j.deadline - start) / grid) for j, _ in usable})  # type: ignore[operator]
    index = {e: i for i, e in enumerate(edges)}
    seg_len = np.diff(np.array(edges, dtype=float)) * grid / 3600.0  # hours
    n, k = len(usable), len(edges) - 1

    cols_job, cols_seg = [], []
    for jdx, (job, _) in enumerate(usable):
        a = index[math.floor((job.submit_time - start) / grid)]
        b = index[math.ceil((job.deadline - start) / grid)]  # type: ignore[operator]
        cols_job.extend([jdx] * (b - a))
        cols_seg.extend(range(a, b))
    y_job = np.array(cols_job, dtype=np.int64)
    y_seg = np.array(cols_seg, dtype=np.int64)
    m = len(y_job)
    need_h = np.array([need / 3600.0 for _, need in usable])  # GPU-hours
    widest = np.array([job.curve.capped(topology.max_job_gpus)[-1] for job, _ in usable], dtype=float)

    # Columns: x_0..x_{n-1}, then y (GPU-hours of job in segment). Rows: work_0..work_{n-1}, cap_0..cap_{k-1}.
    starts = np.concatenate([np.arange(n + 1), n + 2 * np.arange(1, m + 1)]).astype(np.int32)
    rows = np.empty(n + 2 * m, dtype=np.int32)
    vals = np.empty(n + 2 * m)
    rows[:n], vals[:n] = np.arange(n), -need_h
    rows[n::2], vals[n::2] = y_job, 1.0
    rows[n + 1::2], vals[n + 1::2] = n + y_seg, 1.0

    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n + m, n + k
    lp.sense_ = highspy.ObjSense.kMaximize
    lp.col_cost_ = np.concatenate([np.ones(n), np.zeros(m)])
    lp.col_lower_ = np.zeros(n + m)
    lp.col_upper_ = np.concatenate([np.ones(n), widest[y_job] * seg_len[y_seg]])
    lp.row_lower_ = np.concatenate([np.zeros(n), np.full(k, -highspy.kHighsInf)])
    lp.row_upper_ = np.concatenate([np.full(n, highspy.kHighsInf), capacity * seg_len])
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = starts
    lp.a_matrix_.index_ = rows
    lp.a_matrix_.value_ = vals
    if integral:
        lp.integrality_ = [highspy.HighsVarType.kInteger] * n + [highspy.HighsVarType.kContinuous] * m
    solver = quiet_highs(time_limit_s)
    solver.passModel(lp)
    solver.run()
    status = solver.getModelStatus()
    stopped = integral and status == highspy.HighsModelStatus.kTimeLimit
    if status != highspy.HighsModelStatus.kOptimal and not stopped:
        raise RuntimeError(f"the bound LP did not solve: {solver.modelStatusToString(status)}")
    info = solver.getInfo()
    # A MILP stopped early: its dual bound, not its incumbent, bounds every schedule.
    met = float(info.mip_dual_bound if stopped else info.objective_function_value)
    values = solver.getSolution().col_value if integral else []
    chosen = [job.job_id for (job, _), x in zip(usable, values[:n]) if x > 0.5]
    return BoundResult(
        deadline_jobs=len(deadline_jobs), infeasible_alone=infeasible,
        bound=min(1.0, met / len(deadline_jobs)) if deadline_jobs else 1.0,
        grid_s=grid, variables=n + m, solve_s=time.perf_counter() - started, integral=integral, exact=not stopped,
        chosen=chosen,
    )
