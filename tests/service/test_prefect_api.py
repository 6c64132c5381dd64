"""The private Prefect worker methods the service relies on are still there,
with the signatures it calls: an upgrade that changes them fails here, loudly."""

from scheduler_service.worker import prefect_api


def test_the_private_worker_api_is_as_pinned() -> None:
    assert prefect_api.check() == []
