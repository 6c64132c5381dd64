"""The control loop: every decision the service makes, Prefect-free, driven
by the Prefect worker and by the simulator alike (loop.py)."""

from scheduler_service.loop import actions, events
from scheduler_service.loop.deadlines import NO_MARGIN, SafetyMargin
from scheduler_service.loop.loop import ControlLoop
from scheduler_service.loop.settings import LoopSettings, policy_maker
from scheduler_service.loop.run import RunFacts

__all__ = ["ControlLoop", "LoopSettings", "NO_MARGIN", "RunFacts", "SafetyMargin", "actions", "events",
           "policy_maker"]
