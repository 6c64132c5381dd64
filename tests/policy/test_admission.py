"""Admission control and allocation through the policy's one entry point."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.policy import (
    Job, JobStatus, RejectionReason, SchedulingRequest, ThroughputCurve, Topology, make_policy,
)

CURVE = ThroughputCurve({1: 1.0, 2: 1.9, 4: 3.4, 8: 5.5})
TOPO = Topology(1, 1, 8)


def job(job_id, iterations, deadline, submit=0.0, curve=CURVE):
    return Job(job_id, submit, iterations, deadline, curve)


def test_feasible_job_is_admitted_with_its_minimum_share_and_a_finish_before_the_deadline():
    policy = make_policy("elasticflow", TOPO)
    reply = policy.schedule(SchedulingRequest(0.0, [job("a", 3600, 7200)]))
    (decision,) = reply.decisions
    assert decision.admitted and decision.guaranteed
    assert decision.share == 1
    assert decision.guaranteed_finish <= 7200
    assert reply.allocation["a"] == 8  # alone: the spare GPUs go to it
    assert reply.projected_finish["a"] < 7200


def test_deadline_in_the_past_is_rejected_with_that_reason():
    policy = make_policy("elasticflow", TOPO)
    (decision,) = policy.schedule(SchedulingRequest(600.0, [job("a", 10, 300)])).decisions
    assert not decision.admitted and decision.reason is RejectionReason.DEADLINE_PASSED
    # what to resubmit with: later than now, no later than running alone from now would need
    assert 600.0 < decision.earliest_feasible_deadline <= 600.0 + 300 + 10 * 60


def test_too_much_work_even_alone_names_the_earliest_deadline_that_works():
    policy = make_policy("elasticflow", TOPO)
    (decision,) = policy.schedule(SchedulingRequest(0.0, [job("a", 5.5 * 3600, 1800)])).decisions
    assert decision.reason is RejectionReason.INFEASIBLE_ALONE
    earliest = decision.earliest_feasible_deadline
    assert 3600 < earliest <= 3600 + 5 * 60  # the work, a restart, a migration allowance
    again = make_policy("elasticflow", TOPO)
    assert again.schedule(SchedulingRequest(0.0, [job("a", 5.5 * 3600, earliest)])).decisions[0].admitted
    again = make_policy("elasticflow", TOPO)
    assert not again.schedule(SchedulingRequest(0.0, [job("a", 5.5 * 3600, earliest - 60)])).decisions[0].admitted


def test_a_busy_cluster_rejects_with_capacity_reason_and_an_admissible_deadline():
    policy = make_policy("elasticflow", TOPO)
    first = job("big", 5.5 * 7000, 7400)  # needs the whole cluster almost to its deadline
    assert policy.schedule(SchedulingRequest(0.0, [first])).decisions[0].admitted
    late = job("late", 3000, 3600)
    status = {"big": JobStatus(5.5 * 7000, 8, 0.0)}
    (decision,) = policy.schedule(SchedulingRequest(0.0, [late], status=status)).decisions
    assert not decision.admitted and decision.reason is RejectionReason.INSUFFICIENT_CAPACITY
    assert "reserved" in decision.message
    retry = job("late2", 3000, decision.earliest_feasible_deadline)
    status["late"] = JobStatus(3000)
    assert policy.schedule(SchedulingRequest(0.0, [retry], status=status)).decisions[0].admitted


def test_best_effort_never_takes_what_a_deadline_job_planned():
    policy = make_policy("elasticflow", TOPO)
    reply = policy.schedule(SchedulingRequest(0.0, [job("be", 1e6, None), job("d", 5.5 * 3000, 3400)]))
    assert all(d.admitted for d in reply.decisions)
    assert reply.allocation["d"] == 8 and reply.allocation["be"] == 0


def test_spare_gpus_go_where_they_cost_the_least_extra_gpu_time():
    linear = ThroughputCurve({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0})
    flat = ThroughputCurve({1: 1.0, 2: 1.2, 4: 1.3, 8: 1.35})
    policy = make_policy("elasticflow", Topology(1, 3, 4))  # 12 GPUs
    reply = policy.schedule(SchedulingRequest(0.0, [
        job("linear", 1000, 1e6, curve=linear), job("flat", 1000, 1e6, curve=flat),
    ]))
    # Doubling the linear job is free in GPU-time; the flat one only gets what is left.
    assert reply.allocation == {"linear": 8, "flat": 4}


def test_edf_runs_the_requested_width_in_deadline_order():
    policy = make_policy("edf", Topology(1, 1, 4))
    jobs = [Job("late", 0, 100, 9000, CURVE, requested_gpus=4), Job("soon", 0, 100, 500, CURVE, requested_gpus=2)]
    reply = policy.schedule(SchedulingRequest(0.0, jobs))
    assert reply.allocation == {"soon": 2, "late": 0}


def test_unknown_policy_is_named():
    with pytest.raises(ValueError, match="known: "):
        make_policy("fifo", TOPO)


def test_decisions_do_not_depend_on_the_clock_origin():
    """The service passes epoch seconds (~1.8e9); float rounding must not change a decision."""
    from scheduler_service.policy.overhead import RestartOverhead

    def decide(origin):
        policy = make_policy("elasticflow", Topology(1, 1, 2), interval=2.0)
        policy.clock = type(policy.clock)(2.0, RestartOverhead(0.5, 0.5, 0.0))
        out, status, work = [], {}, {}
        for k, (iters, window) in enumerate([(720, 40), (900, 30), (100, 10), (5000, 400), (300, 9)]):
            now = origin + 2.0 * k
            job = Job(str(k), now, iters, now + window, ThroughputCurve({1: 20, 2: 36}))
            reply = policy.schedule(SchedulingRequest(now, [job], status=status))
            d = reply.decisions[0]
            work[job.job_id] = iters  # nothing trains here: every admitted job keeps all its work
            status = {j: JobStatus(work[j], g) for j, g in reply.allocation.items()}
            earliest = None if d.earliest_feasible_deadline is None else d.earliest_feasible_deadline - origin
            out.append((d.admitted, d.reason, d.share, earliest, dict(reply.allocation)))
        return out

    assert decide(0.0) == decide(1.8e9)


@settings(max_examples=50, deadline=None)
@given(runs=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 30), st.integers(1, 8)), max_size=20))
def test_the_timeline_stays_minimal_and_releases_exactly(runs):
    """Merging only where a change ends keeps no two neighbouring segments
    equal, and releasing what was reserved gives back the empty timeline."""
    from scheduler_service.policy.plan import Stretch
    from scheduler_service.policy.timeline import Timeline

    tl = Timeline(64)
    plan = [Stretch(s, s + n, g) for s, n, g in runs]
    tl.add(plan)
    used = [u for _, u in tl.segments()]
    assert all(a != b for a, b in zip(used, used[1:]))
    for slot in range(0, 90):
        assert 64 - tl.free_at(slot) == sum(r.gpus for r in plan if r.start <= slot < r.end)
    tl.add(plan, sign=-1)
    assert tl.segments() == [(0, 0)]


def test_beyond_the_full_re_plan_displacing_a_few_jobs_keeps_the_guarantee(monkeypatch):
    """Past REPLAN_ALL_UP_TO admitted jobs a newcomer that does not fit is
    re-planned only with a few jobs due after it; admitted jobs still meet
    their deadlines."""
    import random

    from scheduler_service.policy import elasticflow
    from scheduler_service.simulator.engine import simulate
    from scheduler_service.simulator.metrics import summarize

    monkeypatch.setattr(elasticflow, "REPLAN_ALL_UP_TO", 0)
    curve = ThroughputCurve({1: 1.0, 2: 1.9, 4: 3.5, 8: 6.0})
    for seed in range(4):
        rng = random.Random(seed)
        jobs, t = [], 0.0
        for i in range(40):
            t += rng.expovariate(1 / 600)
            duration = rng.uniform(600, 20_000)
            jobs.append(Job(str(i), t, duration * curve.speed(1), t + rng.uniform(0.5, 1.5) * duration, curve))
        result = summarize(simulate(jobs, make_policy("elasticflow", Topology(1, 1, 8), 60.0)))
        assert result.admitted_missed == 0
        assert result.admitted > 0 and result.rejected > 0


def test_the_re_plan_of_everyone_plans_the_job_that_cannot_wait_first_even_if_it_is_due_later():
    from scheduler_service.policy.admission import Candidate, Refused, Replanned, plan_all
    from scheduler_service.policy.overhead import PAPER_OVERHEAD
    from scheduler_service.policy.plan import SlotClock

    clock = SlotClock(60.0, PAPER_OVERHEAD)
    levels = CURVE.capped(8)
    # Due at 20 min, it needs the whole cluster for all but about 2 of them: little laxity.
    tight = job("tight", 5800, 1200.0)
    # Due at 10 min, it needs under 2 minutes of the whole cluster: much laxity, but due sooner.
    loose = job("loose", 550, 600.0)
    cands = [Candidate(j, JobStatus(j.iterations), levels) for j in (loose, tight)]
    assert cands[1].laxity(0.0) < cands[0].laxity(0.0)
    # Both do not fit. Deadline order would plan `loose` first and fail on `tight`;
    # least laxity plans `tight` and names `loose` as the one that cannot be planned.
    assert plan_all(cands, 0, 8, clock) == Refused("loose")
    replanned = plan_all(cands[1:], 0, 8, clock)
    assert isinstance(replanned, Replanned) and replanned.plans["tight"].share == 8


def test_a_job_that_placement_moved_is_re_planned_with_a_whole_migration_allowance_again():
    from scheduler_service.policy.admission import migration_allowance
    from scheduler_service.policy.plan import cover

    policy = make_policy("elasticflow", TOPO)
    a = job("a", 3600, 14_400.0)
    policy.schedule(SchedulingRequest(0.0, [a]))
    allowance = migration_allowance(a, policy.levels["a"], policy.clock)
    # A minute later its plan still holds every iteration, but a move has cost it most of its slack.
    remaining = cover(policy.plans["a"], CURVE, 1, 14_400.0, 1, 0.0, policy.clock) - allowance / 4
    status = {"a": JobStatus(remaining, 1)}
    assert cover(policy.plans["a"], CURVE, 1, 14_400.0, 1, 0.0, policy.clock) - remaining < allowance
    policy.moved = {"a"}
    policy.schedule(SchedulingRequest(60.0, [], status=status))
    assert cover(policy.plans["a"], CURVE, 1, 14_400.0, 1, 0.0, policy.clock) - remaining >= allowance
    assert policy.timeline.free_at(1) + policy.plans["a"].gpus_at(1) == 8  # the old plan was released


def test_a_moved_job_with_no_room_alone_takes_its_allowance_back_from_a_job_due_later():
    """ITP cluster04 on 128 GPUs, bare `elasticflow`: a bert job was moved
    while the cluster was fully planned, so it could not be re-planned alone
    with a new allowance; it ran on what was left of it, was pinned, and the
    next forced move made it miss by 218 iterations. Here the job due later
    (b) holds every GPU the moved job (a) could use: a gets its whole
    allowance back from b's plan, and b keeps its guarantee."""
    from scheduler_service.policy.admission import migration_allowance
    from scheduler_service.policy.plan import cover

    curve = ThroughputCurve({1: 1.0, 2: 1.9, 4: 3.5})
    policy = make_policy("elasticflow", Topology(1, 1, 4))
    a, b = job("a", 1.9 * 3450, 3600.0, curve=curve), job("b", 100_000, 40_000.0, curve=curve)
    policy.schedule(SchedulingRequest(0.0, [a, b]))
    assert policy.timeline.free_at(10) == 0  # a on 2 GPUs, b on the other 2 while a runs
    clock, restart = policy.clock, policy.clock.overhead(2)
    allowance = migration_allowance(a, policy.levels["a"], clock)
    # Ten minutes in, a move has cost a all but 10 iterations of its slack.
    remaining = cover(policy.plans["a"], curve, 10, a.deadline, 2, restart, clock) - 10
    status = {"a": JobStatus(remaining, 2, restart), "b": JobStatus(b.iterations - 1.9 * (600 - restart), 2)}
    policy.were_moved({"a"})
    policy.schedule(SchedulingRequest(600.0, [], status=status))
    assert cover(policy.plans["a"], curve, 10, a.deadline, 2, restart, clock) - remaining >= allowance
    assert "b" in policy.guaranteed
    assert cover(policy.plans["b"], curve, 10, b.deadline, 2, 0.0, clock) >= status["b"].remaining


