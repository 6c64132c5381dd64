"""A change of nodes, as the control loop takes it: every admitted run is
re-planned on the new cluster, and a run that had GPUs on a lost node waits
for a new placement."""

from __future__ import annotations

from scheduler_service.loop.actions import Admitted, GpusLost, GuaranteeLost, Launch, Rescale
from scheduler_service.loop.events import ClusterChanged
from scheduler_service.policy import ThroughputCurve, Topology
from tests.loop.driver import T0, Driver, job

CURVE = ThroughputCurve({1: 20.0, 2: 36.0, 4: 64.0})
N1_GONE = {0: 0, 1: 1}  # two nodes of two GPUs; the second one is gone


def _on_both_nodes(iterations: float, deadline: float) -> Driver:
    d = Driver(gpus=2, nodes=2)
    d.arrive(job("a", T0, iterations, deadline, CURVE))
    d.new(d.step(T0), Launch)
    d.ack("a", T0)
    assert len(d.loop.runs["a"].held) == 4
    return d


def test_a_lost_node_replans_every_run_and_the_run_that_had_gpus_there_waits_for_a_new_placement() -> None:
    d = _on_both_nodes(64 * 100, T0 + 300)  # needs 4 GPUs for 100 s, or 2 for 178 s
    (lost,) = d.handle(ClusterChanged(Topology(1, 1, 2), N1_GONE), T0 + 10)
    assert isinstance(lost, GpusLost) and lost.run_id == "a"
    a = d.loop.view("a", T0 + 10)
    assert a is not None and a.held == (0, 1)  # the first node's GPUs stay held until it acknowledges
    actions = d.step(T0 + 10)
    # 2 GPUs for what is left still meets its deadline: it keeps its guarantee.
    assert not d.new(actions, GuaranteeLost) and d.new(actions, Admitted)["a"].guaranteed
    assert d.new(actions, Rescale)["a"].gpus == (0, 1)
    assert d.loop.topology.num_gpus == 2


def test_a_run_the_smaller_cluster_cannot_guarantee_is_said_to_carry_on_best_effort() -> None:
    d = _on_both_nodes(64 * 100, T0 + 120)  # only 4 GPUs make it
    d.handle(ClusterChanged(Topology(1, 1, 2), N1_GONE), T0 + 10)
    assert "a" in d.new(d.step(T0 + 10), GuaranteeLost)
    assert d.loop.view("a", T0 + 10).plan_deadline is None  # type: ignore[union-attr]  # best-effort, never rejected
    assert not d.new(d.step(T0 + 12), GuaranteeLost) and not d.new(d.step(T0 + 14), GuaranteeLost)


def test_a_node_that_joins_is_used_at_the_next_plan() -> None:
    d = Driver(gpus=2, nodes=1)
    d.arrive(job("a", T0, 64 * 1000, T0 + 3600, CURVE))
    d.step(T0)
    d.ack("a", T0)
    d.handle(ClusterChanged(Topology(1, 2, 2), {0: 0, 1: 1}), T0 + 5)
    grow = d.new(d.step(T0 + 5), Rescale)["a"]
    assert len(grow.gpus) == 4
