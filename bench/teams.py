"""Teams: one team floods the cluster; do the others keep their deadlines?

A reference trace (dev102, 500 jobs on 8x8 A100) is split between three teams
in turn (a, b, c; shares 24, 20 and 20 GPUs). Team a then floods: N more jobs
(copies of the trace's own, drawn with a seed) submitted within the first
hour. Through the service's own control loop, elasticflow-overload:
  teams, calm      the teams policy without the flood (each team's ratio "as usual")
  teams, flood     the teams policy with it
  one queue, calm  / flood: the same jobs with no teams file (today's service)
Printed: each team's deadline ratio, the overall ratio, GPU use, admitted misses,
and the LP bound of each team's jobs on its share alone.

Run: .venv/bin/python bench/teams.py              (about a minute on 2 cores)
     .venv/bin/python bench/teams.py --flood 600
"""

from __future__ import annotations

import argparse
import csv
import random
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scheduler_service.simulator.experiment import data_dir  # noqa: E402

POLICY = "elasticflow-overload"
SHARES = {"a": 24, "b": 20, "c": 20}
TRACE = "dev102"


def write_trace(folder: Path, flood: int, seed: int) -> Path:
    rows = list(csv.DictReader((data_dir() / "reference" / "traces" / f"{TRACE}.csv").open()))
    out = []
    for i, row in enumerate(rows):
        out.append({**row, "team": "abc"[i % 3]})
    rng = random.Random(seed)
    for i in range(flood):
        row = dict(rng.choice(rows))
        window = float(row["ddl"]) - float(row["submit_time"])
        submit = rng.uniform(0, 3600)
        out.append({**row, "job_id": f"flood-{i}", "submit_time": f"{submit:.0f}", "ddl": f"{submit + window:.0f}",
                    "team": "a"})
    path = folder / f"{TRACE}-flood{flood}.csv"
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(out[0]))
        writer.writeheader()
        writer.writerows(out)
    return path


def run_task(task: dict) -> dict:
    from scheduler_service.policy.teams import Team
    from scheduler_service.policy.topology import Topology
    from scheduler_service.simulator.bound import deadline_ratio_bound
    from scheduler_service.simulator.experiment import load_jobs, simulate_policy
    from scheduler_service.simulator.metrics import summarize

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="teams-") as folder:
        path = write_trace(Path(folder), task["flood"], task["seed"])
        jobs, topology, _ = load_jobs(path, data_dir() / "clusters" / "n8g8.csv", data_dir() / "throughputs" / "A100")
    out = dict(task)
    if task["line"] == "bound":
        out["bound"] = {t: deadline_ratio_bound([j for j in jobs if j.team == t], Topology(1, share, 1)).bound
                        for t, share in SHARES.items()}
    else:
        teams = tuple(Team(t, s) for t, s in SHARES.items()) if task["teams"] else ()
        run, _ = simulate_policy(jobs, topology, POLICY, 60.0, data_dir() / "throughputs" / "A100", "service",
                                 teams=teams)
        result = summarize(run)
        out.update(ratio=result.deadline_ratio, by_team=result.ratio_by_team, util=result.gpu_utilization,
                   missed=result.admitted_missed)
    out["wall_s"] = time.perf_counter() - started
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--flood", type=int, default=300, help="team a's extra jobs, all within the first hour")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    lines = [("teams, calm", True, 0), ("teams, flood", True, args.flood),
             ("one queue, calm", False, 0), ("one queue, flood", False, args.flood)]
    tasks = [{"line": name, "teams": teams, "flood": flood, "seed": args.seed} for name, teams, flood in lines]
    tasks += [{"line": "bound", "teams": True, "flood": flood, "seed": args.seed} for flood in (0, args.flood)]
    started = time.perf_counter()
    with Pool(2) as pool:
        results = {(r["line"], r["flood"]): r for r in pool.imap_unordered(run_task, tasks)}
    print(f"{TRACE} on n8g8 split between teams a, b, c (shares 24/20/20); team a floods with {args.flood} more "
          f"jobs in the first hour; {POLICY} through the service's loop")
    print(f"{'':<18}{'team a':>8}{'team b':>8}{'team c':>8}{'overall':>9}{'use':>7}{'adm.miss':>10}")
    for name, _, flood in lines:
        r = results[(name, flood)]
        print(f"{name:<18}" + "".join(f"{r['by_team'][t]:>8.3f}" for t in SHARES)
              + f"{r['ratio']:>9.3f}{r['util']:>7.3f}{r['missed']:>10}")
    for flood in (0, args.flood):
        bound = results[("bound", flood)]["bound"]
        print(f"{'bound on share' + (', flood' if flood else ''):<18}" + "".join(f"{bound[t]:>8.3f}" for t in SHARES))
    calm, flood = results[("teams, calm", 0)], results[("teams, flood", args.flood)]
    one = results[("one queue, flood", args.flood)]
    kept = max(abs(flood["by_team"][t] - calm["by_team"][t]) for t in ("b", "c"))
    print(f"teams b and c under the flood: ratio moved by at most {kept:.3f} with teams, "
          f"{max(abs(one['by_team'][t] - results[('one queue, calm', 0)]['by_team'][t]) for t in ('b', 'c')):.3f} "
          f"in one queue; GPU use with teams minus one queue: {flood['util'] - one['util']:+.3f}; "
          f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
