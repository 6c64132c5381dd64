"""How the service words times and refusals for a person, in one place, so
that the run's Prefect state, its log, `elasticflow status`, a pipeline's
`TrainingRejected` and the decision event say the same thing.

A refusal leads with one sentence a data scientist acts on (what the run
would need against what it asked, and the earliest deadline that can be
guaranteed now); the policy's detail (the constraint that failed) follows it
for whoever wants it. No heavy imports: `status` reads this too."""

from __future__ import annotations

from datetime import datetime, timezone

from scheduler_service.contracts import RejectionReason


def span(seconds: float) -> str:
    """A duration as a person reads it: 45s, 3m05s, 2h10m."""
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def moment(at: datetime | None) -> str:
    """A time to the second, in UTC, with its date: a deadline may be another day's."""
    if at is None:
        return "beyond any date"
    return at.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def refusal(reason: RejectionReason, earliest: datetime | None, beyond_any_date: bool,
            deadline: datetime | None, at: datetime) -> str:
    """The sentence a refusal leads with ("" where the policy's own message
    is already what a person needs: a typo, a failed profile). `at`: when
    it was decided, which "in 1h00m" counts from."""
    left = deadline is not None and deadline > at
    due = f"its deadline is in {span((deadline - at).total_seconds())}" if left else "its deadline has passed"
    if earliest is not None:
        then = f" The earliest deadline that can be guaranteed now is {moment(earliest)}."
    elif beyond_any_date:
        then = " No deadline can be guaranteed: it would finish beyond any date."
    else:
        then = ""
    match reason:
        case RejectionReason.INFEASIBLE_ALONE:
            need = (f"about {span(max(0.0, (earliest - at).total_seconds()))}" if earliest is not None
                    else "more time than any date allows")
            first = f"This run needs {need} even with every GPU it can use, and {due}."
        case RejectionReason.INSUFFICIENT_CAPACITY:
            first = f"The GPUs this run needs before its deadline are promised to runs admitted earlier, and {due}."
        case RejectionReason.WINDOW_IN_DEMAND:
            first = ("This run could be guaranteed, but its plan would hold more of the cluster, for longer, than "
                     f"one run is worth now, and {due}.")
        case RejectionReason.DEADLINE_PASSED:
            first = f"Its deadline ({moment(deadline)}) had already passed when it was decided."
        case RejectionReason.SOONER_THAN_START_UP:
            first = f"{due[0].upper()}{due[1:]}: sooner than a run takes to start here."
        case _:
            return ""
    return first + then
