"""The `elasticflow` Prefect worker type (registered through the
`prefect.collections` entry point: importing this package registers it)."""

from scheduler_service.worker.configuration import ElasticFlowJobConfiguration, ElasticFlowVariables
from scheduler_service.worker.worker import ElasticFlowWorker

__all__ = ["ElasticFlowJobConfiguration", "ElasticFlowVariables", "ElasticFlowWorker"]