def test_a_job_that_fell_behind_its_plan_is_re_planned_and_keeps_the_spare_gpus_it_runs_on():
    """In the service a launch can take longer than the restart the plan
    charged. The job has then fallen behind its plan; re-planned on the free
    cluster it keeps the 4 GPUs it started on instead of dropping to the 2 its
    old plan held now and growing back later (two needless resizes)."""
    from scheduler_service.policy.overhead import RestartOverhead
    from scheduler_service.policy.plan import cover

    curve = ThroughputCurve({1: 10.0, 2: 19.0, 4: 36.0})
    policy = make_policy("elasticflow", Topology(1, 1, 4), interval=2.0)
    policy.clock = type(policy.clock)(2.0, RestartOverhead(0.5, 0.5, 0.0))
    reply = policy.schedule(SchedulingRequest(0.0, [job("a", 3000, 150.0, curve=curve)]))
    assert reply.decisions[0].share == 4 and policy.plans["a"].gpus_at(0) == 2  # the level below first
    assert reply.allocation == {"a": 4}  # the rest of the idle cluster on top
    for now in (2.0, 4.0, 6.0):  # still starting: no iteration done yet
        reply = policy.schedule(SchedulingRequest(now, [], status={"a": JobStatus(3000, 4)}))
        assert reply.allocation == {"a": 4}
    assert cover(policy.plans["a"], curve, 3, 150.0, 4, 0.0, policy.clock) >= 3000


