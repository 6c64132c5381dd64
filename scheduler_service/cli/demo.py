"""`elasticflow demo`: the platform end to end on this machine.

Starts the local stack (Prefect server on SQLite, the `gpus` pool, the
ElasticFlow worker on this machine's GPUs or CPU slots), then submits training
runs the way a user would, with a model, iterations and a deadline:

1. `first-use`: a model the service has never seen: it profiles the model's
   throughput (state `Profiling`), admits the run and trains it.
2. `long`: a long run with a loose deadline; alone, it gets every slot the
   profile says pays off.
3. `infeasible`: ten hours of work due in ten minutes: `Rejected` at once,
   with the earliest deadline that could be met.
4. `urgent`: a run that must start now to make its deadline: `long` is
   shrunk (checkpoint, `Rescaling`, same flow run) to make room.

Run sizes come from the profile measured in step 1, so the story holds on a
laptop's CPU as on a GPU node. Every state change, decision and GPU change is
printed as it happens; at the end, each run's outcome against its deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from scheduler_service.text import printable

# A model whose throughput grows with a second slot even on CPU (compute
# dominates the all-reduce at this batch), so the demo can show a resize.
MODEL = "mlp"
HYPERPARAMETERS: dict[str, Any] = {"global_batch_size": 512}
MODEL_KWARGS: dict[str, Any] = {"hidden": 512, "depth": 3}
SETTINGS = {"ELASTICFLOW_INTERVAL_S": "5", "ELASTICFLOW_RESTART_S": "2"}


@dataclass
class DemoRun:
    role: str
    flow_run_id: str
    deadline: datetime | None
    seen_states: list[str] = field(default_factory=list)
    seen_allocations: int = 0
    submitted: datetime = field(default_factory=lambda: datetime.now(timezone.utc))


@dataclass(frozen=True)
class RunEnd:
    """One row of the demo's outcome table: how a run was decided and ended."""

    role: str
    admitted: bool
    reason: str
    share: int | None
    gpu_sets: list[str]
    state: str  # its final state's name, or "not finished"
    end: datetime | None
    deadline: datetime | None
    submitted: datetime

    @property
    def failed(self) -> bool:
        return self.admitted and self.state != "Completed"

    @property
    def late(self) -> bool:
        return (self.admitted and self.state == "Completed" and self.deadline is not None and self.end is not None
                and self.end > self.deadline)

    @property
    def spare(self) -> float | None:
        """The deadline minus the finish, over the run's window (negative: late)."""
        if not self.admitted or self.state != "Completed" or self.deadline is None or self.end is None:
            return None
        return (self.deadline - self.end).total_seconds() / (self.deadline - self.submitted).total_seconds()

    def cells(self) -> tuple[str, ...]:
        """A rejected run never ran: no finish and nothing to spare ("margin -60%" once read as jargon)."""
        if not self.admitted:
            met = "-"
        elif self.state != "Completed":
            met = f"no ({self.state})"
        elif self.late:
            met = f"no, late by {(self.end - self.deadline).total_seconds():.0f} s"  # type: ignore[operator]
        else:
            met = "yes"
        spare = self.spare
        return (f"demo-{self.role}", "admitted" if self.admitted else f"rejected ({self.reason})",
                "" if self.share is None else str(self.share), " -> ".join(self.gpu_sets) or "-",
                "-" if not self.admitted else f"{self.end:%H:%M:%S}" if self.end else self.state,
                f"{self.deadline:%H:%M:%S}" if self.deadline else "-", met,
                "-" if spare is None else f"{spare:.0%} of its window" if spare >= 0 else "none")


def outcome_table(ends: list[RunEnd]) -> Table:
    table = Table(title="outcomes")
    for column in ("run", "decision", "MSS", "GPU sets", "finished", "deadline", "met", "to spare"):
        table.add_column(column, overflow="fold")  # piped, a cell cut to "19:46:…" said nothing
    for end in ends:
        table.add_row(*end.cells())
    return table


