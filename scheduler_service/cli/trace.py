"""`elasticflow trace`: draw a job trace with the paper's statistics.

Options are read as text and checked by the generator, so a bad one exits
with status 2 and one line naming it (click's own type errors print a usage
block instead).
"""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from scheduler_service.cli import app
from scheduler_service.cli.simulate import errors
from scheduler_service.simulator.experiment import resolve
from scheduler_service.simulator.inputs import InputError, load_throughputs
from scheduler_service.simulator.report import write_atomically
from scheduler_service.simulator.tracegen import OptionError, generate, offered_load, parse_spec, trace_csv


@app.command()
def trace(
    out: str = typer.Option("-", help="CSV to write (- for standard output)."),
    jobs: str = typer.Option("500", help="Number of jobs."),
    mean_gap: str = typer.Option("500", help="Mean gap between Poisson arrivals, seconds."),
    gpu_mix: str = typer.Option("1:0.83,2:0.03,4:0.03,8:0.10,16:0.01",
                                help="Requested GPU counts COUNT:WEIGHT,... (halved until the model has a throughput there)."),
    duration_mix: str = typer.Option("0.8:1:2.5,0.2:2.5:4",
                                     help="Duration modes WEIGHT:LO:HI,...: 60 x 10^U(LO,HI) s at the requested count."),
    deadline_factor: str = typer.Option("0.5,1.5", help="LO,HI: deadline = submit + U(LO,HI) x duration."),
    best_effort: str = typer.Option("0", help="Share of jobs without a deadline, 0 to 1."),
    throughputs: str = typer.Option("A100", help="Folder of MODEL.csv curves to draw models and batch sizes from."),
    models: str = typer.Option("", help="Comma-separated models to draw from (default: every model in the folder)."),
    seed: str = typer.Option("0", help="Random seed: the same options and seed give the same trace."),
    sweep: str = typer.Option("1", help="Each arrival a sweep of 1..SWEEP jobs submitted together (one model, "
                                        "batch and count; durations and deadlines their own). 1: single jobs."),
    gpus: str = typer.Option("", help="Optional cluster size in GPUs, to print the offered load on it."),
) -> None:
    """Write a job trace (the paper's CSV columns) drawn with the paper's statistics."""
    try:
        spec = parse_spec(jobs, mean_gap, gpu_mix, duration_mix, deadline_factor, best_effort, models, seed, sweep)
        try:
            curves = load_throughputs(resolve(throughputs, "throughputs"))
        except InputError as exc:
            raise OptionError("--throughputs", str(exc)) from None
        capacity = None
        if gpus:
            try:
                capacity = int(gpus)
            except ValueError:
                raise OptionError("--gpus", f"not an integer: {gpus!r}") from None
            if capacity < 1:
                raise OptionError("--gpus", "at least one GPU")
        rows = generate(spec, curves)
    except OptionError as exc:
        errors.print(f"error: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    text = trace_csv(rows)
    if out == "-":
        sys.stdout.write(text)
    else:
        write_atomically(Path(out), text.encode())
    deadline = sum(1 for r in rows if not r["best_effort"])
    summary = (f"{len(rows)} jobs ({deadline} with deadlines) over {float(rows[-1]['submit_time']) / 3600:.1f} h, "
               f"seed {spec.seed}")
    if capacity:
        summary += f"; offered load on {capacity} GPUs at the requested counts: {offered_load(rows, capacity):.2f}"
    errors.print(summary + ("" if out == "-" else f"; wrote {out}"), highlight=False, soft_wrap=True)
