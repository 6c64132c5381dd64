"""How long the loop stays quiet: the first time at which a step, with no
event before it, could decide or learn anything.

Once a slot the loop looks at every run (loop.py `_due`): whether a plan is
due, and what the speeds it shows teach. Between two events a run trains
on a straight line, and most of those looks change nothing. A driver that
knows when the next one could may skip the slot boundaries before it: the
simulator does (philly through the loop took 24 times the bare policy's
time, looking at every run at each of 100,000 boundaries); the worker polls
anyway.

Quiet needs every running run steady: acknowledged, training on the set it
was told at the rate it reports, its last launch or resize timed (its first
iteration seen: a slow period can put that past the poll the backend planned
for it, and the look that sees it teaches `StartCost`), and its speeds learnt
(another look at the same rate changes nothing: `LoopRun.learnt`,
`Speeds.learnt`). It ends
at the earliest of a plan deadline passing, a run falling more than a slot
behind its plan at the rate it shows (`LoopRun.slipped`), and the time the
policy asked to be woken. What a step would change meanwhile is only what
people see (a run's projection, its risk flag), never a decision.
"""

from __future__ import annotations

import math

from scheduler_service.contracts import RunPhase
from scheduler_service.loop.run import LoopRun


def quiet_until(run: LoopRun, now: float, slack_s: float, planned_at: float) -> float | None:
    """Until when nothing about `run` can make a step act, with no event
    before (math.inf: never); None if something can at the next look."""
    deadline = run.plan_deadline
    if deadline is not None and planned_at < deadline <= now:
        return None  # passed since the last plan: the next look plans
    until = deadline if deadline is not None and deadline > now else math.inf
    if run.phase != RunPhase.RUNNING or not run.commanded and run.pending_seq is None:
        return until  # waits for GPUs, or parked: only an event moves it
    if run.stopping or run.finishing or run.pending_seq is not None or run.reported_gpus != run.commanded \
            or not run.reported_rate or run.being_timed or not run.learnt():
        return None
    return min(until, slips_at(run, now, slack_s))


def slips_at(run: LoopRun, now: float, slack_s: float) -> float:
    """When `run.slipped(t, slack_s)` turns true at the rate it reports:
    its projection at its plan's speed, t + left(t) / v, grows as long as it
    trains slower than v."""
    gpus, rate = len(run.commanded), run.reported_rate or 0.0
    if run.planned_finish is None or gpus not in run.job.curve.points:
        return math.inf
    speed = run.job.curve.speed(gpus)
    if rate >= speed:
        return math.inf
    left = max(0.0, run.job.iterations - run.iteration)
    return now + (run.planned_finish + slack_s - now - left / speed) / (1.0 - rate / speed)
