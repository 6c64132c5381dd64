"""What tells a rank to stop from outside its training loop, as one object
the process entry makes and hands to its `Worker`.

Three sources, each with its own setter: a SIGTERM (`terminate`); the
launcher's ask, for a rank that reads no control folder (a Ray actor, whose
coordinator forwards the scheduler's stop: `ask_stop`); and its flow process
gone (a process rank whose parent changed: Prefect's hard kill of a
cancelled run reaches the flow's PID only, not its ranks). The Worker reads
them at each iteration boundary. They were module globals of `rank.py` that
`ray_actor.py` assigned from outside.
"""

from __future__ import annotations

import os
from typing import Any


class StopFlags:
    def __init__(self, parent_pid: int | None) -> None:
        self._parent_pid = parent_pid  # the flow process that launched this rank (None: a Ray actor's raylet)
        self._terminated = False
        self._stop_asked = False

    @classmethod
    def of_this_process(cls) -> StopFlags:
        """For a rank process launched by its flow process, made before anything else: its parent now."""
        return cls(os.getppid())

    def terminate(self) -> None:
        self._terminated = True

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.terminate()

    def ask_stop(self, asked: bool = True) -> None:
        """The launcher asks this rank to stop (False: a stop asked before no longer stands)."""
        self._stop_asked = asked

    @property
    def terminated(self) -> bool:
        return self._terminated

    @property
    def stop_asked(self) -> bool:
        return self._stop_asked

    @property
    def orphaned(self) -> bool:
        """Its flow process is gone: stop and checkpoint at this boundary
        instead of training on for nobody, on GPUs the scheduler has given to
        someone else."""
        return self._parent_pid is not None and os.getppid() != self._parent_pid
