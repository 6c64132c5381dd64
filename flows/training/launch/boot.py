"""Entry point of a flow process started by the `elasticflow` worker:
`python -m flows.training.launch.boot` instead of `python -m prefect.engine`.

1. Its own session, as Prefect's default launcher gives a flow process: a
   terminal's Ctrl-C does not reach it, a run keeps training when its worker
   crashes or is killed (a restarted worker adopts it), and a signal to the
   process group reaches the engine. A worker stopped gracefully (Ctrl-C to
   `prefect worker start`) still stops its runs on the way out, checkpointed:
   that is Prefect's worker shutdown (docs/operating.md).
2. Warm start: if the worker runs a fork server (`ELASTICFLOW_FORKSERVER`, see
   `flows.training.launch.forkserver`), the flow process is forked from it with
   Prefect, the flow and torch already imported, and this process only relays:
   signals to it, its exit status back to Prefect.
3. Cold start otherwise (no server, or it refused): the run's standby DDP
   workers (the `standby` of its `LaunchSpec`, set by the worker's backend
   when it places the run) start before anything else, so that their imports
   (torch, ~4 s of CPU each) overlap the engine's; then `prefect.engine` runs
   as `__main__` in this same process, so the PID Prefect knows is the
   engine's. A wrong worker count costs a cold start, never correctness;
   unused standbys exit with the flow process.

4. A server that is restarting (a stop of `up`, a killed server) is waited
   for before the engine's first request, and a connection it refuses later
   is retried (`retry_refused_connections`): Prefect's client retries one
   only once it has connected.
5. Least privilege: files it and its ranks create are private (umask 077),
   and its process group is recorded under `$ELASTICFLOW_HOME/run/groups/`
   so that stopping the stack signals this group and never a bystander
   (`scheduler_service.stack.groups`, which reads what `record_group` writes).

Only the standard library, and pydantic to read the `LaunchSpec` (0.1 s),
are imported before the engine starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import time
from pathlib import Path

from flows.training.launch.pause import stack_stopping
from flows.training.launch.standby import FORKSERVER_ENV, WARM_ENV  # standard library only, as this module

ANSWER_TIMEOUT_S = 60.0
API_WAIT_S = 600.0  # how long a flow process waits for its Prefect server to listen before the engine starts
API_WAIT_ENV = "ELASTICFLOW_API_WAIT_S"
PRIVATE_UMASK = 0o077  # files under $ELASTICFLOW_HOME: 0600, folders 0700


def groups_dir(home: Path) -> Path:
    return home / "run" / "groups"


def start_time(pid: int) -> int | None:
    """A process's start time in clock ticks since boot: with its PID, what
    tells it apart from a later process that reused the PID."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def record_group(home: Path | str | None, pgid: int, what: str) -> None:
    """Write down a process group this stack started (leader `pgid`), so that
    stopping the stack can signal exactly it. Best effort: a group that cannot
    be recorded is one the stack leaves alone."""
    started = start_time(pgid)
    if not home or started is None:
        return
    folder = groups_dir(Path(home))
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = folder / f".{pgid}-{started}.tmp"
        tmp.write_text(f"{pgid} {started} {what}\n")
        os.replace(tmp, folder / f"{pgid}-{started}")
    except OSError:
        pass


def run_engine(fork_standbys: bool = False, client_pid: int | None = None) -> int:
    """Start the run's DDP workers, then run Prefect's engine here. Forked
    workers need torch imported and no thread started yet (a fork server's
    child, which also watches its `client_pid`, the boot process)."""
    from flows.training.launch.spec import standby_of

    world = standby_of(dict(os.environ))
    if world > 0:
        from flows.training.launch.standby import POOL

        if fork_standbys:
            POOL.fork(world)
        else:
            POOL.refill(world)
    if client_pid is not None:
        watch_client(client_pid)  # the first thread: after the forks
    retry_refused_connections()
    try:
        with _api_secret():
            runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


def retry_refused_connections() -> None:
    """Every Prefect HTTP client of this process retries a refused
    connection, with Prefect's own backoff (`PREFECT_CLIENT_MAX_RETRIES`).
    Prefect's client retries one only once that client has connected
    (`_has_connected`, so that a wrong URL fails fast), and the engine makes
    fresh clients as it goes: a server killed just after this process found
    it listening (`wait_for_api`) ended the run at the engine's next request
    (Ray chaos, seed 3: an admitted run crashed at iteration 0, 7 s after a
    server kill, while `up` restarted the server). Here the URL is known
    good, so a refused connection is a restart. Prefect 3.9.1's private
    attribute: tests/runtime/test_boot_waits.py fails if it goes."""
    from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient

    for client in (PrefectHttpxAsyncClient, PrefectHttpxSyncClient):
        if getattr(client, "_elasticflow_retries_refused", False):
            continue
        init = client.__init__

        def connected_init(self: object, *args: object, _init: object = init, **kwargs: object) -> None:
            _init(self, *args, **kwargs)  # type: ignore[operator]
            self._has_connected = True  # type: ignore[attr-defined]

        client.__init__ = connected_init  # type: ignore[method-assign]
        client._elasticflow_retries_refused = True  # type: ignore[attr-defined]


