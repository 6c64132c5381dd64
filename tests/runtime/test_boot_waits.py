"""A flow process started while its Prefect server restarts (a stop of `up`,
a killed server) waits for the server, then trains: Prefect's client does
not retry a refused first connection, and chaos found an admitted run that
ended "stopped at iteration 0" when its server was killed 20 s after its
worker."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.slowproxy import slow_server
from tests.stack import ROOT

pytestmark = pytest.mark.slow

DOWN_S = 8.0


async def _flow_run(api_url: str, checkpoints: Path) -> str:
    """A run of `train` from a deployment on a pool nobody serves: only the process below runs it."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    async with get_client() as client:
        try:
            await client.create_work_pool(WorkPoolCreate(name="nobody-serves", type="process"))
        except Exception:
            pass  # made by an earlier run of this test on the same server
        flow_id = await client.create_flow_from_name("train")
        deployment = await client.create_deployment(
            flow_id=flow_id, name="boot-waits", entrypoint="flows/train.py:train", path=str(ROOT),
            work_pool_name="nobody-serves")
        run = await client.create_flow_run_from_deployment(deployment, parameters={
            "model": "mlp", "iterations": 5, "device": "cpu", "checkpoint_store": str(checkpoints),
            "hyperparameters": {"global_batch_size": 16}})
        return str(run.id)


def test_a_flow_process_started_while_its_server_is_down_waits_for_it_and_trains(
        prefect_api: str, tmp_path: Path) -> None:
    from elasticflow_block.prefect_client import sync_client

    run_id = asyncio.run(_flow_run(prefect_api, tmp_path / "checkpoints"))
    with slow_server(prefect_api, delay_s=0.0, down_s=DOWN_S) as restarting:
        env = {**os.environ, "PREFECT_API_URL": restarting, "PREFECT__FLOW_RUN_ID": run_id,
               "ELASTICFLOW_HOME": str(tmp_path / "home")}
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "flows.training.launch.boot"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - started >= DOWN_S
    with sync_client() as client:
        state = client.read_flow_run(run_id).state
    assert state is not None and state.is_completed(), state


def test_a_flow_process_whose_server_dies_just_after_it_found_it_listening_retries_and_trains(
        prefect_api: str, tmp_path: Path) -> None:
    """Ray chaos, seed 3: the server was killed as a flow process started; it
    had found the server listening, and the engine's next request, from a
    fresh client, was refused and not retried: the run crashed at iteration
    0. Now every client of the flow process retries a refused connection."""
    from elasticflow_block.prefect_client import sync_client

    run_id = asyncio.run(_flow_run(prefect_api, tmp_path / "checkpoints"))
    with slow_server(prefect_api, delay_s=0.0, blink_s=DOWN_S) as blinking:
        env = {**os.environ, "PREFECT_API_URL": blinking, "PREFECT__FLOW_RUN_ID": run_id,
               "ELASTICFLOW_HOME": str(tmp_path / "home")}
        done = subprocess.run([sys.executable, "-m", "flows.training.launch.boot"], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with sync_client() as client:
        state = client.read_flow_run(run_id).state
    assert state is not None and state.is_completed(), state
