"""Pollux (Qiao et al., OSDI'21): goodput-driven co-adaptation of GPUs and batch size.

Goodput = system throughput x statistical efficiency. Larger batches process
more samples per second on more GPUs, but each sample teaches less once the
batch outgrows the gradient noise scale B_noise (McCandlish et al.): relative
to a batch M0, a batch M has efficiency (B_noise + M0) / (B_noise + M).
B_noise grows as training progresses, so large batches pay off late.

Every interval the scheduler re-solves: each job takes, for every GPU count,
the batch size that maximizes its goodput there; the cluster is then split to
maximize the generalized mean (p = -1) of the jobs' speedups over one GPU,
greedily by doublings, after one GPU each in arrival order. A running job
whose GPU count would change has its speedup cut by Pollux's restart penalty
(10%, the constant of Pollux's scheduler). Pollux ignores deadlines: every
job is admitted.

Progress, with goodput data: the trace counts iterations at the job's own
batch M0. A job at batch M advances, per second, by steps/s(M) x (M / M0) x
efficiency(M) / efficiency(M0) iterations of M0: it is done when it has done
the statistical work of its original run. `speed(job, gpus)` gives that rate,
on the throughput curve's scale (M = M0 gives exactly `curve.points[gpus]`:
the T4 curves were measured from the same step times). A simulator that asks
the policy for `speed` advances Pollux jobs at that rate; one that reads only
the curve credits them with their own batch's throughput, so larger batches
then change Pollux's decisions but not its jobs' progress.

Without goodput data for a model (the A100 traces), goodput is throughput:
efficiency 1 at the fixed trace batch, and `note` says so.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from dataclasses import dataclass
from typing import Mapping

from scheduler_service.policy.interface import (
    Decision,
    SchedulingPolicy,
    SchedulingReply,
    SchedulingRequest,
)
from scheduler_service.policy.jobs import Job, JobStatus
from scheduler_service.policy.topology import Topology

# Generalized-mean exponent of Pollux's fairness objective (the paper's default).
FAIRNESS_P = -1.0
# Training progress is bucketed to this resolution for batch-size choices (the
# measured noise trajectories have at most ~100 points), which lets choices be cached.
FRACTION_STEP = 0.01
# Candidate batch sizes: M0 x 2^(k / BATCH_STEPS_PER_DOUBLING), up to the model's maximum.
BATCH_STEPS_PER_DOUBLING = 4


def _interp(xs: tuple[float, ...], ys: tuple[float, ...], x: float) -> float:
    """Piecewise-linear interpolation, clamped at both ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True, slots=True)
class StepTimes:
    """Measured seconds per step (and the gradient-sync part) by local batch size."""

    local_bsz: tuple[float, ...]
    step_time: tuple[float, ...]
    sync_time: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.local_bsz or len({len(self.local_bsz), len(self.step_time), len(self.sync_time)}) != 1:
            raise ValueError("step times need equally many local batch sizes, step and sync times")
        if list(self.local_bsz) != sorted(set(self.local_bsz)):
            raise ValueError("local batch sizes must be strictly increasing")

    def at(self, local_bsz: float) -> tuple[float, float]:
        return (_interp(self.local_bsz, self.step_time, local_bsz),
                _interp(self.local_bsz, self.sync_time, local_bsz))


@dataclass(frozen=True, slots=True)
class NoiseTrajectory:
    """Gradient noise scale B_noise (samples) over the fraction of training done."""

    fraction: tuple[float, ...]
    noise_scale: tuple[float, ...]

    def at(self, fraction: float) -> float:
        return _interp(self.fraction, self.noise_scale, fraction)


