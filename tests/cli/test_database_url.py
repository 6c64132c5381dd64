"""A database password never reaches a command line (`ps` shows it to every
user): `up` takes it from the environment or a private file, and says so."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from scheduler_service.cli import _register, app
from scheduler_service.cli.service import DATABASE_ENV, database_url_from, shown_url

_register()


def test_a_password_on_the_command_line_is_refused_naming_the_two_ways_that_keep_it_private() -> None:
    with pytest.raises(ValueError, match=rf"--database: the password would be visible .* {DATABASE_ENV}"):
        database_url_from("postgresql://user:secret@db:5432/prefect", None)
    assert database_url_from("postgresql://user@db:5432/prefect", None) == "postgresql://user@db:5432/prefect"


def test_a_private_file_or_the_environment_may_hold_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = "postgresql://user:secret@db:5432/prefect"
    private = tmp_path / "db.url"
    private.write_text(url + "\n")
    private.chmod(0o600)
    assert database_url_from(None, private) == url
    private.chmod(0o644)
    with pytest.raises(ValueError, match="others can read it .* chmod 600"):
        database_url_from(None, private)
    monkeypatch.setenv(DATABASE_ENV, url)
    assert database_url_from(None, None) == url
    assert "secret" not in shown_url(url) and "db:5432" in shown_url(url)


def test_up_exits_2_with_one_line_and_starts_nothing(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["up", "--home", str(tmp_path), "--database",
                                      "postgresql://user:secret@db:5432/prefect"])
    assert result.exit_code == 2 and "password would be visible" in result.output
    assert "secret" not in result.output.replace("postgresql://user:secret", "")
    assert not (tmp_path / "logs").exists()
    result = CliRunner().invoke(app, ["profile", "mlp", "--database-url", "postgresql://u:secret@db/x"])
    assert result.exit_code == 2 and "ELASTICFLOW_DATABASE_URL" in result.output
