"""Training tasks users bring (issue 45): the two shipped examples train
through the runtime on real DDP ranks, a resize in place leaves their losses
those of one process that never resized, `deterministic` is applied in the
ranks, and a task's misspelt name is refused at take-in, naming the field,
by a short-lived process that never runs the module it cannot find a name in."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from flows.training.datasets import DatasetSpec
from flows.training.params import TrainParameters
from flows.training.rank.rank_setup import build_optimizer
from flows.training.rank.sampler import batch_indices, micro_batches
from flows.training.rank.task import Task
from scheduler_service.worker.intake import InvalidRun, read_request
from tests.runtime.conftest import assert_same_trajectory

REGRESSION = {"model": "flows.examples.regression:model",
              "dataset": {"name": "flows.examples.regression:NoisyLinear", "options": {"size": 512}},
              "loss": "flows.examples.regression:mse", "evaluate": "flows.examples.regression:evaluate"}
CAUSAL_LM = {"model": "flows.examples.causal_lm:build", "model_kwargs": {"dim": 16},
             "dataset": {"name": "flows.examples.causal_lm:Sequences", "options": {"size": 256}}, "loss": "model"}
ITERATIONS = 8


def _params(folder: Path, task: dict[str, Any], **overrides: Any) -> TrainParameters:
    values: dict[str, Any] = dict(
        hyperparameters={"global_batch_size": 12, "max_micro_batch": 4, "learning_rate": 0.02},
        iterations=ITERATIONS, checkpoint_interval=1000, checkpoint_store=str(folder / "checkpoints"),
        control_dir=str(folder / "control"), device="cpu", **task)
    return TrainParameters(**(values | overrides))


def _one_process(params: TrainParameters) -> list[float]:
    """The losses of the same task trained here, in one process, with no DDP
    and no resize: the step the ranks take, written out."""
    task = Task.of(params)
    task.load()
    hp = params.hyperparameters
    torch.manual_seed(hp.seed)
    model = task.build_model()
    optimizer = build_optimizer(model, params)  # type: ignore[arg-type]  # reads .hyperparameters only
    losses = []
    for i in range(params.iterations or 0):
        indices = batch_indices(hp.seed, i, hp.global_batch_size, len(task))
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for a, b in micro_batches(0, hp.global_batch_size, hp.max_micro_batch):
            summed = task.summed_loss(model, task.batch(indices[a:b]), b - a)
            (summed / hp.global_batch_size).backward()
            total += float(summed.detach())
        optimizer.step()
        losses.append(total / hp.global_batch_size)
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("task, deterministic", [(REGRESSION, True), (CAUSAL_LM, False)],
                         ids=["regression", "causal-lm"])
def test_an_example_task_resized_in_place_keeps_the_losses_of_one_process(
    tmp_path: Path, task: dict[str, Any], deterministic: bool
) -> None:
    from flows.training.coordinator.runtime import run_training

    hyperparameters = {"global_batch_size": 12, "max_micro_batch": 4, "learning_rate": 0.02,
                       "deterministic": deterministic}
    params = _params(tmp_path, task, gpu_plan=[[0, 1], [0]], switch_at=[ITERATIONS // 2],
                     hyperparameters=hyperparameters)
    result = run_training(params, "task")
    assert result.status == "completed" and result.restarts == 0
    assert [r.how for r in result.rescales] == ["in_place"]
    assert_same_trajectory(result.losses, _one_process(params))
    assert result.losses[-1] < result.losses[0]  # it learns
    assert all(s.deterministic is deterministic for s in result.segments)  # applied in the ranks, as asked
    if task is REGRESSION:
        assert set(result.metrics) == {"held_out_mse"} and math.isfinite(result.metrics["held_out_mse"])
    else:
        assert result.metrics == {}


def _refusal(task: dict[str, Any]) -> str:
    with pytest.raises(InvalidRun) as refused:
        read_request({**REGRESSION, "iterations": 10, **task}, time.time())
    return str(refused.value)


@pytest.mark.parametrize("field, task", [
    ("model", {"model": "flows.examples.regression:modle"}),
    ("dataset", {"dataset": "flows.examples.regresion:NoisyLinear"}),
    ("loss", {"loss": "flows.examples.regression:mes"}),
    ("collate", {"collate": "flows.examples.regression:no_collate"}),
    ("evaluate", {"evaluate": "flows.examples.regression:evaluation"}),
    ("model_kwargs", {"model_kwargs": {"featurs": 4}}),
    ("dataset.options", {"dataset": {"name": "flows.examples.regression:NoisyLinear", "options": {"sise": 4}}}),
    ("loss", {"loss": "flows.examples.regression:NoisyLinear.x"}),
])
def test_a_misspelt_name_is_refused_at_take_in_naming_the_field(field: str, task: dict[str, Any]) -> None:
    assert _refusal(task).startswith(f"{field}: ")


def test_the_check_never_imports_a_task_into_the_worker_nor_runs_a_module_to_find_a_typo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user's module marks each process that runs it: a typo of a name
    is found in its source, so the module never ran; a good task is
    imported, in a process of its own; never in this one (the worker's)."""
    marks = tmp_path / "marks"
    monkeypatch.setenv("ELASTICFLOW_TEST_IMPORT_MARKS", str(marks))
    task = {"model": "tests.runtime.marking_task:model", "dataset": "tests.runtime.marking_task:dataset",
            "loss": "tests.runtime.marking_task:loss"}
    assert _refusal({**task, "loss": "tests.runtime.marking_task:los"}) == (
        "loss: module 'tests.runtime.marking_task' has no 'los'")
    assert not marks.exists()
    request = read_request({**task, "epochs": 2, "hyperparameters": {"global_batch_size": 8}}, time.time())
    assert request.iterations == math.ceil(2 * 20 / 8)  # the user's dataset counted: 20 samples
    ran_in = marks.read_text().split()
    assert len(ran_in) == 1 and int(ran_in[0]) != __import__("os").getpid()
    assert "tests.runtime.marking_task" not in sys.modules


