"""The tests of runs on a real Ray cluster (tests/ray_cluster.py: 2 nodes x
2 worker slots on loopback, one per test process). They share an xdist
group, so one process runs them all and the cluster starts once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

from flows.training.params import TrainParameters
from tests.runtime.conftest import small_mlp

REL_TOL = 1e-4


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/cluster/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.xdist_group("ray"))
            item.add_marker(pytest.mark.slow)


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
