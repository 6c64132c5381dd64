"""The teams scenario of the evaluation: does a team that floods the cluster
cost the other teams their deadlines?

A reference trace is dealt to three teams in turn (a, b, c), each with a
guaranteed share; team a then floods it with copies of the trace's own jobs,
drawn with a seed, all submitted within the first hour. Each line runs the
same jobs through the service's own control loop, with the teams file and
without it (one queue, as the service runs with none), calm and flooded; the
LP bound of each team's jobs on its share alone goes beside them. Both
`elasticflow reproduce` and `bench/teams.py` show it.
"""

from __future__ import annotations

import csv
import random
import tempfile
from pathlib import Path

from pydantic import BaseModel, Field

from scheduler_service.policy.registry import DEFAULT_POLICY
from scheduler_service.policy.jobs import Job
from scheduler_service.policy.teams import Team
from scheduler_service.policy.topology import AnyTopology, Topology
from scheduler_service.simulator.bound import deadline_ratio_bound
from scheduler_service.simulator.experiment import data_dir, load_jobs, simulate_policy
from scheduler_service.simulator.metrics import PolicyResult, summarize

FLOOD_WINDOW_S = 3600.0  # the flood's submissions all come within this of the trace's start


class TeamsScenario(BaseModel):
    trace: str = Field("dev102", description="a trace of data/reference/traces")
    first: int | None = Field(None, ge=1, description="only the trace's first jobs (a first look, a test)")
    cluster: str = "n8g8"
    gpu: str = "A100"
    shares: dict[str, int] = Field(default_factory=lambda: {"a": 24, "b": 20, "c": 20})
    flood: int = Field(300, ge=0, description="the first team's extra jobs, all within the first hour")
    seed: int = 0
    policy: str = DEFAULT_POLICY
    interval: float = 60.0

    @property
    def flooder(self) -> str:
        return next(iter(self.shares))

    def team_list(self) -> tuple[Team, ...]:
        return tuple(Team(name, share) for name, share in self.shares.items())


class Line(BaseModel):
    """One run of the scenario's jobs."""

    with_teams: bool  # with the teams file, or one queue
    flooded: bool

    @property
    def name(self) -> str:
        return f"{'teams' if self.with_teams else 'one queue'}, {'flood' if self.flooded else 'calm'}"


LINES = (Line(with_teams=True, flooded=False), Line(with_teams=True, flooded=True),
         Line(with_teams=False, flooded=False), Line(with_teams=False, flooded=True))


class TeamsReport(BaseModel):
    scenario: TeamsScenario
    results: dict[str, PolicyResult]  # by Line.name
    bounds: dict[str, dict[str, float]]  # "calm" / "flood" -> team -> LP bound of its jobs on its share


def write_trace(scenario: TeamsScenario, folder: Path, flooded: bool) -> Path:
    """The scenario's trace, with its `team` column, as a CSV in `folder`."""
    rows = list(csv.DictReader((data_dir() / "reference" / "traces" / f"{scenario.trace}.csv").open()))
    rows = rows[:scenario.first] if scenario.first else rows
    names = list(scenario.shares)
    out = [{**row, "team": names[i % len(names)]} for i, row in enumerate(rows)]
    rng = random.Random(scenario.seed)
    for i in range(scenario.flood if flooded else 0):
        row = dict(rng.choice(rows))
        window = float(row["ddl"]) - float(row["submit_time"])
        submit = rng.uniform(0, FLOOD_WINDOW_S)
        out.append({**row, "job_id": f"flood-{i}", "submit_time": f"{submit:.0f}", "ddl": f"{submit + window:.0f}",
                    "team": scenario.flooder})
    path = folder / f"{scenario.trace}-{'flood' if flooded else 'calm'}.csv"
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(out[0]))
        writer.writeheader()
        writer.writerows(out)
    return path


def _jobs(scenario: TeamsScenario, flooded: bool) -> tuple[list[Job], AnyTopology]:
    data = data_dir()
    with tempfile.TemporaryDirectory(prefix="teams-") as folder:
        path = write_trace(scenario, Path(folder), flooded)
        jobs, topology, _ = load_jobs(path, data / "clusters" / f"{scenario.cluster}.csv",
                                      data / "throughputs" / scenario.gpu)
    return jobs, topology


