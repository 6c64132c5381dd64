"""The Ray cluster as ElasticFlow plans it: pools of alike nodes, one per GPU kind.

Ray reports nodes and their resources; buddy placement needs every node of a
kind to hold the same power-of-two number of GPUs (on a CPU-only node: the
worker slots it declared as the `elasticflow_slots` resource). A node's kind
is the `elasticflow_kind:NAME` resource its operator declared, else the
`accelerator_type:NAME` Ray detects on a GPU node, else one unnamed kind. A
node that does not fit is left out, with the reason, rather than bending the
topology. Both the service (its
cluster) and a run's coordinating process (a fixed GPU plan without a
scheduler) read the cluster through here, so they number GPUs alike.

No `ray` import at module level: callers pass what `ray.nodes()` returned,
and `connect` imports Ray only when a process joins a cluster.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from flows.training.control import GpuSlot

log = logging.getLogger("elasticflow.ray")  # a flow process forwards `elasticflow.*` to the run's Prefect logs

SLOTS_RESOURCE = "elasticflow_slots"  # worker slots a CPU-only node offers (`ray start --resources`)
KIND_RESOURCE = "elasticflow_kind:"  # + NAME: the node's GPU kind, as its operator declares it
RAY_KIND_RESOURCE = "accelerator_type:"  # + NAME: the GPU kind Ray detects on a GPU node
RAY_ADDRESS_ENV = "ELASTICFLOW_RAY_ADDRESS"  # the worker's setting: the Ray cluster its runs' ranks run on
NAMESPACE = "elasticflow"  # the Ray namespace of the rank actors
# Ray rewrites 127.0.0.1 to the host's outside address unless told it is one
# machine (read when `ray` is imported); a loopback cluster listens on 127.0.0.1 only.
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
USAGE_STATS_ENV = "RAY_USAGE_STATS_ENABLED"  # "0": no process we start reports usage to Ray's servers


def is_loopback(address: str | None) -> bool:
    host = (address or "").rpartition(":")[0] or (address or "")
    return host.startswith("127.") or host == "localhost"


def loopback_before_import(address: str | None = None) -> None:
    """Keep a process that talks to a loopback cluster (`address`, else the
    run's `ELASTICFLOW_RAY_ADDRESS`) on loopback: call before `import ray`."""
    if is_loopback(address or os.environ.get(RAY_ADDRESS_ENV)):
        os.environ.setdefault(RAY_LOOPBACK_ENV, "0")


def connect(address: str) -> None:
    """Join the Ray cluster at `address` as a driver, once per process: the
    worker (to read the nodes and clean up rank actors) and each run's flow
    process (which owns its rank actors, so they end with it). Ray's own
    errors (ConnectionError, RuntimeError, ValueError) go to the caller."""
    loopback_before_import(address)
    os.environ.setdefault(USAGE_STATS_ENV, "0")
    import ray

    if not ray.is_initialized():
        # ray.init replaces the driver's SIGTERM handler with one that calls
        # sys.exit: in a flow process that took the place of Prefect's bridge,
        # and a cancelled run went Cancelling -> Crashed ("aborted by Python
        # system exit call") -> Cancelled. The handler there before stays.
        before = signal.getsignal(signal.SIGTERM) if threading.current_thread() is threading.main_thread() else None
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)
        if before is not None:
            signal.signal(signal.SIGTERM, before)
        _condense_cluster_errors()


def _condense_cluster_errors() -> None:
    """Ray's driver prints every error the cluster publishes (a node marked
    dead, an actor's death) to stdout, whatever its logging settings, with the
    raylet's state dump: ~160 lines in the worker's log per lost node. They
    become one warning each, on our logger, without the dump. Ray has no
    setting for it: its module-level printer is replaced, and anything else
    it prints is left alone."""
    import ray._private.worker as ray_worker

    printer = ray_worker.print_to_stdstream
    if getattr(printer, "condensed", False):
        return

    def condensed(data: dict, ignore_prefix: bool) -> None:
        if data.get("pid") != "raylet":
            printer(data, ignore_prefix)
            return
        for message in data.get("lines", []):
            head = str(message).split("[state-dump]", 1)[0].strip().splitlines()
            log.warning("Ray: %s", " ".join(line.strip() for line in head[:3])[:500])

    condensed.condensed = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = condensed


