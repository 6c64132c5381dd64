"""`elasticflow up` (the local stack in the foreground) and `elasticflow demo`
(the stack driven end to end). `elasticflow status` lives in status.py."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any, Optional

import typer

from scheduler_service.cli import app, hints

console = hints.console()
errors = hints.console(stderr=True)


DATABASE_ENV = "ELASTICFLOW_PREFECT_DATABASE_URL"


def database_url_from(given: str | None, file: Path | None) -> str | None:
    """The Prefect server's database URL, from where a password is not shown
    to other users: the environment or a private file. A password in the
    command line itself is refused, naming the two ways that keep it out of
    `ps`. ValueError names the option at fault."""
    import os
    import stat

    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    if given and file:
        raise ValueError("--database and --database-file: give one of them")
    if file is not None:
        try:
            mode = file.stat().st_mode
            url = file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"--database-file {file}: cannot read it ({exc.strerror})") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"--database-file {file}: others can read it (mode {stat.S_IMODE(mode):o}); "
                             f"chmod 600 {file}")
    else:
        url = given or os.environ.get(DATABASE_ENV, "")
    if not url:
        return None
    try:
        parsed = make_url(url)
    except ArgumentError:
        source = "--database-file" if file else "--database" if given else DATABASE_ENV
        raise ValueError(f"{source}: not a database URL (e.g. postgresql://user@host:5432/prefect)") from None
    if given:
        refuse_password("--database", parsed, f"{DATABASE_ENV} or a file only you can read (--database-file)")
    return url


def refuse_password(option: str, url: Any, instead: str) -> None:
    """A password given on a command line is shown to every user of the machine by `ps`."""
    if url.password:
        raise ValueError(f"{option}: the password would be visible to every user of this machine in `ps`; "
                         f"put the URL in {instead}")


def shown_url(url: str) -> str:
    """The URL as logs and messages may show it: the password hidden."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def _home(home: Optional[Path]) -> Path:
    from elasticflow_block.home import elasticflow_home

    chosen = (home or elasticflow_home()).expanduser().resolve()
    chosen.mkdir(parents=True, exist_ok=True)
    return chosen


