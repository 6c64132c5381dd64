"""Clusters of several GPU kinds: which kind a job goes to, and what it is told."""

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.inputfiles import InputError, cluster_speeds, load_cluster
from scheduler_service.policy import Job, JobStatus, RejectionReason, SchedulingRequest, ThroughputCurve, make_policy
from scheduler_service.policy.kinds import KindOrder
from scheduler_service.policy.topology import MixedTopology, Topology

FAST = ThroughputCurve({1: 5.0, 2: 9.5, 4: 17.0, 8: 30.0})
SLOW = ThroughputCurve({1: 1.0, 2: 1.9, 4: 3.4, 8: 6.0})
MIXED = MixedTopology.of([("A100", Topology(1, 1, 8)), ("T4", Topology(1, 2, 4))])


def job(job_id, iterations, deadline, submit=0.0, kinds=("A100", "T4")):
    curves = tuple((k, {"A100": FAST, "T4": SLOW}[k]) for k in kinds)
    return Job(job_id, submit, iterations, deadline, curves[0][1], kind=curves[0][0], curves=curves)


def kind_of_block(reply, job_id):
    first, size = reply.placement.blocks[job_id]
    kinds = {MIXED.kind_of(g) for g in range(first, first + size)}
    assert len(kinds) == 1, "a job's GPUs lie in one pool"
    return kinds.pop()


def test_gpu_ids_number_the_pools_one_after_the_other():
    assert MIXED.num_gpus == 16 and MIXED.num_nodes == 3 and MIXED.max_job_gpus == 8
    assert [MIXED.kind_of(g) for g in (0, 7, 8, 15)] == ["A100", "A100", "T4", "T4"]
    assert [MIXED.node_of(g) for g in (0, 7, 8, 11, 12)] == [0, 0, 1, 1, 2]
    with pytest.raises(ValueError, match="distinct"):
        MixedTopology.of([("A100", Topology(1, 1, 8)), ("A100", Topology(1, 1, 4))])


def test_a_wide_window_goes_to_the_slow_kind_and_a_tight_one_to_the_fast_kind():
    policy = make_policy("elasticflow", MIXED)
    loose, tight = job("loose", 3600, 4 * 3600), job("tight", 25 * 3600, 3600)
    reply = policy.schedule(SchedulingRequest(0.0, [loose, tight]))
    assert all(d.admitted and d.guaranteed for d in reply.decisions)
    assert kind_of_block(reply, "loose") == "T4"  # 1 it/s on T4 meets 4 h; A100 stays free
    assert kind_of_block(reply, "tight") == "A100"  # 6.9 it/s needed: only A100 can
    assert policy.speed(loose, 1) == pytest.approx(SLOW.speed(1))


def test_cheapest_first_puts_the_loose_job_on_the_fast_kind():
    policy = make_policy("elasticflow", MIXED, kind_order=KindOrder.LEAST_SHARE)
    reply = policy.schedule(SchedulingRequest(0.0, [job("loose", 3600, 4 * 3600)]))
    assert kind_of_block(reply, "loose") == "A100"


def test_a_job_with_a_curve_on_one_kind_only_runs_there():
    policy = make_policy("elasticflow", MIXED)
    reply = policy.schedule(SchedulingRequest(0.0, [job("t4-only", 100, 3600, kinds=("T4",)),
                                                    job("a100-only", 100, 3600, kinds=("A100",))]))
    assert kind_of_block(reply, "t4-only") == "T4" and kind_of_block(reply, "a100-only") == "A100"


def test_a_rejection_names_every_kind_tried_and_the_earliest_deadline_of_any():
    policy = make_policy("elasticflow", MIXED)
    (decision,) = policy.schedule(SchedulingRequest(0.0, [job("huge", 40 * 3600, 3600)])).decisions
    assert not decision.admitted and decision.reason is RejectionReason.INFEASIBLE_ALONE
    assert "tried T4, A100" in decision.message and "on A100:" in decision.message and "on T4:" in decision.message
    alone_on_a100 = 40 * 3600 / 30.0
    assert alone_on_a100 <= decision.earliest_feasible_deadline <= alone_on_a100 + 2 * 60 + 120


def test_a_full_fast_kind_is_not_reported_as_infeasible_because_the_slow_kind_is_too_slow():
    policy = make_policy("elasticflow", MIXED)
    first = job("first", 29 * 3600, 3600 + 600)  # needs all 8 A100 for the hour
    policy.schedule(SchedulingRequest(0.0, [first]))
    (decision,) = policy.schedule(SchedulingRequest(0.0, [job("second", 29 * 3600, 3600 + 600)],
                                                    status={"first": JobStatus(first.iterations)})).decisions
    assert not decision.admitted
    assert decision.reason is RejectionReason.INSUFFICIENT_CAPACITY  # true of A100; T4 alone would say infeasible