@dataclass(frozen=True, slots=True)
class ModelGoodput:
    """Pollux's measurements for one model.

    `step_times` is keyed by (nodes, replicas): the compact placements a buddy
    allocation produces. `noise` is keyed by the batch size of the validation
    run it was measured in.
    """

    model: str
    max_batch: int
    max_local_bsz: float
    step_times: Mapping[tuple[int, int], StepTimes]
    noise: Mapping[int, NoiseTrajectory]

    def times_for(self, gpus: int, gpus_per_node: int) -> StepTimes:
        """Step times of a compact placement of `gpus` GPUs (nearest measured one)."""
        nodes = max(1, math.ceil(gpus / gpus_per_node))
        key = (nodes, gpus)
        if key in self.step_times:
            return self.step_times[key]
        nearest = min(self.step_times, key=lambda k: (abs(math.log2(k[1] / gpus)), abs(k[0] - nodes), k))
        return self.step_times[nearest]

    def step_seconds(self, times: StepTimes, gpus: int, batch: float) -> float:
        """Seconds per global step of `batch` samples on `gpus` GPUs, accumulating
        gradients when a GPU cannot hold its share in one pass."""
        accum = max(0, math.ceil(batch / (gpus * self.max_local_bsz) - 1e-9) - 1)
        step, sync = times.at(batch / (gpus * (accum + 1)))
        return step + accum * max(step - sync, 0.0)

    def noise_scale(self, batch: int, fraction: float) -> float:
        """B_noise at this point of training, from the validation run nearest `batch`."""
        run = min(self.noise, key=lambda b: (abs(math.log2(b / batch)), b))
        return self.noise[run].at(fraction)


@dataclass(frozen=True, slots=True)
class GoodputModel:
    """Goodput data by model name, as parsed from the Pollux artifact."""

    models: Mapping[str, ModelGoodput]

    def get(self, model: str) -> ModelGoodput | None:
        return self.models.get(model)


def relative_goodput(
    data: ModelGoodput, gpus: int, gpus_per_node: int, base_batch: int, batch: float, fraction: float
) -> float:
    """Goodput at `batch` over goodput at the job's own batch, on the same GPUs,
    in iterations of `base_batch` per second."""
    times = data.times_for(gpus, gpus_per_node)
    noise = data.noise_scale(base_batch, fraction)
    speed_ratio = data.step_seconds(times, gpus, base_batch) / data.step_seconds(times, gpus, batch)
    efficiency_ratio = (noise + base_batch) / (noise + batch)
    return speed_ratio * (batch / base_batch) * efficiency_ratio


def best_batch(
    data: ModelGoodput, gpus: int, gpus_per_node: int, base_batch: int, fraction: float
) -> tuple[int, float]:
    """The batch size (>= the job's own, <= the model's largest) with the most
    goodput on `gpus` GPUs, and its goodput relative to the job's own batch."""
    best, gain = base_batch, 1.0
    k = 1
    top = max(data.max_batch, base_batch)
    while True:
        batch = min(top, round(base_batch * 2 ** (k / BATCH_STEPS_PER_DOUBLING)))
        if batch <= best and batch == top:
            break
        g = relative_goodput(data, gpus, gpus_per_node, base_batch, batch, fraction)
        if g > gain * (1 + 1e-9):
            best, gain = batch, g
        if batch == top:
            break
        k += 1
    return best, gain


