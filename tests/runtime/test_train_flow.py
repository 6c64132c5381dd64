"""The `train` flow end to end against a real temporary Prefect server."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest

from tests.stack import wait_for_events

pytestmark = pytest.mark.slow


def _events(flow_run_id: str, timeout_s: float = 20.0) -> list[dict]:
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()

    def completed(events: list[dict]) -> bool:
        return any(e["event"] == "elasticflow.training.completed" for e in events)

    return wait_for_events(flow_run_id, "elasticflow.training.", timeout_s, until=completed)


def test_train_flow_runs_resizes_and_reports(prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId

    from elasticflow_block.prefect_client import sync_client
    from flows.train import train
    from flows.training.control import FileControlChannel
    from flows.training.launch.spec import LaunchSpec

    # The GPU plan and the control channel are the runtime's, not the user's: no flow parameters.
    spec = LaunchSpec(gpu_plan=[[0, 1], [0]], switch_at=[20], control_dir=str(tmp_path / "control"))
    monkeypatch.setenv(*next(iter(spec.to_env().items())))
    state = train(
        model="mlp",
        hyperparameters={"global_batch_size": 16},
        iterations=40,
        deadline="+2h",
        checkpoint_interval=10,
        checkpoint_store=str(tmp_path / "checkpoints"),
        device="cpu",
        return_state=True,
    )
    assert state.is_completed(), state.message
    result = state.result()
    assert result.status == "completed" and result.iterations == 40 and len(result.losses) == 40
    assert [s.gpus for s in result.segments] == [[0, 1], [0]]
    flow_run_id = str(state.state_details.flow_run_id)
    assert result.run_key == flow_run_id  # checkpoints and control are keyed by flow run

    with sync_client() as client:
        run = client.read_flow_run(uuid.UUID(flow_run_id))
        # Task runs reach the server as events, ingested asynchronously: wait for both.
        deadline = time.time() + 30
        while True:
            tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
            if len(tasks) >= 2 and all(t.state and t.state.is_completed() for t in tasks) or time.time() > deadline:
                break
            time.sleep(0.5)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
    assert run.labels["elasticflow.iteration"] == "40"
    assert run.labels["elasticflow.gpus"] == "0"
    assert run.labels["elasticflow.on_track"] == "true"
    assert "elasticflow.projected_finish" in run.labels
    assert sorted(t.name for t in tasks) == ["segment-0-it0-gpus0_1", "segment-1-it20-gpus0"]
    assert all(t.state.is_completed() for t in tasks)
    # A segment that ends mid-run does not read as the run finishing ("Finished in state Completed()").
    ended = {t.name: (t.state.name, t.state.message) for t in tasks}
    assert ended["segment-0-it0-gpus0_1"] == ("Segment ended", "iterations 0-20 on GPUs 0,1: its GPUs change")
    assert ended["segment-1-it20-gpus0"] == ("Segment ended", "iterations 20-40 on GPUs 0: the run's last iteration")
    progress = [a for a in artifacts if a.type == "progress"]
    assert progress and progress[-1].data == 100.0

    names = {e["event"] for e in _events(flow_run_id)}
    assert {
        "elasticflow.training.segment.started",
        "elasticflow.training.rescaled",
        "elasticflow.training.completed",
    } <= names

    status = FileControlChannel(flow_run_id, tmp_path / "control").status()
    assert status is not None and status.iteration == 40


def test_bad_parameters_fail_the_flow_before_training(prefect_api: str, tmp_path: Path) -> None:
    from flows.train import train

    state = train(model="resnet-50", checkpoint_store=str(tmp_path), return_state=True)
    assert state.is_failed()
    assert "known models: mlp, resnet, transformer, vgg" in state.message
    assert not list(tmp_path.iterdir())  # nothing launched, nothing written
    past = train(model="mlp", deadline="2001-01-01T00:00:00Z", return_state=True)
    assert past.is_failed() and "in the past" in past.message


def test_a_saved_checkpoint_store_block_is_found_by_name(prefect_api: str, tmp_path: Path) -> None:
    from elasticflow_block import CheckpointStore
    from elasticflow_block.storage import resolve_checkpoint_url

    CheckpointStore(url=str(tmp_path / "store"), keep=2).save("runtime-test-store", overwrite=True)
    assert resolve_checkpoint_url("runtime-test-store") == str(tmp_path / "store")
    assert resolve_checkpoint_url(str(tmp_path / "direct")) == str(tmp_path / "direct")  # paths pass through


def test_a_store_that_takes_no_save_fails_the_run_with_the_path_in_its_prefect_logs(
    prefect_api: str, tmp_path: Path
) -> None:
    """Issue 29, 1: every save refused (the store's folder is a file, which
    stops root too) ends the run Failed after three, with the folder named in
    the run's Prefect logs; the segment's task is Failed, and the outcome the
    service reports for it is `failed`, never `met`."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    from elasticflow_block.prefect_client import sync_client
    from flows.train import train
    from scheduler_service.contracts import Outcome, outcome_of
    from tests.stack import wait_until

    store = tmp_path / "checkpoints"
    store.write_text("not a folder")
    state = train(model="mlp", hyperparameters={"global_batch_size": 16}, iterations=400, deadline="+2h",
                  checkpoint_interval=10, checkpoint_store=str(store), device="cpu", return_state=True)
    assert state.is_failed(), state
    assert f"checkpoint save to {store}/" in state.message and "failed (3 in a row)" in state.message
    run_id = str(state.state_details.flow_run_id)
    assert outcome_of(state.type.value, 400, 400, time.time() + 3600, time.time()) is Outcome.FAILED

    def logs() -> list[str] | None:
        with sync_client() as client:
            found = [log.message for log in client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[uuid.UUID(run_id)])))]
        return found if any("training goes on where it is" in m for m in found) else None

    messages = wait_until(logs, 30, "the run's log line about the failing save")
    assert any(f"checkpoint save to {store}/{run_id} failed" in m for m in messages), messages

    def failed_tasks() -> list | None:  # task runs reach the server as events, ingested asynchronously
        with sync_client() as client:
            tasks = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(run_id)])))
        return tasks if tasks and all(t.state is not None and t.state.is_final() for t in tasks) else None

    tasks = wait_until(failed_tasks, 30, "the segment's task in a final state")
    assert all(t.state.is_failed() for t in tasks), [t.state for t in tasks]


