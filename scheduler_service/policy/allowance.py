"""The migration allowance: slack plans carry for restarts nobody planned.

Placement sometimes moves a job that kept its width (fragmentation), and a
move costs a restart its plan did not pay for. Three strategies of the
ElasticFlow policy decide how that is absorbed: how much slack a new plan
carries, how much of it a re-planned job keeps, and which jobs placement
spares because they have too little left. The shipped ones are what keeps
every admitted job on time (docs/scheduling.md, "Why admitted jobs meet
their deadlines"); the others are the ablation's variants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

from scheduler_service.policy.admission import migration_allowance
from scheduler_service.policy.jobs import Job
from scheduler_service.policy.plan import SlotClock


class MigrationAllowance(Protocol):
    """Iterations of slack a new plan carries beyond the job's work."""

    def iterations(self, job: Job, levels: tuple[int, ...], clock: SlotClock) -> float: ...


@dataclass(frozen=True, slots=True)
class OneRestart:
    """What one unplanned restart costs the job at its costliest level, so a
    single migration never breaks its plan (shipped)."""

    def iterations(self, job: Job, levels: tuple[int, ...], clock: SlotClock) -> float:
        return migration_allowance(job, levels, clock)


@dataclass(frozen=True, slots=True)
class NoAllowance:
    """No slack: admits more, but a migration can make an admitted job miss
    (9-534 of them on six of the eleven ablation traces)."""

    def iterations(self, job: Job, levels: tuple[int, ...], clock: SlotClock) -> float:
        return 0.0


class ReplanSlack(Protocol):
    """Slack an admitted job's new plan must carry when everyone is re-planned,
    given its allowance and what its current plan covers beyond its work."""

    def slack(self, allowance: float, surplus: float) -> float: ...


@dataclass(frozen=True, slots=True)
class KeepWhatIsLeft:
    """The slack its plan still has, at most the allowance: a re-plan never
    asks more of a job than its current plan gives, so an admitted job never
    makes a re-plan fail (shipped)."""

    def slack(self, allowance: float, surplus: float) -> float:
        return min(allowance, max(0.0, surplus))


@dataclass(frozen=True, slots=True)
class KeepFullAllowance:
    """The whole allowance again: more protection for jobs already moved, less
    room for the newcomer the re-plan is for."""

    def slack(self, allowance: float, surplus: float) -> float:
        return allowance


class PlacementTiers(Protocol):
    """Which guaranteed jobs placement moves last (`pinned`) and next to last
    (`fragile`), from `cannot_afford(n)`: the jobs whose plan would not
    survive n more unplanned restarts now."""

    def split(self, cannot_afford: Callable[[int], set[str]]) -> tuple[set[str], set[str]]: ...


@dataclass(frozen=True, slots=True)
class PinnedAndFragile:
    """Jobs that cannot afford one restart are moved only if nothing else
    works, those that can afford one but not two only after all others: one
    moved every time fragmentation strikes would spend its allowance a move
    at a time, and the last move would make it miss (shipped)."""

    def split(self, cannot_afford: Callable[[int], set[str]]) -> tuple[set[str], set[str]]:
        pinned = cannot_afford(1)
        return pinned, cannot_afford(2) - pinned


@dataclass(frozen=True, slots=True)
class PinnedOnly:
    """Only jobs that cannot afford one restart are spared (ablation variant 7)."""

    def split(self, cannot_afford: Callable[[int], set[str]]) -> tuple[set[str], set[str]]:
        return cannot_afford(1), set()


ONE_RESTART = OneRestart()
NO_ALLOWANCE = NoAllowance()
KEEP_WHAT_IS_LEFT = KeepWhatIsLeft()
KEEP_FULL_ALLOWANCE = KeepFullAllowance()
PINNED_AND_FRAGILE = PinnedAndFragile()
PINNED_ONLY = PinnedOnly()
