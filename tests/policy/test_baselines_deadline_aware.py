"""Chronus and Pollux: admission, batch-size adaptation, the goodput data, and
no double booking on random traces, with the real simulator and HiGHS."""

import math
import random
import shutil

import pytest

from scheduler_service.policy import Job, ThroughputCurve, Topology, make_policy
from scheduler_service.policy.baselines.chronus_leases import Bucket, Demand, solve
from scheduler_service.policy.baselines.pollux import (
    GoodputModel,
    ModelGoodput,
    NoiseTrajectory,
    PolluxPolicy,
    StepTimes,
    best_batch,
)
from scheduler_service.policy.interface import RejectionReason, SchedulingPolicy, SchedulingReply, SchedulingRequest
from scheduler_service.policy.jobs import JobStatus
from scheduler_service.simulator.engine import simulate
from scheduler_service.simulator.inputs import InputError, load_throughputs
from scheduler_service.simulator.pollux_data import goodput_for, load_goodput, load_model
from tests.conftest import DATA

LINEAR = ThroughputCurve({1: 1.0, 2: 2.0, 4: 4.0})
CONCAVE = ThroughputCurve({1: 1.0, 2: 1.8, 4: 3.2, 8: 5.0})


def job(job_id, iterations, deadline, gpus=1, submit=0.0, curve=LINEAR, model="", batch=0):
    return Job(job_id=job_id, submit_time=submit, iterations=iterations, deadline=deadline, curve=curve,
               requested_gpus=gpus, model=model, batch_size=batch)


# -- Chronus -------------------------------------------------------------------

def test_chronus_admits_a_feasible_job_and_rejects_one_the_leases_cannot_hold():
    policy = make_policy("chronus", Topology(1, 1, 4), interval=60.0)
    first = job("a", 4 * 600, 1000.0, gpus=4)  # 600 s on all 4 GPUs, plus a restart
    second = job("b", 4 * 600, 1000.0, gpus=4)  # the same again: the cluster has no room
    hopeless = job("c", 10_000, 120.0, gpus=1)  # not even an idle cluster finishes it in time
    reply = policy.schedule(SchedulingRequest(0.0, [first, second, hopeless]))
    by_id = {d.job_id: d for d in reply.decisions}
    assert by_id["a"].admitted and by_id["a"].guaranteed and by_id["a"].share == 4
    assert not by_id["b"].admitted and by_id["b"].reason is RejectionReason.INSUFFICIENT_CAPACITY
    assert not by_id["c"].admitted and by_id["c"].reason is RejectionReason.INFEASIBLE_ALONE
    assert by_id["c"].earliest_feasible_deadline > 120.0 and by_id["b"].message
    later = by_id["b"].earliest_feasible_deadline  # after "a", which holds the cluster until ~660 s
    assert 1200.0 <= later <= 1500.0
    again = make_policy("chronus", Topology(1, 1, 4), interval=60.0)
    decisions = again.schedule(SchedulingRequest(0.0, [first, job("b", 4 * 600, later, gpus=4)])).decisions
    assert all(d.admitted for d in decisions)
    assert reply.allocation == {"a": 4}


def test_chronus_rejects_a_deadline_that_has_passed_and_keeps_best_effort_jobs():
    policy = make_policy("chronus", Topology(1, 1, 4), interval=60.0)
    late = job("late", 100, 30.0, submit=0.0)
    free = job("free", 100, None)
    reply = policy.schedule(SchedulingRequest(60.0, [late, free]))
    by_id = {d.job_id: d for d in reply.decisions}
    assert by_id["late"].reason is RejectionReason.DEADLINE_PASSED
    assert by_id["free"].admitted and not by_id["free"].guaranteed
    assert reply.allocation == {"free": 1}


def test_chronus_pads_run_time_estimates_by_its_margin():
    close = job("close", 4 * 1000, 1100.0, gpus=4)  # 1000 s + a 33 s restart: 6% to spare
    for margin, admitted in ((1.0, True), (1.1, False)):
        policy = make_policy("chronus", Topology(1, 1, 4), interval=60.0, lease_s=60.0, estimate_margin=margin)
        assert policy.schedule(SchedulingRequest(0.0, [close])).decisions[0].admitted is admitted


