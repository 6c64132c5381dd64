"""The service's own control loop, driven over a trace: the figure of the
system that runs.

`engine.simulate` asks the bare policy at slot boundaries and charges an
idealised restart (`--actuation ideal`). Here the trace drives
`scheduler_service.loop.ControlLoop`, the very object the Prefect worker
drives, with every rule the service adds (acknowledged hand-over of GPUs,
parking, keep and grow rules, the launch reserve and safety margin, decisions
at once mid-slot, speed observation), and a simulated backend plays the runs'
processes: a launch takes what the loop's own start-cost model says a start
takes; a resize stops at the next iteration boundary (the plans' stop
charge), acknowledges, and trains again once the restart is paid; a park
acknowledges and holds nothing. With `noise`, every delay and every
segment's speed are drawn around those (noise.py: a run's own speed error,
slow periods of nodes, starts that vary), from seeded generators.

The loop is stepped as the worker polls it: at every event (heard at the
next poll), and at every slot boundary while anything is in flight, except
those the loop says nothing could change at (`ControlLoop.quiet_until`:
every run on its straight line, its speeds learnt). Every live run reports
its progress at each boundary and with each arrival (when the loop may
plan), and at its own events; the worker reads every run at every poll,
which would only repeat the same straight line in between.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field

from scheduler_service.loop import ControlLoop, LoopSettings
from scheduler_service.loop.actions import Admitted, Command, Launch, Rejected, Stop
from scheduler_service.loop.events import Acknowledged, Arrived, Ended, Event, Progress
from scheduler_service.policy import Decision, Job, SchedulingPolicy
from scheduler_service.policy.overhead import PAPER_OVERHEAD, RestartOverhead, keeps_gpus
from scheduler_service.policy.topology import AnyTopology, kind_of
from scheduler_service.simulator.engine import DONE_FRACTION, Deadlock, JobRecord, Run, gpus_by_kind
from scheduler_service.simulator.noise import Noise, NoisyCluster

IDLE_SLOTS = 1000  # slots with runs waiting and nothing in flight or to come: a deadlock


class Actuation(BaseModel):
    """How the simulated backend plays the loop's commands."""

    model_config = ConfigDict(frozen=True)

    poll_s: float = Field(1.0, gt=0, description="the worker's poll: the loop hears of an event this late at most")
    noise: Noise = Field(Noise(), description="how the cluster departs from the profiles; the default: exact")
    arrivals_at_boundaries: bool = Field(
        False, description="runs arrive at the slot boundary after their submission, as the bare engine takes "
        "them, instead of at the next poll (to tell the two apart in bench/actuation.py)")
    every_boundary: bool = Field(
        False, description="step the loop at every slot boundary while runs live, as the worker polls it; by "
        "default the boundaries at which the loop says nothing could change are skipped (the same decisions, "
        "checked by tests/simulator/test_service_engine.py)")


class ServiceOptions(BaseModel):
    """The service's settings a simulation of it takes: its loop's and its backend's."""

    model_config = ConfigDict(frozen=True)

    # The service's own default, from its one home (LoopSettings), so that a simulation of the service plans as
    # the service does unless told otherwise.
    safety_margin: float = Field(LoopSettings().safety_margin, ge=0, lt=0.5)
    launch_s: float | None = Field(None, ge=0, description="a new run's start; None: learnt, as the service does")
    in_place_s: float | None = Field(None, ge=0, description="a resize in place, in place of the restart's "
                                     "restart_s; None: every resize costs a restart")
    actuation: Actuation = Actuation()
    defend: bool = Field(True, description="the loop's defenses against noise (LoopSettings.defend); off: the "
                                           "loop as it was, the baseline of bench/noise.py")

    def loop(self, policy: str, interval_s: float, overhead: RestartOverhead = PAPER_OVERHEAD) -> LoopSettings:
        if self.in_place_s is not None:
            overhead = replace(overhead, in_place_s=self.in_place_s)
        return LoopSettings(policy=policy, interval_s=interval_s, overhead=overhead, poll_s=self.actuation.poll_s,
                            launch_s=self.launch_s, safety_margin=self.safety_margin, defend=self.defend)


