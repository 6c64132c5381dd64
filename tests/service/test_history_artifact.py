"""A run shows one allocation history, even when Prefect's client retries
the create of it: the server made the first, its answer was lost, and the
retry made a second."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from scheduler_service.worker.channels import FileControlChannel
from scheduler_service.worker.publish import HISTORY_DESCRIPTION, Publisher
from scheduler_service.worker.registry import ServiceRun
from tests.slowproxy import slow_server


async def _histories(run_id: str) -> list[str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    async with get_client() as client:
        artifacts = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    return [str(a.data) for a in artifacts if a.description == HISTORY_DESCRIPTION]


async def _flow_run() -> str:
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow(name="history-artifact")
    def nothing() -> None:
        pass

    async with get_client() as client:
        return str((await client.create_flow_run(nothing)).id)


def test_a_retried_create_leaves_one_history_with_every_row(prefect_api: str, tmp_path: Path) -> None:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    run_id = asyncio.run(_flow_run())
    run = ServiceRun(run_id, "r", FileControlChannel(run_id, str(tmp_path)), None, model="mlp", iterations=10)

    async def publish() -> None:
        # seed 132: the first write (the create) is made and its answer lost, no other
        with slow_server(prefect_api, 0.0, seed=132, lost=0.5) as lossy, temporary_settings({PREFECT_API_URL: lossy}):
            async with get_client() as client:
                publisher = Publisher(client, related=lambda: [])
                for action in ("admitted", "launch", "release"):
                    run.record(action, "0", 0, "-")
                    await publisher.history(run, ["header"])

    asyncio.run(publish())
    (history,) = asyncio.run(_histories(run_id))
    assert all(f"| {action} |" in history for action in ("admitted", "launch", "release")), history


def test_a_rejection_prefect_refused_is_written_again_until_it_lands(
        prefect_api: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefect's client gives up after its own retries (a server answering 503
    to a quarter of the writes did, in the slow-server burst test): the
    Rejected state is written again, not dropped, or the run stays Scheduled
    ("Late") for ever and its user is never told."""
    from uuid import UUID

    from prefect.client.orchestration import get_client

    from scheduler_service.contracts import Rejection, RejectionReason
    from scheduler_service.worker import publish

    monkeypatch.setattr(publish, "REJECTED_AGAIN_S", (0.1, 0.1, 0.1))
    rejection = Rejection(reason=RejectionReason.INSUFFICIENT_CAPACITY, message="the GPUs are reserved")

    class Refusing:
        """Prefect's client, but its first two state writes fail as they do once its retries are spent."""

        def __init__(self, client: object) -> None:
            self.client, self.refused = client, 0

        async def set_flow_run_state(self, *args: object, **kwargs: object) -> object:
            if self.refused < 2:
                self.refused += 1
                raise RuntimeError("503 Service Unavailable")
            return await self.client.set_flow_run_state(*args, **kwargs)  # type: ignore[attr-defined]

    async def reject() -> tuple[object, int]:
        run_id = await _flow_run()
        async with get_client() as client:
            refusing = Refusing(client)
            await Publisher(refusing, lambda: []).rejected(run_id, rejection)
            return (await client.read_flow_run(UUID(run_id))).state, refusing.refused

    state, refused = asyncio.run(reject())
    assert refused == 2 and state.name == "Rejected", state  # type: ignore[attr-defined]
