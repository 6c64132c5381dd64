"""Ablation of the paper's policy: `elasticflow` with one mechanism changed,
on the traces of the ablation table in docs/scheduling.md.

Each variant is the policy built with other strategies
(scheduler_service/policy/strategies.py) or restart overhead: a
configuration passed to its constructor, so the shipped code is what every
row runs. Prints one markdown row per variant: deadline ratio and, in
brackets, admitted jobs that missed.

Run: .venv/bin/python bench/ablation.py                      (all variants, about 15 minutes on 2 cores)
     .venv/bin/python bench/ablation.py --variant shipped --variant backward-filled --trace dev102
     .venv/bin/python bench/ablation.py --generated --variant shipped --variant backward-filled
         (100 generated traces: 2 sizes x 5 loads x 10 seeds; about 1.5 minutes)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from dataclasses import dataclass
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/sweep.py, for --generated

from scheduler_service.policy.interface import SchedulingPolicy  # noqa: E402
from scheduler_service.policy.overhead import NO_OVERHEAD, PAPER_OVERHEAD, RestartOverhead  # noqa: E402
from scheduler_service.policy.registry import make_policy  # noqa: E402
from scheduler_service.policy.strategies import (  # noqa: E402
    BACKWARD_FILLED,
    DEADLINE_ORDER,
    KEEP_FULL_ALLOWANCE,
    NO_ALLOWANCE,
    PINNED_ONLY,
    REPLAN_ALL,
    REPLAN_FIRST,
    SHIPPED,
    TRIM_LATEST_DUE,
    TRIM_SOONEST_DUE,
    ElasticFlowStrategies,
    FreestWithin,
)
from scheduler_service.policy.topology import Topology  # noqa: E402
from scheduler_service.simulator.engine import simulate  # noqa: E402
from scheduler_service.simulator.experiment import data_dir  # noqa: E402
from scheduler_service.simulator.inputs import load_cluster, load_throughputs, load_trace  # noqa: E402
from scheduler_service.simulator.metrics import summarize  # noqa: E402

# column, trace under data/, cluster, GPU kind, interval: the table's columns
TRACES = [
    ("dev101", "reference/traces/dev101", "n16g8", "A100", 60.0),
    ("dev102", "reference/traces/dev102", "n8g8", "A100", 60.0),
    ("dev103", "reference/traces/dev103", "n4g8", "A100", 60.0),
    ("dev104", "reference/traces/dev104", "n8g8", "A100", 60.0),
    ("dev105", "reference/traces/dev105", "n8g8", "A100", 60.0),
    ("dev106", "reference/traces/dev106", "n8g8", "A100", 60.0),
    ("philly", "traces/philly_103959", "n32g8", "A100", 60.0),
    ("elasticVpollux_e", "traces/elasticVpollux_e", "n16g4", "T4", 60.0),
    ("1000job", "traces/1000job_1500lam", "n8g8", "A100", 240.0),
    ("cluster04", "traces/itp/cluster04", "n16g8", "A100", 60.0),
    ("cluster07", "traces/itp/cluster07", "n16g8", "A100", 60.0),
]


@dataclass(frozen=True, slots=True)
class Variant:
    """`elasticflow` with one mechanism changed: its row label, and the
    strategies and restart overhead it is built with (the simulator charges
    the policy's own overhead, so NO_OVERHEAD makes restarts free in both)."""

    label: str
    strategies: ElasticFlowStrategies = SHIPPED
    overhead: RestartOverhead = PAPER_OVERHEAD

    def policy(self, topology: Topology, interval: float) -> SchedulingPolicy:
        return make_policy("elasticflow", topology, interval, overhead=self.overhead, strategies=self.strategies)


VARIANTS: dict[str, Variant] = {
    "shipped": Variant("`elasticflow` as shipped"),
    "no-allowance": Variant("no migration allowance on new plans",
                            ElasticFlowStrategies(allowance=NO_ALLOWANCE)),
    "no-overhead": Variant("restarts cost nothing, in plans and in the simulator", overhead=NO_OVERHEAD),
    "backward-filled": Variant("1. plans filled backwards from the deadline, not moved forward",
                               ElasticFlowStrategies(shape=BACKWARD_FILLED)),
    "replan-each-arrival": Variant("2. every admitted job re-planned at each arrival slot",
                                   ElasticFlowStrategies(refresh=REPLAN_ALL)),
    "trim-soonest-due": Variant("3. plans trimmed, jobs due soonest first",
                                ElasticFlowStrategies(refresh=TRIM_SOONEST_DUE)),
    "trim-latest-due": Variant("3. the same, jobs due latest first",
                               ElasticFlowStrategies(refresh=TRIM_LATEST_DUE)),
    "replan-first": Variant("4. full re-plan before the fast path",
                            ElasticFlowStrategies(layout=REPLAN_FIRST)),
    "free-6h": Variant("5. the layout leaving more GPUs free in the next 6 h",
                       ElasticFlowStrategies(layout=FreestWithin(6.0))),
    "free-1h": Variant("5. the same, next 1 h",
                       ElasticFlowStrategies(layout=FreestWithin(1.0))),
    "full-allowance": Variant("re-plans keep the full allowance",
                              ElasticFlowStrategies(replan_keeps=KEEP_FULL_ALLOWANCE)),
    "deadline-order": Variant("6. the re-plan of everyone in deadline order, not least laxity first",
                              ElasticFlowStrategies(order=DEADLINE_ORDER)),
    "no-fragile-tier": Variant("7. placement does not spare jobs with one restart left",
                               ElasticFlowStrategies(tiers=PINNED_ONLY)),
    "no-restore": Variant("8. a job that lost ground gets no fresh allowance",
                          ElasticFlowStrategies(restore_allowances=False)),
}

GENERATED_SIZES = ("n4g8", "n8g8")
GENERATED_LOADS = (1.0, 2.0, 3.0, 4.0, 6.0)
GENERATED_SEEDS = tuple(range(1, 11))


def generated_traces(folder: Path) -> list[tuple[str, str, str, str, float]]:
    """Traces the policy was never tuned on: bench/sweep.py's, for every size x
    load x seed, written into `folder`; one column each (size-load-seed)."""
    import sweep

    rows = []
    for cluster in GENERATED_SIZES:
        for load in GENERATED_LOADS:
            for seed in GENERATED_SEEDS:
                name = f"gen-{cluster}-load{load:g}-seed{seed}"
                task = {"kind": "generated", "trace": name, "cluster": cluster, "load": load, "seed": seed}
                path = sweep._trace_file(task, folder)
                rows.append((name[4:], str(path.with_suffix("")), cluster, "A100", 60.0))
    return rows


def run_one(task: tuple[str, int]) -> tuple[str, int, float, int]:
    """One variant on one trace."""
    variant, index = task
    _, trace, cluster, gpu, interval = TRACES[index]
    data = data_dir()
    jobs = load_trace(data / f"{trace}.csv", load_throughputs(data / "throughputs" / gpu))
    policy = VARIANTS[variant].policy(load_cluster(data / "clusters" / f"{cluster}.csv"), interval)
    result = summarize(simulate(jobs, policy))
    return variant, index, result.deadline_ratio, result.admitted_missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", choices=list(VARIANTS), help="default: all")
    parser.add_argument("--trace", action="append", choices=[t[0] for t in TRACES], help="default: all")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--generated", action="store_true",
                        help="run on bench/sweep.py's generated traces instead (--trace does not apply), "
                             "and print the mean per size and load")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ablation-") as folder:
        if args.generated:
            TRACES[:] = generated_traces(Path(folder))
        run(args)


