"""A training run's optimisation settings, shared by the `train` flow and the
pipeline task that submits it (which validates them before it waits in a
queue). Only pydantic: importing it costs nothing."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


MAX_BATCH = 65536  # samples in a global batch: beyond it, a bad value, not a training run
MAX_LEARNING_RATE = 100.0


class Hyperparameters(BaseModel):
    """Optimisation settings. The global batch size is fixed for the whole run,
    whatever the number of GPUs: that is what keeps resizing invisible to SGD."""

    model_config = ConfigDict(extra="forbid")

    global_batch_size: int = Field(default=32, ge=1, le=MAX_BATCH)
    # Finite and within what any optimiser is run with: a learning rate of
    # 1e308 was admitted, held GPUs, and only failed (NaN losses) in training.
    learning_rate: float = Field(default=0.05, gt=0, le=MAX_LEARNING_RATE, allow_inf_nan=False)
    optimizer: Literal["sgd", "adam", "adamw"] = "sgd"
    momentum: float = Field(default=0.9, ge=0, lt=1, allow_inf_nan=False)
    weight_decay: float = Field(default=0.0, ge=0, le=1, allow_inf_nan=False)
    max_micro_batch: int | None = Field(
        default=None, ge=1, le=MAX_BATCH,
        description="largest per-worker forward pass; larger shards use gradient accumulation"
    )
    seed: int = Field(default=0, ge=0, description="model init and data order")
    deterministic: bool = Field(
        default=False,
        description="deterministic kernels only (torch.use_deterministic_algorithms, cuDNN deterministic and no "
                    "benchmark, CUBLAS_WORKSPACE_CONFIG): on GPU a resized run then follows the never-resized one "
                    "as closely as float reduction order allows, at a cost in speed (docs/training.md)")
