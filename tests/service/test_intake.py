"""Take-in without a server: a flow run's parameters become a policy job in
one place, and the two deadlines (the user's, the plan's) move by one
function each."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from scheduler_service.loop.deadlines import (
    SafetyMargin,
    plan_deadline_for,
    user_deadline_for,
)
from scheduler_service.loop.run import LoopRun
from scheduler_service.worker.intake import InvalidRun, arrival, new_run, read_request, usable_points

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc).timestamp()


def test_a_relative_deadline_is_the_users_from_submission_and_a_past_one_reaches_the_policy() -> None:
    request = read_request({"model": "mlp", "iterations": 100, "deadline": "+10m"}, NOW)
    assert request.deadline == NOW + 600 and request.iterations == 100.0
    past = read_request({"model": "mlp", "iterations": 100, "deadline": "2001-01-01T00:00:00Z"}, NOW)
    assert past.deadline is not None and past.deadline < NOW  # the policy says why, with the earliest deadline
    assert read_request({"model": "mlp", "iterations": 5}, NOW).deadline is None  # best-effort


@pytest.mark.parametrize(("parameters", "names"), [
    ({"model": "mlp", "iterations": 0}, "iterations:"),
    ({"model": "resnet-50"}, "model:"),
    ({"model": "mlp", "iterations": 5, "deadline": "tomorrow"}, "deadline:"),
    ({"model": "mlp", "iterations": 5, "hyperparameters": {"global_batch_size": "big"}},
     "hyperparameters.global_batch_size:"),
])
def test_a_bad_parameter_is_an_invalid_run_naming_the_field(parameters: dict[str, object], names: str) -> None:
    with pytest.raises(InvalidRun) as caught:
        read_request(parameters, NOW)
    assert str(caught.value).startswith(names)


def test_a_run_uses_no_more_gpus_than_its_batch_has_samples() -> None:
    assert usable_points({1: 10.0, 2: 19.0, 4: 35.0, 8: 0.0}, batch_size=2, max_job_gpus=8) == {1: 10.0, 2: 19.0}


def test_the_launch_reserve_and_the_margin_move_only_the_plan_deadline(
        tmp_path: object) -> None:
    margin = SafetyMargin(fraction=0.05, floor_s=2.0)
    assert plan_deadline_for(None, NOW, 12.0, margin) is None
    assert plan_deadline_for(NOW + 600, NOW, 12.0) == NOW + 588
    assert plan_deadline_for(NOW + 600, NOW, 12.0, margin) == NOW + 600 - 12 - 30  # 5% of a 10-minute window
    assert plan_deadline_for(NOW + 20, NOW, 12.0, margin) == NOW + 20 - 12 - 2  # at least a slot
    for deadline in (NOW + 20, NOW + 600, NOW + 86400):  # the inverse, on both sides of the floor
        plan = plan_deadline_for(deadline, NOW, 12.0, margin)
        assert plan is not None and abs(user_deadline_for(plan, NOW, 12.0, margin) - deadline) < 1e-6
    request = read_request({"model": "mlp", "iterations": 100, "deadline": "+10m"}, NOW)
    taken_in = new_run("r", "calm-otter", request, str(tmp_path), NOW)
    event = arrival(taken_in, {1: 10.0, 2: 19.0}, max_job_gpus=2, now=NOW)
    assert taken_in.deadline == NOW + 600 and event.job.deadline == NOW + 600  # the loop gets the user's
    run = LoopRun("r", event.job, event.at, reserve_s=12.0, margin=margin)  # as the loop takes it in
    assert run.deadline == NOW + 600 and run.plan_deadline == NOW + 558
    later = plan_deadline_for(NOW + 1000, NOW, run.reserve_s, margin)
    assert later is not None and abs(run.to_user_time(later) - (NOW + 1000)) < 1e-6  # earliest deadlines, told right


def test_a_users_model_module_is_never_imported_into_the_worker(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import sys

    (tmp_path / "evil_model.py").write_text("def build(): pass\nraise SystemExit('imported into the worker')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # where the run's processes find it
    monkeypatch.setenv("ELASTICFLOW_MODEL_MODULES", "evil_model")  # allowed, and still never imported here
    # imported by the take-in check's own process, whose exit is its own
    with pytest.raises(InvalidRun, match="model: cannot import module 'evil_model': SystemExit: imported into the"):
        read_request({"model": "evil_model:build", "dataset": "synthetic-images", "iterations": 5}, NOW)
    assert "evil_model" not in sys.modules
    with pytest.raises(InvalidRun, match="model: model 'evil model:build' is not"):
        read_request({"model": "evil model:build", "dataset": "synthetic-images", "iterations": 5}, NOW)


@pytest.mark.parametrize(("parameters", "says"), [
    ({"model": "mlp", "iterations": 10**15, "deadline": "+1h"}, "iterations: Input should be less than or equal to"),
    ({"model": "mlp", "iterations": 5, "hyperparameters": {"global_batch_size": 10**9}}, "global_batch_size: "),
    ({"model": "mlp", "iterations": 5, "deadline": ""}, "deadline: is empty"),
])
def test_numbers_are_bounded_and_an_empty_deadline_is_an_error(parameters: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidRun, match=says):
        read_request(parameters, NOW)
    assert read_request({"model": "mlp", "iterations": 5, "deadline": "none"}, NOW).deadline is None


def test_checkpoints_and_data_stay_inside_what_the_operator_allowed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import numpy as np

    from scheduler_service.worker.intake import confine

    home, data = tmp_path / "home", tmp_path / "data"
    home.mkdir(), data.mkdir()
    np.savez(data / "ok.npz", x=np.zeros((4, 3), dtype=np.float32), y=np.zeros(4, dtype=np.int64))
    (data / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    roots, schemes = [home, data], frozenset({"s3"})

    def check(**parameters: object) -> None:
        confine(read_request({"model": "mlp", "iterations": 5, **parameters}, NOW), roots, schemes)

    check(checkpoint_store=str(home / "ckpt"))
    check(checkpoint_store="s3://bucket/runs")
    check(checkpoint_store="team-store")  # a saved CheckpointStore block
    check(dataset=f"npz:{data / 'ok.npz'}")
    for parameters, says in [
        ({"checkpoint_store": str(home / ".." / ".." / "etc")}, "checkpoint_store: .* is outside"),
        ({"checkpoint_store": "../../etc"}, "checkpoint_store: .* must be an absolute path"),
        ({"checkpoint_store": "gs://bucket/runs"}, "checkpoint_store: the scheme 'gs' is not allowed"),
        ({"checkpoint_store": "file:///etc"}, "checkpoint_store: .* is outside"),
        ({"dataset": "npz:/etc/hostname"}, "dataset: .* is outside"),
        ({"dataset": f"npz:{data / 'passwd'}"}, "dataset: npz:.* cannot be read as npz"),
    ]:
        with pytest.raises(InvalidRun, match=says):
            check(**parameters)


@pytest.mark.parametrize(("parameters", "says"), [
    ({"model": "mlp", "iterations": 5, "model_kwargs": {"bogus": 1}}, "model_kwargs: got an unexpected keyword argument 'bogus'"),
    ({"model": "mlp", "iterations": 5, "hyperparameters": {"learning_rate": 1e308}},
     "hyperparameters.learning_rate: Input should be less than or equal to 100"),
    ({"model": "mlp", "iterations": 5, "hyperparameters": {"learning_rate": float("inf")}},
     "hyperparameters.learning_rate: Input should be a finite number"),
    ({"model": "mlp", "iterations": 5, "deadline": "+99999999999h"}, "deadline: .* is beyond any date"),
])
def test_values_that_could_only_fail_in_training_fail_at_take_in_naming_the_field(
        parameters: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidRun, match=says):
        read_request(parameters, NOW)


def test_an_empty_dataset_file_is_said_to_be_empty(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from scheduler_service.worker.intake import confine

    (tmp_path / "empty.npz").write_bytes(b"")
    request = read_request({"model": "mlp", "iterations": 5, "dataset": f"npz:{tmp_path / 'empty.npz'}"}, NOW)
    with pytest.raises(InvalidRun, match=r"dataset: npz:.*empty\.npz cannot be read as npz: is empty \(0 bytes\)"):
        confine(request, [tmp_path], frozenset())


def test_cuda_on_a_cluster_of_cpu_slots_is_refused() -> None:
    from scheduler_service.worker.intake import check_device

    request = read_request({"model": "mlp", "iterations": 5, "device": "cuda"}, NOW)
    with pytest.raises(InvalidRun, match="device: 'cuda' was asked, but this cluster's slots are CPUs"):
        check_device(request, "cpu")
    check_device(request, "cuda")
    check_device(read_request({"model": "mlp", "iterations": 5}, NOW), "cpu")  # auto runs on what there is