@dataclass(slots=True)
class Process:
    """One run's flow process as the backend plays it."""

    record: JobRecord
    gpus: tuple[int, ...] = ()  # the set it trains on, once `productive_from` has come
    held: int = 0  # GPUs it holds (counted for GPU-seconds)
    productive_from: float = math.inf
    speed: float = 0.0  # iterations/s while productive, on GPUs at their normal speed
    done: float = 0.0  # iterations, as of `since`
    since: float = 0.0
    alive: bool = False
    finish_at: float | None = None  # when it will have done them all, at its speed
    kind: str = ""  # of its GPU set, on a mixed cluster
    wake_at: float | None = None  # the poll that sees its speed change (a slow period of its nodes)

    def advance(self, now: float, cluster: NoisyCluster | None = None) -> None:
        """Train from `since` to `now` (at the pace of its slowest GPU), and count the GPUs held meanwhile."""
        if now <= self.since:
            return
        self.record.gpu_seconds += self.held * (now - self.since)
        if self.kind:
            seconds = self.record.kind_seconds
            seconds[self.kind] = seconds.get(self.kind, 0.0) + self.held * (now - self.since)
        start = max(self.since, self.productive_from)
        if self.gpus and now > start:
            work, t = 0.0, start
            changes = cluster.changes_between(self.gpus, start, now) if cluster is not None else []
            for end in [*changes, now]:
                work += self.speed * (end - t) * (cluster.slowdown(self.gpus, t) if cluster is not None else 1.0)
                t = end
            self.done = min(self.record.job.iterations, self.done + work)
        self.since = now

    @property
    def finished(self) -> bool:
        return self.done >= self.record.job.iterations * (1 - DONE_FRACTION)


