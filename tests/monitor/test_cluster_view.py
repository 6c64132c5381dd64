"""The service's cluster view: what it shows from runs and their status files,
when it rewrites the artifact, and when a deadline is reported at risk."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from flows.training.control import FileControlChannel
from scheduler_service.policy import Job, ThroughputCurve
from scheduler_service.worker.cluster import load
from scheduler_service.worker.cluster_view import REFRESH_S, ClusterView
from scheduler_service.worker.run_state import RunState

ROOT = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 12, 1, 5, 0, tzinfo=timezone.utc).timestamp()


def _run(tmp_path: Path, run_id: str, deadline_in_s: float | None, gpus: tuple[int, ...]) -> RunState:
    job = Job(job_id=run_id, submit_time=NOW, iterations=1000.0,
              deadline=None if deadline_in_s is None else NOW + deadline_in_s,
              curve=ThroughputCurve({1: 10.0, 2: 18.0}), model="mlp", batch_size=32)
    run = RunState(run_id, job, FileControlChannel(run_id, tmp_path), phase="running", held=gpus, commanded=gpus, share=1)
    return run


def _named(run: RunState, name: str) -> dict[str, RunState]:
    run.name = name
    return {run.run_id: run}


def _progress(run: RunState, iteration: int, finish_in_s: float) -> None:
    finish = datetime.fromtimestamp(NOW + finish_in_s, timezone.utc).isoformat()
    run.channel.publish_status({"iteration": iteration, "projected_finish": finish})


def test_a_deadline_goes_at_risk_and_recovers_once_each(tmp_path: Path) -> None:
    view = ClusterView(load(ROOT / "infra" / "local-cpu2.csv"), margin_s=60)
    run = _run(tmp_path, "run-a", deadline_in_s=600, gpus=(0, 1))
    run.name = "nightly-ranker"
    runs = {"run-a": run}

    _progress(run, 100, finish_in_s=500)  # 100 s to spare: on track
    assert view.risk_changes(view.snapshot(runs, NOW)) == []
    _progress(run, 200, finish_in_s=570)  # inside the one-minute margin
    ((change, job),) = view.risk_changes(view.snapshot(runs, NOW))
    assert change == "at-risk" and job.name == "nightly-ranker" and job.gpus == [0, 1]
    assert view.risk_changes(view.snapshot(runs, NOW)) == []  # told once, not every poll
    _progress(run, 400, finish_in_s=450)
    ((change, _),) = view.risk_changes(view.snapshot(runs, NOW))
    assert change == "recovered"


def test_a_short_run_on_its_plan_is_not_at_risk_until_it_loses_half_its_room(tmp_path: Path) -> None:
    """A two-minute run's plan ends 12 s before its deadline (start cost and
    safety margin): inside the one-minute margin by design, so the margin is
    half that room, 6 s, and at least a slot (5 s)."""
    view = ClusterView(load(ROOT / "infra" / "local-cpu2.csv"), margin_s=60, floor_s=5)
    run = _run(tmp_path, "urgent", deadline_in_s=120, gpus=(0,))
    run.plan_with(NOW + 108)  # what the policy plans it against
    runs = _named(run, "urgent")
    run.projected_finish = NOW + 108  # the plan's: on track, though within a minute of the deadline
    assert view.risk_changes(view.snapshot(runs, NOW)) == []
    assert "on track" in view.markdown(view.snapshot(runs, NOW), NOW)
    run.projected_finish = NOW + 115  # 5 s left of 12: at risk
    ((change, _),) = view.risk_changes(view.snapshot(runs, NOW))
    assert change == "at-risk"
    run.plan_with(NOW + 119)  # a plan keeping 1 s: the slot is the floor
    assert run.risk_margin(60, 5) == 5


def test_best_effort_and_waiting_runs_are_never_at_risk_and_the_policy_projects_before_training(
    tmp_path: Path,
) -> None:
    view = ClusterView(load(ROOT / "infra" / "local-cpu2.csv"), margin_s=60)
    patient = _run(tmp_path, "patient", deadline_in_s=None, gpus=(0,))
    waiting = _run(tmp_path, "waiting", deadline_in_s=30, gpus=())
    waiting.phase = "waiting"
    waiting.projected_finish = NOW + 900
    snapshot = view.snapshot({"patient": patient, "waiting": waiting}, NOW)
    assert view.risk_changes(snapshot) == []
    (job,) = [j for j in snapshot.jobs if j.flow_run_id == "waiting"]
    assert job.projected_finish == datetime.fromtimestamp(NOW + 900, timezone.utc)  # the plan's, no status yet


def test_the_artifact_is_rewritten_when_gpus_change_hands_and_progress_only_now_and_then(tmp_path: Path) -> None:
    view = ClusterView(load(ROOT / "infra" / "local-cpu2.csv"), margin_s=60)
    run = _run(tmp_path, "run-a", deadline_in_s=600, gpus=(0, 1))
    runs = {"run-a": run}
    _progress(run, 10, finish_in_s=300)
    first = view.snapshot(runs, NOW)
    assert view.due(first, NOW)
    text = view.markdown(first, NOW)
    assert "run-a"[:5] in text and "data:image/png;base64," in text  # the allocation plot, embedded
    _progress(run, 20, finish_in_s=300)
    assert not view.due(view.snapshot(runs, NOW + 5), NOW + 5)  # progress alone: wait
    assert view.due(view.snapshot(runs, NOW + REFRESH_S), NOW + REFRESH_S)
    run.held = (0,)  # shrunk: shown at once, and one more step in the plot
    assert view.due(view.snapshot(runs, NOW + REFRESH_S + 1), NOW + REFRESH_S + 1)
    assert [sample.gpus for sample in view.samples] == [{"run-a": 2}, {"run-a": 1}]


def test_a_finished_run_stays_listed_with_whether_it_met_its_deadline(tmp_path: Path) -> None:
    view = ClusterView(load(ROOT / "infra" / "local-cpu2.csv"), margin_s=60)
    run = _run(tmp_path, "run-a", deadline_in_s=600, gpus=(0, 1))
    _progress(run, 900, finish_in_s=30)
    view.snapshot(_named(run, "ranker"), NOW)
    _progress(run, 1000, finish_in_s=0)
    run.phase, run.held = "finished", ()
    snapshot = view.snapshot(_named(run, "ranker"), NOW + 40)
    (job,) = snapshot.jobs
    assert (job.status, job.iterations_done, job.gpus) == ("finished", 1000, [])
    assert "| met |" in view.markdown(snapshot, NOW + 40)
    assert view.risk_changes(snapshot) == []


def test_a_run_that_ended_before_its_last_iteration_is_shown_stopped_not_met(tmp_path: Path) -> None:
    view = ClusterView(load(ROOT / "infra" / "local-cpu2.csv"), margin_s=60)
    run = _run(tmp_path, "run-a", deadline_in_s=600, gpus=(0, 1))
    _progress(run, 300, finish_in_s=200)
    view.snapshot(_named(run, "ranker"), NOW)
    run.phase, run.held = "finished", ()  # cancelled at iteration 300 of 1000
    snapshot = view.snapshot(_named(run, "ranker"), NOW + 10)
    (job,) = snapshot.jobs
    assert (job.status, job.iterations_done) == ("stopped", 300)
    text = view.markdown(snapshot, NOW + 10)
    assert "| stopped |" in text and "met" not in text.split("## Jobs")[1].split("_MSS")[0]


def test_after_a_restart_the_plot_starts_from_the_stored_allocations(tmp_path: Path) -> None:
    view = ClusterView(load(ROOT / "infra" / "local-cpu2.csv"), margin_s=60)
    at = datetime.fromtimestamp(NOW, timezone.utc)
    view.restore([(at, "ranker", 2), (at.replace(minute=5), "ranker", 1), (at.replace(minute=5), "urgent", 1)],
                 {"ranker": at.replace(hour=6)})
    assert [s.gpus for s in view.samples] == [{"ranker": 2}, {"ranker": 1, "urgent": 1}]
    run = _run(tmp_path, "run-a", deadline_in_s=600, gpus=(0, 1))
    snapshot = view.snapshot(_named(run, "ranker"), NOW + 400)
    assert view.due(snapshot, NOW + 400)  # the allocation now differs from the last stored one
    assert len(view.samples) == 3 and "data:image/png;base64," in view.markdown(snapshot, NOW + 400)


def test_a_noisy_rate_raises_no_flapping_alerts(tmp_path: Path) -> None:
    """15 minutes of polls of a run that trains steadily on a noisy machine: its
    own 20-iteration projection swings by minutes either side of the deadline,
    the view's (the plan, then a rate over two minutes, with hysteresis) does not."""
    import random

    view = ClusterView(load(ROOT / "infra" / "local-cpu2.csv"), margin_s=60)
    run = _run(tmp_path, "run-a", deadline_in_s=1200, gpus=(0, 1))  # 1000 iterations at ~1 it/s: 200 s to spare
    run.projected_finish = NOW + 1000  # the plan's
    rng = random.Random(7)
    events = []
    for second in range(0, 900):
        now = NOW + second
        iteration = int(second * 1.0)
        noisy = NOW + second + (1000 - iteration) * rng.uniform(0.6, 1.8)  # the flow's own, swinging
        run.channel.publish_status({"iteration": iteration,
                                    "projected_finish": datetime.fromtimestamp(noisy, timezone.utc).isoformat()})
        events += view.risk_changes(view.snapshot({"run-a": run}, now))
    assert events == []
