"""The `train` flow's parameters, validated once at the boundary.

Everything a user can get wrong (a model name, a deadline in the past, a GPU
plan that does not line up) fails here with a message naming the fix, before
any process is launched or GPU is held.
"""

from __future__ import annotations

import inspect
import math
from datetime import datetime, timedelta, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from elasticflow_block.deadline import relative_seconds
from elasticflow_block.hyperparameters import Hyperparameters
from flows.training.datasets import DatasetSpec
from flows.training.models import check_import_path, data_kind, is_import_path, resolve_factory



def parse_deadline(value: str | datetime, now: datetime | None = None) -> datetime:
    """An aware datetime from ISO-8601 with a zone, or `+2h`, `+1h30m`, `+90s` from `now`.

    Naive times are refused: a deadline that silently shifts by the server's
    time zone is a missed deadline.
    """
    now = now or datetime.now(timezone.utc)
    if not isinstance(value, (str, datetime)):
        raise ValueError(f"deadline {value!r} is not a time: give ISO-8601 with a zone, or relative (e.g. +2h)")
    if isinstance(value, datetime):
        moment = value
    else:
        text = value.strip()
        seconds = relative_seconds(text)
        if seconds is not None:
            try:
                return now + timedelta(seconds=seconds)
            except OverflowError:
                raise ValueError(f"deadline {value!r} is beyond any date (the latest is "
                                 f"{datetime.max.date().isoformat()})") from None
        try:
            moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
        except ValueError as exc:
            raise ValueError(
                f"deadline {value!r} is neither ISO-8601 (e.g. 2026-12-01T18:00:00+00:00) nor relative (e.g. +2h, +1h30m)"
            ) from exc
    if moment.tzinfo is None:
        raise ValueError(f"deadline {value!s} has no time zone; add one (e.g. +00:00 or Z)")
    return moment


BUILT_IN_LOSSES = ("cross_entropy", "model")
BEST_EFFORT = "none"  # `deadline=none`: best-effort, said explicitly
# Bounds on what a user sets, so that no number is too large to plan, to
# print as a date or to allocate: far beyond any real training run.
MAX_ITERATIONS = 10**9
MAX_EPOCHS = 10**5


