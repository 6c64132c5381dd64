"""A burst against the stack with Prefect's server on PostgreSQL (issue 14,
item 5; bench/burst.py prints the 200-run figures): every submission is
created, every run decided, none lost and no GPU double-booked. Latencies are
the benchmark's business, not asserted here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scheduler_service.stack.postgres import NO_POSTGRES, binaries, throwaway_postgres

pytestmark = pytest.mark.slow

RUNS = 30


@pytest.mark.skipif(binaries() is None, reason=NO_POSTGRES)
def test_thirty_concurrent_submissions_on_postgresql_are_all_created_and_decided(tmp_path: Path) -> None:
    from bench.burst import run_burst

    saved = dict(os.environ)  # run_burst and local_stack set the stack's settings in this process
    try:
        with throwaway_postgres() as url:
            burst = run_burst("postgresql", RUNS, tmp_path, url, timeout_s=300)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    report = "\n".join(burst.lines())
    assert len(burst.created) == RUNS and burst.http_503 == 0 and not burst.other_errors, report
    assert len(burst.latencies) == RUNS and burst.lost == 0, report
    assert burst.double_booked == [], report
    assert set(burst.decided_by.values()) <= {"Admitted", "Best-effort", "Rejected", "Profiling", "Waiting"}, report
