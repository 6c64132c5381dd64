"""The service's state on PostgreSQL, chosen by URL alone: a throwaway server
started from Debian's binaries, the same store code as on SQLite."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta, timezone

import pytest

from scheduler_service.contracts import RunPhase
from scheduler_service.store.db import DATABASE_URL_ENV


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    from scheduler_service.stack.postgres import NO_POSTGRES, binaries, throwaway_postgres

    if binaries() is None:
        pytest.skip(NO_POSTGRES)
    # A server in another time zone: times must round-trip as UTC whatever the server's zone.
    with throwaway_postgres(settings={"timezone": "America/New_York"}) as url:
        yield url.replace("postgresql://", "postgresql+psycopg://", 1)


def test_service_state_round_trips_on_postgresql(postgres_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DATABASE_URL_ENV, postgres_url)
    from scheduler_service.store import get_curve, get_engine, save_curve
    from scheduler_service.worker.store import AllocationRecord, DecisionRecord, ServiceStore

    assert get_engine().dialect.name == "postgresql"
    store = ServiceStore()
    deadline = datetime(2026, 12, 1, 6, 0, tzinfo=timezone.utc)
    store.upsert_job("run-1", RunPhase.ARRIVED, model="mlp", global_batch_size=32, iterations=500, deadline=deadline)
    store.upsert_job("run-1", RunPhase.ADMITTED, share=2)
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


def test_a_curve_store_from_before_kinds_is_upgraded_on_postgresql(postgres_url: str) -> None:
    from sqlalchemy import create_engine, text

    from scheduler_service.store import get_curves, get_engine, save_curve

    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text("CREATE DATABASE before_kinds"))
    admin.dispose()
    url = postgres_url.rsplit("/", 1)[0] + "/before_kinds"
    old = create_engine(url)
    with old.begin() as conn:
        conn.execute(text(
            "CREATE TABLE throughput_measurement (id SERIAL PRIMARY KEY, model VARCHAR NOT NULL, "
            "global_batch_size INTEGER NOT NULL, gpus INTEGER NOT NULL, iterations_per_s FLOAT NOT NULL, "
            "device VARCHAR NOT NULL, measured_at TIMESTAMP NOT NULL, "
            "CONSTRAINT uq_throughput_point UNIQUE (model, global_batch_size, gpus))"))
        conn.execute(text("CREATE INDEX ix_throughput_measurement_model ON throughput_measurement (model)"))
        conn.execute(text("INSERT INTO throughput_measurement (model, global_batch_size, gpus, iterations_per_s, "
                          "device, measured_at) VALUES ('mlp', 32, 1, 10.0, 'cpu', now())"))
    old.dispose()
    engine = get_engine(url)
    save_curve("mlp", 32, {1: 3.0}, engine=engine, kind="T4")
    assert get_curves("mlp", 32, engine) == {"": {1: 10.0}, "T4": {1: 3.0}}