class TrainParameters(BaseModel):
    """Everything the `train` flow needs; every field has a usable default."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(default="resnet", max_length=200, description="registered name or 'pkg.module:factory'")
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    dataset: DatasetSpec | None = None
    loss: str = Field(default="cross_entropy", description="'cross_entropy' (of the output's logits and the "
                      "batch's targets), 'model' (the model's output carries its loss, Hugging Face style), or "
                      "'pkg.module:function' of (output, batch): docs/user-guide.md")
    collate: str | None = Field(default=None, description="'pkg.module:function' making a batch of a list of "
                                "samples; default torch's default_collate")
    evaluate: str | None = Field(default=None, description="'pkg.module:function' of the trained model, returning "
                                 "{metric: value}; run once by rank 0 when the run completes")
    hyperparameters: Hyperparameters = Field(default_factory=Hyperparameters)
    iterations: int | None = Field(default=None, ge=1, le=MAX_ITERATIONS)
    epochs: float | None = Field(default=None, gt=0, le=MAX_EPOCHS, allow_inf_nan=False)
    deadline: datetime | None = None
    best_effort: bool = False
    gpu_plan: list[list[int]] = Field(default_factory=lambda: [[0]], description="GPU sets, used in order")
    switch_at: list[int] = Field(default_factory=list, description="iterations at which to move to the next GPU set")
    checkpoint_interval: int = Field(default=50, ge=1, le=MAX_ITERATIONS)
    keep_checkpoints: int = Field(default=3, ge=1, le=1000)
    checkpoint_store: str | None = Field(
        default=None, description="fsspec URL, or name of a saved CheckpointStore block"
    )
    control_dir: str | None = Field(default=None, description="root of the file control channel")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    resize_in_place: bool = Field(default=True, description="resize without a checkpoint where the ranks can: "
                                  "those that stay keep their state, newcomers get it from them (local ranks; "
                                  "False: every resize through a checkpoint, docs/training.md)")
    max_restarts: int = Field(default=3, ge=0, le=100, description="relaunches after a crashed segment")
    run_key: str | None = Field(default=None, description="checkpoint/control key; defaults to the flow run id")
    ray_address: str | None = Field(default=None, description="the Ray cluster whose nodes run the ranks (set by "
                                    "the scheduler's launch, `LaunchSpec`); None: processes on this machine")

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str, info: ValidationInfo) -> str:
        # The scheduler never imports a user's model code into its own
        # process (`import_models=False`): the path's shape is checked there,
        # the import happens in the run's own processes (profiling, training).
        if (info.context or {}).get("import_models", True) or not is_import_path(value):
            resolve_factory(value)
        else:
            check_import_path(value, "model")
        return value

    @field_validator("loss")
    @classmethod
    def _known_loss(cls, value: str) -> str:
        # Shape and allow-list only, wherever it is validated: a user's loss
        # is imported in the run's own processes (task.py) and, at take-in,
        # in a short-lived one (task_check.py).
        return value if value in BUILT_IN_LOSSES else check_import_path(value, "loss")

    @field_validator("collate", "evaluate")
    @classmethod
    def _user_function(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else check_import_path(value, str(info.field_name))

    @field_validator("model_kwargs")
    @classmethod
    def _kwargs_fit_the_factory(cls, kwargs: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """Keyword arguments the model's factory does not take fail now, not in
        the run's processes after it was admitted and held GPUs. A user's own
        factory (`pkg.module:factory`) is checked where it is imported (the
        run's processes), never in the scheduler's."""
        model = info.data.get("model")
        if model is None or (is_import_path(model) and not (info.context or {}).get("import_models", True)):
            return kwargs
        try:
            inspect.signature(resolve_factory(model)).bind(**kwargs)
        except TypeError as exc:
            raise ValueError(f"{exc} (model {model!r})") from None
        return kwargs

    @field_validator("deadline", mode="before")
    @classmethod
    def _parse_deadline(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() == BEST_EFFORT):
            return None
        if isinstance(value, str) and not value.strip():
            raise ValueError(f"is empty: give a time (ISO-8601 with a zone, or +2h), or {BEST_EFFORT!r} for "
                             "a best-effort run")
        context = info.context or {}
        now = context.get("now")
        moment = parse_deadline(value, now)
        # Once admitted, a start past the deadline (a busy machine) is late, not
        # invalid: the scheduler checked the deadline when the run arrived.
        if moment <= (now or datetime.now(timezone.utc)) and not context.get("admitted"):
            raise ValueError(f"deadline {moment.isoformat()} is in the past")
        return moment

    @field_validator("gpu_plan")
    @classmethod
    def _check_plan(cls, plan: list[list[int]]) -> list[list[int]]:
        if not plan:
            raise ValueError("gpu_plan needs at least one GPU set")
        for gpus in plan:
            if not gpus:
                raise ValueError("every GPU set in gpu_plan needs at least one GPU")
            if len(set(gpus)) != len(gpus) or min(gpus) < 0:
                raise ValueError(f"GPU set {gpus} must list distinct non-negative ids")
        return plan

    @model_validator(mode="after")
    def _check_together(self) -> "TrainParameters":
        if self.iterations is not None and self.epochs is not None:
            raise ValueError("give iterations or epochs, not both")
        if self.best_effort and self.deadline is not None:
            raise ValueError("a best-effort job has no deadline; drop one of deadline and best_effort")
        if self.deadline is None:
            self.best_effort = True
        if len(self.switch_at) != len(self.gpu_plan) - 1:
            raise ValueError(
                f"switch_at needs one iteration per GPU-set change: {len(self.gpu_plan) - 1}, got {len(self.switch_at)}"
            )
        if any(b <= a for a, b in zip(self.switch_at, self.switch_at[1:])) or any(s < 1 for s in self.switch_at):
            raise ValueError("switch_at must be strictly increasing positive iterations")
        self.dataset = DatasetSpec.parse(self.dataset, data_kind(self.model))
        largest = max(len(g) for g in self.gpu_plan)
        if self.hyperparameters.global_batch_size < largest:
            raise ValueError(
                f"global_batch_size {self.hyperparameters.global_batch_size} is smaller than the largest GPU set ({largest})"
            )
        return self

    @field_validator("dataset", mode="before")
    @classmethod
    def _dataset_from_string(cls, value: Any) -> Any:
        return DatasetSpec.split(value) if isinstance(value, str) else value

    def total_iterations(self, dataset_size: int) -> int:
        """Iterations to run: given directly, or enough global batches to cover `epochs` (default 1)."""
        if self.iterations is not None:
            return self.iterations
        epochs = self.epochs if self.epochs is not None else 1.0
        return max(1, math.ceil(epochs * dataset_size / self.hyperparameters.global_batch_size))

    def planned_gpus(self, iteration: int) -> tuple[list[int], int | None]:
        """The planned GPU set at `iteration` and the iteration where the plan next changes."""
        step = sum(1 for s in self.switch_at if s <= iteration)
        following = self.switch_at[step] if step < len(self.switch_at) else None
        return self.gpu_plan[step], following
