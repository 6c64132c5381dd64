from datetime import datetime, timedelta, timezone

import pytest
from pydantic import ValidationError

from flows.training.params import TrainParameters, parse_deadline

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)


def test_defaults_are_a_runnable_job() -> None:
    params = TrainParameters()
    assert params.model == "resnet"
    assert params.dataset is not None and params.dataset.name == "synthetic-images"
    assert params.best_effort is True  # no deadline given
    assert params.total_iterations(1024) == 32  # one epoch at global batch 32


def test_unknown_model_lists_the_known_ones() -> None:
    with pytest.raises(ValidationError) as err:
        TrainParameters(model="resnet50x")
    message = str(err.value)
    assert "unknown model 'resnet50x'" in message
    for name in ("mlp", "resnet", "transformer", "vgg"):
        assert name in message


def test_unknown_dataset_lists_the_known_ones() -> None:
    with pytest.raises(ValidationError, match="known datasets: .*cifar10"):
        TrainParameters(model="mlp", dataset="imagenet")


def test_on_disk_dataset_needs_an_existing_path(tmp_path) -> None:
    with pytest.raises(ValidationError, match="does not exist"):
        TrainParameters(model="mlp", dataset=f"npz:{tmp_path / 'missing.npz'}")


def test_deadline_in_the_past_is_an_error() -> None:
    with pytest.raises(ValidationError, match="in the past"):
        TrainParameters(deadline="2020-01-01T00:00:00Z")


def test_naive_deadline_is_refused() -> None:
    with pytest.raises(ValidationError, match="no time zone"):
        TrainParameters(deadline="2099-01-01T00:00:00")


def test_relative_and_absolute_deadlines() -> None:
    assert parse_deadline("+2h", NOW) == NOW + timedelta(hours=2)
    assert parse_deadline("+1h30m", NOW) == NOW + timedelta(minutes=90)
    assert parse_deadline("2026-12-01T18:00:00+01:00", NOW) == datetime(2026, 12, 1, 17, 0, tzinfo=timezone.utc)
    params = TrainParameters.model_validate({"deadline": "+45m"}, context={"now": NOW})
    assert params.deadline == NOW + timedelta(minutes=45) and params.best_effort is False
    with pytest.raises(ValueError, match="neither ISO-8601"):
        parse_deadline("tomorrow", NOW)


def test_best_effort_with_a_deadline_is_contradictory() -> None:
    with pytest.raises(ValidationError, match="best-effort"):
        TrainParameters(deadline="+1h", best_effort=True)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"gpu_plan": [[0, 1], [0]]}, "switch_at needs one iteration per GPU-set change"),
        ({"gpu_plan": [[0, 1], [0], [1]], "switch_at": [5, 5]}, "strictly increasing"),
        ({"gpu_plan": [[0, 0]]}, "distinct"),
        ({"gpu_plan": [[]]}, "at least one GPU"),
        ({"hyperparameters": {"global_batch_size": 2}, "gpu_plan": [[0, 1, 2, 3]]}, "smaller than the largest GPU set"),
        ({"hyperparameters": {"learning_rate": -1}}, "greater than 0"),
        ({"hyperparameters": {"optimiser": "sgd"}}, "Extra inputs are not permitted"),
        ({"iterations": 10, "epochs": 1}, "not both"),
    ],
)
def test_bad_values_fail_fast(fields: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TrainParameters(**fields)


def test_gpu_plan_lookup() -> None:
    params = TrainParameters(gpu_plan=[[0, 1], [0, 1, 2, 3], [0]], switch_at=[5, 10])
    assert params.planned_gpus(0) == ([0, 1], 5)
    assert params.planned_gpus(7) == ([0, 1, 2, 3], 10)
    assert params.planned_gpus(10) == ([0], None)


def test_user_model_needs_a_dataset() -> None:
    with pytest.raises(ValidationError, match="explicit dataset"):
        TrainParameters(model="tests.runtime.user_models:tiny_classifier")
    params = TrainParameters(model="tests.runtime.user_models:tiny_classifier", dataset="synthetic-vectors")
    assert params.dataset is not None and params.dataset.name == "synthetic-vectors"


def test_an_admitted_run_that_starts_after_its_deadline_still_validates() -> None:
    # The scheduler checked the deadline on arrival; a late start is late, not invalid.
    late = TrainParameters.model_validate(
        {"model": "mlp", "iterations": 10, "deadline": "2020-01-01T00:00:00Z"}, context={"admitted": True}
    )
    assert late.deadline is not None and late.deadline.year == 2020