def run_line(scenario: TeamsScenario, line: Line) -> PolicyResult:
    """The scenario's jobs through the service's loop, as `line` says."""
    jobs, topology = _jobs(scenario, line.flooded)
    run, _ = simulate_policy(jobs, topology, scenario.policy, scenario.interval,
                             data_dir() / "throughputs" / scenario.gpu, "service",
                             teams=scenario.team_list() if line.with_teams else ())
    return summarize(run, f"{scenario.trace} ({line.name})", scenario.cluster, scenario.interval, "service")


def bounds_on_shares(scenario: TeamsScenario, flooded: bool) -> dict[str, float]:
    """Each team's LP bound: its jobs alone on a cluster the size of its share."""
    jobs, _ = _jobs(scenario, flooded)
    return {team: deadline_ratio_bound([j for j in jobs if j.team == team], Topology(1, share, 1)).bound
            for team, share in scenario.shares.items()}


def moved_by_flood(report: TeamsReport, with_teams: bool) -> float:
    """How far the flood moved the other teams' ratios, at most (teams with
    no deadline job have no ratio to move)."""
    calm, flood = (report.results[Line(with_teams=with_teams, flooded=f).name] for f in (False, True))
    others = [t for t in report.scenario.shares if t != report.scenario.flooder
              and t in calm.ratio_by_team and t in flood.ratio_by_team]
    return max((abs(flood.ratio_by_team[t] - calm.ratio_by_team[t]) for t in others), default=0.0)


def markdown(report: TeamsReport) -> str:
    s = report.scenario
    names = list(s.shares)
    shares = "/".join(str(v) for v in s.shares.values())
    lines = [f"Teams: {s.trace} on {s.cluster} dealt to teams {', '.join(names)} (shares {shares} GPUs); team "
             f"{s.flooder} floods with {s.flood} more jobs in the first hour. {s.policy} through the service's "
             "loop, with the teams file and in one queue (no file). Deadline ratio by team, overall, GPU use; "
             "the bound is each team's LP bound on its share alone.", "",
             "| | " + " | ".join(f"team {t}" for t in names) + " | overall | use | admitted missed |",
             "|---|" + "---|" * (len(names) + 3)]
    for line in LINES:
        r = report.results[line.name]
        lines.append(f"| {line.name} | " + " | ".join(_ratio(r.ratio_by_team.get(t)) for t in names)
                     + f" | {r.deadline_ratio:.3f} | {r.gpu_utilization:.3f} | {r.admitted_missed} |")
    for when, bound in report.bounds.items():
        lines.append(f"| bound on share, {when} | " + " | ".join(f"{bound[t]:.3f}" for t in names) + " | | | |")
    flood_teams, flood_one = (report.results[Line(with_teams=t, flooded=True).name] for t in (True, False))
    lines += ["", f"Under the flood the other teams' ratios move by at most {moved_by_flood(report, True):.3f} "
                  f"with teams, {moved_by_flood(report, False):.3f} in one queue; GPU use with teams minus one queue: "
                  f"{flood_teams.gpu_utilization - flood_one.gpu_utilization:+.3f}.", ""]
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"  # a team with no deadline job has no ratio


def plot(report: TeamsReport, path: Path) -> None:
    """Each team's ratio in the four lines, its bound on its share marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report.scenario.shares)
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(LINES)
    for i, line in enumerate(LINES):
        ratios = report.results[line.name].ratio_by_team
        ax.bar([k + i * width for k in range(len(names))], [ratios.get(t, 0.0) for t in names], width, label=line.name,
               color=f"C{i}", hatch="//" if line.flooded else None, edgecolor="white")
    for when, style in (("calm", "k_"), ("flood", "r_")):
        if when in report.bounds:
            ax.plot([k + 0.4 - width / 2 for k in range(len(names))], [report.bounds[when][t] for t in names],
                    style, markersize=40, label=f"bound on share, {when}")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(names))],
                  [f"team {t}\n({report.scenario.shares[t]} GPUs)" for t in names])
    ax.set_ylabel("deadline ratio")
    ax.set_ylim(0, 1.3)
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.set_title(f"team {report.scenario.flooder} floods {report.scenario.trace} with {report.scenario.flood} jobs",
                 fontsize=10)
    ax.legend(fontsize=8, ncol=3, loc="upper center")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
