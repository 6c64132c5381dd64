"""Measured throughput curves: iterations/s by (model, global batch size, GPU kind, GPU count).

`elasticflow profile` writes them; admission reads them with `get_curve`
(one kind) or `get_curves` (every kind measured). A curve measured on fewer
GPUs than the model could use here, because the others were busy, is kept
as partial (`partial_kinds`): what it measured holds, but its widest count
is not the model's, and it is completed once those GPUs are free
(worker/profiling.py). Kind "" is a curve measured
where kinds were not told apart (this machine, or a store made before kinds). The
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
TABLE = "throughput_measurement"


class ThroughputMeasurement(SQLModel, table=True):
    """One measured point of a model's throughput curve."""

    __tablename__ = TABLE
    __table_args__ = (UniqueConstraint("model", "global_batch_size", "kind", "gpus", name="uq_throughput_kind_point"),)

    id: int | None = Field(default=None, primary_key=True)
    model: str = Field(index=True)
    global_batch_size: int = Field(index=True)
    kind: str = Field(default="", index=True)
    gpus: int
    iterations_per_s: float
    device: str = "cpu"
    partial: bool = False  # its curve lacks counts the model could use here (GPUs were busy): not its max
    measured_at: datetime = Field(default_factory=lambda: datetime.now(timezone.utc))


def _engine(engine: Engine | None) -> Engine:
    from scheduler_service.store.db import get_engine

    return engine or get_engine()


def upgrade(engine: Engine) -> None:
    """A store made before curves were kept per GPU kind gets the `kind`
    column (its curves become kind "") and the unique point per kind; one
    made before partial curves gets `partial` (its curves are whole). SQLite
    cannot drop a constraint, so there the table is rebuilt; each step is one
    transaction, and a store already upgraded is left alone."""
    from sqlalchemy import inspect
    from sqlalchemy.exc import DatabaseError

    def lacks(column: str) -> bool:
        inspector = inspect(engine)
        return inspector.has_table(TABLE) and column not in {c["name"] for c in inspector.get_columns(TABLE)}

    for column, add in (("kind", _add_kind), ("partial", _add_partial)):
        if not lacks(column):
            continue
        try:
            add(engine)
        except DatabaseError:
            if lacks(column):  # not another process upgrading it at the same moment
                raise


def _add_partial(engine: Engine) -> None:
    from sqlalchemy import text

    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {TABLE} ADD COLUMN partial BOOLEAN NOT NULL DEFAULT FALSE"))


def _add_kind(engine: Engine) -> None:
    from sqlalchemy import inspect, text

    if engine.dialect.name != "sqlite":
        with engine.begin() as conn:
            conn.execute(text(f"ALTER TABLE {TABLE} ADD COLUMN kind VARCHAR NOT NULL DEFAULT ''"))
            conn.execute(text(f"ALTER TABLE {TABLE} DROP CONSTRAINT IF EXISTS uq_throughput_point"))
            conn.execute(text(f"ALTER TABLE {TABLE} ADD CONSTRAINT uq_throughput_kind_point "
                              "UNIQUE (model, global_batch_size, kind, gpus)"))
            conn.execute(text(f"CREATE INDEX IF NOT EXISTS ix_{TABLE}_kind ON {TABLE} (kind)"))
        return
    old = f"{TABLE}_before_kinds"
    columns = "model, global_batch_size, gpus, iterations_per_s, device, measured_at"
    with engine.begin() as conn:
        conn.execute(text(f"ALTER TABLE {TABLE} RENAME TO {old}"))
        for index in inspect(conn).get_indexes(old):
            conn.execute(text(f'DROP INDEX IF EXISTS "{index["name"]}"'))
        ThroughputMeasurement.__table__.create(conn)  # type: ignore[attr-defined]
        conn.execute(text(f"INSERT INTO {TABLE} ({columns}, kind, partial) SELECT {columns}, '', 0 FROM {old}"))
        conn.execute(text(f"DROP TABLE {old}"))


def save_curve(
    model: str, batch_size: int, curve: dict[int, float], device: str = "cpu", engine: Engine | None = None,
    kind: str = "", partial: bool = False,
) -> None:
    """Store (replace) the measured points of one curve, on GPUs of `kind`;
    `partial`: the curve (with the points kept from before) still lacks
    counts the model could use here."""
    if not curve:
        raise ValueError("an empty curve has nothing to store")
    with Session(_engine(engine)) as session:
        existing = session.exec(
            select(ThroughputMeasurement).where(
                ThroughputMeasurement.model == model,
                ThroughputMeasurement.global_batch_size == batch_size,
                ThroughputMeasurement.kind == kind,
                ThroughputMeasurement.gpus.in_(list(curve)),  # type: ignore[attr-defined]
            )
        ).all()
        for row in existing:
            session.delete(row)
        session.flush()
        for row in session.exec(select(ThroughputMeasurement).where(
                ThroughputMeasurement.model == model, ThroughputMeasurement.global_batch_size == batch_size,
                ThroughputMeasurement.kind == kind)).all():
            row.partial = partial
            session.add(row)
        for gpus, rate in sorted(curve.items()):
            session.add(
                ThroughputMeasurement(
                    model=model,
                    global_batch_size=batch_size,
                    gpus=int(gpus),
                    iterations_per_s=float(rate),
                    device=device,
                    kind=kind,
                    partial=partial,
                )
            )
        session.commit()


def get_curves(model: str, batch_size: int, engine: Engine | None = None) -> dict[str, dict[int, float]]:
    """GPU kind -> (GPU count -> iterations/s) for (model, global batch size): every kind measured."""
    with Session(_engine(engine)) as session:
        rows = session.exec(
            select(ThroughputMeasurement).where(
                ThroughputMeasurement.model == model, ThroughputMeasurement.global_batch_size == batch_size
            )
        ).all()
    out: dict[str, dict[int, float]] = {}
    for row in sorted(rows, key=lambda r: (r.kind, r.gpus)):
        out.setdefault(row.kind, {})[row.gpus] = row.iterations_per_s
    return out


def partial_kinds(model: str, batch_size: int, engine: Engine | None = None) -> set[str]:
    """The kinds whose stored curve for (model, global batch size) is partial."""
    with Session(_engine(engine)) as session:
        rows = session.exec(select(ThroughputMeasurement.kind).where(
            ThroughputMeasurement.model == model, ThroughputMeasurement.global_batch_size == batch_size,
            ThroughputMeasurement.partial == True)).all()  # noqa: E712 (a SQL expression)
    return set(rows)


def get_curve(model: str, batch_size: int, engine: Engine | None = None, kind: str | None = None
              ) -> dict[int, float] | None:
    """GPU count -> iterations/s for (model, global batch size), or None if
    never profiled: on `kind`, or, when no kind is asked, the curve of no
    named kind, else the only kind's (a cluster of one kind)."""
    curves = get_curves(model, batch_size, engine)
    if kind is not None:
        return curves.get(kind)
    if "" in curves:
        return curves[""]
    return curves[min(curves)] if curves else None


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
            curve = get_curve(model, size, engine) or {}  # one kind's: see get_curve
            writer.writerow([size, *[curve.get(g, 0) for g in CSV_GPU_COUNTS]])
    return out
