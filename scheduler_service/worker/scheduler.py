"""The service's scheduling loop, without Prefect: the pure policy decides,
this module keeps track of who physically holds which GPU and turns the
policy's placement into launches and control-channel commands.

Two facts drive it:

- The policy is asked at most once per slot (`interval` seconds), at slot
  boundaries, with every active job's status (remaining iterations from the
  run's `status.json`, GPUs it runs on, restart still being paid).
- A GPU goes to a new holder only after its old holder released it. A running
  run's GPUs count as held until it acknowledges the command that gives them
  up (`ack.json`); a run told to grow keeps its old GPUs and claims the new
  ones at once. A run whose new set is not free yet keeps running where it is,
  unless another run waits for its GPUs: then it is parked (checkpoints and
  holds nothing) until its new set is free. Parking needs nothing from anyone,
  so no cycle of runs waiting on each other can form.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

from flows.training.control import GpuSlot

from scheduler_service.contracts import AllocationAction
from scheduler_service.policy import Decision, JobStatus, SchedulingPolicy, SchedulingRequest
from scheduler_service.policy.jobs import floor_pow2
from scheduler_service.worker.run_state import Phase, RunState, plan_deadline_mid_slot

class ActionKind(str, Enum):
    """What the worker must do: the first four are allocation changes (and
    rows of the run's history), AWAIT shows a run not launched yet as waiting."""

    LAUNCH = AllocationAction.LAUNCH.value
    RESCALE = AllocationAction.RESCALE.value
    PARK = AllocationAction.PARK.value
    RELEASED = AllocationAction.RELEASED.value
    AWAIT = "await"

    @property
    def allocation(self) -> AllocationAction | None:
        return None if self is ActionKind.AWAIT else AllocationAction(self.value)


@dataclass(frozen=True, slots=True)
class Action:
    """What the worker must do to Prefect: launch a run, or show it waiting."""

    run_id: str
    kind: ActionKind
    gpus: tuple[int, ...] = ()


@dataclass(slots=True)
class PlanResult:
    decisions: list[Decision]
    allocation: dict[str, int]
    projected_finish: dict[str, float]
    seconds: float  # wall time of the policy call
    arrivals: dict[str, RunState] = field(default_factory=dict)  # the runs these decisions are about
    downgraded: list[RunState] = field(default_factory=list)  # guaranteed before, best-effort now


@dataclass
class Scheduler:
    policy: SchedulingPolicy
    runs: dict[str, RunState] = field(default_factory=dict)
    arrivals: list[RunState] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    last_slot: int | None = None
    # GPUs held by the service itself (profiling a new model): no run is
    # launched or grown onto them until they are given back.
    reserved: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Where GPU ids are, for a command on a cluster of several machines (None: this one).
    locate: Callable[[tuple[int, ...]], list[GpuSlot] | None] = field(default=lambda gpus: None)

    # -- inputs ----------------------------------------------------------------
    def arrive(self, run: RunState) -> None:
        self.arrivals.append(run)

    def adopt(self, run: RunState, running: bool = True, cancelled: bool = False) -> None:
        """A run an earlier life of the service admitted, found after a restart:
        running (it is re-planned with its real status and stays on its GPUs if
        its width holds) or still waiting for GPUs. If the policy no longer
        guarantees it, it carries on as best-effort: an admitted run is never
        rejected afterwards. A running one `cancelled` meanwhile is never planned:
        it is told to stop and holds its GPUs until it does."""
        run.adopted = True
        run.phase = Phase.RUNNING if running else Phase.WAITING
        if running and cancelled:
            self.runs[run.run_id] = run
            self.stop(run.run_id)
            return
        if running:
            self.policy.placer.hold(run.run_id, run.commanded or run.held)  # stay put if the width holds
        self.arrivals.append(run)

    def finish(self, run_id: str) -> None:
        """The run's flow process exited: every GPU it had is free."""
        run = self.runs.get(run_id)
        if run is None or run.phase == Phase.FINISHED:
            return
        run.phase, run.held, run.target, run.pending_seq = Phase.FINISHED, (), (), None
        self.finished.append(run_id)

    def withdraw(self, run_id: str) -> None:
        """A run not decided yet that is gone (rejected by the service, or
        cancelled before the policy saw it): it must not be planned."""
        self.arrivals = [run for run in self.arrivals if run.run_id != run_id]

    def stop(self, run_id: str) -> bool:
        """Tell a running run to checkpoint and end (it was cancelled). The policy
        forgets it at once (its deadline no longer holds anyone back), but its
        GPUs stay held until it acknowledges, as for a park, and no later command
        can supersede the stop. False if it is not running."""
        run = self.runs.get(run_id)
        if run is None or run.phase != Phase.RUNNING:
            return False
        if not run.stopping:
            run.pending_seq, run.stopping, run.target = run.channel.request("stop").seq, True, ()
            self.finished.append(run_id)
        return True

    # -- the policy: once per slot, and at once for arrivals -------------------
    def due(self, now: float) -> bool:
        return bool(self.arrivals) or self.last_slot is None or self.policy.clock.slot_of(now) > self.last_slot

    def status(self, now: float) -> dict[str, JobStatus]:
        """Where every run stands for a plan starting at the current slot's
        boundary: a plan made mid-slot credits the whole slot, so a running run's
        remaining work is put back where it was at the boundary."""
        elapsed = now - self.policy.clock.slot_of(now) * self.policy.clock.interval
        out = {}
        for run in [*self.runs.values(), *self.arrivals]:
            run_id = run.run_id
            if run.phase == Phase.FINISHED or run.stopping:
                continue
            status = run.status()
            done = status.iteration if status is not None else 0
            gpus = len(run.commanded) if run.phase == Phase.RUNNING else 0
            if status is not None and status.iterations_per_s and gpus and len(status.gpus) == gpus:
                run.observe_speed(status.iterations_per_s, gpus, run.job.curve.speed(gpus) / run.speed_ratio)
            overhead_left = max(0.0, self.policy.clock.overhead(gpus) - (now - run.since)) if gpus else 0.0
            since_boundary = run.job.curve.speed(gpus) * elapsed if gpus else 0.0
            out[run_id] = JobStatus(max(0.0, run.job.iterations - done + since_boundary), gpus, overhead_left)
        return out

    def plan(self, now: float) -> PlanResult | None:
        """Ask the policy, if a new slot has begun since the last time or runs
        have arrived: a user waits for the answer, and an admitted run should not
        wait for the next boundary to start."""
        if not self.due(now):
            return None
        self.last_slot = self.policy.clock.slot_of(now)
        arrivals, self.arrivals = self.arrivals, []
        elapsed = now - self.last_slot * self.policy.clock.interval
        for run in arrivals:  # planned from the boundary: what is gone of this slot is not theirs
            if not run.adopted and elapsed > 0 and run.deadline is not None:
                run.reserve_s = plan_deadline_mid_slot(run.reserve_s, elapsed)
                run.replan()
        finished, self.finished = self.finished, []
        status = self.status(now)
        started = time.perf_counter()
        reply = self.policy.schedule(
            SchedulingRequest(now=now, arrivals=[r.job for r in arrivals], finished=finished, status=status)
        )
        seconds = time.perf_counter() - started
        admitted = {d.job_id: d for d in reply.decisions if d.admitted}
        adopted = {run.run_id for run in arrivals if run.adopted}
        downgraded: list[RunState] = []
        for run in arrivals:
            if run.run_id in admitted:
                run.share = admitted[run.run_id].share
                self.runs[run.run_id] = run
            elif run.run_id in adopted:  # next slot, as best-effort
                if run.job.deadline is not None:
                    downgraded.append(run)
                run.plan_with(None)
                self.arrivals.append(run)
        for run_id in finished:
            if run_id in self.runs and self.runs[run_id].phase == Phase.FINISHED:  # a stopping run still holds GPUs
                del self.runs[run_id]
        for run_id, run in self.runs.items():
            gpus = reply.allocation.get(run_id, 0)
            run.target = reply.placement.gpus(run_id) if gpus else ()
        decisions = [d for d in reply.decisions if d.admitted or d.job_id not in adopted]
        return PlanResult(decisions, reply.allocation, reply.projected_finish, seconds,
                          {run.run_id: run for run in arrivals}, downgraded)

    # -- placement -> physical GPUs, every poll --------------------------------
    def actuate(self, now: float) -> list[Action]:
        actions: list[Action] = []
        active = [r for r in self.runs.values() if r.phase != Phase.FINISHED]
        for run in active:  # acknowledgements release what the run gave up
            if run.pending_seq is not None:
                ack = run.channel.acknowledged()
                if ack is not None and ack.seq >= run.pending_seq:
                    run.pending_seq, run.held = None, tuple(ack.gpus)
                    if not run.held:
                        actions.append(Action(run.run_id, ActionKind.RELEASED))

        def held_by_others(run: RunState) -> set[int]:
            return {g for r in active if r is not run for g in r.held} | self.reserved_gpus()

        def wanted_by_others(run: RunState) -> set[int]:
            return {g for r in active if r is not run for g in r.target}

        for run in [r for r in active if r.phase == Phase.RUNNING and r.pending_seq is None and not r.stopping]:
            if run.target == run.commanded or (run.commanded and self._not_worth_a_restart(run, run.target)):
                continue
            if run.target and not set(run.target) & held_by_others(run):
                self._command(run, run.target, now)
                run.held = tuple(sorted(set(run.held) | set(run.target)))
                actions.append(Action(run.run_id, ActionKind.RESCALE, run.target))
            elif run.commanded and (not run.target or set(run.commanded) & wanted_by_others(run)):
                if self._keeps_its_gpus(run, active):
                    continue
                self._command(run, (), now)
                actions.append(Action(run.run_id, ActionKind.PARK))
        for run in sorted((r for r in active if r.phase == Phase.WAITING), key=lambda r: (r.job.submit_time, r.run_id)):
            if run.target and not set(run.target) & held_by_others(run):
                run.phase, run.held = Phase.RUNNING, run.target
                self._command(run, run.target, now)
                actions.append(Action(run.run_id, ActionKind.LAUNCH, run.target))
            else:
                actions.append(Action(run.run_id, ActionKind.AWAIT, run.target))
        return actions

    @staticmethod
    def _keeps_its_gpus(run: RunState, active: list[RunState]) -> bool:
        """A deadline run is not parked for runs due later (earliest deadline
        first): the plan that parks it counts on it catching up later, and a
        run that is behind its profile (a busy machine) then misses, while the
        runs that wanted its GPUs had the slack to wait. Only a run due no
        later than it, or nobody, wanting its GPUs lets it be parked."""
        if run.deadline is None:
            return False
        wanting = [r for r in active if r is not run and set(r.target) & set(run.commanded)]
        return bool(wanting) and all(r.deadline is None or r.deadline > run.deadline for r in wanting)

    def _not_worth_a_restart(self, run: RunState, target: tuple[int, ...]) -> bool:
        """A resize costs a restart. One that would outlast what is left of the
        run's work where it is does nothing but delay it (and whoever waits for
        its GPUs waits less than that restart); a grow must also save more
        than the restart: 5 s from the end, a second GPU that adds 8% saves
        0.4 s and costs the restart, and the run finishes later than if left
        alone (a demo run ended 1 s before its deadline that way)."""
        curve, here, there = run.job.curve, len(run.commanded), len(target)
        speed = curve.speed(here) if here in curve.points else 0.0
        if speed <= 0:
            return False
        left_s = max(0.0, run.job.iterations - run.iterations_done()) / speed
        restart_s = self.policy.clock.overhead(max(1, there))
        if there > here and there in curve.points and curve.speed(there) > speed:
            return left_s * (1.0 - speed / curve.speed(there)) <= restart_s
        return left_s <= restart_s

    def _command(self, run: RunState, gpus: tuple[int, ...], now: float) -> None:
        command = run.channel.request("rescale", list(gpus), placement=self.locate(gpus) if gpus else None)
        run.pending_seq, run.commanded, run.since = command.seq, gpus, now

    # -- the cluster changed (a node joined, left or died) ----------------------
    def rebase(self, policy: SchedulingPolicy, mapping: dict[int, int]) -> list[RunState]:
        """Go on with `policy`, made for the new cluster; `mapping` takes each
        old GPU id that still exists to its new one. Every admitted run is
        re-planned as after a restart (adopted: never rejected, best-effort if
        no longer guaranteed). A run that lost GPUs with a node lost its ranks:
        it waits for a new placement, and the GPUs it had on the nodes left stay
        held until it acknowledges one. Returns those runs."""
        def moved(gpus: tuple[int, ...]) -> tuple[int, ...]:
            return tuple(sorted(mapping[g] for g in gpus if g in mapping))

        lost = []
        old_runs, old_arrivals = self.runs, self.arrivals
        self.policy, self.runs, self.arrivals, self.last_slot = policy, {}, [], None
        self.reserved = {name: moved(gpus) for name, gpus in self.reserved.items()
                         if len(moved(gpus)) == len(gpus)}
        for run in old_runs.values():
            whole = all(g in mapping for g in (*run.held, *run.commanded))
            run.held, run.target = moved(run.held), ()
            run.commanded = moved(run.commanded) if whole else ()
            if not whole:
                lost.append(run)
            if run.phase == Phase.FINISHED:
                continue
            if run.stopping:
                self.runs[run.run_id] = run  # told to stop: holds its GPUs until it has
                continue
            self.adopt(run, running=run.phase == Phase.RUNNING)
        for run in old_arrivals:
            if run.run_id not in {r.run_id for r in self.arrivals}:
                self.arrivals.append(run)
        return lost

    # -- the service's own use of GPUs ------------------------------------------
    def reserved_gpus(self) -> set[int]:
        return {g for gpus in self.reserved.values() for g in gpus}

    def free_block(self, num_gpus: int, largest: int) -> tuple[int, ...]:
        """The largest aligned power-of-two block, at most `largest` GPUs, that no
        run holds or is placed on and nothing reserved: () if none."""
        busy = self.reserved_gpus() | {g for r in self.runs.values() if r.phase != Phase.FINISHED
                                        for g in (*r.held, *r.target)}
        size = floor_pow2(min(largest, num_gpus))
        while size >= 1:
            for start in range(0, num_gpus - size + 1, size):
                if not busy & set(range(start, start + size)):
                    return tuple(range(start, start + size))
            size //= 2
        return ()

    # -- views -----------------------------------------------------------------
    def gpu_map(self) -> dict[int, str]:
        held = {g: r.run_id for r in self.runs.values() for g in r.held}
        held.update({g: f"service:{name}" for name, gpus in self.reserved.items() for g in gpus})
        return held
