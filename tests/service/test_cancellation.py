"""Which Cancelling runs the worker stops itself, and how, on real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from scheduler_service.worker.cancellation import Cancellations, is_flow_process, process_id

RUN = "0b7c1d2e-0000-4000-8000-000000000001"


def _start(ignore_sigterm: bool = False, run_id: str = RUN) -> subprocess.Popen[bytes]:
    code = ("import signal, sys, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_sigterm else "")
            + "print('ready', flush=True)\ntime.sleep(60)\n")
    process = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PREFECT__FLOW_RUN_ID": run_id},
                               stdout=subprocess.PIPE)
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"  # its handler is set
    return process


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for process in started:
        process.kill()
        process.wait()


def test_an_adopted_run_is_stopped_at_once_then_terminated_then_killed_if_it_lingers(
        processes: list[subprocess.Popen[bytes]]) -> None:
    process = _start(ignore_sigterm=True)
    processes.append(process)
    stops = Cancellations(grace_s=45, terminate_after_s=30, kill_after_s=60)
    assert stops.step(RUN, process.pid, "not needed", now=0.0, adopted=True) == "stop"
    assert stops.step(RUN, process.pid, "not needed", now=29.0, adopted=True) is None  # its checkpoint's time
    assert stops.step(RUN, process.pid, "not needed", now=30.0, adopted=True) == "terminated"
    assert stops.step(RUN, process.pid, "not needed", now=89.0, adopted=True) is None
    assert process.poll() is None  # it ignores SIGTERM
    assert stops.step(RUN, process.pid, "not needed", now=90.0, adopted=True) == "killed"
    assert process.wait(10) == -signal.SIGKILL
    stop = stops.forget(RUN)
    assert stop is not None and stop.message == "not needed" and (stop.stopped, stop.terminated) == (0.0, 30.0)
    assert stop.killed and stops.forget(RUN) is None


def test_a_run_this_worker_launched_is_left_to_prefect_for_the_grace_period(
        processes: list[subprocess.Popen[bytes]]) -> None:
    process = _start()
    processes.append(process)
    stops = Cancellations(grace_s=45, terminate_after_s=30, kill_after_s=60)
    assert stops.step(RUN, None, None, now=0.0, adopted=False) == "gone"  # launching: no PID yet
    assert stops.step(RUN, process.pid, None, now=44.0, adopted=False) is None
    assert stops.step(RUN, process.pid, None, now=45.0, adopted=False) == "stop"
    assert stops.step(RUN, process.pid, None, now=75.0, adopted=False) == "terminated"
    assert process.wait(10) == -signal.SIGTERM
    assert stops.step(RUN, process.pid, None, now=76.0, adopted=False) == "gone"
    stop = stops.forget(RUN)
    assert stop is not None and stop.message == "cancelled"  # none given


def test_a_pid_now_used_by_another_process_is_never_signalled(processes: list[subprocess.Popen[bytes]]) -> None:
    stranger = _start(run_id="another-run")
    processes.append(stranger)
    assert not is_flow_process(stranger.pid, RUN) and is_flow_process(stranger.pid, "another-run")
    assert Cancellations().step(RUN, stranger.pid, None, now=0.0, adopted=True) == "gone"
    time.sleep(0.2)
    assert stranger.poll() is None


def test_prefects_infrastructure_pid_is_read_with_or_without_its_host() -> None:
    assert process_id("1234") == 1234 and process_id("node-1:1234") == 1234
    assert process_id(None) is None and process_id("") is None and process_id("node-1:") is None
