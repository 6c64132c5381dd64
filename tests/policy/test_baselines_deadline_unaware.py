"""Tiresias, Gandiva and Themis on hand-made traces where their behaviour is known,
and all three on random traces: never double-book a GPU, always finish."""

import random

import pytest

from scheduler_service.policy import Job, JobStatus, SchedulingRequest, ThroughputCurve, Topology, make_policy
from scheduler_service.policy.baselines.themis import knapsack
from scheduler_service.policy.interface import SchedulingPolicy, SchedulingReply
from scheduler_service.policy.jobs import is_power_of_two
from scheduler_service.policy.overhead import PAPER_OVERHEAD
from scheduler_service.policy.registry import POLICIES
from scheduler_service.simulator.engine import simulate

CURVE = ThroughputCurve({1: 1.0, 2: 1.9, 4: 3.6, 8: 6.4})
FOUR = Topology(1, 1, 4)
BASELINES = ("tiresias", "gandiva", "themis")


def job(job_id, seconds_on_width, width, submit=0.0, deadline=None, curve=CURVE):
    """A job that needs `seconds_on_width` seconds of work on its requested `width` GPUs."""
    return Job(job_id, submit, seconds_on_width * curve.speed(width), deadline, curve, requested_gpus=width)


def finish_times(jobs, policy):
    run = simulate(jobs, policy)
    return {r.job.job_id: r for r in run.records}


def test_the_three_baselines_register_under_their_names():
    for name in BASELINES:
        assert POLICIES[name].name == name


# -- Tiresias -----------------------------------------------------------------

def test_tiresias_demotes_a_long_job_below_a_short_one_that_arrives_later():
    # 4 GPUs x 900 s = 3,600 GPU-seconds > 3,250: the long job is in the second queue
    # by the time the short one arrives, so the newcomer preempts it.
    long_job = job("long", 7200, 4)
    short = job("short", 300, 4, submit=1200)
    records = finish_times([long_job, short], make_policy("tiresias", FOUR))
    assert records["short"].finish < records["long"].finish
    assert records["short"].finish <= 1200 + PAPER_OVERHEAD(4) + 300 + 60
    assert records["long"].restarts == 2  # preempted, then resumed


def test_tiresias_does_not_preempt_a_job_still_in_the_top_queue():
    long_job = job("long", 7200, 4)
    short = job("short", 300, 4, submit=300)  # long has 1,200 GPU-seconds: both in queue 0
    records = finish_times([long_job, short], make_policy("tiresias", FOUR))
    demoted = 3250 / 4  # seconds on 4 GPUs until long leaves queue 0
    assert records["short"].finish >= demoted + 300  # short waited for the demotion
    assert records["short"].finish < records["long"].finish


def test_tiresias_promotes_a_starved_job_back_to_the_top_queue():
    policy = make_policy("tiresias", FOUR, promote_knob=1.0)
    policy.schedule(SchedulingRequest(0.0, [job("old", 7200, 4)]))
    reply = policy.schedule(SchedulingRequest(900.0, [job("new", 7200, 4, submit=900)]))
    assert reply.allocation == {"old": 0, "new": 4}  # old was demoted at 3,600 GPU-seconds
    assert policy.states["old"].queue == 1
    # old ran 900 s; after waiting as long again it is promoted and beats new (demoted by then).
    reply = policy.schedule(SchedulingRequest(1800.0))
    assert policy.states["old"].queue == 0 and policy.states["new"].queue == 1
    assert reply.allocation == {"old": 4, "new": 0}


# -- Gandiva ------------------------------------------------------------------

def test_gandiva_time_slices_two_jobs_that_do_not_fit_together():
    policy = make_policy("gandiva", FOUR)
    a, b = job("a", 3600, 4), job("b", 3600, 4)
    first = policy.schedule(SchedulingRequest(0.0, [a, b]))
    assert first.allocation == {"a": 4, "b": 0} and first.wake_at == 60.0
    status = {"a": JobStatus(a.iterations - 10, 4), "b": JobStatus(b.iterations)}
    second = policy.schedule(SchedulingRequest(60.0, status=status))
    assert second.allocation == {"a": 0, "b": 4} and second.wake_at == 120.0

    records = finish_times([a, b], make_policy("gandiva", FOUR))
    both_alone = 2 * 3600
    assert records["a"].finish > both_alone * 0.9 and records["b"].finish > both_alone * 0.9
    assert abs(records["a"].finish - records["b"].finish) < 180  # they progressed side by side
    assert records["a"].restarts > 10 and records["b"].restarts > 10


def test_gandiva_does_not_slice_when_everyone_fits():
    policy = make_policy("gandiva", Topology(1, 1, 8))
    reply = policy.schedule(SchedulingRequest(0.0, [job("a", 3600, 4), job("b", 3600, 4)]))
    assert reply.allocation == {"a": 4, "b": 4} and reply.wake_at is None


# -- Themis -------------------------------------------------------------------

