"""Commands the CLI prints for a user to paste, and the console it prints with.

A hint says `/path/to/.venv/bin/prefect ...`, not `prefect ...`: the
virtualenv's scripts are not on the PATH unless it is activated, and a hint
that fails when pasted is worse than none. Output that is not a terminal (a
pipe, a log file, a test) is not wrapped at 80 columns mid-phrase: each line
stays one line, for grep and for pasting.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from rich.console import Console


def executable(name: str) -> str:
    """The full path of `name` in this interpreter's scripts folder (the
    virtualenv's bin/), or the bare name if it is not installed there."""
    candidate = Path(sys.executable).parent / name  # not resolved: a venv's python is a symlink
    return str(candidate) if candidate.exists() else name


def command(*args: str, env: dict[str, str] | None = None) -> str:
    """A command line a user can paste as it is: the program by its full path,
    every argument quoted for a POSIX shell, `env` as leading assignments."""
    program, *rest = args
    words = [f"{key}={shlex.quote(value)}" for key, value in (env or {}).items()]
    words += [shlex.quote(executable(program)), *(shlex.quote(str(a)) for a in rest)]
    return " ".join(words)


def prefect(*args: str, api_url: str | None = None) -> str:
    """A `prefect` command against the stack at `api_url` (if given)."""
    return command("prefect", *args, env={"PREFECT_API_URL": api_url} if api_url else None)


def daily_schedule(api_url: str | None = None) -> str:
    """How to turn on pipeline/daily's schedule, which prefect.yaml ships off."""
    return ("pipeline/daily's schedule (01:00 UTC daily) is off. Turn it on with: "
            + prefect("deployment", "schedule", "resume", "--all", api_url=api_url)
            + " (every paused schedule; only pipeline/daily has one here), "
            "or set `active: true` under its schedule in prefect.yaml to keep it on across restarts.")


def console(stderr: bool = False) -> Console:
    """A rich console that wraps at the terminal's width, and not at all when
    not attached to one."""
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, soft_wrap=not stream.isatty())
