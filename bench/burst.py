"""Burst benchmark (issue 14, item 5): N concurrent submissions against the
local stack (`local_stack`, as `elasticflow up` runs it), with Prefect's server
on PostgreSQL and on SQLite.

Each submission is `create_flow_run_from_deployment` on train/mlp, all in
flight at once, with the client's own retries off so that every HTTP 503 is
seen (and then retried here, up to 20 times, so that a run is not lost to it).
Every run asks for 90 s of work at one slot's profiled rate, due in 120 s, on
two CPU slots: one or two are admitted, the rest rejected, so the figure is
the worker's take-in and decision, not training.

Printed per database: creation errors (503s, other errors), runs created, every
run decided?, p50 / p99 of creation -> decision (the first state named
Admitted, Rejected, Profiling or Waiting in the run's state history, against
the run's creation time on the server), runs lost (created but never
decided), GPUs double-booked (the worker's `ef_allocation` rows replayed in
order: a launch onto GPUs another run was last told to use). Targets (on
PostgreSQL): no creation error, all decided, p99 <= 10 s. Reported, not
asserted: the exit status is nonzero only if the benchmark itself fails.

With `--hog`, one CPU-bound process (`while 1: pass`) runs beside the stack
for the whole benchmark, as another tenant's job would. The last line is JSON:
per database `runs`, `created`, `decided`, `errors`, `lost`, `double_booked`,
`p50_s`, `p99_s`.

Run: .venv/bin/python bench/burst.py [--runs 200] [--database postgresql|sqlite|both] [--hog]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any
from uuid import UUID

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DECISIONS = {"Admitted", "Best-effort", "Rejected", "Profiling", "Waiting"}
UNDECIDED = {"Scheduled", "Late"}  # the states of a run the worker has not decided yet
MLP_CURVE = {1: 20.0, 2: 36.0}  # seeded profile, as the tests use: no profiling in the way
SETTINGS = {  # the worker's: a 2-slot CPU cluster, 2 s slots, no start cost kept
    "ELASTICFLOW_CLUSTER": str(ROOT / "infra" / "local-cpu2.csv"),
    "ELASTICFLOW_INTERVAL_S": "2",
    "ELASTICFLOW_RESTART_S": "0.5",
    "ELASTICFLOW_LAUNCH_S": "0",
}


@dataclass
class Burst:
    database: str
    runs: int
    created: list[str] = field(default_factory=list)
    http_503: int = 0
    other_errors: list[str] = field(default_factory=list)
    submit_s: float = 0.0
    latencies: dict[str, float] = field(default_factory=dict)  # run -> creation -> decision, s
    created_at: dict[str, datetime] = field(default_factory=dict)  # run -> its creation on the server
    recorded: dict[str, float] = field(default_factory=dict)  # run -> creation -> the worker's ef_decision row, s
    taken_in: dict[str, float] = field(default_factory=dict)  # run -> creation -> the worker's ef_job row, s
    decided_by: dict[str, str] = field(default_factory=dict)  # run -> name of its decision state
    double_booked: list[str] = field(default_factory=list)
    waited_s: float = 0.0

    @property
    def lost(self) -> int:
        return len(set(self.created) - set(self.latencies))

    def percentile(self, q: float, of: dict[str, float] | None = None) -> float | None:
        values = sorted((self.latencies if of is None else of).values())
        if not values:
            return None
        return values[max(0, math.ceil(q / 100 * len(values)) - 1)]  # nearest rank

    def figures(self) -> dict[str, Any]:
        p50, p99 = self.percentile(50), self.percentile(99)
        return {"runs": self.runs, "created": len(self.created), "decided": len(self.latencies),
                "errors": self.http_503 + len(self.other_errors), "http_503": self.http_503,
                "lost": self.lost, "double_booked": len(self.double_booked),
                "p50_s": None if p50 is None else round(p50, 2), "p99_s": None if p99 is None else round(p99, 2)}

    def lines(self) -> list[str]:
        p50, p99 = self.percentile(50), self.percentile(99)
        kinds = {name: list(self.decided_by.values()).count(name) for name in sorted(set(self.decided_by.values()))}
        fmt = lambda v: "-" if v is None else f"{v:.2f} s"  # noqa: E731
        return [
            f"{self.database}: {self.runs} concurrent submissions, created {len(self.created)} in {self.submit_s:.1f} s",
            f"  creation errors: {self.http_503} HTTP 503, {len(self.other_errors)} other"
            + (f" ({self.other_errors[0]})" if self.other_errors else ""),
            f"  every run decided: {'yes' if len(self.latencies) == len(self.created) == self.runs else 'NO'}"
            f" ({len(self.latencies)}/{len(self.created)}: {kinds}; waited {self.waited_s:.0f} s)",
            f"  creation -> decision: p50 {fmt(p50)}, p99 {fmt(p99)}, max {fmt(max(self.latencies.values(), default=None))}",
            f"  where it went: creation -> taken in by the worker (ef_job row) p50 "
            f"{fmt(self.percentile(50, self.taken_in))}, p99 {fmt(self.percentile(99, self.taken_in))};"
            f" the worker's decision row (ef_decision, written as it publishes) p50 "
            f"{fmt(self.percentile(50, self.recorded))}, p99 {fmt(self.percentile(99, self.recorded))}",
            f"  lost: {self.lost}; double-booked: {len(self.double_booked)}"
            + (f" ({self.double_booked[0]})" if self.double_booked else ""),
        ]


async def submit_all(burst: Burst, parameters: dict) -> None:
    """All at once; a 503 is counted, then retried after a pause."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    async with get_client() as client:
        deployment = await client.read_deployment_by_name("train/mlp")

        async def create(i: int) -> None:
            for attempt in range(20):
                try:
                    run = await client.create_flow_run_from_deployment(deployment.id, parameters=parameters,
                                                                       name=f"burst-{i}")
                    burst.created.append(str(run.id))
                    return
                except PrefectHTTPStatusError as exc:
                    if exc.response.status_code != 503:
                        burst.other_errors.append(f"HTTP {exc.response.status_code}")
                        return
                    burst.http_503 += 1
                except Exception as exc:  # a timeout, a dropped connection: counted, retried
                    burst.other_errors.append(type(exc).__name__)
                await asyncio.sleep(min(1.0 + attempt, 5.0))

        start = time.time()
        await asyncio.gather(*(create(i) for i in range(burst.runs)))
        burst.submit_s = time.time() - start


