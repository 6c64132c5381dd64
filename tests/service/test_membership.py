"""The cluster read from Ray, and a change of nodes as the loop is told of
it, without Ray: `ray.nodes()`-shaped input (what the loop then does to the
runs: tests/loop/test_cluster_change.py)."""

from __future__ import annotations

import pytest

from flows.training.ray_nodes import read_nodes, slots_of
from scheduler_service.policy import Topology
from scheduler_service.stack.ray_local import parse_local
from scheduler_service.worker.cluster import Cluster
from scheduler_service.worker.membership import follow, renumbering


def node(name: str, gpus: int = 0, slots: int = 0, alive: bool = True) -> dict[str, object]:
    resources: dict[str, float] = {"CPU": 8.0}
    if gpus:
        resources["GPU"] = float(gpus)
    if slots:
        resources["elasticflow_slots"] = float(slots)
    return {"NodeID": f"id-{name}", "NodeName": name, "NodeManagerAddress": f"10.0.0.{len(name)}",
            "Alive": alive, "Resources": resources}


def test_only_alike_power_of_two_nodes_are_used_and_each_other_one_is_said_why() -> None:
    nodes, excluded = read_nodes([node("head"), node("a", gpus=8), node("b", gpus=8), node("c", gpus=6),
                                  node("d", gpus=4), node("e", slots=2), node("dead", gpus=8, alive=False)])
    assert [n.name for n in nodes] == ["a", "b"] and all(n.device == "cuda" for n in nodes)
    why = {e.name: e.reason for e in excluded}
    assert set(why) == {"head", "c", "d", "e"}  # a dead node is simply not there
    assert "no GPUs" in why["head"] and "power of two" in why["c"]
    assert "where the others have 8" in why["d"] and "mix devices" in why["e"]


def test_cpu_only_nodes_offer_the_slots_they_declared() -> None:
    nodes, excluded = read_nodes([node("n0", slots=2), node("n1", slots=2)])
    assert [(n.gpus, n.device) for n in nodes] == [(2, "cpu"), (2, "cpu")] and not excluded
    assert [(s.name, s.index) for s in slots_of(nodes, [1, 2])] == [("n0", 1), ("n1", 0)]
    with pytest.raises(ValueError, match="GPU 4 is not in the Ray cluster"):
        slots_of(nodes, [4])


def test_local_cluster_specs_are_checked() -> None:
    assert parse_local("local:2x2") == (2, 2)
    for bad in ("local:2", "local:0x2", "2x", "local:axb"):
        with pytest.raises(ValueError, match="expected local:NxG"):
            parse_local(bad)
    with pytest.raises(ValueError, match="G=3 worker slots per node is not a power of two"):
        parse_local("local:2x3")


def test_a_ray_head_that_is_not_there_is_named_at_once() -> None:
    import socket
    import time

    from scheduler_service.stack.ray_local import check_reachable

    with socket.socket() as listening:  # something answers here
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        check_reachable(f"127.0.0.1:{listening.getsockname()[1]}")
        closed = listening.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(ValueError, match=f"--ray 127.0.0.1:{closed}: no Ray head answers there"):
        check_reachable(f"127.0.0.1:{closed}")
    assert time.monotonic() - started < 5
    with pytest.raises(ValueError, match="expected the head's HOST:PORT"):
        check_reachable("nowhere")


def _cluster(*names: str) -> Cluster:
    nodes, _ = read_nodes([node(n, slots=2) for n in names])
    return Cluster(Topology(1, len(nodes), 2), "cpu", tuple(names), "test",
                   tuple(s for n in nodes for s in n.slots()))


def test_gpu_ids_follow_their_node_when_another_node_goes() -> None:
    old, new = _cluster("n0", "n1", "n2"), _cluster("n0", "n2")
    assert renumbering(old, new) == {0: 0, 1: 1, 4: 2, 5: 3}  # n1's GPUs 2, 3 are gone


def test_a_node_that_joins_adds_gpus_after_those_there_were() -> None:
    assert renumbering(_cluster("n0"), _cluster("n0", "n1")) == {0: 0, 1: 1}


def test_following_a_lost_node_tells_the_loop_where_every_gpu_went() -> None:
    change = follow(_cluster("n0", "n1", "n2"), _cluster("n0", "n2"))
    assert change.gone == ["n1"] and change.joined == []
    assert change.event.mapping == {0: 0, 1: 1, 4: 2, 5: 3} and change.event.lost_nodes == ("n1",)
    assert change.event.topology.num_gpus == 4 and "lost n1; now" in change.describe()


def kinded(name: str, kind: str, slots: int = 0, gpus: int = 0, detected: bool = False) -> dict[str, object]:
    entry = node(name, gpus=gpus, slots=slots)
    entry["Resources"][("accelerator_type:" if detected else "elasticflow_kind:") + kind] = 1.0  # type: ignore[index]
    return entry


