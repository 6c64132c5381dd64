"""Throughput curves kept per GPU kind, and a store made before kinds upgraded in place."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from scheduler_service.store import get_curve, get_curves, get_engine, save_curve

OLD_SCHEMA = """
CREATE TABLE throughput_measurement (id INTEGER NOT NULL, model VARCHAR NOT NULL,
    global_batch_size INTEGER NOT NULL, gpus INTEGER NOT NULL, iterations_per_s FLOAT NOT NULL,
    device VARCHAR NOT NULL, measured_at DATETIME NOT NULL, PRIMARY KEY (id),
    CONSTRAINT uq_throughput_point UNIQUE (model, global_batch_size, gpus));
CREATE INDEX ix_throughput_measurement_model ON throughput_measurement (model);
CREATE INDEX ix_throughput_measurement_global_batch_size ON throughput_measurement (global_batch_size);
INSERT INTO throughput_measurement (model, global_batch_size, gpus, iterations_per_s, device, measured_at)
    VALUES ('mlp', 32, 1, 10.0, 'cpu', '2026-01-01 00:00:00'), ('mlp', 32, 2, 19.0, 'cpu', '2026-01-01 00:00:00');
"""


def test_each_kind_keeps_its_own_curve_of_a_model(tmp_path: Path) -> None:
    engine = get_engine(f"sqlite:///{tmp_path / 'store.db'}")
    save_curve("mlp", 32, {1: 20.0, 2: 38.0}, engine=engine, kind="A100")
    save_curve("mlp", 32, {1: 4.0, 2: 7.5}, engine=engine, kind="T4")
    save_curve("mlp", 32, {1: 5.0}, engine=engine, kind="T4")  # measured again: replaces that point only
    assert get_curves("mlp", 32, engine) == {"A100": {1: 20.0, 2: 38.0}, "T4": {1: 5.0, 2: 7.5}}
    assert get_curve("mlp", 32, engine, kind="T4") == {1: 5.0, 2: 7.5}
    assert get_curve("mlp", 32, engine) == {1: 20.0, 2: 38.0}  # no kind asked, none unnamed: the first kind
    save_curve("mlp", 32, {1: 9.0}, engine=engine)
    assert get_curve("mlp", 32, engine) == {1: 9.0}  # the curve of no named kind, when there is one


def test_a_store_from_before_kinds_is_upgraded_and_keeps_its_curves(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as con:
        con.executescript(OLD_SCHEMA)
    engine = get_engine(f"sqlite:///{path}")
    assert get_curves("mlp", 32, engine) == {"": {1: 10.0, 2: 19.0}}
    save_curve("mlp", 32, {1: 3.0, 2: 5.5}, engine=engine, kind="T4")  # the old unique point would refuse this
    assert get_curves("mlp", 32, engine) == {"": {1: 10.0, 2: 19.0}, "T4": {1: 3.0, 2: 5.5}}
    from scheduler_service.store.throughput import upgrade

    upgrade(engine)  # once is enough: a second look changes nothing
    assert get_curves("mlp", 32, engine)[""] == {1: 10.0, 2: 19.0}


def test_a_run_is_planned_on_each_kind_with_that_kinds_curve_or_else_the_unnamed_one() -> None:
    from scheduler_service.worker.intake import kind_curves, one_curve, policy_job

    stored = {"": {1: 10.0, 2: 19.0}, "T4": {1: 2.0, 2: 3.8}}
    by_kind = kind_curves(stored, ("A100", "T4"))
    assert by_kind == {"A100": {1: 10.0, 2: 19.0}, "T4": {1: 2.0, 2: 3.8}}
    assert kind_curves({"T4": {1: 2.0}}, ("A100", "T4")) == {"T4": {1: 2.0}}  # never guessed for A100
    assert kind_curves(stored, ()) == {} and one_curve(stored) == {1: 10.0, 2: 19.0}
    job = policy_job("r", 0.0, 100, 600.0, one_curve(stored) or {}, "mlp", 32, 8, by_kind)
    assert job.kinds == ("A100", "T4") and job.on("T4").curve.speed(2) == 3.8
    assert policy_job("r", 0.0, 100, 600.0, {1: 10.0}, "mlp", 32, 8).curves == ()  # one kind: as before
