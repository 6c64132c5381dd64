"""ElasticFlow's checkpoint store and the training step for ML pipelines.

`CheckpointStorage` (plain, fsspec) is what training workers use; `CheckpointStore`
is the same thing as a Prefect block. `train_model` is the task a pipeline DAG
calls to train against its SLA (`elasticflow_block.pipeline`), with the pure
deadline derivation in `elasticflow_block.deadline`. Everything but the storage
is imported lazily so that a training worker process does not pay for
importing Prefect.
"""

from __future__ import annotations

import importlib
from typing import Any

from elasticflow_block.storage import CheckpointCorrupt, CheckpointInfo, CheckpointStorage

_LAZY = {
    "CheckpointStore": "elasticflow_block.block",
    "DeadlinePlan": "elasticflow_block.deadline",
    "DownstreamStep": "elasticflow_block.deadline",
    "HistoryPolicy": "elasticflow_block.deadline",
    "SLATooClose": "elasticflow_block.deadline",
    "derive_deadline": "elasticflow_block.deadline",
    "resolve_sla": "elasticflow_block.deadline",
    "TrainedModel": "elasticflow_block.pipeline",
    "TrainingError": "elasticflow_block.errors",
    "TrainingFailed": "elasticflow_block.errors",
    "TrainingRejected": "elasticflow_block.errors",
    "refusal_state": "elasticflow_block.errors",
    "train_model": "elasticflow_block.pipeline",
}

__all__ = [
    "CheckpointCorrupt",
    "CheckpointInfo",
    "CheckpointStorage",
    "CheckpointStore",
    "DeadlinePlan",
    "DownstreamStep",
    "HistoryPolicy",
    "SLATooClose",
    "TrainedModel",
    "TrainingError",
    "TrainingFailed",
    "TrainingRejected",
    "derive_deadline",
    "refusal_state",
    "resolve_sla",
    "train_model",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(name)
    return getattr(importlib.import_module(module), name)