@dataclass
class Demo:
    console: Console
    home: Path
    started: float = field(default_factory=time.time)
    runs: list[DemoRun] = field(default_factory=list)

    def say(self, text: str) -> None:
        # Piped or logged, a line stays one line (rich would cut it at 80 columns).
        self.console.print(f"[dim]{time.time() - self.started:6.1f}s[/dim]  {text}", highlight=False,
                           soft_wrap=not self.console.is_terminal)

    # -- submitting ------------------------------------------------------------
    def submit(self, role: str, iterations: int, deadline: datetime | None) -> DemoRun:
        from prefect.deployments import run_deployment

        parameters: dict[str, Any] = {
            "iterations": iterations, "hyperparameters": HYPERPARAMETERS, "model_kwargs": MODEL_KWARGS,
            "checkpoint_interval": max(10, iterations // 10),
        }
        if deadline is not None:
            parameters["deadline"] = deadline.isoformat()
        flow_run = run_deployment(f"train/{MODEL}", parameters=parameters, timeout=0, flow_run_name=f"demo-{role}")
        run = DemoRun(role, str(flow_run.id), deadline)  # type: ignore[union-attr]
        self.runs.append(run)
        due = f"due {deadline:%H:%M:%S} UTC" if deadline else "best-effort"
        self.say(f"[bold]submitted demo-{role}[/bold]: {MODEL}, {iterations} iterations, {due}")
        return run

    # -- watching --------------------------------------------------------------
    def watch(self, until: Any, timeout_s: float) -> None:
        """Print every new state and GPU change of the demo runs until `until()`."""
        end = time.time() + timeout_s
        while time.time() < end:
            self._poll()
            if until():
                return
            time.sleep(1.0)
        raise TimeoutError(f"the demo waited {timeout_s:.0f} s; see {self.home / 'logs'}")

    def _poll(self) -> None:
        from elasticflow_block.prefect_client import sync_client

        from scheduler_service.worker.store import ServiceStore

        store = ServiceStore()
        with sync_client() as client:
            for run in self.runs:
                states = sorted(client.read_flow_run_states(run.flow_run_id),  # type: ignore[arg-type]
                                key=lambda s: s.timestamp)
                for state in states[len(run.seen_states):]:
                    run.seen_states.append(state.name or state.type.value)
                    if state.name in ("Scheduled", "Pending"):
                        continue
                    message = f": {printable(state.message)}" if state.message else ""
                    self.say(f"demo-{run.role:<10} [bold]{state.name}[/bold]{message}")
                allocations = store.allocations(run.flow_run_id)
                for record in allocations[run.seen_allocations:]:
                    gpus = record.gpus or "none"
                    self.say(f"demo-{run.role:<10} GPUs: {record.action} -> {gpus}")
                run.seen_allocations = len(allocations)

    def final(self, run: DemoRun) -> Any:
        from elasticflow_block.prefect_client import sync_client

        with sync_client() as client:
            flow_run = client.read_flow_run(run.flow_run_id)  # type: ignore[arg-type]
        return flow_run if flow_run.state is not None and flow_run.state.is_final() else None

    def iteration(self, run: DemoRun) -> int:
        import json

        path = self.home / "control" / run.flow_run_id / "status.json"
        try:
            return int(json.loads(path.read_text()).get("iteration", 0))
        except (OSError, ValueError):
            return 0

    # -- the outcome -----------------------------------------------------------
    def summary(self) -> bool:
        """Print each run's outcome; False if an admitted run failed or did not
        finish (a deadline missed is reported, with why it can happen here)."""
        from scheduler_service.worker.store import ServiceStore

        store = ServiceStore()
        ends = []
        for run in self.runs:
            flow_run = self.final(run)
            decisions = store.decisions(run.flow_run_id)
            decision = decisions[-1] if decisions else None
            ends.append(RunEnd(
                role=run.role, admitted=bool(decision and decision.admitted),
                reason=decision.reason if decision and decision.reason else "",
                share=decision.share if decision is not None else None,
                gpu_sets=[r.gpus for r in store.allocations(run.flow_run_id) if r.action in ("launch", "rescale")],
                state=flow_run.state.name if flow_run is not None else "not finished",
                end=flow_run.end_time if flow_run is not None else None,
                deadline=run.deadline, submitted=run.submitted))
        table = outcome_table(ends)
        ok = not any(end.failed for end in ends)
        late = any(end.late for end in ends)
        margins = [end.spare for end in ends if end.spare is not None]
        # Piped, rich would draw it 80 columns wide and cut every cell; a log has no width.
        self.console.print(table, width=None if self.console.is_terminal else 160)
        log = self.home / "logs" / "worker.log"
        alerts = log.read_text(errors="replace").count("deadline at-risk:") if log.exists() else 0
        self.say(f"least time to spare of an admitted run: {min(margins):.1%} of its window; at-risk alerts: {alerts}"
                 if margins else f"no admitted run finished; at-risk alerts: {alerts}")
        if late:
            self.say(
                "an admitted run missed its deadline. The guarantee rests on the profile: on a machine "
                "without GPUs the worker slots share the CPU cores with each other and with the Prefect server, "
                "so a run trains slower beside others than its profile, measured alone, said. The cluster "
                f"artifact and {self.home / 'logs' / 'worker.log'} show by how much."
            )
        return ok


def run_demo(home: Path, port: int, console: Console) -> bool:
    """The demo; False if an admitted run failed or did not finish."""
    from scheduler_service.cli.hints import command
    from scheduler_service.stack.local import local_stack
    from scheduler_service.store import get_curve

    from scheduler_service.stack.rank_account import RankAccountError, resolve

    now = lambda: datetime.now(timezone.utc)  # noqa: E731
    demo = Demo(console, home)
    try:  # as `up`: an unprivileged account for the ranks by default
        account = resolve(None, home)
        rank_user, said = account.user, account.said
    except RankAccountError as exc:  # a throwaway demo still runs; `up` would refuse
        rank_user, said = None, f"ranks run as this stack's user: {exc}"
    demo.say(said)
    with local_stack(home, port, env=SETTINGS, models=(MODEL,), schedules=False, rank_user=rank_user) as stack:
        demo.say(f"stack up: Prefect UI {stack.ui_url}, work pool 'gpus', worker log {stack.logs / 'worker.log'}")
        first = demo.submit("first-use", 40, now() + timedelta(minutes=10))
        demo.watch(lambda: demo.final(first) is not None, 600)
        for line in stack.supervise():  # a crash is said, and the process restarted
            demo.say(line)
        curve = get_curve(MODEL, HYPERPARAMETERS["global_batch_size"]) or {}
        if not curve:
            raise RuntimeError("the service stored no throughput profile; see the worker log")
        best = max(curve.values())
        rates = ", ".join(f"{g}: {r:.1f} it/s" for g, r in sorted(curve.items()))
        demo.say(f"profile of {MODEL} @ batch {HYPERPARAMETERS['global_batch_size']} on this machine: {rates}")
        if max(curve, key=lambda g: curve[g]) == 1:
            demo.say("a second slot does not pay off here, so `long` keeps one slot and no resize is needed")

        long = demo.submit("long", int(best * 90), now() + timedelta(minutes=15))
        demo.watch(lambda: demo.iteration(long) > 0 or demo.final(long) is not None, 300)
        demo.submit("infeasible", int(best * 36000), now() + timedelta(minutes=10))
        demo.submit("urgent", int(curve.get(1, best) * 30), now() + timedelta(seconds=120))
        demo.watch(lambda: all(demo.final(r) is not None for r in demo.runs), 900)
        ok = demo.summary()
        demo.say("stopping the stack; every run's phase, GPUs and outcome stay readable with: "
                 + command("elasticflow", "status", "--home", str(home)))
    return ok
