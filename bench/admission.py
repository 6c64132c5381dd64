"""Admission latency: one admission decision with N admitted jobs on G GPUs.

Builds a busy but feasible cluster state (N admitted deadline jobs with real
A100 curves), then times the admission of 200 further arrivals one by one:
half that fit, half in a hurry (short windows, many iterations) that mostly
do not fit and so take the re-plan path, which is what used to grow with N.
Prints p50/p99 per size and, as the last line, JSON with the ratio of the
large case to the 1,000-job case measured in the same run (10x the jobs:
linear growth would be 10x).
Run: .venv/bin/python bench/admission.py
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler_service.policy import Job, JobStatus, SchedulingRequest, Topology  # noqa: E402
from scheduler_service.policy.elasticflow import ElasticFlowPolicy  # noqa: E402
from scheduler_service.simulator.experiment import data_dir  # noqa: E402
from scheduler_service.simulator.inputs import load_throughputs  # noqa: E402


def make_job(rng: random.Random, curves: list, i: int, now: float) -> Job:
    curve = rng.choice(curves)
    window = rng.uniform(3600, 14 * 86400)
    # About a quarter of one GPU over the window on average: busy, not hopeless.
    iterations = curve.points[1] * window * rng.uniform(0.05, 0.45)
    return Job(f"j{i}", now, iterations, now + window, curve)


def make_hurried(rng: random.Random, curves: list, i: int, now: float) -> Job:
    curve = rng.choice(curves)
    window = rng.uniform(1800, 4 * 3600)
    top = curve.levels[-1]
    iterations = curve.points[top] * window * rng.uniform(0.5, 0.95)
    return Job(f"h{i}", now, iterations, now + window, curve)


def measure(num_jobs: int, nodes: int, samples: int = 400, seed: int = 7) -> dict:
    rng = random.Random(seed)
    curves = list(load_throughputs(data_dir() / "throughputs" / "A100").values())
    policy = ElasticFlowPolicy(Topology(1, nodes, 8), interval=60.0)
    now = 0.0
    status: dict[str, JobStatus] = {}
    i = 0
    while len(policy.guaranteed) < num_jobs:  # build the state, untimed
        batch = [make_job(rng, curves, i + k, now) for k in range(50)]
        i += 50
        for job in batch:
            status[job.job_id] = JobStatus(job.iterations)
        policy.schedule(SchedulingRequest(now, batch, status=status))
    timings = []
    admitted = 0
    slot = policy.clock.slot_of(now)
    for k in range(samples):
        job = (make_job if k % 2 == 0 else make_hurried)(rng, curves, i, now)
        i += 1
        status[job.job_id] = JobStatus(job.iterations)
        start = time.perf_counter()
        decision = policy._arrive(job, slot, status)  # the admission decision alone
        timings.append(time.perf_counter() - start)
        admitted += decision.admitted
    timings.sort()
    return {
        "admitted_jobs": len(policy.guaranteed), "gpus": nodes * 8, "samples": samples, "sample_admitted": admitted,
        "p50_ms": round(timings[len(timings) // 2] * 1e3, 3),
        "p99_ms": round(timings[int(len(timings) * 0.99) - 1] * 1e3, 3),
    }


def main() -> None:
    results = []
    for num_jobs, nodes in [(1000, 128), (3000, 256), (10_000, 256)]:
        r = measure(num_jobs, nodes)
        results.append(r)
        print(f"{r['admitted_jobs']:6d} admitted jobs on {r['gpus']:5d} GPUs: admission p50 {r['p50_ms']:.2f} ms, "
              f"p99 {r['p99_ms']:.2f} ms ({r['sample_admitted']} of {r['samples']} timed arrivals admitted)", flush=True)
    base, large = results[0]["p99_ms"], results[-1]["p99_ms"]
    print(f"target: p99 <= 10 ms with 10,000 jobs on 2,048 GPUs -> {large:.2f} ms "
          f"({'met' if large <= 10 else 'MISSED'}); 10x the jobs -> p99 x{large / base:.1f} "
          f"({'linear or better' if large / base <= 10 else 'worse than linear'})")
    print(json.dumps({"results": results, "p99_ratio_10k_vs_1k": round(large / base, 2)}))


if __name__ == "__main__":
    main()
