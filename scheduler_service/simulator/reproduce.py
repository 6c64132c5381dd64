"""`elasticflow reproduce`: the paper's comparison, end to end, on both cores.

Every policy on the shared traces and cluster specs of the comparison, the LP
upper bound for each, and the reference figures beside them, written as JSON,
a markdown table and two plots.
"""

from __future__ import annotations

import json
from concurrent.futures import ProcessPoolExecutor, as_completed
from functools import lru_cache
from pathlib import Path
from typing import Callable, Sequence

from pydantic import BaseModel, Field

from scheduler_service.policy.registry import DEFAULT_POLICY, POLICIES
from scheduler_service.simulator.bound import BoundResult, deadline_ratio_bound
from scheduler_service.simulator.experiment import data_dir
from scheduler_service.simulator.inputs import load_cluster, load_throughputs, load_trace
from scheduler_service.simulator.metrics import Actuation, PolicyResult
from scheduler_service.simulator.report import write_atomically
from scheduler_service.simulator.teams_case import LINES, TeamsReport, TeamsScenario, bounds_on_shares, run_line
from scheduler_service.simulator.teams_case import markdown as teams_markdown
from scheduler_service.simulator.teams_case import plot as plot_teams

# The schedulers ElasticFlow is compared with (its own ablations excluded).
BASELINES = ("edf", "gandiva", "tiresias", "themis", "chronus", "pollux")
ITP_REFERENCE = [.788, .822, .455, .631, .832, .607, .665, .896, .938, .981]  # paper's plot, cluster01..10
# The cluster each ITP figure of the paper was measured on (the authors' run_fig8b.sh): not 128 GPUs.
ITP_PAPER_CLUSTER = {1: "n64g8", 2: "n64g8", 3: "n64g8", 4: "n128g8", 5: "n64g8", 6: "n64g8", 7: "n128g8",
                     8: "n128g8", 9: "n128g8", 10: "n32g8"}
# The authors' simulator run here on 128 GPUs (n16g8), a far heavier load (data/README.md, issue 13).
ITP_AUTHORS_128 = {4: .194, 6: .568, 7: .381, 10: .973}


def our_policies() -> list[str]:
    """The paper's ElasticFlow and the service's default: the policies this project proposes."""
    return list(dict.fromkeys(p for p in ("elasticflow", DEFAULT_POLICY) if p in POLICIES))


def actuations(policy: str) -> tuple[Actuation, ...]:
    """Ours run through the service's own loop (the figure of the system that
    runs) and bare (the policy alone, as the authors' simulator measures it);
    baselines bare, as the authors ran them."""
    return ("service", "ideal") if policy in our_policies() else ("ideal",)


class Case(BaseModel):
    trace: str  # name under data/traces
    cluster: str  # name under data/clusters
    gpu: str  # A100 or T4
    interval: float
    group: str  # headline, sweep, itp
    policies: list[str] | None = None  # None: every registered policy
    references: dict[str, float] = Field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.trace}@{self.cluster}"


def comparison_cases() -> list[Case]:
    cases = [
        Case(trace="philly_103959", cluster="n32g8", gpu="A100", interval=60, group="headline",
             references={"elasticflow": .910, "edf": .436, "tiresias": .466, "gandiva": .413, "themis": .455}),
        Case(trace="elasticVpollux_e", cluster="n16g4", gpu="T4", interval=60, group="headline",
             references={"elasticflow": .728, "edf": .118, "tiresias": .287, "gandiva": .092, "themis": .313,
                         "chronus": .262, "pollux": .523}),
        Case(trace="100jobs_1500lam", cluster="n16g8", gpu="A100", interval=240, group="headline",
             references={"elasticflow": 1.0, "edf": .920, "tiresias": 1.0, "gandiva": .790, "themis": .990}),
    ]
    for cluster in ("n8g8", "n16g8", "n32g8"):
        refs = {"elasticflow": .933, "edf": .020, "elasticflow-noadmit": .263, "edf-admit": .212} if cluster == "n8g8" else {}
        cases.append(Case(trace="1000job_1500lam", cluster=cluster, gpu="A100", interval=240, group="sweep", references=refs))
    ours = our_policies()
    for i, ref in enumerate(ITP_REFERENCE, start=1):
        cases.append(Case(trace=f"itp/cluster{i:02d}", cluster=ITP_PAPER_CLUSTER[i], gpu="A100", interval=60,
                          group="itp", policies=ours, references={"elasticflow": ref}))
    # Baselines without admission control keep thousands of doomed jobs queued on these
    # overloaded clusters and take minutes each; EDF runs only on cluster10, as the authors' figure does.
    for i in range(1, 11):
        refs = ({"elasticflow": ITP_AUTHORS_128[i]} if i in ITP_AUTHORS_128 else {}) | ({"edf": .427} if i == 10 else {})
        cases.append(Case(trace=f"itp/cluster{i:02d}", cluster="n16g8", gpu="A100", interval=60, group="itp-128",
                          policies=ours + (["edf"] if i == 10 else []), references=refs))
    return cases


