"""Stopping a stack signals the process groups it recorded, and nothing that
merely shares its ELASTICFLOW_HOME (issue 14: a user's shell and a CLI call
that had exported it were killed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from flows.training.boot import record_group
from scheduler_service.stack.groups import groups_of
from scheduler_service.stack.local import stop_processes_of


def _alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


def test_stopping_spares_a_bystander_with_the_same_home_and_stops_a_recorded_group(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = {**os.environ, "ELASTICFLOW_HOME": str(home)}
    bystander = subprocess.Popen(["sleep", "300"], env=env, start_new_session=True)
    # a "flow run": a group leader with a child, as a flow process and its ranks
    ours = subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['sleep', '300']);"
                             " time.sleep(300)"], env=env, start_new_session=True)
    try:
        record_group(home, ours.pid, "flow run test")
        assert [g.pgid for g in groups_of(home)] == [ours.pid]
        stop_processes_of(home, grace_s=5.0)
        assert ours.wait(timeout=30) == -signal.SIGTERM
        assert _alive(bystander), "a process that only shares ELASTICFLOW_HOME was signalled"
        assert groups_of(home) == [] and not any((home / "run" / "groups").iterdir())  # its record is gone too
    finally:
        for proc in (bystander, ours):
            proc.kill()
            proc.wait()


def test_a_record_whose_pid_now_belongs_to_someone_else_is_not_honoured(tmp_path: Path) -> None:
    home = tmp_path / "home"
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        record_group(home, bystander.pid, "flow run long gone")
        (record,) = (home / "run" / "groups").iterdir()
        pgid, started, what = record.read_text().split(" ", 2)
        record.write_text(f"{pgid} {int(started) - 1} {what}")  # recorded before this process existed
        assert groups_of(home) == []
        stop_processes_of(home, grace_s=0.0)
        time.sleep(0.2)
        assert _alive(bystander)
    finally:
        bystander.kill()
        bystander.wait()