async def read_decisions(burst: Burst, timeout_s: float) -> None:
    """Every 2 s, one request for all the runs' current states; a run whose
    state has moved on from Scheduled/Late past a decision has its history
    read once, for the time of its first decision state (written by the
    server); a rejected run's current state is that decision. Reading every
    undecided run's history on every sweep was 400 requests per sweep on the
    same two cores, and reading each rejected run's once 1,000 more in a
    burst of 1,000: the benchmark slowed what it measured."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    gate = asyncio.Semaphore(10)
    start = time.time()
    async with get_client() as client:

        async def look(run: Any) -> None:
            if run.state.name in DECISIONS and run.state.is_final():  # Rejected: its first decision is its state
                states = [run.state]
            else:  # moved on (Admitted -> Pending -> ...): its history has the decision
                async with gate:
                    states = sorted(await client.read_flow_run_states(run.id), key=lambda s: s.timestamp)
            first = next((s for s in states if s.name in DECISIONS), None)
            if first is not None:
                burst.latencies[str(run.id)] = (first.timestamp - run.created).total_seconds()
                burst.created_at[str(run.id)] = run.created
                burst.decided_by[str(run.id)] = first.name

        while time.time() - start < timeout_s:
            undecided = [UUID(r) for r in burst.created if r not in burst.latencies]
            if not undecided:
                break
            runs = []
            for i in range(0, len(undecided), 200):  # the server's largest page
                try:
                    runs += await client.read_flow_runs(
                        flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=undecided[i:i + 200])), limit=200)
                except Exception:
                    pass
            moved = [run for run in runs if run.state is not None and run.state.name not in UNDECIDED]
            await asyncio.gather(*(look(run) for run in moved), return_exceptions=True)
            await asyncio.sleep(2.0)
    burst.waited_s = time.time() - start


def decision_records(home: Path, burst: Burst) -> None:
    """When the worker wrote each run's first decision, against its creation:
    what of the latency is take-in and deciding, not publishing the state."""
    from sqlmodel import Session, select

    from scheduler_service.store.db import get_engine
    from scheduler_service.worker.store import DecisionRecord, RunRecord, aware

    with Session(get_engine(f"sqlite:///{home / 'elasticflow.db'}")) as session:
        rows = list(session.exec(select(DecisionRecord).order_by(DecisionRecord.id)).all())  # type: ignore[arg-type]
        jobs = list(session.exec(select(RunRecord)).all())
    for row in rows:
        created = burst.created_at.get(row.flow_run_id)
        if created is not None and row.flow_run_id not in burst.recorded:
            burst.recorded[row.flow_run_id] = (aware(row.at) - created).total_seconds()
    for job in jobs:
        created = burst.created_at.get(job.flow_run_id)
        if created is not None:
            burst.taken_in[job.flow_run_id] = (aware(job.submitted_at) - created).total_seconds()


def double_bookings(home: Path, runs: set[str]) -> list[str]:
    """Replay the worker's GPU changes in order: a launch onto GPUs another run
    was last told to use is a double booking."""
    from sqlmodel import Session, select

    from scheduler_service.store.db import get_engine
    from scheduler_service.worker.store import AllocationRecord

    with Session(get_engine(f"sqlite:///{home / 'elasticflow.db'}")) as session:
        rows = list(session.exec(select(AllocationRecord).order_by(AllocationRecord.id)).all())  # type: ignore[arg-type]
    holding: dict[str, set[int]] = {}
    problems = []
    for row in (r for r in rows if r.flow_run_id in runs):
        gpus = {int(g) for g in row.gpus.split(",") if g}
        if row.action in ("launch", "rescale"):
            clash = {o: h & gpus for o, h in holding.items() if o != row.flow_run_id and h & gpus}
            if row.action == "launch" and clash:
                problems.append(f"{row.flow_run_id} launched on {sorted(gpus)} held by {clash}")
            holding[row.flow_run_id] = gpus
        else:
            holding.pop(row.flow_run_id, None)
    return problems


def run_burst(database: str, runs: int, base: Path, url: str | None = None, timeout_s: float = 900.0) -> Burst:
    """One burst against a fresh stack under `base`; `url`: the server's
    PostgreSQL (None: SQLite under the home)."""
    import os

    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, PREFECT_HOME, temporary_settings

    from scheduler_service.stack.local import free_port, local_stack
    from scheduler_service.store import save_curve

    home = base / "home"
    os.environ["ELASTICFLOW_HOME"] = str(home)
    os.environ.pop("ELASTICFLOW_DATABASE_URL", None)
    burst = Burst(database, runs)
    with local_stack(home, free_port(), env=SETTINGS, models=("mlp",), schedules=False, database=url) as stack, \
            temporary_settings(updates={PREFECT_API_URL: stack.api_url, PREFECT_HOME: home / "prefect",
                                        PREFECT_CLIENT_MAX_RETRIES: 0}):
        log = stack.logs / "worker.log"
        end = time.time() + 240
        while "started!" not in log.read_text(errors="replace"):
            if time.time() > end:
                raise RuntimeError(f"the worker did not start; see {log}")
            for line in stack.supervise():  # an exit, and why: the end of its log
                print(line, "\n  " + "\n  ".join(log.read_text(errors="replace").splitlines()[-5:]), file=sys.stderr)
            time.sleep(0.5)
        save_curve("mlp", 32, MLP_CURVE)  # once the worker made the store: two first uses race on its tables
        deadline = datetime.now(timezone.utc) + timedelta(seconds=120)
        parameters = {"iterations": 20 * 90, "deadline": deadline.isoformat(), "checkpoint_interval": 2000,
                      "hyperparameters": {"global_batch_size": 32}, "device": "cpu"}
        asyncio.run(submit_all(burst, parameters))
        asyncio.run(read_decisions(burst, timeout_s))
        burst.double_booked = double_bookings(home, set(burst.created))
        decision_records(home, burst)
    return burst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--database", choices=("postgresql", "sqlite", "both"), default="both")
    parser.add_argument("--timeout", type=float, default=900.0, help="longest wait for every decision, s")
    parser.add_argument("--keep", action="store_true", help="keep each stack's home (logs, store) and print where")
    parser.add_argument("--hog", action="store_true", help="one busy-looping process beside the stack throughout")
    parser.add_argument("--publish-concurrency", type=int, default=None,
                        help="the worker's ELASTICFLOW_PUBLISH_CONCURRENCY (default: the worker's own)")
    args = parser.parse_args(argv)
    if args.publish_concurrency is not None:
        SETTINGS["ELASTICFLOW_PUBLISH_CONCURRENCY"] = str(args.publish_concurrency)
    hog = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if args.hog else None
    try:
        return _measure(args)
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()


def _measure(args: argparse.Namespace) -> int:
    from scheduler_service.stack.postgres import NO_POSTGRES, binaries, throwaway_postgres

    print("load before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    chosen = ["postgresql", "sqlite"] if args.database == "both" else [args.database]
    figures: dict[str, Any] = {"hog": args.hog, "publish_concurrency": args.publish_concurrency}
    for database in chosen:
        with tempfile.TemporaryDirectory(prefix=f"burst-{database}-") as scratch:
            tmp = tempfile.mkdtemp(prefix=f"burst-{database}-") if args.keep else scratch  # 3.11: no delete=False
            if args.keep:
                print(f"{database}: home {tmp}/home")
            if database == "postgresql":
                if binaries() is None:
                    print(f"postgresql: skipped, {NO_POSTGRES}")
                    continue
                with throwaway_postgres() as url:
                    burst = run_burst(database, args.runs, Path(tmp), url, args.timeout)
            else:
                burst = run_burst(database, args.runs, Path(tmp), None, args.timeout)
        print("\n".join(burst.lines()), flush=True)
        figures[database] = burst.figures()
    print("load after:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
