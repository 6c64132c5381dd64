"""`elasticflow profile` measures real DDP runs and the store hands the curve to admission."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from typer.testing import CliRunner

from scheduler_service.cli import _register, app
from scheduler_service.store import export_csv, get_curve, get_curves, get_engine, save_curve


def test_store_round_trip_and_csv_shape(tmp_path: Path) -> None:
    engine = get_engine(f"sqlite:///{tmp_path / 'store.db'}")
    assert get_curve("resnet", 64, engine) is None
    save_curve("resnet", 64, {1: 3.0, 2: 5.5}, engine=engine)
    save_curve("resnet", 64, {2: 6.0, 4: 9.0}, engine=engine)  # re-measured points replace old ones
    save_curve("resnet", 128, {1: 2.0}, engine=engine)
    assert get_curve("resnet", 64, engine) == {1: 3.0, 2: 6.0, 4: 9.0}
    rows = list(csv.reader(open(export_csv("resnet", tmp_path / "resnet.csv", engine))))
    reference = list(csv.reader(open(Path(__file__).parents[2] / "data/throughputs/A100/resnet50_cifar10.csv")))
    assert rows[0] == reference[0] == ["global_batch_size", "1", "2", "4", "8", "16", "32", "64"]
    assert rows[1:] == [["64", "3.0", "6.0", "9.0", "0", "0", "0", "0"], ["128", "2.0", "0", "0", "0", "0", "0", "0"]]


def test_default_database_lives_under_elasticflow_home(elasticflow_home: Path) -> None:
    from scheduler_service.store import database_url

    assert database_url() == f"sqlite:///{elasticflow_home / 'elasticflow.db'}"


@pytest.mark.slow
def test_profile_command_stores_a_measured_curve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"sqlite:///{tmp_path / 'profile.db'}"
    monkeypatch.setenv("ELASTICFLOW_DATABASE_URL", url)
    _register()
    out = tmp_path / "mlp.csv"
    result = CliRunner().invoke(
        app, ["profile", "mlp", "--batch-size", "16", "--gpus", "1,2", "--iterations", "6", "--export", str(out)]
    )
    assert result.exit_code == 0, result.output
    curve = get_curve("mlp", 16, get_engine(url))
    assert curve is not None and set(curve) == {1, 2}
    assert all(rate > 0 for rate in curve.values())
    rows = list(csv.reader(open(out)))
    assert rows[1][0] == "16" and float(rows[1][1]) == pytest.approx(curve[1]) and rows[1][3] == "0"
    # Measured on a node of a named kind: kept beside the first, for that kind only.
    result = CliRunner().invoke(app, ["profile", "mlp", "--batch-size", "16", "--gpus", "1", "--iterations", "4",
                                      "--kind", "T4"])
    assert result.exit_code == 0 and "on T4" in result.output, result.output
    assert set(get_curves("mlp", 16, get_engine(url))) == {"", "T4"}


def test_profile_rejects_gpu_counts_that_are_not_powers_of_two() -> None:
    _register()
    result = CliRunner().invoke(app, ["profile", "mlp", "--gpus", "1,3"])
    assert result.exit_code != 0
    assert "powers of two" in result.output
