"""A reduced `elasticflow reproduce`: every policy, the bound, the report files."""

import json

from typer.testing import CliRunner

from scheduler_service.cli import _register, app
from scheduler_service.policy.registry import POLICIES

_register()


def test_quick_reproduce_writes_every_policy_the_bound_and_the_plots(tmp_path):
    result = CliRunner().invoke(app, ["reproduce", "--quick", "--out", str(tmp_path), "--workers", "2"])
    assert result.exit_code == 0, result.output
    payload = json.loads((tmp_path / "results.json").read_text())
    small = [r for r in payload["results"] if r["trace"] == "100jobs_1500lam"]
    assert {r["policy"] for r in small} == set(POLICIES)
    for r in payload["results"]:
        bound = payload["bounds"][f"{r['trace']}@{r['cluster']}"]["bound"]
        assert r["deadline_ratio"] <= bound + 1e-9, r["policy"]
        if r["policy"] == "elasticflow":
            assert r["admitted_missed"] == 0
    table = (tmp_path / "results.md").read_text()
    assert "| 100jobs_1500lam | n16g8 |" in table and "bound" in table
    for name in ("deadline_ratios.png", "cluster_size.png"):
        assert (tmp_path / name).stat().st_size > 5_000
    assert "ElasticFlow" in result.output and "best baseline" in result.output
