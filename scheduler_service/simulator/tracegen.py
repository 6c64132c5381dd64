"""Job traces drawn with the paper's statistics, so an operator can ask what a
cluster of a given size would do at a given load before buying it.

The statistics are those the paper describes for its synthetic traces (and
data/reference/README.md restates): Poisson arrivals; a model and batch size
drawn uniformly from the (model, batch size) rows of a throughput folder, as
in the reference traces; a requested GPU count from the Philly/ITP mix,
halved until the model has a throughput there; a two-mode duration at that
count; iterations = duration x the throughput at the requested count;
deadline = submit + factor x duration. Every one is an option, and a seed
makes the trace reproducible. The CSV has the columns of the paper's traces
(and data/reference/traces), so every tool that reads those reads it.
"""

from __future__ import annotations

import csv
import io
import math
import random
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from scheduler_service.policy.jobs import ThroughputCurve, is_power_of_two

TRACE_COLUMNS = ["job_id", "submit_time", "iteration", "model_name", "ddl", "batch_size", "num_gpu", "duration",
                 "best_effort"]
PAPER_GPU_MIX = ((1, 0.83), (2, 0.03), (4, 0.03), (8, 0.10), (16, 0.01))
# (weight, lo, hi): a duration of 60 x 10^U(lo, hi) seconds with that weight.
PAPER_DURATION_MIX = ((0.8, 1.0, 2.5), (0.2, 2.5, 4.0))


class OptionError(ValueError):
    """A bad generator option: the message is one line naming the option."""

    def __init__(self, option: str, problem: str) -> None:
        super().__init__(f"{option}: {problem}")
        self.option = option


@dataclass(frozen=True)
class TraceSpec:
    jobs: int = 500
    mean_gap_s: float = 500.0
    gpu_mix: tuple[tuple[int, float], ...] = PAPER_GPU_MIX
    duration_mix: tuple[tuple[float, float, float], ...] = PAPER_DURATION_MIX
    deadline_factor: tuple[float, float] = (0.5, 1.5)
    best_effort: float = 0.0  # share of jobs without a deadline
    models: tuple[str, ...] = field(default=())  # empty: every model of the throughput folder
    seed: int = 0
    # Each arrival is a sweep of 1..sweep jobs submitted together (a
    # hyperparameter search): one model, batch size and requested count,
    # each job its own duration and deadline. 1: single jobs, as the paper.
    sweep: int = 1

    @property
    def mean_sweep(self) -> float:
        return (self.sweep + 1) / 2


def _floats(option: str, text: str, parts: int, sep: str = ",") -> list[float]:
    pieces = [p.strip() for p in str(text).split(sep)]
    try:
        values = [float(p) for p in pieces]
    except ValueError:
        raise OptionError(option, f"expected {parts} numbers separated by {sep!r}, got {text!r}") from None
    if len(values) != parts or not all(math.isfinite(v) for v in values):
        raise OptionError(option, f"expected {parts} finite numbers separated by {sep!r}, got {text!r}")
    return values


def parse_spec(jobs: str = "500", mean_gap: str = "500", gpu_mix: str = "1:0.83,2:0.03,4:0.03,8:0.10,16:0.01",
               duration_mix: str = "0.8:1:2.5,0.2:2.5:4", deadline_factor: str = "0.5,1.5",
               best_effort: str = "0", models: str = "", seed: str = "0", sweep: str = "1") -> TraceSpec:
    """A spec from command-line text; every problem names its option."""
    try:
        n = int(jobs)
    except ValueError:
        raise OptionError("--jobs", f"not an integer: {jobs!r}") from None
    if n < 1:
        raise OptionError("--jobs", "at least one job")
    (gap,) = _floats("--mean-gap", mean_gap, 1)
    if gap <= 0:
        raise OptionError("--mean-gap", "the mean gap between arrivals must be positive (seconds)")
    mix = []
    for item in str(gpu_mix).split(","):
        count, weight = _floats("--gpu-mix", item, 2, ":")
        if count != int(count) or not is_power_of_two(int(count)):
            raise OptionError("--gpu-mix", f"GPU counts must be powers of two, got {item!r}")
        if weight < 0:
            raise OptionError("--gpu-mix", f"weights must not be negative, got {item!r}")
        mix.append((int(count), weight))
    if sum(w for _, w in mix) <= 0:
        raise OptionError("--gpu-mix", "the weights add up to zero")
    durations = []
    for item in str(duration_mix).split(","):
        weight, lo, hi = _floats("--duration-mix", item, 3, ":")
        if weight < 0 or lo > hi:
            raise OptionError("--duration-mix", f"each mode is weight:lo:hi with weight >= 0 and lo <= hi, got {item!r}")
        durations.append((weight, lo, hi))
    if sum(w for w, _, _ in durations) <= 0:
        raise OptionError("--duration-mix", "the weights add up to zero")
    low, high = _floats("--deadline-factor", deadline_factor, 2)
    if not 0 < low <= high:
        raise OptionError("--deadline-factor", f"expected lo,hi with 0 < lo <= hi, got {deadline_factor!r}")
    (share,) = _floats("--best-effort", best_effort, 1)
    if not 0 <= share <= 1:
        raise OptionError("--best-effort", f"a share between 0 and 1, got {best_effort!r}")
    try:
        rng_seed = int(seed)
    except ValueError:
        raise OptionError("--seed", f"not an integer: {seed!r}") from None
    try:
        sweep_size = int(sweep)
    except ValueError:
        raise OptionError("--sweep", f"not an integer: {sweep!r}") from None
    if sweep_size < 1:
        raise OptionError("--sweep", "a sweep has at least one job")
    names = tuple(m.strip() for m in str(models).split(",") if m.strip())
    return TraceSpec(n, gap, tuple(mix), tuple(durations), (low, high), share, names, rng_seed, sweep_size)


