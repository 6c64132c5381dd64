"""Where a segment's ranks are on the live Ray cluster: GPU ids as slots,
each rank's seat (its node, the interface its actor reported there), and
which of a placement's nodes are gone."""

from __future__ import annotations

from typing import Any

from flows.training.ray_nodes import by_name, loopback_before_import, read_nodes, slots_of

loopback_before_import()

import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from flows.training.control import GpuSlot  # noqa: E402
from flows.training.orders import Seat  # noqa: E402
from flows.training.rank.node_tasks import node_id_here  # noqa: E402


def live_nodes() -> list[dict[str, Any]]:
    return list(ray.nodes())


def slots_for(gpus: list[int]) -> list[GpuSlot]:
    """GPU ids as slots on the live cluster, numbered by node name: for runs
    given a fixed GPU plan (no scheduler); the service names slots itself."""
    nodes, _ = read_nodes(live_nodes())
    return slots_of(by_name(nodes), gpus)


def lost(placement: list[GpuSlot]) -> list[str]:
    """The names of the placement's nodes that are not up."""
    up = {n["NodeID"] for n in live_nodes() if n.get("Alive")}
    return sorted({slot.name for slot in placement if slot.node not in up})


def ray_seats(placement: list[GpuSlot], where: list[dict[str, Any]]) -> list[Seat]:
    """Each rank on the node its placement names, on the interface its actor reported there."""
    return [Seat(node=slot.node, interface=w["interface"], device_index=slot.index)
            for slot, w in zip(placement, where)]


def answers(node: str, timeout_s: float = 10.0) -> bool:
    """Whether the node still runs work (a task pinned there comes back)."""
    try:
        ref = node_id_here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        return ray.get(ref, timeout=timeout_s) == node
    except Exception:  # noqa: BLE001  # unschedulable, dead, or too slow: not a node to train on
        return False