def quick_cases() -> list[Case]:
    """A reduced comparison for the test suite: small traces, every policy."""
    return [
        Case(trace="100jobs_1500lam", cluster="n16g8", gpu="A100", interval=240, group="headline",
             references={"elasticflow": 1.0, "edf": .920, "tiresias": 1.0, "gandiva": .790, "themis": .990}),
        Case(trace="itp/cluster10", cluster="n16g8", gpu="A100", interval=60, group="itp-128",
             policies=["elasticflow", "edf"], references={"elasticflow": .973, "edf": .427}),
    ]


class Report(BaseModel):
    results: list[PolicyResult]
    bounds: dict[str, BoundResult]
    cases: list[Case]
    headline: dict[str, dict[str, float | str]]  # case -> elasticflow / best baseline
    teams_scenario: TeamsReport | None = None
    wall_s: float = 0.0


@lru_cache(maxsize=8)
def _inputs(case_json: str):
    case = Case.model_validate_json(case_json)
    data = data_dir()
    curves = load_throughputs(data / "throughputs" / case.gpu)
    jobs = load_trace(data / "traces" / f"{case.trace}.csv", curves)
    return jobs, load_cluster(data / "clusters" / f"{case.cluster}.csv")


def _simulate(case_json: str, policy: str, actuation: Actuation) -> PolicyResult:
    from scheduler_service.simulator.experiment import simulate_policy
    from scheduler_service.simulator.metrics import summarize

    case = Case.model_validate_json(case_json)
    jobs, topology = _inputs(case_json)
    run, note = simulate_policy(jobs, topology, policy, case.interval, data_dir() / "throughputs" / case.gpu,
                                actuation)
    result = summarize(run, case.trace, case.cluster, case.interval, actuation)
    return result.model_copy(update={"note": note})


def _bound(case_json: str) -> BoundResult:
    case = Case.model_validate_json(case_json)
    jobs, topology = _inputs(case_json)
    return deadline_ratio_bound(jobs, topology).model_copy(update={"trace": case.trace, "cluster": case.cluster})


def run_comparison(
    cases: Sequence[Case], workers: int = 2, on_progress: Callable[[str, int, int], None] | None = None,
    teams_scenario: TeamsScenario | None = None,
) -> Report:
    """Every case's policies and bound, and the teams scenario's lines and
    bounds, on `workers` processes."""
    import time

    started = time.perf_counter()
    tasks: list[tuple[Case, str | None, Actuation | None]] = []
    for case in cases:
        for policy in case.policies or list(POLICIES):
            tasks += [(case, policy, actuation) for actuation in actuations(policy)]
        tasks.append((case, None, None))  # the bound
    # Biggest traces first, the service's loop before the bare policy, so the two workers finish together.
    tasks.sort(key=lambda t: (-(data_dir() / "traces" / f"{t[0].trace}.csv").stat().st_size, t[2] != "service"))
    results: dict[tuple[str, str, Actuation], PolicyResult] = {}
    bounds: dict[str, BoundResult] = {}
    team_results: dict[str, PolicyResult] = {}
    team_bounds: dict[str, dict[str, float]] = {}
    with ProcessPoolExecutor(max_workers=workers) as pool:
        lines, team_bounds_of = {}, {}
        if teams_scenario is not None:  # each line is as long as a big trace's: first, as those are
            lines = {pool.submit(run_line, teams_scenario, line): line.name for line in LINES}
            team_bounds_of = {pool.submit(bounds_on_shares, teams_scenario, flooded): "flood" if flooded else "calm"
                              for flooded in (False, True)}
        futures = {}
        for case, policy, actuation in tasks:
            payload = case.model_dump_json()
            fut = pool.submit(_bound, payload) if policy is None else pool.submit(_simulate, payload, policy, actuation)
            futures[fut] = (case, policy, actuation)
        every = [*lines, *team_bounds_of, *futures]
        for done, fut in enumerate(as_completed(every), start=1):
            if fut in lines:
                team_results[lines[fut]] = fut.result()
                what = f"teams scenario, {lines[fut]}"
            elif fut in team_bounds_of:
                team_bounds[team_bounds_of[fut]] = fut.result()
                what = f"teams scenario, bounds on shares ({team_bounds_of[fut]})"
            else:
                case, policy, actuation = futures[fut]
                if policy is not None and actuation is not None:
                    results[(case.key, policy, actuation)] = fut.result()  # type: ignore[assignment]
                else:
                    bounds[case.key] = fut.result()  # type: ignore[assignment]
                what = f"{case.key} {f'{policy} ({actuation})' if policy else 'bound'}"
            if on_progress is not None:
                on_progress(what, done, len(every))
    ordered = [results[(c.key, p, a)] for c in cases for p in (c.policies or list(POLICIES)) for a in actuations(p)]
    team_report = (TeamsReport(scenario=teams_scenario, results=team_results, bounds=team_bounds)
                   if teams_scenario is not None else None)
    return Report(results=ordered, bounds=bounds, cases=list(cases), headline=_headline(cases, results),
                  teams_scenario=team_report, wall_s=time.perf_counter() - started)


