"""`train_model`: the training step of an ML pipeline DAG, deadline-aware.

A pipeline knows its SLA ("the model is registered by 06:00 UTC"), not a GPU
count. `train_model` turns the SLA into a training deadline (SLA minus the
expected time of the steps after training, see `elasticflow_block.deadline`),
submits the `train/<model>` deployment as a subflow run in the elasticflow
work pool, waits for it, and returns where the trained checkpoint is.

The scheduler answers at once. A rejection is raised as `TrainingRejected`
with the reason and the earliest deadline that could be met, so the pipeline
can choose: relax its SLA, train a smaller model, or alert a person. Any other
end that is not a completed run raises `TrainingFailed`. A pipeline that stops
waiting (cancelled, crashed, timed out) cancels the training run it submitted.

    from elasticflow_block import train_model, TrainingRejected

    @flow
    def nightly():
        data = prepare.submit()
        try:
            trained = train_model("mlp", {"global_batch_size": 32}, sla="06:00Z",
                                  downstream=["evaluate", "register"], after=[data], iterations=500)
        except TrainingRejected as rejected:
            ...  # rejected.reason, rejected.earliest_feasible_deadline, rejected.earliest_feasible_sla
        evaluate(trained.checkpoint)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import MissingContextError
from pydantic import BaseModel, ConfigDict, Field

from elasticflow_block.deadline import (
    DeadlinePlan,
    DownstreamStep,
    HistoryPolicy,
    derive_deadline,
    given_steps,
    resolve_sla,
)
from elasticflow_block.hyperparameters import Hyperparameters
from elasticflow_block.storage import CheckpointStorage, resolve_checkpoint_url
from elasticflow_block.errors import TrainingFailed, TrainingRejected, refusal_state  # noqa: F401  (the pipeline task's API)
from elasticflow_block.prefect_runs import cancel_run, current_flow_name, learn_steps, wait_for_run
from scheduler_service.contracts import Label, Rejection, StateName



class TrainedModel(BaseModel):
    """What a completed training run left behind, enough to load the model again."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    flow_run_id: str
    run_key: str = Field(description="checkpoint folder name under the store: the train flow run id")
    checkpoint_store: str = Field(description="fsspec URL or path of the checkpoint store root")
    iteration: int = Field(description="iteration of the newest complete checkpoint")
    checkpoint: str = Field(description="path of that checkpoint's payload")
    deadline: datetime
    plan: DeadlinePlan

    def storage(self) -> CheckpointStorage:
        return CheckpointStorage(self.checkpoint_store)

    def load_state(self) -> dict[str, Any]:
        """The checkpoint's state (model and optimizer state dicts, iteration, ...), digest verified."""
        state, _ = self.storage().load(self.run_key, self.iteration)
        return state


class TrainRequest(BaseModel):
    """`train_model`'s arguments, validated before anything is submitted."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model: str = Field(min_length=1)
    hyperparameters: dict[str, Any] = Field(default_factory=dict)
    sla: datetime
    downstream_given: dict[str, timedelta] = Field(default_factory=dict)
    downstream_learned: list[str] = Field(default_factory=list)
    iterations: int | None = Field(default=None, ge=1)
    epochs: float | None = Field(default=None, gt=0)
    dataset: str | dict[str, Any] | None = None
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    parameters: dict[str, Any] = Field(default_factory=dict)
    margin: timedelta = Field(default=timedelta(minutes=1))
    history: HistoryPolicy = Field(default_factory=HistoryPolicy)
    deployment: str

    def train_parameters(self, deadline: datetime) -> dict[str, Any]:
        """Parameters of the train flow run: the caller's extras, then ours (ours win)."""
        ours: dict[str, Any] = {"model": self.model, "deadline": deadline.astimezone(timezone.utc).isoformat()}
        for key, value in (
            ("hyperparameters", self.hyperparameters or None),
            ("iterations", self.iterations),
            ("epochs", self.epochs),
            ("dataset", self.dataset),
            ("model_kwargs", self.model_kwargs or None),
        ):
            if value is not None:
                ours[key] = value
        clash = sorted(set(self.parameters) & (set(ours) | {"best_effort"}))
        if clash:
            raise ValueError(f"parameters {clash} are train_model arguments; pass them there, not in `parameters`")
        return {**self.parameters, **ours}


def _split_downstream(
    downstream: Mapping[str, timedelta | float | None] | Sequence[str],
) -> tuple[dict[str, timedelta], list[str]]:
    """Given times (timedelta or seconds) and step names to learn (a bare name, or a None value)."""
    if isinstance(downstream, str):
        raise TypeError("downstream must be a list of step names or a mapping of step name to expected time")
    if isinstance(downstream, Mapping):
        given = {k: v for k, v in downstream.items() if v is not None}
        learned = [k for k, v in downstream.items() if v is None]
        return {s.name: s.expected for s in given_steps(given)}, learned
    return {}, list(downstream)


