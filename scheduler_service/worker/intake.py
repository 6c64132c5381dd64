"""The one place a flow run becomes a policy `Job`: its parameters validated
as the flow will validate them, its length counted, its throughput curve cut
to the GPU counts it can use.

Pure but for reading a dataset to count its epochs: no Prefect client, no
store, so it is tested without a server. Anything wrong with a run is an
`InvalidRun` whose message names the field: the worker rejects that run and
goes on with the others.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from flows.training.control import FileControlChannel
from scheduler_service.loop.events import Arrived
from scheduler_service.policy import Job, ThroughputCurve
from scheduler_service.worker.registry import ServiceRun

NO_SPEED = {1: 1e-9}
MAX_PARAMETERS = 64 * 1024  # characters of a run's parameters as JSON  # a curve with nothing measurable: the policy finds no usable GPU count


class InvalidRun(ValueError):
    """A flow run the service cannot schedule; the message says why, naming the field."""


@dataclass(frozen=True, slots=True)
class Request:
    """What a run asks for, validated."""

    params: Any  # flows.training.params.TrainParameters
    iterations: float
    deadline: float | None  # the user's, epoch seconds; None: best-effort
    team: str = ""  # its work queue, on a cluster shared by teams

    @property
    def model(self) -> str:
        return self.params.model

    @property
    def batch_size(self) -> int:
        return self.params.hyperparameters.global_batch_size

    @property
    def profile_key(self) -> tuple[str, int, str]:
        """Runs that share a throughput curve (and so one profiling)."""
        return (self.params.model, self.batch_size, self.params.device)


def read_request(parameters: dict[str, Any] | None, now: float) -> Request:
    """Validate a run's parameters like the flow will. A deadline already
    past is not an error here: it reaches the policy, whose rejection says
    so and names the earliest deadline that would be met."""
    from pydantic import ValidationError

    from flows.training.datasets import load_dataset
    from flows.training.params import TrainParameters

    size = len(json.dumps(parameters or {}, default=str))
    if size > MAX_PARAMETERS:  # held by the worker while the run lives: bounded
        raise InvalidRun(f"parameters: {size} characters as JSON, more than the {MAX_PARAMETERS} a run's "
                         "parameters may take (a dataset or a model's settings go in files it names)")
    _refuse_null_numbers(parameters or {}, TrainParameters)
    raw = {k: v for k, v in (parameters or {}).items() if v is not None}
    try:
        params = TrainParameters.model_validate(
            raw, context={"admitted": True, "now": datetime.fromtimestamp(now, timezone.utc), "import_models": False})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'parameters'}: "
                             f"{str(e['msg']).removeprefix('Value error, ')}"
                             for e in exc.errors(include_url=False))
        raise InvalidRun(problems) from None
    size = user_task(params)
    iterations = params.iterations
    if iterations is None:
        try:
            iterations = params.total_iterations(size or len(load_dataset(params.dataset)))
        except Exception as exc:  # a dataset that cannot be read to count its epochs
            raise InvalidRun(f"dataset: {type(exc).__name__}: {exc}") from None
    deadline = None if params.deadline is None else params.deadline.timestamp()
    return Request(params, float(iterations), deadline)


def _refuse_null_numbers(parameters: Mapping[str, Any], model: Any, prefix: str = "") -> None:
    """A number given as null is refused, not read as "left out": Prefect's
    CLI sends `--param iterations=NaN` (or Infinity) as null, and the run then
    trained its default length and reported its deadline met. A null where a
    number may be left out (`iterations`, `epochs`) is refused too: left out,
    it is simply not given."""
    if not isinstance(parameters, Mapping):
        return
    for name, field in model.model_fields.items():
        value = parameters.get(name, ...)
        if value is None and _numeric(field.annotation):
            raise InvalidRun(f"{prefix}{name}: is null, not a number (Prefect's CLI sends NaN and Infinity as null); "
                             "give a finite number, or leave it out")
        nested = _model_of(field.annotation)
        if nested is not None and isinstance(value, Mapping):
            _refuse_null_numbers(value, nested, f"{prefix}{name}.")


def _numeric(annotation: Any) -> bool:
    import typing

    kinds = [a for a in (typing.get_args(annotation) or (annotation,)) if a is not type(None)]
    return bool(kinds) and all(a in (int, float) for a in kinds)


def _model_of(annotation: Any) -> Any:
    import typing

    from pydantic import BaseModel

    for kind in typing.get_args(annotation) or (annotation,):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind
    return None


def user_task(params: Any) -> int | None:
    """A task naming a user's code (model, dataset, loss, collate, evaluation
    by import path) is checked in a short-lived process, never imported
    here (task_check.py): a misspelt name is refused in about a second,
    naming the field, before any profile. Its dataset's length, when the
    run is given in epochs."""
    from flows.training.task_check import TaskRefused, check_task

    try:
        return check_task(params, count=params.iterations is None)
    except TaskRefused as exc:
        raise InvalidRun(str(exc)) from None
    except OSError as exc:  # the check could not start: the run's own processes will say more
        raise InvalidRun(f"task: its import paths could not be checked: {exc}") from None


def confine(request: Request, roots: list[Path], schemes: frozenset[str]) -> None:
    """Where a run may read and write: checkpoints and data inside the allowed
    roots (`ELASTICFLOW_HOME` and the operator's `ELASTICFLOW_ALLOWED_ROOTS`),
    remote stores only by a scheme the operator listed; a dataset must be
    readable and in its format now, before the run holds a GPU."""
    params = request.params
    store = params.checkpoint_store
    if store:
        scheme, sep, rest = store.partition("://")
        if sep and scheme != "file" and scheme not in schemes:
            raise InvalidRun(f"checkpoint_store: the scheme {scheme!r} is not allowed here (allowed: "
                             f"{', '.join(sorted(schemes)) or 'none'}; the operator lists them in "
                             "ELASTICFLOW_STORAGE_SCHEMES)")
        if sep and scheme == "file":
            _inside(rest, "checkpoint_store", roots)
        elif not sep and (store.startswith((".", "~")) or "/" in store):
            _inside(store, "checkpoint_store", roots)
        # else: the name of a saved CheckpointStore block, which the operator made
    dataset = params.dataset
    if dataset is not None and dataset.path:
        path = _inside(dataset.path, "dataset", roots)
        from flows.training.datasets import check_dataset

        try:
            check_dataset(dataset.name, path)
        except (OSError, ValueError) as exc:
            raise InvalidRun(f"dataset: {dataset.name}:{dataset.path} cannot be read as {dataset.name}: {exc}") from None


def block_name(request: Request) -> str | None:
    """The saved CheckpointStore block the run names, if its store is one."""
    store = request.params.checkpoint_store
    if not store or "://" in store or store.startswith((".", "~")) or "/" in store:
        return None
    return store


def check_device(request: Request, cluster_device: str) -> None:
    """A run that asks for CUDA on a cluster of CPU slots can only fail once it holds them."""
    if request.params.device == "cuda" and cluster_device != "cuda":
        raise InvalidRun("device: 'cuda' was asked, but this cluster's slots are CPUs; give device=auto (or cpu) "
                         "to run on what the cluster has")


def _inside(value: str, field: str, roots: list[Path]) -> Path:
    path = Path(value).expanduser()
    if not path.is_absolute():
        raise InvalidRun(f"{field}: {value!r} must be an absolute path (inside {_listed(roots)})")
    resolved = path.resolve()
    if not any(resolved.is_relative_to(root.resolve()) for root in roots):
        raise InvalidRun(f"{field}: {value!r} is outside what this service may use ({_listed(roots)}); the "
                         "operator allows more roots with ELASTICFLOW_ALLOWED_ROOTS")
    return resolved


def _listed(roots: list[Path]) -> str:
    return ", ".join(str(root) for root in roots)


def usable_points(points: dict[int, float], batch_size: int, max_job_gpus: int) -> dict[int, float]:
    """The GPU counts a run can use: no more GPUs than samples in a global batch."""
    limit = min(batch_size, max_job_gpus)
    return {g: s for g, s in points.items() if g <= limit and s > 0}


def kind_curves(stored: Mapping[str, dict[int, float]], kinds: Sequence[str]) -> dict[str, dict[int, float]]:
    """What a model is planned with on each kind of a cluster of several:
    the curve measured on that kind, else the one measured where kinds were
    not told apart (kind "": the worker's machine, or a store from before
    kinds). A kind with neither is not offered to the model. {} on a cluster
    of one kind (`kinds` empty)."""
    return {kind: stored.get(kind) or stored[""] for kind in kinds if kind in stored or "" in stored}


def one_curve(stored: Mapping[str, dict[int, float]]) -> dict[int, float] | None:
    """The curve a cluster of one (unnamed) kind plans with: the unnamed one, else the first kind's."""
    if "" in stored:
        return stored[""]
    return stored[min(stored)] if stored else None


def _curve(points: dict[int, float], batch_size: int, max_job_gpus: int) -> ThroughputCurve:
    try:
        return ThroughputCurve(usable_points(points, batch_size, max_job_gpus) or NO_SPEED)
    except ValueError:
        return ThroughputCurve(NO_SPEED)


def policy_job(run_id: str, submit_time: float, iterations: float, deadline: float | None,
               points: dict[int, float], model: str, batch_size: int, max_job_gpus: int,
               by_kind: Mapping[str, dict[int, float]] | None = None, team: str = "") -> Job:
    """The policy's job for a flow run (a new one, or one adopted after a
    restart); on a cluster of several kinds, with its curve on each
    (`by_kind`, from `kind_curves`)."""
    curve = _curve(points, batch_size, max_job_gpus)
    curves = tuple((kind, _curve(p, batch_size, max_job_gpus)) for kind, p in (by_kind or {}).items())
    if curves:
        return Job(job_id=run_id, submit_time=submit_time, iterations=iterations, deadline=deadline,
                   curve=curves[0][1], model=model, batch_size=batch_size, kind=curves[0][0], curves=curves,
                   team=team)
    return Job(job_id=run_id, submit_time=submit_time, iterations=iterations, deadline=deadline, curve=curve,
               model=model, batch_size=batch_size, team=team)


def new_run(run_id: str, name: str, request: Request, control_root: str, now: float, flow_run: Any = None,
            response: Any = None) -> ServiceRun:
    """A run taken in, before its throughput is known (Profiling) or once it is."""
    channel = FileControlChannel(run_id, request.params.control_dir or control_root)
    return ServiceRun(run_id, name, channel, request.deadline, model=request.model, iterations=request.iterations,
                      taken_in_at=now, flow_run=flow_run, response=response, request=request)


def arrival(run: ServiceRun, points: dict[int, float], max_job_gpus: int, now: float,
            by_kind: Mapping[str, dict[int, float]] | None = None, measured_up_to: int | None = None) -> Arrived:
    """The run for the control loop to decide, with its throughput curve (on
    each kind, `by_kind`); its job's deadline is the user's (the loop
    derives the plan deadline)."""
    request: Request = run.request
    job = policy_job(run.run_id, now, request.iterations, request.deadline, points, request.model,
                     request.batch_size, max_job_gpus, by_kind, request.team)
    return Arrived(run.run_id, job, run.taken_in_at, measured_up_to)
