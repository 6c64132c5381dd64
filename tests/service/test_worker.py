"""The `elasticflow` work pool end to end: a real Prefect server, the worker
started with `prefect worker start`, `train` flow runs of a tiny MLP."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from tests.service.conftest import Stack
from tests.scenarios import allocations as _allocations
from tests.stack import state_names as _state_names

pytestmark = pytest.mark.slow


def _wait_training(stack: Stack, run_id: str, past: int = 0) -> Path:
    """Wait until the run's status file shows an iteration beyond `past`; its path."""
    status = stack.home / "control" / run_id / "status.json"
    stack.wait_until(lambda: status.exists() and json.loads(status.read_text()).get("iteration", 0) > past, 150,
                     "the run to train")
    return status


@pytest.mark.parametrize(
    ("parameters", "reason"),
    [
        (dict(iterations=10**7, deadline="+60s"), "infeasible_even_on_an_idle_cluster"),
        (dict(iterations=40, deadline="2020-01-01T00:00:00Z"), "deadline_passed"),
    ],
    ids=["infeasible", "past"],
)
def test_deadlines_that_cannot_be_met_are_rejected_with_the_reason(
    stack: Stack, parameters: dict, reason: str
) -> None:
    run_id = stack.submit(**parameters)
    run = stack.wait_final(run_id, 60)
    assert run.state.type.value == "CANCELLED" and run.state.name == "Rejected"
    sentence, detail = run.state.message.split(" — ", 1)  # in plain words first, then the policy's detail
    assert detail.startswith(f"{reason}: ") and "The earliest deadline that can be guaranteed now is" in sentence
    if reason == "infeasible_even_on_an_idle_cluster":
        earliest = datetime.fromisoformat(run.state.message.split("earliest feasible deadline ")[1])
        # 1e7 iterations at 36 it/s: about 77 hours from now
        assert 70 * 3600 < (earliest - datetime.now(timezone.utc)).total_seconds() < 90 * 3600
    events = stack.events(run_id, "elasticflow.decision")
    assert events and events[0]["payload"]["reason"] == reason


def test_best_effort_runs_wait_for_spare_gpus_and_a_cancelled_one_gives_its_place_back(stack: Stack) -> None:
    stack.wait_idle()  # the spare GPUs the others wait for are the urgent and first runs', not an earlier test's
    # 128 s of work at two slots' profiled rate, due in 150 s. Its plan holds one or both slots from now
    # (one while its margin, learnt from the stack's earlier runs, leaves slack), then both: the one it
    # leaves spare goes to the first best-effort run, and the two after it wait. (Runs train ~10x faster
    # on this CPU than profiled: the first's ~20 s are the window in which the others are seen waiting.)
    urgent = stack.submit(iterations=4 * 36 * 32, deadline="+150s", checkpoint_interval=5000)
    first = stack.submit(iterations=4 * 36 * 32, checkpoint_interval=500)
    # Runs that arrive together are ordered by id: the two that must wait come once the first is seen.
    stack.wait_until(lambda: _allocations(stack, first) or "Waiting" in _state_names(first), 60, f"{first} seen")
    patient = stack.submit(iterations=50, checkpoint_interval=500)
    dropped = stack.submit(iterations=50, checkpoint_interval=500)

    def waited(run_id: str) -> bool:
        """Its states so far include Waiting: each run's states are published in a lane of its own, and
        one held up by a slow request shows Waiting late (once 15 s late, just before its Pending)."""
        return "Waiting" in _state_names(run_id)

    stack.wait_until(lambda: waited(dropped), 60, f"{dropped} to wait for GPUs")

    from prefect.states import Cancelled

    from elasticflow_block.prefect_client import sync_client

    with sync_client() as client:
        client.set_flow_run_state(dropped, Cancelled(message="changed my mind"), force=True)  # type: ignore[arg-type]
    stack.wait_until(lambda: waited(patient), 60, f"{patient} to wait for GPUs")
    assert stack.flow_run(patient).labels["elasticflow.mss"] == "best-effort"
    names = _state_names(patient)
    assert "Pending" not in names or names.index("Waiting") < names.index("Pending")
    for run_id in (urgent, first, patient):
        assert stack.wait_final(run_id, 180).state.is_completed()
    assert _allocations(stack, dropped)[-1] == ("release", "")  # forgotten, never launched
    assert all(action != "launch" for action, _ in _allocations(stack, dropped))


