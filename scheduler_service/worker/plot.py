"""The allocation over time as a picture: GPUs per job, each job's deadline,
the cluster's size; embedded in the cluster artifact as a data URI.

Pure rendering: no Prefect and no clock here (times are passed in).
"""

from __future__ import annotations

import base64
import io
from datetime import datetime, timedelta, timezone

from pydantic import BaseModel, Field

from scheduler_service.text import printable

# Jobs beyond this many (by GPU-seconds) share one "other jobs" band in the
# plot: a legend of hundreds of runs helps nobody.
PLOT_MAX_JOBS = 10


def _utc(moment: datetime) -> datetime:
    """Naive datetimes are taken as UTC, so comparisons never raise."""
    return moment.replace(tzinfo=timezone.utc) if moment.tzinfo is None else moment


class AllocationSample(BaseModel):
    """How many GPUs each run held from `at` until the next sample."""

    at: datetime
    gpus: dict[str, int] = Field(default_factory=dict)  # run (its flow run id) -> GPUs held


def samples_from_changes(changes: list[tuple[datetime, str, int]]) -> list[AllocationSample]:
    """Cumulative samples from per-run changes `(at, run id, GPUs it holds from
    then on)`, such as the `ef_allocation` rows (launch, rescale, park: the set's
    size; release: 0). One sample per distinct time, runs at 0 dropped."""
    held: dict[str, int] = {}
    samples: list[AllocationSample] = []
    for at, run, gpus in sorted(changes, key=lambda c: _utc(c[0])):
        if gpus > 0:
            held[run] = gpus
        else:
            held.pop(run, None)
        if samples and _utc(samples[-1].at) == _utc(at):
            samples[-1] = AllocationSample(at=at, gpus=dict(held))
        else:
            samples.append(AllocationSample(at=at, gpus=dict(held)))
    return samples


def plotted_jobs(samples: list[AllocationSample], until: datetime | None = None,
                 max_jobs: int = PLOT_MAX_JOBS) -> tuple[list[str], list[str]]:
    """The runs the plot names (most GPU-seconds first, at most `max_jobs`) and the
    rest, drawn as one band. Each sample counts until the next, the last until `until`."""
    points = sorted(samples, key=lambda s: _utc(s.at))
    if not points:
        return [], []
    ends = [_utc(s.at) for s in points[1:]] + [max(_utc(until), _utc(points[-1].at)) if until else _utc(points[-1].at)]
    weight: dict[str, float] = {}
    for sample, end in zip(points, ends):
        span = max((end - _utc(sample.at)).total_seconds(), 1e-9)  # a lone sample still counts
        for run, n in sample.gpus.items():
            weight[run] = weight.get(run, 0.0) + n * span
    ranked = sorted(weight, key=lambda r: (-weight[r], r))
    return ranked[:max_jobs], ranked[max_jobs:]


def legend_names(runs: list[str], names: dict[str, str] | None) -> list[str]:
    """What the plot calls each run: its name (two runs of one name told
    apart by their ids), or its id when it has none."""
    given = [printable((names or {}).get(run) or run) for run in runs]
    return [f"{name} ({run[:8]})" if given.count(name) > 1 and name != run else name
            for run, name in zip(runs, given)]


