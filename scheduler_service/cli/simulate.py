"""`elasticflow simulate`, `elasticflow compare` and `elasticflow diff`: run policies
on a trace, and see job by job where one differs from a reference."""

from __future__ import annotations

import sys
from dataclasses import replace
from enum import Enum
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from scheduler_service.cli import app
from scheduler_service.policy.registry import DEFAULT_POLICY, POLICIES
from scheduler_service.simulator.experiment import Experiment, resolve
from scheduler_service.simulator.inputs import InputError
from scheduler_service.simulator.outcomes import (
    line_up, read_jobs_csv, read_reference, reference_ratio, write_jobs_csv, write_lined_up,
)
from scheduler_service.simulator.report import results_table, write_json, write_plot
from scheduler_service.simulator.metrics import PolicyResult
from scheduler_service.simulator.noise import Noise, SlowPeriods
from scheduler_service.simulator.service import Actuation
from scheduler_service.simulator.service import ServiceOptions


class ActuationName(str, Enum):
    """How the simulator carries out the policy's decisions (`--actuation`)."""

    SERVICE = "service"
    IDEAL = "ideal"
    AUTHORS = "authors"

console = Console(width=None if Console().is_terminal else 160)  # a log: room for every column
errors = Console(stderr=True)


def run_experiment(experiment: Experiment, policies: list[str], json_out: Path | None, plot_out: Path | None,
                   jobs_out: Path | None = None, show: bool = True) -> list[PolicyResult]:
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        errors.print(f"error: unknown policy {unknown[0]!r}; known: {', '.join(sorted(POLICIES))}")
        raise typer.Exit(2)
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total} arrivals"),
        TimeElapsedColumn(), console=errors, transient=True, disable=not errors.is_terminal,
    ) as progress:
        tasks: dict[str, int] = {}

        def on_progress(policy: str, done: int, total: int) -> None:
            if policy not in tasks:
                tasks[policy] = progress.add_task(policy, total=total)
            progress.update(tasks[policy], completed=done)

        try:
            runs, results = experiment.run(policies, on_progress)
        except InputError as exc:
            errors.print(f"error: {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
    if not show:
        return results
    title = f"{experiment.trace.stem} on {experiment.cluster.stem} (interval {experiment.interval:g} s)"
    console.print(results_table(results, title))
    bounds = experiment.team_bounds()
    if bounds:
        console.print("LP bound of each team's jobs alone on its share: "
                      + ", ".join(f"{team} {bound:.3f}" for team, bound in bounds.items()), highlight=False)
    for result in results:
        if result.note:
            console.print(f"note ({result.policy}): {result.note}", highlight=False)
    if json_out is not None:
        write_json(json_out, results)
        console.print(f"wrote {json_out}")
    if plot_out is not None:
        write_plot(plot_out, runs, results, title)
        console.print(f"wrote {plot_out}")
    if jobs_out is not None:
        write_jobs_csv(jobs_out, runs)
        console.print(f"wrote {jobs_out}")
    return results


@app.command()
def simulate(
    trace: str = typer.Option(..., help="Trace CSV (or a name in data/traces, e.g. philly_103959)."),
    cluster: str = typer.Option(..., help="Cluster-spec CSV (or a name in data/clusters, e.g. n32g8)."),
    throughputs: str = typer.Option(..., help="Folder of MODEL.csv throughput curves (or A100 / T4)."),
    policy: list[str] = typer.Option(
        [DEFAULT_POLICY], help=f"Policy to run; repeat for several (default: the service's, {DEFAULT_POLICY}). "
                               f"Known: {', '.join(POLICIES)}."),
    interval: float = typer.Option(60.0, help="Scheduling interval in seconds (the paper: 60; 240 for the 1000-job sweep)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write {'results': [...]} here."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG of GPUs in use over time and deadline ratios."),
    jobs_csv: Optional[Path] = typer.Option(
        None, "--jobs-csv", help="Write one row per job and policy: decision, reason, MSS, start, finish, met."),
    actuation: list[ActuationName] = typer.Option(
        ["service"], help="service: the service's own control loop, with a simulated backend (what the service "
                          "would do); ideal: the bare policy with an idealised restart; authors: the bare "
                          "policy with restarts free, counted as the authors' simulator counts. Repeatable."),
    safety_margin: Optional[float] = typer.Option(
        None, min=0, max=0.49, help="service: room kept in front of each deadline, a fraction of its window "
                                     "(default: the service's own, ELASTICFLOW_SAFETY_MARGIN)"),
    launch_s: Optional[float] = typer.Option(
        None, min=0, help="service: a new run's start, launch to first iteration (default: learnt from the "
                          "starts it sees, as the service does)"),
    in_place_s: Optional[float] = typer.Option(
        None, "--in-place-s", min=0, help="service: a resize that keeps some GPUs is made in place and costs this "
                                           "instead of the restart's 27 s (the stop and the 2 s per level stay); "
                                           "default: every resize costs a restart"),
    noise: float = typer.Option(0.0, min=0, max=2, help="service: each run trains at its curve's speed times a "
                                "factor of its own, lognormal with this sigma (faster or slower); with any noise, "
                                "the noiseless run of the same trace is printed beside it"),
    jitter: float = typer.Option(0.0, min=0, max=2, help="service: and a factor drawn anew at each start on a "
                                 "GPU set (lognormal sigma)"),
    start_noise: float = typer.Option(0.0, min=0, max=2, help="service: starts and restarts take their modelled "
                                      "time times a lognormal factor of this sigma"),
    slow_periods: bool = typer.Option(False, help="service: now and then half of a node's GPUs run at half "
                                      "speed for a while (every 6 h a node, 30 min, on average)"),
    seed: int = typer.Option(0, help="service: the noise's seed"),
    teams: Optional[Path] = typer.Option(
        None, help="Teams file (YAML, infra/teams.yaml's shape): each job is admitted on the share of the team "
                   "its trace row names (a `team` column), and unused shares are lent (docs/scheduling.md); "
                   "each policy runs in one queue too, and each team's LP bound on its share is shown."),
) -> None:
    """Replay a job trace against scheduling policies and compare deadline ratios."""
    noisy = Noise(seed=seed, speed_sigma=noise, jitter_sigma=jitter, start_sigma=start_noise,
                  slow=SlowPeriods() if slow_periods else None)
    service = ServiceOptions(launch_s=launch_s, in_place_s=in_place_s, actuation=Actuation(noise=noisy),
                             **({} if safety_margin is None else {"safety_margin": safety_margin}))
    experiment = Experiment(resolve(trace, "traces"), resolve(cluster, "clusters"), resolve(throughputs, "throughputs"),
                            interval, actuations=tuple(a.value for a in actuation), service=service, teams=teams)
    results = run_experiment(experiment, policy, json_out, plot, jobs_csv)
    if not noisy.quiet and results:
        quiet = replace(experiment, service=service.model_copy(update={"actuation": Actuation()}))
        print_beside_noiseless(results, run_experiment(quiet, policy, None, None, None, show=False), noisy)


def print_beside_noiseless(noisy: list[PolicyResult], quiet: list[PolicyResult], noise: Noise) -> None:
    """Each noisy result beside the same policy's on the exact cluster: what the noise cost."""
    said = noise.model_dump(exclude_defaults=True)
    console.print(f"under noise {said}:", highlight=False)
    for mine, exact in zip(noisy, quiet):
        if mine.actuation != "service":
            continue  # the bare policy plays no noise
        share = mine.admitted_missed / max(mine.admitted_deadline, 1)
        console.print(f"  {mine.policy}: deadline ratio {mine.deadline_ratio:.3f} (noiseless "
                      f"{exact.deadline_ratio:.3f}, {mine.deadline_ratio - exact.deadline_ratio:+.3f}); admitted "
                      f"missed {mine.admitted_missed} of {mine.admitted_deadline} admitted deadline jobs "
                      f"({100 * share:.1f}%; noiseless {exact.admitted_missed})", highlight=False)


@app.command()
def compare() -> None:
    """The paper's main comparison on the Philly-derived trace (256 A100 GPUs)."""
    console.print("ElasticFlow vs EDF on philly_103959 (876 jobs, 32 nodes x 8 A100), interval 60 s\n")
    experiment = Experiment(resolve("philly_103959", "traces"), resolve("n32g8", "clusters"), resolve("A100", "throughputs"), 60.0)
    run_experiment(experiment, ["elasticflow", "elasticflow-noadmit", "edf-admit", "edf"], None, None)
    sys.stdout.flush()


@app.command()
def diff(
    ours: Path = typer.Argument(..., help="Per-job CSV from `elasticflow simulate --jobs-csv`."),
    reference: Path = typer.Argument(..., help="Reference per-job CSV (job_id, decision, met), e.g. "
                                               "data/reference/outcomes/dev102_n8g8.csv, or another --jobs-csv file."),
    policy: Optional[str] = typer.Option(None, help="Which policy of OURS (default: the first in the file)."),
    reference_policy: Optional[str] = typer.Option(
        None, help="When REFERENCE is a --jobs-csv file too: which of its policies (default: the first)."),
    out: Optional[Path] = typer.Option(None, help="Write every deadline job lined up, with its verdict, as CSV."),
    show: int = typer.Option(10, min=0, help="Jobs to list for each side that only one of them met."),
) -> None:
    """Which deadline jobs one policy met and the reference did not, and why."""
    try:
        name, mine = read_jobs_csv(ours, policy)
        ref = read_reference(reference, reference_policy)
        comparison = line_up(name, mine, ref, str(reference))
    except InputError as exc:
        errors.print(f"error: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    n = comparison.deadline_jobs
    ours_met = comparison.count("both met") + comparison.count("only ours met")
    console.print(f"{name}: {ours_met}/{n} met ({ours_met / max(n, 1):.3f}); reference: "
                  f"{reference_ratio(ref) * n:.0f}/{n} ({reference_ratio(ref):.3f})", highlight=False)
    table = Table(title=f"{ours.name} vs {reference.name}, deadline jobs")
    for column in ("", "reference met", "reference missed"):
        table.add_column(column, justify="right")
    table.add_row(f"{name} met", str(comparison.count("both met")), str(comparison.count("only ours met")))
    table.add_row(f"{name} missed", str(comparison.count("only the reference met")), str(comparison.count("neither met")))
    console.print(table)
    why = ", ".join(f"{k} {v}" for k, v in comparison.why_only_reference().most_common())
    console.print(f"met only by the reference; ours: {why or '-'}", highlight=False)
    why = ", ".join(f"{k} {v}" for k, v in comparison.why_only_ours().most_common())
    console.print(f"met only by {name}; the reference: {why or '-'}", highlight=False)
    for verdict in ("only the reference met", "only ours met"):
        pairs = comparison.rows[verdict][:show]
        if not pairs:
            continue
        jobs = Table(title=f"{verdict} (first {len(pairs)} of {comparison.count(verdict)})")
        for column in ("job", "submit s", "window s", "model/batch", "ours", "MSS", "start s", "finish s", "reference"):
            jobs.add_column(column, no_wrap=column != "ours")
        for mine_row, ref_row in pairs:
            window = float(mine_row["deadline"]) - float(mine_row["submit_time"]) if mine_row["deadline"] else None
            decision = mine_row["decision"] + (f": {mine_row['reason']}" if mine_row["reason"] else "")
            if mine_row["decision"] == "admitted":
                decision += ", met" if mine_row["met"] == "1" else ", late"
            ref_said = ref_row["decision"] + (", met" if ref_row["met"] == "1" else ", missed")
            jobs.add_row(mine_row["job_id"], mine_row["submit_time"], "-" if window is None else f"{window:.0f}",
                         f"{mine_row['model']}/{mine_row['batch_size']}", decision, mine_row["mss"],
                         mine_row["start"], mine_row["finish"], ref_said)
        console.print(jobs)
    if out is not None:
        write_lined_up(out, comparison)
        console.print(f"wrote {out}")
