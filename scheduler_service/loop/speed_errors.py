"""How far runs here train from their profiles, learnt as they train, and the
margin admission keeps for it.

A profile is measured once, on an idle machine; a run then shares nodes,
lands on a throttled one, or reads a slow file system. The loop sees each
run's measured speed over its profiled one every slot; the last such ratio
of each of the latest runs of a model on a GPU kind is kept. A new run is
admitted with room in front of its deadline for a run as slow as the low
quantile of those ratios: a run that slow still fits its window once its
plan is stretched by the loop (it is re-planned at its measured speed).
With nothing seen yet, the default margin stands; with every run on its
profile, only the floor (a slot) is kept.
"""

from __future__ import annotations

from collections import OrderedDict

from pydantic import BaseModel, ConfigDict, Field

RUNS_KEPT = 200  # per model and kind: the latest runs' ratios


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
