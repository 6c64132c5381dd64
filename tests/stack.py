"""A real Prefect server (the test harness), an `elasticflow` work pool with the
`train/mlp` deployment, and the worker started by `prefect worker start` as a
separate process, as a user would run it. One stack per xdist worker, shared
by every test that asks for `stack` (registered in tests/conftest.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

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
    killed_groups: list[int] = field(default_factory=list)  # of killed workers: their flow runs may live on

    def start_worker(self, log: Path) -> None:
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL],
            env={**os.environ, "PREFECT_API_URL": self.api_url, "PREFECT_LOGGING_LEVEL": "INFO"},
            stdout=open(log, "wb"), stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
        )
        self.worker_log = log

    def wait_worker_started(self) -> None:
        self.wait_until(lambda: "started!" in self.worker_log.read_text(errors="replace"), 60, "the worker to start")

    def kill_worker(self) -> None:
        """SIGKILL the worker process alone, as a crash would; its flow runs go on."""
        self.killed_groups.append(self.worker.pid)
        self.worker.kill()
        self.worker.wait(timeout=10)

    def submit(self, **parameters: Any) -> str:
        from prefect.deployments import run_deployment

        flow_run = run_deployment("train/mlp", parameters=parameters, timeout=0)
        return str(flow_run.id)  # type: ignore[union-attr]

    def flow_run(self, run_id: str) -> Any:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return client.read_flow_run(run_id)  # type: ignore[arg-type]

    def wait_final(self, run_id: str, timeout_s: float = 120.0) -> Any:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            run = self.flow_run(run_id)
            if run.state is not None and run.state.is_final():
                return run
            time.sleep(0.5)
        raise AssertionError(f"flow run {run_id} not final after {timeout_s} s: {run.state!r}\n{self.log_tail()}")

    def wait_until(self, predicate: Any, timeout_s: float = 60.0, what: str = "condition") -> Any:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}\n{self.log_tail()}")

    def events(self, run_id: str, prefix: str = "elasticflow.", timeout_s: float = 20.0) -> list[dict[str, Any]]:
        """Events about a run, waiting for the first (the server ingests them asynchronously)."""
        from prefect.client.orchestration import get_client

        body = {"filter": {"event": {"prefix": [prefix]},
                           "any_resource": {"id": [f"prefect.flow-run.{run_id}"]}}, "limit": 50}

        def fetch() -> list[dict[str, Any]]:
            with get_client(sync_client=True) as client:
                return client.request("POST", "/events/filter", json=body).json()["events"]

        return self.wait_until(fetch, timeout_s, f"{prefix} events of {run_id}")

    def allocation_artifact(self, run_id: str) -> str:
        """The markdown of the worker's allocation-history artifact of a run."""
        from uuid import UUID

        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

        with get_client(sync_client=True) as client:
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
    """SIGKILL what a failed test may leave behind of the stack at `home`."""
    from scheduler_service.stack.local import stop_processes_of

    stop_processes_of(home, grace_s=0.0)


def stack_settings(base: Path) -> dict[str, str]:
    """The environment of a test stack under `base`: its own Prefect home, a
    2-slot CPU cluster, 2 s slots, cheap restarts."""
    return {
        "PREFECT_HOME": str(base / "prefect"),
        "DO_NOT_TRACK": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "ELASTICFLOW_HOME": str(base / "home"),
        "ELASTICFLOW_CLUSTER": str(ROOT / "infra" / "local-cpu2.csv"),
        "ELASTICFLOW_INTERVAL_S": "2",
        "ELASTICFLOW_RESTART_S": "0.5",
        # Deadlines in these tests are tight on purpose; nothing is kept for starts.
        "ELASTICFLOW_LAUNCH_S": "0",
        # A hung profile fails its run with the ranks' logs well before a test gives up.
        "ELASTICFLOW_PROFILE_TIMEOUT_S": "150",
    }


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("service")
    env = stack_settings(base)
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        mp.delenv("ELASTICFLOW_DATABASE_URL", raising=False)
        from prefect.settings import PREFECT_API_URL
        from prefect.testing.utilities import prefect_test_harness

        from scheduler_service.stack.deployments import deploy, ensure_pool
        from scheduler_service.store import save_curve

        with prefect_test_harness(server_startup_timeout=60):
            api_url = PREFECT_API_URL.value()
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
                for group in stack.killed_groups:
                    try:
                        os.killpg(group, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                _kill_processes_of(stack.home)
