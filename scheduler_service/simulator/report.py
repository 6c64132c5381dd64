"""Showing results: a table for the terminal, JSON for machines, a plot for people."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Sequence

from rich.table import Table

from scheduler_service.simulator.engine import Run
from scheduler_service.simulator.metrics import PolicyResult


def results_table(results: Sequence[PolicyResult], title: str = "") -> Table:
    """One row a policy; on a mixed cluster, the use of each GPU kind too;
    with teams, each team's deadline ratio (and the same jobs in one queue)."""
    table = Table(title=title or None)
    kinds = list(dict.fromkeys(k for r in results for k in r.use_by_kind))
    teams = list(dict.fromkeys(t for r in results for t in r.ratio_by_team))
    for name, justify in [("policy", "left"), ("actuation", "left"), ("ratio", "right"), ("met", "right"),
                          ("admit", "right"), ("reject", "right"), ("adm.miss", "right"),
                          ("JCT h", "right"), ("util", "right"), *((f"util {k}", "right") for k in kinds),
                          *((f"ratio {t}", "right") for t in teams), ("wall s", "right")]:
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for r in results:
        table.add_row(
            r.policy, r.actuation, f"{r.deadline_ratio:.3f}", f"{r.met_deadline}/{r.deadline_jobs}", str(r.admitted),
            str(r.rejected), str(r.admitted_missed),
            "-" if r.avg_jct_s is None else f"{r.avg_jct_s / 3600:.2f}", f"{r.gpu_utilization:.2f}",
            *(f"{r.use_by_kind[k]:.2f}" if k in r.use_by_kind else "-" for k in kinds),
            *(f"{r.ratio_by_team[t]:.3f}" if t in r.ratio_by_team else "-" for t in teams),
            f"{r.wall_s:.2f}",
        )
    return table


def write_atomically(path: Path, data: bytes) -> None:
    """Readers never see a half-written file: write beside it, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; results are for everyone to read
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, results: Sequence[PolicyResult]) -> None:
    payload = {"results": [r.model_dump(mode="json") for r in results]}
    write_atomically(path, (json.dumps(payload, indent=2) + "\n").encode())


def write_plot(path: Path, runs: Sequence[Run], results: Sequence[PolicyResult], title: str = "") -> None:
    """GPUs in use over time per policy, and each policy's deadline ratio."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_use, ax_ratio) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    start = min((run.usage[0][0] for run in runs if run.usage), default=0.0)
    for run in runs:
        if not run.usage:
            continue
        times = [(t - start) / 3600 for t, _ in run.usage]
        ax_use.step(times, [used for _, used in run.usage], where="post", label=run.policy, linewidth=0.9)
    if runs:
        ax_use.axhline(runs[0].capacity, color="grey", linestyle=":", linewidth=0.8, label="capacity")
    ax_use.set_xlabel("hours since the first arrival")
    ax_use.set_ylabel("GPUs in use")
    ax_use.legend(loc="upper right", fontsize=8)
    names = [r.policy for r in results]
    ratios = [r.deadline_ratio for r in results]
    bars = ax_ratio.bar(names, ratios, color=[f"C{i}" for i in range(len(names))])
    ax_ratio.bar_label(bars, fmt="%.3f", fontsize=8)
    ax_ratio.set_ylim(0, 1.1)
    ax_ratio.set_ylabel("deadline satisfactory ratio")
    ax_ratio.tick_params(axis="x", rotation=30, labelsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
