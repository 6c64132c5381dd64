"""A training deadline from a pipeline's SLA: pure functions, no Prefect, no clock.

A pipeline promises a registered model by a time (its SLA). Training is only
one step: evaluation, registration and deployment still have to run after it.
So the deadline ElasticFlow admits against is

    deadline = SLA - (sum of the downstream steps' expected times) - margin

Each downstream step's expected time is given by the pipeline author, or
learned from that step's past runs (a high percentile of recent durations,
scaled by a safety factor, because an SLA is missed by the slow days, not the
average ones), or, with no history yet, a stated fallback. Every number that
went into the deadline is kept in a `DeadlinePlan`, so a rejection or a late
model can be explained afterwards.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from datetime import datetime, time, timedelta, timezone
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Statistic = Literal["max", "p90", "p50"]
Source = Literal["given", "history", "fallback"]

_RELATIVE = re.compile(r"^\+\s*((?:\d+(?:\.\d+)?\s*[smhdw]\s*)+)$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def relative_seconds(text: str) -> float | None:
    """Seconds in a relative time (`+2h`, `+1h30m`, `+90s`); None if `text` is not one.
    The one parser of relative times: training deadlines and pipeline SLAs alike."""
    match = _RELATIVE.match(text.strip())
    if not match:
        return None
    return sum(float(num) * _UNIT_SECONDS[unit]
               for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([smhdw])", match.group(1)))


class SLATooClose(ValueError):
    """The SLA leaves no time to train: the derived deadline is not in the future.

    Raised before anything is submitted; `plan` says where the time went, and
    `reason` / `earliest_feasible_sla` read as on a `TrainingRejected`, so a
    pipeline can handle both the same way (any later SLA leaves some time to
    train; whether enough, only the scheduler can say).
    """

    reason = "sla_too_close"

    def __init__(self, plan: DeadlinePlan, now: datetime) -> None:
        self.plan, self.now = plan, now
        self.earliest_feasible_sla = now + plan.reserved
        steps = ", ".join(f"{s.name} {s.expected} ({s.source})" for s in plan.downstream) or "none"
        super().__init__(
            f"SLA {plan.sla.isoformat()} leaves no time to train: downstream steps [{steps}] plus margin "
            f"{plan.margin} need until then, so training would be due {plan.deadline.isoformat()}, "
            f"which is not after now ({now.isoformat()}); move the SLA to after "
            f"{(now + plan.reserved).isoformat()} or shorten the downstream steps"
        )

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (type(self), (self.plan, self.now))


class HistoryPolicy(BaseModel):
    """How a downstream step's expected time is learned from its past runs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    statistic: Statistic = Field(default="p90", description="of the recent durations; p90 ignores one freak run")
    last_n: int = Field(default=20, ge=1, le=200, description="completed runs looked at, newest first")
    safety_factor: float = Field(default=1.5, ge=1.0, description="multiplies the statistic: slow days exist")
    fallback: timedelta = Field(
        default=timedelta(minutes=5), description="assumed when a step has never completed before"
    )


class DownstreamStep(BaseModel):
    """One step after training and the time reserved for it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    expected: timedelta
    source: Source
    samples: int = Field(default=0, ge=0, description="past runs the estimate rests on (history only)")
    statistic: Statistic | None = None


class DeadlinePlan(BaseModel):
    """The training deadline and every number it was derived from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sla: datetime
    deadline: datetime
    downstream: list[DownstreamStep]
    margin: timedelta

    @property
    def reserved(self) -> timedelta:
        """Time kept free after training: downstream steps plus the margin."""
        return self.sla - self.deadline

    def describe(self) -> str:
        steps = ", ".join(f"{s.name}={s.expected} ({s.source})" for s in self.downstream) or "none"
        return (
            f"training due {self.deadline.isoformat()} = SLA {self.sla.isoformat()} - downstream [{steps}] "
            f"- margin {self.margin}"
        )


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile: always one of the observed values, never interpolated below the max."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 < q <= 100:
        raise ValueError(f"percentile q must be in (0, 100], got {q}")
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def expected_duration(durations_s: Sequence[float], policy: HistoryPolicy | None = None) -> timedelta | None:
    """The time to reserve for a step whose recent runs took `durations_s` (newest first).

    Looks at the newest `last_n` only, so a step that got faster stops being
    over-reserved; None when there is no history (the caller falls back, and says so).
    """
    policy = policy or HistoryPolicy()
    recent = [d for d in durations_s[: policy.last_n] if d >= 0]
    if not recent:
        return None
    if policy.statistic == "max":
        value = max(recent)
    else:
        value = percentile(recent, 90 if policy.statistic == "p90" else 50)
    return timedelta(seconds=value * policy.safety_factor)