def _pick(rng: random.Random, weighted: Sequence[tuple[object, float]]) -> object:
    total = sum(w for _, w in weighted)
    x = rng.random() * total
    for value, weight in weighted:
        x -= weight
        if x < 0:
            return value
    return weighted[-1][0]


def _choices(spec: TraceSpec, curves: Mapping[tuple[str, int], ThroughputCurve]) -> dict[str, list[int]]:
    """Batch sizes by model, restricted to the models asked for."""
    by_model: dict[str, list[int]] = {}
    for model, batch in sorted(curves):
        by_model.setdefault(model, []).append(batch)
    if spec.models:
        unknown = [m for m in spec.models if m not in by_model]
        if unknown:
            raise OptionError("--models", f"no throughput curves for {unknown[0]!r} (known: {', '.join(by_model)})")
        by_model = {m: by_model[m] for m in spec.models}
    return by_model


def generate(spec: TraceSpec, curves: Mapping[tuple[str, int], ThroughputCurve]) -> list[dict[str, int | str]]:
    """Rows of a trace; the same spec and curves always give the same rows."""
    pairs = [(model, batch) for model, batches in _choices(spec, curves).items() for batch in batches]
    rng = random.Random(spec.seed)
    rows: list[dict[str, int | str]] = []
    now = 0.0
    left_in_sweep = 0
    for job_id in range(spec.jobs):
        if left_in_sweep == 0:
            if job_id:
                now += rng.expovariate(1.0 / spec.mean_gap_s)
            left_in_sweep = rng.randint(1, spec.sweep) if spec.sweep > 1 else 1
            model, batch = pairs[rng.randrange(len(pairs))]
            curve = curves[(model, batch)]
            gpus = int(_pick(rng, spec.gpu_mix))  # type: ignore[arg-type]
            while gpus > 1 and gpus not in curve.points:
                gpus //= 2
            if gpus not in curve.points:  # a curve without a 1-GPU point: its narrowest measured count
                gpus = min(curve.points)
        left_in_sweep -= 1
        lo, hi = _pick(rng, [((lo, hi), w) for w, lo, hi in spec.duration_mix])  # type: ignore[misc]
        duration = max(1, round(60 * 10 ** rng.uniform(lo, hi)))
        factor = rng.uniform(*spec.deadline_factor)
        best_effort = rng.random() < spec.best_effort
        submit = round(now)
        rows.append({
            "job_id": job_id, "submit_time": submit, "iteration": max(1, math.ceil(duration * curve.points[gpus])),
            "model_name": model, "ddl": submit + max(1, round(factor * duration)), "batch_size": batch,
            "num_gpu": gpus, "duration": duration, "best_effort": int(best_effort),
        })
    return rows


def offered_load(rows: Sequence[Mapping[str, int | str]], gpus: int) -> float:
    """GPU-time the jobs ask for at their requested counts over the cluster's
    GPU-time while they arrive: 1.0 keeps a server-centric cluster just busy."""
    if len(rows) < 2:
        return 0.0
    span = float(rows[-1]["submit_time"]) - float(rows[0]["submit_time"])
    demand = sum(float(r["duration"]) * float(r["num_gpu"]) for r in rows)
    return demand / (gpus * span) if span > 0 else math.inf


def mean_gap_for(load: float, gpus: int, spec: TraceSpec, curves: Mapping[tuple[str, int], ThroughputCurve]) -> float:
    """The mean gap between arrivals that offers `load` to `gpus` GPUs on
    average (estimated from 20,000 jobs drawn with the spec's other options)."""
    sample = generate(TraceSpec(20_000, 1.0, spec.gpu_mix, spec.duration_mix, spec.deadline_factor,
                                spec.best_effort, spec.models, seed=12345), curves)
    per_job = sum(float(r["duration"]) * float(r["num_gpu"]) for r in sample) / len(sample)
    return per_job * spec.mean_sweep / (load * gpus)  # the gap is between arrivals, each a sweep


def trace_csv(rows: Sequence[Mapping[str, int | str]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=TRACE_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()
