"""Per-job output of `simulate --jobs-csv`, and `diff` against a reference per-job file."""

import csv

from typer.testing import CliRunner

from scheduler_service.cli import _register, app
from scheduler_service.simulator.experiment import data_dir

_register()
runner = CliRunner()
HEADER = "job_id,submit_time,iteration,model_name,ddl,batch_size,num_gpu,duration,best_effort\n"
# Job 0 fits; job 1 cannot finish even alone (deadline 60 s after arrival); job 2 is best-effort.
TRACE = "0,0,1000,resnet50,3000,64,1,150,0\n1,10,900000,bert,70,64,2,100,0\n2,20,500,bert,9000,64,1,100,1\n"


def jobs_csv(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(HEADER + TRACE)
    out = tmp_path / "jobs.csv"
    result = runner.invoke(app, ["simulate", "--trace", str(trace), "--cluster", "n1g8", "--throughputs", "A100",
                                 "--policy", "elasticflow", "--policy", "edf", "--jobs-csv", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_jobs_csv_has_a_row_per_job_and_policy_with_decision_reason_and_mss(tmp_path):
    rows = list(csv.DictReader(jobs_csv(tmp_path).open()))
    assert [(r["policy"], r["job_id"]) for r in rows] == [
        ("elasticflow", "0"), ("elasticflow", "1"), ("elasticflow", "2"), ("edf", "0"), ("edf", "1"), ("edf", "2")]
    ef = {r["job_id"]: r for r in rows if r["policy"] == "elasticflow"}
    assert ef["0"]["decision"] == "admitted" and ef["0"]["met"] == "1" and ef["0"]["guaranteed"] == "1"
    assert int(ef["0"]["mss"]) >= 1 and float(ef["0"]["start"]) <= float(ef["0"]["finish"]) <= 3000
    assert ef["1"]["decision"] == "rejected" and ef["1"]["reason"] and ef["1"]["met"] == "0"
    assert ef["1"]["start"] == "" and ef["1"]["finish"] == ""
    assert ef["2"]["decision"] == "best_effort" and ef["2"]["met"] == "" and ef["2"]["finish"]


def test_diff_names_the_jobs_only_one_side_met_and_why(tmp_path):
    ours = jobs_csv(tmp_path)
    reference = tmp_path / "ref.csv"
    reference.write_text("job_id,decision,met\n0,declined,0\n1,admitted,1\n2,best_effort,\n")
    lined = tmp_path / "lined.csv"
    result = runner.invoke(app, ["diff", str(ours), str(reference), "--out", str(lined)])
    assert result.exit_code == 0, result.output
    assert "elasticflow: 1/2 met (0.500); reference: 1/2 (0.500)" in result.output
    assert "met only by the reference; ours: rejected" in result.output
    assert "met only by elasticflow; the reference: declined 1" in result.output
    rows = {r["job_id"]: r for r in csv.DictReader(lined.open())}
    assert set(rows) == {"0", "1"}  # best-effort jobs count in neither
    assert rows["0"]["verdict"] == "only ours met" and rows["0"]["reference_decision"] == "declined"
    assert rows["1"]["verdict"] == "only the reference met" and rows["1"]["reason"]


def test_diff_of_different_traces_exits_2_with_one_line(tmp_path):
    ours = jobs_csv(tmp_path)
    reference = tmp_path / "ref.csv"
    reference.write_text("job_id,decision,met\n0,admitted,1\n7,admitted,1\n")
    result = runner.invoke(app, ["diff", str(ours), str(reference)])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1 and "job_id" in result.output
    result = runner.invoke(app, ["diff", str(ours), str(reference), "--policy", "gandiva"])
    assert result.exit_code == 2 and "no rows for policy 'gandiva'" in result.output


def test_reference_outcomes_carried_in_the_repository_match_their_readme():
    from scheduler_service.simulator.outcomes import read_reference, reference_ratio

    folder = data_dir() / "reference"
    expected = {"dev101_n16g8": 0.963, "dev102_n8g8": 0.830, "dev103_n4g8": 0.388, "dev104_n8g8": 0.948,
                "dev105_n8g8": 0.235, "dev106_n8g8": 0.992}
    for name, ratio in expected.items():
        assert abs(reference_ratio(read_reference(folder / "outcomes" / f"{name}.csv")) - ratio) < 0.0015, name
        assert (folder / "traces" / f"{name.split('_')[0]}.csv").exists()


def test_diff_lines_up_two_of_our_policies(tmp_path):
    ours = jobs_csv(tmp_path)
    result = runner.invoke(app, ["diff", str(ours), str(ours), "--policy", "edf", "--reference-policy", "elasticflow"])
    assert result.exit_code == 0, result.output
    assert "edf: " in result.output and "reference: 1/2 (0.500)" in result.output
