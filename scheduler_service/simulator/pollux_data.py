"""Reading the Pollux artifact's goodput data into the pure model the policy uses.

Per model, `data/pollux/MODEL/` holds:
- `placements.csv` (placement, local_bsz, step_time, sync_time): seconds per
  step on up to 4 nodes; a placement is one digit per node, the GPUs used on
  it ("44" = two full 4-GPU nodes).
- `scalability.csv` (num_nodes, num_replicas, local_bsz, step_time, sync_time):
  the same for 6 to 16 nodes.
- `validation-B.csv` (progress, iteration, metric, grad_sqr, grad_var): one
  row per epoch of a run at batch size B; `progress` is that run's statistical
  work in iterations of the smallest batch, and grad_sqr / grad_var are the
  gradient's squared norm and variance at that smallest batch, so the noise
  scale is B_noise = smallest batch x grad_var / grad_sqr (capped when
  grad_sqr is 0, as it is late in some runs).

Only placements a buddy allocation produces (the same GPU count on every
node) are kept. Every problem is an InputError naming file, row and field.
"""

from __future__ import annotations

import csv
import math
import re
from pathlib import Path

from scheduler_service.policy.baselines.pollux import GoodputModel, ModelGoodput, NoiseTrajectory, StepTimes
from scheduler_service.simulator.inputs import InputError

# The Pollux artifact measured these on NVIDIA T4 nodes; its data fits only
# throughput curves measured on the same GPU.
POLLUX_GPU = "T4"
# A zero gradient norm (late in some runs) means noise dominates: any batch is
# fully efficient. A finite cap far above every batch size says the same.
NOISE_CAP = 1e12
_VALIDATION = re.compile(r"validation-(\d+)\.csv$")


def _read(path: Path, columns: tuple[str, ...]) -> list[tuple[int, dict[str, float | str]]]:
    """Rows with every column present and numeric (placement kept as text)."""
    try:
        with path.open(newline="") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
            for name in columns:
                if name not in header:
                    raise InputError(path, 1, name, "missing column")
            rows = []
            for number, row in enumerate(reader, start=2):
                parsed: dict[str, float | str] = {}
                for name in columns:
                    text = (row.get(name) or "").strip()
                    if name == "placement":
                        if not text.isdigit():
                            raise InputError(path, number, name, f"not a placement of digits: {text!r}")
                        parsed[name] = text
                        continue
                    try:
                        value = float(text)
                    except ValueError:
                        raise InputError(path, number, name, f"not a number: {text!r}") from None
                    if not math.isfinite(value):
                        raise InputError(path, number, name, f"not finite: {text!r}")
                    parsed[name] = value
                rows.append((number, parsed))
    except OSError as exc:
        raise InputError(path, None, None, f"cannot read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise InputError(path, None, None, "not a text CSV file") from None
    if not rows:
        raise InputError(path, None, None, "no data rows")
    return rows


def _step_times(path: Path, rows: list[tuple[int, dict]], key_of) -> dict[tuple[int, int], StepTimes]:
    grouped: dict[tuple[int, int], dict[float, tuple[float, float]]] = {}
    for number, row in rows:
        key = key_of(row)
        if key is None:
            continue
        if row["local_bsz"] <= 0 or row["step_time"] <= 0 or row["sync_time"] < 0:
            raise InputError(path, number, "step_time", "local batch and step time must be positive")
        grouped.setdefault(key, {})[row["local_bsz"]] = (row["step_time"], row["sync_time"])
    out = {}
    for key, by_bsz in grouped.items():
        sizes = tuple(sorted(by_bsz))
        out[key] = StepTimes(sizes, tuple(by_bsz[s][0] for s in sizes), tuple(by_bsz[s][1] for s in sizes))
    return out


def _compact(row: dict) -> tuple[int, int] | None:
    digits = str(row["placement"]).strip("0")
    if not digits or len(set(digits)) != 1:
        return None  # uneven across nodes: a buddy allocation never makes it
    return len(digits), sum(int(d) for d in digits)


def load_model(directory: Path) -> ModelGoodput:
    """One model's goodput data from its folder."""
    directory = Path(directory)
    placements = directory / "placements.csv"
    step_cols = ("local_bsz", "step_time", "sync_time")
    rows = _read(placements, ("placement", *step_cols))
    times = _step_times(placements, rows, _compact)
    scalability = directory / "scalability.csv"
    if scalability.exists():
        srows = _read(scalability, ("num_nodes", "num_replicas", *step_cols))
        for key, value in _step_times(scalability, srows,
                                      lambda r: (int(r["num_nodes"]), int(r["num_replicas"]))).items():
            times.setdefault(key, value)
    if not times:
        raise InputError(placements, None, "placement", "no placement with the same GPU count on every node")
    max_local = max(float(row["local_bsz"]) for _, row in rows)

    runs: dict[int, list[tuple[float, float, float]]] = {}
    for path in sorted(directory.glob("validation-*.csv")):
        match = _VALIDATION.search(path.name)
        if match is None:
            raise InputError(path, None, None, "expected a name validation-BATCH.csv")
        vrows = _read(path, ("progress", "grad_sqr", "grad_var"))
        for number, row in vrows:
            for name in ("progress", "grad_sqr", "grad_var"):
                if row[name] < 0:
                    raise InputError(path, number, name, "must not be negative")
        runs[int(match.group(1))] = [(r["progress"], r["grad_sqr"], r["grad_var"]) for _, r in vrows]
    if not runs:
        raise InputError(directory, None, None, "no validation-BATCH.csv files (gradient statistics)")
    smallest = min(runs)
    noise = {}
    for batch, points in runs.items():
        points.sort()
        final = points[-1][0] or 1.0
        noise[batch] = NoiseTrajectory(
            tuple(p / final for p, _, _ in points),
            tuple(min(NOISE_CAP, smallest * var / sqr) if sqr > 0 else NOISE_CAP for _, sqr, var in points),
        )
        if len(set(noise[batch].fraction)) != len(points):
            raise InputError(directory / f"validation-{batch}.csv", None, "progress", "progress values repeat")
    return ModelGoodput(directory.name, max(runs), max_local, times, noise)


def load_goodput(pollux_dir: Path, models: set[str] | None = None) -> GoodputModel:
    """Every model folder under `pollux_dir` (or only `models`) with placements.csv."""
    pollux_dir = Path(pollux_dir)
    if not pollux_dir.is_dir():
        raise InputError(pollux_dir, None, None, "Pollux data directory not found")
    found = {}
    for folder in sorted(p for p in pollux_dir.iterdir() if (p / "placements.csv").exists()):
        if models is None or folder.name in models:
            found[folder.name] = load_model(folder)
    return GoodputModel(found)


def goodput_for(throughputs: Path) -> GoodputModel | None:
    """Pollux data matching a throughput directory: only for the GPU it was
    measured on (T4), only for the models that directory has curves for; None
    when nothing matches."""
    throughputs = Path(throughputs)
    if throughputs.name != POLLUX_GPU:
        return None
    pollux_dir = throughputs.parent.parent / "pollux"
    models = {p.stem for p in throughputs.glob("*.csv")}
    if not pollux_dir.is_dir() or not models & {p.name for p in pollux_dir.iterdir()}:
        return None
    model = load_goodput(pollux_dir, models)
    return model if model.models else None
