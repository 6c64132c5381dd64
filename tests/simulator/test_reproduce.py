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
    # Ours through the service's loop and bare; baselines bare.
    assert {r["actuation"] for r in small if r["policy"] == "elasticflow"} == {"service", "ideal"}
    assert {r["actuation"] for r in small if r["policy"] == "edf"} == {"ideal"}
    for r in payload["results"]:
        bound = payload["bounds"][f"{r['trace']}@{r['cluster']}"]["bound"]
        assert r["deadline_ratio"] <= bound + 1e-9, r["policy"]
        if r["policy"] == "elasticflow":
            assert r["admitted_missed"] == 0, r["actuation"]
    table = (tmp_path / "results.md").read_text()
    assert "| 100jobs_1500lam | n16g8 |" in table and "bound" in table and "elasticflow (service)" in table
    for name in ("deadline_ratios.png", "cluster_size.png"):
        assert (tmp_path / name).stat().st_size > 5_000
    assert "ElasticFlow" in result.output and "best baseline" in result.output


def test_itp_clusters_are_compared_with_the_paper_at_the_paper_sizes_and_with_the_authors_at_128_gpus():
    from scheduler_service.simulator.reproduce import ITP_REFERENCE, comparison_cases

    cases = {(c.trace, c.cluster): c for c in comparison_cases() if c.group.startswith("itp")}
    sizes = {"n64g8": (1, 2, 3, 5, 6), "n128g8": (4, 7, 8, 9), "n32g8": (10,)}
    for cluster, numbers in sizes.items():
        for i in numbers:
            case = cases[(f"itp/cluster{i:02d}", cluster)]
            assert case.group == "itp" and case.references["elasticflow"] == ITP_REFERENCE[i - 1]
    overloaded = {i: cases[(f"itp/cluster{i:02d}", "n16g8")].references.get("elasticflow") for i in range(1, 11)}
    assert overloaded[4] == 0.194 and overloaded[7] == 0.381  # the authors' simulator, not the paper's plot
    assert all(overloaded[i] not in ITP_REFERENCE for i in range(1, 11) if overloaded[i] is not None)


def test_a_bad_trace_read_in_a_worker_comes_back_as_the_error_naming_its_field(tmp_path, monkeypatch):
    import pytest

    from scheduler_service.simulator.experiment import data_dir
    from scheduler_service.simulator.inputs import InputError
    from scheduler_service.simulator.reproduce import Case, run_comparison

    real = data_dir()
    for folder in ("throughputs", "clusters"):
        (tmp_path / folder).symlink_to(real / folder)
    (tmp_path / "traces").mkdir()
    rows = (real / "traces" / "100jobs_1500lam.csv").read_text().splitlines()
    header = rows[0].split(",")
    broken = rows[1].split(",")
    broken[header.index("ddl")] = "soon"
    (tmp_path / "traces" / "bad.csv").write_text("\n".join([rows[0], ",".join(broken), *rows[2:]]) + "\n")
    monkeypatch.setenv("ELASTICFLOW_DATA", str(tmp_path))
    case = Case(trace="bad", cluster="n16g8", gpu="A100", interval=240, group="sweep", policies=["edf"])
    with pytest.raises(InputError, match=r"bad\.csv, row 2, field 'ddl'"):
        run_comparison([case], workers=1)


def test_the_teams_scenario_reports_each_team_with_and_without_teams_and_its_bound(tmp_path):
    """Issue 27: the flood of one team, per team and overall, beside one queue,
    with each team's bound on its share; written with the comparison."""
    from scheduler_service.simulator.reproduce import Report, run_comparison, write_report
    from scheduler_service.simulator.teams_case import LINES, TeamsScenario

    scenario = TeamsScenario(first=90, flood=60, shares={"a": 32, "b": 16, "c": 16})
    report = run_comparison([], workers=2, teams_scenario=scenario)
    teams = report.teams_scenario
    assert set(teams.results) == {line.name for line in LINES} and set(teams.bounds) == {"calm", "flood"}
    for line in LINES:
        result = teams.results[line.name]
        assert set(result.ratio_by_team) == {"a", "b", "c"} and result.admitted_missed == 0
    flood = teams.results["teams, flood"]
    assert flood.deadline_jobs == teams.results["teams, calm"].deadline_jobs + 60
    assert all(0 <= teams.bounds["flood"][t] <= 1 for t in "abc")
    write_report(report, tmp_path)
    text = (tmp_path / "results.md").read_text()
    assert "| teams, flood |" in text and "| bound on share, flood |" in text and "team a floods" in text
    assert (tmp_path / "teams.png").stat().st_size > 10_000
    assert Report.model_validate_json((tmp_path / "results.json").read_text()).teams_scenario == teams
