"""How a run ended is told from what it really did: the loop's last progress
may be older than rank 0's last status (found by bench/chaos.py --ray: a run
that finished while no worker watched was recorded `stopped` at iteration 0
while Prefect said Completed)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from flows.training.control import FileControlChannel
from scheduler_service.contracts import Outcome, outcome_of
from scheduler_service.loop.actions import GpusFreed
from scheduler_service.worker.execute import Executor
from scheduler_service.worker.registry import ServiceRun


class _Watch:
    async def final_state(self, run_id: str) -> tuple[str, None]:
        return "COMPLETED", None


class _Reporter:
    def __init__(self) -> None:
        self.told: list[Outcome] = []

    def ended(self, run: ServiceRun, release: GpusFreed, state: str | None, why: str | None, now: float) -> Outcome:
        outcome = outcome_of(state, release.iteration, release.iterations, run.deadline, now)
        self.told.append(outcome)
        return outcome


class _View:
    def ended(self, run_id: str, iteration: int, outcome: Outcome) -> None:
        pass


def test_a_run_that_finished_unseen_ends_with_the_iterations_its_rank_reported(tmp_path: Path) -> None:
    channel = FileControlChannel("r1", tmp_path)
    channel.publish_status({"iteration": 224, "total_iterations": 224})
    run = ServiceRun("r1", "calm-otter", channel, 2_000.0, model="mlp", iterations=224, taken_in_at=0.0)
    reporter = _Reporter()
    executor = Executor(None, None, reporter, lambda: None, _Watch(), _View(), lambda: 1_000.0, None)  # type: ignore[arg-type]
    asyncio.run(executor._tell_how_it_ended(run, GpusFreed("r1", True, iteration=0, iterations=224)))
    assert reporter.told == [Outcome.MET]
