"""What the control loop decides with, read once into one typed model, and
the policy it plans with, made from it. The defaults here are the
service's: the worker's settings (worker/settings.py) and the simulator's
options (simulator/service.py) take theirs from these."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict

from scheduler_service.loop.speeds import MarginRule
from scheduler_service.policy import SchedulingPolicy, make_policy
from scheduler_service.policy.overhead import RestartOverhead
from scheduler_service.policy.registry import DEFAULT_POLICY
from scheduler_service.policy.teams import Team
from scheduler_service.policy.topology import AnyTopology


class LoopSettings(BaseModel):
    """What the loop decides with, read once: the service's settings, or the
    simulator's options. The defaults here are the service's: the worker's
    settings (worker/settings.py) and the simulator's options
    (simulator/service.py) take theirs from these, so a simulation of the
    service plans as the service does unless told otherwise."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    policy: str = DEFAULT_POLICY
    interval_s: float = 5.0
    overhead: RestartOverhead = RestartOverhead()  # a run's own restart: stop, start on the new set
    poll_s: float = 1.0  # the driver's poll: a GPU one run gives up is handed on at the next one
    launch_s: float | None = None  # a new run's start; None: learnt from the starts seen
    safety_margin: float = 0.05  # fraction of a run's window kept in front of its deadline (at least a slot)
    at_risk_s: float = 60.0  # a deadline is at risk when the projection comes this close (at least a slot)
    teams: tuple[Team, ...] = ()  # teams sharing the cluster, each with its guaranteed share (policy/teams.py)
    # Its defenses against a cluster slower or faster than the profiles (speeds.py): runs planned at the
    # speed they show, a margin learnt from the speed errors seen (`safety_margin` until enough are), a run
    # told at once that its guarantee is lost. Off: the loop as it was, the baseline of bench/noise.py.
    defend: bool = True
    margin_rule: MarginRule = MarginRule()

    @property
    def charged(self) -> RestartOverhead:
        """What the plans charge for a change of GPU set: the run's own
        restart, and the hand-over before it: the GPUs' previous holder stops
        and acknowledges, and the next poll gives them on. Charged on every
        change, so a plan holds however its GPUs come free (uncharged, the
        hand-overs of 43 resizes made an admitted run of dev105 miss)."""
        own = self.overhead
        return RestartOverhead(stop_s=2 * own.stop_s + self.poll_s, restart_s=own.restart_s,
                               per_level_s=own.per_level_s, in_place_s=own.in_place_s)


def policy_maker(settings: LoopSettings, **options: object) -> Callable[[AnyTopology], SchedulingPolicy]:
    """The policy for a topology, made anew when the cluster changes."""
    return lambda topology: make_policy(settings.policy, topology, interval=settings.interval_s,
                                        overhead=settings.charged, teams=settings.teams, **options)