def test_the_allow_list_covers_every_import_path_of_a_task(monkeypatch: pytest.MonkeyPatch) -> None:
    for field in ("loss", "collate", "evaluate"):
        with pytest.raises(ValueError, match=f"{field}\n.*{field} module 'os' is not one the operator allows"):
            TrainParameters.model_validate({**REGRESSION, field: "os:system"}, context={"import_models": False})
    with pytest.raises(ValueError, match="dataset module 'subprocess' is not one the operator allows"):
        TrainParameters.model_validate({"model": "mlp", "dataset": "subprocess:run"})
    monkeypatch.setenv("ELASTICFLOW_MODEL_MODULES", "")  # the shipped examples need no setting
    assert TrainParameters.model_validate(REGRESSION, context={"import_models": False}).loss == REGRESSION["loss"]


def test_dataset_strings_name_a_registered_dataset_and_its_path_or_a_users() -> None:
    assert DatasetSpec.split("npz:/data/d.npz") == {"name": "npz", "path": "/data/d.npz"}
    assert DatasetSpec.split("flows.examples.regression:NoisyLinear") == {
        "name": "flows.examples.regression:NoisyLinear"}
    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        DatasetSpec(name="nope")


def test_a_loss_is_per_sample_or_a_mean_and_nothing_else() -> None:
    task = Task("mlp", {"in_features": 4}, DatasetSpec(name="synthetic-vectors", options={"size": 8, "features": 4}))
    task.load()
    model = task.build_model()
    batch = task.batch(torch.arange(4))
    per_sample = task.summed_loss(model, batch, 4)
    task.loss_fn = lambda output, batch: torch.nn.functional.cross_entropy(output, batch[1])  # a mean
    assert torch.allclose(task.summed_loss(model, batch, 4), per_sample)
    task.loss_fn = lambda output, batch: torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"loss: gave shape \(2, 2\) for a micro-batch of 4 samples"):
        task.summed_loss(model, batch, 4)


def test_a_model_loss_needs_an_output_that_carries_one() -> None:
    task = Task("flows.examples.causal_lm:build", {"dim": 8}, DatasetSpec(name="flows.examples.causal_lm:Sequences",
                options={"size": 4}), loss="model")
    task.load()
    batch = task.batch(torch.arange(4))
    assert task.summed_loss(task.build_model(), batch, 4).dim() == 0
    del batch["labels"]
    with pytest.raises(ValueError, match="was it given the labels"):
        task.summed_loss(task.build_model(), batch, 4)


def test_an_evaluation_that_fails_costs_the_run_nothing(caplog: pytest.LogCaptureFixture) -> None:
    task = Task(REGRESSION["model"], {}, DatasetSpec(name="flows.examples.regression:NoisyLinear"),
                evaluate=REGRESSION["evaluate"])
    model = task.build_model()
    assert set(task.evaluate(model)) == {"held_out_mse"} and model.training  # back in training mode
    task.evaluation = lambda trained: 3
    assert task.evaluate(model) == {} and model.training
    assert "evaluate: the task's evaluation failed" in caplog.text and "gave a int, not a mapping" in caplog.text
