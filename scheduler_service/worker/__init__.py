"""The `elasticflow` Prefect worker type (registered through the
`prefect.collections` entry point: importing this package registers it)."""

from scheduler_service.worker.worker import ElasticFlowJobConfiguration, ElasticFlowVariables, ElasticFlowWorker

__all__ = ["ElasticFlowJobConfiguration", "ElasticFlowVariables", "ElasticFlowWorker"]
