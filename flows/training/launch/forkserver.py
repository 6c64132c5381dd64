"""Warm start of flow processes: a fork server that has imported Prefect's
engine, the `train` flow and torch once, and forks one flow process per run.

Why: a flow process started cold spends 5-7 s of CPU importing Prefect, the
flow and torch, and each of its DDP workers 4-5 s more importing torch; on a
small machine that was most of the time from a run's creation to its first
training iteration (docs/service.md, "Latency"). A fork of a process that has
already paid for the imports starts in milliseconds, and so do DDP workers
forked from it before the engine starts any thread.

The `elasticflow` worker starts one server (`python -m flows.training.launch.forkserver
SOCKET`) and tells flow processes where it listens (`ELASTICFLOW_FORKSERVER`).
Prefect still starts what it always starts, `python -m flows.training.launch.boot`,
which imports only the standard library: it connects, hands over its
environment, working directory and stdin/stdout/stderr, forwards the signals it
gets to the forked flow process and exits with its exit status, so Prefect's
view (PID, output, cancellation, exit code) is unchanged. Anything the server
cannot honour falls back to the cold start: no server, a refused request, or
Prefect settings in the run's environment that differ from the server's
(they are read once at import, so a warm process would run with stale ones).

Protocol, one UNIX-socket connection per run: the client sends one JSON line
`{"env": {...}, "cwd": "...", "argv": [...], "client_pid": N}` with its fds
0, 1, 2 attached (SCM_RIGHTS); the server answers `{"pid": N}` or
`{"refused": "why"}`, and `{"exit": code}` once the flow process has exited.
If the client goes away first (Prefect's hard kill is a SIGKILL), the flow
process is SIGKILLed, as that kill would have done to a cold one (by the
server, and by the flow process itself, which watches the client's PID): its
DDP workers notice and checkpoint.

A standby rank is asked for the same way (`"role": "standby"`, with its
stdin and its early log attached): a launcher that has started threads can
no longer fork its own (a flow process refilling its restart spares, a
profile, a test's runtime), and a cold standby spends ~3 s of CPU importing
torch beside the training. The server forks it in a session of its own,
recorded as the stack's; it watches its launcher's pidfd, not its parent,
and is left alone when its client goes (its stdin closes, or it notices at
its next boundary and checkpoints).

Fork safety: the server is single-threaded (checked after its imports) and
never touches CUDA, so a forked child may still choose its devices.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from flows.training.launch.boot import PRIVATE_UMASK, record_group
from flows.training.launch.spec import standby_of
from flows.training.launch.standby import is_secret, rank_env, take_environment, with_repo_on_path

READY = "elasticflow fork server ready"  # its log's line once it serves (it listens earlier: `listen`)
MAX_REQUEST = 4 << 20  # bytes: an environment is a few kB
RELAYED = {signal.SIGTERM, signal.SIGINT}  # the server handles them, and a client relays them to its flow process


def settings_of(env: dict[str, str]) -> dict[str, str]:
    """The Prefect settings an environment carries (`PREFECT__*` are per-run
    variables the engine reads itself, not settings). The server's database
    settings are left out: the server never has them, a flow never needs them."""
    return {k: v for k, v in env.items()
            if k.startswith("PREFECT_") and not k.startswith("PREFECT__") and not is_secret(k)}


@dataclass
class ForkJob:
    """What a forked child runs: a flow process with the client's environment."""

    env: dict[str, str]
    cwd: str
    argv: list[str]
    client_pid: int | None = None

    def run(self) -> int:
        """Become the flow process: the run's DDP workers first (forked while this
        process is still single-threaded), then Prefect's engine as `__main__`."""
        os.environ.clear()
        os.environ.update(self.env)
        sys.argv = [sys.argv[0], *self.argv]  # the engine reads its run id from argv[1] when given
        # As in a cold start, prefect.engine runs as __main__ before any module imports it by name.
        sys.modules.pop("prefect.engine", None)
        try:
            os.chdir(self.cwd)
        except OSError as exc:
            print(f"elasticflow: working directory {self.cwd}: {exc}", file=sys.stderr)
            return 1
        from flows.training.launch import boot

        return boot.run_engine(fork_standbys=True, client_pid=self.client_pid)


@dataclass
class StandbyJob:
    """What a forked child runs: a standby rank for a client's `WorkerPool`."""

    env: dict[str, str]
    client_pid: int
    early_log: str | None

    def run(self) -> int:
        take_environment(rank_env(self.env))  # whatever the client sent, nothing a rank may not see
        from flows.training.rank import rank_main

        rank_main.run_standby(self.early_log, launcher_pid=self.client_pid)  # never returns
        return 1


