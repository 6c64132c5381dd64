"""What a person reads about the whole cluster: the GPU map, and every job's
share, progress and projected finish against its deadline (the allocation
over time is plotted by plot.py).

Pure rendering: no Prefect and no clock here. The worker builds a
`ClusterSnapshot` (times passed in) and publishes the text these functions
return as one Prefect artifact that it keeps current; the same functions can
be tested, or fed from the simulator, without a server.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from enum import Enum

from pydantic import BaseModel, Field

from scheduler_service.markdown import markdown_table
from scheduler_service.text import printable, ranges

# The deadline-at-risk margin when none is given (the service passes its own,
# ELASTICFLOW_AT_RISK_S): a projection within a minute of the deadline is one
# slow slot away from missing it.
DEFAULT_MARGIN = timedelta(minutes=1)


class JobView(BaseModel):
    """One job as the cluster view shows it."""

    name: str  # the flow run's name
    flow_run_id: str
    model: str
    status: str  # e.g. "running", "waiting", "admitted", "finished"; "stopped": ended before its last iteration
    share: int | None = None  # minimum satisfactory share (GPUs); None: best-effort
    gpus: list[int] = Field(default_factory=list)  # GPUs it holds now
    iterations_done: float = 0.0
    iterations_total: float = 0.0
    projected_finish: datetime | None = None  # the policy's; for a finished job, when it finished
    deadline: datetime | None = None  # None: best-effort
    at_risk: bool = False  # the control loop's flag: its one at-risk rule, with hysteresis (loop/loop.py)


class TeamView(BaseModel):
    """A team's guaranteed share and what it holds now."""

    name: str
    share: int
    held: int
    borrowed: int


class ClusterSnapshot(BaseModel):
    """The cluster at one moment. GPU ids are node-major, as in `Topology`:
    `gpus_per_node` each, or, on a cluster of kinds with nodes of different
    sizes, `node_gpus[i]` on node i."""

    at: datetime
    topology: str  # e.g. Topology.describe()
    nodes: list[str]
    gpus_per_node: int = Field(ge=1)
    jobs: list[JobView] = Field(default_factory=list)
    node_gpus: list[int] = Field(default_factory=list)  # empty: gpus_per_node on every node
    node_kinds: list[str] = Field(default_factory=list)  # empty: one unnamed kind
    teams: list[TeamView] = Field(default_factory=list)  # empty: one queue for everyone

    def sizes(self) -> list[int]:
        return self.node_gpus or [self.gpus_per_node] * len(self.nodes)

    @property
    def num_gpus(self) -> int:
        return sum(self.sizes())


class Outlook(str, Enum):
    """A job's projected finish against its deadline."""

    ON_TRACK = "on track"
    AT_RISK = "at risk"  # the loop says so (projected within its margin of the deadline, for a while)
    LATE = "late"  # at risk and projected after the deadline, waiting with a plan past it, or the deadline passed
    MET = "met"  # finished by its deadline
    MISSED = "missed"  # finished after its deadline
    STOPPED = "stopped"  # ended before its last iteration: cancelled, failed or stopped
    UNKNOWN = "no projection"  # has a deadline, no projected finish yet
    BEST_EFFORT = "best-effort"


# Words, bold when someone should act: they read the same in every font
# (emoji showed as empty boxes where no emoji font is installed).
_MARK = {
    Outlook.ON_TRACK: "on track",
    Outlook.AT_RISK: "**at risk**",
    Outlook.LATE: "**late**",
    Outlook.MET: "met",
    Outlook.MISSED: "**missed**",
    Outlook.STOPPED: "stopped",
    Outlook.UNKNOWN: "no projection",
    Outlook.BEST_EFFORT: "best-effort",
}
_FINISHED = {"finished", "completed"}
_ENDED_SHORT = {"stopped", "failed", "cancelled"}  # ended without completing: how is the phase's to say
_PLAIN = {"running", "finished", "completed", "stopped"}  # phases the outlook already says


def _utc(moment: datetime) -> datetime:
    """Naive datetimes are taken as UTC, so comparisons never raise."""
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment


