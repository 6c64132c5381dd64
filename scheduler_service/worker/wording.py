"""The lines a person reads about a run in its own Prefect logs: where it
runs and how it stands against its deadline, and how it ended."""

from __future__ import annotations

from scheduler_service.contracts import Outcome, epoch_to_datetime
from scheduler_service.phrases import span
from scheduler_service.text import printable


def iso(seconds: float | None) -> str | None:
    """ISO-8601 of epoch seconds (None past any date)."""
    moment = epoch_to_datetime(seconds)
    return None if moment is None else moment.isoformat()


def gpus_label(gpus: tuple[int, ...] | list[int]) -> str:
    return ",".join(map(str, gpus))


def clock(seconds: float | None) -> str:
    return (iso(seconds) or "beyond any date")[:19].replace("T", " ") + " UTC"


def outlook_line(deadline: float | None, finish: float | None, now: float, at_risk: bool,
                 gpus: tuple[int, ...], nodes: list[str]) -> str:
    """Where the run stands, in one line: GPUs and nodes, projected finish
    against the deadline. At risk or not is the control loop's flag, the
    one its deadline events follow, not a rule of this line's own."""
    where = f"on {len(gpus)} GPU{'s' if len(gpus) != 1 else ''} {gpus_label(gpus)} ({', '.join(nodes)})" \
        if gpus else "holding no GPUs"
    if deadline is None:
        return f"{where}; best-effort" + (f", projected finish {clock(finish)}" if finish else "")
    if finish is None:
        return f"{where}; deadline {clock(deadline)}"
    spare = deadline - finish
    verdict = "late" if now > deadline or at_risk and spare < 0 else "at risk" if at_risk else "on track"
    return (f"{where}; projected finish {clock(finish)}, deadline {clock(deadline)}: {verdict} "
            f"({span(abs(spare))} {'to spare' if spare >= 0 else 'late'})")


def outcome_line(outcome: Outcome, deadline: float | None, iteration: int, iterations: float, now: float,
                 why: str | None = None) -> str:
    """How the run ended, as its GPUs are released: what its final state says, never only its iterations."""
    progress = f"{iteration}/{iterations:.0f} iterations"
    because = f": {printable(why)[:500]}" if why else ""
    if outcome in (Outcome.MET, Outcome.MISSED):
        spare = (deadline or now) - now
        return (f"finished at {clock(now)}: deadline {outcome.value} ({span(abs(spare))} "
                f"{'to spare' if spare >= 0 else 'late'}); its GPUs are free")
    if outcome is Outcome.DONE:
        return f"finished at {clock(now)} (best-effort); its GPUs are free"
    if outcome is Outcome.FAILED:
        return f"failed at {clock(now)} after {progress}{because}; its GPUs are free"
    if outcome is Outcome.CANCELLED:
        return f"cancelled at {clock(now)} after {progress}; its GPUs are free"
    return f"ended after {progress} (stopped); its GPUs are free"