def test_a_job_moves_to_the_slow_kind_to_let_in_one_only_the_fast_kind_can_run():
    policy = make_policy("elasticflow", MIXED, kind_order=KindOrder.LEAST_SHARE, kind_moves=True)
    mover = job("mover", 20_000, 4200)  # 11 min on 8 A100; 56 min on 8 T4; after the newcomer, too late on A100
    reply = policy.schedule(SchedulingRequest(0.0, [mover]))
    assert kind_of_block(reply, "mover") == "A100"  # cheapest there
    status = {"mover": JobStatus(mover.iterations, reply.allocation["mover"], 0.0, "A100")}
    newcomer = job("newcomer", 0.95 * 30 * 3600, 3600 + 300, kinds=("A100",))  # every A100 for the hour
    reply = policy.schedule(SchedulingRequest(0.0, [newcomer], status=status))
    (decision,) = reply.decisions
    assert decision.admitted and decision.guaranteed and "after run mover moved to T4" in decision.message
    assert kind_of_block(reply, "newcomer") == "A100" and kind_of_block(reply, "mover") == "T4"
    assert "mover" in reply.placement.moved
    # Next step: still on A100 GPUs (its move not carried out yet), so T4 plans it a full start.
    status["newcomer"] = JobStatus(newcomer.iterations, 8, 0.0, "A100")
    reply = policy.schedule(SchedulingRequest(60.0, status=status))
    assert kind_of_block(reply, "mover") == "T4" and policy.speed(mover, 8) == pytest.approx(SLOW.speed(8))


def test_a_move_that_fails_changes_nothing():
    def run(moves):
        policy = make_policy("elasticflow", MIXED, kind_order=KindOrder.LEAST_SHARE, kind_moves=moves)
        mover = job("mover", 20_000, 3000)  # 56 min on 8 T4: too slow there
        reply = policy.schedule(SchedulingRequest(0.0, [mover]))
        status = {"mover": JobStatus(mover.iterations, reply.allocation["mover"], 0.0, "A100")}
        newcomer = job("newcomer", 0.95 * 30 * 3600, 3600 + 300, kinds=("A100",))
        return policy.schedule(SchedulingRequest(0.0, [newcomer], status=status))

    with_moves, without = run(True), run(False)
    assert not with_moves.decisions[0].admitted
    assert with_moves.decisions[0].reason is RejectionReason.INSUFFICIENT_CAPACITY
    assert (with_moves.allocation, with_moves.placement.blocks) == (without.allocation, without.placement.blocks)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.05, 3.0), st.floats(1.2, 6.0), st.integers(0, 3)), min_size=1, max_size=8),
       st.booleans())
def test_every_admitted_job_is_planned_to_finish_by_its_deadline_on_one_kind(specs, moves):
    policy = make_policy("elasticflow", MIXED, kind_moves=moves)
    jobs = [job(f"j{i}", hours * 3600 * 5.0, hours * 3600 * slack, submit=0.0,
                kinds=(("A100", "T4"), ("A100",), ("T4",), ("T4", "A100"))[which])
            for i, (hours, slack, which) in enumerate(specs)]
    reply = policy.schedule(SchedulingRequest(0.0, jobs))
    for decision in reply.decisions:
        if decision.admitted:
            assert decision.guaranteed_finish <= jobs[int(decision.job_id[1:])].deadline + 1e-6
            if reply.allocation.get(decision.job_id):
                kind_of_block(reply, decision.job_id)
    used = [g for j, (first, size) in reply.placement.blocks.items() for g in range(first, first + size)]
    assert len(used) == len(set(used)), "no GPU is given twice"


def test_a_mixed_cluster_file_has_one_row_per_kind(tmp_path):
    path = tmp_path / "mixed.csv"
    path.write_text("gpu_kind,num_switch,num_node_p_switch,num_gpu_p_node,relative_speed\n"
                    "A100,1,2,8,1.0\nT4,1,4,4,0.2\n")
    topology = load_cluster(path)
    assert isinstance(topology, MixedTopology) and topology.kinds == ("A100", "T4")
    assert topology.num_gpus == 32 and cluster_speeds(path) == {"A100": 1.0, "T4": 0.2}
    path.write_text("gpu_kind,num_switch,num_node_p_switch,num_gpu_p_node,relative_speed\nA100,1,2,8,fast\n")
    with pytest.raises(InputError, match="row 2, field 'relative_speed'"):
        cluster_speeds(path)
    path.write_text("gpu_kind,num_switch,num_node_p_switch,num_gpu_p_node\nA100,1,2,8\nA100,1,1,4\n")
    with pytest.raises(InputError, match="row 3, field 'gpu_kind'.*twice"):
        load_cluster(path)


def test_the_shipped_mixed_cluster_is_the_a100_nodes_beside_as_many_t4_nodes():
    data = Path(__file__).resolve().parents[2] / "data" / "clusters"
    topology = load_cluster(data / "mixed_n8g8_A100_n8g8_T4.csv")
    assert topology.describe() == "A100: 1 switch x 8 nodes x 8 GPUs = 64 GPUs + T4: 1 switch x 8 nodes x 8 GPUs = 64 GPUs"


def test_a_job_measured_on_no_kind_of_the_cluster_is_told_so():
    policy = make_policy("elasticflow", MIXED)
    lone = Job("v100", 0.0, 100, 3600, FAST, kind="V100", curves=(("V100", FAST),))
    (decision,) = policy.schedule(SchedulingRequest(0.0, [lone])).decisions
    assert not decision.admitted and decision.reason is RejectionReason.NO_USABLE_GPU_COUNT
    assert "on any GPU kind here (A100, T4)" in decision.message and policy.jobs == {}