def test_nodes_of_two_kinds_are_two_pools_and_every_node_is_used() -> None:
    from scheduler_service.policy.topology import MixedTopology
    from scheduler_service.worker.ray_backend import _as_cluster

    raw = [kinded("t4-a", "T4", gpus=4, detected=True), kinded("a100-a", "A100", gpus=8, detected=True),
           kinded("t4-b", "T4", gpus=4, detected=True), kinded("t4-odd", "T4", gpus=2, detected=True)]
    nodes, excluded = read_nodes(raw)
    assert [(n.name, n.kind) for n in nodes] == [("a100-a", "A100"), ("t4-a", "T4"), ("t4-b", "T4")]
    assert [(e.name, e.reason) for e in excluded] == [
        ("t4-odd", "2 GPUs where the other T4 nodes have 4: buddy placement needs alike nodes of a kind")]
    cluster = _as_cluster(nodes, "ray://test")
    assert isinstance(cluster.topology, MixedTopology)
    assert cluster.describe() == "A100: 1 switch x 1 nodes x 8 GPUs = 8 GPUs + T4: 1 switch x 2 nodes x 4 GPUs = 8 GPUs"
    assert [s.name for s in cluster.locate((7, 8, 12))] == ["a100-a", "t4-a", "t4-b"]  # type: ignore[union-attr]
    assert cluster.node_sizes() == [8, 4, 4] and cluster.node_kinds() == ["A100", "T4", "T4"]


def test_a_declared_kind_wins_over_the_detected_one_and_one_kind_is_todays_cluster() -> None:
    from scheduler_service.worker.ray_backend import _as_cluster

    entry = kinded("n0", "A100-80G", gpus=8)
    entry["Resources"]["accelerator_type:A100"] = 1.0  # type: ignore[index]
    nodes, _ = read_nodes([entry, kinded("n1", "A100-80G", gpus=8)])
    assert {n.kind for n in nodes} == {"A100-80G"}
    assert isinstance(_as_cluster(nodes, "ray://test").topology, Topology)  # one kind: one buddy tree, as before


def test_one_node_of_each_kind_with_unequal_slots_are_both_used() -> None:
    from scheduler_service.worker.ray_backend import _as_cluster

    nodes, excluded = read_nodes([kinded("small", "B", slots=2), kinded("big", "A", slots=4)])
    assert not excluded
    assert _as_cluster(nodes, "ray://test").describe() == (
        "A: 1 switch x 1 nodes x 4 GPUs = 4 GPUs + B: 1 switch x 1 nodes x 2 GPUs = 2 GPUs (CPU worker slots)")


def test_a_node_that_does_not_start_leaves_the_local_cluster_serving(capsys) -> None:
    """Ray gave up on a raylet a loaded machine started slowly, and the
    exception ended the local cluster's process, its GCS and every run on
    it (chaos --ray): the failure is said, and the next SIGHUP adds a node."""
    import threading
    import time

    from scheduler_service.stack.ray_local import serve

    class Nodes:  # Ray's node start, failing the first time as it did
        def __init__(self) -> None:
            self.nodes: list[str] = ["head", "ray-node-1"]
            self.tries = 0

        def add_node(self) -> None:
            self.tries += 1
            if self.tries == 1:
                raise Exception("The current node timed out during startup.")
            self.nodes.append(f"ray-node-{len(self.nodes)}")

    cluster, stop, grow = Nodes(), threading.Event(), threading.Event()
    serving = threading.Thread(target=serve, args=(cluster, stop, grow), daemon=True)
    serving.start()
    for _ in range(2):  # SIGHUP twice
        grow.set()
        stop.set()
        while stop.is_set():
            time.sleep(0.001)
    while cluster.tries < 2 or len(cluster.nodes) < 3:
        time.sleep(0.001)
    stop.set()  # SIGTERM
    serving.join(timeout=10)
    assert not serving.is_alive() and cluster.nodes == ["head", "ray-node-1", "ray-node-2"]
    assert "a new node did not start (The current node timed out during startup.)" in capsys.readouterr().out


def test_a_look_that_finds_no_usable_node_keeps_the_last_cluster_until_one_is_back(monkeypatch, caplog) -> None:
    """The last node lost and its replacement not up yet (CI: one host killed,
    the other cut off): the worker once died here, on a cluster of no GPUs."""
    from scheduler_service.worker import ray_backend

    monkeypatch.setattr(ray_backend, "connect", lambda address: None)
    table = [node("n1", slots=2, alive=False), node("n2", slots=2)]
    backend = ray_backend.RayBackend("10.0.0.1:6379", warm_start=False, node_table=lambda: table)
    first = backend.cluster()
    assert first.nodes == ("n2",)
    table = [node("n1", slots=2, alive=False), node("n2", slots=2, alive=False)]
    assert backend.changed(10.0) is None and backend.changed(20.0) is None
    assert [r.getMessage().split(";")[0] for r in caplog.records].count(
        "the Ray cluster at 10.0.0.1:6379 has no usable node now") == 1  # said once per outage
    table = [node("n1-again", slots=2), node("n2", slots=2, alive=False)]
    back = backend.changed(30.0)
    assert back is not None and back.nodes == ("n1-again",)
    assert follow(first, back).describe().startswith("lost n2; joined n1-again")  # what the worker then says
    assert "after 20 s without" in caplog.text
    with pytest.raises(RuntimeError, match="no usable node"):  # at start there is nothing to serve with
        ray_backend.RayBackend("10.0.0.1:6379", warm_start=False, node_table=lambda: []).cluster()
