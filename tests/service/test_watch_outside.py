"""A final state set from outside (Completed, Crashed... through the API, or
Prefect crashing a run) while the service has the run running, read by the
watch from a real Prefect server, against real processes: a process that
outlives that state is told to stop, then signalled; a run whose process
never started is ended at once, its GPUs freed."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from typing import Any


async def _flow_run(state: Any) -> str:
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow(name="outside")
    def nothing() -> None:
        pass

    async with get_client() as client:
        run = await client.create_flow_run(nothing)
        await client.set_flow_run_state(run.id, state, force=True)
        return str(run.id)


async def _cancelling(running: dict[str, bool], now: float) -> tuple[Any, Any]:
    from prefect.client.orchestration import get_client

    from scheduler_service.worker.backend import LocalProcesses
    from scheduler_service.worker.watch import FINAL_GRACE_S, PrefectWatch

    async with get_client() as client:
        watch = PrefectWatch(client, LocalProcesses(warm_start=False))
        first = await watch.cancelling(running, now)
        later = await watch.cancelling(running, now + FINAL_GRACE_S + 1)
        return first, later


def test_a_final_state_set_from_outside_stops_a_live_process_and_ends_one_never_started(prefect_api: str) -> None:
    from prefect.states import Cancelling, Completed, Crashed

    live = asyncio.run(_flow_run(Completed(message="done, says an operator")))
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               env={**os.environ, "PREFECT__FLOW_RUN_ID": live})
    try:
        asyncio.run(_set_pid(live, process.pid))
        never = asyncio.run(_flow_run(Crashed(message="EventTooLarge")))
        cancelling = asyncio.run(_flow_run(Cancelling()))  # Prefect's own cancellation: left to it here
        now, later = asyncio.run(_cancelling({live: False, never: False, cancelling: False}, time.time()))
        assert now.gone == [never] and now.stop == []  # a live process: its own end is given its grace
        assert later.stop == [live] and later.gone == [never]
        assert now.leaving == later.leaving == [cancelling]  # Prefect stops it; the loop leaves its GPUs be
        assert process.poll() is None  # told on its control channel first; the signals follow
    finally:
        process.kill()
        process.wait()


async def _set_pid(run_id: str, pid: int) -> None:
    from prefect.client.orchestration import get_client

    async with get_client() as client:
        await client.update_flow_run(run_id, infrastructure_pid=f"{socket.gethostname()}:{pid}")
