"""What reaches a run from outside the service, on the real stack: a final
state set through Prefect's API is obeyed (the ranks stop, the GPUs are
released), and job variables that would run a command or change the
environment are refused by Prefect's server itself, naming the variable."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.scenarios import allocations as _allocations
from tests.service.conftest import Stack

pytestmark = pytest.mark.slow


def _iteration(status: Path) -> int:
    return int(json.loads(status.read_text()).get("iteration", 0)) if status.exists() else 0


def test_a_completed_state_forced_through_the_api_stops_the_ranks_and_frees_the_gpus(stack: Stack) -> None:
    """Issue 43: a `Completed` state set through the API was ignored: the
    store said running and the ranks kept training on their GPUs."""
    from prefect.states import Completed

    from elasticflow_block.prefect_client import sync_client
    from scheduler_service.worker.cancellation import is_flow_process, process_id

    run_id = stack.submit(iterations=20000, deadline="+60m", checkpoint_interval=5000)
    status = stack.home / "control" / run_id / "status.json"
    stack.wait_until(lambda: _iteration(status) > 5, 400, "the run to train")  # a loaded machine starts slowly
    with sync_client() as client:
        client.set_flow_run_state(run_id, Completed(message="done, says an operator"), force=True)  # type: ignore[arg-type]
        pid = process_id(client.read_flow_run(run_id).infrastructure_pid)  # type: ignore[arg-type]
    stack.wait_until(lambda: _allocations(stack, run_id)[-1] == ("release", ""), 180, "the release")
    assert pid is not None and not is_flow_process(pid, run_id)  # its process is gone
    reached = _iteration(status)
    time.sleep(3)
    assert _iteration(status) == reached < 20000  # nothing trains any more
    assert stack.flow_run(run_id).state.is_completed()  # the outside's word stands
    assert f"flow run {run_id} is Completed in Prefect while it runs" in stack.worker_log.read_text()


def test_job_variables_that_reach_past_the_model_are_refused_by_prefects_server(stack: Stack) -> None:
    """`prefect deployment run train/mlp --job-variable command="sh -c 'id > pwned.txt'"`
    ran the command as the stack's user; the pool now offers no such variable."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import PrefectHTTPStatusError

    pwned = stack.home / "pwned.txt"
    for variables, named in (({"command": f"sh -c 'id > {pwned}'"}, "command"),
                             ({"env": {"PYTHONPATH": str(stack.home)}}, "env"),
                             ({"working_dir": str(stack.home)}, "working_dir")):
        with pytest.raises(PrefectHTTPStatusError) as refused:
            run_deployment("train/mlp", parameters={"iterations": 10}, job_variables=variables, timeout=0)
        assert refused.value.response.status_code == 422 and named in refused.value.response.text
    run = run_deployment("train/mlp", parameters={"iterations": 10}, job_variables={"stream_output": False},
                         timeout=0)
    assert stack.wait_final(str(run.id), 180).state.is_completed()  # type: ignore[union-attr]
    assert not pwned.exists()