class Backend:
    """The runs' processes: commands take the time a real one would, runs train and finish."""

    def __init__(self, settings: LoopSettings, speed_of: Callable[[Job, int], float], launch_s: float,
                 actuation: Actuation, kind_of: Callable[[int], str] = lambda gpu: "", gpus_per_node: int = 8) -> None:
        self.kind_of = kind_of
        self.overhead = settings.overhead  # a run's own restart, as it really takes (the plans charge more)
        self.speed_of = speed_of  # the policy's: it may change how a job trains (Pollux's batch size)
        self.launch_s = launch_s  # the start-cost model's: a new run takes at least this to train
        self.actuation = actuation
        self.cluster = NoisyCluster(actuation.noise, gpus_per_node)
        self.processes: dict[str, Process] = {}
        self.alive: dict[str, Process] = {}  # launched and not ended: the only ones that change
        self._events: list[tuple[float, int, str, Event | None]] = []  # (the poll that hears of it, order, run, event)
        self._order = 0
        self._touched: set[str] = set()  # runs with an event heard at this step: they report

    # -- time -----------------------------------------------------------------
    def heard_at(self, when: float) -> float:
        """The first poll at or after `when`."""
        poll = self.actuation.poll_s
        return math.ceil(when / poll - 1e-9) * poll

    def later(self, when: float, run_id: str, event: Event | None) -> None:
        """The loop hears of `event` at the first poll from `when` (None: a poll that sees the run's progress)."""
        self._order += 1
        heapq.heappush(self._events, (self.heard_at(when), self._order, run_id, event))

    def next_at(self) -> float | None:
        return self._events[0][0] if self._events else None

    def due(self, now: float) -> list[Event]:
        out = []
        while self._events and self._events[0][0] <= now + 1e-9:
            _, _, run_id, event = heapq.heappop(self._events)
            self._touched.add(run_id)
            if event is not None:
                out.append(event)
        return out

    # -- commands ---------------------------------------------------------------
    def carry_out(self, command: Command, now: float) -> None:
        process = self.processes[command.run_id]
        process.advance(now, self.cluster)
        stop_at = now + self.overhead.stop_s
        if isinstance(command, Stop):
            process.gpus, process.productive_from, process.finish_at = (), math.inf, None
            self.later(stop_at, command.run_id, Acknowledged(command.run_id, command.seq, ()))
            self.later(stop_at, command.run_id, Ended(command.run_id))
            process.alive = False
            self.alive.pop(command.run_id, None)
            return
        if not command.gpus:  # parked: checkpoints at the next boundary and holds nothing once it says so
            process.gpus, process.productive_from, process.finish_at = (), math.inf, None
            self.later(stop_at, command.run_id, Acknowledged(command.run_id, command.seq, ()))
            return
        gpus = len(command.gpus)
        if isinstance(command, Launch):
            delay = max(self.launch_s, self.overhead(gpus)) * self.cluster.start_factor(command.run_id)
            process.alive, process.held = True, gpus
            self.alive[command.run_id] = process
            # The flow process applies its first command, then starts its ranks.
            self.later(now + max(0.0, delay - (self.overhead(gpus) - self.overhead.stop_s)), command.run_id,
                       Acknowledged(command.run_id, command.seq, command.gpus))
        else:  # a resize: it claims the new set now, keeps the old one until it acknowledges
            in_place = keeps_gpus(process.gpus, command.gpus)
            delay = (self.overhead.in_place(gpus) if in_place else self.overhead(gpus)) \
                * self.cluster.start_factor(command.run_id)
            process.held = len(set(command.gpus) | set(process.gpus))
            self.later(stop_at, command.run_id, Acknowledged(command.run_id, command.seq, command.gpus))
        process.gpus = command.gpus
        process.speed = self.speed_of(process.record.job, gpus) * self.cluster.segment_factor(command.run_id)
        process.kind = self.kind_of(command.gpus[0]) if command.gpus else ""
        process.productive_from, process.finish_at, process.wake_at = now + delay, None, None
        first_iteration = process.productive_from + 1.0 / max(process.speed, 1e-9)
        self.later(first_iteration, command.run_id, None)  # seen
        record = process.record
        record.restarts += 1
        record.peak_gpus = max(record.peak_gpus, gpus)
        record.start = now if record.start is None else record.start

    def acknowledged(self, event: Acknowledged, now: float) -> None:
        process = self.processes[event.run_id]
        process.advance(now, self.cluster)
        process.held = len(event.gpus)

    def observe(self, now: float, everyone: bool) -> list[Event]:
        """What the live runs say on their channels now (every one, or those
        with an event at this step); the runs that finished."""
        out: list[Event] = []
        touched, self._touched = self._touched, set()
        for run_id, process in [(r, p) for r, p in self.alive.items() if everyone or r in touched]:
            process.advance(now, self.cluster)
            if process.finished:
                process.alive, process.held = False, 0
                del self.alive[run_id]
                process.record.finish = process.finish_at if process.finish_at is not None else now
                out.append(Ended(run_id))
                continue
            productive = bool(process.gpus) and now >= process.productive_from
            speed = process.speed * self.cluster.slowdown(process.gpus, now)
            out.append(Progress(run_id, int(process.done + 1e-6), process.gpus, speed if productive else None))
            if productive:  # a poll when it will be done at this speed, or when its speed changes before that
                finish = now + (process.record.job.iterations - process.done) / speed
                if process.finish_at is None or abs(finish - process.finish_at) > 1e-3:
                    process.finish_at = finish
                    self.later(finish, run_id, None)
                change = next(iter(self.cluster.changes_between(process.gpus, now, finish)), None)
                if change is not None and change != process.wake_at:
                    process.wake_at = change
                    self.later(change, run_id, None)
        return out

    def in_use(self) -> int:
        return sum(p.held for p in self.alive.values())

    def busy(self) -> bool:
        return bool(self._events) or bool(self.alive)