def test_chronus_lets_a_lease_run_to_its_end():
    policy = make_policy("chronus", Topology(1, 1, 4), interval=60.0, lease_s=240.0, estimate_margin=1.0)
    holder = job("holder", 4 * 600, 3000.0, gpus=4)
    assert policy.schedule(SchedulingRequest(0.0, [holder])).allocation == {"holder": 4}
    urgent = job("urgent", 4 * 300, 720.0, gpus=4, submit=60.0)  # needs the next two leases
    running = {"holder": JobStatus(4 * 540, 4)}
    mid = policy.schedule(SchedulingRequest(60.0, [urgent], status=running))
    assert mid.decisions[0].admitted and mid.allocation == {"holder": 4, "urgent": 0}
    assert mid.wake_at == 240.0  # the lease boundary where "urgent" is due
    running = {"holder": JobStatus(4 * 360, 4), "urgent": JobStatus(4 * 300)}
    renewal = policy.schedule(SchedulingRequest(240.0, status=running))
    assert renewal.allocation == {"holder": 0, "urgent": 4}  # renewing "holder" would miss "urgent"


def test_lease_program_finds_a_schedule_exactly_when_one_exists():
    buckets = [Bucket(0, 1, 60.0), Bucket(1, 1, 60.0), Bucket(2, 2, 60.0)]
    wide = Demand("wide", 4, 120.0, 2, (120.0, 0.0, "wide"), False)  # both first leases, whole cluster
    narrow = Demand("narrow", 2, 120.0, 4, (240.0, 0.0, "narrow"), True)
    ok = solve([wide, narrow], buckets, 4, frozenset(), 100, 5.0)
    assert ok.found and ok.now == ("wide",)
    squeezed = Demand("narrow", 2, 180.0, 3, (180.0, 0.0, "narrow"), True)  # needs 3 leases, 1 is left
    assert not solve([wide, squeezed], buckets, 4, frozenset(), 100, 5.0).found
    soft = solve([wide, squeezed], buckets, 4, frozenset({"narrow"}), 100, 5.0)
    assert soft.found and soft.penalty == pytest.approx(120.0 / 180.0)


def test_chronus_admitted_jobs_meet_their_deadlines_on_a_hand_made_trace():
    eight = ThroughputCurve({1: 1, 2: 2, 4: 4, 8: 8})
    jobs = [
        job("long", 8 * 1800, 3000.0, gpus=8, curve=eight),
        job("short", 1200, 2000.0, gpus=2, submit=60.0),
        job("tight", 4 * 1500, 1700.0, gpus=4, submit=120.0),  # must run from the start
        job("crowd", 8 * 1500, 1900.0, gpus=8, submit=180.0, curve=eight),  # would push "long" past its deadline
        job("be", 3000, None, gpus=4, submit=0.0),
    ]
    policy = make_policy("chronus", Topology(1, 2, 8), interval=60.0, lease_s=60.0, estimate_margin=1.0)
    run = simulate(jobs, policy)
    records = {r.job.job_id: r for r in run.records}
    assert records["crowd"].decision.reason is RejectionReason.INSUFFICIENT_CAPACITY
    assert all(records[j].decision.admitted for j in ("long", "short", "tight", "be"))
    for r in run.records:
        if r.decision.admitted:
            assert r.finish is not None
            if r.job.deadline is not None:
                assert r.met_deadline, r.job.job_id


# -- Pollux ----------------------------------------------------------------------

def synthetic_model(noise: float) -> ModelGoodput:
    """Per-step time grows slowly with the local batch (big batches are cheap per
    sample); `noise` is the gradient noise scale, which decides whether they pay."""
    sizes = (8.0, 64.0, 512.0)
    times = StepTimes(sizes, tuple(0.1 + 0.0005 * s for s in sizes), (0.01, 0.01, 0.01))
    trajectory = NoiseTrajectory((0.0, 1.0), (noise, noise))
    return ModelGoodput("toy", 512, 512.0, {(1, 1): times, (1, 2): times, (1, 4): times}, {64: trajectory})


