"""The local stack as one context manager: a Prefect server on 127.0.0.1 with
SQLite under the home folder, the `gpus` work pool, the deployments, and the
ElasticFlow worker, each a child process with its log under `<home>/logs`.

`elasticflow up` holds it open in the foreground; `elasticflow demo` drives
it. Leaving the context stops everything, flow processes included, in order:
the worker first, then the flow processes still running (they checkpoint on
SIGTERM), then the server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

POOL = "gpus"


@dataclass(frozen=True)
class LocalStack:
    home: Path
    api_url: str
    ui_url: str
    logs: Path
    deployments: dict[str, str]
    server: subprocess.Popen[bytes]
    worker: subprocess.Popen[bytes]

    def check(self) -> None:
        """Raise if the server or the worker has exited."""
        for process, name in ((self.server, "server"), (self.worker, "worker")):
            if process.poll() is not None:
                raise RuntimeError(f"the {name} exited with status {process.returncode}; see {self.logs}")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stack_env(home: Path, port: int) -> dict[str, str]:
    return {
        "ELASTICFLOW_HOME": str(home),
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
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


def _default_signals() -> None:
    """In the child: Ctrl-C and SIGTERM act, even if our parent ignored them."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "prefect", *args], env={**os.environ, **env}, stdout=open(log, "ab"),
        stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_default_signals,
    )


def stop_process(process: subprocess.Popen[bytes] | None) -> None:
    """SIGINT, then SIGTERM to the process group (the worker's flow runs too),
    then SIGKILL if it does not go."""
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


def stop_processes_of(home: Path, grace_s: float = 10.0) -> None:
    """Stop every process started for the stack at `home` that is still alive.
    Flow processes run in their own sessions (so a crashed worker does not take
    them along), out of reach of a signal to the worker's group; they all carry
    ELASTICFLOW_HOME=<home>. SIGTERM first (training checkpoints on it), then
    SIGKILL after `grace_s`."""
    marker = f"ELASTICFLOW_HOME={home}".encode()

    def alive() -> list[int]:
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if marker in (proc / "environ").read_bytes().split(b"\0"):
                    found.append(int(proc.name))
            except OSError:
                continue
        return found

    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        pids = alive()
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.time() + wait_s
        while time.time() < end and alive():
            time.sleep(0.2)


@contextmanager
def local_stack(home: Path, port: int, env: dict[str, str] | None = None,
                models: tuple[str, ...] | None = None, schedules: bool = True) -> Iterator[LocalStack]:
    """Start the stack; `env` adds settings for the worker (e.g. the slot length);
    `schedules=False` deploys `pipeline/daily` with its schedule paused. The
    calling process gets PREFECT_API_URL etc. too, so it can submit runs."""
    import asyncio

    from scheduler_service.stack.deployments import MODELS, deploy, deploy_pipeline, ensure_pool

    settings = {**stack_env(home, port), **(env or {})}
    os.environ.update(settings)
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    server = worker = None
    try:
        server = _spawn(["server", "start", "--host", "127.0.0.1", "--port", str(port)], settings,
                        logs / "server.log")
        wait_healthy(settings["PREFECT_API_URL"], server)
        asyncio.run(ensure_pool(POOL))
        worker = _spawn(["worker", "start", "--pool", POOL], settings, logs / "worker.log")  # boots meanwhile
        with open(logs / "deploy.log", "a") as log, redirect_stdout(log):  # Prefect prints a table per deploy
            deployed = deploy(POOL, models or MODELS)
            deployed["pipeline/daily"] = deploy_pipeline(POOL, paused=not schedules)
        yield LocalStack(home, settings["PREFECT_API_URL"], f"http://127.0.0.1:{port}", logs, deployed,
                         server, worker)
    finally:
        stop_process(worker)
        stop_processes_of(home)  # flow runs still going: they checkpoint and stop
        stop_process(server)

