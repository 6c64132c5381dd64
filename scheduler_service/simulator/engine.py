"""The event loop: arrivals, completions and policy wake-ups, at slot boundaries.

The policy is asked at most once per scheduling interval (ticks fall on slot
boundaries), and only when something happened: a job arrived, a job finished,
or the policy asked to be woken. Between ticks every job runs at a constant
width, so progress and completion times are computed exactly rather than
stepped. A change of GPU set costs the same restart overhead the policy plans
with. Deterministic for a given input.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from scheduler_service.policy.interface import Decision, SchedulingPolicy, SchedulingRequest
from scheduler_service.policy.jobs import Job, JobStatus
from scheduler_service.policy.topology import AnyTopology, MixedTopology, kind_of

# A job whose remaining work is below this fraction of its total is done:
# float rounding must not keep it alive for one more tick.
DONE_FRACTION = 1e-9


@dataclass(slots=True)
class JobRecord:
    """What happened to one job."""

    job: Job
    decision: Decision | None = None
    remaining: float = 0.0
    gpus: int = 0
    block: tuple[int, int] | None = None
    overhead_left: float = 0.0
    start: float | None = None  # first tick with GPUs (its restart overhead follows)
    finish: float | None = None
    gpu_seconds: float = 0.0
    kind_seconds: dict[str, float] = field(default_factory=dict)  # GPU-seconds by GPU kind, on a mixed cluster
    restarts: int = 0
    peak_gpus: int = 0

    @property
    def met_deadline(self) -> bool:
        d = self.job.deadline
        return d is not None and self.finish is not None and self.finish <= d + 1e-6


@dataclass(slots=True)
class Run:
    """A finished simulation: every job's record and the GPUs in use over time."""

    policy: str
    records: list[JobRecord]
    usage: list[tuple[float, int]] = field(default_factory=list)  # (time, GPUs in use) at each tick
    capacity: int = 0
    wall_s: float = 0.0
    ticks: int = 0
    kinds: dict[str, int] = field(default_factory=dict)  # GPUs by kind, on a mixed cluster


def gpus_by_kind(topology: AnyTopology) -> dict[str, int]:
    """GPUs by kind of a mixed cluster ({} for one kind)."""
    pools = topology.pools if isinstance(topology, MixedTopology) else ()
    return {p.kind: p.topology.num_gpus for p in pools}


class Deadlock(RuntimeError):
    """Jobs wait, nothing runs, and nothing will happen: a policy bug."""


def simulate(
    jobs: Sequence[Job],
    policy: SchedulingPolicy,
    on_progress: Callable[[int, int], None] | None = None,
) -> Run:
    started = time.perf_counter()
    interval = policy.clock.interval
    overhead = policy.clock.overhead

    def tick_at_or_after(seconds: float) -> float:
        return math.ceil(seconds / interval - 1e-9) * interval

    pending = sorted(jobs, key=lambda j: (j.submit_time, j.job_id))
    records = {job.job_id: JobRecord(job, remaining=job.iterations) for job in pending}
    active: dict[str, JobRecord] = {}
    finished: list[str] = []
    usage: list[tuple[float, int]] = []
    n, next_arrival, ticks = len(pending), 0, 0
    now = tick_at_or_after(pending[0].submit_time) if pending else 0.0
    last = now

    while next_arrival < n or active:
        ticks += 1
        _advance(active, last, now, finished, policy.speed, lambda gpu: kind_of(policy.topology, gpu))
        for job_id in finished:
            active.pop(job_id, None)
        arrivals = []
        while next_arrival < n and pending[next_arrival].submit_time <= now:
            arrivals.append(pending[next_arrival])
            next_arrival += 1
        status = {j: JobStatus(r.remaining, r.gpus, r.overhead_left,
                               kind_of(policy.topology, r.block[0]) if r.block else "") for j, r in active.items()}
        reply = policy.schedule(SchedulingRequest(now, arrivals, finished, status))
        finished = []
        for decision in reply.decisions:
            record = records[decision.job_id]
            record.decision = decision
            if decision.admitted:
                active[decision.job_id] = record
        in_use = 0
        for job_id, record in active.items():
            gpus = reply.allocation.get(job_id, 0)
            block = reply.placement.blocks.get(job_id) if gpus else None
            if gpus != record.gpus or block != record.block:
                record.gpus, record.block = gpus, block
                record.overhead_left = overhead(gpus)
                if gpus:
                    if record.start is None:
                        record.start = now
                    record.restarts += 1
                    record.peak_gpus = max(record.peak_gpus, gpus)
            in_use += gpus
        usage.append((now, in_use))
        if on_progress is not None:
            on_progress(next_arrival, n)

        candidates = []
        if next_arrival < n:
            candidates.append(tick_at_or_after(pending[next_arrival].submit_time))
        for record in active.values():
            if record.gpus:
                done_at = now + record.overhead_left + record.remaining / policy.speed(record.job, record.gpus)
                candidates.append(tick_at_or_after(done_at))
        if reply.wake_at is not None and reply.wake_at > now:
            candidates.append(reply.wake_at)
        if not candidates:
            if active:
                raise Deadlock(f"{policy.name}: {len(active)} jobs wait at t={now:.0f}s with nothing running")
            break
        last, now = now, max(min(candidates), now + interval)

    return Run(policy.name, list(records.values()), usage, policy.topology.num_gpus,
               time.perf_counter() - started, ticks, gpus_by_kind(policy.topology))


def _advance(
    active: dict[str, JobRecord], start: float, end: float, finished: list[str], rate: Callable[[Job, int], float],
    kind: Callable[[int], str],
) -> None:
    """Run every active job at its width over [start, end)."""
    span = end - start
    if span <= 0:
        return
    for job_id, record in active.items():
        gpus = record.gpus
        if not gpus:
            continue
        held_before, on = record.gpu_seconds, kind(record.block[0]) if record.block else ""
        if record.overhead_left >= span:
            record.overhead_left -= span
            record.gpu_seconds += gpus * span
            _count_kind(record, on, held_before)
            continue
        speed = rate(record.job, gpus)
        productive = span - record.overhead_left
        if speed * productive >= record.remaining * (1 - DONE_FRACTION):
            used = record.overhead_left + record.remaining / speed
            record.finish = start + used
            record.gpu_seconds += gpus * used
            record.remaining = 0.0
            record.gpus, record.block = 0, None
            finished.append(job_id)
        else:
            record.remaining -= speed * productive
            record.gpu_seconds += gpus * span
        record.overhead_left = 0.0
        _count_kind(record, on, held_before)


def _count_kind(record: JobRecord, kind: str, held_before: float) -> None:
    if kind:
        record.kind_seconds[kind] = record.kind_seconds.get(kind, 0.0) + record.gpu_seconds - held_before