def _logger() -> logging.Logger | logging.LoggerAdapter[logging.Logger]:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("elasticflow.pipeline")


def _total_reported(flow_run: Any) -> int | None:
    """The total iterations the run reported (its `elasticflow.total_iterations`
    label, set by the flow as it trains; None if it never did)."""
    try:
        total = int((flow_run.labels or {}).get(Label.TOTAL_ITERATIONS.value, 0))
    except (TypeError, ValueError):
        return None
    return total if total > 0 else None


def _checkpoint_of(flow_run: Any, request: TrainRequest, plan: DeadlinePlan) -> TrainedModel:
    """The completed run's newest checkpoint, found where the train flow writes it.

    The train flow does not persist its result, so the location is derived the
    way it derives it: store root from the run's `checkpoint_store` parameter
    (default `$ELASTICFLOW_HOME/checkpoints`), run key = flow run id.
    """
    run_id = str(flow_run.id)
    params = dict(flow_run.parameters or {})
    root = resolve_checkpoint_url(params.get("checkpoint_store"))
    storage = CheckpointStorage(root)
    done = storage.iterations(run_id)
    state = flow_run.state
    if not done:
        raise TrainingFailed(
            f"train flow run {run_id} completed but no checkpoint exists under {root}/{run_id}; does this process "
            "see the same ELASTICFLOW_HOME (or checkpoint_store) as the flow run?",
            run_id, state.type.value if state else None, state.name if state else None,
        )
    iteration = done[-1]
    total = request.iterations or _total_reported(flow_run)  # `epochs`: the run knew its total
    if total is not None and iteration < total:
        raise TrainingFailed(
            f"train flow run {run_id} completed after {iteration}/{total} iterations "
            "(stopped or preempted); its checkpoint is not the trained model",
            run_id, state.type.value if state else None, state.name if state else None,
        )
    data_path, _ = storage._paths(run_id, iteration)
    return TrainedModel(
        model=request.model, model_kwargs=request.model_kwargs, flow_run_id=run_id, run_key=run_id,
        checkpoint_store=root, iteration=iteration, checkpoint=data_path, deadline=plan.deadline, plan=plan,
    )


def _outcome(flow_run: Any, request: TrainRequest, plan: DeadlinePlan) -> TrainedModel:
    """Translate the train run's final state into a model or a typed error."""
    run_id = str(flow_run.id)
    state = flow_run.state
    if state is None or not state.is_final():
        raise TrainingFailed(
            f"train flow run {run_id} not finished when train_model stopped waiting (state {state!r})",
            run_id, state.type.value if state else None, state.name if state else None,
        )
    if state.is_completed():
        return _checkpoint_of(flow_run, request, plan)
    if state.is_cancelled() and state.name == StateName.REJECTED.value:
        rejection = Rejection.from_labels(flow_run.labels or {}, state.message)
        raise TrainingRejected(state.message or "", run_id, rejection.reason, rejection.earliest_feasible_deadline,
                               plan)
    raise TrainingFailed(
        f"train flow run {run_id} ended {state.type.value} ({state.name}): {state.message or 'no message'}",
        run_id, state.type.value, state.name,
    )


def _publish_plan(plan: DeadlinePlan) -> None:
    """A markdown artifact with the derivation, so the UI shows why training was due when it was."""
    from prefect.artifacts import create_markdown_artifact

    rows = "\n".join(
        f"| {s.name} | {s.expected} | {s.source} | {s.samples or ''} | {s.statistic or ''} |" for s in plan.downstream
    )
    create_markdown_artifact(
        key="elasticflow-training-deadline",
        description="ElasticFlow training deadline from the pipeline SLA",
        markdown=(
            f"**SLA** {plan.sla.isoformat()}  \n**training deadline** {plan.deadline.isoformat()}  \n"
            f"**margin** {plan.margin}\n\n| downstream step | expected | source | runs | statistic |\n"
            f"|---|---|---|---|---|\n{rows}\n"
        ),
    )


