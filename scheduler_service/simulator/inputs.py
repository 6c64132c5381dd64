"""Reading traces, cluster specs and throughput curves, with errors a person can fix.

Every problem is reported as one line naming the file, the row and the field,
and nothing is simulated from a half-read input.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Mapping

from pydantic import BaseModel, Field, ValidationError, model_validator

from scheduler_service.policy.jobs import Job, ThroughputCurve
from scheduler_service.policy.topology import MixedTopology
# Cluster files are read by the worker too: their loader (and the shared error) live below both.
from scheduler_service.inputfiles import InputError, load_cluster  # noqa: F401  (re-exported)
from scheduler_service.inputfiles import csv_rows as _rows

PAPER_COLUMNS = {"job_id", "submit_time", "model_name", "ddl", "batch_size", "num_gpu"}
ITP_COLUMNS = {"job_id", "submission_time", "num_iteration", "model_name", "deadline", "batch_size", "num_gpu"}


class TraceRow(BaseModel):
    """One job of a trace, in either schema, after validation."""

    job_id: str = Field(min_length=1)
    submit_time: float = Field(ge=0)
    iterations: float = Field(gt=0)
    model_name: str = Field(min_length=1)
    deadline: float | None
    batch_size: int = Field(gt=0)
    num_gpu: int = Field(ge=1)
    team: str = ""

    @model_validator(mode="after")
    def _deadline_after_submit(self) -> "TraceRow":
        if self.deadline is not None and self.deadline <= self.submit_time:
            raise ValueError("deadline must be after submit time")
        return self


def load_throughputs(directory: Path) -> dict[tuple[str, int], ThroughputCurve]:
    """Curves keyed by (model, global batch size) from DIR/MODEL.csv files."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(directory, None, None, "throughput directory not found")
    curves: dict[tuple[str, int], ThroughputCurve] = {}
    for path in sorted(directory.glob("*.csv")):
        model = path.stem
        rows = _rows(path)
        _, header = next(rows)
        if "global_batch_size" not in header:
            raise InputError(path, 1, "global_batch_size", "missing column")
        counts = []
        for name in header:
            if name == "global_batch_size":
                continue
            if not name.isdigit():
                raise InputError(path, 1, name, "GPU-count columns must be integers")
            counts.append(name)
        for number, row in rows:
            try:
                batch = int(row["global_batch_size"])
            except (TypeError, ValueError):
                raise InputError(path, number, "global_batch_size", f"not an integer: {row['global_batch_size']!r}") from None
            points: dict[int, float] = {}
            for name in counts:
                text = (row.get(name) or "").strip()
                if not text:
                    continue  # not measured
                try:
                    value = float(text)
                except ValueError:
                    raise InputError(path, number, name, f"not a number: {text!r}") from None
                if math.isfinite(value) and value > 0:
                    points[int(name)] = value
            if points:
                curves[(model, batch)] = ThroughputCurve(points)
    if not curves:
        raise InputError(directory, None, None, "no throughput CSV files with positive values")
    return curves


Curves = dict[tuple[str, int], ThroughputCurve]


def is_folder_of_kinds(directory: Path) -> bool:
    """A throughputs folder holding one folder of curves per GPU kind (A100/, T4/)."""
    directory = Path(directory)
    return directory.is_dir() and not any(directory.glob("*.csv")) and any(directory.glob("*/*.csv"))


def load_kind_throughputs(directory: Path) -> dict[str, Curves]:
    """Curves by GPU kind, from DIR/KIND/MODEL.csv."""
    directory = Path(directory)
    return {sub.name: load_throughputs(sub) for sub in sorted(directory.iterdir()) if any(sub.glob("*.csv"))}


def curves_for_trace(by_kind: Mapping[str, Curves], topology: MixedTopology) -> Curves:
    """One curve per (model, batch) to read a trace with: the first kind of
    the cluster that measured it."""
    merged: Curves = {}
    for kind in reversed(topology.kinds):
        merged.update(by_kind.get(kind, {}))
    return merged


