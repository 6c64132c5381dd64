"""`elasticflow status`: the cluster's GPU map and every job's share, progress
and projected finish."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from scheduler_service.cli import app

console = Console()


@app.command()
def status(
    home: Optional[Path] = typer.Option(None, "--home", help="state folder (default: $ELASTICFLOW_HOME or ~/.elasticflow)"),
) -> None:
    """The cluster's GPU map and every job's share, progress and projected finish."""
    if home is not None:
        os.environ["ELASTICFLOW_HOME"] = str(home.expanduser().resolve())
    from scheduler_service.store.db import elasticflow_home
    from scheduler_service.worker import cluster as cluster_mod
    from scheduler_service.worker.store import ServiceStore

    cluster = cluster_mod.load()
    jobs = ServiceStore().jobs()
    holders = {int(g): job.flow_run_name or job.flow_run_id[:8]
               for job in jobs if job.status == "running" for g in job.gpus.split(",") if g}
    gpu_map = " ".join(f"[{g}:{holders.get(g, '-')}]" for g in range(cluster.topology.num_gpus))
    console.print(f"cluster: {cluster.topology.describe()} ({cluster.source})")
    console.print(f"GPUs: {gpu_map}")
    table = Table(title="jobs")
    for column in ("flow run", "model", "status", "MSS", "GPUs", "progress", "projected finish", "deadline"):
        table.add_column(column)
    control = elasticflow_home() / "control"
    for job in jobs:
        progress, finish = "", ""
        path = control / job.flow_run_id / "status.json"
        if path.exists():
            snap = json.loads(path.read_text())
            progress = f"{snap.get('iteration', 0)}/{snap.get('total_iterations', '?')}"
            finish = str(snap.get("projected_finish") or "")
        table.add_row(job.flow_run_name or job.flow_run_id, job.model, job.status,
                      "" if job.share is None else str(job.share), job.gpus, progress, finish,
                      "" if job.deadline is None else job.deadline.isoformat())
    console.print(table)
