"""A minimal driver of the control loop for tests: it keeps the last command
each run was given and acknowledges it when told, as a run's flow would."""

from __future__ import annotations

from typing import TypeVar

from scheduler_service.loop import ControlLoop, LoopSettings
from scheduler_service.loop.actions import Action, Command
from scheduler_service.loop.events import Acknowledged, Arrived, Ended, Event, Progress
from scheduler_service.policy import Job, ThroughputCurve, Topology
from scheduler_service.policy.overhead import RestartOverhead

A = TypeVar("A")
T0 = 1000.0
CURVE = ThroughputCurve({1: 20.0, 2: 36.0})
# A slot of 2 s and a 1 s restart charged (a 0.25 s stop, the previous
# holder's 0.25 s stop, 0.5 s to start; no poll): the service's shape, shrunk.
# No safety margin beyond the slot: the tests count the seconds a plan keeps.
SETTINGS = LoopSettings(policy="elasticflow", interval_s=2.0, overhead=RestartOverhead(0.25, 0.5, 0.0),
                        poll_s=0.0, launch_s=1.0, safety_margin=0.0)


def job(run_id: str, submit: float, iterations: float, deadline: float | None,
        curve: ThroughputCurve = CURVE) -> Job:
    return Job(run_id, submit, iterations, deadline, curve)


class Driver:
    def __init__(self, gpus: int = 2, settings: LoopSettings = SETTINGS, nodes: int = 1) -> None:
        self.loop = ControlLoop(Topology(1, nodes, gpus), settings)
        self.commands: dict[str, Command] = {}
        self.log: list[Action] = []

    def handle(self, event: Event, now: float) -> list[Action]:
        return self._seen(self.loop.handle(event, now))

    def arrive(self, job: Job, now: float | None = None) -> None:
        self.handle(Arrived(job.job_id, job, job.submit_time if now is None else now), job.submit_time)

    def step(self, now: float) -> list[Action]:
        return self._seen(self.loop.step(now))

    def kinds(self, now: float) -> dict[str, list[str]]:
        """The step's actions, by run: their type names in order."""
        out: dict[str, list[str]] = {}
        for action in self.step(now):
            out.setdefault(action.run_id, []).append(type(action).__name__)
        return out

    def ack(self, run_id: str, now: float, iteration: int = 0) -> list[Action]:
        command = self.commands[run_id]
        gpus = () if command.channel_action == "stop" else command.gpus
        return self.handle(Acknowledged(run_id, command.seq, gpus), now)

    def report(self, run_id: str, now: float, iteration: int, gpus: tuple[int, ...] = (),
               rate: float | None = None) -> list[Action]:
        return self.handle(Progress(run_id, iteration, gpus, rate), now)

    def new(self, actions: list[Action], kind: type[A]) -> dict[str, A]:
        """Those of `actions` of one kind, by run."""
        return {a.run_id: a for a in actions if isinstance(a, kind)}

    def _seen(self, actions: list[Action]) -> list[Action]:
        for action in actions:
            if isinstance(action, Command):
                self.commands[action.run_id] = action
        self.log += actions
        return actions


class Cluster:
    """Runs training as a cluster would play them for the loop: each at its
    own factor of its profile (`factor`, by run), on the GPUs its last
    acknowledged command gave it, after a restart of `restart_s`; every
    command acknowledged at once, progress reported every `tick_s`, and an
    end when a run is done."""

    def __init__(self, driver: Driver, factor: dict[str, float], restart_s: float = 1.0, tick_s: float = 0.5) -> None:
        self.d, self.factor, self.restart_s, self.tick_s = driver, factor, restart_s, tick_s
        self.done: dict[str, float] = {}
        self.gpus: dict[str, tuple[int, ...]] = {}
        self.productive_from: dict[str, float] = {}
        self.seq: dict[str, int] = {}
        self.finished: dict[str, float] = {}
        self.widths: dict[str, list[int]] = {}

    def play(self, jobs: dict[str, Job], start: float, until: float) -> None:
        now = start
        while now <= until and len(self.finished) < len(jobs):
            for run_id, command in list(self.d.commands.items()):
                if run_id in self.finished or self.seq.get(run_id) == command.seq:
                    continue
                self.seq[run_id] = command.seq
                self.d.ack(run_id, now)
                gpus = () if command.channel_action == "stop" else command.gpus
                self.gpus[run_id], self.productive_from[run_id] = gpus, now + self.restart_s
                self.widths.setdefault(run_id, []).append(len(gpus))
            for run_id, gpus in self.gpus.items():
                if run_id in self.finished or not gpus:
                    continue
                curve = jobs[run_id].curve
                rate = curve.speed(len(gpus)) * self.factor.get(run_id, 1.0)
                if now >= self.productive_from[run_id]:
                    self.done[run_id] = self.done.get(run_id, 0.0) + rate * self.tick_s
                if self.done.get(run_id, 0.0) >= jobs[run_id].iterations:
                    self.finished[run_id] = now
                    self.d.handle(Ended(run_id), now)
                    continue
                productive = now >= self.productive_from[run_id]
                self.d.report(run_id, now, int(self.done.get(run_id, 0.0)), gpus, rate if productive else None)
            self.d.step(now)
            now += self.tick_s
