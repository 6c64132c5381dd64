"""ElasticFlow's checkpoint store.

`CheckpointStorage` (plain, fsspec) is what training workers use; `CheckpointStore`
is the same thing as a Prefect block. The block is imported lazily so that a
worker process does not pay for importing Prefect.
"""

from __future__ import annotations

from typing import Any

from elasticflow_block.storage import CheckpointCorrupt, CheckpointInfo, CheckpointStorage

__all__ = ["CheckpointCorrupt", "CheckpointInfo", "CheckpointStorage", "CheckpointStore"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointStore":
        from elasticflow_block.block import CheckpointStore

        return CheckpointStore
    raise AttributeError(name)
