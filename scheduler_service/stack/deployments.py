"""Deployments `train/<model>` of the `train` flow and `pipeline/daily` on an
`elasticflow` work pool, as `prefect.yaml` declares them.

`prefect --no-prompt deploy --all` reads that file; `elasticflow up` deploys the
same definitions from Python (here), so there is one source of truth. Users
name a model, its hyperparameters and a deadline; never a GPU count:

    prefect deployment run train/mlp --param iterations=200 --param deadline=+10m

Entrypoints are module paths (`flows.train.train`) and no pull step is
given: the flow process imports the installed package, so nothing is copied
or changed directory into, and a run's page does not open with four lines
of pull steps (nor repeat them when Prefect loads the flow for its
cancellation hooks).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Any

import yaml

PROJECT_ROOT = Path(__file__).resolve().parents[2]
PREFECT_YAML = PROJECT_ROOT / "prefect.yaml"
ENTRYPOINT = "flows.train.train"
PIPELINE_ENTRYPOINT = "flows.pipeline.daily_pipeline"


@cache
def definitions() -> tuple[dict[str, Any], ...]:
    """The `deployments:` of prefect.yaml, YAML anchors resolved."""
    with PREFECT_YAML.open() as fh:
        return tuple(yaml.safe_load(fh)["deployments"])


def _train_definitions() -> dict[str, dict[str, Any]]:
    """By deployment name: a model's (`train/mlp`) or an example task's (`train/regression`)."""
    return {d["name"]: d for d in definitions() if d["entrypoint"] == ENTRYPOINT}


def _pipeline_definition() -> dict[str, Any]:
    return next(d for d in definitions() if d["entrypoint"] == PIPELINE_ENTRYPOINT)


MODELS = tuple(_train_definitions())
PIPELINE_CRON = _pipeline_definition()["schedules"][0]["cron"]
PIPELINE_SLA = _pipeline_definition()["parameters"]["sla"]


async def ensure_pool(name: str) -> None:
    """Create the `elasticflow` work pool `name` unless it exists; one that
    exists loses any job variable a user may not set (a pool made before
    that rule offered `command`, `env` and `working_dir` to every run:
    worker/configuration.py), keeping what its operator fixed."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    from scheduler_service.worker import ElasticFlowWorker
    from scheduler_service.worker.configuration import confined

    async with get_client() as client:
        try:
            pool = await client.read_work_pool(name)
        except ObjectNotFound:
            await client.create_work_pool(WorkPoolCreate(
                name=name, type=ElasticFlowWorker.type,
                base_job_template=ElasticFlowWorker.get_default_base_job_template(),
            ))
            return
        template = confined(pool.base_job_template)
        if pool.type == ElasticFlowWorker.type and template != pool.base_job_template:
            await client.update_work_pool(name, WorkPoolUpdate(base_job_template=template))


def deploy(pool: str, models: Iterable[str] = MODELS, parameters: dict[str, Any] | None = None) -> dict[str, str]:
    """Deploy `train/<name>` for each of `models` on `pool`; returns deployment name -> id.

    A name prefect.yaml declares gets its parameters (a model, or an example
    task's model, dataset and loss); any other is taken for a model (a
    user's own) and deployed like the others.
    """
    from prefect.deployments.runner import EntrypointType

    from flows.train import train

    known = _train_definitions()
    ids: dict[str, str] = {}
    for model in models:
        spec = known.get(model) or {**next(iter(known.values())), "parameters": {"model": model}}
        deployment = train.to_deployment(
            name=model, work_pool_name=pool, parameters={**spec["parameters"], **(parameters or {})},
            job_variables=spec["work_pool"].get("job_variables"), description=spec["description"],
            entrypoint_type=EntrypointType.MODULE_PATH)
        ids[f"train/{model}"] = str(deployment.apply(work_pool_name=pool))
    return ids


def deploy_pipeline(
    pool: str, cron: str = PIPELINE_CRON, sla: str = PIPELINE_SLA, timezone: str = "UTC", paused: bool = False
) -> str:
    """Deploy the example pipeline as `pipeline/daily` on `pool`, run daily by a cron schedule; returns its id.

    The pipeline's `sla` parameter is stored as a time of day, not a date, so
    every scheduled run is due at its own next `sla`; a manual run can pass an
    ISO-8601 time or `+1h` instead. The pipeline run itself needs no GPU: the
    elasticflow worker launches it as a plain process and schedules only the
    `train/<model>` run it submits.
    """
    from prefect.deployments.runner import EntrypointType
    from prefect.events import DeploymentEventTrigger
    from prefect.schedules import Cron

    from flows.pipeline import daily_pipeline

    spec = _pipeline_definition()
    deployment = daily_pipeline.to_deployment(
        name=spec["name"], work_pool_name=pool, parameters={**spec["parameters"], "sla": sla},
        job_variables=spec["work_pool"].get("job_variables"), description=spec["description"],
        schedule=Cron(cron, timezone=timezone, active=spec["schedules"][0].get("active", True)), paused=paused,
        triggers=[DeploymentEventTrigger(**trigger) for trigger in spec.get("triggers", [])],
        entrypoint_type=EntrypointType.MODULE_PATH)
    return str(deployment.apply(work_pool_name=pool))
