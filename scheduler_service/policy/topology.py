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
