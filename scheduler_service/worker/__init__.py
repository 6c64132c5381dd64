"""The `elasticflow` Prefect worker type. Prefect registers it by importing
`scheduler_service.worker.worker` (the `prefect.collections` entry point).

Lazy: the service's store, settings or contracts are imported without the
worker (and Prefect's worker machinery) coming with them, as `elasticflow
status` does.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "ElasticFlowJobConfiguration": "scheduler_service.worker.configuration",
    "ElasticFlowVariables": "scheduler_service.worker.configuration",
    "ElasticFlowWorker": "scheduler_service.worker.worker",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(name)
    return getattr(importlib.import_module(module), name)
