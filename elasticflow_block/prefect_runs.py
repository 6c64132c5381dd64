"""The Prefect API calls `train_model` makes: the history of a pipeline's
downstream steps (to learn how long they take), waiting for the training run
it submitted, and cancelling it when the pipeline stops waiting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from elasticflow_block.deadline import DownstreamStep, HistoryPolicy, step_from_history


def task_durations(name: str, flow_name: str | None, limit: int) -> list[float]:
    """Wall-clock seconds of the newest completed runs of task `name` (newest first), from the Prefect API.

    Task runs are named `<task name>-<suffix>` unless named explicitly, so the
    name is matched on that prefix; `flow_name` keeps one pipeline's
    `evaluate` apart from another's.
    """
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        TaskRunFilter,
        TaskRunFilterName,
        TaskRunFilterState,
        TaskRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import TaskRunSort

    from elasticflow_block.prefect_client import sync_client

    task_filter = TaskRunFilter(
        name=TaskRunFilterName(like_=name),
        state=TaskRunFilterState(type=TaskRunFilterStateType(any_=[StateType.COMPLETED])),
    )
    flow_filter = FlowFilter(name=FlowFilterName(any_=[flow_name])) if flow_name else None
    with sync_client() as client:
        runs = client.read_task_runs(
            task_run_filter=task_filter, flow_filter=flow_filter, sort=TaskRunSort.END_TIME_DESC, limit=limit * 4
        )
    durations: list[float] = []
    for run in runs:
        if run.name != name and run.name.rsplit("-", 1)[0] != name:
            continue  # `like_` is a substring match: `evaluate` also finds `pre-evaluate-1`
        if run.start_time is not None and run.end_time is not None:
            durations.append((run.end_time - run.start_time).total_seconds())
        elif run.total_run_time:
            durations.append(run.total_run_time.total_seconds())
        if len(durations) >= limit:
            break
    return durations


def learn_steps(names: Sequence[str], policy: HistoryPolicy, flow_name: str | None) -> list[DownstreamStep]:
    """Expected times of downstream steps from their past runs in Prefect (fallback where there are none)."""
    return [step_from_history(name, task_durations(name, flow_name, policy.last_n), policy) for name in names]


def wait_for_run(
    run_id: str, poll_interval_s: float, timeout_s: float | None, logger: logging.Logger | logging.LoggerAdapter[Any],
    outage_s: float = 300.0,
) -> Any:
    """Poll the run until it ends or `timeout_s` passes; the last read run either way.

    A lost connection to the API is waited out for up to `outage_s`: the
    training run does not depend on this process, so a short outage must not
    fail a pipeline whose model is still training.
    """
    from elasticflow_block.prefect_client import sync_client

    give_up = None if timeout_s is None else time.monotonic() + timeout_s
    failing_since: float | None = None
    flow_run: Any = None
    with sync_client() as client:
        while True:
            try:
                flow_run = client.read_flow_run(run_id)  # type: ignore[arg-type]
                failing_since = None
            except Exception as exc:  # httpx errors, 5xx after the client's own retries
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > outage_s:
                    raise
                logger.warning("cannot read train flow run %s (%s); retrying", run_id, exc)
            if flow_run is not None and flow_run.state is not None and flow_run.state.is_final():
                return flow_run
            if give_up is not None and time.monotonic() >= give_up:
                return flow_run
            time.sleep(poll_interval_s)


def cancel_run(run_id: str, why: str, logger: logging.Logger | logging.LoggerAdapter[Any]) -> None:
    """Ask Prefect to cancel the run unless it already ended; never raises (we are usually unwinding).

    `Cancelling` is what the UI's cancel button sets: a running run is stopped by
    its worker (the workers checkpoint first) and ends Cancelled; a run still
    waiting for GPUs or profiling is cancelled at once and gives its place back.
    """
    from prefect.states import Cancelling

    from elasticflow_block.prefect_client import sync_client

    try:
        with sync_client() as client:
            state = client.read_flow_run(run_id).state  # type: ignore[arg-type]
            if state is not None and (state.is_final() or state.is_cancelling()):
                return
            # Not forced: a run that completes meanwhile stays Completed, and one not
            # launched yet goes straight to Cancelled (Prefect's own rule).
            result = client.set_flow_run_state(run_id, Cancelling(message=why))  # type: ignore[arg-type]
        now = result.state
        if now is not None and (now.is_cancelling() or now.is_cancelled()):
            logger.warning("cancelled train flow run %s: %s", run_id, why)
        else:
            logger.info("train flow run %s was not cancelled: it is %s", run_id, now.name if now else "gone")
    except Exception as exc:
        logger.error("could not cancel train flow run %s (%s); cancel it by hand: %s", run_id, exc, why)


def current_flow_name() -> str | None:
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return context.flow.name if context is not None and context.flow is not None else None
