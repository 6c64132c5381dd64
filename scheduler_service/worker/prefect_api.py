"""The private parts of Prefect's worker this service relies on, in one place.

Deciding before a run starts needs the runs a poll would submit, and a way to
submit only some of them: `BaseWorker._get_scheduled_flow_runs`,
`_submit_scheduled_flow_runs` and `_propose_pending_state` (prefect==3.9.1,
pinned in pyproject.toml). `check()` says what changed if an upgrade moves
them; a test calls it, so an upgrade that breaks them fails loudly there.
"""

from __future__ import annotations

import inspect
from typing import Any

from prefect.workers.base import BaseWorker

PINNED = "3.9.1"
# name -> the parameters (after self) this service passes
PRIVATE = {
    "_get_scheduled_flow_runs": [],
    "_submit_scheduled_flow_runs": ["flow_run_response"],
    "_propose_pending_state": ["flow_run"],
    "_has_successfully_synced": None,  # an attribute set by sync_with_backend
    "_runs_task_group": None,  # an attribute: the task group the worker's runs live in, while it is started
}


def check() -> list[str]:
    """What no longer matches (empty when this Prefect is one the service works with)."""
    import prefect

    problems = []
    if prefect.__version__ != PINNED:
        problems.append(f"prefect {prefect.__version__} is not the pinned {PINNED}")
    for name, params in PRIVATE.items():
        if params is None:
            continue
        method = getattr(BaseWorker, name, None)
        if method is None or not inspect.iscoroutinefunction(method):
            problems.append(f"BaseWorker.{name} is gone or no longer a coroutine")
            continue
        found = [p for p in inspect.signature(method).parameters if p != "self"]
        if found != params:
            problems.append(f"BaseWorker.{name}{tuple(found)} no longer takes {tuple(params)}")
    return problems


def synced(worker: BaseWorker[Any, Any, Any]) -> bool:
    """Whether the worker has its work pool (before that, Prefect's own poll runs)."""
    return bool(getattr(worker, "_has_successfully_synced", False))


def runs_task_group(worker: BaseWorker[Any, Any, Any]) -> Any:
    """The task group Prefect runs the worker's flow runs in (None before it
    starts): work spawned there outlives the poll and ends with the worker."""
    return getattr(worker, "_runs_task_group", None)


async def scheduled_runs(worker: BaseWorker[Any, Any, Any]) -> list[Any]:
    """The pool's scheduled runs due now (WorkerFlowRunResponse each), as Prefect's poll sees them."""
    from datetime import datetime, timezone

    responses = await worker._get_scheduled_flow_runs()
    worker._last_polled_time = datetime.now(timezone.utc)  # type: ignore[assignment]
    return list(responses)


async def submit(worker: BaseWorker[Any, Any, Any], responses: list[Any]) -> list[Any]:
    """Hand these runs to Prefect's submission (Pending, then `run`)."""
    if not responses:
        return []
    return await worker._submit_scheduled_flow_runs(flow_run_response=responses)
