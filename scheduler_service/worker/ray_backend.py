"""Runs on a Ray cluster: the cluster is Ray's live nodes, ranks run on them.

The flow process of a run stays where Prefect's worker starts it (this
machine, the same `FlowProcesses` as `LocalProcesses`) and coordinates; its
DDP ranks are Ray actors on the nodes of the placement
(`flows.training.coordinator.ray_ranks`). The service reads the topology from Ray,
follows nodes that join, leave or die (`changed`), names each GPU id by node
and device in every command, and kills rank actors a run left behind.

GPU ids are positions in the current topology: node-major over the usable
nodes in the order they were first seen, so a joining node appends and a
lost one closes ranks behind it (the worker re-plans every run then).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flows.training.launch.spec import LaunchSpec
from flows.training.ray_nodes import (
    NAMESPACE,
    RAY_LOOPBACK_ENV,
    RayNode,
    connect,
    is_loopback,
    is_rank_actor_of,
    kind_major,
    read_nodes,
)
from scheduler_service.policy.topology import AnyTopology, MixedTopology, Topology
from scheduler_service.worker.backend import FlowProcesses, RankPlacement
from scheduler_service.worker.cancellation import Cancelling, StopStep
from scheduler_service.worker.cluster import Cluster
from scheduler_service.worker.settings import SettingsError

log = logging.getLogger("prefect.workers.elasticflow.ray")
DEFAULT_KIND = "unnamed"  # nodes that name no kind, beside some that do


class RayBackend:
    name = "ray"

    def __init__(self, address: str, warm_start: bool = True, refresh_s: float = 1.0,
                 node_table: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.address = address
        self.node_table = node_table or _ray_nodes  # Ray's table of nodes, alive and dead
        self.refresh_s = refresh_s
        self.flows = FlowProcesses(warm_start)
        self.order: list[str] = []  # node ids, first seen first
        self.told: dict[str, str] = {}  # node name -> why it is left out, said once
        self._checked = 0.0
        self._cluster: Cluster | None = None
        self._empty_since: float | None = None  # since when a look found no usable node
        try:
            connect(address)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise SettingsError(f"ELASTICFLOW_RAY_ADDRESS={address}: cannot join the Ray cluster there "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None

    # -- the cluster -----------------------------------------------------------
    def cluster(self) -> Cluster:
        """The usable nodes now, as the service's cluster: at start, when none
        is usable there is nothing to serve with."""
        seen = self.read(self.node_table())
        if seen is None:
            raise RuntimeError(f"the Ray cluster at {self.address} has no usable node (see the lines above); start "
                               "GPU nodes, or CPU nodes with --resources '{\"elasticflow_slots\": N}' (docs/ray.md)")
        return seen

    def read(self, raw: list[dict[str, Any]]) -> Cluster | None:
        """The cluster that Ray's node table `raw` describes; None when no node
        in it is usable (the last cluster read stays)."""
        nodes, excluded = read_nodes(raw)
        for node in excluded:
            if self.told.get(node.name) != node.reason:
                log.warning("Ray node %s left out of the cluster: %s", node.name, node.reason)
                self.told[node.name] = node.reason
        if not nodes:
            return None
        known = {n.node_id: n for n in nodes}
        self.order = [i for i in self.order if i in known] + sorted(
            (i for i in known if i not in self.order), key=lambda i: (known[i].name, i))
        ordered = kind_major([known[i] for i in self.order])
        self._cluster = _as_cluster(ordered, self.address, tuple((n.name, n.reason) for n in excluded))
        return self._cluster

    def changed(self, now: float) -> Cluster | None:
        """The cluster, when its usable nodes differ from the last look (at
        most every `refresh_s`).

        A look that finds no usable node (the last one lost, its replacement
        not yet up) changes nothing: a service has no cluster of no GPUs to
        plan on, and the runs on nodes that are gone fail and restart where
        the next node that comes up puts them."""
        if now - self._checked < self.refresh_s or self._cluster is None:
            return None
        self._checked = now
        before = self._cluster
        after = self.read(self.node_table())
        if after is None:
            if self._empty_since is None:
                self._empty_since = now
                log.warning("the Ray cluster at %s has no usable node now; planning stays on its last nodes (%s) "
                            "until one is back", self.address, ", ".join(before.nodes))
            return None
        if self._empty_since is not None:
            log.warning("the Ray cluster at %s has a usable node again, after %.0f s without", self.address,
                        now - self._empty_since)
            self._empty_since = None
        return after if after.slots != before.slots or after.left_out != before.left_out else None

    # -- runs ------------------------------------------------------------------
    def open(self, home: Path) -> None:
        self.flows.open(home)

    def close(self) -> None:
        self.flows.close()

    def prepare(self, env: dict[str, str], placement: RankPlacement, spec: LaunchSpec) -> None:
        """The flow process puts its ranks on this cluster; none on this machine."""
        self.flows.prepare(env, placement, spec.model_copy(update={"ray_address": self.address, "standby": 0}))
        if is_loopback(self.address):
            env[RAY_LOOPBACK_ENV] = "0"

    def infrastructure_id(self, pid: int) -> str:
        """The coordinating process (`host:pid`) and the Ray cluster its ranks are on."""
        return f"ray://{self.address}/{NAMESPACE}|{self.flows.infrastructure_id(pid)}"

    def alive(self, infrastructure_id: str | None, run_id: str) -> bool:
        return self.flows.alive(infrastructure_id, run_id)

    def stop_step(self, run_id: str, infrastructure_id: str | None, message: str | None, now: float,
                  adopted: bool) -> StopStep | None:
        return self.flows.stop_step(run_id, infrastructure_id, message, now, adopted)

    def kill(self, infrastructure_id: str, run_id: str | None, grace_s: float) -> None:
        """Stop the coordinating process (its ranks end with it, Ray's fate
        sharing), then any rank actor of the run still there, on every node."""
        try:
            self.flows.kill(infrastructure_id, run_id, grace_s)
        finally:  # InfrastructureGone too: its actors may still be there
            if run_id is not None:
                self.kill_ranks(run_id)

    def forget(self, run_id: str) -> Cancelling | None:
        """The coordinating process is gone; so must its ranks be (they are, unless Ray lags)."""
        self.kill_ranks(run_id)
        return self.flows.forget(run_id)

    def kill_ranks(self, run_id: str, timeout_s: float = 15.0) -> int:
        """Kill the run's rank actors left anywhere; how many there were."""
        import ray

        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == NAMESPACE and is_rank_actor_of(str(a.get("name", "")), run_id)]
        for name in names:
            try:
                ray.kill(ray.get_actor(name, namespace=NAMESPACE), no_restart=True)
            except ValueError:  # gone meanwhile
                continue
        give_up = time.monotonic() + timeout_s
        while names and time.monotonic() < give_up:
            left = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
            if not left & set(names):
                break
            time.sleep(0.2)
        if names:
            log.info("flow run %s: killed %d rank actor(s) left on the Ray cluster", run_id, len(names))
        return len(names)


def _ray_nodes() -> list[dict[str, Any]]:
    import ray

    return list(ray.nodes())


def _as_cluster(nodes: list[RayNode], address: str, left_out: tuple[tuple[str, str], ...] = ()) -> Cluster:
    kinds = list(dict.fromkeys(n.kind for n in nodes))  # `nodes` are kind-major
    topology: AnyTopology
    if len(kinds) == 1:
        topology = Topology(1, len(nodes), nodes[0].gpus)
    else:
        pools = []
        for kind in kinds:
            alike = [n for n in nodes if n.kind == kind]
            pools.append((kind or DEFAULT_KIND, Topology(1, len(alike), alike[0].gpus)))
        topology = MixedTopology.of(pools)
    slots = tuple(slot for node in nodes for slot in node.slots())
    return Cluster(topology, nodes[0].device, tuple(n.name for n in nodes), f"Ray cluster at {address}", slots,
                   left_out)
