"""The control loop: every decision the service makes, in one Prefect-free
object that the service and the simulator drive alike.

Events come in through `handle` (a run arrived, reported progress,
acknowledged a command, ended, was cancelled; the cluster changed; the
service reserved GPUs), the clock through `step`. Out come typed actions
(admit, reject, launch, rescale, park, stop, release, at risk ...) for the
driver to carry out. No file, clock, database or API is touched here: the
Prefect worker reads control channels and writes commands, the simulator
models them, and both see the loop decide the same way.

Per step: the pure policy is asked at once when runs arrived (a user waits
for the answer) and once per slot for everyone, with every run's status
(remaining iterations, GPUs, restart still being paid); then its placement
becomes commands (actuation.py), and runs whose outlook flipped are said to
be at risk or recovered (risk.py). What a run is told of its decision is
verdicts.py's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from scheduler_service.contracts import RunPhase
from scheduler_service.loop.actions import (
    Action,
    ProfileNeeded,
    Rebased,
    GuaranteeLost,
    Rejected,
    GpusFreed,
    HoldsNoGpus,
    Started,
    StartedSlowly,
    Stop,
)
from scheduler_service.loop.actuation import actuate, free_block
from scheduler_service.loop.deadlines import NO_MARGIN, SafetyMargin
from scheduler_service.loop.events import (
    Acknowledged,
    Adopted,
    Arrived,
    CancelRequested,
    ClusterChanged,
    Ended,
    Event,
    Leaving,
    ProfileFailed,
    Progress,
    Reserved,
    StartsRecalled,
    Unreserved,
)
from scheduler_service.loop.quiet import quiet_until
from scheduler_service.loop.risk import RiskRule
from scheduler_service.loop.run import LoopRun, RunFacts
from scheduler_service.loop.settings import LoopSettings, policy_maker
from scheduler_service.loop.speeds import Speeds
from scheduler_service.loop.start_cost import StartCost
from scheduler_service.loop.verdicts import admitted, rejected, short_of_measurement
from scheduler_service.policy import Job, SchedulingPolicy, SchedulingRequest
from scheduler_service.policy.teams import TeamsPolicy, TeamUse
from scheduler_service.policy.topology import AnyTopology, MixedTopology, kind_of


class ControlLoop:
    def __init__(self, topology: AnyTopology, settings: LoopSettings,
                 policy_for: Callable[[AnyTopology], SchedulingPolicy] | None = None) -> None:
        self.settings = settings
        self._policy_for = policy_for or policy_maker(settings)
        self.policy = self._policy_for(topology)
        self.start_cost = StartCost(settings.charged, settings.launch_s, settings.charged.in_place)
        self.margin = SafetyMargin(settings.safety_margin, floor_s=settings.interval_s)
        self.speeds = Speeds(settings.margin_rule, settings.safety_margin)  # what runs' speeds teach
        self.risk = RiskRule(max(settings.interval_s, settings.at_risk_s), settings.interval_s, settings.defend)
        self.runs: dict[str, LoopRun] = {}  # decided, until they end
        self.arrivals: list[LoopRun] = []  # to be decided by the next plan
        self.gone: list[str] = []  # ended or stopped since the last plan: the policy forgets them then
        self.reserved: dict[str, tuple[int, ...]] = {}  # the service's own use of GPUs
        self.last_slot: int | None = None  # of the last plan
        self.planned_at = float("-inf")  # when the last plan was made
        self._checked_slot: int | None = None  # the last boundary at which a plan was not due
        self.wake_at: float | None = None  # when the last plan's policy wants to be asked again

    @property
    def topology(self) -> AnyTopology:
        return self.policy.topology

    # -- the one entry ---------------------------------------------------------
    def tick(self, events: list[Event], now: float) -> list[Action]:
        """A driver's poll: what happened since the last one, then the clock.
        The worker and the simulator both drive the loop through this alone,
        so neither keeps its own copy of the order things are decided in."""
        actions = [action for event in events for action in self.handle(event, now)]
        return actions + self.step(now)

    def live(self) -> int:
        """Runs decided and not ended (a driver's loop goes on while there are)."""
        return len(self.runs)

    def quiet_until(self, now: float) -> float:
        """With no event before it, the first time a step could act or
        learn (quiet.py); `now` if the next slot's look may. A driver may
        skip the slot boundaries in between (the simulator does)."""
        if self.arrivals or self.gone or self.last_slot is None:
            return now
        until = self.wake_at if self.wake_at is not None else math.inf
        for run in self.runs.values():
            quiet = quiet_until(run, now, self.settings.interval_s, self.planned_at)
            if quiet is None or not self.speeds.learnt(run):
                return now
            until = min(until, quiet)
        return until

    # -- events ----------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Action]:
        """Take in what happened; the actions due at once (a release, a stop)."""
        match event:
            case Arrived():
                self.arrivals.append(LoopRun(event.run_id, self.speeds.applied(event.job), event.at,
                                             self.start_cost.reserve(), self._margin_for(event.job),
                                             event.measured_up_to, profiled_as=event.job))
            case Adopted():
                return self._adopt(event)
            case StartsRecalled():
                self.start_cost.recall(event.took_s)
            case Progress():
                return self._progress(event, now)
            case Acknowledged():
                run = self._find(event.run_id)
                if run is not None and run.acknowledge(event.seq, event.gpus):
                    return [HoldsNoGpus(run.run_id)]
            case Ended():
                return self._ended(event.run_id)
            case Leaving():
                self._leave(event.run_id)
            case CancelRequested():
                run = self._leave(event.run_id)
                if run is not None and not run.told_to_stop:
                    return [Stop(run.run_id, run.stop())]
            case ClusterChanged():
                return self._rebase(event)
            case Reserved():
                self.reserved[event.holder] = event.gpus
            case Unreserved():
                self.reserved.pop(event.holder, None)
            case ProfileFailed():  # never arrived: decided here, by the loop, as every run is
                return [Rejected(event.run_id, event.reason, event.message, None, None)]
        return []

    def _leave(self, run_id: str) -> LoopRun | None:
        """A running run was cancelled: planned no more (once); None if it is not running."""
        run = self.runs.get(run_id)
        if run is None or run.phase != RunPhase.RUNNING:
            return None
        if run.leave():
            self.gone.append(run_id)  # its deadline no longer holds anyone back
        return run

    def _margin_for(self, job: Job) -> SafetyMargin:
        """The room a new run keeps in front of its deadline: learnt from how
        far runs of its model on its kind strayed from their profiles."""
        if not self.settings.defend:
            return self.margin
        return SafetyMargin(self.speeds.margin(job), floor_s=self.settings.interval_s)

    def _adopt(self, event: Adopted) -> list[Action]:
        """A run an earlier life of the service admitted: running (it is
        re-planned with its real status and stays on its GPUs if its width
        holds) or still waiting for GPUs. If the policy no longer guarantees
        it, it carries on best-effort: an admitted run is never rejected
        afterwards. A running one cancelled meanwhile is never planned: it is
        told to stop and holds its GPUs until it does."""
        run = LoopRun(event.run_id, event.job, event.job.submit_time, 0.0, NO_MARGIN)
        run.adopt(event.running, event.held, event.commanded, event.pending_seq, event.last_seq, event.share,
                  event.since)
        if event.running and event.cancelled:
            self.runs[run.run_id] = run
            return [Stop(run.run_id, run.stop())]
        self._replan_as_adopted(run)
        return []

    def _replan_as_adopted(self, run: LoopRun) -> None:
        if run.phase == RunPhase.RUNNING:
            self.policy.hold(run.run_id, run.commanded or run.held)  # stay put if the width holds
        self.arrivals.append(run)

    def _find(self, run_id: str) -> LoopRun | None:
        """A decided run, or one waiting for its decision (an adopted one may be running)."""
        return self.runs.get(run_id) or next((r for r in self.arrivals if r.run_id == run_id), None)

    def _progress(self, event: Progress, now: float) -> list[Action]:
        run = self._find(event.run_id)
        if run is None or run.phase != RunPhase.RUNNING:
            return []
        run.report(event.iteration, event.gpus, event.iterations_per_s, event.projected_finish, event.save_error)
        resized = run.resized_in(now)
        if resized is not None:
            self.start_cost.resized(resized, run.in_place)
        if not run.first_iteration_since_launch():
            return []
        assert run.launched_at is not None
        took = now - run.launched_at
        run.started()
        slow = self.start_cost.started(took, len(run.commanded))
        said: list[Action] = [Started(run.run_id, took)]
        return said if slow is None else [*said, StartedSlowly(run.run_id, slow.took_s, slow.charged_s, slow.kept_s)]

    def _ended(self, run_id: str) -> list[Action]:
        """Its process exited, or it left before it was launched."""
        waiting = next((run for run in self.arrivals if run.run_id == run_id), None)
        self.arrivals = [run for run in self.arrivals if run.run_id != run_id]
        run = self.runs.pop(run_id, None)
        if run is None and waiting is not None and waiting.adopted:
            run = waiting  # decided by an earlier life, ended before it was planned again: released all the same
        if run is None:
            return []  # never decided: nothing to give back
        launched = run.phase == RunPhase.RUNNING
        if not run.stopping:
            self.gone.append(run_id)
        self.speeds.forget(run_id)
        run.finish()
        return [GpusFreed(run_id, launched, run.iteration, run.job.iterations)]

    def _rebase(self, event: ClusterChanged) -> list[Action]:
        """Go on with a policy made for the new cluster. Every admitted run is
        re-planned as after a restart (adopted: never rejected, best-effort if
        no longer guaranteed); a run that lost GPUs with a node lost its ranks
        and waits for a new placement."""
        def moved(gpus: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(sorted(event.mapping[g] for g in gpus if g in event.mapping))

        old_runs, old_arrivals = self.runs, self.arrivals
        self.policy = self._policy_for(event.topology)
        self.runs, self.arrivals, self.gone, self.last_slot = {}, [], [], None
        self.reserved = {name: moved(gpus) for name, gpus in self.reserved.items() if len(moved(gpus)) == len(gpus)}
        rebased: list[Action] = []
        for run in old_runs.values():
            before = (run.held, run.commanded)
            lost = run.lose_gpus(event.mapping)
            if lost or (run.held, run.commanded) != before:
                rebased.append(Rebased(run.run_id, run.held, lost, event.lost_nodes if lost else ()))
            if run.stopping:
                self.runs[run.run_id] = run  # told to stop: holds its GPUs until it has
                continue
            run.adopt(run.phase == RunPhase.RUNNING, run.held, run.commanded, run.pending_seq, run.seq, run.share,
                      run.since)
            self._replan_as_adopted(run)
        self.arrivals += [run for run in old_arrivals if run not in self.arrivals]
        return rebased

    # -- the clock ---------------------------------------------------------------
    def step(self, now: float) -> list[Action]:
        """Plan if due, move runs toward their placement, say whose outlook flipped."""
        actions = self._plan(now) if self._due(now) else []
        if any(run.adopted and run.phase == RunPhase.RUNNING for run in self.arrivals):
            # An adopted run the plan no longer guarantees still trains on its GPUs: planned again at once,
            # best-effort, before anything moves onto them (it gives them up by its own acknowledgement).
            actions += self._plan(now)
        actions += actuate(list(self.runs.values()), self._reserved_gpus(), self.start_cost.charge, now)
        actions += self.risk.changes(self.runs.values(), self.topology.max_job_gpus, self.start_cost, now)
        return actions

    def _due(self, now: float) -> bool:
        """At once for arrivals (a user waits for the answer, and an admitted
        run should not wait for the next boundary to start) and after the
        cluster changed; else at the first slot boundary after something the
        last plan rested on changed: a run ended or was stopped, a run's
        measured speed moved its curve, a run fell more than a slot behind
        its plan, a run's deadline passed (the policy carries it on
        best-effort, and it may hold nothing until it is planned so); and
        when the policy asked to be woken (a plan that widens)."""
        if self.arrivals or self.last_slot is None:
            return True
        slot = self.policy.clock.slot_of(now)
        if slot <= self.last_slot or slot == self._checked_slot:
            return False
        self._checked_slot = slot
        interval = self.settings.interval_s
        moved = [run for run in self.runs.values() if run.observe()]  # each run's speed, once a slot
        for run in self.runs.values():
            self.speeds.observe(run)
        return bool(self.gone or moved or (self.wake_at is not None and now >= self.wake_at - 1e-6)
                    or any(run.slipped(now, interval) or run.due_between(self.planned_at, now)
                           for run in self.runs.values()))

    def _plan(self, now: float) -> list[Action]:
        clock = self.policy.clock
        self.last_slot, self.planned_at = clock.slot_of(now), now
        elapsed = now - self.last_slot * clock.interval
        arrivals, self.arrivals = self.arrivals, []
        gone, self.gone = self.gone, []
        status = {run.run_id: run.status(self.start_cost.charge(len(run.commanded), run.in_place), now, elapsed,
                                         kind_of(self.topology, run.commanded[0]) if run.commanded else "",
                                         at_measured_speed=self.settings.defend)
                  for run in [*self.runs.values(), *arrivals] if not run.stopping}
        started = time.perf_counter()
        reply = self.policy.schedule(SchedulingRequest(now=now, arrivals=[r.job for r in arrivals], finished=gone,
                                                       status=status))
        seconds = time.perf_counter() - started
        decided = {d.job_id: d for d in reply.decisions}
        actions: list[Action] = []
        for run in arrivals:
            decision = decided.get(run.run_id)
            if decision is not None and decision.admitted:
                run.admit(decision.share)
                self.runs[run.run_id] = run
                actions.append(admitted(run, decision, reply.allocation.get(run.run_id, 0), seconds))
            elif run.adopted:  # next slot, as best-effort
                if run.job.deadline is not None:
                    actions.append(GuaranteeLost(run.run_id))
                run.demote()
                self.arrivals.append(run)
            elif decision is not None and short_of_measurement(run, decision):
                actions.append(ProfileNeeded(run.run_id, run.measured_up_to))  # type: ignore[arg-type]
            elif decision is not None:
                actions.append(rejected(run, decision, now, seconds, self.start_cost.startup_s()))
        for run_id, run in self.runs.items():
            gpus = reply.placement.gpus(run_id) if reply.allocation.get(run_id, 0) else ()
            if gpus:
                run.on_kind(kind_of(self.topology, gpus[0]))
            run.retarget(gpus)
        for run_id, finish in reply.projected_finish.items():
            if run_id in self.runs:
                self.runs[run_id].planned(finish)
        self.wake_at = reply.wake_at
        return actions

    # -- views -------------------------------------------------------------------
    def _reserved_gpus(self) -> set[int]:
        return {g for gpus in self.reserved.values() for g in gpus}

    def teams(self) -> list[TeamUse]:
        """Each team's share and what it holds, on a cluster shared by teams ([] otherwise)."""
        return self.policy.used() if isinstance(self.policy, TeamsPolicy) else []

    def free_block(self, largest: int, kind: str | None = None) -> tuple[int, ...]:
        """The largest aligned power-of-two block of at most `largest` GPUs
        (of `kind`, if given) that nobody holds, is placed on or has
        reserved: () if none."""
        topology = self.topology
        pools = [(p.first_gpu, p.topology.num_gpus) for p in topology.pools if kind in (None, p.kind)] \
            if isinstance(topology, MixedTopology) else [(0, topology.num_gpus)] if kind in (None, "") else []
        return free_block(self.runs.values(), self._reserved_gpus(), pools, largest) if pools else ()

    def gpu_map(self) -> dict[int, str]:
        """Who holds each GPU: a run's id, or `service:<what>`."""
        held = {g: r.run_id for r in self.runs.values() for g in r.held}
        held.update({g: f"service:{name}" for name, gpus in self.reserved.items() for g in gpus})
        return held

    def view(self, run_id: str, now: float) -> RunFacts | None:
        run = self._find(run_id)
        if run is None:
            return None
        return run.view(run.projected_finish(now), self.risk.margin_of(run))

    def views(self, now: float) -> list[RunFacts]:
        """Every run the loop knows, decided or not."""
        return [v for run_id in [*self.runs, *(r.run_id for r in self.arrivals)]
                if (v := self.view(run_id, now)) is not None]

    def sizes(self) -> dict[str, int]:
        """What it keeps, for the test that it does not grow with ended runs."""
        return {"runs": len(self.runs), "arrivals": len(self.arrivals), "gone": len(self.gone),
                "reserved": len(self.reserved)}
