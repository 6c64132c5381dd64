"""`elasticflow status`: every run's phase, GPUs, progress, projected finish,
deadline, outcome and the reason for a rejection or a wait, plus the GPU map.
It only prints: what it prints is `scheduler_service.readmodel`'s report, which
imports neither Prefect nor the worker nor the policy (operators run this in a
loop)."""

from __future__ import annotations

import sys
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import typer

from scheduler_service.cli import app
from scheduler_service.contracts import DETAIL, Outcome, RunPhase
from scheduler_service.phrases import span
from scheduler_service.text import ranges
from scheduler_service.readmodel import (
    PHASE_ORDER, GpuHolder, LeftOut, RunView, StatusReport, gpu_list, report,
)

WIDE = 120  # columns from which one table fits; below, one block per run


def _when(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "-"
    local = moment.astimezone()  # another day's with its year: "01-01 00:00" was read as this year's
    return local.strftime("%H:%M:%S" if local.date() == now.astimezone().date() else "%Y-%m-%d %H:%M")


def _progress(view: RunView) -> str:
    if view.iteration is None:
        return f"0/{view.total_iterations}" if view.total_iterations else "-"
    return f"{view.iteration}/{view.total_iterations}"


def _result(view: RunView) -> str:
    """What came of it (finished), or the latest projection against the deadline."""
    if view.outcome:
        if view.outcome in (Outcome.MET, Outcome.MISSED) and view.finished_at and view.deadline:
            spare = (view.deadline - view.finished_at).total_seconds()
            return f"{view.outcome.value} ({span(abs(spare))} {'early' if spare >= 0 else 'late'})"
        return view.outcome.value
    if view.phase == RunPhase.REJECTED:
        return view.reason or "rejected"
    if view.projected_finish and view.deadline:
        spare = (view.deadline - view.projected_finish).total_seconds()
        verdict = "at risk" if view.at_risk else "on track"  # the loop's rule, not one of status's own
        return f"{verdict} ({span(spare)} spare)" if spare >= 0 else f"{verdict} ({span(-spare)} late)"
    return ""


def _why(view: RunView, now: datetime) -> str:
    if view.summary:  # a refusal: the sentence for a person (with the earliest deadline), then the policy's detail
        return f"{view.summary}{DETAIL}{view.detail}"
    text = view.detail
    if view.earliest_feasible_deadline is not None:
        text += f"; earliest feasible deadline {_when(view.earliest_feasible_deadline, now)}"
    return text


def _gpu_map(slots: list[GpuHolder]) -> list[str]:
    """A summary line, then one line per node holding a run: a 64-GPU map fits 80 columns."""
    busy = [s for s in slots if s.holder]
    free = [s.gpu for s in slots if not s.holder]  # "free: 0" was read as none free, not GPU 0
    lines = [f"GPUs: {len(busy)} of {len(slots)} busy; free: "
             + (f"GPU{'s' if len(free) > 1 else ''} {ranges(free)}" if free else "none")]
    for node in dict.fromkeys(s.node for s in busy):
        held = " ".join(f"{s.gpu}:{s.holder or '-'}" for s in slots if s.node == node)
        lines.append(f"  {node}  {held}")
    return lines


def render(data: StatusReport, console: Any) -> None:
    """A table on a wide terminal; one block per run at 80 columns or in a pipe.
    What users wrote (names, messages) is shown with its control characters
    escaped: a run's name cannot forge a line or colour the terminal."""
    from scheduler_service.text import MESSAGE_LIMIT, printable, shown

    now = data.at
    data = data.model_copy(update={
        "cluster": printable(data.cluster),
        "left_out": [LeftOut(node=printable(o.node), why=printable(o.why)) for o in data.left_out],
        "gpus": [s.model_copy(update={"holder": shown(s.holder)}) if s.holder else s for s in data.gpus],
        "runs": [v.model_copy(update={"name": shown(v.name), "model": shown(v.model),
                                      "detail": shown(v.detail, MESSAGE_LIMIT),
                                      "reason": shown(v.reason, MESSAGE_LIMIT) if v.reason else v.reason})
                 for v in data.runs]})
    counts = {p: sum(v.phase == p for v in data.runs) for p in PHASE_ORDER}
    console.print(f"cluster: {data.cluster}; store: {data.store}", markup=False, highlight=False)
    for out in data.left_out:
        console.print(f"  left out: node {out.node}: {out.why}", markup=False, highlight=False)
    for line in _gpu_map(data.gpus):
        console.print(line, markup=False, highlight=False)
    for team in data.teams:
        console.print(f"team {printable(team.name)}: share {team.share}, holds {team.holds}"
                      + (f" ({team.borrowed} borrowed)" if team.borrowed else "")
                      + (f", lends {team.lends}" if team.lends else ""), markup=False, highlight=False)
    zone = datetime.now().astimezone().tzname()
    console.print(f"{len(data.runs)} runs: " + ", ".join(f"{n} {p.shown}" for p, n in counts.items() if n)
                  + f" (times {zone})")
    if console.width >= WIDE:
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, pad_edge=False)
        teamed = bool(data.teams)
        for column in ("run", *(("team",) if teamed else ()), "model", "phase", "GPUs", "nodes", "progress",
                       "finish", "deadline", "outcome", "why"):
            table.add_column(column, overflow="fold")
        for v in data.runs:
            cells = (v.name, *((printable(v.team or "-"),) if teamed else ()), v.model, v.phase.shown,
                     gpu_list(v.gpus), ",".join(v.nodes) or "-", _progress(v),
                     _when(v.finished_at or v.projected_finish, now), _when(v.deadline, now),
                     _result(v), _why(v, now))
            table.add_row(*(Text(cell) for cell in cells))  # a run's name is no markup
        console.print(table)
        return
    for v in data.runs:
        result = _result(v)
        head = (f"{v.name} [{v.model}{', team ' + printable(v.team) if v.team else ''}] {v.phase.shown}"
                + (f": {result}" if result else ""))
        where = (f"GPUs {gpu_list(v.gpus)} on {','.join(v.nodes)}" if v.gpus
                 else "" if v.phase in (RunPhase.FINISHED, RunPhase.REJECTED) else "no GPUs")
        when = (f"finished {_when(v.finished_at, now)}" if v.finished_at
                else f"projected {_when(v.projected_finish, now)}" if v.projected_finish else "")
        due = (f"deadline {_when(v.deadline, now)}" if v.deadline
               else "" if v.phase == RunPhase.REJECTED else "best-effort")  # rejected: no deadline was read
        progress = "" if v.phase == RunPhase.REJECTED else f"it {_progress(v)}"
        for line in (head, "  " + "  ".join(x for x in (where, progress, when, due) if x),
                     f"  {_why(v, now)}" if _why(v, now) else ""):
            if line:
                console.print(line, markup=False, highlight=False)


@app.command()
def status(
    home: Optional[Path] = typer.Option(None, "--home", help="state folder (default: $ELASTICFLOW_HOME or ~/.elasticflow)"),
    as_json: bool = typer.Option(False, "--json", help="print the StatusReport model as JSON"),
) -> None:
    """Every run's phase, GPUs, progress, projected finish, deadline, outcome and
    the reason for a rejection or a wait, and the GPU map (reads the store; no API calls)."""
    from sqlalchemy.exc import SQLAlchemyError

    try:
        data = report(home.expanduser().resolve() if home else None)
    except (SQLAlchemyError, OSError, ValueError) as exc:  # a store or cluster file it cannot read
        print(f"error: cannot read the service's state: {exc}", file=sys.stderr)
        raise typer.Exit(1) from None
    if as_json:
        print(data.model_dump_json(indent=2))
        return
    from scheduler_service.cli.hints import console

    render(data, console())
