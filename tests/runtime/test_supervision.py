"""`elasticflow up`'s stack under faults (issue 14): a worker killed with
SIGKILL is restarted, then the server, and the run the worker had launched
completes in the same flow run; the ranks of that run see no secret of the worker's and listen on
loopback only; what the stack writes under its home is private; stopping the
stack spares a process that merely exported the same ELASTICFLOW_HOME."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tests.runtime.privilege import environ, listening, too_open
from tests.stack import MLP_CURVE, seed_prefect_db, stack_settings, wait_until

pytestmark = pytest.mark.slow

WORKER_SECRETS = {"PGPASSWORD": "hunter2"}


def _iteration(home: Path, run_id: str) -> int:
    try:
        return int(json.loads((home / "control" / run_id / "status.json").read_text()).get("iteration", 0))
    except (OSError, ValueError):
        return 0


def _ranks(home: Path, run_id: str) -> list[int]:
    """The DDP ranks of a run: its recorded process group, less its leader (the flow process)."""
    from scheduler_service.stack.groups import groups_of

    # boot's group (the relay, alone in a warm start) and the flow process's
    return [pid for group in groups_of(home) if group.what == f"flow run {run_id}"
            for pid in group.members() if pid != group.pgid]


def _api_is_locked(stack: object, run_id: str) -> None:
    """Issue 43: without the stack's secret the API answers 401 (a PATCH of a
    deployment's job variables made every later run execute the caller's
    code); with it, the API works. The worker and the flow process that is
    training `run_id` got this far with it."""
    import base64
    import urllib.error
    import urllib.request

    from scheduler_service.stack.secret import api_auth_string

    home, api_url = stack.home, stack.api_url  # type: ignore[attr-defined]
    lines = dict(line.split("=", 1) for line in (home / "client.env").read_text().splitlines())
    auth = api_auth_string(home)
    assert lines == {"PREFECT_API_URL": api_url, "PREFECT_API_AUTH_STRING": auth}
    deployment = stack.deployments["train/mlp"]  # type: ignore[attr-defined]

    def call(method: str, path: str, body: bytes | None = None, secret: str | None = None) -> int:
        request = urllib.request.Request(f"{api_url}{path}", data=body, method=method,
                                         headers={"Content-Type": "application/json"})
        if secret is not None:
            request.add_header("Authorization", "Basic " + base64.b64encode(secret.encode()).decode())
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status
        except urllib.error.HTTPError as exc:
            return exc.code

    evil = b'{"job_variables": {"env": {"PYTHONPATH": "/tmp/evil"}}}'
    assert call("PATCH", f"/deployments/{deployment}", evil) == 401
    assert call("PATCH", f"/deployments/{deployment}", evil, secret="elasticflow:guess") == 401
    assert call("GET", f"/deployments/{deployment}") == 401
    assert call("GET", f"/flow_runs/{run_id}") == 401
    assert call("GET", f"/flow_runs/{run_id}", secret=auth) == 200
    assert call("GET", "/health") == 200  # probes stay open


def test_a_killed_worker_and_server_are_restarted_and_the_run_completes_in_the_same_flow_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from elasticflow_block.prefect_client import sync_client
    from scheduler_service.stack.local import free_port, local_stack, stack_env, wait_healthy
    from scheduler_service.store import save_curve

    home, port = tmp_path / "home", free_port()
    settings = {**stack_settings(tmp_path), **WORKER_SECRETS,
                "ELASTICFLOW_DATABASE_URL": f"sqlite:///{home / 'elasticflow.db'}"}  # the default store, named
    for key, value in {**stack_env(home, port), **settings}.items():
        monkeypatch.setenv(key, value)  # local_stack sets them in this process too: put back afterwards
    seed_prefect_db(home / "prefect")
    bystander = subprocess.Popen(["sleep", "900"], env=dict(os.environ), start_new_session=True)
    try:
        with local_stack(home, port, env=settings, models=("mlp",), schedules=False) as stack, \
                temporary_settings(updates={PREFECT_API_URL: stack.api_url, PREFECT_HOME: home / "prefect"}):
            worker_log = stack.logs / "worker.log"
            wait_until(lambda: "started!" in worker_log.read_text(errors="replace"), 180, "the worker to start")
            save_curve("mlp", 32, MLP_CURVE)  # once the worker made the store: two first uses race on its tables
            deadline = datetime.now(timezone.utc) + timedelta(minutes=10)
            run = run_deployment("train/mlp", timeout=0, parameters={
                "iterations": 3000, "deadline": deadline.isoformat(), "checkpoint_interval": 100,
                "hyperparameters": {"global_batch_size": 32}, "device": "cpu"})
            run_id = str(run.id)
            wait_until(lambda: _iteration(home, run_id) > 0, 240, "the run to train")

            _api_is_locked(stack, run_id)
            ranks = wait_until(lambda: _ranks(home, run_id), 30, "the run's ranks")
            secrets = {"PGPASSWORD", "ELASTICFLOW_DATABASE_URL", "PREFECT_API_AUTH_STRING"}
            for pid in ranks:
                seen = environ(pid)
                assert not secrets & set(seen), (pid, sorted(seen))
            from scheduler_service.stack.groups import groups_of

            (forkserver,) = [g.pgid for g in groups_of(home) if g.what == "fork server"]
            assert not secrets & set(environ(forkserver))  # what its forks start from
            sockets = listening(ranks)
            assert sockets and all(s.startswith("127.0.0.1:") for s in sockets), sockets

            os.kill(stack.worker.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
            said: list[str] = []
            wait_until(lambda: said.extend(stack.supervise()) or any("restarted" in s for s in said), 60,
                       "the worker to be restarted")
            assert any("the worker exited with status -9" in s for s in said), said
            wait_until(lambda: worker_log.read_text(errors="replace").count("started!") >= 2, 180,
                       "the restarted worker to start")

            os.kill(stack.server.process.pid, signal.SIGKILL)  # type: ignore[union-attr]
            said.clear()
            wait_until(lambda: said.extend(stack.supervise()) or any("server restarted" in s for s in said), 60,
                       "the server to be restarted")
            assert any("the server exited with status -9" in s for s in said), said
            wait_healthy(stack.api_url, stack.server.process, 240)  # type: ignore[arg-type]

            def final() -> object:
                stack.supervise()
                with sync_client() as client:
                    state = client.read_flow_run(run.id).state
                return state if state is not None and state.is_final() else None

            state = wait_until(final, 400, "the run to finish")
            with sync_client() as client:
                ended = client.read_flow_run(run.id)
            assert state.is_completed(), (state, worker_log.read_text()[-3000:])
            assert ended.run_count == 1  # the same flow run, never restarted
            assert _iteration(home, run_id) == 3000
        assert bystander.poll() is None, "stopping the stack signalled a process that only shares its home"
        assert too_open(home) == [], "files under the home readable by others"
    finally:
        bystander.kill()
        bystander.wait()
