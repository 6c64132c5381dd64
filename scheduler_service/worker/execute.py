"""Carrying out the control loop's actions in the service: commands on the
runs' control channels, the runs to launch through Prefect's process worker,
and everything told about them (through the Reporter: store first).

Nothing here waits for Prefect: the store is written at once, Prefect in
the background, each run's writes in order (reporting.py), so a run's page
still shows Admitted before the Pending of its launch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from scheduler_service.contracts import Rejection
from scheduler_service.loop import ControlLoop
from scheduler_service.loop.actions import (
    Action,
    Admitted,
    Await,
    Command,
    GuaranteeLost,
    Launch,
    ProfileNeeded,
    Rebased,
    Rejected,
    GpusFreed,
    HoldsNoGpus,
    RiskChanged,
    Started,
    StartedSlowly,
)
from scheduler_service.worker.channels import send, trained_at
from scheduler_service.worker.profiling import Profiler
from scheduler_service.worker.cluster import Cluster
from scheduler_service.worker.cluster_view import ClusterView
from scheduler_service.worker.registry import RunRegistry, ServiceRun
from scheduler_service.worker.reporting import Reporter
from scheduler_service.worker.watch import PrefectWatch

log = logging.getLogger("prefect.workers.elasticflow.start_cost")  # shown with the worker's own lines


@dataclass
class Applied:
    """What carrying out a step's actions leaves the worker to do: launch
    these runs through Prefect, and tell how these ended once their final
    state is known (after a cancelled one is settled)."""

    launches: list[Any] = field(default_factory=list)
    ended: list[tuple[ServiceRun, GpusFreed]] = field(default_factory=list)

    def __iadd__(self, other: "Applied") -> "Applied":
        self.launches += other.launches
        self.ended += other.ended
        return self


class Executor:
    def __init__(self, loop: ControlLoop, registry: RunRegistry, reporter: Reporter, cluster: Callable[[], Cluster],
                 watch: PrefectWatch, view: ClusterView, clock: Callable[[], float], profiler: Profiler) -> None:
        self.loop = loop
        self.registry = registry
        self.reporter = reporter
        self.cluster = cluster  # the cluster as it is now (it follows a Ray cluster's nodes)
        self.watch = watch  # for a run's final state
        self.view = view
        self.clock = clock
        self.profiler = profiler  # where a run goes back to when its partial curve must be completed first

    async def apply(self, actions: list[Action], now: float) -> Applied:
        """Carry out `actions` in order, admissions first (told before any launch)."""
        for action in [a for a in actions if isinstance(a, Admitted)]:
            run = self.registry.get(action.run_id)
            if run is not None:
                run.admitted(action.share)
                await self.reporter.admitted(run, action, self.loop.view(run.run_id, now), now)
        applied = Applied()
        for action in actions:
            if isinstance(action, Admitted):
                continue
            run = self.registry.get(action.run_id)
            if run is None:
                continue
            if await self._one(run, action, now) and run.response is not None:
                applied.launches.append(run.response)
            if isinstance(action, GpusFreed):
                applied.ended.append((run, action))
        return applied

    async def _one(self, run: ServiceRun, action: Action, now: float) -> bool:
        """True if the run is to be launched now."""
        reporter, view = self.reporter, self.loop.view(run.run_id, now)
        match action:
            case Command():
                cluster = self.cluster()
                send(run.channel, action, cluster.locate(action.gpus) if action.gpus else None)
                at_risk = view is not None and view.at_risk
                if isinstance(action, Launch):
                    run.launching(action.gpus)
                await reporter.allocation(run, action, view, cluster.nodes_of(action.gpus), at_risk, now)
                return isinstance(action, Launch)
            case Rejected():
                self.registry.forget(run.run_id)
                await reporter.rejected(run.run_id, run.flow_run, Rejection.of(
                    action.reason, action.message, action.earliest_feasible_deadline, run.deadline, now),
                    action.decision_s)
            case ProfileNeeded():
                self.profiler.complete_for(run, action.measured_up_to)
                await reporter.profiling(run, now, f"its model was profiled on {action.measured_up_to} GPU(s) only "
                                         "while the others were busy: measuring it on more before deciding it")
            case GuaranteeLost():
                run.admitted(None)
                await reporter.guarantee_lost(run)
            case Await():
                await reporter.waiting(run, action.placed, now)
            case HoldsNoGpus():
                await reporter.released(run, view)
            case GpusFreed():
                self.registry.forget(run.run_id)
                await reporter.released_for_good(run, action)
            case RiskChanged():
                reporter.risk(run, action, view)
            case Rebased():
                await reporter.rebased(run, action, view, self.cluster().nodes_of(action.held))
            case Started():
                reporter.started(run, action.took_s)
            case StartedSlowly():
                log.warning(
                    "flow run %s took %.1f s from launch to its first iteration; plans charge %.1f s per start and "
                    "keep %.1f s for a launch: admitted runs with tight deadlines may miss them. New runs now keep "
                    "the most of the last ten starts; set ELASTICFLOW_LAUNCH_S to what starts cost here",
                    run.run_id, action.took_s, action.charged_s, action.kept_s)
        return False

    async def tell_how_they_ended(self, applied: Applied) -> None:
        """Once their final state is known (a cancelled one settled), how the
        runs that ended did: by the one rule of contracts.outcome_of. In the
        background, after what was told of the run before."""
        for run, release in applied.ended:
            await self.reporter.in_background(self._tell_how_it_ended, run, release, lane=run.run_id)

    async def _tell_how_it_ended(self, run: ServiceRun, release: GpusFreed) -> None:
        state, why = await self.watch.final_state(run.run_id) if release.launched else ("CANCELLED", None)
        # The loop knows the iteration of the last progress it was told; rank 0's last status on the
        # channel may be later (the run finished between two polls, or while no worker watched).
        status = run.channel.status() if release.launched else None
        if status is not None and status.iteration > release.iteration:
            release = replace(release, iteration=status.iteration)
        trained = trained_at(run.channel, release.iterations) if release.launched else None
        outcome = self.reporter.ended(run, release, state, why, self.clock() if trained is None else trained)
        self.view.ended(run.run_id, release.iteration, outcome)
