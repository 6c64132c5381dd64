"""Deployments `train/<model>` of the `train` flow on an `elasticflow` work pool.

Users name a model, its hyperparameters and a deadline; never a GPU count:

    prefect deployment run train/mlp --param iterations=200 --param deadline=+10m
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

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