class PolluxPolicy(SchedulingPolicy):
    name = "pollux"

    def __init__(
        self,
        topology: Topology,
        interval: float = 60.0,
        goodput: GoodputModel | None = None,
        restart_penalty: float = 0.1,
        **kwargs,
    ) -> None:
        super().__init__(topology, interval, **kwargs)
        self.goodput = goodput or GoodputModel({})
        if not 0 <= restart_penalty < 1:
            raise ValueError("the restart penalty is a fraction of speedup in [0, 1)")
        self.restart_penalty = restart_penalty
        self.jobs: dict[str, Job] = {}
        self.fraction: dict[str, float] = {}  # of training done, at the last call
        self.batch: dict[str, int] = {}  # batch size chosen for the current allocation
        self.gain: dict[str, float] = {}  # its goodput over the job's own batch
        self.fallback_models: set[str] = set()
        self._choices: dict[tuple[str, int, int, int], tuple[int, float]] = {}
        self.adaptive_models: set[str] = set()

    @property
    def note(self) -> str:
        """What the goodput model was based on, for reports."""
        parts = []
        if self.adaptive_models:
            parts.append(f"goodput with batch-size adaptation for {', '.join(sorted(self.adaptive_models))}")
        if self.fallback_models:
            parts.append("throughput-only goodput (efficiency 1, fixed batch) for "
                         f"{', '.join(sorted(self.fallback_models))}: no Pollux goodput data")
        return "; ".join(parts)

    # -- goodput --------------------------------------------------------------
    def _data(self, job: Job) -> ModelGoodput | None:
        return self.goodput.get(job.model) if job.batch_size else None

    def _choice(self, job: Job, gpus: int) -> tuple[int, float]:
        data = self._data(job)
        if data is None or not gpus:
            return job.batch_size, 1.0
        bucket = int(self.fraction.get(job.job_id, 0.0) / FRACTION_STEP)
        key = (job.model, job.batch_size, gpus, bucket)
        if key not in self._choices:
            self._choices[key] = best_batch(data, gpus, self.topology.gpus_per_node, job.batch_size,
                                            bucket * FRACTION_STEP)
        return self._choices[key]

    def speed(self, job: Job, gpus: int) -> float:
        """Iterations of the job's own batch per second on `gpus` GPUs at the
        batch size Pollux picks there: the rate at which its work gets done."""
        return job.curve.speed(gpus) * self._choice(job, gpus)[1]

    # -- the one entry point --------------------------------------------------
    def schedule(self, request: SchedulingRequest) -> SchedulingReply:
        for job_id in request.finished:
            for table in (self.jobs, self.fraction, self.batch, self.gain):
                table.pop(job_id, None)
        decisions = [self._arrive(job) for job in sorted(request.arrivals, key=lambda j: (j.submit_time, j.job_id))]
        status = {j: request.status.get(j) or JobStatus(job.iterations) for j, job in self.jobs.items()}
        for job_id, st in status.items():
            job = self.jobs[job_id]
            self.fraction[job_id] = min(1.0, max(0.0, 1.0 - st.remaining / job.iterations))
        alloc = self._allocate(status)
        for job_id, gpus in alloc.items():
            self.batch[job_id], self.gain[job_id] = self._choice(self.jobs[job_id], gpus)
        adaptive = any(self._data(self.jobs[j]) is not None for j in alloc)
        return self.reply(request, decisions, alloc, self.jobs,
                          wake_at=request.now + self.clock.interval if adaptive else None)

    def _arrive(self, job: Job) -> Decision:
        self.jobs[job.job_id] = job
        self.fraction[job.job_id] = 0.0
        if self._data(job) is None:
            self.fallback_models.add(job.model or "?")
            message = "no Pollux goodput data for this model: throughput-only goodput at the trace's batch size"
        else:
            self.adaptive_models.add(job.model)
            message = "goodput-driven GPUs and batch size"
        return Decision(job_id=job.job_id, admitted=True, message=message)

    # -- allocation -----------------------------------------------------------
    def _allocate(self, status: Mapping[str, JobStatus]) -> dict[str, int]:
        """Maximize the p-mean of speedups: one GPU level each in arrival order,
        then doublings by largest gain in sum(speedup^p) per added GPU."""
        free = self.topology.num_gpus
        order = sorted(self.jobs.values(), key=lambda j: (j.submit_time, j.job_id))
        levels = {j.job_id: j.curve.capped(self.topology.max_job_gpus) for j in order}
        alloc: dict[str, int] = {j.job_id: 0 for j in order}
        base: dict[str, float] = {}
        for job in order:
            lv = levels[job.job_id]
            if lv and lv[0] <= free:
                alloc[job.job_id] = lv[0]
                free -= lv[0]
                base[job.job_id] = self.speed(job, lv[0])

        def utility(job: Job, gpus: int) -> float:
            """speedup^p, a changed allocation's speedup cut by the restart penalty."""
            speedup = self.speed(job, gpus) / base[job.job_id]
            current = status[job.job_id].gpus
            if gpus != current and current:
                speedup *= 1.0 - self.restart_penalty
            return speedup ** FAIRNESS_P

        def candidate(job: Job) -> tuple[float, str, int] | None:
            have = alloc[job.job_id]
            bigger = [g for g in levels[job.job_id] if g > have]
            if not bigger:
                return None
            want = bigger[0]
            # p < 0 minimizes sum(speedup^p), p > 0 maximizes it: both raise the p-mean.
            sign = 1.0 if FAIRNESS_P < 0 else -1.0
            gain = sign * (utility(job, have) - utility(job, want)) / (want - have)
            return (-gain, job.job_id, want) if gain > 0 else None

        heap = [c for c in (candidate(j) for j in order if alloc[j.job_id]) if c is not None]
        heapq.heapify(heap)
        while heap and free:
            _, job_id, want = heapq.heappop(heap)
            extra = want - alloc[job_id]
            if extra > free:
                continue  # a smaller doubling elsewhere may still fit
            alloc[job_id] = want
            free -= extra
            nxt = candidate(self.jobs[job_id])
            if nxt is not None:
                heapq.heappush(heap, nxt)
        return alloc