def test_cancelling_a_running_run_ends_it_cancelled_with_a_checkpoint_and_frees_its_gpus(stack: Stack) -> None:
    """The UI's cancel button on a training run: Prefect's runner must be able to
    acknowledge the cancellation (so the run ends Cancelled, not Crashed), the
    workers checkpoint before they go, and the GPUs are released after the process."""
    from elasticflow_block import CheckpointStorage

    run_id = stack.submit(iterations=20000, deadline="+60m", checkpoint_interval=5000)
    _wait_training(stack, run_id, past=5)
    stack.cancel(run_id)
    run = stack.wait_final(run_id, 90)
    assert (run.state.type.value, run.state.name) == ("CANCELLED", "Cancelled"), f"{run.state!r}\n{stack.log_tail()}"
    done = CheckpointStorage(str(stack.home / "checkpoints")).iterations(run_id)
    assert done and 5 < done[-1] < 5000  # written on the way out, not by the interval
    stack.wait_until(lambda: _allocations(stack, run_id)[-1] == ("release", ""), 30, "the release")


def test_a_run_cancelled_before_its_process_starts_ends_cancelled_and_frees_its_gpus(stack: Stack) -> None:
    """Cancelled between the worker's Pending and its launch (a pipeline step
    timing out as its run starts): nothing is started, and the run does not stay
    Cancelling for ever, as Prefect's worker leaves it without `enable_cancellation`."""
    from prefect.states import Cancelling

    from elasticflow_block.prefect_client import sync_client

    run_id = stack.submit(iterations=20000, deadline="+60m", checkpoint_interval=5000)
    with sync_client() as client:
        deadline = time.time() + 180  # profiling first, on a loaded machine
        while (state := client.read_flow_run(run_id).state).is_scheduled() and time.time() < deadline:  # type: ignore[arg-type, union-attr]
            time.sleep(0.05)
        assert state is not None and state.is_pending(), f"not cancelled while pending: {state!r}\n{stack.log_tail()}"
        client.set_flow_run_state(run_id, Cancelling(message="not needed any more"), force=True)  # type: ignore[arg-type]
    run = stack.wait_final(run_id, 90)
    assert run.state.is_cancelled(), f"{run.state!r}\n{stack.log_tail()}"
    # Almost always caught before the launch; should the launch win the race, Prefect's
    # cancellation (its own message) or ours once the process exits ends it.
    if f"flow run {run_id} was cancelled before its process started" in stack.worker_log.read_text():
        assert run.state.message == "not needed any more"
    stack.wait_until(lambda: _allocations(stack, run_id)[-1] == ("release", ""), 30, "the release")


def test_a_run_cancelled_while_no_worker_watches_is_adopted_stopped_with_a_checkpoint_and_ends_cancelled(stack: Stack) -> None:
    """Prefect's worker stops only processes it launched itself: an adopted run
    cancelled in the UI trained on to its end and stayed Cancelling for ever.
    Cancelled while no worker watched, it was not even adopted: its GPUs could
    have been handed out again while it trained on them."""
    from elasticflow_block import CheckpointStorage

    stack.wait_idle()  # on both slots: long enough to be cancelled mid-run (on one it would be done in seconds)
    # Long enough to outlast a worker restart on a loaded machine (20,000 once
    # finished first, and its process was gone before anyone could stop it).
    run_id = stack.submit(iterations=400_000, deadline="+10h", checkpoint_interval=200_000)
    _wait_training(stack, run_id, past=5)
    stack.kill_worker()
    stack.cancel(run_id)
    stack.start_worker(stack.worker_log.with_name("worker-restarted-to-cancel.log"))
    stack.wait_worker_started()
    assert f"adopted running flow run {run_id}" in stack.worker_log.read_text()
    run = stack.wait_final(run_id, 90)
    assert run.state.is_cancelled() and run.state.message == "not needed any more", f"{run.state!r}\n{stack.log_tail()}"
    # Told to stop through its control channel: at adoption, or by the first
    # poll's watch of Cancelling runs, whichever comes first on a busy machine.
    from flows.training.control import FileControlChannel

    command = FileControlChannel(run_id, stack.home / "control").latest()
    assert command is not None and command.action == "stop", command
    assert "Crashed" not in _state_names(run_id)  # stopped through its control channel, not by a signal
    done = CheckpointStorage(str(stack.home / "checkpoints")).iterations(run_id)
    assert done and 5 < done[-1] < 200_000  # written on the way out, not by the interval
    stack.wait_until(lambda: _allocations(stack, run_id)[-1] == ("release", ""), 30, "the release")


