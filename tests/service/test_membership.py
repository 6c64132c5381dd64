"""The cluster read from Ray, and what a change of nodes does to the runs,
without Ray: `ray.nodes()`-shaped input and the scheduler on its own."""

from __future__ import annotations

from pathlib import Path

import pytest

from flows.training.control import ControlAck, FileControlChannel
from flows.training.ray_nodes import read_nodes, slots_of
from scheduler_service.policy import Job, ThroughputCurve, Topology
from scheduler_service.policy.elasticflow import ElasticFlowPolicy
from scheduler_service.policy.overhead import RestartOverhead
from scheduler_service.stack.ray_local import parse_local
from scheduler_service.worker.cluster import Cluster
from scheduler_service.worker.membership import renumbering
from scheduler_service.worker.run_state import Phase, RunState
from scheduler_service.worker.scheduler import Scheduler

T0 = 1000.0
CURVE = ThroughputCurve({1: 20.0, 2: 36.0, 4: 64.0})


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


def _cluster(*names: str) -> Cluster:
    nodes, _ = read_nodes([node(n, slots=2) for n in names])
    return Cluster(Topology(1, len(nodes), 2), "cpu", tuple(names), "test",
                   tuple(s for n in nodes for s in n.slots()))


def test_gpu_ids_follow_their_node_when_another_node_goes() -> None:
    old, new = _cluster("n0", "n1", "n2"), _cluster("n0", "n2")
    assert renumbering(old, new) == {0: 0, 1: 1, 4: 2, 5: 3}  # n1's GPUs 2, 3 are gone


def test_a_node_that_joins_adds_gpus_after_those_there_were() -> None:
    assert renumbering(_cluster("n0"), _cluster("n0", "n1")) == {0: 0, 1: 1}


def _run(tmp: Path, run_id: str, iterations: float, deadline: float | None) -> RunState:
    return RunState(run_id, Job(run_id, T0, iterations, deadline, CURVE), FileControlChannel(run_id, tmp))


def _ack(run: RunState) -> None:
    command = run.channel.latest()
    assert command is not None
    run.channel.acknowledge(ControlAck(seq=command.seq, iteration=0, gpus=command.gpus or []))


def test_a_lost_node_replans_every_run_and_the_run_that_had_gpus_there_waits_for_a_new_placement(
        tmp_path: Path) -> None:
    overhead = RestartOverhead(0.5, 0.5, 0.0)
    before = _cluster("n0", "n1")
    sched = Scheduler(ElasticFlowPolicy(Topology(1, 2, 2), interval=2.0, overhead=overhead),
                      locate=before.locate)
    a = _run(tmp_path, "a", 64 * 100, T0 + 300)  # needs 4 GPUs for 100 s, or 2 for 178 s
    sched.arrive(a)
    sched.plan(T0)
    sched.actuate(T0)
    _ack(a)
    sched.actuate(T0)
    command = a.channel.latest()
    assert command is not None and command.placement is not None
    assert {s.name for s in command.placement} == {"n0", "n1"}  # the command says where each GPU is
    held = a.held
    assert len(held) == 4

    after = _cluster("n0")
    lost = sched.rebase(ElasticFlowPolicy(Topology(1, 1, 2), interval=2.0, overhead=overhead),
                        renumbering(before, after))
    sched.locate = after.locate
    assert lost == [a] and a.commanded == () and a.held == (0, 1)  # n0's GPUs stay held until it acknowledges
    assert a.adopted and a.phase == Phase.RUNNING
    result = sched.plan(T0 + 10)
    assert result is not None
    # 2 GPUs for what is left still meets its deadline: it keeps its guarantee.
    assert not result.downgraded
    actions = {x.run_id: x for x in sched.actuate(T0 + 10)}
    assert actions["a"].kind == "rescale" and actions["a"].gpus == (0, 1)
    command = a.channel.latest()
    assert command is not None and [s.name for s in command.placement or []] == ["n0", "n0"]


def test_a_run_the_smaller_cluster_cannot_guarantee_is_said_to_carry_on_best_effort(tmp_path: Path) -> None:
    overhead = RestartOverhead(0.5, 0.5, 0.0)
    before = _cluster("n0", "n1")
    sched = Scheduler(ElasticFlowPolicy(Topology(1, 2, 2), interval=2.0, overhead=overhead), locate=before.locate)
    a = _run(tmp_path, "a", 64 * 100, T0 + 120)  # only 4 GPUs make it
    sched.arrive(a)
    assert sched.plan(T0).decisions[0].admitted  # type: ignore[union-attr]
    sched.actuate(T0)
    _ack(a)
    after = _cluster("n0")
    sched.rebase(ElasticFlowPolicy(Topology(1, 1, 2), interval=2.0, overhead=overhead), renumbering(before, after))
    result = sched.plan(T0 + 10)
    assert result is not None and result.downgraded == [a]
    assert a.job.deadline is None  # planned best-effort from here on; never rejected
    assert sched.plan(T0 + 12) is not None and not sched.plan(T0 + 14).downgraded  # type: ignore[union-attr]
