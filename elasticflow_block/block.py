"""The checkpoint store as a Prefect block, so a deployment can name it.

`CheckpointStore(url="s3://bucket/ckpts", keep=3).save("my-store")` once, then
`train(..., checkpoint_store="my-store")`. Workers never load the block: the flow
resolves it to a URL and `keep`, and workers use `CheckpointStorage` directly.
"""

from __future__ import annotations

from typing import Any

from prefect.blocks.core import Block
from pydantic import Field

from elasticflow_block.storage import CheckpointInfo, CheckpointStorage, default_root


class CheckpointStore(Block):
    """Where ElasticFlow training runs keep their checkpoints (any fsspec URL)."""

    _block_type_name = "ElasticFlow Checkpoint Store"
    _block_type_slug = "elasticflow-checkpoint-store"
    _description = "Atomic, checksummed, pruned training checkpoints keyed by flow run."

    url: str = Field(default_factory=default_root, description="fsspec URL or local directory.")
    keep: int = Field(default=3, ge=1, description="Checkpoints kept per run; older ones are pruned.")

    def storage(self) -> CheckpointStorage:
        return CheckpointStorage(self.url, keep=self.keep)

    def save_checkpoint(self, run_key: str, iteration: int, state: dict[str, Any]) -> CheckpointInfo:
        return self.storage().save(run_key, iteration, state)

    def load_latest(self, run_key: str) -> tuple[dict[str, Any], CheckpointInfo] | None:
        return self.storage().load_latest(run_key)
