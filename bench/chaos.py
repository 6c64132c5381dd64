"""Chaos for a bounded time against `elasticflow up` (issue 24): a seeded
random mix of submissions and faults, and the invariants checked every
minute and at the end.

Submissions (every 2-6 s): deadline runs the cluster can meet, best-effort
runs, infeasible ones (rejected at once), and deadline runs cancelled 1-15 s
after they are created. Faults (every 15-35 s; `--fault-every`; every kind
once, in a seeded order, before any twice): SIGKILL of
the worker, of the Prefect server, of one rank of a training run; SIGINT to
`up` and a fresh `up`; the newest checkpoint of a training run corrupted;
with `--ray` (`up --ray local:2x2`), SIGKILL of a non-head node's raylet, and
the node added back 20 s later.

Invariants (`scheduler_service.stack.audit`): every run decided exactly once;
no GPU held by two runs or by an ended run (both checked every minute, while
faults fly); at the end, once every run is final: the store (and so `elasticflow
status`) and Prefect agree on every run, none lost, no process of an ended
run alive; a run still live ten minutes after the last fault is a violation
of its own (`never_ended`: the store and Prefect can agree that it waits for
ever). After the stack stops, no process it started is left.

And what a user counts (issue 43): every run that ended failed or crashed
(or stopped short with no final state) is a violation (`failed`) unless it
was cancelled, infeasible, or hit by a fault it could not survive (more rank
kills than its restarts); every admitted deadline run that missed is one
(`missed`) unless a fault cost it the time and the service said so, giving
up its guarantee (GuaranteeLost) before it missed. A stop of `up`, a killed
worker or server, one killed rank, a corrupted checkpoint: a run survives
each, and goes on from its last checkpoint.

The last line is JSON: `runs`, `submitted` and `faults` by kind,
`violations`, `problems` by kind, `outcomes` (each run's outcome, by the
kind of submission), `excused` (runs whose failure or miss a fault
excused, by why), `excused_misses`, `minutes`, `seed`.

Run: .venv/bin/python bench/chaos.py [--minutes 10] [--seed 0] [--runs 0] [--faults 0] [--fault-every 25]
     [--ray] [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MLP_CURVE = {1: 20.0, 2: 36.0}  # seeded: admission plans with it; the real CPU rate is several times higher
SETTINGS = {"ELASTICFLOW_CLUSTER": str(ROOT / "infra" / "local-cpu2.csv"), "ELASTICFLOW_INTERVAL_S": "2",
            "ELASTICFLOW_RESTART_S": "0.5", "PREFECT_LOGGING_LEVEL": "INFO"}
# The launch reserve is left to learn, as a user's service does: with it set to 0 a run decided
# late (after a stop of `up`) kept no time for its start and, on a loaded machine, missed.
HARD = {"double_booked", "held_by_ended", "decisions"}  # must hold at every moment, faults or not
START_S = 600  # for `up` to start: on two cores shared by several stacks its server alone took over 4 minutes
MAX_RESTARTS = 3  # the train flow's default: a run whose ranks were killed more often may fail


def say(*parts: Any) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


class Chaos:
    """One chaos session: the stack it runs, what it submitted, what it broke."""

    def __init__(self, base: Path, port: int, seed: int, ray: bool) -> None:
        self.home, self.port, self.ray = base / "home", port, ray
        self.rng = random.Random(seed)
        self.log = base / "up.log"
        self.runs: dict[str, str] = {}  # flow run id -> kind of submission
        self.submitted: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.hit: dict[str, Counter[str]] = {}  # run -> faults it lived through, each how often
        self.deck: list[str] = []  # the fault kinds still to draw this round
        self.problems: Counter[str] = Counter()
        self.seen: list[str] = []  # the violations, for the report
        self.starts = 0
        self.up: subprocess.Popen[bytes] | None = None
        self.env = {**os.environ, **SETTINGS, "ELASTICFLOW_HOME": str(self.home),
                    "PREFECT_API_URL": self.api_url, "PREFECT_HOME": str(self.home / "prefect")}

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    # -- the stack ------------------------------------------------------------
    def start(self) -> None:
        from scheduler_service.stack.rank_account import OPT_OUT, RankAccountError, resolve

        try:  # the ranks' default unprivileged account where this machine lets it run them, else the opt-out
            resolve(None, self.home)
            rank_user: list[str] = []
        except RankAccountError:
            rank_user = ["--rank-user", OPT_OUT]
        argv = [sys.executable, "-c", "from scheduler_service.cli import main; main()", "up",
                "--home", str(self.home), "--port", str(self.port)] + (["--ray", "local:2x2"] if self.ray else []) \
            + rank_user
        self.up = subprocess.Popen(argv, env=self.env, cwd=ROOT, stdout=open(self.log, "ab"),
                                   stderr=subprocess.STDOUT)
        self.starts += 1
        give_up = time.time() + START_S
        while self.log.read_text(errors="replace").count("ElasticFlow worker started") < self.starts:
            if self.up.poll() is not None or time.time() > give_up:
                raise RuntimeError(f"`up` did not start: {self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.5)
        if self.starts == 1:
            from scheduler_service.store import save_curve

            save_curve("mlp", 32, MLP_CURVE)

    def stop(self) -> None:
        if self.up is not None and self.up.poll() is None:
            self.up.send_signal(signal.SIGINT)
            self.up.wait(timeout=180)

    def _group(self, what: str) -> Any:
        from scheduler_service.stack.groups import groups_of

        return next((g for g in groups_of(self.home) if g.what == what), None)

    def _training(self) -> list[str]:
        from scheduler_service.readmodel import report
        from scheduler_service.contracts import RunPhase

        # a run launching or moving shows as rescaling until it acknowledges its GPUs: it trains too
        return [v.flow_run_id for v in report(self.home).runs if v.phase in (RunPhase.RUNNING, RunPhase.RESCALING)]

    def _live(self) -> list[str]:
        from scheduler_service.readmodel import report
        from scheduler_service.contracts import RunPhase

        return [v.flow_run_id for v in report(self.home).runs
                if v.phase in (RunPhase.ADMITTED, RunPhase.RUNNING, RunPhase.RESCALING)]

    # -- submissions ----------------------------------------------------------
    def submit(self) -> None:
        kind = self.rng.choices(["deadline", "best_effort", "infeasible", "cancelled"], [5, 2, 2, 1])[0]
        window = self.rng.uniform(60, 180)
        planned = {"deadline": 0.15, "cancelled": 0.2, "infeasible": 3.0}.get(kind, 0.0)
        parameters: dict[str, Any] = {"hyperparameters": {"global_batch_size": 32}, "device": "cpu",
                                      "checkpoint_interval": 200}
        if kind == "best_effort":
            parameters["iterations"] = self.rng.randint(400, 2000)
        else:
            parameters["iterations"] = int(MLP_CURVE[1] * window * planned * self.rng.uniform(0.5, 1.0)) + 50
            parameters["deadline"] = (datetime.now(timezone.utc) + timedelta(seconds=window)).isoformat()
        run_id = self._create(parameters)
        if run_id is None:
            return
        self.runs[run_id] = kind
        self.submitted[kind] += 1
        if kind == "cancelled":
            self.later.append((time.time() + self.rng.uniform(1, 15), lambda r=run_id: self._cancel(r)))

    def _create(self, parameters: dict[str, Any]) -> str | None:
        """A run of train/mlp; None if the server is down for longer than a retry."""
        from prefect.deployments import run_deployment

        for _ in range(20):
            try:
                return str(run_deployment("train/mlp", parameters=parameters, timeout=0).id)  # type: ignore[union-attr]
            except Exception:  # the server is being killed or restarted: try again
                time.sleep(2.0)
        self.submitted["not_created"] += 1
        return None

    def _cancel(self, run_id: str) -> None:
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelling

        for _ in range(10):
            try:
                with get_client(sync_client=True) as client:
                    run = client.read_flow_run(run_id)  # type: ignore[arg-type]
                    if run.state is None or run.state.is_final():
                        return
                    client.set_flow_run_state(run_id, Cancelling())  # type: ignore[arg-type]
                    return
            except Exception:
                time.sleep(2.0)

    # -- faults ---------------------------------------------------------------
    def fault(self) -> bool:
        """One fault, the next of the deck; False if it found nothing to hit
        (no rank live, no checkpoint yet): that kind waits for the next round."""
        kind = self._draw()
        live = self._live()
        done = getattr(self, f"_{kind}")()
        if not done:
            return False
        self.faults[kind] += 1
        for run_id in [done] if isinstance(done, str) else live:
            self.hit.setdefault(str(run_id), Counter())[kind] += 1
        say(f"fault {kind}" + (f" ({done})" if isinstance(done, str) else ""))
        return True

    def _draw(self) -> str:
        """Every kind once, in a seeded order, before any kind twice: a
        10-minute run drawn at random once drew no server kill, and proved
        nothing about one."""
        if not self.deck:
            kinds = ["kill_worker", "kill_server", "kill_rank", "stop_up", "corrupt_checkpoint"]
            if self.ray:
                kinds.append("kill_raylet")
            self.deck = self.rng.sample(kinds, k=len(kinds))
        return self.deck.pop()

    def _kill_worker(self) -> bool:
        group = self._group("worker")
        return bool(group and group.signal(signal.SIGKILL))

    def _kill_server(self) -> bool:
        group = self._group("server")
        return bool(group and group.signal(signal.SIGKILL))

    def _kill_rank(self) -> str | bool | None:
        """SIGKILL one rank: a process of a run's group other than its flow
        process; on Ray, one of the stack's rank actors (whose run is not known
        here: every live run counts as hit)."""
        if self.ray:
            actors = [pid for pid, cmdline, environ in self._processes() if cmdline[0].startswith("ray::RankActor")
                      and f"ELASTICFLOW_HOME={self.home}".encode() in environ]
            if actors:
                os.kill(self.rng.choice(actors), signal.SIGKILL)
            return bool(actors)
        training = self._training()  # read once: the store changes between two reads
        for run_id in self.rng.sample(training, k=len(training)):
            group = self._group(f"flow run {run_id}")
            ranks = [p for p in (group.members() if group else []) if p != group.pgid]
            if ranks:
                os.kill(self.rng.choice(ranks), signal.SIGKILL)
                return run_id
        return None

    def _stop_up(self) -> bool:
        self.stop()
        self.start()
        return True

    def _corrupt_checkpoint(self) -> str | None:
        for run_id in self._training():
            newest = sorted((self.home / "checkpoints" / run_id).glob("ckpt-*.pt"))
            if newest:
                with open(newest[-1], "r+b") as fh:
                    fh.seek(max(0, newest[-1].stat().st_size // 2))
                    fh.write(b"chaos" * 8)
                return run_id
        return None

    @staticmethod
    def _processes() -> list[tuple[int, list[str], list[bytes]]]:
        """(pid, argv, environment entries) of every process this user can read."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
                environ = (proc / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            found.append((int(proc.name), cmdline, environ))
        return found

    def _kill_raylet(self) -> bool:
        for pid, cmdline, environ in self._processes():
            if cmdline[0].endswith("/raylet") and "--node-name=ray-node-0" not in cmdline \
                    and f"ELASTICFLOW_HOME={self.home}".encode() in environ:
                os.kill(pid, signal.SIGKILL)
                cluster = self._group("local Ray cluster")
                self.later.append((time.time() + 20, lambda: cluster and cluster.signal_leader(signal.SIGHUP)))
                return True
        return False

    # -- checks ---------------------------------------------------------------
    def _prefect_runs(self) -> list[Any]:
        from prefect.client.orchestration import get_client

        from scheduler_service.stack.audit import read_flow_runs

        async def read() -> Any:
            async with get_client() as client:
                return await read_flow_runs(client, list(self.runs))

        return asyncio.run(read())

    def unsurvivable(self, run_id: str) -> str | None:
        """The fault a run could not be expected to survive, if one hit it."""
        kills = self.hit.get(run_id, Counter())["kill_rank"]
        return f"its ranks killed {kills} times, over its {MAX_RESTARTS} restarts" if kills > MAX_RESTARTS else None

    def guarantee_lost(self) -> set[str]:
        """Deadline runs the service gave up the guarantee of (GuaranteeLost:
        carried on best-effort), as the store has them."""
        from scheduler_service.readmodel import store_url
        from scheduler_service.store.db import get_engine
        from scheduler_service.worker.store import ServiceStore

        return {row.flow_run_id for row in ServiceStore(get_engine(store_url(self.home))).jobs()
                if row.deadline is not None and row.share is None}

    def excused(self) -> dict[str, str]:
        """Runs that may miss: a fault hit them and the service said it cost
        the guarantee, or a fault they could not survive."""
        lost = self.guarantee_lost()
        excused = {r: "guarantee lost after " + ",".join(sorted(f)) for r, f in self.hit.items() if r in lost}
        excused.update({r: why for r in self.hit if (why := self.unsurvivable(r))})
        return excused

    def check(self, final: bool) -> int:
        from scheduler_service.stack.audit import audit

        found = audit(self.home, self._prefect_runs(), excused=self.excused() if final else {},
                      settle_s=0.0 if final else 120.0).violations
        if final:
            found += self.failures()
        counted = [v for v in found if final or v.problem.value in HARD]
        for violation in counted:
            line = f"{violation.problem.value}: {violation.run}: {violation.detail}"
            if line not in self.seen:  # a violation found again a minute later is the same one
                self.problems[violation.problem.value] += 1
                self.seen.append(line)
                say(f"violation {line}")
        return len(counted)

    def failures(self) -> list[Any]:
        """Runs that ended failed (or stopped short) that nothing excuses."""
        from scheduler_service.readmodel import report
        from scheduler_service.contracts import Outcome
        from scheduler_service.stack.audit import Problem, Violation

        found = []
        for view in report(self.home).runs:
            kind = self.runs.get(view.flow_run_id)
            if view.outcome not in (Outcome.FAILED, Outcome.STOPPED) or kind in (None, "cancelled", "infeasible"):
                continue
            if self.unsurvivable(view.flow_run_id):
                continue
            faults = ",".join(sorted(self.hit.get(view.flow_run_id, ()))) or "no fault"
            found.append(Violation(problem=Problem.FAILED, run=view.flow_run_id,
                                   detail=f"{kind} run {view.outcome.value} ({view.detail}); faults: {faults}; "
                                          f"Prefect: {self._final_message(view.flow_run_id)}"))
        return found

    def _final_message(self, run_id: str) -> str:
        """The run's final state and its message (the exception that ended it):
        a failure seen once in three runs is found from this line, not rerun."""
        from uuid import UUID

        from prefect.client.orchestration import get_client

        try:
            with get_client(sync_client=True) as client:
                state = client.read_flow_run(UUID(run_id)).state
        except Exception as exc:  # noqa: BLE001  # the server restarting: say so, the line still counts
            return f"unread ({type(exc).__name__})"
        return f"{state.name}: {(state.message or '')[:400]!r}" if state is not None else "no state"

    def outcomes(self) -> dict[str, dict[str, int]]:
        """Each run's outcome, by the kind of submission: what a user counts."""
        from scheduler_service.readmodel import report
        from scheduler_service.contracts import RunPhase

        views = {v.flow_run_id: v for v in report(self.home).runs}
        tally: dict[str, Counter[str]] = {}
        for run_id, kind in self.runs.items():
            view = views.get(run_id)
            if view is None:
                outcome = "never_taken_in"  # cancelled before a worker saw it
            elif view.phase is RunPhase.REJECTED:
                outcome = "rejected"
            else:
                outcome = view.outcome.value if view.outcome is not None else view.phase.value
            tally.setdefault(kind, Counter())[outcome] += 1
        return {kind: dict(counts) for kind, counts in sorted(tally.items())}

    def settle(self, timeout_s: float) -> set[str]:
        """Until every run is final in Prefect and ended in the store (or
        `timeout_s`); a run cancelled before any worker took it in is ended
        in Prefect alone (the store never had it). The runs not ended then."""
        from scheduler_service.readmodel import report
        from scheduler_service.contracts import RunPhase

        give_up, all_ended_at, ended = time.time() + timeout_s, None, set()
        while time.time() < give_up:
            views = report(self.home).runs
            ended = {v.flow_run_id for v in views if v.phase in (RunPhase.FINISHED, RunPhase.REJECTED)}
            try:
                ended |= {r.id for r in self._prefect_runs() if r.state_type == "CANCELLED"} - \
                    {v.flow_run_id for v in views}
            except Exception:
                pass  # the server is restarting: asked again in 5 s
            if set(self.runs) <= ended:
                all_ended_at = all_ended_at or time.time()
                # a violation that outlasts a minute with every run ended is not one the stack is still fixing
                if not self.check_quietly() or time.time() - all_ended_at > 60:
                    return set()
            time.sleep(5.0)
        return set(self.runs) - ended

    def check_quietly(self) -> int:
        from scheduler_service.stack.audit import audit

        try:
            return len(audit(self.home, self._prefect_runs(), settle_s=0.0).violations)
        except Exception:
            return 1

    def excused_misses(self) -> int:
        from scheduler_service.readmodel import report
        from scheduler_service.contracts import Outcome

        excused = self.excused()
        return sum(1 for v in report(self.home).runs if v.outcome is Outcome.MISSED and v.flow_run_id in excused)

    # -- the session ----------------------------------------------------------
    def run(self, minutes: float, at_least: int = 0, fault_every_s: float = 25.0,
            faults_at_least: int = 0) -> dict[str, Any]:
        self.later: list[tuple[float, Any]] = []
        self.start()
        end, next_fault, next_check = time.time() + minutes * 60, time.time() + 0.8 * fault_every_s, time.time() + 60
        # a slow machine spends the minutes on starts: faults go on past them (5 min at most) to the floor
        while time.time() < end or (sum(self.faults.values()) < faults_at_least and time.time() < end + 300):
            now = time.time()
            for due, action in [d for d in self.later if d[0] <= now]:
                self.later.remove((due, action))
                action()
            if now >= next_fault:
                landed = self.fault()  # one that found nothing to hit is tried again soon
                next_fault = time.time() + (self.rng.uniform(0.6, 1.4) * fault_every_s if landed else 3.0)
            elif now >= next_check:
                try:
                    say(f"check: {self.check(final=False)} violations, {len(self.runs)} runs")
                    next_check = time.time() + 60
                except httpx.TransportError as exc:  # the server is down by a fault, back in seconds
                    say(f"check put off: the server does not answer ({exc})")
                    next_check = time.time() + 10
            else:
                self.submit()
            if self.up is not None and self.up.poll() is not None:  # `up` itself must never die of a fault
                self.problems["up_exited"] += 1
                self.seen.append(f"up exited with {self.up.returncode}")
                self.start()
            time.sleep(self.rng.uniform(2, 6))
        while len(self.runs) < at_least and self.submitted["not_created"] < 3:
            # a slow machine spends the time on restarts: the floor keeps the audit worth something
            self.submit()
            time.sleep(self.rng.uniform(2, 6))
        for due, action in sorted(self.later, key=lambda d: d[0]):  # the pending cancels and node returns
            time.sleep(max(0.0, due - time.time()))
            action()
        say("settling: no more submissions or faults")
        for run in sorted(self.settle(timeout_s=600)):  # the store and Prefect may agree that it waits for ever
            self.problems["never_ended"] += 1
            self.seen.append(f"never ended: {run}")
            say(f"violation never_ended: {run}: still live ten minutes after the last fault")
        self.check(final=True)
        self.stop()
        from scheduler_service.stack.groups import groups_of

        left = [g for g in groups_of(self.home)]
        for group in left:
            self.problems["left_after_stop"] += 1
            self.seen.append(f"left after stop: {group.what} {group.members()}")
        return {"runs": len(self.runs), "submitted": dict(self.submitted), "faults": dict(self.faults),
                "violations": len(self.seen), "problems": dict(self.problems), "outcomes": self.outcomes(),
                "excused": dict(Counter(self.excused().values())), "excused_misses": self.excused_misses(),
                "minutes": minutes, "ray": self.ray}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=0,
                        help="at least this many runs: submissions (no more faults) go on past the time until then")
    parser.add_argument("--faults", type=int, default=0,
                        help="at least this many faults: submissions and faults go on past the time (5 min at most)")
    parser.add_argument("--fault-every", type=float, default=25.0,
                        help="mean seconds between faults (each 0.6-1.4 times it, the first at 0.8 times it)")
    parser.add_argument("--ray", action="store_true", help="ranks on a 2 x 2 loopback Ray cluster")
    parser.add_argument("--keep", action="store_true", help="keep the home (store, logs) and print where; kept anyway when a violation was found")
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="elasticflow-chaos-"))
    with socket.socket() as probe:  # Prefect reads its settings at import: they are set before it is imported
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    from scheduler_service.stack.secret import api_auth_string  # standard library only: Prefect is not imported

    (base / "home").mkdir(mode=0o700)
    os.environ.update({"ELASTICFLOW_HOME": str(base / "home"), "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
                       "PREFECT_HOME": str(base / "home" / "prefect"), "PREFECT_SERVER_EPHEMERAL_ENABLED": "false",
                       # what each `up` of this home makes the API ask for
                       "PREFECT_API_AUTH_STRING": api_auth_string(base / "home")})
    chaos = Chaos(base, port, args.seed, args.ray)
    say(f"chaos for {args.minutes:g} min, seed {args.seed}{', on Ray' if args.ray else ''}; home {chaos.home}")
    try:
        figures = {**chaos.run(args.minutes, args.runs, args.fault_every, args.faults), "seed": args.seed}
    finally:
        chaos.stop()
        if args.keep or chaos.seen:  # a violation's evidence (logs, store) outlives the run that found it
            say(f"home kept: {chaos.home}")
        else:
            shutil.rmtree(base, ignore_errors=True)
    for line in chaos.seen:
        print("  " + line)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
