"""Issue 46: a refusal spoke policy ("even the whole cluster at 1 GPUs cannot
finish 19963633 iterations in time (usable GPU counts at global batch 512:
1; ...); earliest feasible deadline 2026-12-06T06:12:11.887849+00:00"). It
now leads with one sentence a data scientist acts on, to the second, and the
policy's detail follows; programs still read the reason and the deadline."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import pytest

from scheduler_service.contracts import DETAIL, Rejection, RejectionReason

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=timezone.utc).timestamp()
POLICY = ("even alone, on 8 GPUs (the most it can use of 8), it cannot finish 19963633 iterations in time "
          "(usable GPU counts at global batch 512: 1, 2, 4, 8)")


def test_a_run_too_long_for_the_whole_cluster_is_told_what_it_needs_and_what_would_be_guaranteed() -> None:
    rejection = Rejection.of(RejectionReason.INFEASIBLE_ALONE, POLICY, NOW + 3 * 3600 + 600 + 0.887849,
                             deadline=NOW + 3600, now=NOW)
    text = rejection.state_message()
    first, detail = text.split(DETAIL, 1)
    assert first == ("This run needs about 3h10m even with every GPU it can use, and its deadline is in 1h00m. "
                     "The earliest deadline that can be guaranteed now is 2026-12-06 15:10:01 UTC.")
    assert detail.startswith("infeasible_even_on_an_idle_cluster: even alone, on 8 GPUs")
    assert "RejectionReason." not in text and ".887849" not in text  # no enum repr, no microseconds
    # Rounded up, not down: the deadline told stays feasible.
    assert rejection.earliest_feasible_deadline == datetime(2026, 12, 6, 15, 10, 1, tzinfo=timezone.utc)
    again = Rejection.from_state_message(text)
    assert again.reason is RejectionReason.INFEASIBLE_ALONE
    assert again.earliest_feasible_deadline == rejection.earliest_feasible_deadline


def test_a_run_the_admitted_ones_leave_no_room_for_is_told_so_in_words() -> None:
    text = Rejection.of(RejectionReason.INSUFFICIENT_CAPACITY, "the GPUs it would need before its deadline are "
                        "reserved by 6 admitted jobs", NOW + 1800, deadline=NOW + 600, now=NOW).state_message()
    assert text.startswith("The GPUs this run needs before its deadline are promised to runs admitted earlier, "
                           "and its deadline is in 10m00s. The earliest deadline that can be guaranteed now is "
                           "2026-12-06 12:30:00 UTC." + DETAIL + "gpus_reserved_by_admitted_jobs: ")


def test_a_passed_deadline_and_a_too_distant_one_are_said_plainly() -> None:
    passed = Rejection.of(RejectionReason.DEADLINE_PASSED, "the deadline has already passed", NOW + 120,
                          deadline=NOW - 60, now=NOW).state_message()
    assert passed.startswith("Its deadline (2026-12-06 11:59:00 UTC) had already passed when it was decided.")
    never = Rejection.of(RejectionReason.INFEASIBLE_ALONE, POLICY, 1e15, deadline=NOW + 60, now=NOW)
    assert never.beyond_any_date and "No deadline can be guaranteed" in never.state_message()


def test_a_refusal_whose_detail_is_already_plain_has_no_sentence_before_it() -> None:
    typo = Rejection.of(RejectionReason.INVALID_PARAMETERS, "iterations: must be >= 1", None, now=NOW)
    assert typo.state_message() == "invalid_parameters: iterations: must be >= 1"


def test_status_leads_a_refused_run_with_the_same_sentence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sqlmodel import create_engine

    from scheduler_service.contracts import RunPhase
    from scheduler_service.readmodel import report
    from scheduler_service.worker.store import DecisionRecord, ServiceStore

    monkeypatch.delenv("ELASTICFLOW_DATABASE_URL", raising=False)
    store = ServiceStore(create_engine(f"sqlite:///{tmp_path / 'elasticflow.db'}"))
    rejection = Rejection.of(RejectionReason.INFEASIBLE_ALONE, POLICY, NOW + 3 * 3600 + 600, NOW + 3600, NOW)
    store.upsert_job("r1", RunPhase.ARRIVED, flow_run_name="big-one", model="resnet50", global_batch_size=512,
                     iterations=19963633, deadline=datetime.fromtimestamp(NOW + 3600, timezone.utc))
    store.decided(DecisionRecord(flow_run_id="r1", admitted=False, reason=rejection.reason.value,
                                 message=rejection.message, at=datetime.fromtimestamp(NOW, timezone.utc),
                                 earliest_feasible_deadline=rejection.earliest_feasible_deadline),
                  RunPhase.REJECTED, message=rejection.state_message())
    (view,) = report(tmp_path).runs
    assert view.summary == rejection.summary and view.summary.startswith("This run needs about 3h10m")
