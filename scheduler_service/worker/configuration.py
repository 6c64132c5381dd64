"""The `elasticflow` work pool's job template: what a user (or a deployment)
may set for a training run, and nothing the scheduler decides.

The GPU set, world size and nodes are the scheduler's: a serverless interface
never asks for a GPU count, so they are not job variables; the execution
backend hands them to the run when it launches it.
"""

from __future__ import annotations

from pydantic import Field
from prefect.workers.process import ProcessJobConfiguration, ProcessVariables, ProcessWorkerResult


class ElasticFlowJobConfiguration(ProcessJobConfiguration):
    # Flow runs must outlive a crashed worker (it adopts them when restarted):
    # output piped through the worker would break with it. Logs reach the API anyway.
    stream_output: bool = Field(default=False)


class ElasticFlowVariables(ProcessVariables):
    stream_output: bool = Field(
        default=False,
        description="Copy flow run output to the worker's output. Off: a run then survives a worker crash.",
    )


class ElasticFlowWorkerResult(ProcessWorkerResult):
    """Exit status of a training flow run process."""
