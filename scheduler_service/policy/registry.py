"""Policies by name, for the simulator and the command line.

Baselines register themselves by living in `policy/baselines/`: every
SchedulingPolicy subclass with a `name` found there is listed, so adding a
baseline is adding one module.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Sequence

from scheduler_service.policy import baselines
from scheduler_service.policy.elasticflow import ElasticFlowNoAdmission, ElasticFlowPolicy
from scheduler_service.policy.interface import SchedulingPolicy
from scheduler_service.policy.overload import ElasticFlowOverload
from scheduler_service.policy.kinds import KindOrder, KindsPolicy
from scheduler_service.policy.teams import Team, TeamsPolicy
from scheduler_service.policy.topology import AnyTopology, MixedTopology


def _discover() -> dict[str, type[SchedulingPolicy]]:
    found: dict[str, type[SchedulingPolicy]] = {
        ElasticFlowPolicy.name: ElasticFlowPolicy, ElasticFlowNoAdmission.name: ElasticFlowNoAdmission,
        ElasticFlowOverload.name: ElasticFlowOverload,
    }
    for info in sorted(pkgutil.iter_modules(baselines.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{baselines.__name__}.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, SchedulingPolicy) and cls.__module__ == module.__name__ and "name" in cls.__dict__:
                found[cls.name] = cls
    return found


POLICIES: dict[str, type[SchedulingPolicy]] = _discover()

# The one default: the service plans with it, and `elasticflow simulate`,
# `reproduce` and the benches show it first. The paper's policy stays
# available by name (`elasticflow`) for the reproduction.
DEFAULT_POLICY: str = ElasticFlowOverload.name


def make_policy(name: str, topology: AnyTopology, interval: float = 60.0, *, kind_moves: bool = False,
                kind_order: KindOrder = KindOrder.SLOWEST_FIRST, teams: Sequence[Team] = (),
                **options: object) -> SchedulingPolicy:
    """Build a policy; `options` are policy-specific (see simulator/options.py).
    On a cluster of several GPU kinds, the policy plans each kind and
    `KindsPolicy` chooses the kind of each job (`kind_order`: which first;
    `kind_moves`: whether it may move an admitted job to another kind to
    admit a newcomer). With `teams`, each team's runs are admitted on its
    share and what it does not use is lent (teams.py)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    if teams:
        if isinstance(topology, MixedTopology):
            raise ValueError("teams on a cluster of several GPU kinds are not supported yet")
        return TeamsPolicy(topology, teams, lambda share: factory(share, interval=interval, **options))
    if isinstance(topology, MixedTopology):
        return KindsPolicy(topology, lambda pool: factory(pool, interval=interval, **options), kind_order,
                           moves=kind_moves)
    return factory(topology, interval=interval, **options)
