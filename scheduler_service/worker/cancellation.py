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
canceller's message (over that `Crashed` too). Steps 2 and 3 are the one
`Escalation` of the worker, which Prefect's own `kill_infrastructure` runs
too (`backend.FlowProcesses.kill`); each step is a typed `StopStep`.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from enum import Enum
from pathlib import Path


class StopStep(str, Enum):
    """What a step in stopping a run did (a `str`, so "stop" == StopStep.STOP)."""

    STOP = "stop"  # asked on the run's control channel: the worker's to send
    TERMINATED = "terminated"  # SIGTERM sent
    KILLED = "killed"  # SIGKILL sent
    GONE = "gone"  # no process of this run is left: it can be ended


class Escalation:
    """SIGTERM to a run's process (its ranks checkpoint on the way out), then
    SIGKILL `kill_after_s` later if it is still there: Prefect's own way to
    stop a process, for both of the worker's. `kill_infrastructure` runs it
    to the end at once (`run`); a cancellation Prefect does not reach takes
    it one step per poll (`step`), after asking on the control channel first.

    Only a process that is still that run's is signalled: a PID is reused
    once its process is gone (`is_flow_process`). Without a run id (Prefect
    gave none) a live PID of ours is trusted."""

    def __init__(self, pid: int, run_id: str | None, kill_after_s: float) -> None:
        self.pid, self.run_id, self.kill_after_s = pid, run_id, kill_after_s
        self.terminated: float | None = None
        self.killed = False

    def there(self) -> bool:
        return is_flow_process(self.pid, self.run_id) if self.run_id is not None else _exists(self.pid)

    def step(self, now: float) -> StopStep | None:
        """The signal due at `now`, if any: TERMINATED, then KILLED; GONE once
        no process of the run is left; None while waiting."""
        if not self.there():
            return StopStep.GONE
        if self.terminated is None:
            _signal(self.pid, signal.SIGTERM)
            self.terminated = now
            return StopStep.TERMINATED
        if not self.killed and now - self.terminated >= self.kill_after_s:
            _signal(self.pid, signal.SIGKILL)
            self.killed = True
            return StopStep.KILLED
        return None

    def run(self, poll_s: float = 0.2) -> StopStep:
        """Every step now, waiting between them: GONE or KILLED."""
        while True:
            step = self.step(time.monotonic())
            if step in (StopStep.GONE, StopStep.KILLED):
                return step
            time.sleep(poll_s)


@dataclass
class Cancelling:
    """A run seen `Cancelling`, and what was done to its process."""

    pid: int | None
    message: str
    seen: float
    stopped: float | None = None
    signals: Escalation | None = None

    @property
    def terminated(self) -> float | None:
        """When it was sent SIGTERM (None: not yet, or never)."""
        return self.signals.terminated if self.signals else None

    @property
    def killed(self) -> bool:
        return bool(self.signals and self.signals.killed)


class Cancellations:
    """Which `Cancelling` runs to stop, and when: an adopted run at once; a run
    this worker launched only after `grace_s`, which leaves Prefect's own
    cancellation (SIGTERM, SIGKILL 30 s later) time to act first: a second
    SIGTERM would interrupt the checkpoint that the first one started."""

    def __init__(self, grace_s: float = 45.0, terminate_after_s: float = 30.0, kill_after_s: float = 60.0) -> None:
        self.grace_s = grace_s
        self.terminate_after_s = terminate_after_s
        self.kill_after_s = kill_after_s
        self._stops: dict[str, Cancelling] = {}

    def step(self, run_id: str, pid: int | None, message: str | None, now: float, adopted: bool) -> StopStep | None:
        """The run is `Cancelling` at `now`: take the step that is due (None:
        nothing for now). STOP is the worker's to send, on the run's control
        channel; the signals are sent here."""
        stop = self._stops.setdefault(run_id, Cancelling(pid, message or "cancelled", now))
        stop.pid = stop.pid or pid  # a run seen as it launched has its PID only later
        if stop.pid is None or not is_flow_process(stop.pid, run_id):
            return StopStep.GONE
        if stop.stopped is None:
            if adopted or now - stop.seen >= self.grace_s:
                stop.stopped = now
                return StopStep.STOP
            return None
        if stop.signals is None:
            if now - stop.stopped < self.terminate_after_s:
                return None
            stop.signals = Escalation(stop.pid, run_id, self.kill_after_s)
        return stop.signals.step(now)

    def forget(self, run_id: str) -> Cancelling | None:
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
        return _exists(pid)
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or another user's
        return False
    return f"PREFECT__FLOW_RUN_ID={run_id}".encode() in environ.split(b"\0")


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:  # gone, or another user's
        return False
    return True


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except OSError:  # gone since, or not ours: the next step reads "gone"
        pass