def _headline(cases: Sequence[Case], results: dict[tuple[str, str, Actuation], PolicyResult]
              ) -> dict[str, dict[str, float | str]]:
    """ElasticFlow as the service runs it, against the best baseline bare."""
    out: dict[str, dict[str, float | str]] = {}
    for case in cases:
        ef = results.get((case.key, "elasticflow", "service"))
        # Pollux without goodput data is only an elastic throughput maximizer; the paper
        # compares it on the T4 trace alone, and so does the headline.
        names = [b for b in BASELINES if (case.key, b, "ideal") in results and not (b == "pollux" and case.gpu != "T4")]
        if ef is None or not names:
            continue
        best = max(names, key=lambda b: results[(case.key, b, "ideal")].deadline_ratio)
        ratio = results[(case.key, best, "ideal")].deadline_ratio
        out[case.key] = {"elasticflow": ef.deadline_ratio, "best_baseline": best, "best_baseline_ratio": ratio,
                         "improvement": ef.deadline_ratio / ratio if ratio > 0 else float("inf")}
    return out


def write_report(report: Report, out: Path) -> list[Path]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md"]
    write_atomically(paths[0], (json.dumps(report.model_dump(mode="json"), indent=2) + "\n").encode())
    write_atomically(paths[1], markdown(report).encode())
    if report.cases:  # the teams scenario alone (bench/teams.py) has none
        paths += [out / "deadline_ratios.png", out / "cluster_size.png"]
        _plot_ratios(report, paths[2])
        _plot_cluster_size(report, paths[3])
    if report.teams_scenario is not None:
        paths.append(out / "teams.png")
        plot_teams(report.teams_scenario, paths[-1])
    return paths


def _cell(result: PolicyResult | None, ref: float | None) -> str:
    if result is None:
        return ""
    text = f"{result.deadline_ratio:.3f}"
    return text + (f" ({ref:.3f})" if ref is not None else "")


def columns(report: Report) -> list[tuple[str, Actuation]]:
    """(policy, actuation) of every result, in registry order, the service's loop first."""
    present = {(r.policy, r.actuation) for r in report.results}
    return [(p, a) for p in POLICIES for a in ("service", "ideal") if (p, a) in present]


def label(policy: str, actuation: Actuation) -> str:
    return f"{policy} ({actuation})" if policy in our_policies() else policy


def markdown(report: Report) -> str:
    by = {(r.trace, r.cluster, r.policy, r.actuation): r for r in report.results}
    shown = columns(report)
    lines = [
        "Deadline satisfactory ratio, ours (reference in brackets: the authors' simulator or the paper). "
        "`(service)`: the service's own control loop with a simulated backend; `(ideal)`: the bare policy; "
        "baselines are bare. `bound` is the LP upper bound for any scheduler. ITP clusters at the paper's sizes "
        "(n32g8, n64g8, n128g8): brackets are the paper's plot; on n16g8 (128 GPUs): the authors' simulator run "
        "on the same files.", "",
        "| trace | cluster | " + " | ".join(label(p, a) for p, a in shown) + " | bound |",
        "|---|---|" + "---|" * (len(shown) + 1),
    ]
    for case in report.cases:
        cells = [_cell(by.get((case.trace, case.cluster, p, a)), case.references.get(p)) for p, a in shown]
        bound = report.bounds.get(case.key)
        lines.append(f"| {case.trace} | {case.cluster} | " + " | ".join(cells) + (f" | {bound.bound:.3f} |" if bound else " | |"))
    lines += ["", "| case | ElasticFlow | best baseline | its ratio | ElasticFlow / best |", "|---|---|---|---|---|"]
    for key, h in report.headline.items():
        lines.append(f"| {key} | {h['elasticflow']:.3f} | {h['best_baseline']} | {h['best_baseline_ratio']:.3f} | "
                     f"{h['improvement']:.2f}x |")
    missed = {a: sum(r.admitted_missed for r in report.results if r.policy in our_policies() and r.actuation == a)
              for a in ("service", "ideal")}
    lines += ["", f"Jobs our policies admitted that missed their deadline, across all cases: {missed['service']} "
                  f"through the service's loop, {missed['ideal']} bare.",
              f"Wall time of the whole comparison: {report.wall_s:.0f} s.", ""]
    if report.teams_scenario is not None:
        lines.append(teams_markdown(report.teams_scenario))
    return "\n".join(lines)