def step_from_history(name: str, durations_s: Sequence[float], policy: HistoryPolicy | None = None) -> DownstreamStep:
    """A downstream step learned from its past durations, or the policy's fallback when it has none."""
    policy = policy or HistoryPolicy()
    expected = expected_duration(durations_s, policy)
    if expected is None:
        return DownstreamStep(name=name, expected=policy.fallback, source="fallback")
    used = min(len(durations_s), policy.last_n)
    return DownstreamStep(name=name, expected=expected, source="history", samples=used, statistic=policy.statistic)


def given_steps(downstream: Mapping[str, timedelta | float]) -> list[DownstreamStep]:
    """Steps whose times the pipeline author states (a timedelta, or seconds)."""
    steps = []
    for name, value in downstream.items():
        expected = value if isinstance(value, timedelta) else timedelta(seconds=float(value))
        if expected < timedelta(0):
            raise ValueError(f"downstream step {name!r} has a negative expected time {expected}")
        steps.append(DownstreamStep(name=name, expected=expected, source="given"))
    return steps


def derive_deadline(
    sla: datetime, downstream: Sequence[DownstreamStep], now: datetime, margin: timedelta = timedelta(minutes=1)
) -> DeadlinePlan:
    """The training deadline: the SLA minus the downstream steps (run one after another) and a margin.

    Raises `SLATooClose` when that deadline is not after `now`: submitting it
    would only earn a `deadline_passed` rejection, later and with less to go on.
    """
    if sla.tzinfo is None or now.tzinfo is None:
        raise ValueError("sla and now must be time-zone aware")
    if margin < timedelta(0):
        raise ValueError(f"margin must not be negative, got {margin}")
    reserved = sum((s.expected for s in downstream), timedelta(0)) + margin
    plan = DeadlinePlan(sla=sla, deadline=sla - reserved, downstream=list(downstream), margin=margin)
    if plan.deadline <= now:
        raise SLATooClose(plan, now)
    return plan


def resolve_sla(value: str | datetime, now: datetime) -> datetime:
    """An aware SLA time from what a pipeline parameter can hold.

    - an aware datetime, or ISO-8601 with a zone: `2026-12-01T06:00:00Z`
    - relative to `now`: `+1h`, `+2h30m`, `+90s`
    - a time of day with a zone, `06:00Z` or `06:00:00+00:00`: its next
      occurrence after `now`. This is what a daily deployment stores, since a
      fixed date would be stale tomorrow.

    Naive times are refused: an SLA that shifts with the server's zone is a missed SLA.
    """
    if now.tzinfo is None:
        raise ValueError("now must be time-zone aware")
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError(f"SLA {value.isoformat()} has no time zone; add one (e.g. +00:00 or Z)")
        return value
    text = value.strip()
    seconds = relative_seconds(text)
    if seconds is not None:
        return now + timedelta(seconds=seconds)
    iso = text.replace("Z", "+00:00").replace("z", "+00:00")
    try:
        moment = datetime.fromisoformat(iso)
    except ValueError:
        try:
            clock = time.fromisoformat(iso)
        except ValueError as exc:
            raise ValueError(
                f"SLA {value!r} is neither ISO-8601 (2026-12-01T06:00:00Z), a time of day (06:00Z) "
                "nor relative (+1h)"
            ) from exc
        if clock.tzinfo is None:
            raise ValueError(f"SLA {value!r} has no time zone; add one (e.g. 06:00Z)")
        local_now = now.astimezone(clock.tzinfo)
        candidate = datetime.combine(local_now.date(), clock.replace(tzinfo=None), tzinfo=clock.tzinfo)
        if candidate <= local_now:
            candidate = datetime.combine(
                local_now.date() + timedelta(days=1), clock.replace(tzinfo=None), tzinfo=clock.tzinfo
            )
        return candidate.astimezone(timezone.utc)
    if moment.tzinfo is None:
        raise ValueError(f"SLA {value!r} has no time zone; add one (e.g. +00:00 or Z)")
    return moment
