"""One simulation experiment: inputs by path, every policy on the same jobs."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Sequence

from scheduler_service.policy import Job
from scheduler_service.policy.overhead import NO_OVERHEAD, PAPER_OVERHEAD
from scheduler_service.policy.registry import make_policy
from scheduler_service.simulator.engine import Run, simulate
from scheduler_service.inputfiles import cluster_speeds, load_teams
from scheduler_service.policy.kinds import KindOrder
from scheduler_service.policy.teams import Team
from scheduler_service.policy.topology import AnyTopology, MixedTopology
from scheduler_service.simulator.inputs import (
    InputError, curves_for_trace, is_folder_of_kinds, load_cluster, load_kind_throughputs, load_throughputs,
    load_trace, on_kinds,
)
from scheduler_service.simulator.metrics import Actuation, PolicyResult, summarize
from scheduler_service.simulator.options import policy_options
from scheduler_service.simulator.service import ServiceOptions, simulate_service


def data_dir() -> Path:
    """The project's copy of the paper's public data (ELASTICFLOW_DATA overrides)."""
    env = os.environ.get("ELASTICFLOW_DATA")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "data"


def resolve(path: str | Path, kind: str) -> Path:
    """A path as given, or else a name inside the project's data folder
    (`philly_103959`, `itp/cluster10`, `n32g8`, `A100`)."""
    given = Path(path)
    if given.exists():
        return given
    folder = data_dir() / kind
    for candidate in (folder / given, folder / f"{given}.csv"):
        if candidate.exists():
            return candidate
    return given  # let the loader report it, naming what was asked for


def load_jobs(trace: Path, cluster: Path, throughputs: Path) -> tuple[list[Job], AnyTopology, str | None]:
    """The trace's jobs on the cluster, and a note on curves that were derived
    (a mixed cluster: one folder of curves per kind, `--throughputs data/throughputs`)."""
    topology = load_cluster(cluster)
    kinds = is_folder_of_kinds(throughputs)
    if not isinstance(topology, MixedTopology):
        if kinds:
            raise InputError(throughputs, None, None, "a folder of GPU kinds needs a mixed cluster file (a gpu_kind "
                                                      "column, one row per kind); give one kind's folder, e.g. "
                                                      f"{Path(throughputs) / 'A100'}")
        return load_trace(trace, load_throughputs(throughputs)), topology, None
    if not kinds:
        raise InputError(throughputs, None, None, f"a mixed cluster ({', '.join(topology.kinds)}) needs a folder "
                                                  "with one folder of curves per kind (e.g. data/throughputs)")
    by_kind = load_kind_throughputs(throughputs)
    missing = [k for k in topology.kinds if k not in by_kind]
    if missing:
        raise InputError(throughputs, None, None, f"no curves for GPU kind {missing[0]} (found: {', '.join(by_kind)})")
    jobs, derived = on_kinds(load_trace(trace, curves_for_trace(by_kind, topology)), by_kind, topology,
                             cluster_speeds(cluster))
    said = [f"{n} on {kind}" for kind, n in derived.items() if n]
    note = (f"curves scaled by the cluster file's relative_speed for jobs whose model was not measured there: "
            f"{', '.join(said)}") if said else None
    return jobs, topology, note


def simulate_policy(jobs: Sequence[Job], topology: AnyTopology, name: str, interval: float, throughputs: Path,
                    actuation: Actuation, service: ServiceOptions | None = None,
                    on_progress: Callable[[int, int], None] | None = None,
                    kind_moves: bool = False, teams: Sequence[Team] = (),
                    kind_order: KindOrder = KindOrder.SLOWEST_FIRST) -> tuple[Run, str | None]:
    """One policy over the jobs, through the service's loop or bare; and
    what the policy wants readers to know (a fallback it used)."""
    options: dict[str, object] = dict(policy_options(name, throughputs))
    if isinstance(topology, MixedTopology):
        options["kind_moves"], options["kind_order"] = kind_moves, kind_order
    if teams:
        options["teams"] = tuple(teams)
    if actuation in ("ideal", "authors"):
        overhead = PAPER_OVERHEAD if actuation == "ideal" else NO_OVERHEAD
        policy = make_policy(name, topology, interval, overhead=overhead, **options)
        return simulate(jobs, policy, on_progress), getattr(policy, "note", None) or None
    service = service or ServiceOptions()
    settings = service.loop(name, interval)
    policy = make_policy(name, topology, interval, overhead=settings.charged, **options)
    # The cluster of a trace never changes: the loop plans with this very policy.
    run = simulate_service(jobs, topology, settings, service.actuation, lambda _: policy, on_progress)
    return run, getattr(policy, "note", None) or None


@dataclass
class Experiment:
    """Policies on one trace and cluster: through the service's control loop
    (`service`, what the service would do) or as the bare policy (`ideal`)."""

    trace: Path
    cluster: Path
    throughputs: Path
    interval: float = 60.0
    actuations: Sequence[Actuation] = ("service",)
    service: ServiceOptions = field(default_factory=ServiceOptions)
    teams: Path | None = None  # a teams file: each trace row's `team` is admitted on its share

    def run(
        self, policies: Sequence[str], on_progress: Callable[[str, int, int], None] | None = None
    ) -> tuple[list[Run], list[PolicyResult]]:
        if self.interval <= 0:
            raise InputError("--interval", None, None, "the scheduling interval must be positive")
        jobs, topology, derived = load_jobs(self.trace, self.cluster, self.throughputs)
        teams = load_teams(self.teams) if self.teams is not None else ()
        runs, results = [], []
        for name in policies:
            for actuation in self.actuations:
                for grouped in (teams, ()) if teams else ((),):  # with teams: one queue beside it
                    label = name if len(self.actuations) == 1 else f"{name} ({actuation})"
                    label += " (one queue)" if teams and not grouped else ""
                    progress = (None if on_progress is None
                                else (lambda done, total, n=label: on_progress(n, done, total)))
                    try:
                        run, note = simulate_policy(jobs, topology, name, self.interval, self.throughputs, actuation,
                                                    self.service, progress, teams=grouped)
                    except ValueError as exc:  # a teams file that does not fit the cluster
                        if not grouped:
                            raise
                        raise InputError(self.teams or "", None, None, str(exc)) from None
                    if teams and not grouped:  # its own name in the table, the jobs CSV and the plot
                        run = replace(run, policy=f"{name} (one queue)")
                    runs.append(run)
                    result = summarize(run, self.trace.stem, self.cluster.stem, self.interval, actuation)
                    note = "; ".join(n for n in (note, derived) if n) or None
                    results.append(result.model_copy(update={"note": note, "one_queue": bool(teams) and not grouped}))
        return runs, results

    def team_bounds(self) -> dict[str, float]:
        """Each team's LP bound: its jobs alone on a cluster the size of its share."""
        from scheduler_service.policy.topology import Topology
        from scheduler_service.simulator.bound import deadline_ratio_bound

        if self.teams is None:
            return {}
        jobs, _, _ = load_jobs(self.trace, self.cluster, self.throughputs)
        return {t.name: deadline_ratio_bound([j for j in jobs if j.team == t.name], Topology(1, t.share, 1)).bound
                for t in load_teams(self.teams)}
