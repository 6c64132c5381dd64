"""Mixed GPU kinds: what a cluster of A100 and T4 nodes gains over its A100s alone.

On each trace (the six of data/reference/, and generated ones at a heavier
load), through the service's own control loop:
  (a) A100 only   the A100 nodes alone (n8g8): what the project did before kinds
  (b) pinned      8x8 A100 + 8x8 T4, each job pinned to a kind at admission,
                  tried slowest kind first (the shipped rule)
  (b') cheapest   the same, tried on the kind where it is cheapest first
  (c) moves       the shipped rule, and an admitted job may move to another
                  kind (a full restart, charged) to admit a newcomer
with the deadline ratio, admitted jobs that missed, the use of each kind,
and the LP bound of each cluster beside them. T4 curves of the A100 models
are the A100 ones scaled by the cluster file's relative_speed (0.2: an
assumption, stated in the file; the service measures its own).

Run: .venv/bin/python bench/kinds.py                 (about 2 minutes on 2 cores)
     .venv/bin/python bench/kinds.py --generated 0   (the reference traces only)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler_service.simulator.experiment import data_dir  # noqa: E402

MIXED = "mixed_n8g8_A100_n8g8_T4"
POLICY = "elasticflow-overload"
INTERVAL = 60.0
LINES = {  # label -> (cluster, kind order, moves)
    "(a) A100 only": ("n8g8", None, False),
    "(b) pinned": (MIXED, "slowest-first", False),
    "(b') cheapest": (MIXED, "least-share", False),
    "(c) moves": (MIXED, "slowest-first", True),
}


def _trace(task: dict, folder: Path) -> Path:
    if task["trace"].startswith("dev"):
        return data_dir() / "reference" / "traces" / f"{task['trace']}.csv"
    from scheduler_service.simulator.inputs import load_throughputs
    from scheduler_service.simulator.tracegen import TraceSpec, generate, trace_csv

    curves = load_throughputs(data_dir() / "throughputs" / "A100")
    seed = int(task["trace"].rsplit("seed", 1)[1])
    path = folder / f"{task['trace']}.csv"
    path.write_text(trace_csv(generate(TraceSpec(jobs=400, mean_gap_s=330.0, seed=seed), curves)))  # type: ignore[arg-type]
    return path


def run_task(task: dict) -> dict:
    from scheduler_service.policy.kinds import KindOrder
    from scheduler_service.simulator.bound import deadline_ratio_bound
    from scheduler_service.simulator.experiment import load_jobs, simulate_policy
    from scheduler_service.simulator.metrics import summarize

    started = time.perf_counter()
    cluster, order, moves = task["cluster"], task["order"], task["moves"]
    throughputs = data_dir() / "throughputs" / ("A100" if cluster == "n8g8" else "")
    with tempfile.TemporaryDirectory(prefix="kinds-") as folder:
        jobs, topology, _ = load_jobs(_trace(task, Path(folder)), data_dir() / "clusters" / f"{cluster}.csv",
                                      throughputs)
    out = dict(task)
    if task["line"] == "bound":
        out["ratio"] = deadline_ratio_bound(jobs, topology).bound
    else:
        run, _ = simulate_policy(jobs, topology, POLICY, INTERVAL, throughputs, "service", kind_moves=moves,
                                 kind_order=KindOrder(order or KindOrder.SLOWEST_FIRST))
        result = summarize(run)
        out.update(ratio=result.deadline_ratio, admitted_missed=result.admitted_missed, util=result.gpu_utilization,
                   use=result.use_by_kind)
    out["wall_s"] = time.perf_counter() - started
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--generated", type=int, default=2, help="generated traces (seeds) beside the reference ones")
    parser.add_argument("--json", type=Path, default=None, help="write every figure here")
    args = parser.parse_args()
    traces = [f"dev10{i}" for i in range(1, 7)] + [f"gen-load-seed{s}" for s in range(args.generated)]
    tasks = []
    for trace in traces:
        for line, (cluster, order, moves) in LINES.items():
            tasks.append({"trace": trace, "line": line, "cluster": cluster, "order": order, "moves": moves})
        for cluster in ("n8g8", MIXED):
            tasks.append({"trace": trace, "line": "bound", "cluster": cluster, "order": None, "moves": False})
    started = time.perf_counter()
    with Pool(2) as pool:
        results = []
        for i, result in enumerate(pool.imap_unordered(run_task, tasks), 1):
            results.append(result)
            print(f"\r{i}/{len(tasks)} runs", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    by = {(r["trace"], r["line"], r["cluster"]): r for r in results}
    header = f"{'trace':<16}" + "".join(f"{line:>22}" for line in LINES) + f"{'bound A100':>12}{'bound mixed':>12}"
    print(f"deadline ratio (admitted misses) [A100 use / T4 use], {POLICY} through the service's loop")
    print(header)
    gains = []
    for trace in traces:
        cells = []
        for line, (cluster, _, _) in LINES.items():
            r = by[(trace, line, cluster)]
            use = r["use"]
            where = f"[{use['A100']:.2f}/{use['T4']:.2f}]" if use else f"[{r['util']:.2f}/-]"
            cells.append(f"{r['ratio']:.3f} ({r['admitted_missed']}) {where}")
        alone, pinned = by[(trace, "(a) A100 only", "n8g8")]["ratio"], by[(trace, "(b) pinned", MIXED)]["ratio"]
        gains.append(pinned - alone)
        bounds = [by[(trace, "bound", c)]["ratio"] for c in ("n8g8", MIXED)]
        print(f"{trace:<16}" + "".join(f"{c:>22}" for c in cells) + "".join(f"{b:>12.3f}" for b in bounds))
    misses = sum(r.get("admitted_missed", 0) for r in results)
    print(f"(b) pinned over (a) A100 only: mean {sum(gains) / len(gains):+.4f}, min {min(gains):+.4f}; "
          f"admitted misses in all runs: {misses}; {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
