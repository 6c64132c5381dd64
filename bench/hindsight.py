"""How much of the gap to the bound is which jobs a policy admits, and how
much is how it plans them (issue 25's heavy traces).

The integral bound (`deadline_ratio_bound(integral=True)`) also names the
jobs of the best fluid schedule it found: what hindsight would admit. Each
policy then runs on those jobs alone, as if it had turned away exactly the
others at their arrival (a turned-away job never runs, so leaving it out of
the trace is the same run), and its ratio is counted over every deadline
job of the trace. If a policy given hindsight's choice still meets far
fewer than that choice, no rule for choosing better at arrival can close
the gap: its planner cannot pack the jobs it is given.

Prints one markdown row per trace: the default policy as it runs (restarts
charged, then free as the authors count), the same given hindsight's jobs
(its price still applies), the paper's policy given them (no price: every
one it can plan), the share of jobs hindsight chose and the LP bound. Bare
policies, the simulator's engine.

Run: .venv/bin/python bench/hindsight.py                    (the heavy reference traces, about 20 s on 2 cores)
     .venv/bin/python bench/hindsight.py --trace dev101 --trace dev104   (any trace of bench/ablation.py; the ITP
         clusters at 16 x 8 hold thousands of jobs, beyond the integral bound in minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import sys
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ablation import TRACES  # noqa: E402

from scheduler_service.policy.jobs import Job  # noqa: E402
from scheduler_service.policy.overhead import NO_OVERHEAD, PAPER_OVERHEAD, RestartOverhead  # noqa: E402
from scheduler_service.policy.registry import DEFAULT_POLICY, make_policy  # noqa: E402
from scheduler_service.policy.topology import AnyTopology  # noqa: E402
from scheduler_service.simulator.bound import deadline_ratio_bound  # noqa: E402
from scheduler_service.simulator.engine import simulate  # noqa: E402
from scheduler_service.simulator.experiment import data_dir  # noqa: E402
from scheduler_service.simulator.inputs import load_cluster, load_throughputs, load_trace  # noqa: E402

HEAVY = ("dev102", "dev103", "dev105")
# (label, policy, restarts, on hindsight's jobs only): the row's policy columns
COLUMNS = (
    (f"default ({DEFAULT_POLICY})", DEFAULT_POLICY, PAPER_OVERHEAD, False),
    ("default, restarts free", DEFAULT_POLICY, NO_OVERHEAD, False),
    ("default, hindsight's jobs", DEFAULT_POLICY, PAPER_OVERHEAD, True),
    ("default, hindsight's jobs, restarts free", DEFAULT_POLICY, NO_OVERHEAD, True),
    ("elasticflow, hindsight's jobs", "elasticflow", PAPER_OVERHEAD, True),
)


def _case(name: str) -> tuple[list[Job], str, AnyTopology, float]:
    """The trace's jobs, its cluster's name and topology, and its slot."""
    _, trace, cluster, gpu, interval = next(t for t in TRACES if t[0] == name)
    data = data_dir()
    jobs = load_trace(data / f"{trace}.csv", load_throughputs(data / "throughputs" / gpu))
    return jobs, cluster, load_cluster(data / "clusters" / f"{cluster}.csv"), interval


def ratio(jobs: list[Job], kept: list[Job], topology: AnyTopology, interval: float, policy: str,
          overhead: RestartOverhead) -> float:
    """The policy's deadline ratio on `kept`, over every deadline job of `jobs`."""
    run = simulate(kept, make_policy(policy, topology, interval, overhead=overhead))
    met = sum(1 for r in run.records if r.met_deadline)
    return met / sum(1 for j in jobs if j.deadline is not None)


def row(task: tuple[str, float]) -> str:
    name, time_limit = task
    jobs, cluster, topology, interval = _case(name)
    lp = deadline_ratio_bound(jobs, topology)
    milp = deadline_ratio_bound(jobs, topology, integral=True, time_limit_s=time_limit)
    chosen = set(milp.chosen)
    kept = [j for j in jobs if j.deadline is None or j.job_id in chosen]
    cells = [ratio(jobs, kept if hindsight else jobs, topology, interval, policy, overhead)
             for _, policy, overhead, hindsight in COLUMNS]
    picked = len(chosen) / milp.deadline_jobs
    note = "" if milp.exact else f" (search stopped at {time_limit:g} s; proven {milp.bound:.3f})"
    return (f"| {name}, {cluster} | " + " | ".join(f"{c:.3f}" for c in cells)
            + f" | {picked:.3f}{note} | {lp.bound:.3f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", action="append", choices=[t[0] for t in TRACES], help="default: " + ", ".join(HEAVY))
    parser.add_argument("--time-limit", type=float, default=120.0, help="seconds for each integral bound's search")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    print("| trace, cluster | " + " | ".join(label for label, _, _, _ in COLUMNS) + " | hindsight's jobs | LP bound |")
    print("|---" * (len(COLUMNS) + 3) + "|")
    with Pool(args.workers) as pool:
        for line in pool.imap(row, [(name, args.time_limit) for name in args.trace or HEAVY]):
            print(line, flush=True)


if __name__ == "__main__":
    main()
