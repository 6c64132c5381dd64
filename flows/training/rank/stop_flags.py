"""What tells a rank to stop from outside its training loop, as one object
the process entry makes and hands to its `Worker`.

Three sources: a SIGTERM (`terminate`); the scheduler's stop for a command,
which the coordinator forwards the same way whatever carries the ranks (a
process rank finds it in its segment's folder, `listen`; a Ray actor is
told by a call, `ask_stop`), so that ranks read no control folder; and its
flow process gone (a process rank whose parent changed, or, for one the fork
server forked, whose launcher's pidfd says it ended: Prefect's hard kill of
a cancelled run reaches the flow's PID only, not its ranks). The Worker
reads them at each iteration boundary.
"""

from __future__ import annotations

import os
import select
import threading
from pathlib import Path
from typing import Any

STOP_FILE = "stop"  # in a process rank's segment folder: the command seq a stop was asked for


class StopFlags:
    def __init__(self, parent_pid: int | None, launcher_fd: int | None = None) -> None:
        self._parent_pid = parent_pid  # the flow process that launched this rank (None: a Ray actor's raylet)
        self._launcher_fd = launcher_fd  # a pidfd of the launcher, where that is not the parent
        self._terminated = False
        self._stop_seq = 0  # the newest command a stop was asked for
        self._stop_file: Path | None = None
        self._lock = threading.Lock()  # a Ray actor is told from another thread

    @classmethod
    def of_this_process(cls) -> StopFlags:
        """For a rank process launched by its flow process, made before anything else: its parent now."""
        return cls(os.getppid())

    @classmethod
    def watching(cls, launcher_pid: int) -> StopFlags:
        """For a rank the fork server forked for `launcher_pid` (standby.py):
        its parent is the server, so it watches its launcher through a pidfd
        (no reused PID can pass for it). A launcher already gone is seen at
        the first boundary."""
        try:
            return cls(None, os.pidfd_open(launcher_pid))
        except ProcessLookupError:
            return cls(-1)  # no parent has that PID: orphaned from the start

    def terminate(self) -> None:
        self._terminated = True

    def on_sigterm(self, signum: int, frame: Any) -> None:
        self.terminate()

    def listen(self, folder: Path) -> None:
        """Hear the coordinator's stops in `folder` (a process rank's segment folder)."""
        self._stop_file = folder / STOP_FILE

    def ask_stop(self, seq: int) -> None:
        """The coordinator forwards the scheduler's stop for its command `seq`."""
        with self._lock:
            self._stop_seq = max(self._stop_seq, seq)

    def stop_asked(self, applied_seq: int) -> bool:
        """A stop stands for a command later than the one the rank's round
        applies: one that comes late, for a command the round already applies
        (it was resized in place for it), is dropped."""
        if self._stop_file is not None:
            try:
                self.ask_stop(int(self._stop_file.read_text() or 0))
            except (OSError, ValueError):  # none yet (or being replaced)
                pass
        return self._stop_seq > applied_seq

    @property
    def terminated(self) -> bool:
        return self._terminated

    @property
    def orphaned(self) -> bool:
        """Its flow process is gone: stop and checkpoint at this boundary
        instead of training on for nobody, on GPUs the scheduler has given to
        someone else."""
        if self._launcher_fd is not None:
            return bool(select.select([self._launcher_fd], [], [], 0)[0])  # readable once it has exited
        return self._parent_pid is not None and os.getppid() != self._parent_pid
