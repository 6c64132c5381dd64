"""The cluster the service schedules: a cluster file, or this machine.

A cluster file has the shape of `data/clusters/*.csv` (`num_switch,
num_node_p_switch, num_gpu_p_node, ...`) and is read with the loader the
simulator uses too (`scheduler_service.inputfiles`), so bad files fail with the
same one-line message. Without one
(`ELASTICFLOW_CLUSTER` unset and no `infra/cluster.csv`), the local machine is
the cluster: one node with its CUDA devices, or, on a CPU-only machine,
`ELASTICFLOW_CPU_SLOTS` worker slots (default: the CPU count), rounded down to
a power of two because buddy placement needs one.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.training.control import GpuSlot
from scheduler_service.policy.jobs import floor_pow2
from scheduler_service.policy.topology import AnyTopology, MixedTopology, Topology
from scheduler_service.inputfiles import load_cluster

CLUSTER_ENV = "ELASTICFLOW_CLUSTER"
CPU_SLOTS_ENV = "ELASTICFLOW_CPU_SLOTS"
DEFAULT_CLUSTER_FILE = Path(__file__).resolve().parents[2] / "infra" / "cluster.csv"


@dataclass(frozen=True, slots=True)
class Cluster:
    topology: AnyTopology
    device: str  # "cuda" or "cpu" (a "GPU" is then a worker slot)
    nodes: tuple[str, ...]  # node names, index = Topology.node_of(gpu)
    source: str
    slots: tuple[GpuSlot, ...] = ()  # on a Ray cluster: where each GPU id is (index = GPU id)
    left_out: tuple[tuple[str, str], ...] = ()  # (node, why) of the nodes found and not used

    def locate(self, gpus: tuple[int, ...]) -> list[GpuSlot] | None:
        """Where `gpus` are, for a run's command (None on one machine)."""
        return [self.slots[g] for g in gpus] if self.slots else None

    def describe(self) -> str:
        """The topology in words; on CPU nodes a "GPU" is a worker slot, and says so."""
        text = self.topology.describe()
        return f"{text} (CPU worker slots)" if self.device == "cpu" else text

    def publish(self, home: Path, teams: tuple[Any, ...] = ()) -> None:
        """`cluster.json` in the home, for readers that must not guess the
        cluster from their own environment (`elasticflow status`); with the
        teams' shares, on a cluster shared by teams (policy.teams.Team)."""
        import json

        gpu_nodes = [self.nodes[self.topology.node_of(g)] for g in range(self.topology.num_gpus)]
        home.mkdir(parents=True, exist_ok=True)
        tmp = home / ".cluster.json.tmp"
        tmp.write_text(json.dumps({"description": self.describe(), "source": self.source,
                                   "gpu_nodes": gpu_nodes,
                                   "left_out": [{"node": n, "why": why} for n, why in self.left_out],
                                   "teams": [{"name": t.name, "share": t.share} for t in teams]}))
        tmp.replace(home / "cluster.json")

    def node_sizes(self) -> list[int]:
        """GPUs of each node, in node order."""
        pools = self.topology.pools if isinstance(self.topology, MixedTopology) else ()
        if not pools:
            return [self.topology.gpus_per_node] * self.topology.num_nodes  # type: ignore[union-attr]
        return [p.topology.gpus_per_node for p in pools for _ in range(p.topology.num_nodes)]

    def node_kinds(self) -> list[str]:
        """The GPU kind of each node ("" where the cluster names none)."""
        pools = self.topology.pools if isinstance(self.topology, MixedTopology) else ()
        return [p.kind for p in pools for _ in range(p.topology.num_nodes)] or [""] * self.topology.num_nodes

    def nodes_of(self, gpus: list[int] | tuple[int, ...]) -> list[str]:
        return sorted({self.nodes[self.topology.node_of(g)] for g in gpus}, key=self.nodes.index)


def local_cuda_devices() -> int:
    """CUDA devices visible here, without importing torch (the worker starts fast)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
    return len(glob.glob("/dev/nvidia[0-9]*"))


def load(path: str | Path | None = None, cpu_slots: int | None = None) -> Cluster:
    """The cluster from `path`, `$ELASTICFLOW_CLUSTER`, `infra/cluster.csv`, or this machine
    (`cpu_slots`, `$ELASTICFLOW_CPU_SLOTS` or the CPU count on a CPU-only one)."""
    chosen = path or os.environ.get(CLUSTER_ENV) or (DEFAULT_CLUSTER_FILE if DEFAULT_CLUSTER_FILE.exists() else None)
    if chosen:
        topology = load_cluster(Path(chosen))
        device = "cuda" if local_cuda_devices() else "cpu"
        nodes = tuple(f"node-{i}" for i in range(topology.num_nodes))
        if topology.num_nodes == 1:
            nodes = ("localhost",)
        return Cluster(topology, device, nodes, str(chosen))
    cuda = local_cuda_devices()
    if cuda:
        return Cluster(Topology(1, 1, floor_pow2(cuda)), "cuda", ("localhost",), f"{cuda} local CUDA devices")
    slots = cpu_slots or int(os.environ.get(CPU_SLOTS_ENV) or os.cpu_count() or 1)
    return Cluster(Topology(1, 1, floor_pow2(slots)), "cpu", ("localhost",), f"{slots} local CPU worker slots")
