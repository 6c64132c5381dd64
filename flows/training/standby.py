"""Standby DDP worker processes: `python -m flows.training.worker --standby`
processes that have imported torch and wait on stdin for a segment.

Standard library only, so that a flow process can start its standbys before it
imports anything heavy (see `flows.training.boot`). `flows.training.launcher`
hands them to segments; missing standbys are started on demand.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
from pathlib import Path

_REPO_ROOT = str(Path(__file__).resolve().parents[2])


class WorkerPool:
    """Standby worker processes, already past their imports, handed out to segments."""

    def __init__(self) -> None:
        self._standby: list[subprocess.Popen[bytes]] = []
        self._lock = threading.Lock()

    @staticmethod
    def _spawn() -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = "1"  # read once at process start by the OpenMP runtime
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_REPO_ROOT, env.get("PYTHONPATH")]))
        return subprocess.Popen(
            [sys.executable, "-m", "flows.training.worker", "--standby"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def _alive(self) -> list[subprocess.Popen[bytes]]:
        return [p for p in self._standby if p.poll() is None]

    def take(self, count: int) -> list[subprocess.Popen[bytes]]:
        """`count` workers: standbys first, fresh processes for the rest."""
        with self._lock:
            alive = self._alive()
            taken, self._standby = alive[:count], alive[count:]
        return taken + [self._spawn() for _ in range(count - len(taken))]

    def refill(self, count: int) -> None:
        """Start standbys until `count` are waiting."""
        with self._lock:
            self._standby = self._alive()
            self._standby += [self._spawn() for _ in range(count - len(self._standby))]

    @property
    def size(self) -> int:
        with self._lock:
            return len(self._alive())

    def close(self) -> None:
        with self._lock:
            standby, self._standby = self._standby, []
        for proc in standby:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


POOL = WorkerPool()
atexit.register(POOL.close)