@app.command()
def up(
    port: int = typer.Option(4200, "--port", help="port of the local Prefect server (bound to 127.0.0.1)"),
    home: Optional[Path] = typer.Option(None, "--home", help="state folder (default: $ELASTICFLOW_HOME or ~/.elasticflow)"),
    database: Optional[str] = typer.Option(
        None, "--database", help="the Prefect server's database, e.g. postgresql://user@host:5432/prefect, with "
        "no password: a command line is visible to every user in `ps` (default: SQLite under the home; given to "
        "the server alone)"),
    database_file: Optional[Path] = typer.Option(
        None, "--database-file", help="a file (mode 0600) holding the database URL, password and all; or set "
        f"{DATABASE_ENV}"),
    ray: Optional[str] = typer.Option(
        None, "--ray", help="run the ranks on a Ray cluster: its head's ADDRESS (host:port), or local:NxG to "
        "start N nodes of G worker slots on this machine, on loopback, stopped with the stack (docs/ray.md)"),
    rank_user: Optional[str] = typer.Option(
        None, "--rank-user", help="the unprivileged account training ranks run as (default: $ELASTICFLOW_RANK_USER, "
        "else elasticflow-rank, created if missing when run as root); `root` opts out: ranks run as root"),
) -> None:
    """Run the local stack in the foreground: Prefect server (SQLite, or
    PostgreSQL with --database), the `gpus` work pool, deployments
    train/<model> and pipeline/daily, the ElasticFlow worker (scheduling this
    machine, or a Ray cluster's nodes with --ray). A server or worker that
    exits is restarted; training runs go on meanwhile. Ctrl-C stops it."""
    from scheduler_service.stack.local import local_stack

    home = _home(home)

    stopping = False

    def on_term(signum: int, frame: object) -> None:
        # Once: a second signal (a double Ctrl-C, a wrapper forwarding its own
        # SIGTERM) must not cut the orderly stop short and leave processes behind.
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    try:
        database = database_url_from(database, database_file)
    except ValueError as exc:
        errors.print(f"error: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    where = f"PostgreSQL {shown_url(database)}" if database else "SQLite"
    if ray:
        from scheduler_service.stack.ray_local import LOCAL_PREFIX, check_reachable, parse_local

        try:
            if ray.startswith(LOCAL_PREFIX):
                parse_local(ray)
            else:
                check_reachable(ray)
        except ValueError as exc:
            errors.print(f"error: {exc}")
            raise typer.Exit(2) from None
        console.print(f"ranks on the Ray cluster {ray}")
    from scheduler_service.stack.rank_account import RankAccount, RankAccountError, resolve

    try:  # on Ray, rank actors run as the Ray nodes' user: that is the cluster's to set (docs/ray.md)
        account = RankAccount(None, "ranks run as the Ray nodes' user") if ray else resolve(rank_user, home)
    except RankAccountError as exc:
        errors.print(f"error: {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if account.user is None:  # opted out (`root`), or not root: the worker's ranks stay the stack's user
        import os

        from flows.training.launch.identity import RANK_USER_ENV

        os.environ.pop(RANK_USER_ENV, None)
    console.print(f"starting Prefect server on 127.0.0.1:{port} ({where}; home {home})")
    console.print(account.said, highlight=False)
    try:
        with local_stack(home, port, database=database, ray=ray, rank_user=account.user) as stack:
            if ray:
                import os

                from flows.training.ray_nodes import RAY_ADDRESS_ENV

                console.print(f"Ray cluster at {os.environ.get(RAY_ADDRESS_ENV, ray)}")
            from scheduler_service.stack.secret import load_hint

            console.print(
                f"work pool 'gpus' (type elasticflow); deployments: {', '.join(stack.deployments)}\n"
                f"ElasticFlow worker started (log {stack.logs / 'worker.log'}). UI: {stack.ui_url}\n"
                f"The API asks for the stack's secret: the client settings are in {stack.client_env} (0600; "
                "the UI asks for its PREFECT_API_AUTH_STRING). Load them in your shell, then submit:\n"
                f"  {load_hint(home)}\n"
                "  " + hints.prefect("deployment", "run", "train/mlp", "--param", "iterations=200", "--param",
                                     "deadline=+10m") + "\n"
                "  " + hints.prefect("deployment", "run", "pipeline/daily", "--param", "sla=+10m") + "\n"
                + hints.daily_schedule() + "\n"
                "Ctrl-C stops everything."
            )
            while True:
                for line in stack.supervise():
                    errors.print(line)
                time.sleep(1.0)
    except KeyboardInterrupt:
        console.print("stopped")
    except RuntimeError as exc:
        errors.print(f"error: {exc}")
        raise typer.Exit(1) from None


@app.command()
def demo(
    port: int = typer.Option(0, "--port", help="port of the local Prefect server (default: a free one)"),
    home: Optional[Path] = typer.Option(None, "--home", help="state folder (default: a new temporary one)"),
) -> None:
    """The real thing on this machine: start the stack, submit training runs with
    deadlines (one infeasible, one that forces a resize), show every decision and
    GPU change, each run's outcome, then stop. Exits 1 if an admitted run failed."""
    import tempfile

    from scheduler_service.cli.demo import run_demo
    from scheduler_service.stack.local import free_port

    chosen = _home(home or Path(tempfile.mkdtemp(prefix="elasticflow-demo-")))
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        ok = run_demo(chosen, port or free_port(), console)
    except KeyboardInterrupt:
        errors.print("interrupted; the stack is stopped")
        raise typer.Exit(130) from None
    except (RuntimeError, TimeoutError) as exc:
        errors.print(f"error: {exc}")
        raise typer.Exit(1) from None
    console.print(f"state, logs and checkpoints: {chosen}")
    if not ok:
        raise typer.Exit(1)


@app.command()
def audit(
    home: Optional[Path] = typer.Option(None, "--home", help="state folder (default: $ELASTICFLOW_HOME or ~/.elasticflow)"),
    settle_s: float = typer.Option(30.0, "--settle", help="seconds a run's last change is given to reach the store"),
) -> None:
    """Whether the service's store (what `status` shows), Prefect and the
    processes tell the same story about every run of the `gpus` pool: one
    line per disagreement, lost run, GPU held twice or by an ended run, and
    process outliving its run. Exits 1 if there is any (reads Prefect's API)."""
    import asyncio
    import os

    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

    from scheduler_service.stack.audit import audit as check
    from scheduler_service.stack.audit import decision_counts, read_flow_runs
    from scheduler_service.stack.secret import CLIENT_AUTH_ENV, load_client_env

    chosen = _home(home)
    load_client_env(chosen)  # the stack's user needs no export: the home has the client settings
    updates = {setting: os.environ[name] for setting, name in ((PREFECT_API_URL, "PREFECT_API_URL"),
                                                               (PREFECT_API_AUTH_STRING, CLIENT_AUTH_ENV))
               if os.environ.get(name)}
    if PREFECT_API_URL not in updates and not PREFECT_API_URL.value():  # never a temporary server of Prefect's own
        errors.print("error: set PREFECT_API_URL to the stack's API (`up` prints it), e.g. http://127.0.0.1:4200/api")
        raise typer.Exit(2)

    async def read() -> list:
        async with get_client() as client:
            return await read_flow_runs(client)

    try:
        with temporary_settings(updates=updates):
            flow_runs = asyncio.run(read())
        found = check(chosen, flow_runs, decision_counts(chosen), settle_s=settle_s)
    except Exception as exc:  # no server, no store: say which, no traceback
        errors.print(f"error: cannot audit: {type(exc).__name__}: {exc}")
        raise typer.Exit(2) from None
    for line in found.lines():
        console.print(line, markup=False, highlight=False)
    console.print(f"{found.runs} runs, {len(found.violations)} problems")
    if found.violations:
        raise typer.Exit(1)
