"""What runs' measured speeds teach the loop, from one observation of each
running run a slot (`Speeds.observe`), two lessons:

- a model's lasting gap from its profile (`ModelGaps`): a profile is one
  measurement on an idle moment; a run then trains beside others (a shared
  file system, a busy CPU, a slow node). Each run's own plan already follows
  the speed it shows (`LoopRun.observe`); this carries a lasting gap
  over to the model, so its next run is admitted on the speed its runs
  really train at. Only a gap seen in LASTING observations in a row (a slot
  apart) counts, and the profile stays the best case: a model is never
  planned faster than it was measured.
- the margin admission keeps (`SpeedErrors`): the last ratio of measured
  over planned speed of each of the latest runs of a model on a GPU kind is
  kept, and a new run is admitted with room in front of its deadline for a
  run as slow as the low quantile of those ratios (it is re-planned at its
  measured speed, so such a run still fits). With nothing seen yet, the
  default margin stands; with every run on its profile, only the floor (a
  slot). The errors are taken against the corrected curve, so nothing the
  gap explains is counted twice.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import replace

from pydantic import BaseModel, ConfigDict, Field

from scheduler_service.contracts import RunPhase
from scheduler_service.loop.run import LoopRun
from scheduler_service.policy import Job, ThroughputCurve

LASTING = 3  # observations in a row (one a slot) a gap must last
GAP = 0.03  # smaller gaps from what the model is planned with are noise
FLOOR = 0.2  # a run this slow is stalled or resizing, not slower
RUNS_KEPT = 200  # per model and kind: the latest runs' ratios

Key = tuple[str, int]  # model, global batch size


class ModelGaps:
    def __init__(self) -> None:
        self.ratios: dict[Key, float] = {}  # measured speed over the profile's, where a lasting gap was seen
        self._streaks: dict[str, list[float]] = {}  # by run: its ratios off the model's, in a row

    @staticmethod
    def _key(job: Job) -> Key | None:
        """Runs of one GPU kind only: on a cluster of kinds each kind has its own curve."""
        return None if job.curves or not job.model else (job.model, job.batch_size)

    def applied(self, job: Job) -> Job:
        """The job with its curve at the speed its model's runs were seen to train at."""
        key = self._key(job)
        ratio = self.ratios.get(key, 1.0) if key is not None else 1.0
        if ratio == 1.0:
            return job
        return replace(job, curve=ThroughputCurve({g: v * ratio for g, v in job.curve.points.items()}))

    def _compare(self, profile: Job, gpus: int, rate: float | None) -> tuple[Key, float, bool] | None:
        """Its model's key, the ratio of `rate` to the profile, and whether
        that is off what the model is planned with by GAP or more; None when
        there is nothing to compare."""
        key = self._key(profile)
        speed = profile.curve.points.get(gpus, 0.0)
        if key is None or not rate or rate <= 0 or speed <= 0:
            return None
        ratio = min(1.0, max(FLOOR, rate / speed))
        planned = self.ratios.get(key, 1.0)
        return key, ratio, abs(ratio - planned) >= GAP * planned

    def observe(self, run_id: str, profile: Job, gpus: int, rate: float | None) -> bool:
        """A running run's rate on `gpus` GPUs against `profile` (its job as
        measured, before any correction), once a slot; True if that moved
        what its model is planned with."""
        compared = self._compare(profile, gpus, rate)
        if compared is None:
            return False
        key, ratio, off = compared
        if not off:
            self._streaks.pop(run_id, None)
            return False
        streak = self._streaks.setdefault(run_id, [])
        streak.append(ratio)
        if len(streak) < LASTING:
            return False
        self.ratios[key] = sum(streak) / len(streak)
        del self._streaks[run_id]
        return True

    def forget(self, run_id: str) -> None:
        self._streaks.pop(run_id, None)

    def learnt(self, run_id: str, profile: Job, gpus: int, rate: float | None) -> bool:
        """Whether another `observe` of this rate would change nothing: no
        gap from what its model is planned with, and no streak to end."""
        compared = self._compare(profile, gpus, rate)
        return compared is None or not compared[2] and run_id not in self._streaks


class MarginRule(BaseModel):
    """How admission turns the speed errors seen into a margin."""

    model_config = ConfigDict(frozen=True)

    quantile: float = Field(0.2, gt=0, lt=1, description="a run as slow as this quantile of those seen still fits")
    at_most: float = Field(0.3, ge=0, lt=0.5, description="of a run's window, whatever was seen")
    min_runs: int = Field(5, ge=1, description="runs of a model on a kind before its own errors count; "
                                               "until then, those of every model on the kind, then of all")


class SpeedErrors:
    """Measured over profiled speed of the latest runs, per (model, GPU kind)."""

    def __init__(self, rule: MarginRule, default: float) -> None:
        self.rule = rule
        self.default = default  # the margin before anything was seen
        self._ratios: dict[tuple[str, str], OrderedDict[str, float]] = {}

    def seen(self, model: str, kind: str, run_id: str, ratio: float) -> None:
        """Run `run_id` trains at `ratio` times its profile (its latest measure replaces the one before)."""
        runs = self._ratios.setdefault((model, kind), OrderedDict())
        runs.pop(run_id, None)
        runs[run_id] = ratio
        while len(runs) > RUNS_KEPT:
            runs.popitem(last=False)

    def _samples(self, model: str, kind: str) -> list[float]:
        own = list(self._ratios.get((model, kind), {}).values())
        if len(own) >= self.rule.min_runs:
            return own
        same_kind = [r for (_, k), runs in self._ratios.items() if k == kind for r in runs.values()]
        if len(same_kind) >= self.rule.min_runs:
            return same_kind
        return [r for runs in self._ratios.values() for r in runs.values()]

    def margin(self, model: str, kind: str) -> float:
        """The fraction of a new run's window to keep in front of its deadline."""
        samples = sorted(self._samples(model, kind))
        if len(samples) < self.rule.min_runs:
            return self.default
        low = samples[min(len(samples) - 1, int(self.rule.quantile * len(samples)))]
        return min(self.rule.at_most, max(0.0, 1.0 - low))


class Speeds:
    """The loop's one collaborator for what runs' speeds teach it."""

    def __init__(self, rule: MarginRule, default_margin: float) -> None:
        self.gaps = ModelGaps()
        self.errors = SpeedErrors(rule, default_margin)

    def observe(self, run: LoopRun) -> None:
        """A slot's observation of `run`: its rate against its profile (on the
        set it was told, once it reports being there) and its measured ratio."""
        if run.phase == RunPhase.RUNNING and len(run.reported_gpus) == len(run.commanded):
            self.gaps.observe(run.run_id, run.profiled_as, len(run.commanded), run.reported_rate)
        if run.measured_ratio is not None:
            self.errors.seen(run.job.model, run.job.kind, run.run_id, run.measured_ratio)

    def learnt(self, run: LoopRun) -> bool:
        """Whether another slot's `observe` of `run` would teach nothing new
        (what `SpeedErrors` keeps is its latest ratio: the same however often
        it is seen)."""
        if run.phase != RunPhase.RUNNING or len(run.reported_gpus) != len(run.commanded):
            return True
        return self.gaps.learnt(run.run_id, run.profiled_as, len(run.commanded), run.reported_rate)

    def applied(self, job: Job) -> Job:
        return self.gaps.applied(job)

    def margin(self, job: Job) -> float:
        return self.errors.margin(job.model, job.kind)

    def forget(self, run_id: str) -> None:
        self.gaps.forget(run_id)
