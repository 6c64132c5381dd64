"""`elasticflow status`: every run's phase, GPUs, progress, projected finish,
deadline, outcome and the reason for a rejection or a wait, plus the GPU map.

It reads only what the worker writes on this machine: its tables in the
project store and each run's control folder (status.json, command.json,
ack.json). No Prefect API call, and no import of Prefect, of the worker package
or of the scheduling policy: those cost seconds, and operators run this in a
loop. That is why the tables are read by name with SQLAlchemy Core rather than
through `scheduler_service.worker.store`, and why the home and the cluster's
shape are found here again (tests/cli/test_status.py writes through the
worker's own classes, so a drift fails there).

A few lines over 400 because the read model (the run views, `report()`,
finding the home and the cluster) still lives here beside the printing;
issue 46 moves it below the CLI, where `stack/audit.py` can use it too.
"""

from __future__ import annotations

import csv
import glob
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

import typer
from pydantic import BaseModel

from scheduler_service.cli import app
from scheduler_service.contracts import AllocationAction, Outcome, RunPhase, outcome_of

PHASE_ORDER = (RunPhase.RUNNING, RunPhase.RESCALING, RunPhase.ADMITTED, RunPhase.PROFILING, RunPhase.ARRIVED,
               RunPhase.REJECTED, RunPhase.FINISHED)
WIDE = 120  # columns from which one table fits; below, one block per run


class GpuSlot(BaseModel):
    gpu: int
    node: str
    holder: str | None = None  # the run's name, None when free


class RunView(BaseModel):
    """One run as `elasticflow status --json` gives it."""

    flow_run_id: str
    name: str
    model: str
    phase: RunPhase  # the table shows `phase.shown`, which says what it waits for
    gpus: list[int]
    nodes: list[str]
    iteration: int | None = None  # from the run's status file; None before its first report
    total_iterations: int | None = None
    projected_finish: datetime | None = None
    deadline: datetime | None = None  # None: best-effort
    outcome: Outcome | None = None  # finished runs: as the worker recorded it from the run's final state
    finished_at: datetime | None = None  # when its process ended (the last `release` allocation)
    reason: str | None = None  # a rejection's reason code
    detail: str = ""  # the rejection's message, why it waits, or the decision's message
    earliest_feasible_deadline: datetime | None = None
    team: str | None = None  # on a cluster shared by teams: its work queue
    at_risk: bool = False  # the control loop's flag (its one at-risk rule), as the worker stored it


class TeamStatus(BaseModel):
    """A team's guaranteed share and what its running runs hold now."""

    name: str
    share: int
    holds: int
    borrowed: int  # held beyond its share: lent by the others
    lends: int  # of its share, held by other teams' runs


class LeftOut(BaseModel):
    node: str
    why: str


class StatusReport(BaseModel):
    """The whole answer of `elasticflow status --json`."""

    at: datetime
    store: str
    cluster: str
    gpus: list[GpuSlot]
    runs: list[RunView]
    left_out: list[LeftOut] = []  # nodes the worker found and does not use, and why
    teams: list[TeamStatus] = []  # on a cluster shared by teams


def _home() -> Path:
    # As elasticflow_block.home, whose package pulls in fsspec.
    return Path(os.environ.get("ELASTICFLOW_HOME") or Path.home() / ".elasticflow")


def store_url(home: Path) -> str:
    # As scheduler_service.store.db.database_url, whose package pulls in sqlmodel.
    return os.environ.get("ELASTICFLOW_DATABASE_URL") or f"sqlite:///{home / 'elasticflow.db'}"


