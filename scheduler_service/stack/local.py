"""The local stack as one context manager: a Prefect server on 127.0.0.1 with
SQLite under the home folder (or the PostgreSQL database it is given), the
`gpus` work pool, the deployments, and the ElasticFlow worker, each a child
process with its log under `<home>/logs`; with `ray`, the worker schedules a
Ray cluster (one it is given, or a loopback one started here first).

Its API asks every client for the stack's secret (secret.py).

`elasticflow up` holds it open in the foreground and restarts the server or
the worker when one exits (`supervisor.py`); `elasticflow demo` drives it.
Leaving the context stops what the stack started, flow processes included, in
order: the worker first, then the flow processes still running (they
checkpoint on SIGTERM), then the server. "What the stack started" is what it
recorded (`groups.py`), never what merely looks like it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

from flows.training.launch.identity import RANK_USER_ENV
from flows.training.orders import free_port  # noqa: F401  # the stack's ports: callers import it from here
from flows.training.launch.pause import clear_stopping, mark_stopping
from flows.training.ray_nodes import RAY_ADDRESS_ENV, RAY_LOOPBACK_ENV
from scheduler_service.stack import secret
from scheduler_service.stack.groups import Group, groups_of, start_time, stop_groups
from scheduler_service.stack.supervisor import PRIVATE_UMASK, Supervised

POOL = "gpus"
# ~10 s on an idle machine; on two cores shared by several stacks, 90 s was passed (and `up` gave up)
SERVER_START_S = 240.0
PAUSE_GRACE_S = 40.0  # a stop: each run's ranks checkpoint (up to 30 s) and it tells Prefect it paused


@dataclass(frozen=True)
class LocalStack:
    home: Path
    api_url: str
    ui_url: str
    logs: Path
    deployments: dict[str, str]
    server: Supervised
    worker: Supervised
    ray_cluster: Supervised | None = None  # `--ray local:NxG`
    client_env: Path | None = None  # the settings a user's client needs (secret.py)

    def supervise(self) -> list[str]:
        """Restart the server or the worker if it exited (after its backoff);
        a line for the operator about each exit and restart (and the local
        Ray cluster's exit: its runs fail over to a clear state, see docs/ray.md)."""
        checks = [self.server.check(), self.worker.check(), self.ray_cluster.check() if self.ray_cluster else None]
        return [line for line in checks if line]


def stack_env(home: Path, port: int) -> dict[str, str]:
    return {
        "ELASTICFLOW_HOME": str(home),
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # Prefect's default profile lets a client with no API URL start a
        # temporary server of its own and talk to it, silently: nothing the
        # stack starts may, so a missing URL fails loudly instead.
        "PREFECT_SERVER_EPHEMERAL_ENABLED": "false",
    }


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float = 90.0) -> None:
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


