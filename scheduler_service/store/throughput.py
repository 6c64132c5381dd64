"""Measured throughput curves: iterations/s by (model, global batch size, GPU count).

`elasticflow profile` writes them; admission reads them with `get_curve`. The
CSV export has the shape of the shared tables in data/throughputs/: one row per
global batch size, one column per power-of-two GPU count, 0 where not measured.
"""

from __future__ import annotations

import csv
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import UniqueConstraint
from sqlalchemy.engine import Engine
from sqlmodel import Field, Session, SQLModel, select

CSV_GPU_COUNTS = (1, 2, 4, 8, 16, 32, 64)


class ThroughputMeasurement(SQLModel, table=True):
    """One measured point of a model's throughput curve."""

    __tablename__ = "throughput_measurement"
    __table_args__ = (UniqueConstraint("model", "global_batch_size", "gpus", name="uq_throughput_point"),)

    id: int | None = Field(default=None, primary_key=True)
    model: str = Field(index=True)
    global_batch_size: int = Field(index=True)
    gpus: int
    iterations_per_s: float
    device: str = "cpu"
    measured_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))


def _engine(engine: Engine | None) -> Engine:
    from scheduler_service.store.db import get_engine

    return engine or get_engine()


def save_curve(
    model: str, batch_size: int, curve: dict[int, float], device: str = "cpu", engine: Engine | None = None
) -> None:
    """Store (replace) the measured points of one curve."""
    if not curve:
        raise ValueError("an empty curve has nothing to store")
    with Session(_engine(engine)) as session:
        existing = session.exec(
            select(ThroughputMeasurement).where(
                ThroughputMeasurement.model == model,
                ThroughputMeasurement.global_batch_size == batch_size,
                ThroughputMeasurement.gpus.in_(list(curve)),  # type: ignore[attr-defined]
            )
        ).all()
        for row in existing:
            session.delete(row)
        session.flush()
        for gpus, rate in sorted(curve.items()):
            session.add(
                ThroughputMeasurement(
                    model=model,
                    global_batch_size=batch_size,
                    gpus=int(gpus),
                    iterations_per_s=float(rate),
                    device=device,
                )
            )
        session.commit()


def get_curve(model: str, batch_size: int, engine: Engine | None = None) -> dict[int, float] | None:
    """GPU count -> iterations/s for (model, global batch size), or None if never profiled."""
    with Session(_engine(engine)) as session:
        rows = session.exec(
            select(ThroughputMeasurement).where(
                ThroughputMeasurement.model == model, ThroughputMeasurement.global_batch_size == batch_size
            )
        ).all()
    return {row.gpus: row.iterations_per_s for row in sorted(rows, key=lambda r: r.gpus)} or None


def batch_sizes(model: str, engine: Engine | None = None) -> list[int]:
    with Session(_engine(engine)) as session:
        rows = session.exec(
            select(ThroughputMeasurement.global_batch_size).where(ThroughputMeasurement.model == model).distinct()
        ).all()
    return sorted(int(r) for r in rows)


def export_csv(model: str, path: str | Path, engine: Engine | None = None) -> Path:
    """Write every stored curve of `model` in the data/throughputs/ CSV shape."""
    sizes = batch_sizes(model, engine)
    if not sizes:
        raise ValueError(f"no throughput measured for model {model!r}")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["global_batch_size", *CSV_GPU_COUNTS])
        for size in sizes:
            curve = get_curve(model, size, engine) or {}
            writer.writerow([size, *[curve.get(g, 0) for g in CSV_GPU_COUNTS]])
    return out
