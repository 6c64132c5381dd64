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
from scheduler_service.policy.topology import AnyTopology, MixedTopology

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


def deadline_ratio_bound(jobs: Sequence[Job], topology: AnyTopology, grid_s: float | None = None, *,
                         integral: bool = False, time_limit_s: float | None = None) -> BoundResult:
    """The bound on `topology`; on a mixed cluster each job meets its
    deadline on one kind at a time (x_j = the sum of its extents x_jk on
    each kind it has a curve for, each with that kind's least GPU-time),
    and every kind's GPUs bound what runs there."""
    import time

    import highspy

    from scheduler_service.solver import quiet_highs

    started = time.perf_counter()
    pools = [(p.kind, p.topology) for p in topology.pools] if isinstance(topology, MixedTopology) \
        else [("", topology)]
    deadline_jobs = [j for j in jobs if j.deadline is not None]
    pairs: list[tuple[int, int, Job, float]] = []  # (job index, pool index, the job on that kind, need)
    for jdx, job in enumerate(deadline_jobs):
        for pdx, (kind, pool) in enumerate(pools):
            if kind and not job.runs_on(kind):
                continue
            on = job.on(kind) if kind else job
            need = least_gpu_time(on, pool.max_job_gpus)
            if need is not None:
                pairs.append((jdx, pdx, on, need))
    met_somewhere = sorted({jdx for jdx, _, _, _ in pairs})
    infeasible = len(deadline_jobs) - len(met_somewhere)
    if not pairs:
        return BoundResult(deadline_jobs=len(deadline_jobs), infeasible_alone=infeasible, bound=0.0,
                           grid_s=0.0, variables=0, solve_s=time.perf_counter() - started)
    start = min(job.submit_time for _, _, job, _ in pairs)
    total_window = sum(job.deadline - job.submit_time for _, _, job, _ in pairs)  # type: ignore[operator]
    grid = grid_s or max(1.0, total_window / max(MAX_VARIABLES - 3 * len(pairs), len(pairs)))
    # Widen windows outward to the grid: a looser relaxation, still a bound.
    edges = sorted({math.floor((job.submit_time - start) / grid) for _, _, job, _ in pairs}
                   | {math.ceil((job.deadline - start) / grid) for _, _, job, _ in pairs})  # type: ignore[operator]
    index = {e: i for i, e in enumerate(edges)}
    seg_len = np.diff(np.array(edges, dtype=float)) * grid / 3600.0  # hours
    n, k, chosen_rows = len(pairs), len(edges) - 1, len(met_somewhere)
    row_of_job = {jdx: i for i, jdx in enumerate(met_somewhere)}

    cols_job, cols_seg = [], []
    for p, (_, pdx, job, _) in enumerate(pairs):
        a = index[math.floor((job.submit_time - start) / grid)]
        b = index[math.ceil((job.deadline - start) / grid)]  # type: ignore[operator]
        cols_job.extend([p] * (b - a))
        cols_seg.extend(pdx * k + seg for seg in range(a, b))
    y_job = np.array(cols_job, dtype=np.int64)
    y_seg = np.array(cols_seg, dtype=np.int64)  # (pool, segment): one capacity row each
    m = len(y_job)
    need_h = np.array([need / 3600.0 for _, _, _, need in pairs])  # GPU-hours
    widest = np.array([job.curve.capped(pools[pdx][1].max_job_gpus)[-1] for _, pdx, job, _ in pairs], dtype=float)
    capacity = np.concatenate([np.full(k, pool.num_gpus, dtype=float) * seg_len for _, pool in pools])

    # Columns: x_0..x_{n-1} (one per job and kind), then y (GPU-hours of a pair in a segment).
    # Rows: work_0..work_{n-1}, cap per (kind, segment), then one per job: its kinds' x sum to at most 1.
    cap0, one0 = n, n + len(pools) * k
    starts = np.concatenate([2 * np.arange(n + 1), 2 * n + 2 * np.arange(1, m + 1)]).astype(np.int32)
    rows = np.empty(2 * n + 2 * m, dtype=np.int32)
    vals = np.empty(2 * n + 2 * m)
    rows[0:2 * n:2], vals[0:2 * n:2] = np.arange(n), -need_h
    rows[1:2 * n:2] = [one0 + row_of_job[jdx] for jdx, _, _, _ in pairs]
    vals[1:2 * n:2] = 1.0
    rows[2 * n::2], vals[2 * n::2] = y_job, 1.0
    rows[2 * n + 1::2], vals[2 * n + 1::2] = cap0 + y_seg, 1.0
    num_rows = one0 + chosen_rows
    seg_of = y_seg % k

    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n + m, num_rows
    lp.sense_ = highspy.ObjSense.kMaximize
    lp.col_cost_ = np.concatenate([np.ones(n), np.zeros(m)])
    lp.col_lower_ = np.zeros(n + m)
    lp.col_upper_ = np.concatenate([np.ones(n), widest[y_job] * seg_len[seg_of]])
    lp.row_lower_ = np.concatenate([np.zeros(n), np.full(num_rows - n, -highspy.kHighsInf)])
    lp.row_upper_ = np.concatenate([np.full(n, highspy.kHighsInf), capacity, np.ones(chosen_rows)])
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
    chosen = [job.job_id for (_, _, job, _), x in zip(pairs, values[:n]) if x > 0.5]
    return BoundResult(
        deadline_jobs=len(deadline_jobs), infeasible_alone=infeasible,
        bound=min(1.0, met / len(deadline_jobs)) if deadline_jobs else 1.0,
        grid_s=grid, variables=n + m, solve_s=time.perf_counter() - started, integral=integral, exact=not stopped,
        chosen=chosen,
    )