def test_pollux_grows_the_batch_only_when_that_raises_goodput():
    big_batch, gain = best_batch(synthetic_model(1e6), 4, 4, 64, 0.5)
    assert big_batch > 64 and gain > 1.5
    assert best_batch(synthetic_model(1.0), 4, 4, 64, 0.5) == (64, 1.0)  # noise-free: samples wasted

    toy = job("j", 1000, None, curve=LINEAR, model="toy", batch=64)
    for noise, grows in ((1e6, True), (1.0, False)):
        policy = PolluxPolicy(Topology(1, 1, 4), goodput=GoodputModel({"toy": synthetic_model(noise)}))
        reply = policy.schedule(SchedulingRequest(0.0, [toy]))
        assert reply.allocation == {"j": 4}
        assert (policy.batch["j"] > 64) is grows
        assert (policy.speed(toy, 4) > LINEAR.speed(4)) is grows
        assert reply.wake_at == 60.0  # re-adapts every interval as the noise scale moves


def test_pollux_real_data_grows_yolov3_late_in_training_on_many_gpus():
    model = load_goodput(DATA / "pollux", {"yolov3"}).models["yolov3"]
    assert best_batch(model, 1, 4, 64, 0.0)[0] == 64
    batch, gain = best_batch(model, 16, 4, 64, 0.9)
    assert batch > 64 and gain > 1.0


def test_pollux_without_goodput_data_falls_back_and_says_so():
    policy = make_policy("pollux", Topology(1, 1, 8), interval=60.0)
    a, b = job("a", 1000, 2000.0, curve=CONCAVE, model="resnet50", batch=64), job("b", 500, None, curve=CONCAVE)
    reply = policy.schedule(SchedulingRequest(0.0, [a, b]))
    assert all(d.admitted for d in reply.decisions) and "throughput-only" in reply.decisions[0].message
    assert "throughput-only" in policy.note and "resnet50" in policy.note
    assert reply.wake_at is None and sum(reply.allocation.values()) == 8
    assert policy.speed(a, 4) == CONCAVE.speed(4)


# -- the goodput data --------------------------------------------------------------

def test_goodput_parser_reads_the_pollux_artifact():
    model = load_goodput(DATA / "pollux")
    assert set(model.models) == {"bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3"}
    cifar = model.models["cifar10"]
    assert cifar.max_batch == 4096 and cifar.max_local_bsz == 1024
    assert {(1, 1), (1, 4), (2, 8), (4, 16), (8, 32), (16, 64)} <= set(cifar.step_times)
    assert set(cifar.noise) == {128, 256, 512, 1024, 2048, 4096}
    assert all(math.isfinite(v) and v >= 0 for t in cifar.noise.values() for v in t.noise_scale)
    assert goodput_for(DATA / "throughputs" / "T4") is not None
    assert goodput_for(DATA / "throughputs" / "A100") is None  # measured on T4 only


def test_goodput_step_times_reproduce_the_t4_throughput_curves():
    """The T4 curves were measured from the same data: seconds per step at the
    trace's batch (with gradient accumulation) must give the same iterations/s,
    so progress at the job's own batch is the same under both."""
    model = goodput_for(DATA / "throughputs" / "T4")
    for (name, batch), curve in load_throughputs(DATA / "throughputs" / "T4").items():
        data = model.models[name]
        for gpus, speed in curve.points.items():
            seconds = data.step_seconds(data.times_for(gpus, 4), gpus, batch)
            assert 1 / seconds == pytest.approx(speed, rel=1e-6), (name, batch, gpus)