def on_kinds(jobs: list[Job], by_kind: Mapping[str, Curves], topology: MixedTopology,
             speeds: Mapping[str, float]) -> tuple[list[Job], dict[str, int]]:
    """The jobs with their curve on every kind of the cluster they can run
    on: the measured one, or, for a kind with a `relative_speed` that never
    measured the model, the first measuring kind's curve scaled by the two
    kinds' speeds (an estimate: its scaling shape is the measured kind's).
    Also how many jobs got a derived curve, by kind."""
    derived = dict.fromkeys(topology.kinds, 0)
    out = []
    for job in jobs:
        key = (job.model, job.batch_size)
        measured = [k for k in topology.kinds if key in by_kind.get(k, {})]
        curves = []
        for kind in topology.kinds:
            if kind in measured:
                curves.append((kind, by_kind[kind][key]))
                continue
            base = next((k for k in measured if k in speeds), None)
            if base is None or kind not in speeds:
                continue
            factor = speeds[kind] / speeds[base]
            points = {g: v * factor for g, v in by_kind[base][key].points.items()}
            curves.append((kind, ThroughputCurve(points)))
            derived[kind] += 1
        first_kind, first_curve = curves[0]
        out.append(replace(job, kind=first_kind, curve=first_curve, curves=tuple(curves)))
    return out, derived


def _pick(row: dict[str, str], *names: str) -> tuple[str, str | None]:
    for name in names:
        if name in row:
            return name, row[name]
    return names[0], None


def load_trace(path: Path, curves: dict[tuple[str, int], ThroughputCurve]) -> list[Job]:
    """Jobs of a trace in the paper's schema or the ITP clusters' schema."""
    path = Path(path)
    rows = _rows(path)
    _, header = next(rows)
    itp = "submission_time" in header
    required = ITP_COLUMNS if itp else PAPER_COLUMNS
    for name in sorted(required):
        if name not in header:
            raise InputError(path, 1, name, "missing column")
    if not itp and "iteration" not in header:
        raise InputError(path, 1, "iteration", "missing column")
    jobs: list[Job] = []
    seen: set[str] = set()
    for number, row in rows:
        best_effort = (row.get("best_effort") or "0").strip() == "1"
        fields = {
            "job_id": _pick(row, "job_id"),
            "submit_time": _pick(row, "submission_time", "submit_time"),
            "iterations": _pick(row, "num_iteration", "iteration"),
            "model_name": _pick(row, "model_name"),
            "deadline": _pick(row, "deadline", "ddl"),
            "batch_size": _pick(row, "batch_size"),
            "num_gpu": _pick(row, "num_gpu"),
            "team": _pick(row, "team"),
        }
        values = {key: value for key, (_, value) in fields.items() if value is not None or key != "team"}
        if best_effort:
            values["deadline"] = None
        try:
            parsed = TraceRow.model_validate(values)
        except ValidationError as exc:
            err = exc.errors()[0]
            key = str(err["loc"][0]) if err["loc"] else "deadline"
            column = fields.get(key, (key, None))[0]
            raise InputError(path, number, column, err["msg"]) from None
        if parsed.job_id in seen:
            raise InputError(path, number, "job_id", f"duplicate job id {parsed.job_id!r}")
        seen.add(parsed.job_id)
        curve = curves.get((parsed.model_name, parsed.batch_size))
        if curve is None:
            known = sorted({m for m, _ in curves})
            if parsed.model_name not in known:
                raise InputError(path, number, "model_name",
                                 f"no throughput curve for model {parsed.model_name!r} (known: {', '.join(known)})")
            sizes = sorted(b for m, b in curves if m == parsed.model_name)
            raise InputError(path, number, "batch_size",
                             f"no throughput row for {parsed.model_name} at batch size {parsed.batch_size} (measured: {sizes})")
        jobs.append(Job(
            job_id=parsed.job_id, submit_time=parsed.submit_time, iterations=parsed.iterations,
            deadline=parsed.deadline, curve=curve, requested_gpus=parsed.num_gpu,
            model=parsed.model_name, batch_size=parsed.batch_size, team=parsed.team.strip(),
        ))
    if not jobs:
        raise InputError(path, None, None, "the trace has no jobs")
    return jobs
