"""A cluster of A100 and T4 nodes, simulated through the service's loop and bounded."""

import json

from typer.testing import CliRunner

from scheduler_service.cli import _register, app
from scheduler_service.policy import Job, ThroughputCurve, Topology
from scheduler_service.policy.topology import MixedTopology
from scheduler_service.simulator.bound import deadline_ratio_bound
from scheduler_service.simulator.experiment import data_dir, load_jobs, simulate_policy
from scheduler_service.simulator.metrics import summarize

_register()
MIXED = "mixed_n8g8_A100_n8g8_T4"


def run(trace, cluster, throughputs):
    jobs, topology, note = load_jobs(data_dir() / "reference" / "traces" / f"{trace}.csv",
                                     data_dir() / "clusters" / f"{cluster}.csv", data_dir() / "throughputs" / throughputs)
    result, _ = simulate_policy(jobs, topology, "elasticflow-overload", 60.0, data_dir() / "throughputs", "service")
    return summarize(result), note


def test_the_t4_nodes_meet_deadlines_the_a100_nodes_alone_cannot():
    alone, _ = run("dev102", "n8g8", "A100")
    mixed, note = run("dev102", MIXED, "")
    assert mixed.admitted_missed == 0 and alone.admitted_missed == 0
    assert mixed.deadline_ratio > alone.deadline_ratio
    assert set(mixed.use_by_kind) == {"A100", "T4"}
    assert mixed.use_by_kind["T4"] > 0.3  # the slow kind is really used, not a spare
    assert "relative_speed" in note and "on T4" in note  # derived curves are said to be derived


def test_simulate_on_a_folder_of_kinds_reports_the_use_of_each(tmp_path):
    out = tmp_path / "out.json"
    result = CliRunner().invoke(app, ["simulate", "--trace", str(data_dir() / "reference" / "traces" / "dev106.csv"),
                                      "--cluster", MIXED, "--throughputs", str(data_dir() / "throughputs"),
                                      "--actuation", "ideal", "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "T4" in result.output  # its own use column
    (row,) = json.loads(out.read_text())["results"]
    assert row["admitted_missed"] == 0 and row["use_by_kind"]["T4"] > 0


def test_a_folder_of_kinds_on_a_cluster_of_one_kind_is_refused_with_what_to_give():
    result = CliRunner().invoke(app, ["simulate", "--trace", "dev106", "--cluster", "n8g8",
                                      "--throughputs", str(data_dir() / "throughputs")])
    assert result.exit_code == 2
    assert "needs a mixed cluster file" in result.output and "A100" in result.output


def test_the_bound_of_a_mixed_cluster_counts_the_slow_kind():
    fast, slow = ThroughputCurve({1: 1.0, 2: 2.0}), ThroughputCurve({1: 0.5, 2: 1.0})
    jobs = [Job(f"j{i}", 0.0, 3600.0, 3600.0, fast, kind="A100", curves=(("A100", fast), ("T4", slow)))
            for i in range(4)]  # each needs one A100 for the hour, or two T4
    one = deadline_ratio_bound(jobs, Topology(1, 1, 2)).bound
    both = deadline_ratio_bound(jobs, MixedTopology.of([("A100", Topology(1, 1, 2)), ("T4", Topology(1, 1, 2))])).bound
    assert one == 0.5 and both == 0.75  # 2 on A100, 1 more on the two T4
