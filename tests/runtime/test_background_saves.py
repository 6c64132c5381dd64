"""Periodic checkpoints off the training loop's path (issue 26, saving.py):
the loop hands over a copy and goes on; what lands on disk is the state of
the iteration it was taken at; a failure is counted as a synchronous one is."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import torch

from elasticflow_block.storage import CheckpointInfo, CheckpointStorage
from flows.training.rank.saving import Saves, cpu_copy


class SlowStorage(CheckpointStorage):
    """A real local store whose saves wait until let go."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.go = threading.Event()

    def save(self, run_key: str, iteration: int, state: dict) -> CheckpointInfo:  # type: ignore[override]
        assert self.go.wait(30)
        return super().save(run_key, iteration, state)


def test_a_background_save_returns_at_once_and_keeps_the_state_it_was_handed(tmp_path: Path) -> None:
    storage = SlowStorage(str(tmp_path / "ck"))
    saves, done = Saves(storage, "run"), []
    weights = torch.ones(4)
    start = time.perf_counter()
    saves.save_later(10, cpu_copy({"model": {"w": weights}, "iteration": 10}), done.append)
    handed_s = time.perf_counter() - start
    weights.add_(1.0)  # the next optimizer step, in place
    assert done == [] and handed_s < 1.0
    storage.go.set()
    saves.join()
    assert [info.iteration for info in done] == [10]
    state, info = storage.load_latest("run")
    assert info.iteration == 10 and torch.equal(state["model"]["w"], torch.ones(4))


def test_a_background_save_the_store_refuses_counts_as_a_failure(tmp_path: Path) -> None:
    blocked = tmp_path / "ck"
    blocked.write_text("not a folder")
    saves, done = Saves(CheckpointStorage(str(blocked)), "run"), []
    for iteration in (10, 20, 30):
        saves.save_later(iteration, {"iteration": iteration}, done.append)
    saves.join()
    assert done == [] and saves.failures == 3 and saves.exhausted
    assert saves.error is not None and str(blocked) in saves.error


def test_a_copy_for_the_background_shares_no_tensor_with_the_loop() -> None:
    state = {"model": {"w": torch.zeros(2)}, "optimizer": {"state": {0: {"momentum_buffer": torch.zeros(2)}}},
             "rng": (torch.zeros(1, dtype=torch.uint8), 3), "history": [1.0]}
    copied = cpu_copy(state)
    state["model"]["w"].add_(1)
    state["optimizer"]["state"][0]["momentum_buffer"].add_(1)
    assert copied["model"]["w"].sum() == 0 and copied["optimizer"]["state"][0]["momentum_buffer"].sum() == 0
    assert copied["rng"][1] == 3 and isinstance(copied["rng"], tuple)
