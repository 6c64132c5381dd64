"""Nodes come and go: the service's cluster follows the Ray cluster.

A node that joins adds capacity at the next plan; one that leaves or dies
takes its GPUs with it. GPU ids are positions in the topology, so every id
moves to its new position (by node and device), the policy is made anew for
the new topology, and every admitted run is re-planned as after a restart:
it keeps its guarantee if the smaller cluster still meets it, and otherwise
carries on best-effort and says so (decisions.publish: `downgraded`). A run
that had GPUs on a lost node lost its ranks: its flow process waits for the
new placement the next actuation sends it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from scheduler_service.policy import make_policy
from scheduler_service.worker.cluster import Cluster
from scheduler_service.worker.decisions import tell

if TYPE_CHECKING:
    from scheduler_service.worker.worker import ElasticFlowWorker

log = logging.getLogger("prefect.workers.elasticflow.membership")


def renumbering(old: Cluster, new: Cluster) -> dict[int, int]:
    """Old GPU id -> new, for the GPUs on nodes in both."""
    position = {(slot.node, slot.index): gpu for gpu, slot in enumerate(new.slots)}
    return {gpu: position[(slot.node, slot.index)] for gpu, slot in enumerate(old.slots)
            if (slot.node, slot.index) in position}


def follow(worker: ElasticFlowWorker, new: Cluster) -> None:
    old = worker.cluster
    gone = sorted(set(old.nodes) - set(new.nodes))
    joined = sorted(set(new.nodes) - set(old.nodes))
    mapping = renumbering(old, new)
    worker.policy = make_policy(worker.settings.policy, new.topology, interval=worker.interval,
                                overhead=worker.overhead)
    lost = worker.scheduler.rebase(worker.policy, mapping)
    worker.cluster = worker.view.cluster = new
    worker.profiler.num_gpus, worker.profiler.max_job_gpus = new.topology.num_gpus, new.topology.max_job_gpus
    new.publish(worker.settings.home)
    log.warning("cluster changed: %s%s%s; now %s", f"lost {', '.join(gone)}" if gone else "",
                "; " if gone and joined else "", f"joined {', '.join(joined)}" if joined else "",
                new.topology.describe())
    worker.publisher.cluster_event("elasticflow.cluster.changed", {
        "lost": gone, "joined": joined, "topology": new.topology.describe(),
        "runs_that_lost_gpus": [run.run_id for run in lost]}, nodes=[*gone, *joined])
    for run in lost:
        tell(worker, run, f"its GPUs on {', '.join(gone) or 'a lost node'} are gone with the node; it goes on "
                          "from its last checkpoint where the next plan puts it", warning=True)
        worker.publisher.event(run.run_id, "elasticflow.run.nodes-lost", {"nodes": gone}, nodes=gone)
