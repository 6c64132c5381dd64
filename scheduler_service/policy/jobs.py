"""Jobs and their throughput curves: the only facts the policy knows about a job.

Kept as frozen slotted dataclasses rather than pydantic models because the
simulator creates and reads them millions of times; the boundaries (trace
files, the service) validate with pydantic before building them.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field, replace
from typing import Mapping


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def floor_pow2(n: int) -> int:
    """The largest power of two not above `n` (1 for anything below 2): buddy
    placement deals only in such blocks."""
    return 1 << (max(1, n).bit_length() - 1)


@dataclass(frozen=True, slots=True)
class ThroughputCurve:
    """Iterations per second of one model at one global batch size, by GPU count.

    Only power-of-two counts are measured (compact buddy placements). Levels
    past which throughput stops growing are useless to a scheduler (more GPUs,
    no more speed), so `levels` keeps only the counts where speed strictly
    grows: that makes every planning step monotone, which the admission
    guarantee relies on.
    """

    points: Mapping[int, float]
    levels: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        kept: list[int] = []
        best = 0.0
        for gpus in sorted(self.points):
            speed = self.points[gpus]
            if is_power_of_two(gpus) and speed > best:
                kept.append(gpus)
                best = speed
        if not kept:
            raise ValueError("a throughput curve needs at least one positive power-of-two point")
        object.__setattr__(self, "levels", tuple(kept))

    def speed(self, gpus: int) -> float:
        """Iterations/s on `gpus` GPUs (0 for 0 GPUs)."""
        return self.points[gpus] if gpus else 0.0

    def capped(self, max_gpus: int) -> tuple[int, ...]:
        """The useful levels that fit in `max_gpus` GPUs (asked at every step for every run: a bisection)."""
        return self.levels[:bisect_right(self.levels, max_gpus)]


@dataclass(frozen=True, slots=True)
class Job:
    """A training job as the scheduler sees it.

    `deadline` is absolute seconds on the same clock as `submit_time`; None
    makes the job best-effort (always admitted, never reserved).
    `requested_gpus` is what a server-centric user would have asked for: the
    baselines use it, ElasticFlow ignores it. On a cluster of several GPU
    kinds, `curves` holds the job's curve on each kind it can run on and
    `curve` is the one on `kind`, where it is planned now (`on`).
    """

    job_id: str
    submit_time: float
    iterations: float
    deadline: float | None
    curve: ThroughputCurve
    requested_gpus: int = 1
    model: str = ""
    batch_size: int = 0
    kind: str = ""
    curves: tuple[tuple[str, ThroughputCurve], ...] = ()
    team: str = ""  # whose share it is admitted on, on a cluster shared by teams

    @property
    def best_effort(self) -> bool:
        return self.deadline is None

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(kind for kind, _ in self.curves)

    def runs_on(self, kind: str) -> bool:
        return kind == self.kind or kind in self.kinds or not (self.kind or self.curves)

    def on(self, kind: str) -> "Job":
        """The job as planned on `kind`, with that kind's curve. A job whose
        curve names no kind (measured where kinds were not told apart) has
        that one curve on every kind."""
        if kind == self.kind:
            return self
        if not self.curves and not self.kind:
            return replace(self, kind=kind)
        for name, curve in self.curves:
            if name == kind:
                return replace(self, kind=kind, curve=curve)
        raise KeyError(f"job {self.job_id} has no throughput curve on {kind}")


@dataclass(frozen=True, slots=True)
class JobStatus:
    """Where a job stands now: what is left and what it runs on.

    `overhead_left` is the part of a restart still being paid (seconds in
    which the job holds GPUs but makes no progress). `kind` is the GPU kind
    of what it holds, on a cluster of several: a job whose GPUs are of
    another kind than it is planned on starts afresh there.
    """

    remaining: float
    gpus: int = 0
    overhead_left: float = 0.0
    kind: str = ""
