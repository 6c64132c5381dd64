"""Stopping the `Cancelling` runs that Prefect's own machinery does not reach.

Prefect's process worker stops a run on `Cancelling` only if that very worker
launched its process and saw the event after the launch. Two cases fall
outside: a run adopted after a worker restart (its process was launched by
the worker before), and a run cancelled in the instant of its launch. Left
alone, such a run trains to its end, stays `Cancelling` for ever and keeps its
GPUs. The worker stops it in three steps, each only if the one before did not
end its process in time:

1. `stop` on the run's control channel: at the next iteration boundary its DDP
   workers checkpoint and exit, the flow returns, and its engine, which may not
   complete a `Cancelling` run, exits;
2. SIGTERM, as Prefect's runner would send: the workers checkpoint on the way
   out, and the engine reports `Crashed`, not knowing why;
3. SIGKILL.

Once the process is gone the worker ends the run `Cancelled`, with the
canceller's message (over that `Crashed` too).
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Step = Literal["stop", "terminated", "killed", "gone"]


@dataclass
class Stop:
    """A run seen `Cancelling`, and what was done to its process."""

    pid: int | None
    message: str
    seen: float
    stopped: float | None = None
    terminated: float | None = None
    killed: bool = False


class Cancellations:
    """Which `Cancelling` runs to stop, and when: an adopted run at once; a run
    this worker launched only after `grace_s`, which leaves Prefect's own
    cancellation (SIGTERM, SIGKILL 30 s later) time to act first: a second
    SIGTERM would interrupt the checkpoint that the first one started."""

    def __init__(self, grace_s: float = 45.0, terminate_after_s: float = 30.0, kill_after_s: float = 60.0) -> None:
        self.grace_s = grace_s
        self.terminate_after_s = terminate_after_s
        self.kill_after_s = kill_after_s
        self._stops: dict[str, Stop] = {}

    def step(self, run_id: str, pid: int | None, message: str | None, now: float, adopted: bool) -> Step | None:
        """The run is `Cancelling` at `now`: take the step that is due. "stop" is
        the worker's to send, on the run's control channel; "terminated" and
        "killed" are done here; "gone" means no process of this run is left (it
        can be ended); None, nothing for now."""
        stop = self._stops.setdefault(run_id, Stop(pid, message or "cancelled", now))
        stop.pid = stop.pid or pid  # a run seen as it launched has its PID only later
        if stop.pid is None or not is_flow_process(stop.pid, run_id):
            return "gone"
        if stop.stopped is None:
            if adopted or now - stop.seen >= self.grace_s:
                stop.stopped = now
                return "stop"
        elif stop.terminated is None:
            if now - stop.stopped >= self.terminate_after_s:
                _signal(stop.pid, signal.SIGTERM)
                stop.terminated = now
                return "terminated"
        elif not stop.killed and now - stop.terminated >= self.kill_after_s:
            _signal(stop.pid, signal.SIGKILL)
            stop.killed = True
            return "killed"
        return None

    def forget(self, run_id: str) -> Stop | None:
        """The run's process is gone: what was asked of it, if anything."""
        return self._stops.pop(run_id, None)


def process_id(infrastructure_pid: str | None) -> int | None:
    """The local PID in Prefect's `infrastructure_pid` ("1234" or "host:1234")."""
    try:
        return int(str(infrastructure_pid).rsplit(":", 1)[-1]) if infrastructure_pid else None
    except ValueError:
        return None


def is_flow_process(pid: int, run_id: str) -> bool:
    """Whether `pid` is still the process Prefect started for this flow run: a
    PID is reused once its process is gone, and a stranger must not be
    signalled. Without /proc (not Linux) a live PID of ours is trusted."""
    if not Path("/proc/self/environ").exists():
        try:
            os.kill(pid, 0)
        except OSError:  # gone, or another user's
            return False
        return True
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return False
    return f"PREFECT__FLOW_RUN_ID={run_id}".encode() in environ.split(b"\0")


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:  # gone since, or not ours: the next step reads "gone"
        pass
