"""The process groups a stack started, and the only processes it ever signals.

Why a record and not a search: a stack once stopped "every process whose
environment holds ELASTICFLOW_HOME=<home>", and so killed a user's shell or
notebook that had exported it as the docs say (issue 14). Now each process
group the stack (or its worker, for flow runs and the fork server) starts is
written down when it starts, under `<home>/run/groups/`, with its leader's
start time, and stopping signals those groups and nothing else.

A PID can be reused once its process is gone; a process group's ID cannot
while any member lives. So a record is honoured only while its group is
provably the one recorded: the leader alive with the recorded start time, or,
the leader gone, members that all started after it. Records of groups that
are gone are removed.

Standard library only: `flows.training.launch.boot` writes records before anything
heavy is imported (it imports `record_group` from `flows.training.launch.boot`, which
is where the writing side lives, so that the training runtime does not import
the service).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from flows.training.launch.boot import groups_dir, record_group, start_time

__all__ = ["Group", "groups_of", "record_group", "start_time", "stop_groups"]


@dataclass(frozen=True)
class Group:
    pgid: int
    start: int  # the leader's start time, clock ticks since boot (/proc/<pid>/stat field 22)
    what: str
    record: Path | None = None

    def members(self) -> list[int]:
        """Live processes of this group if it is still the one recorded, else []."""
        found: list[tuple[int, int]] = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            stat = _stat(int(proc.name))
            if stat is not None and stat[1] == self.pgid and stat[0] not in ("Z", "X"):
                found.append((int(proc.name), stat[2]))
        for pid, started in found:
            if (pid == self.pgid and started != self.start) or started < self.start:
                return []  # the PID was reused: another group, not ours
        return [pid for pid, _ in found]

    def signal_leader(self, sig: int) -> bool:
        """Signal only the process that leads the group, if the group is still
        ours and its leader alive: a signal the leader handles (the local Ray
        cluster adds a node on SIGHUP) would end the others (Ray's GCS and
        raylets die of a SIGHUP sent to the whole group)."""
        return self.pgid in self.members() and _send(os.kill, self.pgid, sig)

    def signal(self, sig: int) -> bool:
        """Signal the whole group if it is still ours and alive; whether it was."""
        return bool(self.members()) and _send(os.killpg, self.pgid, sig)


def _send(kill: Callable[[int, int], None], target: int, sig: int) -> bool:
    try:
        kill(target, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, process group, start time) of a process, or None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2]), int(fields[19])


def groups_of(home: Path) -> list[Group]:
    """Every recorded group of the stack at `home`; records of groups that are gone are removed."""
    folder = groups_dir(home)
    if not folder.is_dir():
        return []
    groups = []
    for record in sorted(folder.iterdir()):
        try:
            pgid, start, what = record.read_text().split(" ", 2)
            group = Group(int(pgid), int(start), what.strip(), record)
        except (OSError, ValueError):
            continue
        if group.members():
            groups.append(group)
        else:
            record.unlink(missing_ok=True)
    return groups


def stop_groups(groups: list[Group], grace_s: float = 10.0, first: int = signal.SIGTERM) -> None:
    """`first` (SIGTERM: training checkpoints on it) to each group, SIGKILL to
    what is left after `grace_s`; records of stopped groups are removed."""
    live = [g for g in groups if g.signal(first)]
    end = time.time() + grace_s
    while live and time.time() < end:
        time.sleep(0.2)
        live = [g for g in live if g.members()]
    for group in live:
        group.signal(signal.SIGKILL)
    for group in groups:
        if group.record is not None and not group.members():
            group.record.unlink(missing_ok=True)