def simulate_service(jobs: Sequence[Job], topology: AnyTopology, settings: LoopSettings,
                     actuation: Actuation = Actuation(),
                     policy_for: Callable[[AnyTopology], SchedulingPolicy] | None = None,
                     on_progress: Callable[[int, int], None] | None = None) -> Run:
    """Every job through the service's control loop; what happened to each."""
    started = time.perf_counter()
    loop = ControlLoop(topology, settings, policy_for)
    policy, clock = loop.policy, loop.policy.clock
    backend = Backend(settings, policy.speed, loop.start_cost.launch_s, actuation,
                      lambda gpu: kind_of(topology, gpu), getattr(topology, "gpus_per_node", 8))
    def heard(job: Job) -> float:
        if actuation.arrivals_at_boundaries:
            return clock.slot_after(job.submit_time) * clock.interval
        return backend.heard_at(job.submit_time)

    pending = sorted(jobs, key=lambda j: (heard(j), j.job_id))
    records = {job.job_id: JobRecord(job, remaining=job.iterations) for job in pending}
    for job in pending:
        backend.processes[job.job_id] = Process(records[job.job_id], since=job.submit_time)
    usage: list[tuple[float, int]] = []
    next_arrival, n, steps, idle_since = 0, len(pending), 0, None
    now = heard(pending[0]) if pending else 0.0

    while next_arrival < n or loop.live() or backend.busy():
        steps += 1
        events = backend.due(now)
        arrived = next_arrival
        while next_arrival < n and heard(pending[next_arrival]) <= now + 1e-9:
            job = pending[next_arrival]
            events.append(Arrived(job.job_id, job, job.submit_time))
            next_arrival += 1
        boundary = abs(now - clock.slot_of(now) * clock.interval) < 1e-6
        events += backend.observe(now, everyone=boundary or next_arrival > arrived)
        for event in events:
            if isinstance(event, Acknowledged):
                backend.acknowledged(event, now)
        for action in loop.tick(events, now):  # as the worker drives it (worker.decide)
            if isinstance(action, Command):
                backend.carry_out(action, now)
            elif isinstance(action, (Admitted, Rejected)):
                records[action.run_id].decision = _decision(action)
        in_use = backend.in_use()
        if not usage or usage[-1][1] != in_use:
            usage.append((now, in_use))
        if on_progress is not None:
            on_progress(next_arrival, n)
        if loop.live() and not backend.busy() and next_arrival >= n:
            idle_since = now if idle_since is None else idle_since
            if now - idle_since > IDLE_SLOTS * clock.interval:
                raise Deadlock(f"{policy.name}: {loop.live()} runs wait at t={now:.0f}s with nothing running")
        else:
            idle_since = None
        candidates = [t for t in (backend.next_at(),) if t is not None]
        if next_arrival < n:
            candidates.append(heard(pending[next_arrival]))
        if loop.live():
            # the next slot's plan: the boundary after this slot (slot_after(now + 1e-6) was `now` again
            # a few times per slot late in a trace, its tolerance growing with the slot number)
            candidates.append(_next_look(loop, clock.slot_of(now) + 1, clock.interval, now, actuation.every_boundary,
                                         next((t for t in (backend.next_at(),) if t is not None), math.inf)))
        if not candidates:
            break
        now = max(min(candidates), now + 1e-6)

    return Run(policy.name, list(records.values()), usage, topology.num_gpus, time.perf_counter() - started, steps,
               gpus_by_kind(topology))


def _next_look(loop: ControlLoop, slot: int, interval: float, now: float, every_boundary: bool,
               event_at: float) -> float:
    """The boundary of `slot`, or a later one while the loop stays quiet:
    the last boundary a slot short of the time it names (a crossing it
    computes in continuous time is never skipped by rounding), and never past
    the idle limit (a deadlock is still found). Never past the boundary
    that begins the slot of the backend's next event either: the loop looks
    at the first step of each slot (at its boundary, as the worker's first
    poll in it), not at an event's step in the middle of it (an arrival is
    planned for at once wherever it lands: its slot's boundary may go)."""
    if every_boundary or event_at <= (slot + 1) * interval:
        return slot * interval
    quiet = min(loop.quiet_until(now), now + IDLE_SLOTS * interval)
    look = math.floor(quiet / interval) - 1
    if event_at < math.inf:
        look = min(look, math.floor(event_at / interval + 1e-9))
    return max(slot, look) * interval


def _decision(action: Admitted | Rejected) -> Decision:
    """The decision as a policy's reply would say it, for the per-job tables."""
    if isinstance(action, Admitted):
        return Decision(job_id=action.run_id, admitted=True, guaranteed=action.guaranteed, message=action.message,
                        share=action.share, guaranteed_finish=action.guaranteed_finish)
    return Decision(job_id=action.run_id, admitted=False, reason=action.reason, message=action.message,
                    earliest_feasible_deadline=action.earliest_feasible_deadline)