def outlook(job: JobView, at: datetime) -> Outlook:
    """Where `job` stands against its deadline at time `at`. Whether a
    running job is at risk is the control loop's to say (`job.at_risk`, the
    flag behind its events): a second rule here showed a run at risk while
    its events said it had recovered."""
    if job.deadline is None:
        return Outlook.BEST_EFFORT
    deadline = _utc(job.deadline)
    if job.status in _ENDED_SHORT:  # neither met nor missed: nobody wants its result any more
        return Outlook.STOPPED
    if job.status in _FINISHED:
        if job.projected_finish is None:
            return Outlook.UNKNOWN
        return Outlook.MET if _utc(job.projected_finish) <= deadline else Outlook.MISSED
    if _utc(at) > deadline:
        return Outlook.LATE
    if job.projected_finish is None:
        return Outlook.UNKNOWN
    if _utc(job.projected_finish) > deadline and (job.at_risk or job.status != "running"):
        return Outlook.LATE
    return Outlook.AT_RISK if job.at_risk else Outlook.ON_TRACK


def _cell(text: str) -> str:
    """Markdown table cells cannot hold pipes; what users wrote keeps no control character."""
    return printable(text.replace("\n", " ")).replace("|", "\\|")


def _duration(delta: timedelta) -> str:
    seconds = int(abs(delta.total_seconds()))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours >= 48:
        text = f"{hours // 24}d{hours % 24}h"
    elif hours:
        text = f"{hours}h{minutes:02d}m"
    elif minutes:
        text = f"{minutes}m{secs:02d}s"
    else:
        text = f"{secs}s"
    return ("-" if delta.total_seconds() < 0 else "") + text


def _brief(delta: timedelta) -> str:
    """A duration to a table's width: `30s`, `10m`, `1h05m`, `3d0h`."""
    seconds = int(abs(delta.total_seconds()))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m"
    return _duration(timedelta(seconds=seconds))


def _when(moment: datetime | None, at: datetime, relative_too: bool = True) -> str:
    """A time as HH:MM:SS UTC with how far from `at`; on another day its
    date, to the minute (the relative time says the rest): "Dec 07 11:58",
    the year only when it differs. A full date and time in every row of
    deadlines past midnight pushed the jobs table past a 1280-pixel window."""
    if moment is None:
        return "-"
    moment, at = _utc(moment).astimezone(timezone.utc), _utc(at).astimezone(timezone.utc)
    if moment.date() == at.date():
        clock = moment.strftime("%H:%M:%S")
    else:
        clock = moment.strftime("%b %d %H:%M" if moment.year == at.year else "%Y-%m-%d %H:%M")
    if not relative_too:
        return clock
    delta = moment - at
    relative = f"in {_brief(delta)}" if delta.total_seconds() >= 0 else f"{_brief(-delta)} ago"
    return f"{clock} ({relative})"


NAME_CHARS = 20  # of a run's name in the jobs table and the GPU map


def short_name(name: str) -> str:
    """A run's name as the jobs table and the GPU map show it: at most NAME_CHARS characters."""
    return name if len(name) <= NAME_CHARS else name[:NAME_CHARS - 1] + "…"


def _progress(job: JobView) -> str:
    if job.iterations_total <= 0:
        return "-"
    percent = max(0.0, min(100.0, 100.0 * job.iterations_done / job.iterations_total))
    return f"{percent:.0f}%"


def _order(job: JobView) -> tuple[bool, bool, datetime, str]:
    """Active jobs before ended ones (the one active run was row 11 of 13);
    in each, earliest deadline first, best-effort jobs after every deadline job."""
    far = datetime.max.replace(tzinfo=timezone.utc)
    ended = job.status in _FINISHED or job.status in _ENDED_SHORT
    return (ended, job.deadline is None, far if job.deadline is None else _utc(job.deadline), job.name)


def _holders(snapshot: ClusterSnapshot) -> dict[int, list[str]]:
    """GPU -> names of the jobs holding it (two during a hand-over report),
    cut as the jobs table cuts them: a node of 8 GPUs held by long-named runs
    was wider than the window, one full name a cell."""
    holders: dict[int, list[str]] = {}
    for job in sorted(snapshot.jobs, key=_order):
        for gpu in job.gpus:
            holders.setdefault(gpu, []).append(short_name(job.name))
    return holders


def gpu_map_markdown(snapshot: ClusterSnapshot) -> str:
    """One row per node, one column per local GPU: `id holder`, or `id ·` when idle."""
    holders = _holders(snapshot)
    sizes = snapshot.sizes()
    header = ["node"] + [f"GPU {i}" for i in range(max(sizes, default=0))]
    rows = []
    first = 0
    for index, node in enumerate(snapshot.nodes):
        kind = snapshot.node_kinds[index] if index < len(snapshot.node_kinds) else ""
        cells = [_cell(f"{node} ({kind})" if kind else node)]
        for local in range(max(sizes)):
            if local >= sizes[index]:
                cells.append("")
                continue
            gpu = first + local
            names = holders.get(gpu)
            cells.append(f"`{gpu}` " + (_cell(" + ".join(names)) if names else "·"))
        first += sizes[index]
        rows.append(cells)
    lines = [markdown_table(header, rows)]
    strays = sorted(g for g in holders if g >= snapshot.num_gpus)
    if strays:  # a job reports GPUs the topology does not have: show it rather than hide it
        lines.append("")
        lines.append("GPUs outside the topology: " + ", ".join(f"`{g}` {_cell(' + '.join(holders[g]))}"
                                                             for g in strays))
    return "\n".join(lines)


