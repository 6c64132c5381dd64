"""The worker's settings: every `ELASTICFLOW_*` variable an operator sets,
read once at start-up into one typed model.

A bad value stops the worker at once with one line naming the variable and
what it accepts, instead of a bare `ValueError` in the middle of a poll.
`docs/service.md`'s table of variables is `settings_table()`'s output (a test
keeps the two equal).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from scheduler_service.loop import LoopSettings
from scheduler_service.markdown import markdown_table
from scheduler_service.policy.overhead import RestartOverhead

PREFIX = "ELASTICFLOW_"
LOOP = LoopSettings()  # the defaults of what the loop decides with have their one home there


class SettingsError(SystemExit):
    """A setting the worker cannot start with; the message is one line for the operator."""


def _setting(default: Any, meaning: str, shown: str | None = None, **constraints: Any) -> Any:
    """A field with its meaning and the default as the docs table shows it."""
    return Field(default=default, description=meaning,
                 json_schema_extra={"shown": shown if shown is not None else str(default)}, **constraints)


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", frozen=True)

    home: Path = _setting(Path.home() / ".elasticflow", "store, control channels, checkpoints", "`~/.elasticflow`")
    database_url: str | None = _setting(
        None, "the service's store (any SQLAlchemy URL, e.g. `postgresql+psycopg://...`)",
        "SQLite under `ELASTICFLOW_HOME`")
    policy: str = _setting(
        LOOP.policy, "scheduling policy, by its registered name: `elasticflow` is the paper's; the "
        "default also prices how committed a run's window is, and stays within 0.01 of it when the cluster is "
        "not overloaded (docs/scheduling.md)", f"`{LOOP.policy}`")
    interval_s: float = _setting(LOOP.interval_s, "slot length: the policy re-plans once per slot, and when runs "
                                 "arrive", f"{LOOP.interval_s:g}", gt=0)
    poll_s: float = _setting(LOOP.poll_s, "how often the worker looks for new runs and acts on plans (at most a slot)",
                             f"{LOOP.poll_s:g}", gt=0)
    at_risk_s: float = _setting(
        LOOP.at_risk_s, "a running run's deadline is at risk (cluster view, `elasticflow.deadline.at-risk` event) "
        "when its projected finish comes within this of it (or half the room its plan keeps, if less); at least a slot",
        f"{LOOP.at_risk_s:g}", ge=0)
    warm_start: bool = _setting(True, "0: start every flow process cold instead of forking it from the warm-start "
                                "server", "1")
    safety_margin: float = _setting(
        LOOP.safety_margin, "room kept in front of an admitted run's deadline, as a fraction of its window (at "
        "least a slot), for a machine slower than its profile", f"{LOOP.safety_margin:g}", ge=0, lt=0.5)
    restart_s: float = _setting(
        2.0, "a run's restart on a new GPU set (+0.5 s to stop); plans charge it with the hand-over before it "
        "(the GPUs' previous holder stops, 0.5 s, and a poll sees it)", "2", ge=0)
    in_place_s: float = _setting(
        1.0, "a resize that keeps some of a run's GPUs, made in place, in place of `restart_s`; the change under "
        "way is charged it, or the longest of the last ten seen if more", "1", ge=0)
    launch_s: float | None = _setting(
        LOOP.launch_s, "launch to first iteration of a new run; the part beyond a restart is kept in front of its "
        "deadline",
        "15, raised by starts seen", ge=0)
    publish_concurrency: int = _setting(
        16, "Prefect API requests in flight when a burst of decisions is published (more on PostgreSQL)", "16",
        ge=1, le=256)
    lease_s: float = _setting(
        30.0, "one worker per pool: a worker's lease on its pool, renewed every third of this, is taken over by "
        "another worker this long after its last renewal (at once if its process is gone from this host)", "30",
        ge=3)
    profile_iterations: int = _setting(8, "iterations measured per GPU count when a model is profiled on first use",
                                       "8", ge=3)
    profile_timeout_s: float = _setting(
        600.0, "longest a run waits in Profiling (GPUs to measure on, then the measurement)", "600", gt=0)
    allowed_roots: str = _setting(
        "", "folders (`:`-separated) besides `ELASTICFLOW_HOME` where runs may keep checkpoints and read data",
        "none")
    storage_schemes: str = _setting(
        "", "remote checkpoint stores runs may name, by fsspec scheme (`,`-separated, e.g. `s3,gs`)", "none")
    cluster: Path | None = _setting(None, "cluster file", "`infra/cluster.csv` or this machine")
    teams: Path | None = _setting(
        None, "teams file (YAML, `infra/teams.example.yaml`): a run's team is its work queue in the pool; each "
        "team's runs are admitted on its guaranteed share and unused shares are lent (docs/user-guide.md)",
        "none: one queue for everyone")
    cpu_slots: int | None = _setting(None, "worker slots on a CPU-only machine", "CPU count", ge=1)
    ray_address: str | None = _setting(
        None, "a Ray cluster (`host:port` of its head): its live nodes are the cluster and each run's ranks run "
        "on them (docs/ray.md)", "none: this machine")
    ray_spares_per_node: int | None = _setting(
        None, "on Ray, warm rank actors a run keeps per node (~360 MiB each) for its next resize; one missing is "
        "started cold", "one per GPU of the run there", ge=0)
    model_modules: str = _setting(
        "", "module prefixes (`,`-separated) every import path of a user's task (model factory, dataset, loss, "
        "collate, evaluate: `pkg.module:name`) may come from; checked at take-in without importing into the worker "
        "(a short-lived process imports them), and in the run's processes",
        "none: built-in models and `flows.examples` only")
    rank_user: str | None = _setting(
        None, "the unprivileged user training ranks run as (the stack must run as root), each run with a group of "
        "its own: ranks reach their run's checkpoint and control folders, not the store, the logs or other runs' "
        "(docs/operating.md)", "none: the stack's user")
    rank_gids: str = _setting(
        "", "gids (`FIRST-LAST`) free on this machine for runs' own groups", "`3000000-3999999`")

    @field_validator("rank_user")
    @classmethod
    def _usable_rank_user(cls, name: str | None) -> str | None:
        if not name or not name.strip():
            return None
        problem = rank_user_problem(name.strip())
        if problem is not None:
            raise ValueError("an unprivileged user the stack can switch to and who can read Python and the project "
                             f"({problem})")
        return name.strip()

    @field_validator("rank_gids")
    @classmethod
    def _gid_range(cls, text: str) -> str:
        from flows.training.launch.identity import gid_range

        try:
            gid_range(text)
        except ValueError as exc:
            raise ValueError(str(exc).split(": expected ", 1)[1]) from None
        return text

    @field_validator("teams")
    @classmethod
    def _readable_teams(cls, path: Path | None) -> Path | None:
        from scheduler_service.inputfiles import InputError, load_teams

        if path is None or not str(path).strip():
            return None
        try:
            load_teams(path)
        except InputError as exc:
            raise ValueError(str(exc)) from None
        return path

    def team_list(self) -> tuple[Any, ...]:
        """The teams of the teams file (() without one)."""
        from scheduler_service.inputfiles import load_teams

        return load_teams(self.teams) if self.teams is not None else ()

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        from scheduler_service.policy import POLICIES

        if name not in POLICIES:
            raise ValueError(f"one of {', '.join(sorted(POLICIES))}")
        return name

    def loop(self) -> LoopSettings:
        """What the control loop decides with. A start is charged `restart_s`
        plus half a second to stop, the same at every width (one machine)."""
        return LoopSettings(policy=self.policy, interval_s=self.interval_s,
                            overhead=RestartOverhead(stop_s=0.5, restart_s=self.restart_s, per_level_s=0.0,
                                                     in_place_s=self.in_place_s),
                            poll_s=self.effective_poll_s, launch_s=self.launch_s,
                            safety_margin=self.safety_margin, at_risk_s=self.at_risk_s, teams=self.team_list())

    def warnings(self, restart_s: float) -> list[str]:
        """What the operator should know at start: settings that work, but not well."""
        found = []
        if self.interval_s < 2 * restart_s:
            found.append(f"slot {self.interval_s:.1f} s is under two restarts ({2 * restart_s:.1f} s): no spare GPUs "
                         "will be granted early; raise ELASTICFLOW_INTERVAL_S or lower ELASTICFLOW_RESTART_S")
        if os.geteuid() == 0 and self.rank_user is None and self.ray_address is None:
            found.append("the stack runs as root and so would users' training code: set ELASTICFLOW_RANK_USER to "
                         "an unprivileged user (docs/operating.md, 'What a run can see and touch')")
        return found

    @property
    def effective_poll_s(self) -> float:
        return min(self.interval_s, self.poll_s)

    @property
    def roots(self) -> list[Path]:
        """Where runs may keep checkpoints and read data."""
        return [self.home, *(Path(r).expanduser() for r in self.allowed_roots.split(":") if r.strip())]

    @property
    def schemes(self) -> frozenset[str]:
        return frozenset(s.strip() for s in self.storage_schemes.split(",") if s.strip())


def rank_user_problem(name: str) -> str | None:
    """Why ranks cannot run as `name` here (None: they can): no such user,
    root, a stack not root, or Python or the project out of that user's reach."""
    from flows.training.launch.identity import check_user, unreachable

    try:
        check_user(name)
    except ValueError as exc:
        return str(exc).split(": ", 1)[1]
    for needed in (Path(sys.base_prefix), Path(sys.prefix), Path(__file__).resolve().parents[2]):
        blocker = unreachable(needed / "lib")
        if blocker is not None:
            return f"{blocker} keeps that user from {needed}: install Python and the project where it can read them"
    return None


