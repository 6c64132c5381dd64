"""Deployments `train/<model>` of the `train` flow on an `elasticflow` work pool.

Users name a model, its hyperparameters and a deadline; never a GPU count:

    prefect deployment run train/mlp --param iterations=200 --param deadline=+10m
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

PROJECT_ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = "flows/train.py:train"
MODELS = ("resnet", "vgg", "transformer", "mlp")


async def ensure_pool(name: str) -> None:
    """Create the `elasticflow` work pool `name` unless it exists."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    from scheduler_service.worker import ElasticFlowWorker

    async with get_client() as client:
        try:
            await client.read_work_pool(name)
        except ObjectNotFound:
            await client.create_work_pool(WorkPoolCreate(
                name=name, type=ElasticFlowWorker.type,
                base_job_template=ElasticFlowWorker.get_default_base_job_template(),
            ))


def deploy(pool: str, models: Iterable[str] = MODELS, parameters: dict[str, Any] | None = None) -> dict[str, str]:
    """Deploy `train/<model>` for each model; returns deployment name -> id."""
    from prefect import flow

    ids: dict[str, str] = {}
    for model in models:
        train = flow.from_source(source=str(PROJECT_ROOT), entrypoint=ENTRYPOINT)
        deployment_id = train.deploy(  # type: ignore[union-attr]
            name=model, work_pool_name=pool, parameters={"model": model, **(parameters or {})},
            description=f"Train {model}: give iterations or epochs, hyperparameters and a deadline, never GPUs.",
            print_next_steps=False, ignore_warnings=True,
        )
        ids[f"train/{model}"] = str(deployment_id)
    return ids


PIPELINE_ENTRYPOINT = "flows/pipeline.py:daily_pipeline"
PIPELINE_CRON = "0 1 * * *"  # 01:00 UTC: five hours before the default SLA
PIPELINE_SLA = "06:00Z"  # a time of day: each run's registered model is due at the next 06:00 UTC


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
    from prefect import flow
    from prefect.schedules import Cron

    pipeline = flow.from_source(source=str(PROJECT_ROOT), entrypoint=PIPELINE_ENTRYPOINT)
    deployment_id = pipeline.deploy(  # type: ignore[union-attr]
        name="daily", work_pool_name=pool, parameters={"sla": sla},
        schedule=Cron(cron, timezone=timezone), paused=paused,
        description=(f"Example ML pipeline (prepare -> train -> evaluate -> register) due daily at {sla}; "
                     "training's deadline is derived from that SLA. See docs/pipelines.md."),
        print_next_steps=False, ignore_warnings=True,
    )
    return str(deployment_id)
