"""A stop of `elasticflow up` is a pause (issue 43): SIGINT to `up` while an
admitted deadline run trains, then `up` again, and the same flow run goes on
from its last checkpoint, not from 0, and meets its deadline. It used to end
`Crashed` ("Execution was aborted by a termination signal") with a checkpoint
on disk that nothing ever read again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from uuid import UUID

import pytest

from tests.stack import MLP_CURVE, ROOT, rank_user_args, stack_settings, state_names, wait_until

pytestmark = pytest.mark.slow


def _iteration(home: Path, run_id: str) -> int:
    try:
        return int(json.loads((home / "control" / run_id / "status.json").read_text()).get("iteration") or 0)
    except (OSError, ValueError):
        return 0


def _segment_names(run_id: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[UUID(run_id)])))
    return [run.name for run in runs]


def test_a_stop_of_up_pauses_a_run_that_the_next_up_resumes_from_its_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from elasticflow_block.storage import CheckpointStorage
    from scheduler_service.cli.status import report
    from scheduler_service.contracts import Outcome
    from scheduler_service.stack.local import free_port, stack_env
    from scheduler_service.stack.secret import api_auth_string
    from scheduler_service.store import save_curve

    home, port = tmp_path / "home", free_port()
    home.mkdir(mode=0o700)
    # The API asks for the stack's secret (each `up` of this home makes it ask for this one), and the
    # ranks' account is the default where this machine lets it run them, else the explicit opt-out.
    settings = {**stack_env(home, port), **stack_settings(tmp_path), "PREFECT_API_AUTH_STRING": api_auth_string(home)}
    for key, value in settings.items():
        monkeypatch.setenv(key, value)
    log = tmp_path / "up.log"
    starts = 0

    def start() -> subprocess.Popen[bytes]:
        nonlocal starts
        up = subprocess.Popen([sys.executable, "-c", "from scheduler_service.cli import main; main()", "up",
                               "--home", str(home), "--port", str(port), *rank_user_args(home)], env={**os.environ, **settings}, cwd=ROOT,
                              stdout=open(log, "ab"), stderr=subprocess.STDOUT)
        starts += 1
        wait_until(lambda: log.read_text(errors="replace").count("ElasticFlow worker started") >= starts
                   and (home / "logs" / "worker.log").read_text(errors="replace").count("started!") >= starts,
                   600, f"the stack's start {starts}")
        return up

    up = start()
    try:
        with temporary_settings(updates={PREFECT_API_URL: settings["PREFECT_API_URL"], PREFECT_HOME: home / "prefect",
                                         PREFECT_API_AUTH_STRING: settings["PREFECT_API_AUTH_STRING"]}):
            save_curve("mlp", 32, MLP_CURVE)  # once the worker made the store
            # Planned at the seeded 36 it/s on both slots: 83 s of its 15 minutes (on two loaded cores it
            # trains at 20-40 it/s, and a start of `up` takes minutes)
            total = 3000
            run_id = str(run_deployment("train/mlp", timeout=0, parameters={  # type: ignore[union-attr]
                "iterations": total, "deadline": "+15m", "checkpoint_interval": 200,
                "hyperparameters": {"global_batch_size": 32}, "device": "cpu"}).id)
            wait_until(lambda: _iteration(home, run_id) > 600, 240, "the run to train past a checkpoint")
            up.send_signal(signal.SIGINT)
            assert up.wait(timeout=180) == 0, log.read_text(errors="replace")[-3000:]
            at_stop = _iteration(home, run_id)
            checkpoint = CheckpointStorage(str(home / "checkpoints")).iterations(run_id)[-1]
            assert 0 < checkpoint and at_stop < total, (checkpoint, at_stop)  # it stopped mid-training

            up = start()
            wait_until(lambda: (v := {r.flow_run_id: r for r in report(home).runs}.get(run_id)) is not None
                       and v.outcome is not None, 600, "the run to end")
            view = {r.flow_run_id: r for r in report(home).runs}[run_id]
            names = state_names(run_id)
            assert names[-1] == "Completed" and "Crashed" not in names, names
            assert "Resuming" in names, names  # paused, then taken up again in the same flow run
            assert view.outcome is Outcome.MET, view
            assert _iteration(home, run_id) == total
            # the second launch started from the checkpoint the stop left, not from 0
            segments = _segment_names(run_id)
            assert any(s.startswith(f"segment-0-it{checkpoint}-") for s in segments), (checkpoint, segments)
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=180)
