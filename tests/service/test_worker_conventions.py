"""Prefect's conventions, as its own workers follow them: the pool's template
and the flow's parameters show only what a user sets, decisions are events
related to the worker and the work pool, a rejection is readable by programs
from the run's labels, and the infrastructure id names where a run lives."""

from __future__ import annotations

import socket

import pytest

from tests.stack import Stack


def test_the_pool_template_and_the_flow_parameters_are_what_a_user_sets() -> None:
    from flows.train import train
    from scheduler_service.worker.worker import ElasticFlowWorker

    variables = ElasticFlowWorker.get_default_base_job_template()["variables"]["properties"]
    assert not {"gpus", "world_size", "nodes"} & set(variables)  # the scheduler's, never the user's
    assert "stream_output" in variables
    parameters = set(train.parameters.properties)
    assert not {"gpu_plan", "switch_at", "control_dir", "run_key"} & parameters
    assert {"model", "hyperparameters", "iterations", "epochs", "deadline", "checkpoint_store"} <= parameters


@pytest.mark.slow
def test_a_rejection_is_an_event_of_the_pool_and_labels_a_program_reads(stack: Stack) -> None:
    from scheduler_service.contracts import Rejection

    run_id = stack.submit(iterations=100, deadline="2001-01-01T00:00:00Z")
    run = stack.wait_final(run_id, 60)
    assert run.state.name == "Rejected"
    rejection = Rejection.from_labels(run.labels, run.state.message)
    assert rejection.reason == "deadline_passed" and rejection.earliest_feasible_deadline is not None
    (event,) = [e for e in stack.events(run_id, "elasticflow.decision")]
    roles = {r["prefect.resource.role"] for r in event["related"]}
    assert {"work-pool", "worker"} <= roles


@pytest.mark.slow
def test_a_launched_run_is_recorded_where_it_lives(stack: Stack) -> None:
    run_id = stack.submit(iterations=50)
    run = stack.wait_final(run_id, 180)
    assert run.state.is_completed(), run.state
    host, _, pid = str(run.infrastructure_pid).rpartition(":")
    assert host == socket.gethostname() and pid.isdigit()
