"""The read model: every run as the service stands now, from what the worker
writes on this machine. `elasticflow status` prints it, the stack's audit
checks it against Prefect, the chaos bench and the stack tests read it.

It reads only the worker's tables in the project store, each run's control
folder (status.json, command.json, ack.json) and the cluster the worker
published (`cluster.json`). No Prefect API call, and no import of Prefect, of
the worker package or of the scheduling policy: those cost seconds, and
operators run `status` in a loop. That is why the tables are read by name
with SQLAlchemy Core rather than through `scheduler_service.worker.store`
(tests/cli/test_status.py writes through the worker's own classes, so a
drift fails there), and why the cluster is the one the worker published,
never guessed again here from this shell's environment.
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from scheduler_service.contracts import AllocationAction, Outcome, RejectionReason, RunPhase, outcome_of
from scheduler_service.phrases import refusal

PHASE_ORDER = (RunPhase.RUNNING, RunPhase.RESCALING, RunPhase.ADMITTED, RunPhase.PROFILING, RunPhase.ARRIVED,
               RunPhase.REJECTED, RunPhase.FINISHED)
UNPUBLISHED = "not known yet: no worker has started with this home"


class GpuHolder(BaseModel):
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
    summary: str = ""  # a rejection's sentence for a person, which leads (phrases.refusal)
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
    gpus: list[GpuHolder]
    runs: list[RunView]
    left_out: list[LeftOut] = []  # nodes the worker found and does not use, and why
    teams: list[TeamStatus] = []  # on a cluster shared by teams


def default_home() -> Path:
    # As elasticflow_block.home, whose package pulls in fsspec.
    return Path(os.environ.get("ELASTICFLOW_HOME") or Path.home() / ".elasticflow")


def store_url(home: Path) -> str:
    # As scheduler_service.store.db.database_url, whose package pulls in sqlmodel.
    return os.environ.get("ELASTICFLOW_DATABASE_URL") or f"sqlite:///{home / 'elasticflow.db'}"


def gpu_list(gpus: list[int]) -> str:
    return ",".join(map(str, gpus)) or "-"


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
    """The cluster's description, each GPU's node and the nodes left out, as
    the worker published them (`cluster.json` in the home: {"description":
    str, "gpu_nodes": [node of GPU 0, ...], "left_out": [{"node", "why"}, ...]},
    scheduler_service.worker.cluster.Cluster.publish). Before a worker has
    started there is no map: one guessed from this shell's environment was
    another cluster whenever the worker's environment differed."""
    try:
        published = json.loads((home / "cluster.json").read_text())
        return (str(published["description"]), [str(n) for n in published["gpu_nodes"]],
                [LeftOut.model_validate(entry) for entry in published.get("left_out", [])])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return UNPUBLISHED, [], []


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
            view.summary = refusal(RejectionReason.read(decision.reason), view.earliest_feasible_deadline, False,
                                   view.deadline, _aware(decision.at))
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
                           else f"moving to GPUs {gpu_list(pending.gpus)}" if pending.gpus else "being parked")
    elif allocations and allocations[-1].action in (AllocationAction.PARK, AllocationAction.RELEASED):
        view.detail = "parked: its GPUs went to runs closer to their deadlines"
    elif allocations and allocations[-1].action == AllocationAction.REBASED:
        view.detail = "its GPUs went with a lost node: it waits for a new placement"
    else:
        view.detail = row.message if (row.message or "").startswith("waiting") else "waiting for GPUs"
    return view


def report(home: Path | None = None) -> StatusReport:
    """Everything `status` prints, read from the store and the control folders."""
    home = home or default_home()
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
                        gpus=[GpuHolder(gpu=g, node=n, holder=holders.get(g)) for g, n in enumerate(node_of)],
                        runs=views, left_out=left_out, teams=_team_status(_teams(home), views))
