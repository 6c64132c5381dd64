"""`elasticflow up` (the local stack in the foreground) and `elasticflow status`
(the cluster's GPU map and every job's share, progress and projected finish)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from scheduler_service.cli import app

console = Console()
errors = Console(stderr=True)
POOL = "gpus"


def _home(home: Optional[Path]) -> Path:
    chosen = home or Path(os.environ.get("ELASTICFLOW_HOME") or Path.home() / ".elasticflow")
    chosen = chosen.expanduser().resolve()
    chosen.mkdir(parents=True, exist_ok=True)
    return chosen


def _stack_env(home: Path, port: int) -> dict[str, str]:
    return {
        "ELASTICFLOW_HOME": str(home),
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    }


def _wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float = 90.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the Prefect server did not answer at {url} within {timeout_s:.0f} s")


def _default_signals() -> None:
    """In the child: Ctrl-C and SIGTERM act, even if our parent ignored them."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "prefect", *args], env={**os.environ, **env}, stdout=open(log, "ab"),
        stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_default_signals,
    )


def _stop(process: subprocess.Popen[bytes] | None, name: str) -> None:
    """SIGINT, then SIGTERM to the process group (the worker's flow runs too),
    then SIGKILL by PID group if it does not go."""
    if process is None:
        return
    for sig, wait_s in ((signal.SIGINT, 8.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # children that outlived the leader
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    console.print(f"stopped {name}")


@app.command()
def up(
    port: int = typer.Option(4200, "--port", help="port of the local Prefect server (bound to 127.0.0.1)"),
    home: Optional[Path] = typer.Option(None, "--home", help="state folder (default: $ELASTICFLOW_HOME or ~/.elasticflow)"),
) -> None:
    """Run the local stack in the foreground: Prefect server (SQLite), the `gpus`
    work pool, deployments train/<model>, the ElasticFlow worker. Ctrl-C stops it."""
    home = _home(home)
    env = _stack_env(home, port)
    os.environ.update(env)
    logs = home / "logs"
    logs.mkdir(exist_ok=True)
    server = worker = None
    stopping = False

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        console.print(f"starting Prefect server on 127.0.0.1:{port} (home {home})")
        server = _spawn(["server", "start", "--host", "127.0.0.1", "--port", str(port)], env, logs / "server.log")
        _wait_healthy(env["PREFECT_API_URL"], server)
        import asyncio

        from scheduler_service.service.deployments import MODELS, deploy, ensure_pool

        asyncio.run(ensure_pool(POOL))
        deployed = deploy(POOL, MODELS)
        console.print(f"work pool {POOL!r} (type elasticflow); deployments: {', '.join(deployed)}")
        worker = _spawn(["worker", "start", "--pool", POOL], env, logs / "worker.log")
        console.print(
            f"ElasticFlow worker started (log {logs / 'worker.log'}). UI: http://127.0.0.1:{port}\n"
            f"  PREFECT_API_URL={env['PREFECT_API_URL']} prefect deployment run train/mlp "
            "--param iterations=200 --param deadline=+10m\n"
            "Ctrl-C stops everything."
        )
        while True:
            for process, name in ((server, "server"), (worker, "worker")):
                if process.poll() is not None:
                    raise RuntimeError(f"the {name} exited with status {process.returncode}; see {logs}")
            time.sleep(1.0)
    except KeyboardInterrupt:
        stopping = True
    except RuntimeError as exc:
        errors.print(f"error: {exc}")
    finally:
        _stop(worker, "worker")
        _stop(server, "server")
    if not stopping:
        raise typer.Exit(1)


@app.command()
def status(
    home: Optional[Path] = typer.Option(None, "--home", help="state folder (default: $ELASTICFLOW_HOME or ~/.elasticflow)"),
) -> None:
    """The cluster's GPU map and every job's share, progress and projected finish."""
    if home is not None:
        os.environ["ELASTICFLOW_HOME"] = str(_home(home))
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
