"""Teams end to end: two work queues of the `gpus` pool, one slot's share
each on a 2-slot machine; a team's run borrows the other's idle slot and
gives it back when that team's own run arrives."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from tests.scenarios import ack_gpus, cluster_artifact_data
from tests.service.conftest import POOL, Stack

pytestmark = pytest.mark.slow


def _submit(queue: str, in_s: float, **parameters: Any) -> str:
    from prefect.deployments import run_deployment

    deadline = (datetime.now(timezone.utc) + timedelta(seconds=in_s)).isoformat()
    flow_run = run_deployment("train/mlp", parameters={**parameters, "deadline": deadline}, timeout=0,
                              work_queue_name=queue)
    return str(flow_run.id)  # type: ignore[union-attr]


def _teams_shown() -> bool:
    view = cluster_artifact_data()
    return "## Teams" in view and "| speech |" in view


def test_a_borrowed_slot_is_given_back_when_its_team_needs_it_and_both_meet_their_deadlines(
        stack: Stack, tmp_path: Path) -> None:
    from elasticflow_block.prefect_client import sync_client

    with sync_client() as client:
        for queue in ("vision", "speech"):
            try:
                client.create_work_queue(name=queue, work_pool_name=POOL)
            except Exception:  # made by an earlier test of this session
                pass
    teams = tmp_path / "teams.yaml"
    teams.write_text("teams:\n  - name: vision\n    share: 1\n  - name: speech\n    share: 1\n")
    with stack.worker_through(stack.api_url, tmp_path / "worker-teams.log", ELASTICFLOW_TEAMS=str(teams)):
        loose = _submit("speech", 600, iterations=5000, checkpoint_interval=500)
        stack.wait_until(lambda: ack_gpus(stack, loose) == [0, 1], 150, "speech's run on both slots")
        # 50 s of work on one slot, due in 40 s: the two slots could (28 s), speech's share of one cannot.
        refused = _submit("speech", 40, iterations=20 * 50)
        refused_run = stack.wait_final(refused, 60)
        assert refused_run.state.name == "Rejected", refused_run.state
        assert "gpus_reserved_by_admitted_jobs: team speech (1 guaranteed GPUs): even its whole share cannot" in (
            refused_run.state.message or "")
        # Vision's run needs its slot now: speech gives it back at the next slot.
        urgent = _submit("vision", 70, iterations=20 * 40, checkpoint_interval=500)
        stack.wait_until(lambda: ack_gpus(stack, loose) in ([0], [1]), 60, "speech's run to give the slot back")
        urgent_run = stack.wait_final(urgent, 180)
        assert urgent_run.state.is_completed(), urgent_run.state
        loose_run = stack.wait_final(loose, 420)
        assert loose_run.state.is_completed(), loose_run.state
        for run in (urgent_run, loose_run):
            assert run.labels.get("elasticflow.admission") == "admitted"
            assert run.end_time is not None
            assert run.end_time <= datetime.fromisoformat(run.parameters["deadline"]), run.name
        (decision,) = stack.events(urgent, "elasticflow.decision")
        teams_named = [r for r in decision["related"] if r.get("prefect.resource.role") == "team"]
        assert [r["prefect.resource.name"] for r in teams_named] == ["vision"]  # filterable by team in the UI
        assert stack.wait_until(_teams_shown, 30, "the teams in the cluster view")
        stranger = _submit("default", 600, iterations=100)
        stranger_run = stack.wait_final(stranger, 60)
        assert stranger_run.state.name == "Rejected" and "unknown_team" in (stranger_run.state.message or "")
