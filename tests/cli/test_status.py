"""`elasticflow status` over a store of 100 runs in every phase, written as
the worker writes them (tests/cli/runs.py): what it says, piped, at 80
columns on a terminal, wide, and as JSON. Nothing is timed here; the latency
is bench/service.py --status-only."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from scheduler_service.cli import _register, app
from scheduler_service.cli.status import _gpu_map, _when, render
from scheduler_service.readmodel import UNPUBLISHED, GpuHolder, StatusReport, report
from scheduler_service.contracts import RunPhase
from tests.cli.runs import CLUSTER, REJECTION, TOTAL, fill

PHASE = {"profiling": RunPhase.PROFILING, "waiting": RunPhase.ADMITTED, "parked": RunPhase.ADMITTED,
         "running": RunPhase.RUNNING, "rescaling": RunPhase.RESCALING, "met": RunPhase.FINISHED,
         "missed": RunPhase.FINISHED, "stopped": RunPhase.FINISHED, "rejected": RunPhase.REJECTED,
         "failed": RunPhase.FINISHED}
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("status-home")


@pytest.fixture(scope="module")
def kinds(home: Path) -> dict[str, str]:
    return fill(home, 100)


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    monkeypatch.setenv("ELASTICFLOW_HOME", str(home))
    monkeypatch.delenv("ELASTICFLOW_DATABASE_URL", raising=False)
    monkeypatch.setenv("COLUMNS", "80")


def _blocks(text: str) -> dict[str, str]:
    """Each run's block (its head line and the indented lines under it), by run name."""
    blocks: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if line.startswith("run-"):
            name = line.split()[0]
            blocks[name] = line
        elif name and line.startswith("  "):
            blocks[name] += "\n" + line
    return blocks


def test_piped_output_names_every_run_phase_outcome_and_reason(home: Path, kinds: dict[str, str]) -> None:
    _register()
    result = CliRunner().invoke(app, ["status", "--home", str(home)])
    assert result.exit_code == 0, result.output
    assert "100 runs: 10 running, 10 rescaling, 20 admitted-waiting, 10 profiling, 10 rejected, 40 finished" \
        in result.output
    assert "GPUs: 20 of 64 busy; free: GPUs 20-63" in result.output
    assert "  node-0  0:run-003 1:run-004 2:run-013 3:run-014" in result.output
    blocks = _blocks(result.output)
    assert set(blocks) == set(kinds)
    for name, kind in kinds.items():
        block = blocks[name]
        head = block.splitlines()[0]
        assert head.startswith(f"{name} [mlp] {PHASE[kind].shown}"), block
        if kind == "rejected":
            assert f"rejected: {REJECTION[0]}" in head and REJECTION[1] in block
            assert "The earliest deadline that can be guaranteed now is" in block  # in words, first
        elif kind in ("met", "missed", "stopped", "failed"):
            assert f"finished: {kind}" in head and "finished " in block
            assert (f"it {TOTAL}/{TOTAL}" in block) == (kind != "stopped")
            if kind == "failed":  # at its last iteration, but it ended Failed: never "met"
                assert "met" not in head
        elif kind == "parked":
            assert "parked" in block and "no GPUs" in block
        elif kind == "waiting":
            assert "waiting for GPUs" in block
        elif kind == "profiling":
            assert "profiling its speed" in block
        elif kind in ("running", "rescaling"):
            assert "on node-" in block and f"it 200/{TOTAL}" in block and "on track" in head
            assert ("moving to GPUs" in block) == (kind == "rescaling")
    # not a terminal: a line is never cut in two
    assert all(line.startswith(("run-", "  ", "cluster:", "GPUs:", "100 runs")) for line in result.output.splitlines())


def test_at_80_columns_on_a_terminal_every_line_fits_and_the_reasons_are_whole(home: Path, kinds: dict[str, str]) -> None:
    out = io.StringIO()
    render(report(home), Console(file=out, width=80, force_terminal=True, color_system=None))
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80
    flat = " ".join(text.split())
    assert REJECTION[1] in flat and "parked: its GPUs went to runs closer to their deadlines" in flat
    assert flat.count("finished: met") == sum(k == "met" for k in kinds.values())


def test_a_wide_terminal_gets_one_table(home: Path, kinds: dict[str, str]) -> None:
    out = io.StringIO()
    render(report(home), Console(file=out, width=200, force_terminal=True, color_system=None))
    header = next(line for line in out.getvalue().splitlines() if line.startswith("run "))
    assert header.split() == ["run", "model", "phase", "GPUs", "nodes", "progress", "finish", "deadline",
                              "outcome", "why"]
    assert sum(line.startswith("run-") for line in out.getvalue().splitlines()) == 100


