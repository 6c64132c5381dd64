"""`elasticflow simulate` and `elasticflow compare`: run policies on a trace."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from scheduler_service.cli import app
from scheduler_service.policy.registry import POLICIES
from scheduler_service.simulator.experiment import Experiment, resolve
from scheduler_service.simulator.inputs import InputError
from scheduler_service.simulator.report import results_table, write_json, write_plot

console = Console(width=None if Console().is_terminal else 110)
errors = Console(stderr=True)


def run_experiment(experiment: Experiment, policies: list[str], json_out: Path | None, plot_out: Path | None) -> None:
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
    title = f"{experiment.trace.stem} on {experiment.cluster.stem} (interval {experiment.interval:g} s)"
    console.print(results_table(results, title))
    for result in results:
        if result.note:
            console.print(f"note ({result.policy}): {result.note}", highlight=False)
    if json_out is not None:
        write_json(json_out, results)
        console.print(f"wrote {json_out}")
    if plot_out is not None:
        write_plot(plot_out, runs, results, title)
        console.print(f"wrote {plot_out}")


@app.command()
def simulate(
    trace: str = typer.Option(..., help="Trace CSV (or a name in data/traces, e.g. philly_103959)."),
    cluster: str = typer.Option(..., help="Cluster-spec CSV (or a name in data/clusters, e.g. n32g8)."),
    throughputs: str = typer.Option(..., help="Folder of MODEL.csv throughput curves (or A100 / T4)."),
    policy: list[str] = typer.Option(["elasticflow"], help=f"Policy to run; repeat for several. Known: {', '.join(POLICIES)}."),
    interval: float = typer.Option(60.0, help="Scheduling interval in seconds (the paper: 60; 240 for the 1000-job sweep)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write {'results': [...]} here."),
    plot: Optional[Path] = typer.Option(None, help="Write a PNG of GPUs in use over time and deadline ratios."),
) -> None:
    """Replay a job trace against scheduling policies and compare deadline ratios."""
    experiment = Experiment(resolve(trace, "traces"), resolve(cluster, "clusters"), resolve(throughputs, "throughputs"), interval)
    run_experiment(experiment, policy, json_out, plot)


@app.command()
def compare() -> None:
    """The paper's main comparison on the Philly-derived trace (256 A100 GPUs)."""
    console.print("ElasticFlow vs EDF on philly_103959 (876 jobs, 32 nodes x 8 A100), interval 60 s\n")
    experiment = Experiment(resolve("philly_103959", "traces"), resolve("n32g8", "clusters"), resolve("A100", "throughputs"), 60.0)
    run_experiment(experiment, ["elasticflow", "elasticflow-noadmit", "edf-admit", "edf"], None, None)
    sys.stdout.flush()
