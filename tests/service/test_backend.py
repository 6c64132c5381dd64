"""The execution backends on real processes: the infrastructure id names
host and process, `kill` (Prefect's kill_infrastructure) stops only a process
that is still that run's, and the launch reaches the flow process typed. The
Ray backend is the same flow process plus Ray (joining a cluster is faked
here; tests/cluster has the real one)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import pytest

from flows.training.launch.spec import LaunchSpec
from scheduler_service.worker import ray_backend
from scheduler_service.worker.backend import InfrastructureGone, LocalProcesses, RankPlacement
from scheduler_service.worker.ray_backend import RayBackend
from tests.stack import wait_fork_server

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


@pytest.fixture
def ray(monkeypatch: pytest.MonkeyPatch) -> RayBackend:
    """A Ray backend that joined no cluster, and has no rank actor to kill."""
    killed: list[str] = []
    monkeypatch.setattr(ray_backend, "connect", lambda address: None)
    monkeypatch.setattr(RayBackend, "kill_ranks", lambda self, run_id, timeout_s=15.0: killed.append(run_id) or 0)
    backend = RayBackend("10.0.0.1:6379", warm_start=False)
    backend.killed = killed  # type: ignore[attr-defined]
    return backend


def test_a_placement_reaches_the_flow_process_as_its_launch_spec(ray: RayBackend) -> None:
    admitted = LaunchSpec(deadline="2030-01-01T00:00:00+00:00", admitted=True)
    placement = RankPlacement("r", (2, 3), ("node-a",))
    env: dict[str, str] = {"ELASTICFLOW_DATABASE_URL": "postgresql://u:secret@db/x", "PREFECT_API_URL": "http://x"}
    LocalProcesses(warm_start=False).prepare(env, placement, admitted)
    assert set(env) == {"ELASTICFLOW_LAUNCH", "PREFECT_API_URL"}  # the worker's store credentials are not passed on
    local = LaunchSpec.from_env(env)
    # The first segment's two ranks and two spares for a restart
    assert local == admitted.model_copy(update={"gpus": [2, 3], "nodes": ["node-a"], "standby": 4})
    assert local.parameters() == {"deadline": admitted.deadline}  # placement and standbys are not parameters
    env = {}
    ray.prepare(env, placement, admitted)
    on_ray = LaunchSpec.from_env(env)
    assert on_ray == local.model_copy(update={"standby": 0, "ray_address": "10.0.0.1:6379"})  # no rank here
    assert on_ray.parameters() == {"deadline": admitted.deadline, "ray_address": "10.0.0.1:6379"}


def test_the_workers_own_ranks_are_forked_by_its_fork_server_and_a_run_starting_cold_is_not_sent_there(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile's ranks run in the worker's process tree: asked of its fork
    server, as a warm run's are, instead of three cold interpreters."""
    from flows.training.launch.boot import FORKSERVER_ENV
    from flows.training.launch.standby import ServedWorker, WorkerPool

    monkeypatch.delenv(FORKSERVER_ENV, raising=False)
    backend = LocalProcesses()
    backend.open(tmp_path)
    pool = WorkerPool()
    try:
        path = os.environ[FORKSERVER_ENV]
        wait_fork_server(tmp_path / "logs" / "forkserver.log")
        (rank,) = pool.take(1)
        assert isinstance(rank, ServedWorker)
        rank.kill()
        placement, spec = RankPlacement("r", (0,), ("node-a",)), LaunchSpec(admitted=False)
        warm = dict(os.environ)
        backend.prepare(warm, placement, spec)
        assert warm[FORKSERVER_ENV] == path
        cold = {**os.environ, "OMP_NUM_THREADS": "7"}  # a job variable a forked process could not honour
        backend.prepare(cold, placement, spec)
        assert FORKSERVER_ENV not in cold
    finally:
        pool.close()
        backend.close()
    assert FORKSERVER_ENV not in os.environ


def test_backends_compose_the_flow_process_instead_of_subclassing_each_other() -> None:
    assert LocalProcesses.__bases__ == (object,) and RayBackend.__bases__ == (object,)


def test_the_ray_backend_kills_the_coordinator_then_any_rank_left_even_when_the_process_is_gone(
        ray: RayBackend) -> None:
    process = _start(RUN)
    infra = ray.infrastructure_id(process.pid)
    assert infra == f"ray://10.0.0.1:6379/elasticflow|{socket.gethostname()}:{process.pid}"
    assert ray.alive(infra, RUN) and not ray.alive(infra, "another-run")
    ray.kill(infra, RUN, grace_s=5.0)
    assert process.wait(timeout=10) == -signal.SIGTERM
    with pytest.raises(InfrastructureGone):
        ray.kill(infra, RUN, grace_s=0.5)
    assert ray.killed == [RUN, RUN]  # type: ignore[attr-defined]
