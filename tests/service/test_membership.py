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
