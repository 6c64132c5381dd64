"""Long commands say how far they are on stderr, also when it is not a terminal (a log, a pipe)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from scheduler_service.cli import _register, app


@pytest.mark.slow
def test_profile_says_each_gpu_count_as_it_measures_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICFLOW_DATABASE_URL", f"sqlite:///{tmp_path / 'profile.db'}")
    _register()
    result = CliRunner().invoke(app, ["profile", "mlp", "--batch-size", "8", "--gpus", "1,2", "--iterations", "4"])
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    assert lines[0] == "[1/2] mlp on 1 GPU(s), 4 iterations ..." and lines[2].startswith("[2/2] mlp on 2 GPU(s)")
    assert lines[1].startswith("[1/2] ") and lines[1].endswith(" s)") and "it/s" in lines[1]


def test_reproduce_writes_a_line_per_case_where_no_bar_can_be_drawn(tmp_path: Path) -> None:
    _register()
    result = CliRunner().invoke(app, ["reproduce", "--quick", "--workers", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    steps = [line for line in result.stderr.splitlines() if line.startswith("[")]
    total = int(steps[-1].split("/")[1].split("]")[0])
    assert len(steps) == total and steps[-1].startswith(f"[{total}/{total}] ")
