"""bench/sweep.py's single runs: a generated trace at a load, a reference trace
lined up with the authors' per-job outcomes."""

import importlib.util
from pathlib import Path

import pytest

SWEEP = Path(__file__).resolve().parents[2] / "bench" / "sweep.py"
spec = importlib.util.spec_from_file_location("sweep", SWEEP)
sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sweep)


def test_a_generated_run_offers_about_the_load_asked_for_and_stays_under_the_bound():
    task = {"kind": "generated", "trace": "t", "cluster": "n16g8", "load": 1.0, "seed": 1}
    bound = sweep.run_task(dict(task, policy="bound", actuation=None, series="bound"))
    for actuation in ("service", "ideal"):
        run = sweep.run_task(dict(task, policy="elasticflow", actuation=actuation, series=actuation))
        assert run["load_measured"] == pytest.approx(1.0, rel=0.5)  # one 500-job trace of a heavy-tailed mix
        assert run["admitted_missed"] == 0 and 0 < run["ratio"] <= bound["ratio"] + 1e-9


def test_the_sweep_runs_ours_through_the_services_loop_and_bare_and_edf_bare():
    assert ("elasticflow", "service") in sweep.series() and ("elasticflow", "ideal") in sweep.series()
    assert ("edf", "ideal") in sweep.series() and ("edf", "service") not in sweep.series()


def test_a_reference_run_is_lined_up_with_the_authors_outcomes():
    run = sweep.run_task({"kind": "reference", "trace": "dev101", "cluster": "n16g8", "policy": "elasticflow",
                          "actuation": "service", "series": "elasticflow (service)"})
    reference = sweep.reference_ratio("dev101", "n16g8")
    deadline_jobs = 400
    # ours - reference = (only ours - only reference) / deadline jobs
    assert run["ratio"] - reference == pytest.approx((run["only_ours"] - run["only_reference"]) / deadline_jobs)
    assert ("dev101", "n16g8") in sweep.reference_cases() and ("openb126", "n2g8") in sweep.reference_cases()
    assert len(sweep.reference_cases()) == 9  # six drawn with the paper's statistics, Alibaba's at three sizes
