"""Runs that end or leave without the worker seeing their process exit, as
Prefect tells it: runs not launched yet that left the queue, runs under
processes an earlier worker launched (adopted ones are not the worker's
children, so their end is read from Prefect), and running runs left
`Cancelling` that Prefect's own worker does not stop. The steps that stop
those are the execution backend's (`cancellation.py`); what to do with the
run is the control loop's: this module only says which runs, and settles
their Prefect state.

`settle` ends a run still `Cancelling` whose process is gone or never
started, or one whose process was stopped for a cancellation (its engine then
reports `Crashed`): `Cancelled`, with the canceller's message. Without it
such runs stayed `Cancelling` for ever: an engine refuses a run already
`Cancelling` and exits without ending it, and Prefect's worker settles that
only with `enable_cancellation`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled

from scheduler_service.worker.backend import ExecutionBackend
from scheduler_service.worker.cancellation import StopStep

log = logging.getLogger("prefect.workers.elasticflow.stopping")  # shown with the worker's own lines

# How long a run's process may outlive its final state before that state is
# taken as set from outside: a flow's own Completed is followed by its exit
# within a second or two, within tens on a machine loaded far past its cores.
FINAL_GRACE_S = 30.0
FINAL = (StateType.COMPLETED, StateType.CANCELLED, StateType.CRASHED, StateType.FAILED)


@dataclass
class Stopping:
    """Running runs being stopped from outside, as one poll found them."""

    leaving: list[str] = field(default_factory=list)  # Cancelling: Prefect stops them; no GPU moves meanwhile
    stop: list[str] = field(default_factory=list)  # to tell to stop now: nothing of Prefect's does
    gone: list[str] = field(default_factory=list)  # no process (gone, or never started): to end, GPUs freed


class PrefectWatch:
    def __init__(self, client: Any, backend: ExecutionBackend) -> None:
        self.client = client
        self.backend = backend
        self._final_seen: dict[str, float] = {}  # running run id -> when it was first seen in a final state

    async def settle(self, flow_run_id: Any, when: str) -> bool:
        """End a cancelled run whose process is gone `Cancelled`; True if it did."""
        stop = self.backend.forget(str(flow_run_id))
        try:
            state = (await self.client.read_flow_run(flow_run_id)).state
            stopped_by_us = (stop is not None and stop.terminated is not None and state is not None
                             and state.is_crashed())
            if state is None or not (state.is_cancelling() or stopped_by_us):
                return False
            message = stop.message if stop is not None else (state.message or "cancelled")
            await self.client.set_flow_run_state(flow_run_id, Cancelled(message=message), force=stopped_by_us)
        except Exception:
            log.warning("could not settle the cancellation of flow run %s", flow_run_id, exc_info=True)
            return False
        log.info("flow run %s was cancelled %s; marked Cancelled", flow_run_id, when)
        return True

    async def final_state(self, run_id: str, timeout_s: float = 5.0) -> tuple[str | None, str | None]:
        """The run's final state's type and message, as Prefect has it now;
        (None, None) if that cannot be read in time (then its iterations say
        how it ended)."""
        import anyio

        try:
            with anyio.fail_after(timeout_s):
                state = (await self.client.read_flow_run(UUID(run_id))).state
        except Exception:
            log.warning("could not read the final state of flow run %s", run_id, exc_info=True)
            return None, None
        if state is None:
            return None, None
        return state.type.value, state.message

    async def vanished(self, waiting: Iterable[str], scheduled: set[str]) -> list[str]:
        """Runs not started yet that left the Scheduled state without us
        (cancelled or deleted in the UI): they give back their place."""
        from prefect.exceptions import ObjectNotFound

        gone = []
        for run_id in [r for r in waiting if r not in scheduled]:
            try:
                flow_run = await self.client.read_flow_run(UUID(run_id))
            except ObjectNotFound:
                flow_run = None
            except Exception:
                continue
            # Ended (cancelled in the UI) or deleted. A run Pending or Running is not gone: a launch this
            # worker (or the one before it, killed just after) made and has not seen start yet.
            if flow_run is None or flow_run.state is None or flow_run.state.is_final():
                log.info("flow run %s left the queue before it got GPUs; forgetting it", run_id)
                gone.append(run_id)
        return gone

    async def ended(self, foreign: Iterable[str]) -> list[str]:
        """Runs under processes an earlier worker launched that Prefect says
        have ended and whose process is gone (one that outlives its final
        state is stopped first: `cancelling`)."""
        from prefect.exceptions import ObjectNotFound

        done = []
        for run_id in foreign:
            try:
                flow_run = await self.client.read_flow_run(UUID(run_id))
                final = flow_run is None or flow_run.state is None or flow_run.state.is_final()
                if final and flow_run is not None and self.backend.alive(flow_run.infrastructure_pid, run_id):
                    final = False
            except ObjectNotFound:
                final = True
            except Exception:
                log.warning("could not read flow run %s", run_id, exc_info=True)
                continue
            if final:
                done.append(run_id)
        return done

    async def cancelling(self, running: dict[str, bool], now: float) -> Stopping:
        """Running runs `Cancelling` (Prefect's own worker stops those it
        launched; adopted ones, or ones cancelled as they launched, are left:
        see cancellation.py), or already in a final state while the service
        still has them running (set from outside through the API: Completed,
        Cancelled, Crashed, Failed; or crashed by Prefect itself), by id ->
        whether an earlier worker launched it. Signals are the backend's to
        send."""
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterId,
            FlowRunFilterState,
            FlowRunFilterStateType,
        )
        for run_id in [r for r in self._final_seen if r not in running]:
            del self._final_seen[run_id]
        found = Stopping()
        if not running:
            return found
        try:
            flow_runs = await self.client.read_flow_runs(flow_run_filter=FlowRunFilter(
                id=FlowRunFilterId(any_=[UUID(r) for r in running]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.CANCELLING, *FINAL]))))
        except Exception:
            log.warning("could not read which runs are cancelling", exc_info=True)
            return found
        for flow_run in flow_runs:
            run_id = str(flow_run.id)
            if run_id not in running:  # ended while we read
                continue
            state = flow_run.state
            final = state is not None and state.type in FINAL
            adopted = running[run_id]
            if final:
                # A run's own end (Completed as its flow returns) is followed at
                # once by its process's exit, which ends it: only a final state
                # its process outlives is someone else's, and is obeyed as a stop.
                seen = self._final_seen.setdefault(run_id, now)
                if flow_run.infrastructure_pid and now - seen < FINAL_GRACE_S:
                    continue
                adopted = True  # nothing of Prefect's will stop it: at once
            if not final:
                found.leaving.append(run_id)
            message = state.message if state is not None else None
            if final:
                message = f"set {state.name} from outside" + (f": {message}" if message else "")  # type: ignore[union-attr]
            try:
                step = self.backend.stop_step(run_id, flow_run.infrastructure_pid, message, now, adopted)
            except Exception:  # one run's trouble must not stop the poll
                log.exception("could not stop cancelled flow run %s", run_id)
                continue
            said = f"is {state.name} in Prefect while it runs" if final else "is Cancelling"  # type: ignore[union-attr]
            if step is StopStep.STOP:
                log.info("flow run %s %s and Prefect's worker does not stop it: told it to stop", run_id, said)
                found.stop.append(run_id)
            elif step in (StopStep.TERMINATED, StopStep.KILLED):
                log.warning("flow run %s %s and did not stop when told: %s its process", run_id, said, step.value)
            elif step is StopStep.GONE and ((not final) if running[run_id] else (final and not flow_run.infrastructure_pid)):
                # An adopted run's process is gone (a final one: `ended` says so), or
                # Prefect ended a run of ours before its process started (none will exit).
                log.warning("flow run %s %s and has no process: its GPUs are freed", run_id, said)
                found.gone.append(run_id)
        return found

    async def still_to_launch(self, flow_run: Any) -> bool:
        """False for a run cancelled (or ended by hand) since we made it Pending:
        Prefect's launcher goes by the state it polled. A `Cancelling` one is
        ended `Cancelled` here, as nothing else would end it."""
        try:
            state = (await self.client.read_flow_run(flow_run.id)).state
        except Exception:
            log.warning("could not read flow run %s before its launch; launching it", flow_run.id, exc_info=True)
            return True
        if state is not None and state.is_cancelling():
            return not await self.settle(flow_run.id, "before its process started")
        if state is not None and state.is_final():
            log.info("flow run %s is %s since it was made Pending; not launched", flow_run.id, state.name)
            return False
        return True
