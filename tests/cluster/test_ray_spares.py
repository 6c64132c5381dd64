"""Warm rank actors per node are bounded by the operator's setting: each is a
process with torch imported (~360 MiB), and a 4-slot run held 8 of them."""

from __future__ import annotations

from typing import Any

import pytest

from flows.training.control import GpuSlot


def _placement(*nodes: str) -> list[GpuSlot]:
    return [GpuSlot(node=node, name=node, ip="127.0.0.1", index=i) for i, node in enumerate(nodes)]


def _pool(per_node: int | None, monkeypatch: pytest.MonkeyPatch) -> Any:
    from flows.training.coordinator import ray_pool

    pool = ray_pool.ActorPool("run", per_node)
    monkeypatch.setattr(pool, "_new", lambda node: f"actor on {node}")  # no cluster needed to count
    return pool


def test_warm_actors_follow_the_placement_up_to_the_cap_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    placement = _placement("a", "a", "b", "b")
    uncapped = _pool(None, monkeypatch)
    uncapped.refill(placement)
    assert {node: len(actors) for node, actors in uncapped.ready.items()} == {"a": 2, "b": 2}
    capped = _pool(1, monkeypatch)
    capped.refill(placement)
    assert {node: len(actors) for node, actors in capped.ready.items()} == {"a": 1, "b": 1}
    none = _pool(0, monkeypatch)
    none.refill(placement)
    assert sum(len(actors) for actors in none.ready.values()) == 0


def test_the_setting_is_a_whole_number_or_unset() -> None:
    from flows.training.coordinator.ray_pool import spares_per_node

    assert spares_per_node({}) is None and spares_per_node({"ELASTICFLOW_RAY_SPARES_PER_NODE": "2"}) == 2
    with pytest.raises(ValueError, match="ELASTICFLOW_RAY_SPARES_PER_NODE='two': expected a whole number"):
        spares_per_node({"ELASTICFLOW_RAY_SPARES_PER_NODE": "two"})