def _plot_ratios(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r.trace, r.cluster, r.policy, r.actuation): r for r in report.results}
    shown = columns(report)
    cases = [c for c in report.cases if not c.group.startswith("itp")]
    itp_groups = [g for g in ITP_TITLES if any(c.group == g for c in report.cases)]
    fig, axes = plt.subplots(1 + len(itp_groups), 1, figsize=(13, 4.5 + 3.5 * len(itp_groups)), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / max(len(shown), 1)
    for i, (policy, actuation) in enumerate(shown):
        there = [(k, c) for k, c in enumerate(cases) if (c.trace, c.cluster, policy, actuation) in by]
        ax.bar([k + i * width for k, _ in there], [by[(c.trace, c.cluster, policy, actuation)].deadline_ratio
                                                  for _, c in there], width, label=label(policy, actuation),
               color=f"C{i}")
    for k, c in enumerate(cases):
        if c.key in report.bounds:
            ax.hlines(report.bounds[c.key].bound, k - width / 2, k + 0.8 - width / 2, colors="black",
                      linestyles="--", label="LP bound" if k == 0 else None)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(cases))], [f"{c.trace}\n{c.cluster}" for c in cases], fontsize=8)
    ax.set_ylabel("deadline ratio")
    ax.set_ylim(0, 1.05)
    ax.legend(ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 1.18))
    for row, group in enumerate(itp_groups, start=1):
        _plot_itp(axes[row][0], [c for c in report.cases if c.group == group], by, report.bounds, group)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)


ITP_TITLES = {"itp": ("the paper", "ITP clusters at the paper's sizes"),
              "itp-128": ("the authors' simulator", "ITP clusters on 128 GPUs (overload)")}


def _plot_itp(ax, cases: Sequence[Case], by: dict, bounds: dict[str, BoundResult], group: str) -> None:
    """Each of our policies beside the reference figure and the bound, one cluster a group of bars."""
    ours = [(p, a) for p in our_policies() for a in actuations(p)
            if any((c.trace, c.cluster, p, a) in by for c in cases)]
    width = 0.8 / (len(ours) + 1)
    for i, (policy, actuation) in enumerate(ours):
        ax.bar([k + i * width for k in range(len(cases))],
               [by[key].deadline_ratio if (key := (c.trace, c.cluster, policy, actuation)) in by else 0
                for c in cases], width, label=label(policy, actuation), color=f"C{i}")
    who, title = ITP_TITLES[group]
    ax.bar([k + len(ours) * width for k in range(len(cases))], [c.references.get("elasticflow", float("nan")) for c in cases],
           width, label=f"ElasticFlow ({who})", color="C7")
    ax.plot([k + 0.4 - width / 2 for k in range(len(cases))], [bounds[c.key].bound for c in cases], "k_",
            markersize=30, label="LP bound")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(cases))],
                  [f"{c.trace.split('/')[-1]}\n{c.cluster}" for c in cases], fontsize=8)
    ax.set_ylabel("deadline ratio")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(0, 1.25)  # room for the legend above the bars
    ax.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ax.legend(fontsize=8, ncol=4, loc="upper center")


def _plot_cluster_size(report: Report, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = [c for c in report.cases if c.group == "sweep"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if not sweep:
        ax.text(0.5, 0.5, "no cluster-size sweep in this run", ha="center", transform=ax.transAxes)
    else:
        sizes = []
        for c in sweep:
            spec = _inputs(c.model_dump_json())[1]
            sizes.append(spec.num_gpus)
        by = {(r.trace, r.cluster, r.policy, r.actuation): r for r in report.results}
        for i, (policy, actuation) in enumerate(columns(report)):
            if all((c.trace, c.cluster, policy, actuation) in by for c in sweep):
                ax.plot(sizes, [by[(c.trace, c.cluster, policy, actuation)].deadline_ratio for c in sweep], "o-",
                        label=label(policy, actuation), color=f"C{i}")
        ax.plot(sizes, [report.bounds[c.key].bound for c in sweep], "k--", label="LP bound")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_title(f"{sweep[0].trace}, interval {sweep[0].interval:g} s")
        ax.legend(fontsize=8, loc="lower left", ncol=3)
    ax.set_xlabel("GPUs in the cluster")
    ax.set_ylabel("deadline ratio")
    ax.set_ylim(0, 1.05)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