def test_training_that_fails_while_the_stack_stops_under_it_pauses(
        prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chaos on Ray: three admitted runs ended failed at iteration 0 after a stop of `up`, which
    tears its local Ray cluster down (a run joining it then cannot). Failing while the stack stops
    is the stop's doing: the run pauses, to go on at the next start, as a SIGTERM then does."""
    from elasticflow_block.prefect_client import sync_client

    from prefect.exceptions import Pause

    from flows import train as train_module
    from flows.training.launch.pause import clear_stopping, mark_stopping

    home = tmp_path / "home"
    monkeypatch.setenv("ELASTICFLOW_HOME", str(home))

    keys: list[str] = []

    def torn_down(params: object, run_key: str, **kwargs: object) -> None:
        keys.append(run_key)
        raise ConnectionError("the Ray cluster at 127.0.0.1:6379 is gone")

    monkeypatch.setattr(train_module, "run_training", torn_down)
    run = dict(model="mlp", iterations=5, device="cpu", checkpoint_store=str(tmp_path / "ck"), return_state=True)
    mark_stopping(home)
    with pytest.raises(Pause):  # in this process, the engine hands the pause back to its caller
        train_module.train(**run)
    with sync_client() as client:
        state = client.read_flow_run(keys[-1]).state  # type: ignore[arg-type]
    assert state is not None and state.is_scheduled() and state.name == "Resuming", state
    clear_stopping(home)  # the same failure with no stop under way is the run's own
    assert train_module.train(**run).is_failed()