def test_a_refused_job_leaves_nothing_behind_in_the_policy():
    policy = make_policy("elasticflow", TOPO)
    policy.schedule(SchedulingRequest(0.0, [job("a", 5.5 * 6800, 7200)]))  # takes the cluster
    refused = [job(f"r{i}", 5.5 * 6800, 7200, submit=1.0) for i in range(50)]
    decisions = policy.schedule(SchedulingRequest(1.0, refused, status={"a": JobStatus(5.5 * 6800, 8)})).decisions
    assert not any(d.admitted for d in decisions)
    assert set(policy.jobs) == {"a"} and set(policy.levels) == {"a"} and set(policy.plans) == {"a"}


def test_a_job_past_its_deadline_keeps_its_gpus_rather_than_lend_them_to_extra_width():
    """CI: a run a few seconds late was parked so that a guaranteed run with
    25 minutes to spare could run on both GPUs, and waited for all of it."""
    curve = ThroughputCurve({1: 20.0, 2: 36.0})
    policy = make_policy("elasticflow", Topology(1, 1, 2), interval=2.0)
    long, late = job("long", 20_000, 1800, curve=curve), job("late", 680, 200, curve=curve)
    assert all(d.admitted for d in policy.schedule(SchedulingRequest(0.0, [long, late], status={})).decisions)
    status = {"long": JobStatus(19_000, 0), "late": JobStatus(91, 2)}  # late trained slower than planned
    reply = policy.schedule(SchedulingRequest(250.0, [], status=status))
    assert reply.allocation["late"] == 2 and reply.allocation["long"] == 0
    status = {"long": JobStatus(19_000, 0)}  # once it is done, the guaranteed run takes both
    assert policy.schedule(SchedulingRequest(260.0, [], finished=["late"], status=status)).allocation["long"] == 2