class ForkServer:
    """Accepts clients, forks flow processes, reports their exit codes."""

    def __init__(self, path: Path, listener: socket.socket, parent_pid: int | None) -> None:
        self.path, self.listener, self.parent_pid = path, listener, parent_pid
        self.settings = settings_of(dict(os.environ))
        self.children: dict[int, socket.socket | None] = {}  # pid -> client connection (None: client gone)
        self.standbys: set[int] = set()  # children that are standby ranks, not flow processes
        self.accepting = True

    def serve(self) -> ForkJob | StandbyJob | None:
        """Serve until told to stop and every flow process has exited (None), or
        return the job to run in a freshly forked child."""
        sel = selectors.DefaultSelector()
        listener = self.listener
        sel.register(listener, selectors.EVENT_READ)
        stop: list[int] = []  # not a threading.Event: a second signal inside its handler would deadlock on its lock
        for sig in RELAYED:
            signal.signal(sig, lambda signum, _: stop.append(signum))
        print(f"{READY} pid={os.getpid()} socket={self.path}", flush=True)
        while self.accepting or self.children:
            if self.accepting and (stop or (self.parent_pid and os.getppid() != self.parent_pid)):
                # Its worker is gone: no new runs, but the running ones still report to their clients.
                self.accepting = False
                sel.unregister(listener)
                listener.close()
                self.path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    self.path.parent.rmdir()  # the worker's temporary folder for it, if nothing else is there
                print(f"elasticflow fork server stopping, waiting for {len(self.children)} flow process(es)",
                      flush=True)
            for key, _ in sel.select(timeout=0.5):
                if key.fileobj is listener:
                    job = self._accept(listener, sel)
                    if job is not None:
                        return job  # in the child
                else:
                    self._client_event(key.fileobj, sel)  # type: ignore[arg-type]
            self._reap(sel)
        return None

    def _accept(self, listener: socket.socket, sel: selectors.BaseSelector) -> ForkJob | StandbyJob | None:
        try:
            conn, _ = listener.accept()
        except OSError as exc:  # out of fds, say: this client times out and starts cold, others still come
            print(f"elasticflow fork server: accept failed: {exc}", file=sys.stderr, flush=True)
            time.sleep(0.1)
            return None
        fds: list[int] = []
        try:
            conn.settimeout(60.0)  # as long as the client waits for an answer
            data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            while not data.endswith(b"\n") and data and len(data) < MAX_REQUEST:
                more = conn.recv(1 << 16)
                if not more:
                    break
                data += more
            request = json.loads(data)
            env, cwd, argv = dict(request["env"]), str(request["cwd"]), [str(a) for a in request.get("argv", [])]
            client_pid = int(request["client_pid"]) if request.get("client_pid") else None
            standby = request.get("role", "flow") == "standby"
            early_log = str(request["early_log"]) if request.get("early_log") else None
            if standby and client_pid is None:
                raise ValueError("a standby needs its launcher's client_pid")
            if len(fds) != (2 if standby else 3):
                raise ValueError(f"expected {'stdin and a log' if standby else 'stdin, stdout and stderr'}, "
                                 f"got {len(fds)} fds")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self._answer(conn, {"refused": f"bad request: {exc}"})
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        changed = [] if standby else sorted(k for k in self.settings.keys() | settings_of(env).keys()
                                            if self.settings.get(k) != env.get(k))  # a rank reads none
        if changed:
            self._answer(conn, {"refused": f"Prefect settings differ from the fork server's: {', '.join(changed)}"})
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        if self._client_gone(conn):  # it gave up waiting and started cold: no second engine for its run
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        # Signals wait across the fork: the child inherits the server's
        # handlers, and a SIGTERM relayed to it before it reset them was lost
        # to the server's stop list (the run then ignored its cancellation).
        signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED)
        try:
            pid = os.fork()
        except OSError as exc:  # no memory or process slots for a copy of this process: the client starts cold
            signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
            self._answer(conn, {"refused": f"fork failed: {exc}"})
            for fd in fds:
                os.close(fd)
            conn.close()
            return None
        if pid == 0:  # the flow process: its own signal handlers first, then drop the server's sockets
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a fresh interpreter
            signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)  # one sent meanwhile lands now, on these
            sel.close()
            listener.close()
            conn.close()
            for other in self.children.values():
                if other is not None:
                    other.close()
            os.setsid()
            what = f"standby rank of pid {client_pid}" if standby else \
                f"flow run {env.get('PREFECT__FLOW_RUN_ID', '?')}"
            record_group(env.get("ELASTICFLOW_HOME"), os.getpid(), what)
            for target, fd in zip((0, 1, 2), fds + fds[1:] if standby else fds):  # a standby's log is both
                os.dup2(fd, target)
            for fd in set(fds):
                os.close(fd)
            if standby:
                assert client_pid is not None
                return StandbyJob(env, client_pid, early_log)
            return ForkJob(env, cwd, argv, client_pid)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED)
        for fd in fds:
            os.close(fd)
        conn.settimeout(None)
        self.children[pid] = conn
        if standby:
            self.standbys.add(pid)
        sel.register(conn, selectors.EVENT_READ, pid)
        self._answer(conn, {"pid": pid})
        if standby:
            print(f"forked standby rank pid={pid} for pid={client_pid}", flush=True)
        else:
            print(f"forked flow process pid={pid} flow_run={env.get('PREFECT__FLOW_RUN_ID', '?')} "
                  f"standby={standby_of(env)}", flush=True)
        return None

    @staticmethod
    def _client_gone(conn: socket.socket) -> bool:
        conn.setblocking(False)
        try:
            return conn.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True
        finally:
            conn.setblocking(True)

    def _client_event(self, conn: socket.socket, sel: selectors.BaseSelector) -> None:
        """A client sends nothing after its request: readable means it is gone."""
        pid = sel.get_key(conn).data
        try:
            gone = not conn.recv(1 << 10)
        except OSError:
            gone = True
        if gone:
            sel.unregister(conn)
            conn.close()
            self.children[pid] = None
            if pid in self.standbys:
                return  # a standby rank sees its launcher gone itself, and checkpoints if it trains
            try:
                os.kill(pid, signal.SIGKILL)  # what Prefect's hard kill did to a cold flow process
            except ProcessLookupError:
                pass

    def _reap(self, sel: selectors.BaseSelector) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            code = os.waitstatus_to_exitcode(status)
            if pid in self.standbys:
                self.standbys.discard(pid)
            else:
                print(f"flow process pid={pid} exited with {code}", flush=True)
            if conn is not None:
                sel.unregister(conn)
                self._answer(conn, {"exit": code})
                conn.close()

    @staticmethod
    def _answer(conn: socket.socket, message: dict[str, object]) -> None:
        if "refused" in message:
            print(f"refused a flow process: {message['refused']}", flush=True)
        try:
            conn.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            pass


