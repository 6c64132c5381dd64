"""elasticflow-overload: price-threshold admission.

What it must keep from the paper's policy: decisions at arrival and a
guarantee that holds (exact throughputs, restarts charged). What it adds:
under overload it turns away a job whose plan would hold much capacity in an
already busy window, so that more jobs meet their deadlines.
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_service.policy import Job, JobStatus, RejectionReason, SchedulingRequest, ThroughputCurve, Topology, make_policy
from scheduler_service.policy.overhead import NO_OVERHEAD, PAPER_OVERHEAD
from scheduler_service.policy.overload import ElasticFlowOverload
from scheduler_service.policy.plan import cover
from scheduler_service.simulator.engine import simulate
from scheduler_service.simulator.metrics import summarize

CURVES = [
    ThroughputCurve({1: 1.0, 2: 1.9, 4: 3.5, 8: 6.0, 16: 8.0}),
    ThroughputCurve({1: 2.0, 2: 3.0, 4: 3.6, 8: 3.8}),
    ThroughputCurve({1: 0.5, 2: 1.0, 4: 1.9, 8: 3.7, 16: 7.0, 32: 12.0}),
]
LINEAR = ThroughputCurve({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0})
HOUR = 3600.0


def generated(seed: int, load: float, jobs: int = 40) -> tuple[Topology, list[Job]]:
    """The paper's synthetic recipe in small: Poisson arrivals, mostly 1-GPU
    jobs, two-mode durations, deadline = submit + U(0.5, 1.5) x duration."""
    rng = random.Random(seed)
    topo = Topology(1, 2, 8)
    out, t = [], 0.0
    for i in range(jobs):
        t += rng.expovariate(load / 1800)
        curve = rng.choice(CURVES)
        gpus = rng.choices([1, 2, 4, 8], [0.83, 0.03, 0.04, 0.10])[0]
        duration = 60 * 10 ** (rng.uniform(1, 2.5) if rng.random() < 0.8 else rng.uniform(2.5, 3.6))
        deadline = t + rng.uniform(0.5, 1.5) * duration
        out.append(Job(str(i), t, duration * curve.speed(min(gpus, 8)), deadline, curve, requested_gpus=gpus))
    return topo, out


def test_it_is_built_by_name_like_the_paper_policy():
    policy = make_policy("elasticflow-overload", Topology(1, 1, 8), interval=30.0, overhead=NO_OVERHEAD)
    assert isinstance(policy, ElasticFlowOverload)
    assert policy.clock.interval == 30.0 and policy.clock.overhead is NO_OVERHEAD


@pytest.mark.parametrize("load", [0.5, 2.0, 6.0])
def test_admitted_jobs_meet_their_deadlines_across_loads(load):
    for seed in range(3):
        topo, jobs = generated(seed, load)
        result = summarize(simulate(jobs, make_policy("elasticflow-overload", topo, 60.0, overhead=PAPER_OVERHEAD)))
        assert result.admitted_missed == 0, (seed, load)
        assert result.admitted + result.rejected == result.jobs


def test_it_meets_at_least_as_many_as_the_paper_policy_under_overload():
    met = {"elasticflow": 0, "elasticflow-overload": 0}
    for seed in range(4):
        topo, jobs = generated(seed, 6.0, jobs=60)
        for name in met:
            met[name] += summarize(simulate(jobs, make_policy(name, topo, 60.0))).met_deadline
    assert met["elasticflow-overload"] >= met["elasticflow"]


def test_on_a_trace_with_a_known_optimum_it_finds_it():
    """8 GPUs for 10 hours. Four 1-GPU jobs take half of them for the whole
    window (9.5 h of work each); then one job wants the other half for the
    whole window (39.2 GPU-hours); then eight 1-GPU-hour jobs due within 2.5
    hours. In those 2.5 hours (20 GPU-hours) the long jobs must do at least
    8 + 9.2 GPU-hours, so with the big job at most 2 short ones fit (7 met);
    without it all 12 others are met. First-come admission takes the big one."""
    jobs = [Job(f"a{i}", 0.0, 0.95 * 10 * HOUR, 10 * HOUR, LINEAR) for i in range(4)]
    jobs.append(Job("b", 0.0, 4 * 0.98 * 10 * HOUR, 10 * HOUR, LINEAR))
    jobs += [Job(f"c{i}", 0.0, HOUR, 2.5 * HOUR, LINEAR) for i in range(8)]
    topo = Topology(1, 1, 8)

    overload = make_policy("elasticflow-overload", topo, 60.0, overhead=NO_OVERHEAD)
    reply = overload.schedule(SchedulingRequest(0.0, jobs))
    admitted = {d.job_id for d in reply.decisions if d.admitted}
    assert admitted == {j.job_id for j in jobs} - {"b"}
    big = next(d for d in reply.decisions if d.job_id == "b")
    assert big.reason is RejectionReason.WINDOW_IN_DEMAND and big.earliest_feasible_deadline > 10 * HOUR

    paper = make_policy("elasticflow", topo, 60.0, overhead=NO_OVERHEAD)
    paper_admitted = {d.job_id for d in paper.schedule(SchedulingRequest(0.0, jobs)).decisions if d.admitted}
    assert "b" in paper_admitted and len(paper_admitted) <= 7

    assert summarize(simulate(jobs, make_policy("elasticflow-overload", topo, 60.0, overhead=NO_OVERHEAD))).met_deadline == 12


def test_the_earliest_deadline_it_names_would_be_admitted():
    jobs = [Job(f"a{i}", 0.0, 0.95 * 10 * HOUR, 10 * HOUR, LINEAR) for i in range(4)]
    big = Job("b", 0.0, 4 * 0.98 * 10 * HOUR, 10 * HOUR, LINEAR)
    policy = make_policy("elasticflow-overload", Topology(1, 1, 8), 60.0, overhead=NO_OVERHEAD)
    decision = policy.schedule(SchedulingRequest(0.0, jobs + [big])).decisions[-1]
    assert not decision.admitted
    retry = Job("b2", 0.0, big.iterations, decision.earliest_feasible_deadline, LINEAR)
    status = {j.job_id: JobStatus(j.iterations) for j in jobs}
    assert policy.schedule(SchedulingRequest(0.0, [retry], status=status)).decisions[0].admitted


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 10_000), load=st.floats(0.5, 8.0), budget=st.sampled_from([30.0, 300.0, 3000.0]))
def test_an_admitted_job_is_never_displaced(seed, load, budget):
    """At every decision after its admission, a guaranteed job is still
    guaranteed and its plan still covers what it has left, whatever arrived."""
    topo, jobs = generated(seed, load, jobs=25)
    policy = make_policy("elasticflow-overload", topo, 60.0)
    policy.budget_s = budget
    admitted: set[str] = set()
    schedule = policy.schedule

    def checked(request):
        reply = schedule(request)
        admitted.update(d.job_id for d in reply.decisions if d.admitted)
        now_slot = policy.clock.slot_of(request.now)
        for job_id in admitted - set(request.finished):
            job = policy.jobs.get(job_id)
            if job is None or job.deadline <= request.now:
                continue
            assert job_id in policy.guaranteed
            st_ = request.status.get(job_id)
            if st_ is not None:
                plan = policy.plans[job_id]
                assert cover(plan, job.curve, now_slot, job.deadline, st_.gpus, st_.overhead_left,
                             policy.clock) >= st_.remaining * (1 - 1e-9)
        return reply

    policy.schedule = checked
    assert summarize(simulate(jobs, policy)).admitted_missed == 0


def test_a_job_turned_away_for_capacity_is_told_a_deadline_the_price_also_accepts():
    """Its earliest feasible deadline must pass this policy's price too, or a
    user who resubmits with it would be turned away again."""
    jobs = [Job("a", 0.0, 8 * 0.99 * 600, 600, LINEAR)]  # the whole cluster for 10 minutes
    late = Job("late", 0.0, 8 * 300, 600, LINEAR)  # 5 minutes of it, due with it
    policy = make_policy("elasticflow-overload", Topology(1, 1, 8), 60.0, overhead=NO_OVERHEAD)
    decision = policy.schedule(SchedulingRequest(0.0, jobs + [late])).decisions[-1]
    assert decision.reason is RejectionReason.INSUFFICIENT_CAPACITY
    retry = Job("retry", 0.0, late.iterations, decision.earliest_feasible_deadline, LINEAR)
    status = {j.job_id: JobStatus(j.iterations) for j in jobs}
    assert policy.schedule(SchedulingRequest(0.0, [retry], status=status)).decisions[0].admitted


def test_a_job_that_would_hold_the_whole_idle_cluster_for_days_pays_for_what_it_takes():
    """A run over half the cluster pays for its GPUs at the prices they
    reach as it takes them, not at the price of the slot before it came: on
    an idle cluster the old price of one job reserving all 16 GPUs for 40
    hours was 0 (on Alibaba's openb126 such a job held a 16-GPU cluster for
    46 hours while 19 later jobs were turned away). A narrow job as long
    stays free on an idle cluster."""
    topo, curve = Topology(1, 2, 8), ThroughputCurve({g: float(g) for g in (1, 2, 4, 8, 16)})
    giant = Job("giant", 0.0, 16 * 0.97 * 40 * HOUR, 40 * HOUR, curve)
    policy = make_policy("elasticflow-overload", topo, 60.0, overhead=NO_OVERHEAD)
    decision = policy.schedule(SchedulingRequest(0.0, [giant])).decisions[0]
    assert not decision.admitted and decision.reason is RejectionReason.WINDOW_IN_DEMAND
    assert "up to 16 of the 16 GPUs, in slots already 0% reserved" in decision.message
    assert decision.earliest_feasible_deadline > 40 * HOUR

    narrow = Job("narrow", 0.0, 0.97 * 40 * HOUR, 40 * HOUR, ThroughputCurve({1: 1.0}))
    policy = make_policy("elasticflow-overload", topo, 60.0, overhead=NO_OVERHEAD)
    assert policy.schedule(SchedulingRequest(0.0, [narrow])).decisions[0].admitted
