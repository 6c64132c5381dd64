"""A launch waits for its run's states and decision labels, never for its
placement labels or history rows: on a slow server those held a burst's
launches 7-10 s, which their deadlines paid (scheduler_service/worker/lanes.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from scheduler_service.contracts import Label
from scheduler_service.loop.actions import Admitted, Launch
from scheduler_service.store.db import get_engine
from scheduler_service.worker.channels import FileControlChannel
from scheduler_service.worker.registry import ServiceRun
from scheduler_service.worker.reporting import Reporter
from scheduler_service.worker.store import ServiceStore
from tests.service.offline import RecordingPublisher


class HungDetails(RecordingPublisher):
    """Prefect answers states and a decision's labels at once, and hangs on
    placement labels and artifacts."""

    def __init__(self) -> None:
        super().__init__()
        self.answer = anyio.Event()
        self.details_done = 0

    async def labels(self, run_id: str, labels: dict[Label, Any]) -> None:
        if Label.GPUS in labels:
            await self.answer.wait()
            self.details_done += 1

    async def history(self, run: Any, *args: Any, **kwargs: Any) -> None:
        await self.answer.wait()
        self.details_done += 1


def test_a_launch_waits_for_its_admitted_state_and_not_for_its_placement_labels_or_history(tmp_path: Path) -> None:
    store = ServiceStore(get_engine(f"sqlite:///{tmp_path / 'elasticflow.db'}"))
    publisher = HungDetails()
    run = ServiceRun("r1", "burst-1", FileControlChannel("r1", str(tmp_path / "control")), deadline=None,
                     response=object())
    admitted = Admitted("r1", guaranteed=True, share=1, message="admitted", guaranteed_finish=100.0, gpus_now=1,
                        decision_s=0.001)

    async def main() -> tuple[list[str], float, int]:
        async with anyio.create_task_group() as group:
            reporter = Reporter(store=store, publisher=publisher, logger_for=lambda flow_run: None,
                                task_group=lambda: group, concurrency=4)
            await reporter.admitted(run, admitted, None, now=0.0)
            await reporter.allocation(run, Launch("r1", 1, (0,)), None, ["localhost"], False, now=0.0)
            await anyio.sleep(0.1)  # the writes begin; Prefect's launch comes after the poll
            started = anyio.current_time()
            with anyio.fail_after(5):
                async with reporter.lanes.of("r1"):  # what the launch's Pending proposal takes
                    waited = anyio.current_time() - started
                    states = list(publisher.named.get("r1", []))
            details_before = publisher.details_done
            publisher.answer.set()
            assert await reporter.drain(timeout_s=5.0)
        return states, waited, details_before

    states, waited, details_before = anyio.run(main)
    assert states == ["Admitted"]  # its state went first ...
    assert details_before == 0 and waited < 1.0  # ... and the launch did not wait for the rest
    assert publisher.details_done == 3  # the history rows of the admission and the launch, its GPUs, in the end
