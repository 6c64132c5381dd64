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
