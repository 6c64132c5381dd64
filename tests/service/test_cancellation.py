"""Which Cancelling runs the worker stops itself, and how, on real processes;
and the one SIGTERM -> SIGKILL escalation both of the worker's stops use."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from scheduler_service.worker.cancellation import Cancellations, Escalation, StopStep, is_flow_process, process_id

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


def test_steps_are_typed_and_still_read_as_the_strings_the_worker_compares() -> None:
    assert [s.value for s in StopStep] == ["stop", "terminated", "killed", "gone"]
    assert StopStep.STOP == "stop" and StopStep.GONE in ("terminated", "gone")


def test_the_escalation_kills_only_after_its_grace_and_only_the_runs_process(
        processes: list[subprocess.Popen[bytes]]) -> None:
    stubborn = _start(ignore_sigterm=True)
    stranger = _start(run_id="another-run")
    processes += [stubborn, stranger]
    assert Escalation(stranger.pid, RUN, kill_after_s=0.0).step(now=0.0) is StopStep.GONE
    escalation = Escalation(stubborn.pid, RUN, kill_after_s=10.0)
    assert escalation.step(now=100.0) is StopStep.TERMINATED
    assert escalation.step(now=109.9) is None
    time.sleep(0.2)
    assert stubborn.poll() is None  # SIGTERM ignored, and no SIGKILL before the grace is over
    assert escalation.step(now=110.0) is StopStep.KILLED
    assert stubborn.wait(10) == -signal.SIGKILL
    assert escalation.step(now=111.0) is StopStep.GONE
    assert stranger.poll() is None  # never signalled: its PID is not this run's process


def test_run_to_the_end_the_escalation_is_sigterm_then_sigkill_after_the_grace(
        processes: list[subprocess.Popen[bytes]]) -> None:
    polite, stubborn = _start(), _start(ignore_sigterm=True)
    processes += [polite, stubborn]
    started = time.monotonic()
    assert Escalation(polite.pid, RUN, kill_after_s=30.0).run() is StopStep.GONE
    assert polite.wait(10) == -signal.SIGTERM and time.monotonic() - started < 10
    started = time.monotonic()
    assert Escalation(stubborn.pid, RUN, kill_after_s=1.0).run() is StopStep.KILLED
    assert stubborn.wait(10) == -signal.SIGKILL and time.monotonic() - started >= 1.0