def test_json_is_the_status_report_model(home: Path, kinds: dict[str, str]) -> None:
    _register()
    result = CliRunner().invoke(app, ["status", "--home", str(home), "--json"])
    assert result.exit_code == 0, result.output
    data = StatusReport.model_validate_json(result.output)
    assert len(data.gpus) == 64 and sum(bool(s.holder) for s in data.gpus) == 20
    by_name = {run.name: run for run in data.runs}
    for name, kind in kinds.items():
        run = by_name[name]
        assert run.phase == PHASE[kind]
        if kind in ("met", "missed", "stopped", "failed"):
            assert run.outcome == kind and run.finished_at is not None
        if kind == "rejected":
            assert (run.reason, run.detail) == REJECTION and run.earliest_feasible_deadline is not None
        if kind in ("running", "rescaling"):
            assert len(run.gpus) == 1 and run.nodes == [f"node-{run.gpus[0] // 4}"]
            assert (run.iteration, run.total_iterations) == (200, TOTAL) and run.projected_finish is not None
    assert json.loads(result.output)["runs"][0]["phase"] == "running"


def test_an_empty_home_is_no_runs_not_an_error(tmp_path: Path) -> None:
    data = report(tmp_path)
    assert data.runs == [] and not (tmp_path / "elasticflow.db").exists()


