"""The scheduler service's own tables, in the project store (`scheduler_service.store.db`):
SQLite under `$ELASTICFLOW_HOME` by default, any SQLAlchemy URL via
`ELASTICFLOW_DATABASE_URL`. The service is the only writer.

- `ef_job`: one row per flow run the service has seen, with its current state;
- `ef_decision`: every admission decision, with the reason and the earliest
  feasible deadline of a rejection;
- `ef_allocation`: every change of a run's GPU set (launch, rescale, park, release);
- `ef_lease`: which worker holds a pool (lease.py): one worker per pool.
"""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy.engine import Engine
from sqlmodel import Field, Session, SQLModel, select

from scheduler_service.contracts import RunPhase
from scheduler_service.store.db import get_engine


def _now() -> datetime:
    return datetime.now(timezone.utc)


def aware(moment: datetime) -> datetime:
    """A time read back from the store; SQLite hands it back naive, though it was written in UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)


class RunRecord(SQLModel, table=True):
    __tablename__ = "ef_job"

    flow_run_id: str = Field(primary_key=True)
    flow_run_name: str = ""
    model: str = ""
    global_batch_size: int = 0
    iterations: float = 0
    deadline: datetime | None = None
    submitted_at: datetime = Field(default_factory=_now)
    status: str = Field(default=RunPhase.ARRIVED.value, index=True)  # a RunPhase value
    share: int | None = None
    gpus: str = ""  # GPU ids it holds now, "0,1"
    message: str = ""
    outcome: str | None = None  # an Outcome, once it ended: from its final Prefect state
    team: str | None = None  # its work queue, on a cluster shared by teams
    at_risk: bool | None = None  # the control loop's at-risk flag, as its last RiskChanged set it
    updated_at: datetime = Field(default_factory=_now)


class DecisionRecord(SQLModel, table=True):
    __tablename__ = "ef_decision"

    id: int | None = Field(default=None, primary_key=True)
    flow_run_id: str = Field(index=True)
    at: datetime = Field(default_factory=_now)
    admitted: bool
    reason: str | None = None
    message: str = ""
    earliest_feasible_deadline: datetime | None = None
    share: int | None = None
    decision_ms: float | None = None


class AllocationRecord(SQLModel, table=True):
    __tablename__ = "ef_allocation"

    id: int | None = Field(default=None, primary_key=True)
    flow_run_id: str = Field(index=True)
    at: datetime = Field(default_factory=_now)
    action: str  # an AllocationAction: launch | rescale | park | stop | released | release
    gpus: str = ""


class StartRecord(SQLModel, table=True):
    """A run's start, launch to first iteration: what a restarted service
    recalls of how long starts take here (loop/start_cost.py)."""

    __tablename__ = "ef_start"

    id: int | None = Field(default=None, primary_key=True)
    flow_run_id: str
    at: datetime = Field(default_factory=_now)
    took_s: float


class LeaseRecord(SQLModel, table=True):
    """The worker that holds a pool: who (host, pid and that process's start
    time, which tells it from a later process with the same pid), since when,
    and its last heartbeat. `holder` is a token new at each take, `beats`
    counts renewals: a take-over is a compare-and-swap on both (lease.py)."""

    __tablename__ = "ef_lease"

    pool: str = Field(primary_key=True)
    holder: str
    host: str
    pid: int
    pid_started: int | None = None
    since: datetime = Field(default_factory=_now)
    renewed_at: datetime = Field(default_factory=_now)
    beats: int = 0


class ServiceStore:
    """Thin writer over the tables; every call is one short transaction."""

    def __init__(self, engine: Engine | None = None) -> None:
        self.engine = engine or get_engine()
        SQLModel.metadata.create_all(self.engine)
        self._add_missing_columns()

    def _add_missing_columns(self) -> None:
        """A store an older version made lacks the columns added since
        (`create_all` makes tables, never columns): add them, empty."""
        from sqlalchemy import inspect, text

        for table in (RunRecord.__table__,):  # type: ignore[attr-defined]
            present = {c["name"] for c in inspect(self.engine).get_columns(table.name)}
            for column in table.columns:
                if column.name not in present:
                    kind = column.type.compile(dialect=self.engine.dialect)
                    with self.engine.begin() as connection:
                        connection.execute(text(f'ALTER TABLE {table.name} ADD COLUMN "{column.name}" {kind}'))

    def upsert_job(self, flow_run_id: str, phase: RunPhase | None = None, **fields: object) -> None:
        """Create or update the run's row: its phase, and any other columns given."""
        self._write(flow_run_id, phase, fields)

    def decided(self, decision: DecisionRecord, phase: RunPhase, **fields: object) -> None:
        """The decision row and the run's new phase in one transaction: a
        worker killed between two commits would leave a decided run that
        reads undecided, and its next life would decide it a second time."""
        self._write(decision.flow_run_id, phase, fields, decision)

    def _write(self, flow_run_id: str, phase: RunPhase | None, fields: dict[str, object],
               also: SQLModel | None = None) -> None:
        with Session(self.engine) as session:
            row = session.get(RunRecord, flow_run_id) or RunRecord(flow_run_id=flow_run_id)
            if phase is not None:
                row.status = phase.value
            for key, value in fields.items():
                setattr(row, key, value)
            row.updated_at = _now()
            session.add(row)
            if also is not None:
                session.add(also)
            session.commit()

    def add(self, record: SQLModel) -> None:
        with Session(self.engine) as session:
            session.add(record)
            session.commit()

    def jobs(self, phases: tuple[RunPhase, ...] | None = None) -> list[RunRecord]:
        """Every run's row, oldest first; only those in `phases` if given."""
        with Session(self.engine) as session:
            query = select(RunRecord)
            if phases:
                query = query.where(RunRecord.status.in_([p.value for p in phases]))  # type: ignore[attr-defined]
            return list(session.exec(query.order_by(RunRecord.submitted_at)).all())

    def decisions(self, flow_run_id: str | None = None) -> list[DecisionRecord]:
        with Session(self.engine) as session:
            query = select(DecisionRecord)
            if flow_run_id:
                query = query.where(DecisionRecord.flow_run_id == flow_run_id)
            return list(session.exec(query.order_by(DecisionRecord.id)).all())

    def allocations(self, flow_run_id: str | None = None, since: datetime | None = None) -> list[AllocationRecord]:
        with Session(self.engine) as session:
            query = select(AllocationRecord)
            if flow_run_id:
                query = query.where(AllocationRecord.flow_run_id == flow_run_id)
            if since is not None:
                query = query.where(AllocationRecord.at >= since)
            return list(session.exec(query.order_by(AllocationRecord.id)).all())

    def recent_starts(self, count: int) -> tuple[float, ...]:
        """The last `count` starts' seconds, oldest first."""
        with Session(self.engine) as session:
            rows = session.exec(select(StartRecord).order_by(StartRecord.id.desc()).limit(count)).all()  # type: ignore[union-attr]
            return tuple(row.took_s for row in reversed(rows))
