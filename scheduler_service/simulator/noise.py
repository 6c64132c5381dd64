"""A noisy cluster for the simulated backend: runs that train faster or
slower than their profile, nodes that slow down for a while, starts that
take longer or shorter than the model says.

Every draw comes from a generator seeded by (seed, what it is for): a run's
speed error depends on its id, not on the order things happened in, so two
loops run on one trace under one `Noise` see the same cluster (the bench
compares the loop with and without its defenses on the very same noise).
"""

from __future__ import annotations

import bisect
import math
import random
import zlib
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field


class SlowPeriods(BaseModel):
    """Each node now and then has some of its GPUs run at a fraction of their
    speed for a while (a throttled or shared node): a data-parallel run on
    any of them trains at the pace of its slowest rank."""

    model_config = ConfigDict(frozen=True)

    every_s: float = Field(6 * 3600.0, gt=0, description="mean time between slow periods of one node")
    lasting_s: float = Field(1800.0, gt=0, description="mean length of one")
    fraction: float = Field(0.5, gt=0, le=1, description="of the node's GPUs slowed")
    speed: float = Field(0.5, gt=0, le=1, description="their speed meanwhile, a fraction of the normal")


class Noise(BaseModel):
    """How far the simulated cluster departs from the profiles. All zero: exact."""

    model_config = ConfigDict(frozen=True)

    seed: int = 0
    speed_sigma: float = Field(0.0, ge=0, le=2, description="a run's speed against its curve: a factor fixed "
                               "for the run, lognormal with this sigma (faster or slower)")
    jitter_sigma: float = Field(0.0, ge=0, le=2, description="and one drawn anew each time it starts on a "
                                "GPU set (a launch or a resize), lognormal")
    start_sigma: float = Field(0.0, ge=0, le=2, description="a launch's or a restart's length, lognormal "
                               "around what the model says")
    slow: SlowPeriods | None = Field(None, description="slow periods of nodes; None: none")

    @property
    def quiet(self) -> bool:
        return not (self.speed_sigma or self.jitter_sigma or self.start_sigma or self.slow)


def _rng(seed: int, *what: object) -> random.Random:
    return random.Random(zlib.crc32(":".join(map(str, (seed, *what))).encode()))


@dataclass(slots=True)
class NodeSlowness:
    """One node's slow periods, drawn as far ahead as asked: (start, end, slowed GPU offsets)."""

    periods: list[tuple[float, float, frozenset[int]]] = field(default_factory=list)
    starts: list[float] = field(default_factory=list)
    drawn_to: float = 0.0


class NoisyCluster:
    """The noise one simulation plays: draws by run and by node, reproducible."""

    def __init__(self, noise: Noise, gpus_per_node: int) -> None:
        self.noise = noise
        self.gpus_per_node = max(1, gpus_per_node)
        self._factor: dict[str, float] = {}
        self._segments: dict[str, int] = {}
        self._nodes: dict[int, NodeSlowness] = {}

    def _lognormal(self, sigma: float, *what: object) -> float:
        return math.exp(_rng(self.noise.seed, *what).gauss(0.0, sigma)) if sigma else 1.0

    def run_factor(self, run_id: str) -> float:
        """The run's own speed over its curve's, for its whole life."""
        if run_id not in self._factor:
            self._factor[run_id] = self._lognormal(self.noise.speed_sigma, "speed", run_id)
        return self._factor[run_id]

    def segment_factor(self, run_id: str) -> float:
        """A start on a GPU set: the run's factor times this segment's own jitter."""
        n = self._segments[run_id] = self._segments.get(run_id, 0) + 1
        return self.run_factor(run_id) * self._lognormal(self.noise.jitter_sigma, "jitter", run_id, n)

    def start_factor(self, run_id: str) -> float:
        """How much longer (or shorter) than modelled this start or restart takes."""
        return self._lognormal(self.noise.start_sigma, "start", run_id, self._segments.get(run_id, 0))

    # -- slow nodes -------------------------------------------------------------
    def _node(self, node: int, until: float) -> NodeSlowness:
        slow = self.noise.slow
        state = self._nodes.setdefault(node, NodeSlowness())
        if slow is None or state.drawn_to >= until:
            return state
        rng = _rng(self.noise.seed, "node", node, len(state.periods))
        t = state.periods[-1][1] if state.periods else 0.0
        while t < until + slow.every_s:
            start = t + rng.expovariate(1.0 / slow.every_s)
            end = start + rng.expovariate(1.0 / slow.lasting_s)
            count = max(1, round(slow.fraction * self.gpus_per_node))
            state.periods.append((start, end, frozenset(rng.sample(range(self.gpus_per_node), count))))
            state.starts.append(start)
            t = end
        state.drawn_to = t
        return state

    def slowdown(self, gpus: tuple[int, ...], at: float) -> float:
        """The speed of a run on `gpus` at `at`, a fraction of its own: its slowest GPU's."""
        slow = self.noise.slow
        if slow is None or not gpus:
            return 1.0
        for gpu in gpus:
            node, offset = divmod(gpu, self.gpus_per_node)
            state = self._node(node, at)
            i = bisect.bisect_right(state.starts, at) - 1
            if i >= 0 and state.periods[i][1] > at and offset in state.periods[i][2]:
                return slow.speed
        return 1.0

    def changes_between(self, gpus: tuple[int, ...], after: float, until: float) -> list[float]:
        """When the slowdown of `gpus` may change in (after, until]: the starts and ends of their nodes' periods."""
        if self.noise.slow is None or not gpus:
            return []
        out: set[float] = set()
        for node in {g // self.gpus_per_node for g in gpus}:
            state = self._node(node, until)
            i = max(0, bisect.bisect_right(state.starts, after) - 1)
            for start, end, _ in state.periods[i:]:
                if start > until:
                    break
                out.update(t for t in (start, end) if after < t <= until)
        return sorted(out)