def test_a_model_never_profiled_is_profiled_on_free_slots_then_admitted(stack: Stack) -> None:
    from scheduler_service.store import get_curve
    from scheduler_service.store.db import get_engine

    run_id = stack.submit(iterations=60, deadline="+10m", hyperparameters={"global_batch_size": 16},
                          checkpoint_interval=500)
    run = stack.wait_final(run_id, 240)
    assert run.state.is_completed(), run.state
    names = _state_names(run_id)
    assert names.index("Profiling") < names.index("Admitted") < names.index("Running")
    curve = get_curve("mlp", 16, engine=get_engine(f"sqlite:///{stack.home / 'elasticflow.db'}"))
    assert curve is not None and set(curve) == {1, 2}  # both slots were free to measure on
    assert "profiling mlp@16 on GPUs 0,1" in stack.worker_log.read_text()


def test_a_restarted_worker_adopts_the_running_run_which_completes(stack: Stack) -> None:
    # Long enough (about 90 s on two CPU slots) not to end while the worker
    # restarts on a loaded machine (then there would be nothing to adopt). On
    # one slot it trains without an all-reduce, 15x faster: so it starts alone.
    stack.wait_idle()
    run_id = stack.submit(iterations=6000, deadline="+15m", checkpoint_interval=500)
    status = _wait_training(stack, run_id)
    stack.kill_worker()
    # What it holds: the GPUs it acknowledged and any it was told to move to
    # (one or both slots, depending on whether the run before it had finished).
    control = stack.home / "control" / run_id
    held = sorted({*json.loads((control / "ack.json").read_text())["gpus"],
                   *json.loads((control / "command.json").read_text())["gpus"]})
    stack.start_worker(stack.worker_log.with_name("worker-restarted.log"))
    stack.wait_worker_started()
    assert f"adopted running flow run {run_id} on GPUs {','.join(map(str, held))}" in stack.worker_log.read_text()
    done = stack.wait_final(run_id, 300)
    assert done.state.is_completed(), done.state
    # The same flow run, never relaunched by Prefect (a relaunch passes through
    # Pending again; run_count also counts the Rescaling -> Running steps).
    assert _state_names(run_id).count("Pending") == 1
    assert json.loads(status.read_text())["iteration"] == 6000
    stack.wait_until(lambda: _allocations(stack, run_id)[-1] == ("release", ""), 30, "the new worker to release it")
    # Still one allocation-history artifact, continued: the launch from before the crash, the release after.
    stack.wait_until(lambda: "| release |" in stack.allocation_artifact(run_id), 30,
                     "the release in the run's allocation history")
    assert "| launch |" in stack.allocation_artifact(run_id)


def test_a_run_that_ends_while_no_worker_watches_is_released_by_the_next_one(stack: Stack) -> None:
    from sqlmodel import Session

    from scheduler_service.store.db import get_engine
    from scheduler_service.worker.store import RunRecord

    run_id = stack.submit(iterations=400, deadline="+10m", checkpoint_interval=500)
    _wait_training(stack, run_id)
    stack.kill_worker()
    assert stack.wait_final(run_id, 120).state.is_completed()  # the flow process does not need the worker
    assert _allocations(stack, run_id)[-1][0] != "release"
    stack.start_worker(stack.worker_log.with_name("worker-after-the-end.log"))
    stack.wait_worker_started()
    assert _allocations(stack, run_id)[-1] == ("release", "")
    with Session(get_engine(f"sqlite:///{stack.home / 'elasticflow.db'}")) as session:
        assert session.get(RunRecord, run_id).status == "finished"  # type: ignore[union-attr]


def test_a_second_worker_on_the_pool_refuses_to_start_naming_the_first(stack: Stack, tmp_path: Path) -> None:
    """Two workers on one pool decided every run twice and trained more runs
    than there were GPUs (issue 43): the second refuses, naming the first's
    host, pid and since, and the first keeps its pool (a clean stop's
    release, and take-overs: tests/service/test_lease.py)."""
    import socket
    import subprocess
    import sys

    log = tmp_path / "second.log"
    second = subprocess.run([sys.executable, "-m", "prefect", "worker", "start", "--pool", "gpus"],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT, timeout=120)
    said = log.read_text(errors="replace")
    assert second.returncode != 0, said
    assert "work pool 'gpus' is held by another ElasticFlow worker" in said, said
    assert f"host {socket.gethostname()}, pid {stack.worker.pid}, since " in said, said
    assert stack.worker.poll() is None  # the first goes on
