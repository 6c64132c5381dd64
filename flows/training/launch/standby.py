"""Standby DDP worker processes: `python -m flows.training.rank.rank_main --standby`
processes that have imported torch and wait on stdin for a segment.

Standard library only, so that a flow process can start its standbys before it
imports anything heavy (see `flows.training.launch.boot`). `flows.training.coordinator.launcher`
hands them to segments; missing standbys are started on demand.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Union

# The project's root: on the path of every process the stack starts (fork
# server, standbys, the take-in check), so `flows` and the allowed model
# packages import there whatever the folder it starts in.
REPO_ROOT = str(Path(__file__).resolve().parents[3])
EXTRA_ENV = "ELASTICFLOW_RANK_ENV"  # operator's additions to the allow-list, comma-separated names

# What a DDP rank may see of its flow process's environment. Ranks never talk
# to Prefect or the service's store: no PREFECT_* and no database URL, and none
# of the worker's secrets (issue 14). A remote checkpoint store's credentials
# are added by name through ELASTICFLOW_RANK_ENV.
RANK_ENV_NAMES = {"PATH", "HOME", "USER", "LOGNAME", "LANG", "TZ", "TMPDIR", "PYTHONPATH", "PYTHONHASHSEED",
                  "PYTHONUNBUFFERED", "VIRTUAL_ENV", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                  "WORLD_SIZE", "LOCAL_WORLD_SIZE"}
RANK_ENV_PREFIXES = ("LC_", "ELASTICFLOW_", "CUDA_", "CUBLAS_", "NCCL_", "GLOO_", "TORCH_", "PYTORCH_", "OMP_",
                     "MKL_", "OPENBLAS_", "KMP_", "NVIDIA_")
SECRET_NAMES = {"ELASTICFLOW_DATABASE_URL", "PGPASSWORD", "PGPASSFILE", "DATABASE_URL",
                "PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_PASSWORD",
                "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING", "PREFECT_API_KEY"}


def is_secret(name: str) -> bool:
    """Names that carry credentials of the worker, the store or the API.
    The flow process needs the API's (the worker keeps `PREFECT_*` in its
    environment); the fork server and the ranks it forks never hold it."""
    upper = name.upper()
    return upper in SECRET_NAMES or any(word in upper for word in ("PASSWORD", "SECRET", "DATABASE_URL"))


def with_repo_on_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with the project's root first on PYTHONPATH."""
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")]))
    return env


def rank_env(env: dict[str, str]) -> dict[str, str]:
    """The part of `env` a rank gets: the allow-list, less anything secret."""
    extra = {n.strip() for n in env.get(EXTRA_ENV, "").split(",") if n.strip()}

    def allowed(name: str) -> bool:
        if name in extra:  # the operator said so
            return True
        return not is_secret(name) and (name in RANK_ENV_NAMES or name.startswith(RANK_ENV_PREFIXES))

    return {k: v for k, v in env.items() if allowed(k)}


class ForkedWorker:
    """A standby forked from this process (see `WorkerPool.fork`), with the part
    of `subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, pid: int, stdin: IO[bytes]) -> None:
        self.pid, self.stdin = pid, stdin
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: it is gone, how is unknown
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if end is not None and time.time() > end:
                raise subprocess.TimeoutExpired(f"worker {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Worker = Union[subprocess.Popen[bytes], ForkedWorker]
EARLY_LOG_PREFIX = "elasticflow-standby-"


def sweep_early_logs(directory: str | None = None) -> int:
    """Remove the early logs of standbys whose flow process is gone: a flow
    process killed with its standbys alive leaves them (45 empty files in
    /tmp after a day of tests). Each name carries its flow process's pid;
    only files of this user, whose process no longer exists, are removed.
    Returns how many."""
    folder = Path(directory or tempfile.gettempdir())
    removed = 0
    for path in folder.glob(f"{EARLY_LOG_PREFIX}*-*.log"):
        owner = path.name[len(EARLY_LOG_PREFIX):].split("-", 1)[0]
        if not owner.isdigit() or int(owner) == os.getpid():
            continue
        try:
            if path.stat().st_uid != os.getuid():
                continue
            os.kill(int(owner), 0)
        except ProcessLookupError:  # its flow process is gone
            path.unlink(missing_ok=True)
            removed += 1
        except OSError:  # not ours to judge (another user's process), or already gone
            continue
    return removed


class WorkerPool:
    """Standby worker processes, already past their imports, handed out to segments."""

    def __init__(self) -> None:
        self._standby: list[Worker] = []
        self._lock = threading.Lock()
        self._swept = False

    def _spawn(self) -> subprocess.Popen[bytes]:
        if not self._swept:  # what flow processes killed before they could clean up left
            self._swept = True
            sweep_early_logs()
        env = rank_env(dict(os.environ))
        env["OMP_NUM_THREADS"] = "1"  # read once at process start by the OpenMP runtime
        with_repo_on_path(env)
        # What it says before it has a segment's log, kept for a crash report;
        # removed by the standby itself once handed a segment or told to go.
        fd, log = tempfile.mkstemp(prefix=f"{EARLY_LOG_PREFIX}{os.getpid()}-", suffix=".log")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "flows.training.rank.rank_main", "--standby", log],
                env=env,
                stdin=subprocess.PIPE,
                stdout=fd,
                stderr=fd,
            )
        finally:
            os.close(fd)
        proc.standby_log = log  # type: ignore[attr-defined]
        return proc

    def _alive(self) -> list[Worker]:
        return [p for p in self._standby if p.poll() is None]

    def take(self, count: int) -> list[Worker]:
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

    def fork(self, count: int) -> None:
        """Add `count` standbys forked from this process: instant, as torch is
        already imported here. Only for a process that has started no thread
        and not touched CUDA (a fork server's child before its engine runs)."""
        import torch

        from flows.training.rank import rank_main

        if threading.active_count() > 1 or torch.cuda.is_initialized():
            self.refill(count)  # not safe to fork here: start them as fresh interpreters
            return
        with self._lock:
            for _ in range(count):
                read, write = os.pipe()
                pid = os.fork()
                if pid == 0:
                    try:
                        os.close(write)
                        for other in self._standby:  # or a sibling never sees its launcher go
                            if isinstance(other, ForkedWorker):
                                other.stdin.close()
                        os.dup2(read, 0)
                        os.close(read)
                        devnull = os.open(os.devnull, os.O_WRONLY)  # as a fresh standby's, until handed a log
                        os.dup2(devnull, 1)
                        os.dup2(devnull, 2)
                        os.close(devnull)
                        allowed = rank_env(dict(os.environ))  # what a spawned standby would have had
                        os.environ.clear()
                        os.environ.update(allowed)
                        rank_main.run_standby()
                    finally:
                        os._exit(1)  # never back into the flow process's code
                os.close(read)
                self._standby.append(ForkedWorker(pid, os.fdopen(write, "wb")))

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
            early = getattr(proc, "standby_log", None)
            if early:
                Path(early).unlink(missing_ok=True)


POOL = WorkerPool()
atexit.register(POOL.close)
