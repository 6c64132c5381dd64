"""A real Ray cluster of 2 nodes x 2 worker slots on loopback, for the whole
session of one test process (the tests share an xdist group, so one process
runs them all). Each test gets both nodes alive: one that kills a node adds a
fresh one afterwards."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before ray is imported: stay on loopback

from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

import pytest  # noqa: E402

from flows.training.params import TrainParameters  # noqa: E402
from scheduler_service.stack.ray_local import LocalRayCluster  # noqa: E402
from tests.runtime.conftest import small_mlp  # noqa: E402

NODES, SLOTS = 2, 2
REL_TOL = 1e-4


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/cluster/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.xdist_group("ray"))
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[LocalRayCluster]:
    cluster = LocalRayCluster(NODES, SLOTS)
    yield cluster
    import ray

    ray.shutdown()
    cluster.shutdown()


def alive_nodes() -> list[dict[str, Any]]:
    import ray

    return [n for n in ray.nodes() if n["Alive"]]


@pytest.fixture
def ray_address(ray_cluster: LocalRayCluster) -> Iterator[str]:
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


@pytest.fixture(autouse=True)
def elasticflow_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("ELASTICFLOW_HOME", str(home))
    return home


@pytest.fixture
def make_params(tmp_path: Path, ray_address: str) -> Callable[..., TrainParameters]:
    """The runtime tests' small MLP on the cluster, 60 iterations, a checkpoint every 5."""
    return lambda **overrides: small_mlp(tmp_path, **{"iterations": 60, "checkpoint_interval": 5,
                                                      "ray_address": ray_address, **overrides})


def assert_same_losses(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
    assert worst <= REL_TOL, f"largest relative loss difference {worst:.2e}"


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """300 iterations on one local slot (no Ray), never resized: every run
    on the cluster must reproduce its loss at every iteration (shorter ones,
    its start)."""
    from flows.training.coordinator.runtime import run_training

    root = tmp_path_factory.mktemp("reference")
    params = TrainParameters(
        model="mlp", hyperparameters={"global_batch_size": 30, "max_micro_batch": 4, "learning_rate": 0.01},
        iterations=300, checkpoint_interval=1000, checkpoint_store=str(root / "ck"),
        control_dir=str(root / "ctl"), device="cpu")
    return run_training(params, "reference").losses