@task(name="train-model", cache_policy=NO_CACHE, persist_result=False, retries=0)
def train_model(
    model: str,
    hyperparameters: dict[str, Any] | None = None,
    *,
    sla: datetime | str,
    downstream: Mapping[str, timedelta | float | None] | Sequence[str] = (),
    after: Sequence[Any] = (),
    iterations: int | None = None,
    epochs: float | None = None,
    dataset: str | dict[str, Any] | None = None,
    model_kwargs: dict[str, Any] | None = None,
    parameters: dict[str, Any] | None = None,
    margin: timedelta = timedelta(minutes=1),
    history: HistoryPolicy | None = None,
    deployment: str | None = None,
    poll_interval_s: float = 5.0,
    timeout_s: float | None = None,
    now: datetime | None = None,
) -> TrainedModel:
    """Train `model` so that the pipeline meets `sla`; return the trained checkpoint.

    Everything after `hyperparameters` is keyword-only, and `sla` has no
    default: a pipeline states when its result is due.

    - `sla`: when the pipeline's result is due: ISO-8601 with a zone, `+2h`, or
      a time of day (`06:00Z`, next occurrence).
    - `downstream`: the steps after training. A mapping gives their expected
      times (timedelta or seconds; None = learn it); a list of task names learns
      them all from their past completed runs in this flow (see `history`).
    - `after`: upstream futures or results that must exist before training
      (Prefect waits for futures passed here and draws the dependency).
    - `parameters`: other `train` flow parameters (`checkpoint_interval`,
      `checkpoint_store`, `device`, ...); `deployment` defaults to `train/<model>`.
    - `now`: the clock, for tests; the real time otherwise.

    Raises `SLATooClose` before submitting when no time is left to train,
    `TrainingRejected` when the scheduler refuses the deadline, and
    `TrainingFailed` for any other unsuccessful end.

    The training run lives only as long as someone waits for it: when this step
    stops waiting (the pipeline run is cancelled or crashes, Ctrl-C, or
    `timeout_s` passes), the training run is cancelled and its GPUs go back.
    """
    del after  # only there to order the DAG: Prefect resolved it before this body runs
    logger = _logger()
    clock = now or datetime.now(timezone.utc)
    given, learned = _split_downstream(downstream)
    request = TrainRequest(
        model=model, hyperparameters=hyperparameters or {}, sla=resolve_sla(sla, clock),
        downstream_given=given, downstream_learned=learned, iterations=iterations, epochs=epochs,
        dataset=dataset, model_kwargs=model_kwargs or {}, parameters=parameters or {}, margin=margin,
        history=history or HistoryPolicy(), deployment=deployment or f"train/{model}",
    )
    if request.hyperparameters:
        Hyperparameters.model_validate(request.hyperparameters)  # a typo fails here, not after a queue wait
    steps = [DownstreamStep(name=k, expected=v, source="given") for k, v in request.downstream_given.items()]
    if request.downstream_learned:
        steps += learn_steps(request.downstream_learned, request.history, current_flow_name())
    for step in steps:
        if step.source == "fallback":
            logger.warning(
                "no completed runs of downstream step %r to learn from; assuming %s (HistoryPolicy.fallback)",
                step.name, step.expected,
            )
    plan = derive_deadline(request.sla, steps, clock, request.margin)
    logger.info("elasticflow.train_model plan model=%s %s", request.model, plan.describe())
    try:
        _publish_plan(plan)
    except Exception as exc:  # an artifact is a courtesy; training does not depend on it
        logger.debug("deadline artifact not written: %s", exc)

    from prefect.deployments import run_deployment

    submitted = run_deployment(
        request.deployment, parameters=request.train_parameters(plan.deadline), as_subflow=True, timeout=0,
    )
    run_id = str(submitted.id)
    logger.info("elasticflow.train_model submitted flow_run=%s deployment=%s", run_id, request.deployment)
    # Nobody will read what it trains once this step stops waiting (the pipeline
    # was cancelled or crashed, or gave up): its GPUs go back to runs whose
    # results someone awaits.
    try:
        flow_run = wait_for_run(run_id, poll_interval_s, timeout_s, logger)
    except BaseException as exc:
        cancel_run(run_id, f"the pipeline step waiting for it stopped ({type(exc).__name__}: {exc})", logger)
        raise
    if flow_run is None or flow_run.state is None or not flow_run.state.is_final():
        cancel_run(run_id, f"the pipeline step waiting for it stopped (timeout_s={timeout_s} passed)", logger)
        raise TrainingFailed(
            f"train flow run {run_id} not finished within timeout_s={timeout_s}; it was cancelled",
            run_id, "CANCELLING", "Cancelling",
        )
    logger.info(
        "elasticflow.train_model finished flow_run=%s state=%s name=%s",
        flow_run.id, flow_run.state.type.value if flow_run.state else None,  # type: ignore[union-attr]
        flow_run.state.name if flow_run.state else None,  # type: ignore[union-attr]
    )
    trained = _outcome(flow_run, request, plan)
    logger.info(
        "elasticflow.train_model checkpoint=%s iteration=%d deadline=%s",
        trained.checkpoint, trained.iteration, trained.deadline.isoformat(),
    )
    return trained