def launch(home: Path) -> tuple[subprocess.Popen[bytes], Path]:
    """Start a server for the calling worker (it stops when that process goes);
    its socket path. Its environment is the one a flow process of this worker
    gets, less the run's own variables: the worker's, and its Prefect settings."""
    from prefect.settings import get_current_settings

    path = Path(tempfile.mkdtemp(prefix="elasticflow-")) / "fork.sock"  # short: socket paths max out at 107
    # Every flow process and DDP rank it forks starts from this environment
    # (/proc/<pid>/environ of each shows it): none of the worker's secrets.
    inherited = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True)}
    env = {k: v for k, v in inherited.items() if not is_secret(k)}
    env |= {"ELASTICFLOW_HOME": str(home),
           # torch.cuda.is_available() through NVML, which leaves forks free to use CUDA
           "PYTORCH_NVML_BASED_CUDA_CHECK": "1"}
    with_repo_on_path(env)
    logs = home / "logs"
    logs.mkdir(parents=True, exist_ok=True, mode=0o700)
    with open(logs / "forkserver.log", "ab", opener=lambda name, flags: os.open(name, flags, 0o600)) as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "flows.training.launch.forkserver", str(path), str(os.getpid())], env=env,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            cwd=path.parent)  # like Prefect's workspace folder: no prefect.toml or .env of the worker's
    record_group(home, process.pid, "fork server")
    return process, path


def listen(path: Path) -> socket.socket:
    """The server's socket, listening before the imports: a run launched
    while they take (a stack's first seconds, when a restart resumes its
    runs) waits in the backlog (up to boot.ANSWER_TIMEOUT_S) for its warm
    fork instead of importing it all again cold beside them, ranks too."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path.with_suffix(".tmp")
    tmp.unlink(missing_ok=True)
    listener.bind(str(tmp))
    listener.listen(64)
    os.replace(tmp, path)
    return listener


def _warm_up() -> None:
    """Everything a flow process and its DDP workers import, once."""
    import prefect.flow_engine  # noqa: F401
    import torch._dynamo  # noqa: F401  # the first optimizer step imports it: ~2 s

    import flows.train  # noqa: F401
    import flows.training.rank.rank_main  # noqa: F401


def main(argv: list[str]) -> int:
    path = Path(argv[0])
    parent = int(argv[1]) if len(argv) > 1 else None
    started = time.time()
    os.umask(PRIVATE_UMASK)  # what its flow processes and ranks create under the home is private
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # read once, at import: the DDP workers it forks use 1 thread
    listener = listen(path)
    _warm_up()
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    import torch

    why_not = f"imports started threads {threads}" if threads else (  # a fork would copy their locks as they are
        "imports initialised CUDA" if torch.cuda.is_initialized() else None)  # forks could not use CUDA
    if why_not is not None:  # the clients waiting meanwhile read no answer and start cold
        path.unlink(missing_ok=True)
        listener.close()
        print(f"elasticflow fork server: not serving, {why_not}", file=sys.stderr)
        return 1
    print(f"elasticflow fork server imported in {time.time() - started:.1f} s", flush=True)
    job = ForkServer(path, listener, parent).serve()
    if job is None:  # stopped: nothing to tear down that is worth the second it takes with torch loaded
        sys.stdout.flush()
        os._exit(0)
    try:  # the forked flow process (or standby rank), from here on
        return job.run()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
