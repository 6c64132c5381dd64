"""The service's cluster view: what it shows of the control loop's runs, and
when it rewrites the artifact (whether a deadline is at risk is the loop's
to say: tests/loop/test_risk.py)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from scheduler_service.contracts import Outcome, RunPhase
from scheduler_service.loop.run import RunFacts
from scheduler_service.worker.cluster import load
from scheduler_service.worker.cluster_view import REFRESH_S, ClusterView
from scheduler_service.worker.plot import legend_names

ROOT = Path(__file__).resolve().parents[2]
NOW = datetime(2026, 12, 1, 5, 0, tzinfo=timezone.utc).timestamp()


def _view() -> ClusterView:
    return ClusterView(load(ROOT / "infra" / "local-cpu2.csv"), margin_s=60)


def _run(run_id: str, deadline_in_s: float | None, gpus: tuple[int, ...], iteration: int = 0,
         finish_in_s: float | None = None, phase: RunPhase = RunPhase.RUNNING) -> RunFacts:
    deadline = None if deadline_in_s is None else NOW + deadline_in_s
    return RunFacts(run_id, phase, "mlp", gpus, iteration, 1000.0, deadline, deadline, 1,
                   None if finish_in_s is None else NOW + finish_in_s, 60.0)


def test_a_waiting_run_shows_the_plans_projection_and_its_phase() -> None:
    view = _view()
    waiting = _run("waiting", deadline_in_s=30, gpus=(), finish_in_s=900, phase=RunPhase.ADMITTED)
    (job,) = view.snapshot([waiting], {"waiting": "ranker"}, NOW).jobs
    assert job.name == "ranker" and job.status == "admitted-waiting"
    assert job.projected_finish == datetime.fromtimestamp(NOW + 900, timezone.utc)


def test_the_artifact_is_rewritten_when_gpus_change_hands_and_progress_only_now_and_then() -> None:
    view = _view()
    run = _run("run-a", deadline_in_s=600, gpus=(0, 1), iteration=10, finish_in_s=300)
    first = view.snapshot([run], {}, NOW)
    assert view.due(first, NOW)
    text = view.markdown(first, NOW)
    assert "run-a"[:5] in text and "data:image/png;base64," in text  # the allocation plot, embedded
    run = replace(run, iteration=20)
    assert not view.due(view.snapshot([run], {}, NOW + 5), NOW + 5)  # progress alone: wait
    assert view.due(view.snapshot([run], {}, NOW + REFRESH_S), NOW + REFRESH_S)
    run = replace(run, held=(0,))  # shrunk: shown at once, and one more step in the plot
    assert view.due(view.snapshot([run], {}, NOW + REFRESH_S + 1), NOW + REFRESH_S + 1)
    assert [sample.gpus for sample in view.samples] == [{"run-a": 2}, {"run-a": 1}]


def test_a_finished_run_stays_listed_with_whether_it_met_its_deadline() -> None:
    view = _view()
    view.snapshot([_run("run-a", deadline_in_s=600, gpus=(0, 1), iteration=900, finish_in_s=30)], {"run-a": "ranker"},
                  NOW)
    view.ended("run-a", 1000, Outcome.MET)  # how it ended, from its final state
    snapshot = view.snapshot([], {}, NOW + 40)
    (job,) = snapshot.jobs
    assert (job.status, job.iterations_done, job.gpus, job.name) == ("finished", 1000, [], "ranker")
    assert "| met |" in view.markdown(snapshot, NOW + 40)


def test_a_run_that_ended_before_its_last_iteration_is_shown_stopped_not_met() -> None:
    view = _view()
    view.snapshot([_run("run-a", deadline_in_s=600, gpus=(0, 1), iteration=300, finish_in_s=200)], {}, NOW)
    view.ended("run-a", 300, Outcome.CANCELLED)  # cancelled at iteration 300 of 1000
    snapshot = view.snapshot([], {}, NOW + 10)
    (job,) = snapshot.jobs
    assert (job.status, job.iterations_done) == ("cancelled", 300)
    text = view.markdown(snapshot, NOW + 10)
    assert "| cancelled |" in text and "met" not in text.split("## Jobs")[1].split("_MSS")[0]


def test_a_run_that_failed_at_its_last_iteration_is_shown_failed_not_met() -> None:
    """Its status file reached the last iteration, but its final save failed
    and the run ended Failed: the outcome is its final state's."""
    view = _view()
    view.snapshot([_run("run-a", deadline_in_s=600, gpus=(0, 1), iteration=999, finish_in_s=5)], {}, NOW)
    view.ended("run-a", 1000, Outcome.FAILED)
    (job,) = view.snapshot([], {}, NOW + 10).jobs
    assert job.status == "failed" and "| met |" not in view.markdown(view.snapshot([], {}, NOW + 10), NOW + 10)


