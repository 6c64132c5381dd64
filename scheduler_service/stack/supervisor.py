"""Supervision of the stack's long-lived processes (the Prefect server, the
worker): one that exits is started again, after a backoff, with one log line.

Why not a fuse: `elasticflow up` used to stop everything when either exited,
and so turned a worker crash into a full outage that killed every training
run (issue 14). Training runs live in their own sessions and outlive the
worker; a restarted worker adopts them, and the worker rides out a server
restart. So the cheap and right answer to an exit is to start it again.

Each process gets its own process group (its session), recorded with its
start time (`groups.Group`), and is only ever signalled through it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from scheduler_service.stack.groups import Group, record_group, start_time, stop_groups

PRIVATE_UMASK = 0o077  # what the stack's processes create under the home: 0600 files, 0700 folders
BACKOFF_S = (1.0, 2.0, 5.0, 10.0, 30.0, 60.0)  # after the 1st, 2nd... quick exit in a row
HEALTHY_S = 60.0  # a process that ran this long before exiting starts again at the first backoff


def _child_setup() -> None:
    """In the child: Ctrl-C and SIGTERM act, even if our parent ignored them;
    what it creates is private to the account."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.umask(PRIVATE_UMASK)


@dataclass
class Supervised:
    """One process the stack keeps running: `python -m <module> <args>` (Prefect's CLI unless said)."""

    name: str
    args: list[str]
    env: dict[str, str]
    log: Path
    home: Path
    process: subprocess.Popen[bytes] | None = None
    group: Group | None = None
    started_t: float = 0.0
    quick_exits: int = 0  # exits in a row, each soon after its start
    restart_at: float | None = None  # when an exited process is due to start again
    restarts: int = field(default=0)
    stopped: bool = False  # by the stack: not to be restarted
    module: str = "prefect"
    restart: bool = True  # False: an exit is reported, not mended (a local Ray cluster's address would change)
    unset: tuple[str, ...] = ()  # variables of this process's environment the child must not get

    def start(self) -> None:
        with open(self.log, "ab", opener=lambda name, flags: os.open(name, flags, 0o600)) as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", self.module, *self.args],
                env={k: v for k, v in {**os.environ, **self.env}.items() if k not in self.unset}, stdout=log,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=_child_setup,
            )
        self.started_t = time.time()
        self.stopped = False
        self.group = Group(self.process.pid, start_time(self.process.pid) or 0, self.name)
        record_group(self.home, self.process.pid, self.name)  # for a cleanup after this process died
        self.restart_at = None

    def check(self, now: float | None = None) -> str | None:
        """Notice an exit and schedule a restart, or restart when due; a line
        for the operator when either happens."""
        now = time.time() if now is None else now
        if self.process is None or self.stopped:
            return None
        if self.restart_at is None:
            code = self.process.poll()
            if code is None:
                return None
            ran_s = now - self.started_t
            if not self.restart:
                self.stopped = True
                return f"the {self.name} exited with status {code} after {ran_s:.0f} s (log {self.log})"
            self.quick_exits = 0 if ran_s >= HEALTHY_S else self.quick_exits + 1
            wait_s = BACKOFF_S[min(max(self.quick_exits - 1, 0), len(BACKOFF_S) - 1)]
            self.restart_at = now + wait_s
            self._reap_group()
            return (f"the {self.name} exited with status {code} after {ran_s:.0f} s; restarting it in "
                    f"{wait_s:.0f} s (log {self.log})")
        if now < self.restart_at:
            return None
        self.start()
        self.restarts += 1
        return f"the {self.name} restarted (pid {self.process.pid}, restart {self.restarts})"

    def _reap_group(self) -> None:
        """What the exited leader left in its group (a profile's ranks of a
        dead worker): gone with it, as a fresh start expects."""
        if self.group is not None:
            stop_groups([self.group], grace_s=0.0, first=signal.SIGKILL)

    def stop(self, grace_s: float = 5.0, interrupt: bool = True) -> None:
        """SIGINT first (a clean exit), then after `grace_s` the group is
        SIGKILLed: flow runs are in their own groups and the stack stops them
        itself. Not a longer wait: Prefect's worker takes a first SIGINT as
        "cancel every flow run I wait on", giving each 30 s before SIGKILL, and
        its SIGTERM handler only sends itself that SIGINT. `interrupt=False`:
        no SIGINT, the SIGKILL at once (a worker whose runs must live on)."""
        self.restart_at, self.stopped = None, True
        if self.process is None or self.group is None:
            return
        if interrupt and self.group.signal(signal.SIGINT):
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        stop_groups([self.group], grace_s=0.0, first=signal.SIGKILL)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
