"""Ablation of the paper's policy: `elasticflow` with one mechanism changed,
on the traces of the ablation table in docs/scheduling.md.

Each variant patches the policy in the worker process that simulates it,
so the shipped code stays as it is. Prints one markdown row per variant:
deadline ratio and, in brackets, admitted jobs that missed.

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
from multiprocessing import Pool
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/sweep.py, for --generated

from scheduler_service.simulator.experiment import Experiment, data_dir  # noqa: E402

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


# -- variants: each changes one mechanism of scheduler_service.policy.elasticflow -------------

def no_overhead() -> None:
    """Restarts cost nothing, in plans and in the simulator (which charges the policy's own)."""
    from scheduler_service.policy import elasticflow as ef
    from scheduler_service.policy.overhead import NO_OVERHEAD

    init = ef.ElasticFlowPolicy.__init__
    ef.ElasticFlowPolicy.__init__ = lambda self, topology, interval=60.0, overhead=None, admission=True: init(
        self, topology, interval, NO_OVERHEAD, admission)


def full_allowance() -> None:
    """Re-plans keep each admitted job's full migration allowance, not what its plan has left."""
    from scheduler_service.policy import admission as adm
    from scheduler_service.policy import elasticflow as ef

    def candidate(self, job_id, status, slot):
        job, levels = self.jobs[job_id], self.levels[job_id]
        previous = self.plans.get(job_id) if job_id in self.guaranteed else None
        return adm.Candidate(job, status[job_id], levels, adm.migration_allowance(job, levels, self.clock), previous)

    ef.ElasticFlowPolicy._candidate = candidate


def no_allowance() -> None:
    """New plans carry no migration allowance (no slack for an unplanned restart)."""
    from scheduler_service.policy import admission as adm
    from scheduler_service.policy import elasticflow as ef

    adm.migration_allowance = ef.migration_allowance = lambda *args: 0.0


def backward_filled() -> None:
    """1. Plans stay as progressive filling lays them, backwards from the deadline
    (the paper's description, shipped before): not moved forward."""
    from scheduler_service.policy import plan as P

    P.front_load = lambda plan, *args: plan


def deadline_order() -> None:
    """6. The re-plan of everyone goes in deadline order, not least laxity first."""
    from scheduler_service.policy import admission as adm

    adm.Candidate.order = lambda self, now: (self.job.deadline, self.job.submit_time, self.job.job_id)


def no_fragile_tier() -> None:
    """7. Placement does not spare jobs that can absorb one restart but not two."""
    from scheduler_service.policy import elasticflow as ef

    pinned = ef.ElasticFlowPolicy._pinned
    ef.ElasticFlowPolicy._pinned = lambda self, slot, alloc, status, restarts=1: pinned(self, slot, alloc, status)


def no_restore() -> None:
    """8. A job that lost ground (placement moved it, or it fell behind its plan)
    is not re-planned with a fresh allowance."""
    from scheduler_service.policy import elasticflow as ef

    def forget(self, slot, status):
        self.moved = set()

    ef.ElasticFlowPolicy._restore_allowances = forget


def _before_first_arrival(step: Callable) -> None:
    """Run `step(policy, slot, status)` once per slot, before its first deadline arrival."""
    from scheduler_service.policy import elasticflow as ef

    arrive = ef.ElasticFlowPolicy._arrive

    def patched(self, job, slot, status):
        if job.deadline is not None and self.guaranteed and getattr(self, "_stepped", None) != slot:
            self._stepped = slot
            step(self, slot, status)
        return arrive(self, job, slot, status)

    ef.ElasticFlowPolicy._arrive = patched


def replan_each_arrival() -> None:
    """2. Every admitted job re-planned from scratch in deadline order at each slot
    with an arrival, before admission (kept if every job still fits)."""
    from scheduler_service.policy import admission as adm

    def refresh(policy, slot, status):
        cands = [policy._candidate(j, status, slot) for j in policy.guaranteed]
        replanned = adm.plan_all(cands, slot, policy.topology.num_gpus, policy.clock)
        if not isinstance(replanned, str):
            policy.timeline, plans = replanned
            policy.plans.update(plans)

    _before_first_arrival(refresh)


def _trim(latest_first: bool) -> Callable[[], None]:
    def variant() -> None:
        """3. A job more than a slot of work ahead of its plan is re-planned alone,
        needing its remaining work and its allowance,
        so it gives back what it no longer needs; jobs in deadline order, or the
        reverse."""
        from scheduler_service.policy import admission as adm
        from scheduler_service.policy.plan import cover

        def trim(policy, slot, status):
            order = sorted(policy.guaranteed, key=lambda j: (policy.jobs[j].deadline, j), reverse=latest_first)
            for job_id in order:
                job, st, plan, levels = policy.jobs[job_id], status[job_id], policy.plans[job_id], policy.levels[job_id]
                allowance = adm.migration_allowance(job, levels, policy.clock)
                have = cover(plan, job.curve, slot, job.deadline, st.gpus, st.overhead_left, policy.clock)
                if have - st.remaining <= allowance + job.curve.points[levels[0]] * policy.clock.interval:
                    continue
                policy.timeline.add(plan.runs, sign=-1, since=slot)
                new = adm.plan_one(adm.Candidate(job, st, levels, allowance), slot, policy.timeline, policy.clock)
                policy.timeline.add((new or plan).runs, since=slot)
                policy.plans[job_id] = new or plan

        _before_first_arrival(trim)

    return variant


def _choose_layout(free_within_h: float | None) -> Callable[[], None]:
    def variant() -> None:
        """4. (None) Full re-plan before the fast path; 5. of the two layouts, the
        one leaving more GPUs free in the next `free_within_h` hours."""
        from scheduler_service.policy import admission as adm
        from scheduler_service.policy import elasticflow as ef
        from scheduler_service.policy.interface import RejectReason
        from scheduler_service.policy.timeline import Timeline

        arrive = ef.ElasticFlowPolicy._arrive

        def patched(self, job, slot, status):
            levels = self.levels_for(job)
            if not levels or job.deadline is None or job.deadline <= slot * self.clock.interval:
                return arrive(self, job, slot, status)
            cand = adm.Candidate(job, status[job.job_id], levels, adm.migration_allowance(job, levels, self.clock))
            if adm.plan_one(cand, slot, Timeline(self.topology.num_gpus, slot), self.clock) is None:
                return arrive(self, job, slot, status)
            self.levels[job.job_id] = levels
            fast = adm.plan_one(cand, slot, self.timeline, self.clock)
            replanned = self._replan_with(cand, slot, status)
            replanned = None if isinstance(replanned, str) else replanned
            use_fast = fast is not None and replanned is None
            if fast is not None and replanned is not None and free_within_h is not None:
                horizon = slot + round(free_within_h * 3600 / self.clock.interval)

                def free(timeline: Timeline) -> int:
                    return sum((b - a) * f for a, b, f in timeline.forward(slot, horizon))

                with_fast = self.timeline.copy()
                with_fast.add(fast.runs)
                use_fast = free(with_fast) >= free(replanned[0])
            if use_fast:
                self._reserve(job, fast, guaranteed=True)
                return self._admit(job, fast)
            if replanned is not None:
                self._adopt(job, replanned)
                return self._admit(job, self.plans[job.job_id])
            return self._reject(job, RejectReason.INSUFFICIENT_CAPACITY, "no plan in either layout")

        ef.ElasticFlowPolicy._arrive = patched

    return variant


VARIANTS: dict[str, tuple[str, Callable[[], None] | None]] = {
    "shipped": ("`elasticflow` as shipped", None),
    "no-allowance": ("no migration allowance on new plans", no_allowance),
    "no-overhead": ("restarts cost nothing, in plans and in the simulator", no_overhead),
    "backward-filled": ("1. plans filled backwards from the deadline, not moved forward", backward_filled),
    "replan-each-arrival": ("2. every admitted job re-planned at each arrival slot", replan_each_arrival),
    "trim-soonest-due": ("3. plans trimmed, jobs due soonest first", _trim(latest_first=False)),
    "trim-latest-due": ("3. the same, jobs due latest first", _trim(latest_first=True)),
    "replan-first": ("4. full re-plan before the fast path", _choose_layout(None)),
    "free-6h": ("5. the layout leaving more GPUs free in the next 6 h", _choose_layout(6.0)),
    "free-1h": ("5. the same, next 1 h", _choose_layout(1.0)),
    "full-allowance": ("re-plans keep the full allowance", full_allowance),
    "deadline-order": ("6. the re-plan of everyone in deadline order, not least laxity first", deadline_order),
    "no-fragile-tier": ("7. placement does not spare jobs with one restart left", no_fragile_tier),
    "no-restore": ("8. a job that lost ground gets no fresh allowance", no_restore),
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
    """One variant on one trace, in a fresh worker (maxtasksperchild=1), so patches never leak."""
    variant, index = task
    patch = VARIANTS[variant][1]
    if patch is not None:
        patch()
    _, trace, cluster, gpu, interval = TRACES[index]
    data = data_dir()
    experiment = Experiment(data / f"{trace}.csv", data / "clusters" / f"{cluster}.csv",
                            data / "throughputs" / gpu, interval)
    _, results = experiment.run(["elasticflow"])
    return variant, index, results[0].deadline_ratio, results[0].admitted_missed


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
    with Pool(args.workers, maxtasksperchild=1) as pool:
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
        print(f"| {VARIANTS[variant][0]} | " + " | ".join(cells[(variant, i)] for i in columns) + " |")


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
        print(f"| {VARIANTS[variant][0]} | " + " | ".join(f"{m:.3f}" for m in means) + f" | {missed} |")


if __name__ == "__main__":
    main()
