"""Policies by name, for the simulator and the command line."""

from __future__ import annotations

from typing import Callable

from scheduler_service.policy.baselines.edf import EDFAdmitPolicy, EDFPolicy
from scheduler_service.policy.elasticflow import ElasticFlowNoAdmission, ElasticFlowPolicy
from scheduler_service.policy.interface import SchedulingPolicy
from scheduler_service.policy.topology import Topology

PolicyFactory = Callable[..., SchedulingPolicy]

POLICIES: dict[str, PolicyFactory] = {
    cls.name: cls for cls in (ElasticFlowPolicy, ElasticFlowNoAdmission, EDFPolicy, EDFAdmitPolicy)
}


def make_policy(name: str, topology: Topology, interval: float = 60.0) -> SchedulingPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
    return factory(topology, interval=interval)
