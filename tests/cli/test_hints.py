"""The commands the CLI prints can be pasted as they are, and piped output is not cut at 80 columns."""

from __future__ import annotations

import io
import shlex
import sys
from pathlib import Path

from scheduler_service.cli.hints import command, daily_schedule, prefect


def test_a_hint_names_the_virtualenvs_executable_by_its_full_path_and_quotes_its_arguments() -> None:
    words = shlex.split(command("elasticflow", "status", "--home", "/tmp/with space"))
    assert words == [str(Path(sys.executable).parent / "elasticflow"), "status", "--home", "/tmp/with space"]
    assert Path(words[0]).exists()
    env, program, *rest = shlex.split(prefect("deployment", "run", "train/mlp", api_url="http://127.0.0.1:4200/api"))
    assert env == "PREFECT_API_URL=http://127.0.0.1:4200/api" and Path(program).name == "prefect"
    assert Path(program).is_absolute() and rest == ["deployment", "run", "train/mlp"]


def test_the_daily_schedule_hint_says_it_is_off_and_how_to_turn_it_on() -> None:
    text = daily_schedule("http://127.0.0.1:4200/api")
    assert "is off" in text and "deployment schedule resume" in text and "active: true" in text


def test_a_console_not_attached_to_a_terminal_keeps_each_line_whole(monkeypatch) -> None:
    from scheduler_service.cli import hints

    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    line = "word " * 40
    hints.console().print(line)
    assert out.getvalue().count("\n") == 1 and len(out.getvalue()) > 80
