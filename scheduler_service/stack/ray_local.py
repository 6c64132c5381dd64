"""A Ray cluster of N nodes x G worker slots on this machine, on loopback.

For trying the cluster backend (`elasticflow up --ray local:2x2`) and for the
tests: each node is a real raylet with its own processes, as on separate
machines, only all bound to 127.0.0.1. It is Ray's own multi-node-on-one-host
helper (`ray.cluster_utils.Cluster`), so nodes can be killed and added.

    python -m scheduler_service.stack.ray_local 2x2 ADDRESS_FILE

runs one until SIGTERM, writing its address to ADDRESS_FILE once it is up.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from flows.training.ray_nodes import KIND_RESOURCE, RAY_LOOPBACK_ENV, SLOTS_RESOURCE, USAGE_STATS_ENV

LOCAL_PREFIX = "local:"


def parse_local(spec: str) -> tuple[int, int]:
    """`local:NxG` (or `NxG`) as (nodes, slots per node)."""
    text = spec[len(LOCAL_PREFIX):] if spec.startswith(LOCAL_PREFIX) else spec
    match = re.fullmatch(r"(\d+)x(\d+)", text)
    if not match or min(int(match[1]), int(match[2])) < 1:
        raise ValueError(f"--ray {spec!r}: expected local:NxG, N nodes of G worker slots (e.g. local:2x2)")
    nodes, slots = int(match[1]), int(match[2])
    if slots & (slots - 1):
        # Buddy placement needs a power of two per node; the worker would leave
        # every such node out and find no cluster to schedule.
        raise ValueError(f"--ray {spec!r}: G={slots} worker slots per node is not a power of two (1, 2, 4, 8 ...)")
    return nodes, slots


def check_reachable(address: str, timeout_s: float = 3.0) -> None:
    """`--ray HOST:PORT`: fail at once, naming the address, when nothing
    answers there (Ray's own client retries its connection for minutes, and
    the stack would look started meanwhile)."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--ray {address!r}: expected the head's HOST:PORT (e.g. 10.0.0.1:6379) or local:NxG")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as exc:
        raise ValueError(f"--ray {address}: no Ray head answers there ({exc.strerror or exc}); start it with "
                         f"`ray start --head --port={port}` or name its address (docs/ray.md)") from None


class LocalRayCluster:
    """Nodes of `slots` worker slots on loopback; with `kinds`, node i
    declares kind `kinds[i]` (`elasticflow_kind:NAME`) and `kind_slots[i]`
    slots, as an operator's mixed cluster would."""

    def __init__(self, nodes: int, slots: int, kinds: tuple[str, ...] = (), kind_slots: tuple[int, ...] = ()) -> None:
        import os

        if "ray" in sys.modules and os.environ.get(RAY_LOOPBACK_ENV) != "0":
            raise RuntimeError(f"set {RAY_LOOPBACK_ENV}=0 before importing ray: a loopback cluster needs it")
        os.environ[RAY_LOOPBACK_ENV] = "0"  # and every raylet and driver it starts inherits it
        os.environ[USAGE_STATS_ENV] = "0"  # a head reports usage to Ray's servers unless told not to
        from ray.cluster_utils import Cluster

        self.slots = slots
        self.kinds, self.kind_slots = kinds, kind_slots
        self.cluster = Cluster(initialize_head=True, head_node_args=self._node_args(0, head=True))
        self.nodes: list[Any] = [self.cluster.head_node]
        for i in range(1, nodes):
            self.add_node()

    def _node_args(self, index: int, head: bool = False) -> dict[str, Any]:
        slots = self.kind_slots[index] if index < len(self.kind_slots) else self.slots
        resources: dict[str, float] = {SLOTS_RESOURCE: slots}
        if index < len(self.kinds):
            resources[KIND_RESOURCE + self.kinds[index]] = 1
        args: dict[str, Any] = dict(num_cpus=slots, num_gpus=0, resources=resources,
                                    node_name=f"ray-node-{index}", node_ip_address="127.0.0.1",
                                    object_store_memory=96 * 1024**2)
        if head:
            args["include_dashboard"] = False
        return args

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def add_node(self) -> Any:
        node = self.cluster.add_node(**self._node_args(len(self.nodes)))
        self.nodes.append(node)
        return node

    def kill_node(self, index: int) -> None:
        """The node's raylet and its processes are killed, as if its machine died."""
        self.cluster.remove_node(self.nodes[index], allow_graceful=False)

    def shutdown(self) -> None:
        self.cluster.shutdown()


def main(argv: list[str]) -> int:
    nodes, slots = parse_local(argv[0])
    cluster = LocalRayCluster(nodes, slots)
    stop, grow = threading.Event(), threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGHUP, lambda *_: (grow.set(), stop.set()))  # a machine back after one died
    out = Path(argv[1])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(cluster.address)
    tmp.replace(out)
    print(f"local Ray cluster: {nodes} nodes x {slots} slots at {cluster.address}; SIGHUP to this process "
          f"(pid {os.getpid()}, not its group) adds a node", flush=True)
    serve(cluster, stop, grow)
    cluster.shutdown()
    return 0


def serve(cluster: Any, stop: threading.Event, grow: threading.Event) -> None:
    """Add a node each time `grow` is set, until `stop` alone is. A node that
    does not come up (Ray gives up on a raylet that a loaded machine starts
    slowly) is said and left out: the cluster goes on with the nodes it has,
    where an exception here once ended it, and every run on it with it."""
    while True:
        stop.wait()
        if not grow.is_set():
            return
        grow.clear()
        stop.clear()
        try:
            cluster.add_node()
        except Exception as exc:  # noqa: BLE001 - whatever Ray raised, the cluster stays up
            print(f"local Ray cluster: a new node did not start ({exc}); it goes on without it", flush=True)
            continue
        print(f"local Ray cluster: node ray-node-{len(cluster.nodes) - 1} added", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
