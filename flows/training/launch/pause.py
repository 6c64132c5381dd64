"""A stop of the stack is a pause, not a failure (issue 43).

`elasticflow up` marks its home `stopping` before it stops anything, and
clears the mark when it starts. While the mark is there, a SIGTERM to a
training run's flow process means "checkpoint and go": the run leaves
Prefect in a non-final state (`Scheduled`, named `Resuming`, with the
iteration it reached) instead of `Crashed`, and the next start's recovery
gives it GPUs again in the same flow run, from its last checkpoint. A SIGTERM
without the mark (a cancellation, an operator's kill) keeps its old meaning.

Standard library only: the boot relay reads the mark before Prefect is imported.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

HOME_ENV = "ELASTICFLOW_HOME"


def stopping_mark(home: Path | str) -> Path:
    return Path(home) / "run" / "stopping"


def mark_stopping(home: Path) -> None:
    """Before the stack stops anything: what ends from now on ends paused."""
    mark = stopping_mark(home)
    mark.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    mark.write_text(f"{os.getpid()} {time.time():.3f}\n")


def clear_stopping(home: Path) -> None:
    """At a start: runs of this life end as their own story says. When the
    last stop began is kept (`stopped_at`) for the next worker's recovery."""
    mark = stopping_mark(home)
    if mark.exists():
        os.replace(mark, mark.with_name("stopped"))


def stopped_at(home: Path | str) -> float | None:
    """When the last stop of the stack at `home` began (epoch seconds), if it ever stopped."""
    for name in ("stopping", "stopped"):
        try:
            return float((Path(home) / "run" / name).read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return None


def stack_stopping(home: Path | str | None = None) -> bool:
    """Whether the stack at `home` (default `$ELASTICFLOW_HOME`) is stopping."""
    home = home or os.environ.get(HOME_ENV)
    return bool(home) and stopping_mark(home).exists()  # type: ignore[arg-type]
