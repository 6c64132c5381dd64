"""What the scheduler tells a training run it launches, beyond the user's
parameters: the deadline it was admitted with, where it was placed and where
its ranks run, and (for a run driven without a scheduler, as in tests and
benchmarks) a fixed GPU plan and where its control channel lives.

These are the runtime's knobs, not the user's: they are not parameters of
the `train` flow (a deployment shows only what a user sets), and they reach
its process in one typed variable, `ELASTICFLOW_LAUNCH`, which the worker's
execution backend writes (`scheduler_service.worker.backend`) and the flow
process reads: its boot (`standby`) and the `train` flow (the rest).
"""

from __future__ import annotations

import os
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

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
    gpus: list[int] | None = Field(default=None, description="the GPUs it was launched on (its control channel "
                                   "says so too, and says where it goes next)")
    nodes: list[str] | None = Field(default=None, description="the names of those GPUs' nodes")
    standby: int = Field(default=0, ge=0, description="rank processes its boot starts on this machine before "
                         "Prefect's engine, so that their imports overlap the engine's (or, forked, cost "
                         "nothing): the first segment's and the spares its runtime keeps for a restart; "
                         "0 when the ranks run elsewhere (Ray actors on the nodes)")
    ray_address: str | None = Field(default=None, description="the Ray cluster whose nodes run its ranks")

    def to_env(self) -> dict[str, str]:
        return {LAUNCH_ENV: self.model_dump_json(exclude_none=True)}

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "LaunchSpec":
        text = (env if env is not None else os.environ).get(LAUNCH_ENV)
        return cls.model_validate_json(text) if text else cls()

    def parameters(self) -> dict[str, Any]:
        """What it sets in the runtime's `TrainParameters` (the admitted deadline replaces the user's)."""
        return self.model_dump(exclude_none=True, exclude={"admitted", "gpus", "nodes", "standby"})


def standby_of(env: dict[str, str]) -> int:
    """The launch's `standby`, for code that must not fail on a bad value
    (the fork server, a boot about to start cold): 0 then."""
    try:
        return LaunchSpec.from_env(env).standby
    except ValidationError:
        return 0