def test_a_job_infeasible_alone_is_told_the_gpus_it_can_use_of_the_cluster_not_the_whole_cluster():
    """Issue 46: "even the whole cluster at 1 GPUs" on a 2-GPU cluster, for a
    model whose speed stops growing at 1 GPU."""
    policy = make_policy("elasticflow", Topology(1, 1, 2))
    flat = ThroughputCurve({1: 1.0, 2: 1.0})
    (decision,) = policy.schedule(SchedulingRequest(0.0, [job("a", 10_000, 600, curve=flat)])).decisions
    assert decision.reason is RejectionReason.INFEASIBLE_ALONE
    assert decision.message.startswith("even alone, on 1 GPU (the most it can use of 2), it cannot finish 10000 ")


def test_a_job_brought_back_from_spare_gpus_to_its_plan_gets_its_migration_allowance_checked_as_if_moved():
    """The grant's two restarts, there and back, are paid out of the job's
    slack as a move's is: ITP cluster06 (128 GPUs, through the loop) let a job
    that way go from 573 iterations of slack to 66, and the next forced move
    made it miss. Still on spare GPUs, it has paid only the first."""
    policy = make_policy("elasticflow", TOPO)
    assert policy.schedule(SchedulingRequest(0.0, [job("a", 2 * 3000, 4000)])).allocation == {"a": 8}
    assert policy.plans["a"].gpus_at(1) == 1
    running = {"a": JobStatus(2 * 3000 - 5.5 * 25, 8)}
    wider = policy.schedule(SchedulingRequest(60.0, [job("b", 1.9 * 3000, 3400, submit=60.0)], status=running))
    assert policy.plans["a"].gpus_at(1) < wider.allocation["a"] < 8 and policy.moved == set()

    policy = make_policy("elasticflow", TOPO)
    policy.schedule(SchedulingRequest(0.0, [job("a", 2 * 3000, 4000)]))
    busy = [job(name, speed * 3000, 3200, submit=60.0) for name, speed in (("b", 3.3), ("c", 1.85), ("d", 0.95))]
    back = policy.schedule(SchedulingRequest(60.0, busy, status=running))
    assert back.allocation["a"] == policy.plans["a"].gpus_at(1) < 8 and policy.moved == {"a"}
