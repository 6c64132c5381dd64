"""Standby ranks asked of the fork server (`standby.served`): forked there,
with a rank's environment only, their exits reported to the launcher, left to
notice a launcher that dies, and started cold where no server answers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

from flows.training.launch.standby import FORKSERVER_ENV, ServedWorker, WorkerPool
from flows.training.rank.stop_flags import StopFlags
from tests.runtime.privilege import environ

ROOT = Path(__file__).resolve().parents[2]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _gone(pid: int, within_s: float = 60.0) -> bool:
    end = time.time() + within_s
    while time.time() < end:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_standby_is_forked_by_the_server_holds_only_a_ranks_environment_and_reports_its_exit(
        fork_server: Path, monkeypatch) -> None:
    monkeypatch.setenv("PGPASSWORD", "hunter2")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    pool = WorkerPool()
    try:
        first, second = pool.take(2)
        assert isinstance(first, ServedWorker) and isinstance(second, ServedWorker)
        assert "forkserver" in Path(f"/proc/{_parent(first.pid)}/cmdline").read_text()
        # The block /proc shows (a fork keeps the server's, Prefect's settings among them) is wiped
        # by the standby as it starts, before it can be handed any code to run.
        end = time.time() + 60
        while kept := [k for k in environ(first.pid) if k.startswith("PREFECT_") or k == "PGPASSWORD"]:
            assert time.time() < end, kept
            time.sleep(0.05)
        assert first.poll() is None
        first.stdin.close()  # no segment for it: it goes, and the server says how
        assert first.wait(60) == 0
        second.kill()
        assert second.wait(60) == -9
    finally:
        pool.close()


def test_a_standby_whose_launcher_dies_goes_and_a_rank_sees_its_launcher_gone(fork_server: Path) -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            from flows.training.launch.standby import WorkerPool
            (worker,) = WorkerPool().take(1)
            print(worker.pid, flush=True)
            input()
        """)], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        standby = int(launcher.stdout.readline())  # type: ignore[union-attr]
        flags = StopFlags.watching(launcher.pid)
        assert not flags.orphaned
        launcher.kill()  # as Prefect's hard kill: no goodbye; the server leaves the standby be
        launcher.wait()
        assert flags.orphaned  # what a rank that trains reads at its next boundary, then checkpoints
        assert _gone(standby)  # a standby reads the end of its stdin
    finally:
        launcher.kill()


def test_without_an_answering_server_standbys_start_cold(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(FORKSERVER_ENV, str(tmp_path / "nobody-listens.sock"))
    pool = WorkerPool()
    try:
        (worker,) = pool.take(1)
        assert isinstance(worker, subprocess.Popen)
    finally:
        pool.close()
