"""The local execution backend on real processes: the infrastructure id names
host and process, and `kill` (Prefect's kill_infrastructure) stops only a
process that is still that run's."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from scheduler_service.worker.backend import InfrastructureGone, LocalProcesses, Placement

RUN = "0b7c1d2e-0000-4000-8000-000000000002"


def _start(run_id: str, ignore_sigterm: bool = False) -> subprocess.Popen[bytes]:
    code = ("import signal, time\n" + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_sigterm else "")
            + "print('ready', flush=True)\ntime.sleep(60)\n")
    process = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PREFECT__FLOW_RUN_ID": run_id},
                               stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    return process


def test_the_infrastructure_id_is_host_and_pid_and_another_hosts_is_not_ours() -> None:
    backend = LocalProcesses(warm_start=False)
    process = _start(RUN)
    try:
        infra = backend.infrastructure_id(process.pid)
        assert infra == f"{socket.gethostname()}:{process.pid}"
        assert backend.alive(infra, RUN) and not backend.alive(infra, "another-run")
        assert not backend.alive(f"elsewhere:{process.pid}", RUN)
    finally:
        process.kill()
        process.wait()


def test_kill_terminates_then_kills_and_refuses_a_process_that_is_not_the_runs() -> None:
    backend = LocalProcesses(warm_start=False)
    stranger = _start("someone-else")
    try:
        with pytest.raises(InfrastructureGone):
            backend.kill(backend.infrastructure_id(stranger.pid), RUN, grace_s=0.5)
        assert stranger.poll() is None  # never signalled
    finally:
        stranger.kill()
        stranger.wait()
    stubborn = _start(RUN, ignore_sigterm=True)
    backend.kill(backend.infrastructure_id(stubborn.pid), RUN, grace_s=0.5)
    assert stubborn.wait(timeout=10) == -signal.SIGKILL


def test_a_placement_reaches_the_flow_process_environment() -> None:
    env: dict[str, str] = {}
    LocalProcesses(warm_start=False).prepare(env, Placement("r", (2, 3), ("localhost",)))
    assert env == {"ELASTICFLOW_GPUS": "2,3", "ELASTICFLOW_WORLD_SIZE": "2", "ELASTICFLOW_NODES": "localhost"}
