"""`elasticflow trace`: traces the simulator loads, the same for the same seed,
and drawn with the statistics asked for."""

import math
import statistics

import pytest
from typer.testing import CliRunner

from scheduler_service.cli import _register, app
from scheduler_service.simulator.experiment import data_dir
from scheduler_service.simulator.inputs import load_throughputs, load_trace
from scheduler_service.simulator.tracegen import TraceSpec, generate, mean_gap_for, offered_load, parse_spec

_register()
runner = CliRunner()
CURVES = load_throughputs(data_dir() / "throughputs" / "A100")


def test_a_generated_trace_loads_with_the_simulators_loader_and_is_the_same_per_seed(tmp_path):
    out = tmp_path / "t.csv"
    args = ["trace", "--jobs", "50", "--mean-gap", "300", "--best-effort", "0.2", "--seed", "7", "--out", str(out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    jobs = load_trace(out, CURVES)
    assert len(jobs) == 50 and 0 < sum(j.deadline is None for j in jobs) < 50
    first = out.read_text()
    assert runner.invoke(app, args).exit_code == 0 and out.read_text() == first
    assert runner.invoke(app, args[:-4] + ["--seed", "8", "--out", str(out)]).exit_code == 0
    assert out.read_text() != first
    assert first.splitlines()[0] == "job_id,submit_time,iteration,model_name,ddl,batch_size,num_gpu,duration,best_effort"


def test_the_trace_has_the_requested_statistics_roughly():
    spec = parse_spec(jobs="20000", mean_gap="400", deadline_factor="1,2", best_effort="0.3",
                      models="bert,gpt2,vgg16", seed="1")
    rows = generate(spec, CURVES)
    gaps = [b["submit_time"] - a["submit_time"] for a, b in zip(rows, rows[1:])]
    assert statistics.mean(gaps) == pytest.approx(400, rel=0.05)
    assert statistics.mean(r["best_effort"] for r in rows) == pytest.approx(0.3, abs=0.02)
    assert {r["model_name"] for r in rows} == {"bert", "gpt2", "vgg16"}
    ones = sum(r["num_gpu"] == 1 for r in rows) / len(rows)
    eights = sum(r["num_gpu"] == 8 for r in rows) / len(rows)
    assert ones == pytest.approx(0.83, abs=0.02) and eights == pytest.approx(0.10, abs=0.02)
    short = [r for r in rows if r["duration"] < 60 * 10 ** 2.5]
    assert len(short) / len(rows) == pytest.approx(0.8, abs=0.02)
    assert all(600 <= r["duration"] <= 600_000 for r in rows)
    exponents = [math.log10(r["duration"] / 60) for r in short]
    assert statistics.mean(exponents) == pytest.approx(1.75, abs=0.03)  # U(1, 2.5)
    factors = [(r["ddl"] - r["submit_time"]) / r["duration"] for r in rows]
    assert min(factors) >= 0.99 and max(factors) <= 2.01 and statistics.mean(factors) == pytest.approx(1.5, abs=0.02)
    for r in rows[:500]:  # iterations take `duration` seconds at the requested count
        speed = CURVES[(r["model_name"], r["batch_size"])].points[r["num_gpu"]]
        assert r["iteration"] / speed == pytest.approx(r["duration"], abs=1 / speed + 1e-6)


def test_mean_gap_for_a_load_gives_that_load_on_average():
    spec = TraceSpec(jobs=20000, seed=3)
    gap = mean_gap_for(2.0, 64, spec, CURVES)
    rows = generate(TraceSpec(jobs=20000, mean_gap_s=gap, seed=3), CURVES)
    assert offered_load(rows, 64) == pytest.approx(2.0, rel=0.1)


@pytest.mark.parametrize("option,value", [
    ("--jobs", "0"), ("--jobs", "many"), ("--mean-gap", "-1"), ("--gpu-mix", "3:1"), ("--gpu-mix", "1"),
    ("--gpu-mix", "1:0,2:0"), ("--duration-mix", "1:3:2"), ("--deadline-factor", "1.5,0.5"),
    ("--deadline-factor", "1"), ("--best-effort", "1.2"), ("--models", "alexnet"), ("--seed", "x"),
    ("--throughputs", "nowhere"), ("--gpus", "0"), ("--sweep", "0"),
])
def test_a_bad_option_exits_2_with_one_line_naming_it(tmp_path, option, value):
    out = tmp_path / "t.csv"
    result = runner.invoke(app, ["trace", option, value, "--out", str(out)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and option in lines[0], result.output
    assert not out.exists()


def test_sweeps_arrive_together_share_a_model_and_keep_the_offered_load():
    spec = TraceSpec(jobs=20000, seed=5, sweep=8)
    gap = mean_gap_for(2.0, 64, spec, CURVES)
    rows = generate(TraceSpec(jobs=20000, mean_gap_s=gap, seed=5, sweep=8), CURVES)
    by_time: dict[int, list[dict]] = {}
    for row in rows:
        by_time.setdefault(int(row["submit_time"]), []).append(row)
    # Arrivals a second apart or less share a submit time once rounded: rare, so look at the rest.
    groups = [g for g in by_time.values() if len({(r["model_name"], r["batch_size"], r["num_gpu"]) for r in g}) == 1]
    assert len(groups) > 0.98 * len(by_time)
    sizes = [len(group) for group in groups]
    assert max(sizes) <= 8 and 4.0 < sum(sizes) / len(sizes) < 5.0  # 1..8 jobs an arrival, 4.5 on average
    assert offered_load(rows, 64) == pytest.approx(2.0, rel=0.15)
    assert generate(TraceSpec(jobs=50, seed=5), CURVES) == generate(TraceSpec(jobs=50, seed=5, sweep=1), CURVES)
