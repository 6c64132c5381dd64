"""The simulated cluster's noise: seeded, reproducible, drawn by run and by
node (not by the order things happen in), and played by the backend."""

from __future__ import annotations

import statistics

import pytest

from scheduler_service.policy import Job, ThroughputCurve, Topology
from scheduler_service.policy.overhead import RestartOverhead
from scheduler_service.simulator.noise import Noise, NoisyCluster, SlowPeriods
from scheduler_service.simulator.service import Actuation, ServiceOptions, simulate_service

CURVE = ThroughputCurve({1: 1.0, 2: 1.9, 4: 3.5, 8: 6.0})
OVERHEAD = RestartOverhead(stop_s=2.0, restart_s=27.0, per_level_s=2.0)


def test_a_runs_speed_error_depends_on_the_seed_and_the_run_not_on_the_order_asked() -> None:
    noise = Noise(seed=4, speed_sigma=0.2)
    one, other = NoisyCluster(noise, 8), NoisyCluster(noise, 8)
    forward = [one.run_factor(f"r{i}") for i in range(200)]
    backward = [other.run_factor(f"r{i}") for i in reversed(range(200))][::-1]
    assert forward == backward
    assert forward != [NoisyCluster(Noise(seed=5, speed_sigma=0.2), 8).run_factor(f"r{i}") for i in range(200)]
    logs = [__import__("math").log(f) for f in forward]
    assert abs(statistics.mean(logs)) < 0.05 and statistics.stdev(logs) == pytest.approx(0.2, rel=0.2)
    assert min(forward) < 0.85 and max(forward) > 1.15  # faster and slower
    assert NoisyCluster(Noise(seed=4), 8).run_factor("r0") == 1.0  # no sigma: exact


def test_slow_periods_are_seeded_and_a_gpu_set_trains_at_its_slowest_gpus_pace() -> None:
    noise = Noise(seed=1, slow=SlowPeriods(every_s=3600.0, lasting_s=600.0, fraction=0.5, speed=0.5))
    cluster = NoisyCluster(noise, 8)
    node = tuple(range(8))
    changes = cluster.changes_between(node, 0.0, 48 * 3600.0)
    assert changes == NoisyCluster(noise, 8).changes_between(node, 0.0, 48 * 3600.0)
    assert changes != NoisyCluster(noise.model_copy(update={"seed": 2}), 8).changes_between(node, 0.0, 48 * 3600.0)
    assert 20 < len(changes) < 100  # about one period an hour, a start and an end each
    slowed = [t for t in changes if cluster.slowdown(node, t + 1e-3) == 0.5]
    assert slowed
    t = slowed[0] + 1e-3
    by_gpu = [cluster.slowdown((g,), t) for g in node]
    assert sorted(by_gpu) == [0.5] * 4 + [1.0] * 4  # half of its GPUs
    assert cluster.slowdown(tuple(g + 8 for g in node), t) in (0.5, 1.0)  # another node: its own periods


def test_the_backend_plays_the_noise_the_same_way_for_one_seed() -> None:
    jobs = [Job(str(i), 100.0 * i, 3.5 * 900, 100.0 * i + 5000, CURVE) for i in range(6)]

    def finishes(noise: Noise) -> list[float | None]:
        options = ServiceOptions(actuation=Actuation(noise=noise))
        run = simulate_service(jobs, Topology(1, 1, 8), options.loop("elasticflow", 60.0, OVERHEAD),
                               options.actuation)
        return [r.finish for r in run.records]

    slow = SlowPeriods(every_s=600.0, lasting_s=300.0)
    noisy = Noise(seed=1, speed_sigma=0.2, jitter_sigma=0.1, start_sigma=0.2, slow=slow)
    assert finishes(noisy) == finishes(noisy)
    assert finishes(noisy) != finishes(noisy.model_copy(update={"seed": 2}))
    assert finishes(noisy) != finishes(Noise())


def test_a_slow_period_slows_a_lone_run_by_what_it_spent_in_it() -> None:
    """Half speed for a while: the run's end moves by the work it did not do then."""
    job = Job("a", 0.0, 3.5 * 3000, 20_000.0, ThroughputCurve({1: 1.0, 2: 1.9, 4: 3.5}))
    finish = {}
    for slow in (None, SlowPeriods(every_s=1000.0, lasting_s=500.0, fraction=1.0, speed=0.5)):
        options = ServiceOptions(safety_margin=0.0, launch_s=0.0, actuation=Actuation(noise=Noise(seed=3, slow=slow)))
        run = simulate_service([job], Topology(1, 1, 4), options.loop("elasticflow", 60.0, OVERHEAD),
                               options.actuation)
        finish[slow is None] = run.records[0].finish
    cluster = NoisyCluster(Noise(seed=3, slow=SlowPeriods(every_s=1000.0, lasting_s=500.0, fraction=1.0, speed=0.5)), 4)
    start = finish[True] - 3000.0  # when it trained, on 4 GPUs for 3000 s
    changes = cluster.changes_between((0, 1, 2, 3), start, finish[False])
    assert changes  # it met slow periods
    assert finish[False] > finish[True] + 100
