"""A graceful stop lets what already happened reach Prefect, for a bounded
time, even while it is being cancelled: the store is written first, and what
is still untold after that is the next start's to settle."""

from __future__ import annotations

import anyio

from scheduler_service.worker.reporting import Reporter
from tests.service.offline import RecordingPublisher


def test_a_stop_waits_for_writes_under_way_but_not_for_ever() -> None:
    told: list[str] = []

    async def tell(what: str, seconds: float) -> None:
        await anyio.sleep(seconds)
        told.append(what)

    async def main() -> tuple[bool, bool]:
        whole = False
        async with anyio.create_task_group() as group:  # the worker's runs task group: it ends after teardown
            reporter = Reporter(store=None, publisher=RecordingPublisher(), logger_for=lambda run: None,  # type: ignore[arg-type]
                                task_group=lambda: group, concurrency=4)
            with anyio.CancelScope() as stopping:
                await reporter.in_background(tell, "admitted", 0.3, lane="a")
                await reporter.in_background(tell, "launched", 0.1, lane="a")  # after the first, in its lane
                stopping.cancel()  # SIGINT: the poll is cancelled ...
                try:
                    await anyio.sleep(10)
                finally:  # ... and teardown drains, shielded from that cancellation
                    whole = await reporter.drain(timeout_s=5.0)
        async with anyio.create_task_group() as group:
            reporter = Reporter(store=None, publisher=RecordingPublisher(), logger_for=lambda run: None,  # type: ignore[arg-type]
                                task_group=lambda: group, concurrency=4)
            await reporter.in_background(tell, "stuck", 30.0, lane="b")
            started = anyio.current_time()
            cut = await reporter.drain(timeout_s=0.3)
            assert anyio.current_time() - started < 2.0
            group.cancel_scope.cancel()
        return whole, cut

    whole, cut = anyio.run(main)
    assert (whole, cut) == (True, False)
    assert told == ["admitted", "launched"]
