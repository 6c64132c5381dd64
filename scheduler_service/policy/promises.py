"""What a share's admitted plans promise over a window: what a refusal for
capacity tells a person ("24 of its 32 GPUs are promised to 3 runs before
this run's deadline"), rather than a count of the cluster's jobs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from scheduler_service.policy.plan import Plan, SlotClock
from scheduler_service.policy.timeline import Timeline


@dataclass(frozen=True, slots=True)
class Promises:
    """At most `gpus` reserved at once over the window, by `plans` plans, the
    last of which ends `ends_in_s` from now."""

    gpus: int
    plans: int
    ends_in_s: float


def promised(plans: Iterable[Plan], timeline: Timeline, clock: SlotClock, now: float, until: float) -> Promises:
    """What `plans` (reserved on `timeline`) hold between `now` and `until`."""
    slot = clock.slot_of(now)
    end = max(clock.slot_after(until), slot + 1)
    free = min((f for _, _, f in timeline.forward(slot, end)), default=timeline.capacity)
    overlapping = [plan for plan in plans if any(r.start < end and r.end > slot for r in plan.runs)]
    last = max((plan.end for plan in overlapping), default=slot)
    return Promises(timeline.capacity - free, len(overlapping), max(0.0, last * clock.interval - now))
