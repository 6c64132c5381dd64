"""The best schedule that exists, on instances small enough to search: how
far the LP bound (bound.py) is from what can really be done.

The bound relaxes three things: a job may meet a fraction of its deadline
(x_j in [0, 1]), the cluster is a fluid of GPU-hours, and a job's width is
any mix of counts. This model keeps none of them: time is cut into slots of
`slot_s`, and in each slot inside its window (whole slots only) a job runs
on one of its usable power-of-two counts or not at all; each slot's GPUs
never exceed the cluster's; a job is met when the slots it runs in deliver
its iterations. Any power-of-two sizes that sum to at most the cluster fit
in its buddy tree, so every solution is a schedule a buddy placer can lay
out; only restarts are free (as the authors' simulator counts). Its optimum
is therefore achievable up to restart costs, while the bound is an upper
limit: where the two meet the bound is tight and the gap to a policy is the
policy's; where they do not, the bound is loose by the difference.
"""

from __future__ import annotations

import math
import time
from typing import Sequence

from pydantic import BaseModel

from scheduler_service.policy.jobs import Job
from scheduler_service.policy.topology import Topology


class ExactResult(BaseModel):
    deadline_jobs: int
    slot_s: float
    best: float  # deadline ratio of the best schedule found (achievable, restarts aside)
    proven: float  # no schedule of this model meets more (HiGHS's dual bound)
    optimal: bool  # best == proven
    variables: int
    solve_s: float
    met: list[str]


def best_schedule(jobs: Sequence[Job], topology: Topology, slot_s: float = 600.0,
                  time_limit_s: float = 300.0) -> ExactResult:
    import highspy
    import numpy as np

    from scheduler_service.solver import quiet_highs

    started = time.perf_counter()
    deadline_jobs = [j for j in jobs if j.deadline is not None]
    capacity = topology.num_gpus
    cols: list[tuple[int, int, int]] = []  # (job, slot, gpus) of each z column
    for jdx, job in enumerate(deadline_jobs):
        first, last = math.ceil(job.submit_time / slot_s), math.floor(job.deadline / slot_s)  # type: ignore[operator]
        for slot in range(first, last):
            cols.extend((jdx, slot, g) for g in job.curve.capped(topology.max_job_gpus))
    n, m = len(deadline_jobs), len(cols)
    slots = sorted({slot for _, slot, _ in cols})
    slot_row = {slot: i for i, slot in enumerate(slots)}
    pairs = sorted({(jdx, slot) for jdx, slot, _ in cols})
    pair_row = {pair: i for i, pair in enumerate(pairs)}
    # Rows: work_j (sum speed*slot*z - iterations*x >= 0), one width per (job, slot) (sum_g z <= 1), capacity per slot.
    r_work, r_pair, r_cap = 0, n, n + len(pairs)
    rows, cols_idx, vals = [], [], []
    for jdx, job in enumerate(deadline_jobs):
        rows.append(r_work + jdx), cols_idx.append(jdx), vals.append(-job.iterations)
    for c, (jdx, slot, g) in enumerate(cols):
        speed = deadline_jobs[jdx].curve.speed(g)
        rows += [r_work + jdx, r_pair + pair_row[(jdx, slot)], r_cap + slot_row[slot]]
        cols_idx += [n + c] * 3
        vals += [speed * slot_s, 1.0, float(g)]
    matrix = highspy.HighsSparseMatrix()
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = n + m, n + len(pairs) + len(slots)
    lp.sense_ = highspy.ObjSense.kMaximize
    lp.col_cost_ = np.concatenate([np.ones(n), np.zeros(m)])
    lp.col_lower_, lp.col_upper_ = np.zeros(n + m), np.ones(n + m)
    inf = highspy.kHighsInf
    lp.row_lower_ = np.concatenate([np.zeros(n), np.full(len(pairs) + len(slots), -inf)])
    lp.row_upper_ = np.concatenate([np.full(n, inf), np.ones(len(pairs)), np.full(len(slots), float(capacity))])
    order = np.lexsort((np.array(rows), np.array(cols_idx)))
    col_sorted = np.array(cols_idx)[order]
    matrix.format_ = highspy.MatrixFormat.kColwise
    matrix.start_ = np.searchsorted(col_sorted, np.arange(n + m + 1)).astype(np.int32)
    matrix.index_ = np.array(rows, dtype=np.int32)[order]
    matrix.value_ = np.array(vals)[order]
    matrix.num_col_, matrix.num_row_ = lp.num_col_, lp.num_row_
    lp.a_matrix_ = matrix
    lp.integrality_ = [highspy.HighsVarType.kInteger] * (n + m)
    solver = quiet_highs(time_limit_s)
    solver.passModel(lp)
    solver.run()
    info = solver.getInfo()
    values = solver.getSolution().col_value if info.primal_solution_status else [0.0] * (n + m)
    met = [job.job_id for job, x in zip(deadline_jobs, values[:n]) if x > 0.5]
    total = max(1, len(deadline_jobs))
    optimal = solver.getModelStatus() == highspy.HighsModelStatus.kOptimal
    proven = float(info.objective_function_value if optimal else info.mip_dual_bound)
    return ExactResult(deadline_jobs=len(deadline_jobs), slot_s=slot_s, best=len(met) / total,
                       proven=min(1.0, proven / total), optimal=optimal, variables=n + m,
                       solve_s=time.perf_counter() - started, met=met)
