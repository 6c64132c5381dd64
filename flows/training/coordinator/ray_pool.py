"""A run's rank actors on the Ray nodes, apart from what they train: the warm
ones it keeps per node (`ActorPool`), the environment they get, and how
they end (`end_actors`: killed, then awaited on their own nodes, for a GPU
is free only once its process is gone). `ray_ranks` runs segments on them.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from flows.training.ray_nodes import loopback_before_import, rank_actor_name

loopback_before_import()

import ray  # noqa: E402
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: E402

from flows.training.control import GpuSlot  # noqa: E402
from flows.training.rank.node_tasks import await_exit  # noqa: E402
from flows.training.rank.ray_actor import RankActor  # noqa: E402
from flows.training.launch.standby import rank_env  # noqa: E402

log = logging.getLogger("elasticflow.ray")


def _actor_env() -> dict[str, str]:
    """What the ranks see of this process's environment, besides their node's:
    the allow-list's own names (a remote store's credentials by name through
    ELASTICFLOW_RANK_ENV), never PATH or HOME, which are the node's."""
    mine = rank_env(dict(os.environ))
    keep = {k: v for k, v in mine.items() if k.startswith(("ELASTICFLOW_", "NCCL_", "GLOO_", "TORCH_"))
            or k in os.environ.get("ELASTICFLOW_RANK_ENV", "").split(",")}
    keep["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"  # the placement's GPU, not one Ray picks
    return keep


# Warm rank actors a run keeps per node, at most (unset: one for each GPU its
# placement has there). Each is a process with torch imported, ~360 MiB: a
# 4-slot run held 8 actors, 2.9 GiB. One that is missing is started cold when
# a resize needs it (bench/ray.py measures what that costs).
SPARES_ENV = "ELASTICFLOW_RAY_SPARES_PER_NODE"


def spares_per_node(env: dict[str, str] | None = None) -> int | None:
    """The operator's cap on warm actors per node and run; None: no cap."""
    value = (os.environ if env is None else env).get(SPARES_ENV, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ValueError(f"{SPARES_ENV}={value!r}: expected a whole number of warm actors per node (0 for none)")
    return int(value)


class ActorPool:
    """Warm rank actors per node, owned by this process (they end with it)."""

    def __init__(self, run_key: str, per_node: int | None = None) -> None:
        self.run_key = run_key
        self.per_node = per_node  # the cap on warm actors per node (None: one per GPU placed there)
        self.ready: dict[str, list[Any]] = {}
        self.count = 0
        self.env = _actor_env()

    def _new(self, node: str) -> Any:
        self.count += 1
        return RankActor.options(
            name=rank_actor_name(self.run_key, self.count),
            scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            runtime_env={"env_vars": self.env},
        ).remote()

    def take(self, slot: GpuSlot) -> Any:
        standbys = self.ready.get(slot.node) or []
        return standbys.pop() if standbys else self._new(slot.node)

    def refill(self, placement: list[GpuSlot]) -> None:
        """Keep one warm actor for each GPU of `placement` on its node, up to the cap per node."""
        wanted: dict[str, int] = {}
        for slot in placement:
            wanted[slot.node] = wanted.get(slot.node, 0) + 1
        if self.per_node is not None:
            wanted = {node: min(count, self.per_node) for node, count in wanted.items()}
        for node, count in wanted.items():
            standbys = self.ready.setdefault(node, [])
            while len(standbys) < count:
                standbys.append(self._new(node))

    def drop(self, nodes: set[str]) -> None:
        """Forget standbys on nodes that are gone."""
        for node in nodes:
            for actor in self.ready.pop(node, []):
                ray.kill(actor)

    def close(self) -> None:
        for actors in self.ready.values():
            for actor in actors:
                ray.kill(actor)
        self.ready.clear()


def end_actors(actors: list[Any], where: list[dict[str, Any]], timeout_s: float = 15.0) -> None:
    """Kill the actors and return once their processes are gone, as seen on
    their own nodes: the GPUs are free only then, and the scheduler hears of
    the new set (the acknowledgement) only after this."""
    for actor in actors:
        ray.kill(actor, no_restart=True)
    by_node: dict[str, list[int]] = {}
    for w in where:
        by_node.setdefault(w["node"], []).append(w["pid"])
    checks = [await_exit.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
        pids, timeout_s) for node, pids in by_node.items()]
    left = []
    for check in checks:
        try:
            left += ray.get(check, timeout=timeout_s + 10)
        except Exception:  # noqa: BLE001  # a node that is gone took its processes with it
            continue
    if left:
        log.warning("rank processes %s still there %.0f s after they were killed", left, timeout_s)