@dataclass(frozen=True, slots=True)
class RayNode:
    node_id: str
    name: str
    ip: str
    gpus: int
    device: Literal["cuda", "cpu"]
    kind: str = ""  # "" on a cluster whose nodes name no kind

    def slots(self) -> list[GpuSlot]:
        return [GpuSlot(node=self.node_id, name=self.name, ip=self.ip, index=i) for i in range(self.gpus)]


@dataclass(frozen=True, slots=True)
class Excluded:
    name: str
    reason: str


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def kind_of(resources: dict[str, Any]) -> str:
    """The node's GPU kind: declared, else detected by Ray, else ""."""
    for prefix in (KIND_RESOURCE, RAY_KIND_RESOURCE):
        named = sorted(key[len(prefix):] for key in resources if key.startswith(prefix) and len(key) > len(prefix))
        if named:
            return named[0]
    return ""


def read_nodes(raw: Iterable[dict[str, Any]]) -> tuple[list[RayNode], list[Excluded]]:
    """The usable live nodes, grouped by kind (kinds by name, nodes in the
    order given), and the others with why.

    GPU nodes win over CPU-slot nodes (a run does not mix devices); among the
    nodes of one kind, the most common size wins (the larger on a tie)."""
    candidates: list[RayNode] = []
    excluded: list[Excluded] = []
    for entry in raw:
        if not entry.get("Alive", False):
            continue
        resources = entry.get("Resources") or {}
        name = str(entry.get("NodeName") or entry.get("NodeManagerAddress") or entry["NodeID"][:12])
        gpus, device = int(resources.get("GPU", 0)), "cuda"
        if not gpus:
            gpus, device = int(resources.get(SLOTS_RESOURCE, 0)), "cpu"
        if not gpus:
            excluded.append(Excluded(name, f"no GPUs and no {SLOTS_RESOURCE} resource"))
            continue
        if not _is_power_of_two(gpus):
            excluded.append(Excluded(name, f"{gpus} GPUs: buddy placement needs a power of two per node"))
            continue
        candidates.append(RayNode(entry["NodeID"], name, str(entry.get("NodeManagerAddress", "")), gpus,
                                  device, kind_of(resources)))  # type: ignore[arg-type]
    if any(n.device == "cuda" for n in candidates):
        for node in [n for n in candidates if n.device == "cpu"]:
            excluded.append(Excluded(node.name, "CPU worker slots beside GPU nodes: a run does not mix devices"))
        candidates = [n for n in candidates if n.device == "cuda"]
    kept: list[RayNode] = []
    for kind in sorted({n.kind for n in candidates}):
        alike = [n for n in candidates if n.kind == kind]
        counts = Counter(n.gpus for n in alike)
        size = max(counts, key=lambda g: (counts[g], g))
        others = f"the other {kind} nodes" if kind else "the others"
        for node in [n for n in alike if n.gpus != size]:
            excluded.append(Excluded(node.name, f"{node.gpus} GPUs where {others} have {size}: "
                                                "buddy placement needs alike nodes of a kind"))
        kept += [n for n in alike if n.gpus == size]
    return kept, excluded


def kind_major(nodes: list[RayNode]) -> list[RayNode]:
    """The nodes grouped by kind (kinds by name), keeping their order within
    a kind: GPU ids number the pools one after the other."""
    return sorted(nodes, key=lambda n: n.kind)


def rank_actor_name(run_key: str, n: int) -> str:
    """A run's rank actors are named after it, so the worker can find any left behind."""
    return f"{run_key}/rank-{n}"


def is_rank_actor_of(name: str, run_key: str) -> bool:
    return name.startswith(f"{run_key}/rank-")


def by_name(nodes: list[RayNode]) -> list[RayNode]:
    """A stable order for a cluster nobody has numbered yet (kind-major)."""
    return sorted(nodes, key=lambda n: (n.kind, n.name, n.node_id))


def slots_of(nodes: list[RayNode], gpus: Iterable[int]) -> list[GpuSlot]:
    """GPU ids (node-major over `nodes`) as slots."""
    every = [slot for node in nodes for slot in node.slots()]
    out = []
    for gpu in gpus:
        if not 0 <= gpu < len(every):
            raise ValueError(f"GPU {gpu} is not in the Ray cluster ({len(every)} GPUs on {len(nodes)} nodes)")
        out.append(every[gpu])
    return out