def _teams(home: Path) -> list[tuple[str, int]]:
    """(name, share) of each team, as the worker published them in `cluster.json` ([] for one queue)."""
    try:
        published = json.loads((home / "cluster.json").read_text())
        return [(str(t["name"]), int(t["share"])) for t in published.get("teams", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def _team_status(teams: list[tuple[str, int]], views: list[RunView]) -> list[TeamStatus]:
    """What each team holds against its share. What the teams hold beyond
    their shares is lent from the idle shares, credited to the lenders in
    order (GPUs no team owns are lent first, and are nobody's)."""
    running = (RunPhase.RUNNING, RunPhase.RESCALING)
    holds = {name: sum(len(v.gpus) for v in views if v.team == name and v.phase in running) for name, _ in teams}
    wanted = sum(max(0, holds[name] - share) for name, share in teams)
    out = []
    for name, share in teams:
        lends = min(max(0, share - holds[name]), wanted)
        wanted -= lends
        out.append(TeamStatus(name=name, share=share, holds=holds[name], borrowed=max(0, holds[name] - share),
                              lends=lends))
    return out


def _cluster(home: Path) -> tuple[str, list[str], list[LeftOut]]:
    """The cluster's description, each GPU's node and the nodes left out: as
    the worker published it (`cluster.json` in the home: {"description": str,
    "gpu_nodes": [node of GPU 0, ...], "left_out": [{"node", "why"}, ...]}, if
    it does), else chosen as scheduler_service.worker.cluster.load chooses it
    (cluster file, else this machine)."""
    try:
        published = json.loads((home / "cluster.json").read_text())
        return (str(published["description"]), [str(n) for n in published["gpu_nodes"]],
                [LeftOut.model_validate(entry) for entry in published.get("left_out", [])])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    chosen = os.environ.get("ELASTICFLOW_CLUSTER")
    default = Path(__file__).resolve().parents[2] / "infra" / "cluster.csv"
    if chosen or default.exists():
        path = Path(chosen or default)
        with path.open(newline="") as fh:
            row = next(csv.DictReader(fh))
        switches, per_switch, per_node = (int(row[k]) for k in ("num_switch", "num_node_p_switch", "num_gpu_p_node"))
        nodes = switches * per_switch
        names = ["localhost"] if nodes == 1 else [f"node-{i}" for i in range(nodes)]
        return (f"{nodes} node(s) x {per_node} GPUs ({path})",
                [names[g // per_node] for g in range(nodes * per_node)], [])
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    cuda = (len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"]) if visible is not None
            else len(glob.glob("/dev/nvidia[0-9]*")))
    slots = cuda or int(os.environ.get("ELASTICFLOW_CPU_SLOTS") or os.cpu_count() or 1)
    count = 1 << (max(1, slots).bit_length() - 1)
    what = "local CUDA devices" if cuda else "local CPU worker slots"
    return f"{count} {what} on localhost", ["localhost"] * count, []


def _aware(moment: datetime | None) -> datetime | None:
    """SQLite hands times back naive, though they were written in UTC."""
    return moment if moment is None or moment.tzinfo else moment.replace(tzinfo=timezone.utc)


def _read_tables(url: str) -> tuple[list[Any], dict[str, Any], dict[str, list[Any]]]:
    """Runs (oldest first), each run's latest decision, each run's allocations."""
    from sqlalchemy import MetaData, Table, create_engine, inspect, select

    engine = create_engine(url)
    try:
        if not inspect(engine).has_table("ef_job"):
            return [], {}, {}
        meta = MetaData()
        job, decision, allocation = (Table(name, meta, autoload_with=engine)
                                     for name in ("ef_job", "ef_decision", "ef_allocation"))
        with engine.connect() as conn:
            runs = list(conn.execute(select(job).order_by(job.c.submitted_at)))
            decisions = {row.flow_run_id: row for row in conn.execute(select(decision).order_by(decision.c.id))}
            allocations: dict[str, list] = {}
            for row in conn.execute(select(allocation).order_by(allocation.c.id)):
                allocations.setdefault(row.flow_run_id, []).append(row)
        return runs, decisions, allocations
    finally:
        engine.dispose()


def _view(row: Any, decision: Any, allocations: list[Any], control: Path, node_of: list[str]) -> RunView:
    """One run from its ef_job row, its latest ef_decision, its ef_allocation rows and its control folder."""
    from flows.training.control import FileControlChannel

    channel = FileControlChannel(row.flow_run_id, control)
    snap = channel.status()
    gpus = [int(g) for g in (row.gpus or "").split(",") if g]
    view = RunView(
        flow_run_id=row.flow_run_id, name=row.flow_run_name or row.flow_run_id[:8], model=row.model,
        phase=RunPhase.ADMITTED, gpus=gpus, nodes=sorted({node_of[g] for g in gpus if g < len(node_of)}),
        iteration=snap.iteration if snap else None,
        total_iterations=(snap.total_iterations if snap else 0) or int(row.iterations) or None,
        projected_finish=_aware(snap.projected_finish) if snap else None, deadline=_aware(row.deadline),
        team=getattr(row, "team", None),  # absent from a store an older worker wrote
        at_risk=bool(getattr(row, "at_risk", None)))
    stored = RunPhase(row.status)
    if stored == RunPhase.REJECTED:
        view.phase, view.detail = RunPhase.REJECTED, row.message or ""
        if decision is not None and not decision.admitted:
            view.reason, view.detail = decision.reason, decision.message or view.detail
            view.earliest_feasible_deadline = _aware(decision.earliest_feasible_deadline)
    elif stored == RunPhase.FINISHED:
        view.phase, view.projected_finish = RunPhase.FINISHED, None
        releases = [a.at for a in allocations if a.action == AllocationAction.RELEASE]
        view.finished_at = _aware(releases[-1] if releases else row.updated_at)
        recorded = getattr(row, "outcome", None)  # absent from a store an older worker wrote
        view.outcome = Outcome(recorded) if recorded else outcome_of(
            None, view.iteration or 0, view.total_iterations or 0,
            view.deadline.timestamp() if view.deadline else None, view.finished_at.timestamp())
        if view.outcome not in (Outcome.MET, Outcome.MISSED, Outcome.DONE):
            view.detail = f"{view.outcome.value} at iteration {view.iteration or 0} of {view.total_iterations}"
    elif stored in (RunPhase.ARRIVED, RunPhase.PROFILING) and decision is None:
        view.phase = stored
        view.detail = "profiling its speed" if stored == RunPhase.PROFILING else "waiting for its admission decision"
    elif stored == RunPhase.RUNNING and gpus:
        command, ack = channel.latest(), channel.acknowledged()
        pending = command if command is not None and command.seq > (ack.seq if ack else 0) else None
        view.phase = RunPhase.RESCALING if pending else RunPhase.RUNNING
        if pending is not None:
            view.detail = ("stopping: checkpointing, then it ends" if pending.action == "stop"
                           else f"moving to GPUs {_gpus(pending.gpus)}" if pending.gpus else "being parked")
    elif allocations and allocations[-1].action in (AllocationAction.PARK, AllocationAction.RELEASED):
        view.detail = "parked: its GPUs went to runs closer to their deadlines"
    else:
        view.detail = row.message if (row.message or "").startswith("waiting") else "waiting for GPUs"
    return view


def report(home: Path | None = None) -> StatusReport:
    """Everything `status` prints, read from the store and the control folders."""
    home = home or _home()
    url = store_url(home)
    description, node_of, left_out = _cluster(home)
    missing = url.startswith("sqlite:///") and not Path(url.removeprefix("sqlite:///")).exists()
    runs, decisions, allocations = ([], {}, {}) if missing else _read_tables(url)
    views = [_view(row, decisions.get(row.flow_run_id), allocations.get(row.flow_run_id, []),
                   home / "control", node_of) for row in runs]
    views.sort(key=lambda v: PHASE_ORDER.index(v.phase))  # stable: oldest first within a phase
    holders = {g: v.name for v in views if v.phase in (RunPhase.RUNNING, RunPhase.RESCALING) for g in v.gpus}
    from sqlalchemy.engine import make_url

    shown = make_url(url).render_as_string(hide_password=True)
    return StatusReport(at=datetime.now(timezone.utc), store=shown, cluster=description,
                        gpus=[GpuSlot(gpu=g, node=n, holder=holders.get(g)) for g, n in enumerate(node_of)],
                        runs=views, left_out=left_out, teams=_team_status(_teams(home), views))


def _when(moment: datetime | None, now: datetime) -> str:
    if moment is None:
        return "-"
    local = moment.astimezone()
    return local.strftime("%H:%M:%S" if local.date() == now.astimezone().date() else "%m-%d %H:%M")


def _gpus(gpus: list[int]) -> str:
    return ",".join(map(str, gpus)) or "-"


def _progress(view: RunView) -> str:
    if view.iteration is None:
        return f"0/{view.total_iterations}" if view.total_iterations else "-"
    return f"{view.iteration}/{view.total_iterations}"


def _result(view: RunView) -> str:
    """What came of it (finished), or the latest projection against the deadline."""
    if view.outcome:
        if view.outcome in (Outcome.MET, Outcome.MISSED) and view.finished_at and view.deadline:
            spare = (view.deadline - view.finished_at).total_seconds()
            return f"{view.outcome.value} ({_span(abs(spare))} {'early' if spare >= 0 else 'late'})"
        return view.outcome.value
    if view.phase == RunPhase.REJECTED:
        return view.reason or "rejected"
    if view.projected_finish and view.deadline:
        spare = (view.deadline - view.projected_finish).total_seconds()
        verdict = "at risk" if view.at_risk else "on track"  # the loop's rule, not one of status's own
        return f"{verdict} ({_span(spare)} spare)" if spare >= 0 else f"{verdict} ({_span(-spare)} late)"
    return ""


def _span(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _why(view: RunView, now: datetime) -> str:
    text = view.detail
    if view.earliest_feasible_deadline is not None:
        text += f"; earliest feasible deadline {_when(view.earliest_feasible_deadline, now)}"
    return text


def _ranges(numbers: list[int]) -> str:
    """0,1,2,5 -> "0-2,5"."""
    spans: list[list[int]] = []
    for n in numbers:
        if spans and n == spans[-1][1] + 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans) or "none"


def _gpu_map(slots: list[GpuSlot]) -> list[str]:
    """A summary line, then one line per node holding a run: a 64-GPU map fits 80 columns."""
    busy = [s for s in slots if s.holder]
    lines = [f"GPUs: {len(busy)} of {len(slots)} busy; free: {_ranges([s.gpu for s in slots if not s.holder])}"]
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
                     _gpus(v.gpus), ",".join(v.nodes) or "-", _progress(v),
                     _when(v.finished_at or v.projected_finish, now), _when(v.deadline, now),
                     _result(v), _why(v, now))
            table.add_row(*(Text(cell) for cell in cells))  # a run's name is no markup
        console.print(table)
        return
    for v in data.runs:
        result = _result(v)
        head = (f"{v.name} [{v.model}{', team ' + printable(v.team) if v.team else ''}] {v.phase.shown}"
                + (f": {result}" if result else ""))
        where = (f"GPUs {_gpus(v.gpus)} on {','.join(v.nodes)}" if v.gpus
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
