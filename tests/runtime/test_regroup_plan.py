"""Who stays, joins and leaves at a resize in place: `regroup.plan_regroup`,
the one rule both transports follow (pure, no process)."""

from __future__ import annotations

from flows.training.control import GpuSlot
from flows.training.orders import Seat, rank_orders
from flows.training.regroup import plan_regroup


def _here(gpus: list[int]) -> list[tuple[int, int]]:
    """Ranks on one machine: a GPU is its own slot."""
    return [(g, g) for g in gpus]


def test_ranks_on_gpus_that_stay_go_on_first_newcomers_take_the_rest_and_the_others_leave() -> None:
    plan = plan_regroup(_here([0, 1, 2, 3]), _here([2, 3, 4]))
    assert (plan.stay, plan.joining, plan.leaving) == ([2, 3], [2], [0, 1])
    seats = [Seat("localhost", "lo", g) for g in (2, 3, 4)]
    orders = rank_orders(seats, "127.0.0.1", 29500, "cpu", 0.0, [2, 3, 4])
    word = plan.word(1, orders, old_world=4)
    # the new rank 0 is the old rank 2, which stayed and so holds the state to broadcast
    assert word.round == 1 and word.spec_file == "spec-1.json"
    assert word.orders == {0: None, 1: None, 2: orders[0], 3: orders[1]}


def test_a_grow_keeps_every_rank_and_a_move_to_other_gpus_keeps_none() -> None:
    grown = plan_regroup(_here([4, 5]), _here([4, 5, 6, 7]))
    assert (grown.stay, grown.joining, grown.leaving) == ([0, 1], [2, 3], [])
    moved = plan_regroup(_here([0, 1]), _here([2, 3]))
    assert moved.stay == [] and moved.leaving == [0, 1]  # no resize in place: they save, a new segment starts


def test_on_a_cluster_a_gpu_id_stays_only_at_the_same_slot() -> None:
    a0, a1 = (GpuSlot(name="a", node="node-a", ip="10.0.0.1", index=i) for i in (0, 1))
    b0 = GpuSlot(name="b", node="node-b", ip="10.0.0.2", index=0)
    # GPU 1 now names a device on another node (the cluster changed): its rank cannot stay
    plan = plan_regroup([(0, a0), (1, a1)], [(0, a0), (1, b0)])
    assert (plan.stay, plan.joining, plan.leaving) == ([0], [1], [1])
