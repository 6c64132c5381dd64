"""What the runs of a model showed against its profile, for the runs of it
decided next.

A profile is one measurement on an idle moment; a run then trains beside
others (a shared file system, a busy CPU, a slow node). Each run's own plan
already follows the speed it shows (`LoopRun.observe_speed`); this carries a
lasting gap over to the model, so the next run of it is admitted on the
speed its runs really train at, not on the profile alone. Only a gap seen
in LASTING observations in a row (a slot apart) counts, and the profile stays
the best case: a model is never planned faster than it was measured.
"""

from __future__ import annotations

from dataclasses import replace

from scheduler_service.policy import Job, ThroughputCurve

LASTING = 3  # observations in a row (one a slot) a gap must last
GAP = 0.03  # smaller gaps from what the model is planned with are noise
FLOOR = 0.2  # a run this slow is stalled or resizing, not slower

Key = tuple[str, int]  # model, global batch size


class SpeedSeen:
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

    def observe(self, run_id: str, profile: Job, gpus: int, rate: float | None) -> bool:
        """A running run's rate on `gpus` GPUs against `profile` (its job as
        measured, before any correction), once a slot; True if that moved
        what its model is planned with."""
        key = self._key(profile)
        speed = profile.curve.points.get(gpus, 0.0)
        if key is None or not rate or rate <= 0 or speed <= 0:
            return False
        ratio = min(1.0, max(FLOOR, rate / speed))
        planned = self.ratios.get(key, 1.0)
        if abs(ratio - planned) < GAP * planned:
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
