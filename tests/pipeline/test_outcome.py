"""How a finished train flow run becomes a model or a typed error (real Prefect
state objects and a real checkpoint store on disk; no server needed)."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from prefect.client.schemas.objects import FlowRun
from prefect.states import Cancelled, Completed, Crashed, Failed, Scheduled

from elasticflow_block.deadline import derive_deadline
from elasticflow_block.pipeline import TrainingFailed, TrainingRejected, TrainRequest, _outcome
from elasticflow_block.storage import CheckpointStorage

NOW = datetime(2026, 11, 30, 15, 0, tzinfo=timezone.utc)
PLAN = derive_deadline(NOW + timedelta(hours=2), [], NOW)
REQUEST = TrainRequest(model="mlp", sla=PLAN.sla, iterations=20, deployment="train/mlp")


def _run(state: object, store: Path | None = None) -> FlowRun:
    parameters = {"model": "mlp", "iterations": 20}
    if store is not None:
        parameters["checkpoint_store"] = str(store)
    return FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), state=state, parameters=parameters)  # type: ignore[arg-type]


def test_completed_run_gives_its_newest_checkpoint(tmp_path: Path) -> None:
    run = _run(Completed(), tmp_path)
    storage = CheckpointStorage(str(tmp_path))
    for iteration in (10, 20):
        storage.save(str(run.id), iteration, {"model": {}, "iteration": iteration})
    trained = _outcome(run, REQUEST, PLAN)
    assert (trained.run_key, trained.iteration) == (str(run.id), 20)
    assert Path(trained.checkpoint) == tmp_path / str(run.id) / "ckpt-0000000020.pt"
    assert trained.load_state()["iteration"] == 20
    assert trained.deadline == PLAN.deadline


def test_completed_without_a_checkpoint_or_short_of_its_iterations_is_a_failure(tmp_path: Path) -> None:
    with pytest.raises(TrainingFailed, match="ELASTICFLOW_HOME"):
        _outcome(_run(Completed(), tmp_path), REQUEST, PLAN)
    stopped = _run(Completed(), tmp_path)
    CheckpointStorage(str(tmp_path)).save(str(stopped.id), 12, {"iteration": 12})
    with pytest.raises(TrainingFailed, match="12/20"):
        _outcome(stopped, REQUEST, PLAN)


def test_a_run_given_in_epochs_is_held_to_the_total_it_reported(tmp_path: Path) -> None:
    by_epochs = REQUEST.model_copy(update={"iterations": None, "epochs": 2.0})
    run = _run(Completed(), tmp_path)
    CheckpointStorage(str(tmp_path)).save(str(run.id), 30, {"iteration": 30})
    run.labels["elasticflow.total_iterations"] = "64"  # what the flow reports as it trains
    with pytest.raises(TrainingFailed, match="30/64"):
        _outcome(run, by_epochs, PLAN)
    run.labels["elasticflow.total_iterations"] = "30"
    assert _outcome(run, by_epochs, PLAN).iteration == 30


def test_rejected_runs_raise_the_typed_rejection() -> None:
    message = "gpus_reserved_by_admitted_jobs: 3 runs hold them; earliest feasible deadline 2026-11-30T19:00:00+00:00"
    run = _run(Cancelled(name="Rejected", message=message))
    with pytest.raises(TrainingRejected) as caught:
        _outcome(run, REQUEST, PLAN)
    assert caught.value.reason == "gpus_reserved_by_admitted_jobs"
    assert caught.value.earliest_feasible_deadline == datetime(2026, 11, 30, 19, tzinfo=timezone.utc)
    assert caught.value.flow_run_id == str(run.id) and caught.value.message == message


@pytest.mark.parametrize(
    "state",
    [Failed(message="boom"), Crashed(message="exit 137"), Cancelled(message="changed my mind"), Scheduled()],
    ids=["failed", "crashed", "cancelled-by-a-person", "not-finished"],
)
def test_other_ends_raise_training_failed_not_rejected(state: object) -> None:
    with pytest.raises(TrainingFailed) as caught:
        _outcome(_run(state), REQUEST, PLAN)
    assert not isinstance(caught.value, TrainingRejected)
    assert str(caught.value)
