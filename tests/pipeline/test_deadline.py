"""The training deadline derived from a pipeline SLA: pure functions, no Prefect server."""

from __future__ import annotations

import pickle
from datetime import datetime, timedelta, timezone

import pytest

from scheduler_service.contracts import Rejection, RejectionReason
from elasticflow_block.deadline import (
    DownstreamStep,
    HistoryPolicy,
    SLATooClose,
    derive_deadline,
    expected_duration,
    given_steps,
    percentile,
    resolve_sla,
    step_from_history,
)
from elasticflow_block.pipeline import (
    TrainingRejected,
    TrainRequest,
    _split_downstream,
    train_model,
)

NOW = datetime(2026, 11, 30, 15, 0, tzinfo=timezone.utc)
SLA = datetime(2026, 12, 1, 6, 0, tzinfo=timezone.utc)


def test_deadline_is_the_sla_minus_the_downstream_steps_and_the_margin() -> None:
    steps = given_steps({"evaluate": timedelta(minutes=20), "register": 60.0, "deploy": timedelta(minutes=29)})
    plan = derive_deadline(SLA, steps, NOW, margin=timedelta(minutes=10))
    assert plan.deadline == datetime(2026, 12, 1, 5, 0, tzinfo=timezone.utc)
    assert plan.reserved == timedelta(hours=1)
    assert [s.source for s in plan.downstream] == ["given"] * 3
    assert "register=0:01:00 (given)" in plan.describe()


def test_no_downstream_steps_leaves_only_the_margin() -> None:
    plan = derive_deadline(SLA, [], NOW)
    assert plan.deadline == SLA - timedelta(minutes=1)


def test_an_sla_too_close_raises_before_anything_is_submitted_and_says_why() -> None:
    steps = given_steps({"evaluate": timedelta(minutes=30)})
    with pytest.raises(SLATooClose) as caught:
        derive_deadline(NOW + timedelta(minutes=20), steps, NOW, margin=timedelta(minutes=1))
    error = caught.value
    assert error.plan.deadline == NOW - timedelta(minutes=11)
    assert "evaluate 0:30:00 (given)" in str(error)
    assert (NOW + timedelta(minutes=31)).isoformat() in str(error)  # the earliest SLA that leaves any time
    assert (error.reason, error.earliest_feasible_sla) == ("sla_too_close", NOW + timedelta(minutes=31))
    assert pickle.loads(pickle.dumps(error)).plan == error.plan
    # exactly at now is no time to train either
    with pytest.raises(SLATooClose):
        derive_deadline(NOW + timedelta(minutes=31), steps, NOW, margin=timedelta(minutes=1))


def test_learned_times_use_a_high_percentile_of_recent_runs_times_a_safety_factor() -> None:
    newest_first = [10.0, 12.0, 11.0, 9.0, 13.0, 10.0, 11.0, 12.0, 10.0, 95.0]  # one freak run, the oldest
    p90 = HistoryPolicy(statistic="p90", last_n=20, safety_factor=1.5)
    assert expected_duration(newest_first, p90) == timedelta(seconds=13 * 1.5)  # the freak is the top 10 %
    assert expected_duration(newest_first, HistoryPolicy(statistic="max", safety_factor=1.0)) == timedelta(seconds=95)
    assert expected_duration(newest_first, HistoryPolicy(statistic="p50", safety_factor=1.0)) == timedelta(seconds=11)
    # only the newest last_n count: a step that got faster stops being over-reserved
    assert expected_duration([5.0, 5.0, 300.0], HistoryPolicy(statistic="max", last_n=2, safety_factor=1.0)) == (
        timedelta(seconds=5)
    )
    step = step_from_history("evaluate", newest_first, p90)
    assert (step.source, step.samples, step.statistic) == ("history", 10, "p90")


def test_no_history_falls_back_to_the_stated_default() -> None:
    policy = HistoryPolicy(fallback=timedelta(minutes=7))
    assert expected_duration([], policy) is None
    step = step_from_history("register", [], policy)
    assert step == DownstreamStep(name="register", expected=timedelta(minutes=7), source="fallback")
    plan = derive_deadline(SLA, [step], NOW, margin=timedelta(0))
    assert plan.deadline == SLA - timedelta(minutes=7)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([3.0], 90) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 90) == 90.0
    with pytest.raises(ValueError):
        percentile([], 90)


