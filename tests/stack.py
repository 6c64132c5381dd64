"""The one way the suite runs Prefect: `prefect_server` starts a real
`prefect server start` (UI optional), and `stack_on` adds to one an
`elasticflow` work pool with the `train/mlp` deployment and the worker started
by `prefect worker start` as a separate process, as a user would run them.

Fixtures, registered in tests/conftest.py: `prefect_api` (the server, for
tests that only need one) and `stack` (the pool, deployment and worker on that
same server), one of each per xdist worker, stopped between the tests that use
them (`Shared`). The UI test starts its own server with the UI on, through the
same `prefect_server`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from scheduler_service.stack.groups import Group, start_time
from scheduler_service.stack.local import free_port

ROOT = Path(__file__).resolve().parents[1]
POOL = "gpus"
# Seeded profile: admission plans with these figures (the real CPU rate is
# higher, so admitted runs finish early); 2 slots beat 1, so growing and
# shrinking are worth it.
MLP_CURVE = {1: 20.0, 2: 36.0}


@dataclass
class Stack:
    api_url: str
    home: Path
    worker: subprocess.Popen[bytes]
    worker_log: Path
    killed_groups: list[Group] = field(default_factory=list)  # of killed workers: what may live on

    def start_worker(self, log: Path, api_url: str | None = None, **env: str | None) -> None:
        """`prefect worker start` on the pool, through `api_url` if given (a
        slow proxy of the same server), with `env` on top of the stack's (None: unset)."""
        environment = {**os.environ, "PREFECT_API_URL": api_url or self.api_url, "PREFECT_LOGGING_LEVEL": "INFO"}
        for key, value in env.items():
            if value is None:
                environment.pop(key, None)
            else:
                environment[key] = value
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL],
            env=environment, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        )
        self.worker_log = log

    @contextmanager
    def worker_through(self, api_url: str, log: Path, **env: str | None) -> Iterator[None]:
        """The stack's worker replaced, while inside, by one that talks to
        Prefect through `api_url`; the usual one is back afterwards."""
        usual_log = self.worker_log
        _stop(self.worker)
        self.start_worker(log, api_url, **env)
        try:
            self.wait_worker_started()
            yield
        finally:
            _stop(self.worker)
            self.start_worker(usual_log)
            self.wait_worker_started()

    def wait_worker_started(self) -> None:
        self.wait_until(lambda: "started!" in self.worker_log.read_text(errors="replace"), 60, "the worker to start")

    def kill_worker(self) -> None:
        """SIGKILL the worker process alone, as a crash would; its flow runs go on."""
        self.killed_groups.append(Group(self.worker.pid, start_time(self.worker.pid) or 0, "killed worker"))
        self.worker.kill()
        self.worker.wait(timeout=10)

    def submit(self, name: str | None = None, **parameters: Any) -> str:
        from prefect.deployments import run_deployment

        flow_run = run_deployment("train/mlp", parameters=parameters, timeout=0, flow_run_name=name)
        return str(flow_run.id)  # type: ignore[union-attr]

    def flow_run(self, run_id: str) -> Any:
        from elasticflow_block.prefect_client import sync_client

        with sync_client() as client:
            return client.read_flow_run(run_id)  # type: ignore[arg-type]

    def cancel(self, run_id: str) -> None:
        """As a user cancels it in the UI."""
        from prefect.states import Cancelling

        from elasticflow_block.prefect_client import sync_client

        with sync_client() as client:
            client.set_flow_run_state(run_id, Cancelling(message="not needed any more"), force=True)  # type: ignore[arg-type]

    def wait_final(self, run_id: str, timeout_s: float = 120.0) -> Any:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            run = self.flow_run(run_id)
            if run.state is not None and run.state.is_final():
                return run
            time.sleep(0.5)
        raise AssertionError(f"flow run {run_id} not final after {timeout_s} s: {run.state!r}\n{self.log_tail()}")

    def wait_until(self, predicate: Any, timeout_s: float = 60.0, what: str = "condition") -> Any:
        try:
            return wait_until(predicate, timeout_s, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log_tail()}") from None

    def idle(self) -> bool:
        """No run holds or awaits GPUs (the store says so)."""
        import sqlite3

        try:
            with sqlite3.connect(self.home / "elasticflow.db") as db:
                busy = db.execute("select count(*) from ef_job where status in ('admitted', 'running')")
                return busy.fetchone()[0] == 0
        except sqlite3.Error:
            return True  # no store yet: nothing has run

    def wait_idle(self, timeout_s: float = 180.0) -> None:
        """Until the cluster is idle: a test whose run must get every slot, and
        so train at the speed it assumes, starts after the tests before it are
        done with theirs."""
        self.wait_until(self.idle, timeout_s, "the cluster to be idle")

    def events(self, run_id: str, prefix: str = "elasticflow.", timeout_s: float = 20.0) -> list[dict[str, Any]]:
        """Events about a run, waiting for the first (the server ingests them asynchronously)."""
        try:
            return wait_for_events(run_id, prefix, timeout_s)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log_tail()}") from None

    def allocation_artifact(self, run_id: str) -> str:
        """The markdown of the worker's allocation-history artifact of a run."""
        from uuid import UUID

        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        from elasticflow_block.prefect_client import sync_client

        with sync_client() as client:
            artifacts = client.read_artifacts(
                artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)]))
            )
        (artifact,) = [a for a in artifacts if a.description == "ElasticFlow allocation history"]
        return str(artifact.data)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.worker_log.read_text(errors="replace").splitlines()[-lines:])


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop the worker and every flow process it started (its process group)."""
    from scheduler_service.stack.local import stop_process

    stop_process(process)


def _kill_processes_of(home: Path) -> None:
    """SIGKILL what a failed test may leave behind of the stack at `home`: the
    process groups recorded for it (flow runs, fork servers), never a process
    chosen by its environment."""
    from scheduler_service.stack.local import stop_processes_of

    stop_processes_of(home, grace_s=0.0)


def stack_settings(base: Path) -> dict[str, str]:
    """The ElasticFlow environment of a test stack under `base`: a 2-slot CPU
    cluster, 2 s slots, cheap restarts (`prefect_server` sets Prefect's)."""
    return {
        "ELASTICFLOW_HOME": str(base / "home"),
        "ELASTICFLOW_CLUSTER": str(ROOT / "infra" / "local-cpu2.csv"),
        "ELASTICFLOW_INTERVAL_S": "2",
        "ELASTICFLOW_RESTART_S": "0.5",
        # Deadlines in these tests are tight on purpose; nothing is kept for starts.
        "ELASTICFLOW_LAUNCH_S": "0",
        # A hung profile fails its run with the ranks' logs well before a test gives up.
        "ELASTICFLOW_PROFILE_TIMEOUT_S": "150",
    }


def rank_user_args(home: Path) -> list[str]:
    """`up`'s options for its ranks' account: none (the default unprivileged
    account, created if missing) where this machine lets that account run the
    ranks, else the explicit opt-out `--rank-user root` (a Python under /root,
    a home under a folder others cannot pass through)."""
    from scheduler_service.stack.rank_account import OPT_OUT, RankAccountError, resolve

    try:
        resolve(None, home)
    except RankAccountError:
        return ["--rank-user", OPT_OUT]
    return []


def final_flow_run(run_id: Any, supervise: Callable[[], Iterable[str]] | None = None) -> Any:
    """The flow run once its state is final, else None: a `wait_until`
    predicate. `supervise` (a stack under `up`'s supervision) is stepped
    first, and what it says is printed, so a process that died is restarted
    while the test waits."""
    from elasticflow_block.prefect_client import sync_client

    for line in supervise() if supervise is not None else ():
        print(line)
    with sync_client() as client:
        found = client.read_flow_run(run_id)
    return found if found.state is not None and found.state.is_final() else None


def wait_until(predicate: Callable[[], Any], timeout_s: float = 60.0, what: str = "condition") -> Any:
    """The predicate's first truthy value, polled every 0.3 s; AssertionError naming `what` after `timeout_s`."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def wait_for_events(
    run_id: str,
    prefix: str = "elasticflow.",
    timeout_s: float = 20.0,
    until: Callable[[list[dict[str, Any]]], bool] = bool,
) -> list[dict[str, Any]]:
    """A run's events whose name starts with `prefix`, once `until` holds for
    them (default: there is one); the server ingests events asynchronously."""
    from elasticflow_block.prefect_client import sync_client

    body = {"filter": {"event": {"prefix": [prefix]},
                       "any_resource": {"id": [f"prefect.flow-run.{run_id}"]}}, "limit": 50}

    def fetch() -> list[dict[str, Any]] | None:
        with sync_client() as client:
            events = client.request("POST", "/events/filter", json=body).json()["events"]
        return events if until(events) else None

    return wait_until(fetch, timeout_s, f"{prefix} events of {run_id}")


def flow_run_states(run_id: str) -> list[Any]:
    """Every state a flow run went through, oldest first."""
    from elasticflow_block.prefect_client import sync_client

    with sync_client() as client:
        states = client.read_flow_run_states(run_id)  # type: ignore[arg-type]
    return sorted(states, key=lambda state: state.timestamp)


def state_names(run_id: str) -> list[str]:
    return [state.name for state in flow_run_states(run_id)]


class Shared:
    """The session's server and stack, stopped (SIGSTOP to their process
    groups) between the tests that use them. Idle, a server and its worker
    still poll each other: a fifth of a core per test process, a sixth of the
    suite's CPU over a session. Stopped they cost nothing, and come back
    (SIGCONT) where they were. Only while no run holds or awaits GPUs: a run
    left training is never frozen under its flow process."""

    def __init__(self) -> None:
        self._processes: list[Callable[[], subprocess.Popen[bytes] | None]] = []
        self._busy: list[Callable[[], bool]] = []
        self._stopped: list[Group] = []  # until woken

    def add(self, process: Callable[[], subprocess.Popen[bytes] | None], busy: Callable[[], bool] | None = None
            ) -> None:
        """A process to stop between tests (read at each stop: a test may replace it)."""
        self._processes.append(process)
        if busy is not None:
            self._busy.append(busy)

    def wake(self) -> None:
        stopped, self._stopped = self._stopped, []
        for group in stopped:
            group.signal(signal.SIGCONT)

    def sleep(self) -> None:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        if self._stopped or any(busy() for busy in self._busy):
            return
        APILogWorker.drain_all()  # what this process still has to send, sent while the server listens
        EventsWorker.drain_all()
        for process in (of() for of in self._processes):
            if process is not None and process.poll() is None:
                group = Group(process.pid, start_time(process.pid) or 0, "shared stack")
                if group.signal(signal.SIGSTOP):
                    self._stopped.append(group)


SHARED = Shared()
USERS = {"prefect_api", "stack"}  # the fixtures of the shared server and stack


def wait_fork_server(log: Path, process: subprocess.Popen[bytes] | None = None, timeout_s: float = 120.0) -> None:
    """Until the fork server writing `log` serves (it listens at once, and
    serves once it has imported torch), or its process ended."""
    from flows.training.launch.forkserver import READY

    deadline = time.time() + timeout_s
    while READY.encode() not in (log.read_bytes() if log.exists() else b""):
        assert (process is None or process.poll() is None) and time.time() < deadline, \
            f"the fork server does not serve: {log.read_text(errors='replace')[-2000:] if log.exists() else ''}"
        time.sleep(0.05)


def seed_prefect_db(prefect_home: Path) -> None:
    """A migrated Prefect database in `prefect_home` before its server first
    starts, copied from one migrated once per machine and Prefect version: a
    server on a fresh database runs every migration first (~6 s of CPU and of
    the test's time, ~10 s to healthy on an idle machine, ~3.5 s without).
    Fresh databases are still migrated where a test starts a stack without
    this (bench/chaos.py through test_chaos, `make demo`)."""
    import fcntl
    import tempfile

    import prefect

    target = prefect_home / "prefect.db"
    if target.exists():
        return
    template_home = Path(tempfile.gettempdir()) / f"elasticflow-tests-prefect-{prefect.__version__}"
    template_home.mkdir(mode=0o700, exist_ok=True)
    template = template_home / "prefect.db"
    with open(template_home / "lock", "w") as lock:  # xdist workers make it once between them
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not template.exists():
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
            building = template_home / "building"
            shutil.rmtree(building, ignore_errors=True)
            building.mkdir()
            subprocess.run([sys.executable, "-m", "prefect", "server", "database", "upgrade", "-y"],
                           env={**env, "PREFECT_HOME": str(building), "DO_NOT_TRACK": "1"}, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
            os.replace(building / "prefect.db", template)
            shutil.rmtree(building, ignore_errors=True)
    for folder in (prefect_home.parent, prefect_home):  # as the stack makes its home and this: private
        folder.mkdir(mode=0o700, exist_ok=True)
    shutil.copyfile(template, target)
    target.chmod(0o600)


@contextmanager
def prefect_server(base: Path, *, ui: bool = False, timeout_s: float = 240.0,
                   started: Callable[[subprocess.Popen[bytes]], None] | None = None) -> Iterator[str]:
    """`prefect server start` on a free port of 127.0.0.1 with its own
    PREFECT_HOME under `base`; until the block ends this process (its settings
    and its environment, so workers and flow processes it starts) talks to it.
    Yields the API URL.

    Not Prefect's test harness: its server never serves the UI, and one way to
    start a server for every test is easier to reason about than two. Startup
    takes ~10 s on an idle machine, over a minute on two busy cores.
    """
    import prefect.context
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from scheduler_service.stack.local import wait_healthy

    base.mkdir(parents=True, exist_ok=True)
    seed_prefect_db(base / "prefect")
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    env = {
        "PREFECT_HOME": str(base / "prefect"),
        "PREFECT_API_URL": api_url,
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_ENABLED": "true" if ui else "false",
    }
    if ui:
        env["PREFECT_UI_API_URL"] = api_url
        # the UI's static files are copied on first start: into our folder, not site-packages
        env["PREFECT_UI_STATIC_DIRECTORY"] = str(base / "ui-static")
    log = base / "server.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env={**os.environ, **env}, stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=base,
        start_new_session=True,
    )
    if started is not None:
        started(server)
    try:
        try:
            wait_healthy(api_url, server, timeout_s)
        except RuntimeError as exc:
            raise AssertionError(f"{exc}:\n{log.read_text()[-3000:]}") from None
        with pytest.MonkeyPatch.context() as mp:
            for key, value in env.items():
                mp.setenv(key, value)
            with temporary_settings(updates={PREFECT_API_URL: api_url, PREFECT_HOME: base / "prefect"}):
                # as Prefect's harness does: also threads whose context was copied earlier see this server
                with prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()):
                    try:
                        yield api_url
                    finally:  # send what is queued while the server still listens
                        APILogWorker.drain_all()
                        EventsWorker.drain_all()
    finally:
        _stop(server)


@contextmanager
def stack_on(api_url: str, base: Path) -> Iterator[Stack]:
    """On the server at `api_url`: the `gpus` pool with `train/mlp` (seeded MLP
    profile) and a worker, state under `base`; all they started is stopped at the end."""
    with pytest.MonkeyPatch.context() as mp:
        for key, value in stack_settings(base).items():
            mp.setenv(key, value)
        mp.delenv("ELASTICFLOW_DATABASE_URL", raising=False)
        from scheduler_service.stack.deployments import deploy, ensure_pool
        from scheduler_service.store import save_curve

        save_curve("mlp", 32, MLP_CURVE)
        asyncio.run(ensure_pool(POOL))
        stack = Stack(api_url, base / "home", None, base / "worker.log")  # type: ignore[arg-type]
        stack.start_worker(base / "worker.log")  # boots (imports) while we deploy
        try:
            deploy(POOL, ["mlp"], parameters={"hyperparameters": {"global_batch_size": 32}, "device": "cpu"})
            stack.wait_worker_started()
            yield stack
        finally:
            _stop(stack.worker)
            for group in stack.killed_groups:  # only while it is still that group: PIDs are reused
                group.signal(signal.SIGKILL)
            _kill_processes_of(stack.home)


@contextmanager
def running_stack(base: Path, *, ui: bool = False) -> Iterator[Stack]:
    """A server of its own, with the stack on it (the UI test's)."""
    with prefect_server(base, ui=ui) as api_url, stack_on(api_url, base) as stack:
        yield stack


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prefect server alone, for tests that run flows in this process
    (stopped between them: `Shared`)."""
    with prefect_server(tmp_path_factory.mktemp("prefect"), started=lambda server: SHARED.add(lambda: server)) \
            as api_url:
        try:
            yield api_url
        finally:
            SHARED.wake()


@pytest.fixture(scope="session")
def stack(prefect_api: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The pool, `train/mlp` and a worker on the session's server (stopped
    between the tests that use it: `Shared`)."""
    with stack_on(prefect_api, tmp_path_factory.mktemp("service")) as stack:
        SHARED.add(lambda: stack.worker, busy=lambda: not stack.idle())
        try:
            yield stack
        finally:
            SHARED.wake()