def test_after_a_restart_the_plot_starts_from_the_stored_allocations() -> None:
    view = _view()
    at = datetime.fromtimestamp(NOW, timezone.utc)
    view.restore([(at, "run-a", "ranker", 2), (at.replace(minute=5), "run-a", "ranker", 1),
                  (at.replace(minute=5), "run-b", "urgent", 1)], {"run-a": at.replace(hour=6)})
    assert [s.gpus for s in view.samples] == [{"run-a": 2}, {"run-a": 1, "run-b": 1}]
    snapshot = view.snapshot([_run("run-a", deadline_in_s=600, gpus=(0, 1))], {"run-a": "ranker"}, NOW + 400)
    assert view.due(snapshot, NOW + 400)  # the allocation now differs from the last stored one
    assert len(view.samples) == 3 and "data:image/png;base64," in view.markdown(snapshot, NOW + 400)


def test_two_runs_of_one_name_are_two_runs_in_the_plot() -> None:
    view = _view()
    twins = [_run("aaaaaaaa-1", deadline_in_s=600, gpus=(0,)), _run("bbbbbbbb-2", deadline_in_s=900, gpus=(1,))]
    view.due(view.snapshot(twins, {"aaaaaaaa-1": "nightly", "bbbbbbbb-2": "nightly"}, NOW), NOW)
    assert view.samples[-1].gpus == {"aaaaaaaa-1": 1, "bbbbbbbb-2": 1}  # not one "nightly" with 1 GPU
    assert set(view.deadlines) == {"aaaaaaaa-1", "bbbbbbbb-2"}
    assert legend_names(["aaaaaaaa-1", "bbbbbbbb-2"], view.names) == ["nightly (aaaaaaaa)", "nightly (bbbbbbbb)"]


def test_a_name_with_pipes_and_control_characters_stays_in_its_cell() -> None:
    view = _view()
    snapshot = view.snapshot([_run("run-a", deadline_in_s=600, gpus=(0,))], {"run-a": "a|b\n\x1b[31mFAKE"}, NOW)
    text = view.markdown(snapshot, NOW)
    assert "\x1b" not in text and "a\\|b \\x1b[31mFAKE" in text
    row = next(line for line in text.splitlines() if "FAKE" in line and line.startswith("|"))
    assert row.count(" | ") == next(line for line in text.splitlines() if line.startswith("| ")).count(" | ")


def test_the_key_page_is_told_the_view_in_one_line_and_where_the_whole_of_it_is() -> None:
    """Prefect's page for an artifact key shows its description and its
    versions, not its data: it showed "ElasticFlow cluster" and one version
    id (issue 46). The description now carries the summary and a link."""
    import asyncio
    from types import SimpleNamespace

    from scheduler_service.worker.render import cluster_summary

    class Client:
        def __init__(self) -> None:
            self.updates: list[object] = []

        async def read_artifacts(self, **_: object) -> list[object]:
            return []

        async def create_artifact(self, artifact: object) -> object:
            return SimpleNamespace(id="a1b2c3d4")

        async def update_artifact(self, artifact_id: object, update: object) -> None:
            self.updates.append(update)

    view, client = _view(), Client()
    snapshot = view.snapshot([_run("run-a", deadline_in_s=600, gpus=(0, 1), finish_in_s=300)], {}, NOW)
    asyncio.run(view.publish(client, view.markdown(snapshot, NOW), cluster_summary(snapshot)))
    (update,) = client.updates
    assert "2/2 GPUs busy" in update.description and "1 job" in update.description  # type: ignore[attr-defined]
    assert "(/artifacts/artifact/a1b2c3d4)" in update.description  # type: ignore[attr-defined]
