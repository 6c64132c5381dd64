"""One worker per pool (issue 43, item 3): the pool's lease in the service
store, on SQLite and on PostgreSQL. A second taker is refused naming the
holder; a holder whose heartbeats stopped, or whose process is gone from this
host, is taken over; a holder taken over from learns it at its next beat; a
clean stop frees the pool at once. The same with two real workers:
tests/service/test_worker.py."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine

from scheduler_service.worker.lease import Holder, PoolHeld, PoolLease


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 12, 5, 12, 0, tzinfo=timezone.utc)

    def __call__(self) -> datetime:
        return self.now


@pytest.fixture(scope="module")
def postgres_url() -> Iterator[str]:
    from scheduler_service.stack.postgres import NO_POSTGRES, binaries, throwaway_postgres

    if binaries() is None:
        pytest.skip(NO_POSTGRES)
    with throwaway_postgres() as url:
        yield url.replace("postgresql://", "postgresql+psycopg://", 1)


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    from sqlmodel import delete

    from scheduler_service.store.db import get_engine
    from scheduler_service.worker.store import LeaseRecord, ServiceStore

    url = f"sqlite:///{tmp_path / 'store.db'}" if request.param == "sqlite" else request.getfixturevalue(
        "postgres_url")
    engine = get_engine(url)
    ServiceStore(engine)
    yield engine
    with engine.begin() as connection:  # the PostgreSQL server serves the module's tests
        connection.execute(delete(LeaseRecord))


def test_a_second_worker_is_refused_naming_the_first_and_a_released_pool_is_free(engine: Engine) -> None:
    first = PoolLease(engine, "gpus", stale_s=30)
    assert first.take() is None
    # another live process on this host: this test's own parent
    other = Holder(socket.gethostname(), *_parent())
    second = PoolLease(engine, "gpus", stale_s=30, holder=other)
    with pytest.raises(PoolHeld) as refused:
        second.take()
    message = str(refused.value)
    assert f"host {socket.gethostname()}, pid {first.holder.pid}, since " in message and "'gpus'" in message
    assert PoolLease(engine, "other-pool", stale_s=30, holder=other).take() is None  # one lease per pool
    assert first.renew()
    first.release()
    assert second.take() is None


def test_a_silent_holder_on_another_host_is_taken_over_after_the_bound_and_learns_it(engine: Engine) -> None:
    clock = Clock()
    away = PoolLease(engine, "gpus", stale_s=30, holder=Holder("elsewhere", 4242, 1), clock=clock)
    assert away.take() is None
    newcomer = PoolLease(engine, "gpus", stale_s=30, clock=clock)
    clock.now += timedelta(seconds=20)
    assert away.renew()
    clock.now += timedelta(seconds=25)  # 25 s after its last heartbeat: still its
    with pytest.raises(PoolHeld, match="host elsewhere, pid 4242"):
        newcomer.take()
    clock.now += timedelta(seconds=10)  # 35 s: gone
    taken = newcomer.take()
    assert taken is not None and "host elsewhere, pid 4242" in taken and "no heartbeat for 35 s" in taken
    assert not away.renew() and away.lost
    away.release()  # a stale holder's clean stop leaves the new holder's lease alone
    assert newcomer.renew()


def test_a_holder_whose_process_is_gone_from_this_host_is_taken_over_at_once(engine: Engine) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = Holder(socket.gethostname(), int(done.stdout), None)
    assert PoolLease(engine, "gpus", stale_s=3600, holder=dead).take() is None
    taken = PoolLease(engine, "gpus", stale_s=3600).take()
    assert taken is not None and "its process has ended" in taken


def _parent() -> tuple[int, int | None]:
    import os

    from flows.training.launch.boot import start_time

    return os.getppid(), start_time(os.getppid())


def test_a_holder_that_ended_but_was_not_yet_reaped_is_gone(engine: Engine) -> None:
    """A worker SIGKILLed under `up` is a zombie until the supervisor polls it."""
    import time

    from flows.training.launch.boot import start_time

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    started = start_time(child.pid)
    time.sleep(1.0)  # it has exited; nobody has waited for it
    try:
        assert PoolLease(engine, "gpus", stale_s=3600, holder=Holder(socket.gethostname(), child.pid,
                                                                      started)).take() is None
        taken = PoolLease(engine, "gpus", stale_s=3600).take()
        assert taken is not None and "its process has ended" in taken
    finally:
        child.wait()
