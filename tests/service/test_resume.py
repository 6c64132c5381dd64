"""A run whose process died while no worker watched (the machine or the whole
stack went down) is never left `Running` for ever holding GPUs: the next
worker finds its process gone, frees its GPUs and continues it from its last
checkpoint, in the same flow run."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.stack import Stack, state_names

pytestmark = pytest.mark.slow


def test_a_run_whose_process_died_with_the_worker_resumes_from_its_checkpoint(stack: Stack) -> None:
    stack.wait_idle()  # alone on both slots, it trains at the speed the counts below assume
    run_id = stack.submit(iterations=3000, deadline="+15m", checkpoint_interval=200)
    status = stack.home / "control" / run_id / "status.json"
    stack.wait_until(lambda: status.exists() and json.loads(status.read_text()).get("iteration", 0) > 400, 150,
                     "the run to train past a checkpoint")
    stack.kill_worker()
    pid = int(str(stack.flow_run(run_id).infrastructure_pid).rpartition(":")[2])
    os.kill(pid, signal.SIGKILL)  # its flow process goes too (its ranks stop at their next iteration)
    stack.wait_until(lambda: not os.path.exists(f"/proc/{pid}"), 30, "the flow process to go")
    stack.start_worker(stack.worker_log.with_name("worker-after-a-dead-run.log"))
    stack.wait_worker_started()
    stack.wait_until(lambda: "its process was gone when the worker restarted" in stack.worker_log.read_text(), 30,
                     "the worker to see the run's process gone")
    done = stack.wait_final(run_id, 300)
    assert done.state.is_completed(), done.state
    names = state_names(run_id)
    assert "Resuming" in names and names.count("Pending") == 2  # the same flow run, launched once more
    assert json.loads(status.read_text())["iteration"] == 3000
