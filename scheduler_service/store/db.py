"""The project's SQL store: SQLite under `$ELASTICFLOW_HOME` unless
`ELASTICFLOW_DATABASE_URL` names another SQLAlchemy URL."""

from __future__ import annotations

import os
from functools import lru_cache

from sqlalchemy.engine import Engine
from sqlmodel import SQLModel, create_engine

from elasticflow_block.home import elasticflow_home

DATABASE_URL_ENV = "ELASTICFLOW_DATABASE_URL"


def database_url() -> str:
    """The configured URL, read at call time so tests and CLIs can set the env var."""
    url = os.environ.get(DATABASE_URL_ENV)
    if url:
        return url
    home = elasticflow_home()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'elasticflow.db'}"


@lru_cache(maxsize=8)
def _engine_for(url: str) -> Engine:
    # Timestamps are stored without a zone and read as UTC: make a PostgreSQL
    # session speak UTC whatever the server's own time zone.
    connect_args = {"options": "-c timezone=UTC"} if url.startswith("postgresql") else {}
    engine = create_engine(url, connect_args=connect_args, pool_pre_ping=True)
    # Importing the table modules registers them on SQLModel.metadata.
    from scheduler_service.store import throughput

    throughput.upgrade(engine)
    _create_tables(engine)
    return engine


def _create_tables(engine: Engine, attempts: int = 5) -> None:
    """`create_all` checks for each table, then creates it: two processes
    opening a fresh store at once (the worker and a CLI, two xdist workers)
    both see it missing and the second `CREATE TABLE` fails. Once the other
    one has made it, the check passes: try again."""
    import time

    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

    for attempt in range(attempts):
        try:
            SQLModel.metadata.create_all(engine)
            return
        except (OperationalError, ProgrammingError, IntegrityError) as exc:
            text = str(exc).lower()
            if attempt == attempts - 1 or not ("already exists" in text or "duplicate" in text or "locked" in text):
                raise
            time.sleep(0.05 * (attempt + 1))


def get_engine(url: str | None = None) -> Engine:
    """An engine for `url` (default: `database_url()`), with the schema created."""
    return _engine_for(url or database_url())