def allocation_plot(samples: list[AllocationSample], deadlines: dict[str, datetime] | None = None,
                    total_gpus: int | None = None, until: datetime | None = None,
                    max_jobs: int = PLOT_MAX_JOBS, width_px: int = 900, height_px: int = 360,
                    names: dict[str, str] | None = None) -> bytes:
    """A PNG of GPUs per job over time: stacked steps (each sample holds until the
    next one, the last until `until`), each job's deadline a dashed line in its
    colour, the cluster's size a grey line. Jobs beyond `max_jobs` (by
    GPU-seconds) share one grey "other jobs" band so the legend stays readable.
    Samples and deadlines are keyed by run id; `names` gives the legend's words."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.dates as mdates
    from matplotlib.figure import Figure

    dpi = 100
    figure = Figure(figsize=(width_px / dpi, height_px / dpi), dpi=dpi)
    axes = figure.add_subplot()
    axes.set_ylabel("GPUs")
    points = sorted(samples, key=lambda s: _utc(s.at))
    if not points:
        axes.text(0.5, 0.5, "no allocation yet", ha="center", va="center", transform=axes.transAxes, fontsize=14)
        axes.set_xticks([])
        axes.set_yticks([])
    else:
        times = [_utc(s.at).astimezone(timezone.utc).replace(tzinfo=None) for s in points]
        end = _utc(until).astimezone(timezone.utc).replace(tzinfo=None) if until is not None else times[-1]
        end = max(end, times[-1])
        shown, others = plotted_jobs(points, end, max_jobs)
        xs = times + [end]  # the last sample holds until `end`
        series = [[float(s.gpus.get(run, 0)) for s in points] for run in shown]
        labels = legend_names(shown, names)
        colours = [matplotlib.colormaps["tab10"](i % 10) for i in range(len(shown))]
        if others:
            series.append([float(sum(s.gpus.get(run, 0) for run in others)) for s in points])
            labels.append(f"{len(others)} other jobs")
            colours.append((0.75, 0.75, 0.75, 1.0))
        series = [values + values[-1:] for values in series]
        # Deadlines far past the samples (hours, for a job just started) would
        # squash the plot: the x range reaches at most half its span beyond the
        # last sample, and a deadline outside it is named in the legend only.
        span = max((end - times[0]).total_seconds(), 1.0)
        right = end + timedelta(seconds=span * 0.02)
        due: dict[str, datetime] = {}
        for run in shown:
            deadline = (deadlines or {}).get(run)
            if deadline is not None:
                due[run] = _utc(deadline).astimezone(timezone.utc).replace(tzinfo=None)
                if due[run] <= end + timedelta(seconds=span * 0.5):
                    right = max(right, due[run] + timedelta(seconds=span * 0.02))
        for i, run in enumerate(shown):
            if run in due:
                labels[i] = f"{labels[i]} (due {due[run]:%H:%M:%S})"
        if series:
            axes.stackplot(xs, *series, labels=labels, colors=colours, step="post", alpha=0.85,
                           edgecolor="white", linewidth=0.5)
        for run, colour in zip(shown, colours):
            if run in due and due[run] <= right:
                axes.axvline(due[run], color=colour, linestyle="--", linewidth=1.5)
        axes.set_xlim(times[0], right)
        if total_gpus:
            axes.axhline(total_gpus, color="grey", linewidth=1, linestyle=":")
            axes.set_ylim(0, total_gpus * 1.08)
        axes.yaxis.get_major_locator().set_params(integer=True)
        locator = mdates.AutoDateLocator(minticks=3, maxticks=8)
        axes.xaxis.set_major_locator(locator)
        axes.xaxis.set_major_formatter(mdates.ConciseDateFormatter(locator))
        axes.set_xlabel("time (UTC); dashed: deadlines")
        if labels:
            axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    axes.set_title("GPUs per job")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


def png_data_uri(png: bytes) -> str:
    """A `data:` URI of a PNG, for an `<img>` or a markdown image."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def allocation_markdown(samples: list[AllocationSample], deadlines: dict[str, datetime] | None = None,
                        total_gpus: int | None = None, until: datetime | None = None,
                        names: dict[str, str] | None = None) -> str:
    """The allocation plot embedded in markdown as a data URI: the Prefect 3.9.1
    UI renders it inside a markdown artifact (checked in headless Chromium by
    tests/ui), so the picture needs no file server."""
    png = allocation_plot(samples, deadlines, total_gpus, until, names=names)
    return f"## Allocation over time\n\n![GPUs per job over time]({png_data_uri(png)})"
