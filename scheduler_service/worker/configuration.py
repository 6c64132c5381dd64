"""The `elasticflow` work pool's job template: what a user (or a deployment)
may set for a training run, and nothing the scheduler decides.

The GPU set, world size and nodes are the scheduler's: a serverless interface
never asks for a GPU count, so they are not job variables; the execution
backend hands them to the run when it launches it.

Nor may a run or a deployment set the command, the environment or the working
folder of its flow process: each would run code of its choosing as the
stack's user (`command="sh -c ..."`, `env={"PYTHONPATH": ...}` with a
`sitecustomize.py`), around the model allow-list and the rank account. What
a deployment legitimately needs there, the operator writes into the pool's
base job template (its `job_configuration`), once, not per run. The only
user code that runs is the user's model, in the run's own processes.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from prefect.workers.process import ProcessJobConfiguration, ProcessWorkerResult

# Where a run's or a deployment's job variables would reach past its model.
OPERATOR_ONLY = ("command", "env", "working_dir")


class ElasticFlowVariables(BaseModel):
    """The job variables a user or a deployment may set: these and no others
    (`additionalProperties: false`, so Prefect's server refuses any other
    when a deployment or a flow run is created; take-in refuses them too)."""

    model_config = ConfigDict(extra="forbid")

    stream_output: bool = Field(
        default=False,
        description="Copy flow run output to the worker's output. Off: a run then survives a worker crash.",
    )


ALLOWED = frozenset(ElasticFlowVariables.model_fields)


def forbidden(job_variables: Any) -> list[str]:
    """The job variables in `job_variables` no user may set, sorted; a
    dotted key (`env.PYTHONPATH`, as Prefect's CLI also accepts) counts as
    its first part."""
    if not isinstance(job_variables, dict):
        return []
    return sorted({str(key).split(".", 1)[0] for key in job_variables} - ALLOWED)


class ElasticFlowJobConfiguration(ProcessJobConfiguration):
    # Flow runs must outlive a crashed worker (it adopts them when restarted):
    # output piped through the worker would break with it. Logs reach the API anyway.
    stream_output: bool = Field(default=False)

    @classmethod
    def json_template(cls) -> dict[str, Any]:
        """Only the user's variables are templated in; the command, the
        environment and the working folder are the operator's, fixed here."""
        return {key: value for key, value in super().json_template().items() if key in ALLOWED}

    @classmethod
    async def from_template_and_values(cls, base_job_template: dict[str, Any], values: dict[str, Any],
                                       client: Any = None) -> "ElasticFlowJobConfiguration":
        """A run's and its deployment's job variables reach its configuration
        only where a user may set them, whatever the pool's template says (a
        pool made before this rule, or changed since): take-in refused the
        others already; this is the launch's own guard."""
        allowed = {key: value for key, value in values.items() if str(key).split(".", 1)[0] in ALLOWED}
        return await super().from_template_and_values(confined(base_job_template), allowed, client=client)


def confined(template: dict[str, Any]) -> dict[str, Any]:
    """A pool's base job template with no variable a user may not set: those
    variables are dropped from its schema, which forbids any other, and so
    are the job configuration's fields that only they filled in. What the
    operator wrote into the job configuration itself stays."""
    result = copy.deepcopy(template)
    variables = result.setdefault("variables", {})
    properties = variables.setdefault("properties", {})
    dropped = [name for name in properties if name not in ALLOWED]
    for name in dropped:
        del properties[name]
    variables["required"] = [name for name in variables.get("required", []) if name in ALLOWED]
    if not variables["required"]:
        del variables["required"]
    variables["additionalProperties"] = False
    placeholder = re.compile(r"\{\{\s*(%s)\s*\}\}" % "|".join(map(re.escape, dropped))) if dropped else None
    configuration = result.setdefault("job_configuration", {})
    for key in [k for k, v in configuration.items()
                if placeholder is not None and placeholder.search(_text(v))]:
        del configuration[key]
    return result


def _text(value: Any) -> str:
    import json

    return value if isinstance(value, str) else json.dumps(value, default=str)


class ElasticFlowWorkerResult(ProcessWorkerResult):
    """Exit status of a training flow run process."""
