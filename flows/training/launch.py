"""What the scheduler tells a training run it launches, beyond the user's
parameters: the deadline it was admitted with, and (for a run driven without
a scheduler, as in tests and benchmarks) a fixed GPU plan and where its
control channel lives.

These are the runtime's knobs, not the user's: they are not parameters of
the `train` flow (a deployment shows only what a user sets), and they reach
its process in one typed variable, `ELASTICFLOW_LAUNCH`.
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

LAUNCH_ENV = "ELASTICFLOW_LAUNCH"


class LaunchSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    deadline: datetime | None = Field(
        default=None, description="the deadline the run was admitted with: a relative one (`+10m`) stays what it "
        "meant at submission, and a late start still trains")
    admitted: bool = Field(default=False, description="launched by the scheduler, which checked the deadline")
    gpu_plan: list[list[int]] | None = Field(default=None, description="GPU sets, used in order (no scheduler)")
    switch_at: list[int] | None = Field(default=None, description="iterations at which to move to the next set")
    control_dir: str | None = Field(default=None, description="root of the file control channel")

    def to_env(self) -> dict[str, str]:
        return {LAUNCH_ENV: self.model_dump_json(exclude_none=True)}

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "LaunchSpec":
        text = (env if env is not None else os.environ).get(LAUNCH_ENV)
        return cls.model_validate_json(text) if text else cls()

    def parameters(self) -> dict[str, Any]:
        """What it sets in the runtime's `TrainParameters` (the admitted deadline replaces the user's)."""
        out = self.model_dump(exclude_none=True, exclude={"admitted"})
        return out
