"""The `elasticflow` command line. Each subcommand lives in its own module and
only parses arguments and delegates; this module just assembles them."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="elasticflow",
    help="Elastic, deadline-aware serverless training on Prefect (ElasticFlow).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)



@app.callback()
def _group() -> None:
    # Keeps `elasticflow` a group of subcommands when only one is registered
    # (typer would otherwise run that one as the whole program).
    pass


def _register(command: str | None = None) -> None:
    # Imported for their side effect: each module adds its commands to `app`.
    if command == "status":
        # Run in loops and scripts: it alone skips the other modules' imports
        # (the simulator's numpy and HiGHS, Prefect), about half a second.
        from scheduler_service.cli import status  # noqa: F401
        return
    from scheduler_service.cli import evaluate, simulate  # noqa: F401
    from scheduler_service.cli import profile  # noqa: F401
    from scheduler_service.cli import service  # noqa: F401
    from scheduler_service.cli import status  # noqa: F401
    from scheduler_service.cli import trace  # noqa: F401


def main() -> None:
    import sys

    _register(sys.argv[1] if len(sys.argv) > 1 else None)
    app()
