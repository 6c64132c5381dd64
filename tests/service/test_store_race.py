"""Two processes opening a fresh store at once both create its tables (issue 14)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path


def _open(url: str, barrier: "multiprocessing.synchronize.Barrier", out: "multiprocessing.Queue[str]") -> None:
    from scheduler_service.store.db import _engine_for

    barrier.wait()
    try:
        _engine_for(url)
        out.put("ok")
    except Exception as exc:  # noqa: BLE001  # what the test reports
        out.put(f"{type(exc).__name__}: {exc}"[:300])


def test_processes_opening_a_fresh_sqlite_store_at_once_all_get_it(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    for trial in range(3):
        url = f"sqlite:///{tmp_path / f'store{trial}.db'}"
        barrier, out = context.Barrier(6), context.Queue()
        procs = [context.Process(target=_open, args=(url, barrier, out)) for _ in range(6)]
        for proc in procs:
            proc.start()
        results = [out.get(timeout=120) for _ in procs]
        for proc in procs:
            proc.join(timeout=30)
        assert results == ["ok"] * 6, results