def run(args: argparse.Namespace) -> None:
    variants = args.variant or list(VARIANTS)
    columns = [i for i, t in enumerate(TRACES) if not args.trace or t[0] in args.trace]
    tasks = [(v, i) for v in variants for i in columns]
    cells: dict[tuple[str, int], str] = {}
    results: dict[tuple[str, int], tuple[float, int]] = {}
    with Pool(args.workers) as pool:
        for variant, index, ratio, missed in pool.imap_unordered(run_one, tasks):
            results[(variant, index)] = (ratio, missed)
            cells[(variant, index)] = f"{ratio:.3f}" + (f" [{missed}]" if missed else "")
            print(f"  {variant:36s} {TRACES[index][0]:17s} {cells[(variant, index)]}", file=sys.stderr, flush=True)
    if args.generated:
        print_means(variants, columns, results)
        return
    print("| variant | " + " | ".join(TRACES[i][0] for i in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for variant in variants:
        print(f"| {VARIANTS[variant].label} | " + " | ".join(cells[(variant, i)] for i in columns) + " |")


def print_means(variants: list[str], columns: list[int], results: dict[tuple[str, int], tuple[float, int]]) -> None:
    """One row per variant: mean deadline ratio over the seeds of each size and load,
    and the admitted jobs that missed, summed over all of them."""
    groups: dict[str, list[int]] = {}
    for i in columns:
        groups.setdefault(TRACES[i][0].rsplit("-seed", 1)[0], []).append(i)
    print("| variant | " + " | ".join(groups) + " | admitted misses |")
    print("|---" * (len(groups) + 2) + "|")
    for variant in variants:
        means = [statistics.mean(results[(variant, i)][0] for i in members) for members in groups.values()]
        missed = sum(results[(variant, i)][1] for i in columns)
        print(f"| {VARIANTS[variant].label} | " + " | ".join(f"{m:.3f}" for m in means) + f" | {missed} |")


if __name__ == "__main__":
    main()
