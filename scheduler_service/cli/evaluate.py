"""`elasticflow bound` and `elasticflow reproduce`: how far from the limit, and the paper's comparison."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from scheduler_service.cli import app
from scheduler_service.cli.simulate import console, errors
from scheduler_service.simulator.experiment import resolve
from scheduler_service.simulator.inputs import InputError, load_cluster, load_throughputs, load_trace


@app.command()
def bound(
    trace: str = typer.Option(..., help="Trace CSV (or a name in data/traces)."),
    cluster: str = typer.Option(..., help="Cluster-spec CSV (or a name in data/clusters)."),
    throughputs: str = typer.Option(..., help="Folder of throughput curves (or A100 / T4)."),
    integral: bool = typer.Option(False, help="Each job met or not (a MILP): tighter where the LP counts fractions "
                                              "of large jobs; small traces only."),
    time_limit: float = typer.Option(300.0, min=1, help="--integral: seconds to search; the bound proven by then "
                                                        "is reported (still a bound)."),
) -> None:
    """Upper bound on the deadline ratio ANY scheduler can reach on this trace (LP relaxation, or --integral)."""
    from scheduler_service.simulator.bound import deadline_ratio_bound

    try:
        curves = load_throughputs(resolve(throughputs, "throughputs"))
        jobs = load_trace(resolve(trace, "traces"), curves)
        topology = load_cluster(resolve(cluster, "clusters"))
    except InputError as exc:
        errors.print(f"error: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    result = deadline_ratio_bound(jobs, topology, integral=integral, time_limit_s=time_limit if integral else None)
    kind = "MILP" if integral else "LP"
    stopped = "" if result.exact else f", stopped at {time_limit:g} s: the bound proven by then"
    console.print(
        f"{Path(trace).stem} on {topology.describe()}: no scheduler can meet more than "
        f"[bold]{result.bound:.3f}[/bold] of the {result.deadline_jobs} deadlines "
        f"({result.infeasible_alone} cannot be met even alone). {kind}: {result.variables} variables, "
        f"{result.solve_s:.2f} s{stopped}."
    )


@app.command()
def reproduce(
    out: Path = typer.Option(Path("docs/evaluation"), help="Folder for results.json, results.md and the plots."),
    quick: bool = typer.Option(False, help="A reduced comparison on two small traces (for tests and a first look)."),
    teams: bool = typer.Option(True, help="The teams scenario too: one team floods dev102, per-team ratios with "
                                          "and without teams, and each team's bound on its share (not with --quick)."),
    workers: int = typer.Option(2, min=1, help="Worker processes (the comparison is embarrassingly parallel)."),
) -> None:
    """Run every policy on the paper's traces and clusters, with the LP bound and reference figures."""
    from scheduler_service.simulator.reproduce import comparison_cases, quick_cases, run_comparison, write_report
    from scheduler_service.simulator.teams_case import TeamsScenario

    cases = quick_cases() if quick else comparison_cases()
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=errors, transient=False) as progress:
        task = progress.add_task("simulating", total=None)

        def on_progress(what: str, done: int, total: int) -> None:
            progress.update(task, total=total, completed=done, description=f"done: {what:40s}")
            if not errors.is_terminal:  # a bar is drawn only on a terminal: a log gets a line per case
                errors.print(f"[{done}/{total}] {what}", highlight=False, soft_wrap=True)

        report = run_comparison(cases, workers, on_progress,
                                teams_scenario=TeamsScenario() if teams and not quick else None)
    paths = write_report(report, out)
    console.print((out / "results.md").read_text())
    for key, h in report.headline.items():
        console.print(f"{key}: ElasticFlow {h['elasticflow']:.3f} / best baseline {h['best_baseline']} "
                      f"{h['best_baseline_ratio']:.3f} = {h['improvement']:.2f}x")
    console.print("wrote " + ", ".join(str(p) for p in paths))