def stop_process(process: subprocess.Popen[bytes] | None, grace_s: float = 8.0) -> None:
    """Stop a process this caller started in a session of its own: SIGINT,
    then SIGTERM, then SIGKILL to its group (what it started in it too),
    each only while that group is still the one it started."""
    if process is None:
        return
    group = Group(process.pid, start_time(process.pid) or 0, "process")
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 5.0)):
        if not group.signal(sig):
            break
        try:
            process.wait(timeout=wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
    stop_groups([group], grace_s=0.0, first=signal.SIGKILL)  # and children that outlived the leader
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def stop_processes_of(home: Path, grace_s: float = 10.0, keep: tuple[int, ...] = ()) -> None:
    """Stop the process groups started for the stack at `home` that are still
    alive (flow runs, fork servers: they run in sessions of their own, out of
    reach of a signal to the worker's group), all but those led by `keep`.
    SIGTERM first (training checkpoints on it), SIGKILL after `grace_s`.
    Only recorded groups (`groups.py`): never a process chosen by its environment."""
    stop_groups([g for g in groups_of(home) if g.pgid not in keep], grace_s)


def database_url(url: str) -> str:
    """Prefect's server talks to PostgreSQL through asyncpg: `postgresql://...`
    as an operator writes it, with the driver Prefect needs."""
    for plain in ("postgresql://", "postgres://", "postgresql+psycopg://", "postgresql+psycopg2://"):
        if url.startswith(plain):
            return "postgresql+asyncpg://" + url[len(plain):]
    return url


@contextmanager
def local_stack(home: Path, port: int, env: dict[str, str] | None = None,
                models: tuple[str, ...] | None = None, schedules: bool = True,
                database: str | None = None, ray: str | None = None,
                rank_user: str | None = None) -> Iterator[LocalStack]:
    """Start the stack; `env` adds settings for the worker (e.g. the slot length);
    `schedules=False` deploys `pipeline/daily` with its schedule paused;
    `database` is the Prefect server's database URL (PostgreSQL), given to the
    server alone; `rank_user`, the account the ranks run as (rank_account.py;
    None: ELASTICFLOW_RANK_USER as the environment has it). The calling
    process gets PREFECT_API_URL etc. too, so it can submit runs."""
    import asyncio

    import prefect.context
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_URL,
        PREFECT_SERVER_EPHEMERAL_ENABLED,
        temporary_settings,
    )

    from scheduler_service.stack.deployments import MODELS, deploy, deploy_pipeline, ensure_pool

    umask = os.umask(PRIVATE_UMASK)  # the deploy log, the store's first tables...: private, as the children's
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    home.chmod(0o700)
    auth = secret.api_auth_string(home)
    # Every client of the stack (the worker, its flow processes, this process)
    # authenticates; the server alone checks.
    settings = {**stack_env(home, port), secret.CLIENT_AUTH_ENV: auth, **(env or {})}
    if rank_user is not None:
        settings[RANK_USER_ENV] = rank_user
    os.environ.update(settings)
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True, mode=0o700)
    server_env = {**settings, secret.SERVER_AUTH_ENV: auth}
    if database:
        server_env["PREFECT_API_DATABASE_CONNECTION_URL"] = database_url(database)
    ray_cluster = _ray_cluster(ray, settings, home, logs)
    server = Supervised("server", ["server", "start", "--host", "127.0.0.1", "--port", str(port)], server_env,
                        logs / "server.log", home)
    worker = Supervised("worker", ["worker", "start", "--pool", POOL], settings, logs / "worker.log", home)
    clear_stopping(home)  # runs of this life end as they end, until this stack stops
    try:
        server.start()
        assert server.process is not None
        wait_healthy(settings["PREFECT_API_URL"], server.process, timeout_s=SERVER_START_S)
        # This process's Prefect settings may predate the environment set above: for
        # as long as the stack runs, its clients (the demo's submissions) talk to
        # the stack's server; without this, the demo started a temporary one.
        with temporary_settings(updates={PREFECT_API_URL: settings["PREFECT_API_URL"],
                                         PREFECT_API_AUTH_STRING: auth, PREFECT_SERVER_EPHEMERAL_ENABLED: False}), \
                prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()):
            # (and for threads that start from the process-wide context, as Prefect's test harness does)
            asyncio.run(ensure_pool(POOL))
            worker.start()  # boots meanwhile
            with open(logs / "deploy.log", "a") as log, redirect_stdout(log):  # Prefect prints a table per deploy
                deployed = deploy(POOL, models or MODELS)
                deployed["pipeline/daily"] = deploy_pipeline(POOL, paused=not schedules)
            client_env = secret.client_env_file(home, settings["PREFECT_API_URL"], auth)
            yield LocalStack(home, settings["PREFECT_API_URL"], f"http://127.0.0.1:{port}", logs, deployed,
                             server, worker, ray_cluster, client_env)
    finally:
        mark_stopping(home)  # a stop is a pause: every run checkpoints and waits for the next start (pause.py)
        # Not Prefect's graceful shutdown: it kills the flow processes it launched (their boot relays
        # SIGKILLed at once, and each warm flow process with its relay), and a stop is a pause. What the
        # worker had not told Prefect yet, the next start's recovery settles from the store, as after a crash.
        worker.stop(interrupt=False)
        # flow runs still going: they checkpoint and stop, paused
        stop_processes_of(home, grace_s=PAUSE_GRACE_S,
                          keep=tuple(p.process.pid for p in (server, ray_cluster) if p and p.process))
        server.stop(grace_s=8.0)
        if ray_cluster is not None:
            ray_cluster.stop(grace_s=15.0)
        if ray:  # the calling process's own later runs are not on a cluster that is gone
            os.environ.pop(RAY_ADDRESS_ENV, None)
        os.umask(umask)


def _ray_cluster(ray: str | None, settings: dict[str, str], home: Path, logs: Path) -> Supervised | None:
    """`--ray ADDRESS`: the worker schedules that cluster. `--ray local:NxG`:
    a loopback cluster of N nodes x G slots started here, stopped with the stack."""
    from scheduler_service.stack.ray_local import LOCAL_PREFIX, parse_local

    if not ray:
        return None
    if not ray.startswith(LOCAL_PREFIX):
        settings[RAY_ADDRESS_ENV] = ray
        os.environ.update(settings)
        return None
    parse_local(ray)  # a bad spec fails here, before anything starts
    address_file = home / "ray-address"
    address_file.unlink(missing_ok=True)
    # Rank actors run users' code in processes the Ray nodes start: not with the API's secret.
    unset = (secret.CLIENT_AUTH_ENV, secret.SERVER_AUTH_ENV)
    cluster = Supervised("local Ray cluster", [ray, str(address_file)],
                         {k: v for k, v in {**settings, RAY_LOOPBACK_ENV: "0"}.items() if k not in unset},
                         logs / "ray.log", home, module="scheduler_service.stack.ray_local", restart=False,
                         unset=unset)
    cluster.start()
    assert cluster.process is not None
    give_up = time.monotonic() + 180
    while not address_file.exists():
        if cluster.process.poll() is not None or time.monotonic() > give_up:
            cluster.stop()
            raise RuntimeError(f"the local Ray cluster did not start (log {logs / 'ray.log'})")
        time.sleep(0.2)
    settings.update({RAY_ADDRESS_ENV: address_file.read_text().strip(), RAY_LOOPBACK_ENV: "0"})
    os.environ.update(settings)
    return cluster