def test_before_a_worker_publishes_its_cluster_there_is_no_map_not_a_guess(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 46: the map was guessed again from this shell's environment, a
    different cluster whenever the worker's environment differed."""
    monkeypatch.setenv("ELASTICFLOW_CLUSTER", str(CLUSTER))
    data = report(tmp_path)
    assert data.cluster == UNPUBLISHED and data.gpus == []
    out = io.StringIO()
    render(data, Console(file=out, width=80))
    assert "GPUs: 0 of 0 busy" in out.getvalue()


def test_status_imports_neither_prefect_nor_the_worker_nor_the_policy() -> None:
    code = ("import json, sys; from scheduler_service.cli import _register; _register('status'); "
            "import scheduler_service.cli.status as s; s.report(); print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    loaded = set(json.loads(out.stdout))
    assert not {m for m in loaded if m.split(".")[0] == "prefect" or
                m.startswith(("scheduler_service.worker", "scheduler_service.policy", "numpy", "torch"))}


def test_a_cluster_the_worker_published_is_the_map(tmp_path: Path) -> None:
    (tmp_path / "cluster.json").write_text(json.dumps({"description": "2 nodes x 2 GPUs",
                                                       "gpu_nodes": ["a", "a", "b", "b"]}))
    data = report(tmp_path)
    assert data.cluster == "2 nodes x 2 GPUs" and [s.node for s in data.gpus] == ["a", "a", "b", "b"]


def test_nodes_the_worker_left_out_are_listed_with_why(tmp_path: Path) -> None:
    """issue 24: a Ray node of 3 slots was left out with one line in worker.log,
    and `status` said nothing of it."""
    (tmp_path / "cluster.json").write_text(json.dumps({
        "description": "1 switch x 2 nodes x 2 GPUs = 4 GPUs", "gpu_nodes": ["a", "a", "b", "b"],
        "left_out": [{"node": "c", "why": "3 GPUs: buddy placement needs a power of two per node"}]}))
    data = report(tmp_path)
    assert [(o.node, o.why) for o in data.left_out] == [("c", "3 GPUs: buddy placement needs a power of two per node")]
    out = io.StringIO()
    render(data, Console(file=out, width=120))
    assert "left out: node c: 3 GPUs: buddy placement needs a power of two per node" in out.getvalue()


def test_a_name_with_control_characters_cannot_forge_a_line_or_colour_the_terminal(tmp_path: Path) -> None:
    from scheduler_service.store.db import get_engine
    from scheduler_service.worker.store import ServiceStore

    forged = "ok\n\x1b[31mFAKE finished: met\x1b[0m"
    store = ServiceStore(get_engine(f"sqlite:///{tmp_path / 'elasticflow.db'}"))
    store.upsert_job("00000000-0000-0000-0000-000000000001", RunPhase.RUNNING, flow_run_name=forged, model="mlp",
                     iterations=10, gpus="0")
    out = io.StringIO()
    render(report(tmp_path), Console(file=out, width=80, force_terminal=True, color_system="standard"))
    text = out.getvalue()
    assert "\x1b[31m" not in text and "FAKE finished" not in text.split("\\x1b[31m")[0]
    assert "ok\\n\\x1b[31mFAKE finished: met\\x1b[0m" in text  # shown, escaped, on its one line
    assert not any(line.lstrip().startswith("FAKE") for line in text.splitlines())


def test_on_a_cluster_shared_by_teams_each_team_shows_its_share_and_what_it_holds_borrows_and_lends(
        tmp_path: Path) -> None:
    from scheduler_service.store.db import get_engine
    from scheduler_service.worker.store import ServiceStore

    (tmp_path / "cluster.json").write_text(json.dumps({
        "description": "1 switch x 1 nodes x 4 GPUs = 4 GPUs", "gpu_nodes": ["a"] * 4,
        "teams": [{"name": "vision", "share": 2}, {"name": "speech", "share": 2}]}))
    store = ServiceStore(get_engine(f"sqlite:///{tmp_path / 'elasticflow.db'}"))
    store.upsert_job("00000000-0000-0000-0000-000000000001", RunPhase.RUNNING, flow_run_name="wide", model="mlp",
                     iterations=10, gpus="0,1,2", team="speech")
    store.upsert_job("00000000-0000-0000-0000-000000000002", RunPhase.ADMITTED, flow_run_name="waits", model="mlp",
                     iterations=10, team="vision")
    data = report(tmp_path)
    assert [(t.name, t.share, t.holds, t.borrowed, t.lends) for t in data.teams] == [
        ("vision", 2, 0, 0, 1), ("speech", 2, 3, 1, 0)]
    assert {v.name: v.team for v in data.runs} == {"wide": "speech", "waits": "vision"}
    out = io.StringIO()
    render(data, Console(file=out, width=120))
    text = out.getvalue()
    assert "team vision: share 2, holds 0, lends 1" in text and "team speech: share 2, holds 3 (1 borrowed)" in text
    assert "team" in text.splitlines()[[i for i, l in enumerate(text.splitlines()) if l.startswith("run")][0]]


def test_bidi_overrides_zero_width_characters_and_long_names_are_escaped_and_bounded(tmp_path: Path) -> None:
    """Issue 43: `status` printed U+202E (the rest of the line reversed) and
    U+200B raw; a name of any length is cut, with an ellipsis."""
    from scheduler_service.store.db import get_engine
    from scheduler_service.worker.store import ServiceStore

    from scheduler_service.worker.cluster import load

    load(CLUSTER).publish(tmp_path)  # the GPU map lists each holder's name too
    store = ServiceStore(get_engine(f"sqlite:///{tmp_path / 'elasticflow.db'}"))
    store.upsert_job("00000000-0000-0000-0000-000000000001", RunPhase.RUNNING, flow_run_name="ab\u202edc\u200bx",
                     model="mlp", iterations=10, gpus="0")
    store.upsert_job("00000000-0000-0000-0000-000000000002", RunPhase.RUNNING, flow_run_name="L" * 100_000,
                     model="mlp", iterations=10, gpus="1")
    for width in (80, 200):
        out = io.StringIO()
        render(report(tmp_path), Console(file=out, width=width))
        text = out.getvalue()
        assert "\u202e" not in text and "\u200b" not in text and "ab\\u202edc\\u200bx" in text
        assert "L" * 200 not in text and "L" * 150 in text.replace("\n", "").replace(" ", "") and "…" in text


def test_the_gpu_map_names_the_free_gpus_and_another_days_time_has_its_year() -> None:
    """Issue 46: "free: 0" was read as none free (it meant GPU 0), and
    "deadline 01-01 00:00" dropped the year."""
    slots = [GpuHolder(gpu=0, node="localhost"), GpuHolder(gpu=1, node="localhost", holder="a")]
    assert _gpu_map(slots)[0] == "GPUs: 1 of 2 busy; free: GPU 0"
    assert _gpu_map([slots[1]])[0] == "GPUs: 1 of 1 busy; free: none"
    assert _gpu_map([GpuHolder(gpu=g, node="n") for g in range(4)])[0] == "GPUs: 0 of 4 busy; free: GPUs 0-3"
    now = datetime(2026, 12, 6, 12, 0, tzinfo=timezone.utc)
    assert "2027-01-01" in _when(datetime(2027, 1, 1, 12, 0, tzinfo=timezone.utc), now)
