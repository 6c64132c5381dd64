"""A story through the service that more than one test reads: played once,
what was seen along the way kept for each test to assert on. The UI test
reads the shrunk run's page, the service test its records; played twice it
was a minute and a half of the suite twice."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tests.stack import Stack, state_names


def ack_gpus(stack: Stack, run_id: str) -> list[int] | None:
    path = stack.home / "control" / run_id / "ack.json"
    return json.loads(path.read_text())["gpus"] if path.exists() else None


def allocations(stack: Stack, run_id: str) -> list[tuple[str, str]]:
    from sqlmodel import Session, select

    from scheduler_service.store.db import get_engine
    from scheduler_service.worker.store import AllocationRecord

    with Session(get_engine(f"sqlite:///{stack.home / 'elasticflow.db'}")) as session:
        rows = session.exec(select(AllocationRecord).where(AllocationRecord.flow_run_id == run_id)
                            .order_by(AllocationRecord.id)).all()
    return [(r.action, r.gpus) for r in rows]


def cluster_artifact_data() -> str:
    """The service's cluster-wide view: one keyed artifact, updated in place ("" before its first publish)."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from elasticflow_block.prefect_client import sync_client

    with sync_client() as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["elasticflow-cluster"])))
    return str(found[0].data) if found else ""


@dataclass
class Shrink:
    """What `shrink_for_an_urgent_run` saw."""

    first: str  # the long run: alone on both slots, then shrunk in place, then cancelled
    first_gpus_alone: list[int] | None
    first_allocations_alone: list[tuple[str, str]]
    first_labels: dict[str, Any]
    decision_events: list[dict[str, Any]]
    malformed_state: Any  # the final state of an arrival with iterations=0, submitted while the first trained
    shrunk_to: list[int] | None
    urgent_state: Any
    urgent_allocations: list[tuple[str, str]]
    first_allocations: list[tuple[str, str]]  # once it ended
    first_final_state: Any
    history: str  # the first run's allocation-history artifact, once its release is in
    cluster: str  # the cluster view then
    first_name: str
    first_state_names: list[str]


def shrink_for_an_urgent_run(stack: Stack) -> Shrink:
    """One flow run alone gets both slots; a malformed arrival is rejected
    without touching it; a deadline run that must start now takes one of its
    slots (the first shrinks in place, inside the same flow run) and
    completes; the first trains on, and is cancelled rather than trained to
    its end.

    The first cannot end before the urgent one's deadline however fast this
    machine trains (CI's trained 20,000 iterations in 80 s, and the
    cancellation landed on a run that had just completed), so the urgent one
    cannot wait for it: 200,000 iterations are 10,000 s at the profiled rate,
    due in twelve hours. The urgent one, 34 s of work at the profiled rate, is
    due in 120 s: room for a start and for training at half the profile (a
    loaded machine trains slower than it, and the loop learns so)."""
    stack.wait_idle()  # alone: the run before this one may still hold a slot while its process ends
    first = stack.submit(iterations=200_000, deadline="+12h", checkpoint_interval=500)
    status = stack.home / "control" / first / "status.json"

    def iteration() -> int:
        return json.loads(status.read_text()).get("iteration", 0) if status.exists() else 0

    try:
        stack.wait_until(iteration, 150, "the first run to train")
        gpus_alone, allocations_alone = ack_gpus(stack, first), allocations(stack, first)
        labels = dict(stack.flow_run(first).labels)
        decisions = stack.events(first, "elasticflow.decision")
        malformed = stack.submit(iterations=0, deadline="+10m")
        urgent = stack.submit(iterations=20 * 34, deadline="+120s", checkpoint_interval=500)
        malformed_state = stack.wait_final(malformed, 60).state
        # A resize in place on a machine loaded far past its cores once took 71 s from the decision.
        shrunk = stack.wait_until(lambda: ack_gpus(stack, first) in ([0], [1]), 150, "the first run to shrink")
        at_shrink = iteration()
        urgent_state = stack.wait_final(urgent, 240).state
        stack.wait_until(lambda: iteration() > at_shrink, 60, "the first run to train on after its shrink")
        stack.cancel(first)
        first_final = stack.wait_final(first, 120).state
        # The release is recorded when the flow process has exited, a moment after its run ends.
        history = stack.wait_until(lambda: (h := stack.allocation_artifact(first)) and "| release |" in h and h, 30,
                                   "the release in the allocation history")
        return Shrink(first, gpus_alone, allocations_alone, labels, decisions, malformed_state, shrunk, urgent_state,
                      allocations(stack, urgent), allocations(stack, first), first_final,
                      history, cluster_artifact_data(), stack.flow_run(first).name, state_names(first))
    finally:  # never left training for what comes after
        if not stack.flow_run(first).state.is_final():
            stack.cancel(first)
