"""Take-in without a server: what can only fail later is refused at once,
naming the field, and the refusal says what the run asked for."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from scheduler_service.contracts import RunPhase
from tests.service.offline import Entry, FlowRun, offline_worker

NOW = 1_800_000_000.0


def _take(worker, parameters: dict) -> str:  # type: ignore[no-untyped-def]
    entry = Entry(FlowRun(parameters))
    asyncio.run(worker.take_in.take([entry], NOW))
    return str(entry.flow_run.id)


def test_a_checkpoint_store_block_nobody_saved_is_refused_before_the_run_holds_a_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = offline_worker(tmp_path, monkeypatch)
    run_id = _take(worker, {"model": "mlp", "iterations": 5, "checkpoint_store": "team-store"})
    (decision,) = worker.reporter.store.decisions(run_id)
    assert not decision.admitted and decision.reason == "invalid_parameters"
    assert decision.message.startswith("checkpoint_store: no CheckpointStore block named 'team-store' is saved")
    (row,) = worker.reporter.store.jobs()
    assert row.status == RunPhase.REJECTED and row.model == "mlp"  # shown as what it asked for, rejected


def test_cuda_asked_of_this_cpu_cluster_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    worker = offline_worker(tmp_path, monkeypatch)
    run_id = _take(worker, {"model": "mlp", "iterations": 5, "device": "cuda"})
    (decision,) = worker.reporter.store.decisions(run_id)
    assert decision.reason == "invalid_parameters" and decision.message.startswith("device: 'cuda' was asked")