@pytest.mark.parametrize("file,line,replace,field", [
    ("placements.csv", 3, "1,45,abc,0.0005", "step_time"),
    ("validation-128.csv", 2, "391.0,390,0.4455,-1.0,5.0", "grad_sqr"),
])
def test_goodput_parser_names_file_row_and_field_of_a_malformed_value(tmp_path, file, line, replace, field):
    folder = tmp_path / "cifar10"
    shutil.copytree(DATA / "pollux" / "cifar10", folder)
    lines = (folder / file).read_text().splitlines()
    lines[line - 1] = replace
    (folder / file).write_text("\n".join(lines) + "\n")
    with pytest.raises(InputError) as err:
        load_model(folder)
    assert file in str(err.value) and f"row {line}" in str(err.value) and field in str(err.value)


def test_goodput_parser_rejects_missing_columns_and_statistics(tmp_path):
    folder = tmp_path / "toy"
    folder.mkdir()
    (folder / "placements.csv").write_text("placement,local_bsz,step_time\n1,32,0.1\n")
    with pytest.raises(InputError, match="sync_time.*missing column"):
        load_model(folder)
    (folder / "placements.csv").write_text("placement,local_bsz,step_time,sync_time\n1,32,0.1,0.01\n")
    with pytest.raises(InputError, match="no validation"):
        load_model(folder)


# -- both, on random traces -------------------------------------------------------

class Checked(SchedulingPolicy):
    """Delegates to a real policy and checks every reply's GPU bookkeeping."""

    name = "checked"

    def __init__(self, inner: SchedulingPolicy) -> None:
        self.inner, self.topology, self.clock = inner, inner.topology, inner.clock
        self.name = inner.name

    def schedule(self, request: SchedulingRequest) -> SchedulingReply:
        reply = self.inner.schedule(request)
        used: set[int] = set()
        for job_id, gpus in reply.allocation.items():
            if not gpus:
                assert job_id not in reply.placement.blocks
                continue
            assert reply.placement.blocks[job_id][1] == gpus
            block = set(reply.placement.gpus(job_id))
            assert not block & used, f"{job_id} double-booked at t={request.now}"
            used |= block
        assert max(used, default=0) < self.topology.num_gpus
        return reply

    def __getattr__(self, item):
        return getattr(self.inner, item)


def random_trace(seed: int, n: int = 30, gap: float = 300.0, slack: float = 2.0) -> list[Job]:
    rng = random.Random(seed)
    curves = [LINEAR, CONCAVE, ThroughputCurve({1: 2.0, 2: 3.0, 4: 3.6, 8: 3.8})]
    jobs, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(1 / gap)
        curve = rng.choice(curves)
        gpus = rng.choice([1, 1, 2, 4, 8])
        duration = rng.uniform(300, 3000)
        iterations = duration * curve.speed(max(g for g in curve.points if g <= gpus))
        deadline = None if rng.random() < 0.2 else t + rng.uniform(0.5, slack) * duration
        jobs.append(job(f"j{i}", iterations, deadline, gpus=gpus, submit=round(t), curve=curve,
                        model=rng.choice(["toy", "other"]), batch=64))
    return jobs


@pytest.mark.parametrize("name", ["chronus", "pollux"])
@pytest.mark.parametrize("seed,nodes,gap,slack", [
    (1, 2, 300.0, 2.0), (2, 2, 300.0, 2.0), (3, 2, 300.0, 2.0),
    (6, 1, 100.0, 5.0),  # one node, dense arrivals, loose deadlines: the lease program decides
])
def test_no_double_booking_and_every_admitted_job_finishes(name, seed, nodes, gap, slack):
    options = {"goodput": GoodputModel({"toy": synthetic_model(1e4)})} if name == "pollux" else {}
    policy = Checked(make_policy(name, Topology(1, nodes, 8), interval=60.0, **options))
    run = simulate(random_trace(seed, gap=gap, slack=slack), policy)
    for r in run.records:
        assert r.decision is not None
        if r.decision.admitted:
            assert r.finish is not None and r.remaining == 0.0
    if name == "chronus":
        slo = [r for r in run.records if r.decision.admitted and r.job.deadline is not None]
        assert slo and all(r.met_deadline for r in slo)
