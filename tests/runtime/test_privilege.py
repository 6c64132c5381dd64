"""Least privilege for DDP ranks (issue 14): they see an allow-listed
environment (never the worker's database URL or passwords), listen on the
job's address only (loopback: every rank is on this machine), and what they
write is private to the account."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from flows.training.datasets import DatasetSpec
from flows.training.coordinator.launcher import WorkerPool, local_segment
from flows.training.params import Hyperparameters
from flows.training.segment import SegmentSpec
from flows.training.launch.standby import rank_env
from flows.training.supervision import read_progress
from tests.runtime.privilege import environ, listening, too_open

SECRETS = {"PGPASSWORD": "hunter2", "ELASTICFLOW_DATABASE_URL": "postgresql://ef:hunter2@db/ef",
           "PREFECT_API_DATABASE_CONNECTION_URL": "postgresql+asyncpg://p:hunter2@db/prefect",
           "SOME_SERVICE_TOKEN_SECRET": "x"}


def test_the_rank_allow_list_keeps_what_training_needs_and_drops_secrets_and_prefect() -> None:
    env = {"PATH": "/bin", "PYTHONPATH": "/src", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1",
           "CUDA_VISIBLE_DEVICES": "0", "ELASTICFLOW_HOME": "/h", "PREFECT_API_URL": "http://x/api",
           "AWS_SECRET_ACCESS_KEY": "s", "UNRELATED": "1", **SECRETS}
    assert rank_env(env) == {"PATH": "/bin", "PYTHONPATH": "/src", "RANK": "0", "MASTER_ADDR": "127.0.0.1",
                             "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0", "ELASTICFLOW_HOME": "/h"}
    # an operator can add what a remote checkpoint store needs, by name
    assert "AWS_SECRET_ACCESS_KEY" in rank_env({**env, "ELASTICFLOW_RANK_ENV": "AWS_SECRET_ACCESS_KEY"})


@pytest.mark.slow
def test_running_ranks_hold_no_secret_listen_on_loopback_and_write_private_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in SECRETS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("ELASTICFLOW_HOME", str(tmp_path / "home"))
    spec = SegmentSpec(run_key="privilege", model="mlp", dataset=DatasetSpec(name="synthetic-vectors"),
                       hyperparameters=Hyperparameters(global_batch_size=8), total_iterations=1_000_000,
                       stop_at=1_000_000, checkpoint_interval=5, checkpoint_url=str(tmp_path / "home" / "ck"))
    pool = WorkerPool()
    segment = local_segment(spec, [0, 1], workdir=tmp_path / "home" / "segments", pool=pool)
    segment.start()
    try:
        deadline = time.time() + 240  # imports and rendezvous on a busy machine; training then runs on
        while not list((tmp_path / "home" / "ck").rglob("*")) or not read_progress(segment.transport.dir, 0)[0]:
            assert time.time() < deadline, "the ranks never trained and checkpointed"
            assert all(r.proc.poll() is None for r in segment.ranks), [
                (segment.transport.dir / f"rank{r}.log").read_text(errors="replace") for r in (0, 1)
                if (segment.transport.dir / f"rank{r}.log").exists()]
            time.sleep(0.5)
        for pid in segment.pids:
            seen = environ(pid)
            assert not set(SECRETS) & set(seen), sorted(seen)
            assert not [k for k in seen if k.startswith("PREFECT_")], sorted(seen)
        sockets = listening(segment.pids)
        assert sockets, "rank 0 listens for its peers (the rendezvous store) somewhere"
        assert all(s.startswith("127.0.0.1:") for s in sockets), sockets
    finally:
        segment.kill(grace_s=10.0)
        pool.close()
    assert too_open(tmp_path / "home" / "ck") == [] and too_open(segment.transport.dir) == []
