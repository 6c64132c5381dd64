"""Which layout admits a newcomer: its plan on the timeline as it is (the
fast path), or the re-plan of admitted jobs with it.

Both keep every guarantee; they differ in what they leave for later
arrivals. The shipped choice takes the fast path whenever it works and
re-plans only when it does not, which is also the cheap order. Trying the
re-plan first, or picking whichever layout leaves more GPUs free in the next
hours, was measured and loses on dev103 (docs/scheduling.md, Ablation
variants 4 and 5).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from scheduler_service.policy.admission import Refused, Replanned
from scheduler_service.policy.plan import Plan, SlotClock
from scheduler_service.policy.timeline import Timeline

Replan = Callable[[], Replanned | Refused]


class LayoutChoice(Protocol):
    """Pick the fast plan (`fast`, None if it failed), the re-plan (computed
    only if asked for: it costs a plan per admitted job), or None for neither."""

    def choose(
        self, fast: Plan | None, replan: Replan, timeline: Timeline, slot: int, clock: SlotClock
    ) -> Plan | Replanned | None: ...


@dataclass(frozen=True, slots=True)
class FastPathFirst:
    """The fast plan if there is one, else the re-plan (shipped)."""

    def choose(
        self, fast: Plan | None, replan: Replan, timeline: Timeline, slot: int, clock: SlotClock
    ) -> Plan | Replanned | None:
        if fast is not None:
            return fast
        replanned = replan()
        return replanned if isinstance(replanned, Replanned) else None


@dataclass(frozen=True, slots=True)
class ReplanFirst:
    """The re-plan if it works, else the fast plan (ablation variant 4)."""

    def choose(
        self, fast: Plan | None, replan: Replan, timeline: Timeline, slot: int, clock: SlotClock
    ) -> Plan | Replanned | None:
        replanned = replan()
        return replanned if isinstance(replanned, Replanned) else fast


@dataclass(frozen=True, slots=True)
class FreestWithin:
    """Of the two layouts, the one leaving more GPU-slots free in the next
    `hours` (the fast one on a tie), on the theory that near-term capacity is
    what the next arrivals need (ablation variant 5)."""

    hours: float

    def choose(
        self, fast: Plan | None, replan: Replan, timeline: Timeline, slot: int, clock: SlotClock
    ) -> Plan | Replanned | None:
        replanned = replan()
        if not isinstance(replanned, Replanned):
            return fast
        if fast is None:
            return replanned
        horizon = slot + round(self.hours * 3600 / clock.interval)

        def free(layout: Timeline) -> int:
            return sum((b - a) * f for a, b, f in layout.forward(slot, horizon))

        with_fast = timeline.copy()
        with_fast.add(fast.runs)
        return fast if free(with_fast) >= free(replanned.timeline) else replanned


FAST_PATH_FIRST = FastPathFirst()
REPLAN_FIRST = ReplanFirst()