def _accepts(error: dict[str, Any]) -> str:
    """What a failed field accepts, in words an operator reads."""
    context = error.get("ctx") or {}
    kind = error["type"]
    if kind == "greater_than":
        return f"a number greater than {context['gt']}"
    if kind == "greater_than_equal":
        return f"a number of at least {context['ge']}"
    if kind in ("float_parsing", "float_type"):
        return "a number"
    if kind in ("int_parsing", "int_type", "int_from_float"):
        return "a whole number"
    if kind in ("bool_parsing", "bool_type"):
        return "1 or 0 (true or false)"
    return str(error["msg"]).removeprefix("Value error, ")


def load_settings(**overrides: Any) -> WorkerSettings:
    """The settings from the environment (and `overrides`, for tests); a bad
    value raises SettingsError with one line per variable at fault."""
    try:
        return WorkerSettings(**overrides)
    except ValidationError as exc:
        lines = []
        for error in exc.errors(include_url=False):
            name = PREFIX + str(error["loc"][0]).upper() if error["loc"] else PREFIX + "*"
            lines.append(f"{name}={error.get('input')!s}: expected {_accepts(error)}")
        raise SettingsError("bad setting: " + "; ".join(lines)) from None


def settings_table() -> str:
    """The operator's table of variables, as docs/service.md shows it."""
    rows = []
    for name, field in WorkerSettings.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        rows.append([f"`{PREFIX}{name.upper()}`", str(extra.get("shown")), str(field.description)])
    return markdown_table(["variable", "default", "meaning"], rows)
