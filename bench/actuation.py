"""Where the service's loop and the bare policy differ, rule by rule.

The same policy on the same trace, bare (`ideal`: the policy at slot
boundaries, an idealised restart) and through the service's own control loop
(`service`: simulator/service.py), and between the two, the service with its
additions taken away one at a time, so that each step of the difference has
its cause:

  service      the service as it ships: 5% safety margin (at least a slot),
               launch reserve learnt from the starts seen, decisions at the
               next poll, the hand-over charged in every plan
  no margin    ELASTICFLOW_SAFETY_MARGIN=0 (the slot floor stays)
  no reserve   and no launch reserve (ELASTICFLOW_LAUNCH_S=0)
  boundaries   and runs decided at the slot boundary after they arrive, as
               the bare engine takes them, not at once
  uncharged    and plans charge the restart alone, not the hand-over before it
  ideal        the bare policy (engine.py)

What is left between `uncharged` and `ideal` is the loop itself: GPUs handed
on only once acknowledged, a poll between events, the slot floor of the
margin, and the restart rules of loop/actuation.py.

Run: .venv/bin/python bench/actuation.py                    (reference and shared traces, both policies)
     .venv/bin/python bench/actuation.py --itp              (the ten ITP clusters at 16x8, the default policy)
     .venv/bin/python bench/actuation.py --trace dev102 --policy elasticflow
Prints one markdown row per trace and policy, and a JSON line per run to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler_service.simulator.experiment import data_dir  # noqa: E402

VARIANTS = ("service", "no margin", "no reserve", "boundaries", "uncharged", "ideal")
# trace under data/, cluster, GPU kind, interval
CASES = ([(f"reference/traces/{t}", c, "A100", 60.0) for t, c in
          [("dev101", "n16g8"), ("dev102", "n8g8"), ("dev103", "n4g8"), ("dev104", "n8g8"), ("dev105", "n8g8"),
           ("dev106", "n8g8")]]
         + [("traces/philly_103959", "n32g8", "A100", 60.0), ("traces/elasticVpollux_e", "n16g4", "T4", 60.0),
            ("traces/100jobs_1500lam", "n16g8", "A100", 240.0), ("traces/1000job_1500lam", "n8g8", "A100", 240.0)]
         # Alibaba's production trace (data/reference/README.md), at the size where the default trails the authors
         + [("reference/traces/openb126", "n2g8", "A100", 60.0)])
ITP = [(f"traces/itp/cluster{i:02d}", "n16g8", "A100", 60.0) for i in range(1, 11)]


def run_one(task: tuple[tuple[str, str, str, float], str, str]) -> dict:
    from scheduler_service.policy.registry import make_policy
    from scheduler_service.simulator.engine import simulate
    from scheduler_service.simulator.inputs import load_cluster, load_throughputs, load_trace
    from scheduler_service.simulator.metrics import summarize
    from scheduler_service.simulator.options import policy_options
    from scheduler_service.simulator.service import Actuation, ServiceOptions, simulate_service
    from scheduler_service.policy.overhead import PAPER_OVERHEAD

    (trace, cluster, gpu, interval), policy, variant = task
    data = data_dir()
    jobs = load_trace(data / f"{trace}.csv", load_throughputs(data / "throughputs" / gpu))
    topology = load_cluster(data / "clusters" / f"{cluster}.csv")
    options = policy_options(policy, data / "throughputs" / gpu)
    if variant == "ideal":
        run = simulate(jobs, make_policy(policy, topology, interval, overhead=PAPER_OVERHEAD, **options))
    else:
        steps = VARIANTS.index(variant)
        service = ServiceOptions(**({"safety_margin": 0.0} if steps >= 1 else {}),
                                 **({"launch_s": 0.0} if steps >= 2 else {}),
                                 actuation=Actuation(arrivals_at_boundaries=steps >= 3))
        settings = service.loop(policy, interval)
        overhead = PAPER_OVERHEAD if steps >= 4 else settings.charged
        planner = make_policy(policy, topology, interval, overhead=overhead, **options)
        run = simulate_service(jobs, topology, settings, service.actuation, lambda _: planner)
    result = summarize(run)
    return {"trace": Path(trace).name, "cluster": cluster, "policy": policy, "variant": variant,
            "ratio": result.deadline_ratio, "admitted_missed": result.admitted_missed, "wall_s": result.wall_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--itp", action="store_true", help="the ten ITP clusters at 16x8 instead")
    parser.add_argument("--trace", action="append", help="only these (by name, e.g. dev102, cluster04)")
    parser.add_argument("--policy", action="append", help="default: elasticflow-overload and elasticflow "
                                                          "(with --itp: elasticflow-overload)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    cases = ITP if args.itp else CASES
    if args.trace:
        cases = [c for c in cases if Path(c[0]).name in args.trace]
    policies = args.policy or (["elasticflow-overload"] if args.itp else ["elasticflow-overload", "elasticflow"])
    tasks = [(case, policy, variant) for case in cases for policy in policies for variant in VARIANTS]
    results: dict[tuple[str, str, str], dict] = {}
    with Pool(args.workers) as pool:
        for row in pool.imap_unordered(run_one, tasks):
            results[(row["trace"], row["policy"], row["variant"])] = row
            print(json.dumps(row), file=sys.stderr, flush=True)
    print("| trace | cluster | policy | " + " | ".join(VARIANTS) + " |")
    print("|---|---|---|" + "---|" * len(VARIANTS))
    for case in cases:
        name = Path(case[0]).name
        for policy in policies:
            cells = []
            for variant in VARIANTS:
                row = results[(name, policy, variant)]
                cells.append(f"{row['ratio']:.3f}" + (f" [{row['admitted_missed']}]" if row["admitted_missed"] else ""))
            print(f"| {name} | {case[1]} | {policy} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
