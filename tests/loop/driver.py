"""A minimal driver of the control loop for tests: it keeps the last command
each run was given and acknowledges it when told, as a run's flow would."""

from __future__ import annotations

from typing import TypeVar

from scheduler_service.loop import ControlLoop, LoopSettings
from scheduler_service.loop.actions import Action, Command
from scheduler_service.loop.events import Acknowledged, Arrived, Event, Progress
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
