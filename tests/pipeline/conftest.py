"""The service test stack (real Prefect server, `gpus` pool, `train/mlp`, the
worker as a separate process), plus the example pipeline deployed as
`pipeline/daily` by the same function `elasticflow up` calls."""

from __future__ import annotations

import pytest

from tests.stack import POOL, Stack


@pytest.fixture(scope="session")
def pipeline_stack(stack: Stack) -> Stack:
    from scheduler_service.stack.deployments import deploy_pipeline

    deploy_pipeline(POOL)
    return stack
