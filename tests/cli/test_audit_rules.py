"""The audit's rules over a real store on disk: what chaos asserts on."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from flows.training.control import FileControlChannel
from scheduler_service.contracts import RunPhase
from scheduler_service.stack.audit import PrefectRun, Problem, audit


@pytest.mark.parametrize(("iteration", "flagged"), [(1000, True), (400, False)])
def test_a_run_that_trained_every_iteration_yet_failed_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 iteration: int, flagged: bool) -> None:
    """A stop once killed a run's flow process just after its last iteration
    and the next start called it failed: the audit names such a run, and not
    one that failed midway."""
    from scheduler_service.store.db import get_engine
    from scheduler_service.worker.store import ServiceStore

    monkeypatch.delenv("ELASTICFLOW_DATABASE_URL", raising=False)
    store = ServiceStore(get_engine(f"sqlite:///{tmp_path / 'elasticflow.db'}"))
    store.upsert_job("r1", RunPhase.FINISHED, flow_run_name="calm-otter", model="mlp", global_batch_size=32,
                     iterations=1000, outcome="failed", submitted_at=datetime.now(timezone.utc))
    FileControlChannel("r1", tmp_path / "control").publish_status({"iteration": iteration, "total_iterations": 1000,
                                                                   "event": "completed"})
    long_ago = datetime.now(timezone.utc) - timedelta(minutes=5)
    crashed = PrefectRun(id="r1", state_type="CRASHED", state_name="Crashed", final=True, since=long_ago)
    found = audit(tmp_path, [crashed], {"r1": 1})
    assert [v.problem for v in found.violations] == ([Problem.TRAINED_BUT_FAILED] if flagged else [])


@pytest.mark.parametrize(("state_type", "flagged"), [("CANCELLED", False), ("COMPLETED", True), ("SCHEDULED", False)])
def test_a_run_the_store_never_took_in_is_lost_unless_cancelled_first_or_still_waiting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, state_type: str, flagged: bool) -> None:
    """Chaos on Ray cancelled three runs while the worker was down: they never
    reached the scheduler, and the audit must not call them lost; a run that
    ran (Completed) with no record of the scheduler's is."""
    from scheduler_service.store.db import get_engine
    from scheduler_service.worker.store import ServiceStore

    monkeypatch.delenv("ELASTICFLOW_DATABASE_URL", raising=False)
    ServiceStore(get_engine(f"sqlite:///{tmp_path / 'elasticflow.db'}"))
    long_ago = datetime.now(timezone.utc) - timedelta(minutes=5)
    run = PrefectRun(id="r1", state_type=state_type, state_name=state_type.title(),
                     final=state_type != "SCHEDULED", since=long_ago)
    found = audit(tmp_path, [run], {})
    assert [v.problem for v in found.violations] == ([Problem.LOST] if flagged else [])


def test_a_run_decided_while_the_audit_reads_has_its_one_decision(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Chaos once counted a run admitted with 0 decisions: the decision rows
    were read, then the worker decided the run (decision and phase in one
    write), then the runs' phases were read. The decisions are read after the
    phases, so a run seen decided is seen with its decision."""
    from scheduler_service.stack import audit as audit_module
    from scheduler_service.store.db import get_engine
    from scheduler_service.worker.store import DecisionRecord, ServiceStore

    monkeypatch.delenv("ELASTICFLOW_DATABASE_URL", raising=False)
    store = ServiceStore(get_engine(f"sqlite:///{tmp_path / 'elasticflow.db'}"))
    store.upsert_job("r1", RunPhase.ARRIVED, flow_run_name="calm-otter", model="mlp", global_batch_size=32,
                     iterations=1000, submitted_at=datetime.now(timezone.utc))
    read_phases = audit_module.report

    def the_worker_decides_first(home: Path) -> object:  # the worker's write lands just before this read
        store.decided(DecisionRecord(flow_run_id="r1", admitted=True, reason="admitted", share=1), RunPhase.ADMITTED)
        return read_phases(home)

    monkeypatch.setattr(audit_module, "report", the_worker_decides_first)
    long_ago = datetime.now(timezone.utc) - timedelta(minutes=5)
    run = PrefectRun(id="r1", state_type="SCHEDULED", state_name="Admitted", final=False, since=long_ago)
    found = audit(tmp_path, [run])
    assert Problem.DECISIONS not in [v.problem for v in found.violations], found.lines()
