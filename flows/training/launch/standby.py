"""Standby DDP worker processes: `python -m flows.training.rank.rank_main --standby`
processes that have imported torch and wait on stdin for a segment.

Standard library only, so that a flow process can start its standbys before it
imports anything heavy (see `flows.training.launch.boot`). `flows.training.coordinator.launcher`
hands them to segments; missing standbys are started on demand: asked of
the fork server where there is one (instant, and none of the ~3 s of CPU
a fresh interpreter spends importing torch beside the training), else as
fresh interpreters.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from abc import ABC, abstractmethod
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


FORKSERVER_ENV = "ELASTICFLOW_FORKSERVER"  # where the fork server listens (flows.training.launch.forkserver)
WARM_ENV = "ELASTICFLOW_WARM_START"  # "0": start flow processes and their ranks cold
SERVED_ANSWER_S = 10.0  # a server that takes longer to fork a standby is stuck: start one cold


def take_environment(env: dict[str, str]) -> None:
    """Make `env` this forked process's whole environment, as a fresh
    interpreter started with it would have it: `os.environ` and the C
    library's; its PYTHONPATH entries first on `sys.path`; and the block the
    kernel shows as /proc/<pid>/environ, which a fork keeps from the process
    that was exec'd (the fork server's: Prefect's settings, the worker's
    variables) and a rank's code could read, zeroed."""
    import ctypes

    os.environ.clear()
    os.environ.update(env)
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (proc(5) fields 50, 51)
    except (OSError, IndexError, ValueError):
        return
    if 0 < start < end:  # os.environ and the C library's now hold copies elsewhere
        ctypes.memset(start, 0, end - start)


class _Handle(ABC):
    """A standby this process did not `Popen`, with the part of
    `subprocess.Popen`'s interface the launcher uses. How its exit is
    learnt (`poll`) is each kind's: a child's by waitpid, a fork server's
    from the server."""

    def __init__(self, pid: int, stdin: IO[bytes]) -> None:
        self.pid, self.stdin = pid, stdin
        self.returncode: int | None = None

    @abstractmethod
    def poll(self) -> int | None: ...

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


class ForkedWorker(_Handle):
    """A standby forked from this process (see `WorkerPool.fork`)."""

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


class ServedWorker(_Handle):
    """A standby the fork server forked for this process: not our child, so
    its exit code comes over the request's connection (the server reaps it),
    and signals go through a pidfd, which no reused PID can pass for."""

    def __init__(self, pid: int, stdin: IO[bytes], conn: socket.socket, standby_log: str, said: bytes = b"") -> None:
        super().__init__(pid, stdin)
        self.standby_log = standby_log
        self._conn = conn
        self._said = said  # what the server sent after its answer: the exit report, once the standby is gone
        self._server_gone = False
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except OSError:  # gone already: its exit is on the connection
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if b"\n" not in self._said:
            self._read()
        if b"\n" in self._said:
            self.returncode = int(json.loads(self._said.partition(b"\n")[0])["exit"])
        elif self._server_gone and self._ended():  # the server went first: how it ended is unknown
            self.returncode = -signal.SIGKILL
        if self.returncode is not None:
            self._close()
        return self.returncode

    def _read(self) -> None:
        try:
            data = self._conn.recv(1 << 10, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        self._said += data
        self._server_gone = not data

    def _ended(self) -> bool:
        return self._pidfd is None or bool(select.select([self._pidfd], [], [], 0)[0])

    def send_signal(self, sig: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass

    def _close(self) -> None:
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


def served(env: dict[str, str], log_fd: int, log: str) -> ServedWorker | None:
    """A standby forked by this process's fork server (`ELASTICFLOW_FORKSERVER`)
    with `env` (the allow-list's), writing to `log` (`log_fd`); None where
    there is no server or it does not answer."""
    path = os.environ.get(FORKSERVER_ENV)
    if not path or os.environ.get(WARM_ENV, "1") == "0":
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    read, write = os.pipe()
    said = b""
    try:
        conn.settimeout(SERVED_ANSWER_S)
        conn.connect(path)
        request = json.dumps({"role": "standby", "env": env, "cwd": REPO_ROOT, "client_pid": os.getpid(),
                              "early_log": log}).encode() + b"\n"
        sent = socket.send_fds(conn, [request[: 1 << 15]], [read, log_fd])
        if sent < len(request):
            conn.sendall(request[sent:])
        while b"\n" not in said:  # byte for byte the server's: its exit report may follow at once
            more = conn.recv(1 << 10)
            if not more:
                break
            said += more
        line, _, said = said.partition(b"\n")
        answer = json.loads(line or b"{}")
    except (OSError, ValueError):
        answer = {}
    finally:
        os.close(read)
    if "pid" not in answer:
        conn.close()
        os.close(write)
        return None
    conn.settimeout(None)
    return ServedWorker(int(answer["pid"]), os.fdopen(write, "wb"), conn, log, said)


Worker = Union[subprocess.Popen[bytes], ForkedWorker, ServedWorker]
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

    def _spawn(self) -> Worker:
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
            warm = served(env, fd, log)
            if warm is not None:
                return warm
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
                        take_environment(rank_env(dict(os.environ)))  # what a spawned standby would have had
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