def _api_secret() -> contextlib.AbstractContextManager[object]:
    """The API's secret from this flow process's environment into Prefect's
    settings. A fork server's child has the settings its server read at
    start, and the server is kept from the secret (the ranks it forks must not
    hold it): the child takes it here, after its ranks are forked."""
    auth = os.environ.get("PREFECT_API_AUTH_STRING")
    if not auth:
        return contextlib.nullcontext()
    import prefect.context
    from prefect.settings import PREFECT_API_AUTH_STRING, temporary_settings

    applied = contextlib.ExitStack()
    applied.enter_context(temporary_settings(updates={PREFECT_API_AUTH_STRING: auth}))
    # and for the engine's threads, which start from the process-wide context (as Prefect's test harness does)
    applied.enter_context(prefect.context._temporary_global_settings_context(prefect.context.get_settings_context()))
    return applied


def run_warm(path: str) -> int | None:
    """Have the fork server start this run's flow process and relay for it; its
    exit code, or None if the server cannot (then start cold)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(ANSWER_TIMEOUT_S)  # a server that accepts but never answers: start cold
        sock.connect(path)
        request = json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "argv": sys.argv[1:],
                              "client_pid": os.getpid()}).encode() + b"\n"
        sent = socket.send_fds(sock, [request[: 1 << 15]], [0, 1, 2])
        if sent < len(request):  # not even an empty send once all is out: a refusal may have closed it already
            sock.sendall(request[sent:])
        replies = sock.makefile("rb")
        answer = json.loads(replies.readline() or b"{}")
    except (OSError, ValueError) as exc:
        sock.close()  # before starting cold: a server that forks late sees us gone and kills its fork
        print(f"elasticflow: warm start unavailable ({exc}); starting cold", file=sys.stderr, flush=True)
        return None
    if "pid" not in answer:
        sock.close()
        print(f"elasticflow: warm start refused ({answer.get('refused', 'no answer')}); starting cold",
              file=sys.stderr, flush=True)
        return None
    pid = int(answer["pid"])
    sock.settimeout(None)
    try:  # a handle on that very process: no signal can reach a reused PID
        pidfd: int | None = os.pidfd_open(pid)
    except (OSError, AttributeError):
        pidfd = None

    def relay(signum: int, frame: object) -> None:
        if signum == signal.SIGTERM and stack_stopping():
            return  # the stack signals the flow process's own group: a second SIGTERM would cut its checkpoint short
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, signum)
            else:
                os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, relay)
    try:
        line = replies.readline()
    except OSError:
        line = b""
    if line:
        return int(json.loads(line)["exit"])
    # The server went away first: wait for the flow process, then report a
    # failure, which Prefect ignores if the run already reached a final state
    # and otherwise marks it Crashed instead of leaving it Running.
    print(f"elasticflow: fork server gone; waiting for flow process {pid}", file=sys.stderr, flush=True)
    if pidfd is not None:
        select.select([pidfd], [], [])
    else:
        while _alive(pid):
            time.sleep(0.5)
    return 1


def watch_client(client_pid: int) -> None:
    """In a warm flow process: die with the boot process that relays for it.
    Prefect's hard kill (SIGKILL) reaches boot only; this does to the flow
    process what it would have done to a cold one, even without the server."""
    import threading

    try:
        fd = os.pidfd_open(client_pid)
    except (OSError, AttributeError):
        return  # the server's kill on disconnect remains

    def wait() -> None:
        select.select([fd], [], [])
        if stack_stopping():  # the stack signals this process's group itself, and it pauses (pause.py)
            return
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="elasticflow-client-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _exit(code: int) -> None:
    """Exit as the flow process did: a negative code is the signal that ended it."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # the only ones without a handler to reset
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


def wait_for_api(url: str | None, timeout_s: float | None = None, poll_s: float = 1.0) -> bool:
    """Until something listens at the Prefect API's address; False if nothing
    has within `timeout_s` (`ELASTICFLOW_API_WAIT_S`, default 10 min).
    Prefect's client retries a refused connection only once it has connected
    once, so a flow process started while `up` restarted its server ended at
    the engine's first request, having trained nothing: chaos found an
    admitted run "stopped at iteration 0" after a server kill 20 s behind a
    worker kill. A listener is enough: the server binds its port once it has
    started, and one that listens but is slow is the engine client's to wait
    for, with its own retries."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url or "")
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return True  # not a URL this can read: the engine says what is wrong with it
    if not host:
        return True
    wait_s = float(os.environ.get(API_WAIT_ENV, API_WAIT_S)) if timeout_s is None else timeout_s
    give_up = time.monotonic() + wait_s
    while True:
        try:
            socket.create_connection((host, port), timeout=5).close()
            return True
        except OSError:
            if time.monotonic() >= give_up:
                return False
            time.sleep(poll_s)


def main() -> None:
    os.umask(PRIVATE_UMASK)
    try:
        os.setsid()
    except OSError:  # already a session leader
        pass
    record_group(os.environ.get("ELASTICFLOW_HOME"), os.getpid(),
                 f"flow run {os.environ.get('PREFECT__FLOW_RUN_ID', '?')}")
    if not wait_for_api(os.environ.get("PREFECT_API_URL")):
        print(f"elasticflow: no Prefect server listens at {os.environ.get('PREFECT_API_URL')}; "
              "starting the engine all the same", file=sys.stderr, flush=True)
    path = os.environ.get(FORKSERVER_ENV)
    if path and os.environ.get(WARM_ENV, "1") != "0":
        code = run_warm(path)
        if code is not None:
            _exit(code)
    sys.exit(run_engine())


if __name__ == "__main__":
    main()
