"""Warm start: flow processes forked from a server that has imported Prefect and
torch, relayed by `flows.training.launch.boot` so that Prefect sees what it always saw."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from flows.training.launch.boot import FORKSERVER_ENV
from flows.training.launch.forkserver import READY
from tests.stack import wait_fork_server

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
# Every wait below ends as soon as what it waits for happens (a socket
# appears, a process exits); this ceiling only bounds a wait that never would.
# Generous: on a busy machine importing torch alone can take a minute, and a
# signalled engine needs CPU to exit (issue 14: 30 s timeouts failed there).
CEILING_S = 300.0


def _children(pid: int) -> list[int]:
    """Live (not yet exited) child processes of `pid`."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                found.append(int(proc.name))
    return found


@pytest.fixture(scope="module")
def api() -> Iterator[str]:
    """An API that accepts connections and never answers: an engine asking it
    for its run waits, a process to signal."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}/api"
    sock.close()


def _start_server(base: Path, api_url: str, ready: bool = True) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """The server, once it serves (`ready`), or once it listens (its imports may still be under way)."""
    path = base / "s.sock"
    env = {**os.environ, "PREFECT_HOME": str(base / "prefect"), "PYTHONPATH": str(ROOT), "PREFECT_API_URL": api_url}
    env.pop(FORKSERVER_ENV, None)
    log = open(base / "server.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "flows.training.launch.forkserver", str(path)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    end = time.time() + CEILING_S
    while not path.exists():
        assert proc.poll() is None and time.time() < end, (base / "server.log").read_text()
        time.sleep(0.05)
    if ready:
        wait_fork_server(base / "server.log", proc, CEILING_S)
    return proc, {**env, FORKSERVER_ENV: str(path)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, api: str) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, str]]]:
    proc, env = _start_server(tmp_path_factory.mktemp("fork"), api)
    yield proc, env
    proc.terminate()
    assert proc.wait(timeout=CEILING_S) == 0
    assert not Path(env[FORKSERVER_ENV]).exists()


def _forked(server_pid: int, boot: subprocess.Popen[str]) -> int:
    """The flow process the server forked for `boot`."""
    end = time.time() + CEILING_S
    while not _children(server_pid):
        assert time.time() < end and boot.poll() is None, "no flow process was forked"
        time.sleep(0.1)
    (child,) = _children(server_pid)
    return child


def _gone(pid: int, within_s: float = CEILING_S) -> bool:
    end = time.time() + within_s
    while Path(f"/proc/{pid}").exists() and "Z" not in _state(pid):
        if time.time() > end:
            return False
        time.sleep(0.1)
    return True


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


RUN_ID = "00000000-0000-4000-8000-000000000000"  # valid, on an API that never answers: the engine waits


def _boot(env: dict[str, str], **extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "flows.training.launch.boot"], env={**env, **extra}, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_the_forked_engine_writes_to_the_clients_output_and_its_exit_code_comes_back(server) -> None:
    proc, env = server
    boot = _boot(env, PREFECT__FLOW_RUN_ID="not-a-uuid")
    out, _ = boot.communicate(timeout=CEILING_S)
    assert boot.returncode == 1, out
    assert "Invalid flow run id" in out  # Prefect's engine ran, in a fork, writing to our stdout
    assert "starting cold" not in out


def test_a_client_that_comes_while_the_server_imports_waits_for_its_warm_fork(tmp_path: Path, api: str) -> None:
    """A stack's first seconds, when a restart resumes its runs: the server
    listens before it imports, and a run launched meanwhile is forked warm
    once the imports are done, not started cold beside them."""
    proc, env = _start_server(tmp_path, api, ready=False)
    try:
        assert b"imported in" not in (tmp_path / "server.log").read_bytes()  # it listens, the imports go on
        boot = _boot(env, PREFECT__FLOW_RUN_ID="not-a-uuid")
        out, _ = boot.communicate(timeout=CEILING_S)
        assert "starting cold" not in out and "Invalid flow run id" in out, out
        assert READY.encode() in (tmp_path / "server.log").read_bytes()
    finally:
        proc.terminate()
        proc.wait(timeout=CEILING_S)


def test_other_prefect_settings_than_the_servers_start_cold_and_say_why(server) -> None:
    proc, env = server
    boot = _boot(env, PREFECT__FLOW_RUN_ID="not-a-uuid", PREFECT_LOGGING_LEVEL="DEBUG")
    out, _ = boot.communicate(timeout=CEILING_S)
    assert "warm start refused (Prefect settings differ from the fork server's: PREFECT_LOGGING_LEVEL)" in out
    assert boot.returncode == 1 and "Invalid flow run id" in out  # the same engine, started cold


def test_signals_reach_the_forked_process_and_a_killed_client_takes_it_along(server) -> None:
    proc, env = server
    boot = _boot(env, PREFECT__FLOW_RUN_ID=RUN_ID)
    _forked(proc.pid, boot)
    boot.send_signal(signal.SIGTERM)
    boot.communicate(timeout=CEILING_S)
    assert boot.returncode == -signal.SIGTERM  # it ended on the relayed SIGTERM, not by itself
    assert not _children(proc.pid)  # and the server reaped it

    boot = _boot(env, PREFECT__FLOW_RUN_ID=RUN_ID)
    child = _forked(proc.pid, boot)
    boot.kill()  # Prefect's hard kill: no relay, the server sees the connection drop
    boot.wait()
    assert _gone(child), "the flow process outlived its killed client"


def test_a_flow_process_killed_by_a_signal_is_reported_so(server) -> None:
    proc, env = server
    boot = _boot(env, PREFECT__FLOW_RUN_ID=RUN_ID)
    os.kill(_forked(proc.pid, boot), signal.SIGKILL)  # the OOM killer, say
    boot.communicate(timeout=CEILING_S)
    assert boot.returncode == -signal.SIGKILL  # as if Prefect had started the flow process itself


def test_without_its_server_a_flow_process_still_dies_with_its_client(tmp_path: Path, api: str) -> None:
    proc, env = _start_server(tmp_path, api)
    boot = _boot(env, PREFECT__FLOW_RUN_ID=RUN_ID)
    child = _forked(proc.pid, boot)
    proc.kill()  # the server crashes; its forks carry on
    proc.wait()
    assert not _gone(child, within_s=1.0)
    boot.kill()  # and Prefect's hard kill still reaches the flow process
    boot.wait()
    assert _gone(child), "the flow process outlived its killed client"


def test_without_a_server_the_flow_process_starts_cold(tmp_path: Path) -> None:
    env = {**os.environ, FORKSERVER_ENV: str(tmp_path / "none.sock"), "PREFECT__FLOW_RUN_ID": "not-a-uuid",
           "PREFECT_API_URL": "http://127.0.0.1:9/api", "ELASTICFLOW_API_WAIT_S": "0"}
    out = subprocess.run([sys.executable, "-m", "flows.training.launch.boot"], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=CEILING_S)
    assert "warm start unavailable" in out.stderr and "Invalid flow run id" in out.stderr + out.stdout
    assert out.returncode == 1


def test_a_signal_that_reaches_the_flow_process_as_it_is_forked_is_not_lost(server) -> None:
    """The fork inherits the server's handlers: a SIGTERM that came before the
    child had reset them went to the server's stop list, and the run ignored
    its cancellation for ever (a suite run hung 300 s on it). Signals are
    held across the fork now: one sent the moment the child exists kills it."""
    proc, env = server
    for attempt in range(8):
        boot = _boot(env, PREFECT__FLOW_RUN_ID=RUN_ID)
        try:
            end = time.time() + CEILING_S
            while not (children := _children(proc.pid)):
                assert time.time() < end and boot.poll() is None, "no flow process was forked"
                time.sleep(0.0005)
            os.kill(children[0], signal.SIGTERM)  # at once: before it could set up anything
            boot.communicate(timeout=60)
            assert boot.returncode == -signal.SIGTERM, f"attempt {attempt}: {boot.returncode}"
        finally:
            if boot.poll() is None:
                boot.kill()  # the server then kills its flow process
                boot.wait()
