"""Greedy allocation of spare GPUs, by least extra GPU-time per added GPU.

Each admitted job first gets what its plan reserves for now. Spare GPUs then
go, one doubling at a time, to the job for which the doubling costs the least
extra GPU-time (throughput is concave, so every doubling costs more than the
one before: diminishing returns). A job that already runs at a width keeps it
first when it can, because every change costs a restart.

Extra GPUs must never endanger a deadline. A grant is safe when the job's plan
still covers its remaining iterations after paying for the restart the grant
causes now and for one more restart when the grant is taken back later; the
simulator's tests check that every admitted job meets its deadline.
"""

from __future__ import annotations

import heapq
from typing import Callable, Mapping

from scheduler_service.policy.jobs import Job, JobStatus


def step_cost(job: Job, levels: tuple[int, ...], remaining: float, have: int, want: int) -> float:
    """Extra GPU-seconds per added GPU of running the rest at `want` instead of `have`."""
    speed = job.curve.points
    base = have / speed[have] if have else levels[0] / speed[levels[0]]
    return remaining * (want / speed[want] - base) / (want - have)


def next_level(levels: tuple[int, ...], have: int) -> int | None:
    for level in levels:
        if level > have:
            return level
    return None


def grow(
    order: list[str],
    jobs: Mapping[str, Job],
    levels: Mapping[str, tuple[int, ...]],
    status: Mapping[str, JobStatus],
    alloc: dict[str, int],
    spare: int,
    safe: Callable[[str, int], bool],
) -> int:
    """Keep current widths where possible, then hand out the rest greedily.

    `order` breaks ties (and sets who keeps first). Mutates `alloc`; returns
    the GPUs still spare.
    """
    for job_id in order:
        have, current = alloc.get(job_id, 0), status[job_id].gpus
        if current > have and current - have <= spare and safe(job_id, current):
            alloc[job_id] = current
            spare -= current - have
    heap: list[tuple[float, int, str, int]] = []
    for rank, job_id in enumerate(order):
        want = next_level(levels[job_id], alloc.get(job_id, 0))
        if want is not None:
            have = alloc.get(job_id, 0)
            cost = step_cost(jobs[job_id], levels[job_id], status[job_id].remaining, have, want)
            heap.append((cost, rank, job_id, want))
    heapq.heapify(heap)
    while heap and spare > 0:
        _, rank, job_id, want = heapq.heappop(heap)
        have = alloc.get(job_id, 0)
        if want - have > spare or not safe(job_id, want):
            continue
        alloc[job_id] = want
        spare -= want - have
        nxt = next_level(levels[job_id], want)
        if nxt is not None:
            cost = step_cost(jobs[job_id], levels[job_id], status[job_id].remaining, want, nxt)
            heapq.heappush(heap, (cost, rank, job_id, nxt))
    return spare
