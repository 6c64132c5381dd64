"""A change of nodes, as the control loop takes it: every admitted run is
re-planned on the new cluster, and a run that had GPUs on a lost node waits
for a new placement."""

from __future__ import annotations

from scheduler_service.loop.actions import Admitted, GuaranteeLost, Launch, Rebased, Rescale
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
    assert isinstance(lost, Rebased) and lost.run_id == "a" and lost.lost and lost.held == (0, 1)
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


def test_a_run_on_the_node_that_stays_is_told_its_gpus_new_ids_when_the_first_node_goes() -> None:
    """Ids are positions: with the first node gone the second node's GPUs 2, 3
    are 0, 1. The run that trains there loses nothing, and what it holds must
    be re-recorded under the new ids, or a GPU that joins as 2 or 3 is given
    to another run while the records still say it is this one's."""
    d = Driver(gpus=2, nodes=2)
    d.arrive(job("a", T0, 20 * 1000, T0 + 3600, CURVE))
    d.arrive(job("b", T0, 20 * 1000, T0 + 3600, CURVE))
    launches = d.new(d.step(T0), Launch)
    d.ack("a", T0)
    d.ack("b", T0)
    on_second = next(run for run, launch in launches.items() if min(launch.gpus) >= 2)
    on_first = "b" if on_second == "a" else "a"
    rebased = {a.run_id: a for a in d.handle(ClusterChanged(Topology(1, 1, 2), {2: 0, 3: 1}), T0 + 10)}
    assert isinstance(rebased[on_second], Rebased) and not rebased[on_second].lost
    assert rebased[on_second].held == tuple(g - 2 for g in launches[on_second].gpus)
    assert rebased[on_first].lost and rebased[on_first].held == ()