def teams_markdown(snapshot: ClusterSnapshot) -> str:
    """One row per team: its share, what it holds, what of that it borrowed, what of its share it lends."""
    rows = [[_cell(t.name), str(t.share), str(t.held), str(t.borrowed), str(max(0, t.share - t.held + t.borrowed))]
            for t in snapshot.teams]
    return markdown_table(["team", "share", "holds", "borrowed", "idle share (lent or free)"], rows)


def jobs_markdown(snapshot: ClusterSnapshot, margin: timedelta = DEFAULT_MARGIN) -> str:
    """The jobs table, earliest deadline first, best-effort jobs last."""
    if not snapshot.jobs:
        return "_No jobs._"
    # Narrow enough for the Prefect UI's artifact column (about 700 pixels in
    # a 1280-pixel window): the outlook second, with the run's phase when it
    # is not simply running; its id, model and iteration counts are on its own page.
    # "finish" is the projected finish (the legend says so): the longer header
    # alone decided its column's width, and a long run name then overflowed.
    # The UI draws cells without wrapping: at 1280 pixels a 20-character run name and "stopped ·
    # cancelled" pushed the GPUs column off the edge. A name is cut at NAME_CHARS (its page has it
    # whole), a run that ended short says only how, and GPUs are ranges.
    header = ["job", "outlook", "done", "finish", "deadline", "MSS", "GPUs"]
    rows = []
    for job in sorted(snapshot.jobs, key=_order):
        mark = _MARK[outlook(job, snapshot.at)]
        cells = [
            _cell(short_name(job.name)),
            _cell(job.status) if job.status in _ENDED_SHORT
            else mark + ("" if job.status in _PLAIN else f" · {_cell(job.status)}"),
            _progress(job),
            _when(job.projected_finish, snapshot.at, relative_too=False),  # the outlook says how it stands
            _when(job.deadline, snapshot.at) if job.deadline is not None else "none",
            "-" if job.share is None else str(job.share),
            ranges(sorted(job.gpus)) or "-",
        ]
        rows.append(cells)
    return markdown_table(header, rows)


def cluster_summary(snapshot: ClusterSnapshot) -> str:
    """The view in one line: when, the cluster, GPUs busy, jobs, and how many are late or at risk."""
    at = _utc(snapshot.at).astimezone(timezone.utc)
    busy = len({g for job in snapshot.jobs for g in job.gpus})
    outlooks = [outlook(job, snapshot.at) for job in snapshot.jobs]
    counts = [f"{outlooks.count(o)} {o.value}" for o in (Outlook.LATE, Outlook.AT_RISK) if o in outlooks]
    summary = (f"{at:%Y-%m-%d %H:%M:%S} UTC · {snapshot.topology} · {busy}/{snapshot.num_gpus} GPUs busy · "
               f"{len(snapshot.jobs)} job{'s' if len(snapshot.jobs) != 1 else ''}")
    return summary + (" · " + ", ".join(counts) if counts else "")


def cluster_markdown(snapshot: ClusterSnapshot, margin: timedelta = DEFAULT_MARGIN) -> str:
    """The whole cluster view as markdown: a summary line, the GPU map by node and
    the jobs table with each job's outlook against its deadline. Times are UTC,
    with how far they are from `snapshot.at`."""
    return "\n".join([  # no title: the artifact's description is shown above it
        f"**{cluster_summary(snapshot)}**", "",
        "## GPUs", "", gpu_map_markdown(snapshot), "",
        *(["## Teams", "", teams_markdown(snapshot), ""] if snapshot.teams else []),
        "## Jobs", "", jobs_markdown(snapshot, margin), "",
        (f"_Finish: projected finish. MSS: minimum satisfactory share, the fewest GPUs that meet the deadline. "
         f"At risk: projected finish within {_duration(margin)} of the deadline, or within half the room its "
         f"plan keeps if that is less, for half a minute (the same rule as the deadline events)._"),
    ])
