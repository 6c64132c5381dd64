"""Carrying out the control loop's actions in the service: commands on the
runs' control channels, the runs to launch through Prefect's process worker,
and everything told about them (through the Reporter: store first).

Admissions are told before this poll launches anything (a run's page shows
Admitted before Pending); rejections go to Prefect in the background.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from scheduler_service.contracts import Rejection
from scheduler_service.loop import ControlLoop
from scheduler_service.loop.actions import (
    Action,
    Admitted,
    Await,
    Command,
    GpusLost,
    GuaranteeLost,
    Launch,
    Rejected,
    Release,
    Released,
    RiskChanged,
    StartedSlowly,
)
from scheduler_service.worker.channels import send
from scheduler_service.worker.cluster import Cluster
from scheduler_service.worker.registry import RunRegistry, ServiceRun
from scheduler_service.worker.reporting import Reporter

log = logging.getLogger("prefect.workers.elasticflow.start_cost")  # shown with the worker's own lines


@dataclass
class Applied:
    """What carrying out a step's actions leaves the worker to do: launch
    these runs through Prefect, and tell how these ended once their final
    state is known (after a cancelled one is settled)."""

    launches: list[Any] = field(default_factory=list)
    ended: list[tuple[ServiceRun, Release]] = field(default_factory=list)

    def __iadd__(self, other: "Applied") -> "Applied":
        self.launches += other.launches
        self.ended += other.ended
        return self


class Executor:
    def __init__(self, loop: ControlLoop, registry: RunRegistry, reporter: Reporter,
                 cluster: Callable[[], Cluster]) -> None:
        self.loop = loop
        self.registry = registry
        self.reporter = reporter
        self.cluster = cluster  # the cluster as it is now (it follows a Ray cluster's nodes)

    async def apply(self, actions: list[Action], now: float) -> Applied:
        """Carry out `actions` in order."""
        admitted = [a for a in actions if isinstance(a, Admitted)]
        async with anyio.create_task_group() as group:  # independent requests: wait for the slowest only
            for action in admitted:
                run = self.registry.get(action.run_id)
                if run is not None:
                    run.admitted(action.share)
                    group.start_soon(self.reporter.admitted, run, action, self.loop.view(run.run_id, now), now)
        applied = Applied()
        for action in actions:
            if isinstance(action, Admitted):
                continue
            run = self.registry.get(action.run_id)
            if run is None:
                continue
            if await self._one(run, action, now) and run.response is not None:
                applied.launches.append(run.response)
            if isinstance(action, Release):
                applied.ended.append((run, action))
        return applied

    async def _one(self, run: ServiceRun, action: Action, now: float) -> bool:
        """True if the run is to be launched now."""
        reporter, view = self.reporter, self.loop.view(run.run_id, now)
        match action:
            case Command():
                cluster = self.cluster()
                send(run.channel, action, cluster.locate(action.gpus) if action.gpus else None)
                margin = view.risk_margin_s if view is not None else 0.0
                if isinstance(action, Launch):
                    run.launching(action.gpus)
                await reporter.allocation(run, action, view, cluster.nodes_of(action.gpus), margin, now)
                return isinstance(action, Launch)
            case Rejected():
                self.registry.forget(run.run_id)
                await reporter.rejected(run.run_id, run.flow_run, Rejection.of(
                    action.reason, action.message, action.earliest_feasible_deadline), action.decision_s)
            case GuaranteeLost():
                run.admitted(None)
                await reporter.guarantee_lost(run)
            case Await():
                await reporter.waiting(run, action.placed, now)
            case Released():
                await reporter.released(run, view)
            case Release():
                self.registry.forget(run.run_id)
                await reporter.released_for_good(run, action)
            case RiskChanged():
                reporter.risk(run, action, view)
            case GpusLost():
                reporter.gpus_lost(run, list(action.nodes))
            case StartedSlowly():
                log.warning(
                    "flow run %s took %.1f s from launch to its first iteration; plans charge %.1f s per start and "
                    "keep %.1f s for a launch: admitted runs with tight deadlines may miss them. New runs now keep "
                    "the most of the last ten starts; set ELASTICFLOW_LAUNCH_S to what starts cost here",
                    run.run_id, action.took_s, action.charged_s, action.kept_s)
        return False
