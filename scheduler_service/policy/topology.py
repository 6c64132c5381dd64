"""Cluster topology: switches, nodes and GPUs, read from the cluster-spec CSV.

GPUs are numbered switch-major, then node, then local index. With a power of
two GPUs per node (and nodes per switch, when there are several switches),
every aligned power-of-two range of GPU ids is a compact set: within one node,
or whole neighbouring nodes under one switch. That is what makes buddy
placement give the speed the throughput curves were measured at.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.policy.jobs import floor_pow2, is_power_of_two


@dataclass(frozen=True, slots=True)
class Topology:
    num_switches: int
    nodes_per_switch: int
    gpus_per_node: int

    def __post_init__(self) -> None:
        if min(self.num_switches, self.nodes_per_switch, self.gpus_per_node) < 1:
            raise ValueError("switches, nodes per switch and GPUs per node must all be >= 1")
        if not is_power_of_two(self.gpus_per_node):
            raise ValueError(f"GPUs per node must be a power of two for buddy placement, got {self.gpus_per_node}")
        if self.num_switches > 1 and not is_power_of_two(self.nodes_per_switch):
            raise ValueError(
                f"with several switches, nodes per switch must be a power of two, got {self.nodes_per_switch}"
            )

    @property
    def num_nodes(self) -> int:
        return self.num_switches * self.nodes_per_switch

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def max_job_gpus(self) -> int:
        """The largest power-of-two GPU set the cluster can hold."""
        return floor_pow2(self.num_gpus)

    def node_of(self, gpu: int) -> int:
        return gpu // self.gpus_per_node

    def describe(self) -> str:
        return f"{self.num_switches} switch x {self.nodes_per_switch} nodes x {self.gpus_per_node} GPUs = {self.num_gpus} GPUs"


@dataclass(frozen=True, slots=True)
class Pool:
    """The GPUs of one kind: a buddy tree of like nodes. Its GPU ids are
    `first_gpu` on, after the pools before it, so every id names one GPU of
    the whole cluster and a pool's aligned blocks stay aligned."""

    kind: str
    topology: Topology
    first_gpu: int = 0

    def holds(self, gpu: int) -> bool:
        return self.first_gpu <= gpu < self.first_gpu + self.topology.num_gpus


@dataclass(frozen=True)
class MixedTopology:
    """A cluster of several GPU kinds, one pool each. A job runs on one kind
    at a time (no data-parallel group spans two kinds: the slower kind would
    set every step's pace), so each pool is planned as its own cluster and a
    job's GPU ids always lie in one pool."""

    pools: tuple[Pool, ...]

    def __post_init__(self) -> None:
        kinds = [p.kind for p in self.pools]
        if not kinds or len(set(kinds)) != len(kinds) or not all(kinds):
            raise ValueError(f"a mixed cluster needs distinct, named GPU kinds, got {kinds}")
        first = 0
        for pool in self.pools:
            if pool.first_gpu != first:
                raise ValueError(f"pool {pool.kind} starts at GPU {pool.first_gpu}, expected {first}")
            first += pool.topology.num_gpus

    @classmethod
    def of(cls, kinds: list[tuple[str, Topology]]) -> "MixedTopology":
        pools, first = [], 0
        for kind, topology in kinds:
            pools.append(Pool(kind, topology, first))
            first += topology.num_gpus
        return cls(tuple(pools))

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(p.kind for p in self.pools)

    @property
    def num_nodes(self) -> int:
        return sum(p.topology.num_nodes for p in self.pools)

    @property
    def num_gpus(self) -> int:
        return sum(p.topology.num_gpus for p in self.pools)

    @property
    def max_job_gpus(self) -> int:
        return max(p.topology.max_job_gpus for p in self.pools)

    def pool(self, kind: str) -> Pool:
        for pool in self.pools:
            if pool.kind == kind:
                return pool
        raise KeyError(kind)

    def pool_of(self, gpu: int) -> Pool:
        for pool in self.pools:
            if pool.holds(gpu):
                return pool
        raise IndexError(f"GPU {gpu} is not in this cluster of {self.num_gpus}")

    def kind_of(self, gpu: int) -> str:
        return self.pool_of(gpu).kind

    def node_of(self, gpu: int) -> int:
        nodes = 0
        for pool in self.pools:
            if pool.holds(gpu):
                return nodes + pool.topology.node_of(gpu - pool.first_gpu)
            nodes += pool.topology.num_nodes
        raise IndexError(f"GPU {gpu} is not in this cluster of {self.num_gpus}")

    def describe(self) -> str:
        return " + ".join(f"{p.kind}: {p.topology.describe()}" for p in self.pools)


AnyTopology = Topology | MixedTopology


def kind_of(topology: AnyTopology, gpu: int) -> str:
    """The GPU kind of `gpu` ("" on a cluster of one unnamed kind)."""
    return topology.kind_of(gpu) if isinstance(topology, MixedTopology) else ""


def kinds_of(topology: AnyTopology) -> tuple[str, ...]:
    """The named GPU kinds of a cluster of several (() for one kind)."""
    return topology.kinds if isinstance(topology, MixedTopology) else ()
