"""A real Ray cluster of 2 nodes x 2 worker slots on loopback, for the whole
session of one test process: every test that takes `ray_address` shares the
xdist group "ray", so one process runs them all. Each test gets both nodes
alive: one that kills a node adds a fresh one afterwards. Ray is imported
only once a test asks for the cluster."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported: stay on loopback

from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

NODES, SLOTS = 2, 2


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    from scheduler_service.stack.ray_local import LocalRayCluster

    cluster = LocalRayCluster(NODES, SLOTS)
    yield cluster
    import ray

    ray.shutdown()
    cluster.shutdown()


def alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n["Alive"]]


@pytest.fixture
def ray_address(ray_cluster: Any) -> Iterator[str]:
    """The cluster's address, this process joined to it, with both nodes up."""
    from flows.training.ray_nodes import connect

    import ray

    connect(ray_cluster.address)
    while len(alive_nodes()) < NODES:
        ray_cluster.add_node()
    yield ray_cluster.address
    # Not connected between tests: a driver's threads print what the cluster
    # says (a dead node's errors...) into the output pytest captures for
    # whichever test this process runs next.
    ray.shutdown()