def test_themis_gives_the_expired_lease_to_the_most_unfair_job():
    policy = make_policy("themis", FOUR)  # lease: 10 minutes
    a, b = job("a", 3600, 4), job("b", 3600, 4, submit=60)
    assert policy.schedule(SchedulingRequest(0.0, [a])).allocation == {"a": 4}
    ran = (60 - PAPER_OVERHEAD(4)) * CURVE.speed(4)
    reply = policy.schedule(SchedulingRequest(60.0, [b], status={"a": JobStatus(a.iterations - ran, 4)}))
    assert reply.allocation == {"a": 4, "b": 0}  # a holds its lease
    assert reply.wake_at == 600.0
    ran = (600 - PAPER_OVERHEAD(4)) * CURVE.speed(4)
    status = {"a": JobStatus(a.iterations - ran, 4), "b": JobStatus(b.iterations)}
    reply = policy.schedule(SchedulingRequest(600.0, status=status))
    rho = {j: policy.rho(policy.states[j], 600.0) for j in "ab"}
    assert rho["b"] > rho["a"]  # b has waited 9 minutes, a has run for 10
    assert reply.allocation == {"a": 0, "b": 4}


def test_themis_leftover_gpus_go_to_jobs_outside_the_visible_set():
    policy = make_policy("themis", Topology(1, 1, 8), fairness_knob=0.9)
    reply = policy.schedule(SchedulingRequest(0.0, [job(f"j{i}", 600 * (i + 1), 4) for i in range(3)]))
    assert sorted(reply.allocation.values()) == [0, 4, 4]  # one visible bidder, the rest work-conserving


def test_themis_lease_is_a_whole_number_of_intervals():
    assert make_policy("themis", FOUR, interval=240.0).lease == 720.0
    assert make_policy("themis", FOUR, interval=60.0, lease_s=90.0).lease == 120.0


def test_knapsack_maximizes_total_value_within_capacity():
    assert sorted(knapsack([(4, 1.0), (2, 0.7), (2, 0.6), (8, 5.0)], 4)) == [1, 2]
    assert knapsack([(8, 5.0)], 4) == []


# -- All three: safety on random traces -------------------------------------

def checked(name: str, topology: Topology, interval: float) -> SchedulingPolicy:
    """The policy, with every reply checked against the rules of the interface."""
    base = POLICIES[name]

    class Checked(base):
        def schedule(self, request: SchedulingRequest) -> SchedulingReply:
            reply = super().schedule(request)
            taken: set[int] = set()
            for job_id, gpus in reply.allocation.items():
                if not gpus:
                    assert job_id not in reply.placement.blocks
                    continue
                start, size = reply.placement.blocks[job_id]
                assert size == gpus and is_power_of_two(gpus) and start % size == 0
                gpu_ids = set(range(start, start + size))
                assert not gpu_ids & taken, f"{job_id} double-booked at t={request.now}"
                assert max(gpu_ids) < topology.num_gpus
                taken |= gpu_ids
            if reply.wake_at is not None:
                assert reply.wake_at > request.now
                assert reply.wake_at / interval == pytest.approx(round(reply.wake_at / interval))
            return reply

    return Checked(topology, interval=interval)


def random_trace(seed: int, count: int = 40) -> list[Job]:
    rng = random.Random(seed)
    curves = [CURVE, ThroughputCurve({1: 2.0, 2: 3.0, 4: 3.5}), ThroughputCurve({1: 0.5, 2: 1.0})]
    jobs, clock = [], 0.0
    for i in range(count):
        clock += rng.expovariate(1 / 400)
        curve = rng.choice(curves)
        width = rng.choice([1, 1, 2, 4, 8, 16])  # 16 is more than any curve measures
        seconds = rng.uniform(60, 5000)
        deadline = None if rng.random() < 0.2 else clock + seconds * rng.uniform(0.5, 3.0)
        speed = curve.speed(max(g for g in curve.points if g <= width))
        jobs.append(Job(f"j{i}", round(clock), seconds * speed, deadline, curve, requested_gpus=width))
    return jobs


@pytest.mark.parametrize("name", BASELINES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_traces_never_double_book_and_finish_every_job(name, seed):
    topology = Topology(1, 2, 4)
    jobs = random_trace(seed)
    run = simulate(jobs, checked(name, topology, 60.0))
    assert all(r.finish is not None and r.remaining == 0 for r in run.records)
    largest = {j.job_id: max(j.curve.points) for j in jobs}
    assert all(r.peak_gpus <= min(largest[r.job.job_id], r.job.requested_gpus) for r in run.records)


@pytest.mark.parametrize("name", BASELINES)
def test_simulation_is_deterministic(name):
    jobs = random_trace(7)
    first = simulate(jobs, make_policy(name, Topology(1, 2, 4)))
    again = simulate(jobs, make_policy(name, Topology(1, 2, 4)))
    assert [r.finish for r in first.records] == [r.finish for r in again.records]
