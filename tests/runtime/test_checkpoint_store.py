import logging
from pathlib import Path

import pytest
import torch

from elasticflow_block import CheckpointCorrupt, CheckpointStorage, CheckpointStore


def _state(value: float) -> dict:
    return {"weights": torch.full((64,), value), "iteration": int(value)}


def test_save_load_and_prune(tmp_path: Path) -> None:
    store = CheckpointStorage(str(tmp_path), keep=2)
    for it in (5, 10, 15):
        store.save("run-a", it, _state(it))
    assert store.iterations("run-a") == [10, 15]
    state, info = store.load_latest("run-a")
    assert info.iteration == 15 and torch.equal(state["weights"], torch.full((64,), 15.0))
    assert store.load_latest("run-b") is None  # keyed by run: nothing leaks across runs
    assert not list(tmp_path.glob("run-a/*.tmp-*"))  # no temp files left behind


def test_corrupt_latest_falls_back_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = CheckpointStorage(str(tmp_path), keep=3)
    store.save("run", 4, _state(4))
    info = store.save("run", 8, _state(8))
    data = bytearray(Path(info.path).read_bytes())
    data[len(data) // 2] ^= 0xFF
    Path(info.path).write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt):
        store.load("run", 8)
    with caplog.at_level(logging.WARNING, logger="elasticflow.checkpoint"):
        state, loaded = store.load_latest("run")
    assert loaded.iteration == 4 and state["iteration"] == 4
    assert any("falling back" in r.getMessage() and "iteration=8" in r.getMessage() for r in caplog.records)


def test_truncated_or_digestless_checkpoints_are_not_used(tmp_path: Path) -> None:
    store = CheckpointStorage(str(tmp_path), keep=3)
    store.save("run", 1, _state(1))
    info = store.save("run", 2, _state(2))
    Path(info.path).write_bytes(Path(info.path).read_bytes()[:100])  # torn write
    (tmp_path / "run" / "ckpt-0000000003.pt").write_bytes(b"partial")  # no digest: never completed
    assert store.iterations("run") == [1, 2]
    assert store.load_latest("run")[1].iteration == 1


def test_any_fsspec_url_works() -> None:
    store = CheckpointStorage("memory://elasticflow-test", keep=1)
    store.save("run", 1, _state(1))
    store.save("run", 2, _state(2))
    assert store.iterations("run") == [2]
    assert store.load_latest("run")[0]["iteration"] == 2
    store.delete_run("run")
    assert store.iterations("run") == []


def test_block_wraps_the_same_storage(tmp_path: Path) -> None:
    block = CheckpointStore(url=str(tmp_path), keep=1)
    block.save_checkpoint("run", 3, _state(3))
    assert block.load_latest("run")[1].iteration == 3
    assert CheckpointStorage(str(tmp_path)).iterations("run") == [3]


def test_keep_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        CheckpointStorage(str(tmp_path), keep=0)


def test_checkpoints_on_a_local_disk_are_private_whatever_the_umask(tmp_path: Path) -> None:
    import os
    import stat

    previous = os.umask(0o022)  # a notebook's or a pipeline task's
    try:
        CheckpointStorage(str(tmp_path)).save("private-run", 3, {"w": 1})
    finally:
        os.umask(previous)
    folder = tmp_path / "private-run"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert {stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()} == {0o600}
