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


def _register() -> None:
    # Imported for their side effect: each module adds its commands to `app`.
    from scheduler_service.cli import evaluate, simulate  # noqa: F401
    from scheduler_service.cli import profile  # noqa: F401
    from scheduler_service.cli import service  # noqa: F401
    from scheduler_service.cli import status  # noqa: F401
    from scheduler_service.cli import trace  # noqa: F401


def main() -> None:
    _register()
    app()
