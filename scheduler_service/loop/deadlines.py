"""A run's two deadlines, and the one function each that moves between them.

`deadline` is the user's. The plan deadline is what the policy plans
against: earlier by the launch reserve (a new run's start costs more than
the restart the plans charge) and by the safety margin. A time the policy reports (an earliest feasible deadline) goes back
to the user's clock with `user_deadline_for`, so that what a user is told
is feasible when used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SafetyMargin:
    """Room kept in front of an admitted run's deadline, so that a machine a
    little slower than its profile still finishes in time: a fraction of the
    run's window, and at least `floor_s` (a slot: a plan is revised no sooner)."""

    fraction: float = 0.0
    floor_s: float = 0.0

    def of(self, window_s: float) -> float:
        return max(self.floor_s, self.fraction * max(0.0, window_s))


NO_MARGIN = SafetyMargin()


def plan_deadline_for(deadline: float | None, window_from: float, reserve_s: float,
                      margin: SafetyMargin = NO_MARGIN) -> float | None:
    """The deadline the policy plans a run against: the user's, less what its
    start costs beyond a restart (`reserve_s`) and the safety margin on its
    window (from `window_from`, when it was taken in)."""
    if deadline is None:
        return None
    return deadline - reserve_s - margin.of(deadline - window_from)


def user_deadline_for(plan_time: float, window_from: float, reserve_s: float,
                      margin: SafetyMargin = NO_MARGIN) -> float:
    """The inverse: the user's deadline whose plan deadline is `plan_time`, so
    that an earliest feasible deadline told to a user is feasible when used
    (a later deadline has a wider window and so a wider margin)."""
    floor_only = plan_time + reserve_s + margin.floor_s
    if margin.fraction <= 0 or margin.fraction * (floor_only - window_from) <= margin.floor_s:
        return floor_only
    return (plan_time + reserve_s - margin.fraction * window_from) / (1.0 - margin.fraction)
