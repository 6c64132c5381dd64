"""The service's state on PostgreSQL, chosen by URL alone: a throwaway server
started from Debian's binaries, the same store code as on SQLite."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from scheduler_service.store.db import DATABASE_URL_ENV


def _binaries() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    bin_dir = _binaries()
    if bin_dir is None:
        pytest.skip("no PostgreSQL server binaries (Debian: apt-get install postgresql)")
    from scheduler_service.stack.local import free_port

    # PostgreSQL refuses to run as root: run it as the `postgres` account then,
    # in a folder that account can reach (pytest's tmp folders are root-only).
    data = Path(tempfile.mkdtemp(prefix="elasticflow-pg-"))
    as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    if as_user:
        shutil.chown(data, "postgres")
        data.chmod(0o700)
    port = free_port()

    def run(*args: str) -> None:
        done = subprocess.run([*as_user, *args], capture_output=True, text=True)
        if done.returncode:
            pytest.fail(f"{Path(args[0]).name} failed: {done.stdout}{done.stderr}")

    run(str(bin_dir / "initdb"), "-D", str(data / "db"), "-A", "trust", "-U", "elasticflow")
    run(str(bin_dir / "pg_ctl"), "-D", str(data / "db"), "-l", str(data / "server.log"), "-w", "-o",
        f"-h 127.0.0.1 -p {port} -k {data} -c timezone=America/New_York", "start")
    try:
        yield f"postgresql+psycopg://elasticflow@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run([*as_user, str(bin_dir / "pg_ctl"), "-D", str(data / "db"), "-m", "immediate", "stop"],
                       capture_output=True)
        shutil.rmtree(data, ignore_errors=True)


def test_service_state_round_trips_on_postgresql(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATABASE_URL_ENV, postgres_url)
    from scheduler_service.store import get_curve, get_engine, save_curve
    from scheduler_service.worker.store import AllocationRecord, DecisionRecord, ServiceStore

    assert get_engine().dialect.name == "postgresql"
    store = ServiceStore()
    deadline = datetime(2026, 12, 1, 6, 0, tzinfo=timezone.utc)
    store.upsert_job("run-1", model="mlp", global_batch_size=32, iterations=500, deadline=deadline, status="arrived")
    store.upsert_job("run-1", status="admitted", share=2)
    store.add(DecisionRecord(flow_run_id="run-1", admitted=True, share=2, decision_ms=1.5))
    store.add(DecisionRecord(flow_run_id="run-2", admitted=False, reason="deadline_passed",
                             earliest_feasible_deadline=deadline + timedelta(hours=1)))
    store.add(AllocationRecord(flow_run_id="run-1", action="launch", gpus="0,1"))
    save_curve("mlp", 32, {1: 20.0, 2: 36.0})

    (job,) = store.jobs()
    assert (job.status, job.share, job.iterations) == ("admitted", 2, 500)
    # stored without a zone and read as UTC, whatever the server's time zone (New York here)
    assert job.deadline.replace(tzinfo=timezone.utc) == deadline
    rejected = store.decisions("run-2")[0]
    assert rejected.earliest_feasible_deadline.replace(tzinfo=timezone.utc) == deadline + timedelta(hours=1)
    assert [(a.action, a.gpus) for a in store.allocations("run-1")] == [("launch", "0,1")]
    assert get_curve("mlp", 32) == {1: 20.0, 2: 36.0}