def test_negative_or_naive_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="negative"):
        given_steps({"evaluate": -1.0})
    with pytest.raises(ValueError, match="aware"):
        derive_deadline(datetime(2026, 12, 1, 6), [], NOW)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2026-12-01T06:00:00Z", SLA),
        ("2026-12-01T07:00:00+01:00", SLA),
        ("+15h", SLA),
        ("+14h60m", SLA),
        ("06:00Z", SLA),  # the next 06:00 UTC after 15:00: tomorrow
        ("16:00:00+00:00", datetime(2026, 11, 30, 16, 0, tzinfo=timezone.utc)),  # later today
        ("15:00Z", datetime(2026, 12, 1, 15, 0, tzinfo=timezone.utc)),  # exactly now: the next one
        ("07:00+01:00", SLA),
    ],
)
def test_sla_forms(value: str, expected: datetime) -> None:
    assert resolve_sla(value, NOW) == expected


@pytest.mark.parametrize("value", ["2026-12-01T06:00:00", "06:00", "tomorrow", datetime(2026, 12, 1, 6)])
def test_sla_without_a_zone_or_unreadable_is_refused(value: object) -> None:
    with pytest.raises(ValueError):
        resolve_sla(value, NOW)  # type: ignore[arg-type]


def test_rejection_messages_parse_into_reason_and_earliest_deadline() -> None:
    rejection = Rejection.from_state_message(
        "infeasible_even_on_an_idle_cluster: 10000000 iterations need 77.2 h on 2 GPUs; "
        "earliest feasible deadline 2026-12-03T20:12:00.500000+00:00"
    )
    reason, earliest = rejection.reason, rejection.earliest_feasible_deadline
    assert reason == "infeasible_even_on_an_idle_cluster"
    assert earliest == datetime(2026, 12, 3, 20, 12, 0, 500000, tzinfo=timezone.utc)
    def parse_rejection(message: str | None) -> tuple[str, datetime | None]:
        rejection = Rejection.from_state_message(message)
        return rejection.reason, rejection.earliest_feasible_deadline

    assert parse_rejection("invalid_parameters: iterations: must be >= 1") == ("invalid_parameters", None)
    assert parse_rejection("something odd happened") == ("unknown", None)
    assert parse_rejection(None) == ("unknown", None)


def test_a_rejection_tells_the_pipeline_the_sla_it_could_promise() -> None:
    plan = derive_deadline(SLA, given_steps({"evaluate": timedelta(minutes=20)}), NOW, margin=timedelta(minutes=5))
    earliest = datetime(2026, 12, 1, 8, 0, tzinfo=timezone.utc)
    error = TrainingRejected("gpus_reserved_by_admitted_jobs: busy; earliest feasible deadline ...", "run-1",
                             RejectionReason.INSUFFICIENT_CAPACITY, earliest, plan)
    # Issue 46: the message read "(RejectionReason.INSUFFICIENT_CAPACITY)", the enum's repr
    assert str(error).startswith("training rejected (gpus_reserved_by_admitted_jobs): ") and "RejectionReason" not in str(error)
    assert error.reason == "gpus_reserved_by_admitted_jobs"
    assert error.earliest_feasible_sla == earliest + timedelta(minutes=25)
    copy = pickle.loads(pickle.dumps(error))  # Prefect may serialise a task's exception
    assert (copy.reason, copy.earliest_feasible_deadline, copy.flow_run_id) == (error.reason, earliest, "run-1")


def test_downstream_given_learned_or_mixed() -> None:
    assert _split_downstream(["evaluate", "register"]) == ({}, ["evaluate", "register"])
    assert _split_downstream({"evaluate": 30, "register": None}) == ({"evaluate": timedelta(seconds=30)}, ["register"])
    with pytest.raises(TypeError):
        _split_downstream("evaluate")


def test_train_parameters_carry_an_absolute_deadline_and_refuse_clashes() -> None:
    request = TrainRequest(model="mlp", hyperparameters={"global_batch_size": 32}, sla=SLA, iterations=100,
                           parameters={"checkpoint_interval": 25, "device": "cpu"}, deployment="train/mlp")
    params = request.train_parameters(datetime(2026, 12, 1, 7, 0, tzinfo=timezone(timedelta(hours=2))))
    assert params == {"checkpoint_interval": 25, "device": "cpu", "model": "mlp",
                      "deadline": "2026-12-01T05:00:00+00:00", "hyperparameters": {"global_batch_size": 32},
                      "iterations": 100}
    clashing = request.model_copy(update={"parameters": {"deadline": "+1h"}})
    with pytest.raises(ValueError, match="deadline"):
        clashing.train_parameters(SLA)


def test_train_model_refuses_a_past_deadline_without_submitting() -> None:
    """No Prefect server is running here: reaching the submission would fail differently."""
    with pytest.raises(SLATooClose):
        train_model.fn("mlp", sla="+30s", downstream={"evaluate": 60.0}, iterations=10, now=NOW)
