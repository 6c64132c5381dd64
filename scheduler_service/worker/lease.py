"""One worker per pool: a lease in the service store.

Two workers on one pool each take in, decide and launch the same runs: every
run got two decisions, runs read `finished` while still training, and more
runs trained than there were GPUs (issue 43). So a worker takes its pool's
lease before it touches anything, and a second worker refuses to start, naming
the first (host, pid, since).

The holder renews the lease every `stale_s / 3` from a thread of its own (a
poll held up by a slow server must not lose it). A lease is taken over when
its holder is provably gone: not renewed for `stale_s`, or its process gone
from this very host (a SIGKILLed worker restarted at once need not wait). A
take-over is a compare-and-swap on the holder's token and heartbeat count, so
of two workers taking over at once, one wins. A holder whose lease was taken
over (it stalled past `stale_s`) stops: it is no longer the pool's worker.
The clocks compared are the workers' own (UTC): hosts sharing a PostgreSQL
store are assumed to keep time within a fraction of `stale_s`.

Works the same on SQLite and PostgreSQL: plain INSERT, UPDATE ... WHERE and
DELETE, each one short transaction.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from sqlalchemy import delete, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlmodel import Session

from flows.training.launch.boot import start_time
from scheduler_service.worker.store import LeaseRecord, aware

log = logging.getLogger(__name__)


class PoolHeld(SystemExit):
    """Another live worker holds the pool; the message names it, for the operator."""


@dataclass(frozen=True)
class Holder:
    """Who takes or holds a lease."""

    host: str
    pid: int
    pid_started: int | None

    @classmethod
    def this_process(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), start_time(os.getpid()))


def _now() -> datetime:
    return datetime.now(timezone.utc)


def _alive_here(row: LeaseRecord, here: Holder) -> bool | None:
    """Whether the row's process still lives, where this host can tell (None: another host)."""
    if row.host != here.host:
        return None
    try:  # a zombie (ended, not yet reaped by its parent) is gone too
        if Path(f"/proc/{row.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return False
    except (OSError, IndexError):
        return False
    started = start_time(row.pid)
    return started is not None and (row.pid_started is None or started == row.pid_started)


def describe(row: LeaseRecord) -> str:
    return f"host {row.host}, pid {row.pid}, since {aware(row.since).isoformat(timespec='seconds')}"


class PoolLease:
    """This worker's hold on `pool`: `take` it, `renew` it (or `keep` it
    renewed by a thread), `release` it on a clean stop."""

    def __init__(self, engine: Engine, pool: str, stale_s: float, holder: Holder | None = None,
                 clock: Callable[[], datetime] = _now) -> None:
        self.engine, self.pool, self.stale_s = engine, pool, stale_s
        self.holder = holder or Holder.this_process()
        self.token = uuid.uuid4().hex
        self.clock = clock
        self.lost = False
        self._beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def take(self) -> str | None:
        """Hold the pool, or raise PoolHeld naming its live holder. Returns a
        line about the holder taken over from, if any."""
        for _ in range(5):  # each round, someone else may have changed the row meanwhile
            now = self.clock()
            mine = LeaseRecord(pool=self.pool, holder=self.token, host=self.holder.host, pid=self.holder.pid,
                               pid_started=self.holder.pid_started, since=now, renewed_at=now, beats=0)
            with Session(self.engine) as session:
                row = session.get(LeaseRecord, self.pool)
                if row is None:
                    session.add(mine)
                    try:
                        session.commit()
                        return None
                    except IntegrityError:  # another worker inserted it first: look again
                        session.rollback()
                        continue
                session.expunge(row)
            why = self._gone(row, now)
            if why is None:
                raise PoolHeld(
                    f"work pool {self.pool!r} is held by another ElasticFlow worker ({describe(row)}, last "
                    f"heartbeat {aware(row.renewed_at).isoformat(timespec='seconds')}): one worker per pool; stop "
                    f"that one first (its lease is taken over {self.stale_s:.0f} s after its last heartbeat)")
            with self.engine.begin() as connection:
                swapped = connection.execute(
                    update(LeaseRecord)
                    .where(LeaseRecord.pool == self.pool, LeaseRecord.holder == row.holder,  # type: ignore[arg-type]
                           LeaseRecord.beats == row.beats)  # type: ignore[arg-type]
                    .values(holder=self.token, host=self.holder.host, pid=self.holder.pid,
                            pid_started=self.holder.pid_started, since=now, renewed_at=now, beats=0))
            if swapped.rowcount == 1:
                return f"took over work pool {self.pool!r} from a worker that is gone ({describe(row)}; {why})"
        raise PoolHeld(f"work pool {self.pool!r}: its lease kept changing hands while this worker tried to take it")

    def _gone(self, row: LeaseRecord, now: datetime) -> str | None:
        """Why the row's holder is known gone, or None while it may live."""
        alive = _alive_here(row, self.holder)
        if alive is False:
            return "its process has ended"
        silent_s = (now - aware(row.renewed_at)).total_seconds()
        if silent_s > self.stale_s:
            return f"no heartbeat for {silent_s:.0f} s"
        return None

    def renew(self) -> bool:
        """One heartbeat; False (and `lost`) once another worker holds the pool."""
        self._beats += 1
        with self.engine.begin() as connection:
            done = connection.execute(
                update(LeaseRecord)
                .where(LeaseRecord.pool == self.pool, LeaseRecord.holder == self.token)  # type: ignore[arg-type]
                .values(renewed_at=self.clock(), beats=self._beats))
        if done.rowcount != 1:
            self.lost = True
        return not self.lost

    def keep(self, on_lost: Callable[[], None]) -> None:
        """Renew every third of `stale_s` from a daemon thread until `release`;
        `on_lost` once the lease is gone to another worker. A store that does
        not answer is tried again at the next beat."""
        def beat() -> None:
            while not self._stop.wait(self.stale_s / 3):
                try:
                    if not self.renew():
                        log.error("work pool %r: another worker took this worker's lease over (it missed its "
                                  "heartbeats for %.0f s); stopping", self.pool, self.stale_s)
                        on_lost()
                        return
                except Exception as exc:  # noqa: BLE001 - a store down for a moment: the next beat tries again
                    log.warning("work pool %r: lease heartbeat failed (%s: %s)", self.pool, type(exc).__name__, exc)

        self._thread = threading.Thread(target=beat, name=f"lease-{self.pool}", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Give the pool up (a clean stop): the next worker takes it at once."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self.engine.begin() as connection:
            connection.execute(delete(LeaseRecord).where(LeaseRecord.pool == self.pool,  # type: ignore[arg-type]
                                                         LeaseRecord.holder == self.token))  # type: ignore[arg-type]

