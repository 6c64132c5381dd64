"""`train_model` and the example pipeline against the real stack: a Prefect
server, the `elasticflow` worker as its own process, `train/mlp` on 2 CPU slots
with a seeded throughput curve (20 it/s on one slot, 36 on two)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from prefect import flow, task

from elasticflow_block import HistoryPolicy, TrainingFailed, TrainingRejected, train_model
from elasticflow_block.pipeline import learn_steps
from tests.stack import Stack, flow_run_states, wait_until

pytestmark = pytest.mark.slow


@flow(name="too-ambitious")
def too_ambitious() -> None:
    # 1e7 iterations at 36 it/s is about 77 hours; the SLA leaves 60 s.
    train_model("mlp", {"global_batch_size": 32}, sla="+3m", downstream={"evaluate": 60.0},
                iterations=10**7, margin=timedelta(seconds=60), poll_interval_s=0.5)


def test_a_rejected_deadline_raises_the_typed_error_with_reason_and_earliest_deadline(stack: Stack) -> None:
    started = datetime.now(timezone.utc)
    with pytest.raises(TrainingRejected) as caught:
        too_ambitious()
    rejected = caught.value
    assert rejected.reason == "infeasible_even_on_an_idle_cluster"
    assert rejected.message.startswith("This run needs about")  # in plain words first, then the policy's detail
    assert " — infeasible_even_on_an_idle_cluster: " in rejected.message
    assert rejected.earliest_feasible_deadline is not None
    assert 70 * 3600 < (rejected.earliest_feasible_deadline - started).total_seconds() < 90 * 3600
    assert rejected.earliest_feasible_sla == rejected.earliest_feasible_deadline + timedelta(minutes=2)
    assert rejected.plan is not None and rejected.plan.deadline < started + timedelta(minutes=2)
    run = stack.flow_run(rejected.flow_run_id)
    assert run.state.name == "Rejected" and run.parent_task_run_id is not None  # a subflow run of the caller


@flow(name="impatient")
def impatient() -> None:
    train_model("mlp", {"global_batch_size": 32}, sla="+60m", iterations=20000, timeout_s=3, poll_interval_s=0.5)


def test_a_step_that_stops_waiting_cancels_its_training_run(stack: Stack) -> None:
    with pytest.raises(TrainingFailed, match="not finished within timeout_s=3; it was cancelled") as caught:
        impatient()
    run = stack.wait_final(str(caught.value.flow_run_id), 90)
    assert run.state.is_cancelled() and run.state.name != "Rejected", f"{run.state!r}"


@task(name="evaluate")
def _evaluate_probe(seconds: float) -> None:
    time.sleep(seconds)


@flow(name="history-probe")
def _history_probe(seconds: float) -> None:
    _evaluate_probe(seconds)


def test_downstream_times_are_learned_from_completed_task_runs_of_the_flow(stack: Stack) -> None:
    for seconds in (0.2, 0.4, 0.3):
        _history_probe(seconds)
    policy = HistoryPolicy(statistic="max", safety_factor=2.0, fallback=timedelta(minutes=3))
    evaluate, register = learn_steps(["evaluate", "register"], policy, "history-probe")
    assert evaluate.source == "history" and evaluate.samples == 3
    assert timedelta(seconds=0.8) <= evaluate.expected < timedelta(seconds=3)  # max 0.4 s (+ overhead) x 2
    assert (register.source, register.expected) == ("fallback", timedelta(minutes=3))
    (elsewhere,) = learn_steps(["evaluate"], policy, "another-pipeline")  # another flow's history is not ours
    assert elsewhere.source == "fallback"


def test_the_daily_pipeline_trains_admitted_evaluates_the_checkpoint_and_registers_it(pipeline_stack: Stack) -> None:
    from prefect.deployments import run_deployment

    from elasticflow_block.prefect_client import sync_client

    stack = pipeline_stack
    with sync_client() as client:
        deployment = client.read_deployment_by_name("pipeline/daily")
        runs_before = {str(r.id) for r in client.read_flow_runs()}
    assert deployment.work_pool_name == "gpus" and deployment.parameters == {"sla": "06:00Z"}
    # off until the user turns it on (prefect.yaml: active: false)
    assert [(s.schedule.cron, s.active) for s in deployment.schedules] == [("0 1 * * *", False)]

    pipeline = run_deployment("pipeline/daily", parameters={"sla": "+5m"}, timeout=0)
    done = stack.wait_final(str(pipeline.id), 240)  # ~100 s on two cores shared with other suites
    assert done.state.is_completed(), f"{done.state!r}\n{stack.log_tail()}"

    latest = json.loads((stack.home / "registry" / "mlp" / "latest.json").read_text())
    assert latest["pipeline_flow_run_id"] == str(pipeline.id)
    assert latest["met_sla"] is True and latest["iteration"] == 300
    assert latest["metrics"]["accuracy"] > 0.3  # ten classes: chance is 0.1
    assert Path(latest["checkpoint"]).exists()
    assert datetime.fromisoformat(latest["training_deadline"]) < datetime.fromisoformat(latest["sla"])

    train = stack.flow_run(latest["train_flow_run_id"])
    assert str(train.id) not in runs_before
    assert train.state.is_completed() and train.labels.get("elasticflow.mss") not in (None, "best-effort")
    with sync_client() as client:
        parent = client.read_task_run(train.parent_task_run_id)
        evaluate = [t for t in client.read_task_runs() if t.flow_run_id == pipeline.id and t.name.startswith("evaluate")]
    assert parent.flow_run_id == pipeline.id  # the training run is a subflow of the pipeline run
    assert evaluate and evaluate[0].state.is_completed()


def test_cancelling_the_pipeline_cancels_the_training_run_it_waits_for(pipeline_stack: Stack) -> None:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.deployments import run_deployment
    from prefect.states import Cancelling

    from elasticflow_block.prefect_client import sync_client

    stack = pipeline_stack
    pipeline = run_deployment("pipeline/daily", parameters={"sla": "+60m", "iterations": 20000}, timeout=0)

    def training_run() -> Any:
        with sync_client() as client:
            children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[pipeline.id])))
        return children[0] if children else None

    train = stack.wait_until(training_run, 150, "the pipeline to submit its training run")
    status = stack.home / "control" / str(train.id) / "status.json"
    stack.wait_until(lambda: status.exists() and json.loads(status.read_text()).get("iteration", 0) > 0, 150,
                     "the training run to train")
    with sync_client() as client:
        client.set_flow_run_state(pipeline.id, Cancelling(message="SLA dropped"), force=True)
    assert stack.wait_final(str(pipeline.id), 90).state.is_cancelled()
    train = stack.wait_final(str(train.id), 90)
    assert (train.state.type.value, train.state.name) == ("CANCELLED", "Cancelled"), f"{train.state!r}"
    why = [s.message for s in flow_run_states(str(train.id)) if s.name == "Cancelling"]
    assert why and why[0].startswith("the pipeline step waiting for it stopped (TerminationSignal")


def test_a_daily_run_started_late_counts_its_sla_from_when_it_was_due_and_says_it_is_too_late(
    pipeline_stack: Stack,
) -> None:
    """Due 2 h ago with a one-hour SLA: the SLA passed an hour ago. The run must
    fail saying so, not move its SLA to an hour from now."""
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
    )
    from prefect.deployments import run_deployment

    from elasticflow_block.prefect_client import sync_client

    stack = pipeline_stack
    late = run_deployment("pipeline/daily", parameters={"sla": "+1h"}, timeout=0,
                          scheduled_time=datetime.now(timezone.utc) - timedelta(hours=2))
    run = stack.wait_final(str(late.id), 180)
    assert run.state.is_failed() and run.state.name == "SLATooClose", f"{run.state!r}"
    assert "leaves no time to train" in run.state.message
    _assert_logs_without_traceback(str(late.id), "leaves no time to train")
    with sync_client() as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[late.id])))
        children = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[late.id])))
    (artifact,) = [a for a in artifacts if a.key == "pipeline-training-rejected"]
    assert "no time left to train" in str(artifact.data) and "leaves no time to train" in str(artifact.data)
    assert children == []  # nothing was submitted


def _assert_logs_without_traceback(run_id: str, says: str) -> None:
    """The run's logs (its tasks' too) say why, and hold no traceback: an expected refusal is no crash."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from elasticflow_block.prefect_client import sync_client

    def logs() -> list[str] | None:
        with sync_client() as client:
            found = [log.message for log in client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))]  # type: ignore[list-item]
        return found if any("Finished in state" in m and "type=FAILED" in m for m in found) else None

    messages = wait_until(logs, 30, "the pipeline run's last log lines")
    assert any(says in m for m in messages), messages
    assert not [m for m in messages if "Traceback" in m], messages


def test_a_rejected_pipeline_fails_by_name_with_the_reason_and_no_traceback(pipeline_stack: Stack) -> None:
    from prefect.deployments import run_deployment

    # 1e7 iterations cannot be trained by any SLA minutes away: the worker rejects it at once.
    rejected = run_deployment("pipeline/daily", parameters={"sla": "+10m", "iterations": 10**7}, timeout=0)
    run = pipeline_stack.wait_final(str(rejected.id), 180)
    assert run.state.is_failed() and run.state.name == "TrainingRejected", f"{run.state!r}"
    assert "infeasible_even_on_an_idle_cluster" in run.state.message
    assert "earliest feasible SLA" in run.state.message
    _assert_logs_without_traceback(str(rejected.id), "infeasible_even_on_an_idle_cluster")
