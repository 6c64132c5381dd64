"""`elasticflow audit` never falls back to a temporary Prefect server of its
own (it would find no runs and say all is well): without an API URL it says
what to set and exits 2."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from scheduler_service.cli import _register, app

_register()


def test_audit_without_an_api_url_names_the_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings(updates={PREFECT_API_URL: None}):
        result = CliRunner().invoke(app, ["audit", "--home", str(tmp_path)])
    assert result.exit_code == 2 and "PREFECT_API_URL" in result.output
