"""`elasticflow profile`: measure a model's throughput curve and store it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from scheduler_service.cli import app
from scheduler_service.cli.hints import console as make_console

console = make_console()
errors = make_console(stderr=True)


def _gpu_counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"--gpus takes comma-separated integers, got {text!r}") from None
    if not counts or any(c < 1 or c & (c - 1) for c in counts):
        raise typer.BadParameter(f"--gpus takes powers of two (1,2,4,...), got {text!r}")
    return counts


@app.command()
def profile(
    model: str = typer.Argument(..., help="registered model name or pkg.module:factory"),
    batch_size: int = typer.Option(32, "--batch-size", "-b", min=1, help="global batch size"),
    gpus: str = typer.Option("1,2,4", "--gpus", help="GPU counts to measure, powers of two"),
    iterations: int = typer.Option(10, "--iterations", min=3, help="iterations per measurement"),
    warmup: int = typer.Option(2, "--warmup", min=0, help="iterations excluded from the rate"),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda"),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="dataset (default: synthetic for the model)"),
    export: Optional[Path] = typer.Option(None, "--export", help="also write the model's curves as CSV"),
    kind: str = typer.Option("", "--kind", help="the GPU kind measured here, as the cluster names it (e.g. T4: "
                                                "the node's elasticflow_kind or accelerator_type); runs are then "
                                                "planned with this curve on that kind only (docs/ray.md)"),
    database_url: Optional[str] = typer.Option(
        None, "--database-url", help="SQLAlchemy URL without a password (default: $ELASTICFLOW_DATABASE_URL, "
        "which may hold one, or SQLite)"
    ),
) -> None:
    """Measure iterations/s on each GPU count with short DDP runs and store the curve."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from flows.training.coordinator.profiler import profile_throughput
    from scheduler_service.cli.service import refuse_password
    from scheduler_service.store import export_csv, get_engine, save_curve

    if database_url:
        try:
            refuse_password("--database-url", make_url(database_url), "ELASTICFLOW_DATABASE_URL")
        except (ValueError, ArgumentError) as exc:
            errors.print(f"error: {exc}" if isinstance(exc, ValueError) and "password" in str(exc)
                         else "error: --database-url: not a database URL", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    counts = sorted(set(_gpu_counts(gpus)))
    curve: dict[int, float] = {}
    # One count at a time, each said on stderr as it goes: a count starts
    # len(count) processes and can take a minute, and a silent minute looks hung.
    for step, count in enumerate(counts, start=1):
        errors.print(f"[{step}/{len(counts)}] {model} on {count} GPU(s), {iterations} iterations ...", highlight=False)
        started = time.perf_counter()
        try:
            curve.update(profile_throughput(
                model, batch_size, [count], iterations=iterations, warmup=warmup, device=device, dataset=dataset
            ))
        except ValueError as exc:
            errors.print(f"error: {exc}")
            raise typer.Exit(2) from None
        errors.print(f"[{step}/{len(counts)}] {curve[count]:.3f} it/s ({time.perf_counter() - started:.1f} s)",
                     highlight=False)
    engine = get_engine(database_url)
    from flows.training.coordinator.runtime import default_device

    save_curve(model, batch_size, curve, device=default_device(device), engine=engine, kind=kind.strip())
    table = Table(title=f"{model} @ global batch {batch_size}" + (f" on {kind.strip()}" if kind.strip() else ""))
    table.add_column("GPUs", justify="right")
    table.add_column("iterations/s", justify="right")
    for count, rate in curve.items():
        table.add_row(str(count), f"{rate:.3f}")
    console.print(table)
    console.print(f"stored in {engine.url.render_as_string(hide_password=True)}")
    if export:
        console.print(f"exported {export_csv(model, export, engine)}")
