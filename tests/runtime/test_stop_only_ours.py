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

from flows.training.launch.boot import record_group
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


def test_a_signal_for_the_leader_reaches_it_and_not_the_rest_of_its_group(tmp_path: Path) -> None:
    """Chaos once added a Ray node back with SIGHUP to the local cluster's
    whole group: Ray's GCS, in that group, died of it, and the cluster with
    it. The leader handles the signal; its child (default action: exit) must
    not get it."""
    home = tmp_path / "home"
    heard = tmp_path / "heard"
    leader = subprocess.Popen([sys.executable, "-c",
                               "import pathlib, signal, subprocess, sys, time\n"
                               f"signal.signal(signal.SIGHUP, lambda *_: pathlib.Path({str(heard)!r}).touch())\n"
                               "child = subprocess.Popen(['sleep', '300'])\n"
                               "print(child.pid, flush=True)\n"  # ready: its handler is in place
                               "time.sleep(300)"], stdout=subprocess.PIPE, start_new_session=True)
    try:
        child = int(leader.stdout.readline())  # type: ignore[union-attr]
        record_group(home, leader.pid, "local Ray cluster")
        (group,) = groups_of(home)
        assert group.signal_leader(signal.SIGHUP)
        deadline = time.time() + 10
        while not heard.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert heard.exists() and _alive(leader)
        state = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state not in ("Z", "X"), "the SIGHUP reached the rest of the group"
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
