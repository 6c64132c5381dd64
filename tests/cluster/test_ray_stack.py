"""End to end on `elasticflow up --ray local:2x2`: a user's `prefect deployment
run train/mlp --param deadline=...` is decided, launched across both nodes of
a real loopback Ray cluster, and Completed in the same flow run."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tests.stack import stack_settings, wait_until

ROOT = Path(__file__).resolve().parents[2]
# Seeded profile where only 4 slots meet the deadline below (the real CPU rate
# is higher: the run finishes early, but it is planned, and placed, on 4).
CURVE = {1: 10.0, 2: 19.0, 4: 36.0}


def test_a_deployment_run_is_decided_launched_across_nodes_and_completed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from scheduler_service.stack.local import free_port, local_stack
    from scheduler_service.store import save_curve

    settings = stack_settings(tmp_path)
    del settings["ELASTICFLOW_CLUSTER"]  # the cluster is Ray's
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    home, port = tmp_path / "home", free_port()
    with local_stack(home, port, env=settings, models=("mlp",), ray="local:2x2") as stack, \
            temporary_settings(updates={PREFECT_API_URL: stack.api_url, PREFECT_HOME: home / "prefect"}):
        worker_log = stack.logs / "worker.log"
        wait_until(lambda: "started!" in worker_log.read_text(errors="replace"), 180, "the worker to start")
        assert "2 nodes x 2 GPUs" in worker_log.read_text() and "ray backend" in worker_log.read_text()
        save_curve("mlp", 32, CURVE)
        deadline = (datetime.now(timezone.utc) + timedelta(seconds=150)).isoformat()
        out = subprocess.run(
            [sys.executable, "-m", "prefect", "deployment", "run", "train/mlp", "--param", f"deadline={deadline}",
             "--param", "iterations=3000", "--param", "checkpoint_interval=100"],
            cwd=ROOT, capture_output=True, text=True, check=True, timeout=120).stdout
        run_id = re.search(r"flow-run/([0-9a-f-]{36})", out)[1]  # type: ignore[index]

        def final() -> object:
            for line in stack.supervise():
                print(line)
            with get_client(sync_client=True) as client:
                run = client.read_flow_run(run_id)
            return run if run.state is not None and run.state.is_final() else None

        run = wait_until(final, 300, "the run to finish")
        assert run.state.is_completed(), (run.state, worker_log.read_text()[-3000:])
        assert run.run_count == 1
        assert run.labels.get("elasticflow.admission") == "admitted"
        assert str(run.labels.get("elasticflow.mss")) == "4"
        assert set(str(run.labels.get("elasticflow.nodes")).split(",")) == {"ray-node-0", "ray-node-1"}
        log = worker_log.read_text()
        assert "launched on 4 GPUs" in log and "ray-node-0" in log and "ray-node-1" in log
