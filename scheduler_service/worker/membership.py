"""Nodes come and go: the service's cluster follows the Ray cluster.

A node that joins adds capacity at the next plan; one that leaves or dies
takes its GPUs with it. GPU ids are positions in the topology, so every id
moves to its new position (by node and device); the control loop then makes
its policy anew for the new topology and re-plans every admitted run as
after a restart (loop.py, `ClusterChanged`): it keeps its guarantee if the
smaller cluster still meets it, and otherwise carries on best-effort and
says so. A run that had GPUs on a lost node lost its ranks: its flow process
waits for the new placement the next actuation sends it.
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_service.loop.events import ClusterChanged
from scheduler_service.worker.cluster import Cluster


@dataclass(frozen=True, slots=True)
class ClusterChange:
    """The new cluster, and what the loop is to be told of it."""

    cluster: Cluster
    event: ClusterChanged
    gone: list[str]
    joined: list[str]

    def describe(self) -> str:
        parts = [f"lost {', '.join(self.gone)}" if self.gone else "", f"joined {', '.join(self.joined)}"
                 if self.joined else ""]
        return "; ".join(p for p in parts if p) + f"; now {self.cluster.describe()}"


def renumbering(old: Cluster, new: Cluster) -> dict[int, int]:
    """Old GPU id -> new, for the GPUs on nodes in both."""
    position = {(slot.node, slot.index): gpu for gpu, slot in enumerate(new.slots)}
    return {gpu: position[(slot.node, slot.index)] for gpu, slot in enumerate(old.slots)
            if (slot.node, slot.index) in position}


def follow(old: Cluster, new: Cluster) -> ClusterChange:
    gone = sorted(set(old.nodes) - set(new.nodes))
    joined = sorted(set(new.nodes) - set(old.nodes))
    return ClusterChange(new, ClusterChanged(new.topology, renumbering(old, new), tuple(gone)), gone, joined)
