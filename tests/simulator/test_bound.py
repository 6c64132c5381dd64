"""The LP bound: never below what a policy achieves, tight where the optimum is known."""

import random

import pytest

from scheduler_service.policy import Job, ThroughputCurve, Topology, make_policy
from scheduler_service.simulator.bound import deadline_ratio_bound, least_gpu_time
from scheduler_service.simulator.engine import simulate
from scheduler_service.simulator.experiment import Experiment
from scheduler_service.simulator.metrics import summarize
from tests.conftest import DATA

LINEAR = ThroughputCurve({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0})
TOPO = Topology(1, 1, 8)


def test_two_jobs_that_each_need_the_whole_cluster_bound_at_one_half():
    jobs = [Job("a", 0, 8 * 3600, 3600, LINEAR), Job("b", 0, 8 * 3600, 3600, LINEAR)]
    assert deadline_ratio_bound(jobs, TOPO).bound == pytest.approx(0.5)


def test_jobs_in_disjoint_windows_all_fit():
    jobs = [Job(str(i), i * 3600, 8 * 3600, (i + 1) * 3600, LINEAR) for i in range(5)]
    result = deadline_ratio_bound(jobs, TOPO)
    assert result.bound == pytest.approx(1.0) and result.infeasible_alone == 0


def test_a_job_too_slow_even_alone_counts_as_missed():
    jobs = [Job("fast", 0, 100, 3600, LINEAR), Job("hopeless", 0, 9 * 3600, 3600, LINEAR)]
    result = deadline_ratio_bound(jobs, TOPO)
    assert result.infeasible_alone == 1 and result.bound == pytest.approx(0.5)


def test_least_gpu_time_mixes_two_counts_when_one_is_too_slow():
    concave = ThroughputCurve({1: 1.0, 2: 1.5})
    # 1 GPU needs 2 h, 2 GPUs need 1.33 h; in a 1.5 h window the cheapest mix
    # runs 1 GPU for 0.5 h and 2 GPUs for 1 h: 2.5 GPU-hours.
    job = Job("j", 0, 7200, 5400, concave)
    assert least_gpu_time(job, 8) == pytest.approx(2.5 * 3600)


@pytest.mark.parametrize("trace,cluster,gpu,interval", [
    ("elasticVpollux_e", "n16g4", "T4", 60.0), ("100jobs_1500lam", "n16g8", "A100", 240.0),
])
def test_bound_is_never_below_any_policy_on_shared_traces(trace, cluster, gpu, interval):
    exp = Experiment(DATA / "traces" / f"{trace}.csv", DATA / "clusters" / f"{cluster}.csv",
                     DATA / "throughputs" / gpu, interval)
    _, results = exp.run(["elasticflow", "edf", "edf-admit", "elasticflow-noadmit"])
    from scheduler_service.simulator.inputs import load_cluster, load_throughputs, load_trace
    jobs = load_trace(exp.trace, load_throughputs(exp.throughputs))
    bound = deadline_ratio_bound(jobs, load_cluster(exp.cluster)).bound
    assert all(r.deadline_ratio <= bound + 1e-9 for r in results)


@pytest.mark.parametrize("seed", range(6))
def test_bound_is_never_below_elasticflow_on_random_traces(seed):
    rng = random.Random(seed)
    curve = ThroughputCurve({1: 1.0, 2: 1.8, 4: 3.0, 8: 4.5})
    jobs, t = [], 0.0
    for i in range(30):
        t += rng.expovariate(1 / 900)
        duration = rng.uniform(600, 10_000)
        jobs.append(Job(str(i), t, duration * 1.8, t + rng.uniform(0.3, 1.5) * duration, curve, requested_gpus=2))
    ratio = summarize(simulate(jobs, make_policy("elasticflow", TOPO))).deadline_ratio
    assert ratio <= deadline_ratio_bound(jobs, TOPO).bound + 1e-9


def test_the_integral_bound_does_not_count_fractions_of_jobs():
    # Three jobs, each needing 6 of the 8 GPUs over the same hour: the LP meets
    # 8/6 of a job's worth of them (ratio 4/9); only one can really be met.
    jobs = [Job(str(i), 0, 6 * 3600, 3600, LINEAR) for i in range(3)]
    assert deadline_ratio_bound(jobs, TOPO).bound == pytest.approx(4 / 9)
    exact = deadline_ratio_bound(jobs, TOPO, integral=True, time_limit_s=30)
    assert exact.exact and exact.bound == pytest.approx(1 / 3) and len(exact.chosen) == 1


def test_the_best_schedule_is_achievable_and_within_both_bounds():
    """bench-free check of the diagnosis tool (simulator/exact.py): on a small
    random trace its best schedule meets every job it names, in whole slots
    of at most 8 GPUs, and lies under the integral bound, which lies under the LP."""
    from scheduler_service.simulator.exact import best_schedule

    rng = random.Random(3)
    curve = ThroughputCurve({1: 1.0, 2: 1.8, 4: 3.0, 8: 4.5})
    jobs, t = [], 0.0
    for i in range(12):
        t += rng.expovariate(1 / 600)
        duration = rng.uniform(600, 5000)
        jobs.append(Job(str(i), t, duration * 1.8, t + rng.uniform(0.5, 1.5) * duration, curve))
    lp = deadline_ratio_bound(jobs, TOPO).bound
    milp = deadline_ratio_bound(jobs, TOPO, integral=True, time_limit_s=30).bound
    best = best_schedule(jobs, TOPO, slot_s=300.0, time_limit_s=60)
    assert best.optimal and best.best == pytest.approx(best.proven)
    assert 0 < best.best <= milp + 1e-9 <= lp + 2e-9
    assert len(best.met) == round(best.best * len(jobs))
