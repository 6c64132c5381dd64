from pathlib import Path

import pytest

from flows.training.control import ControlAck, FileControlChannel


def test_commands_are_sequenced_and_superseded(tmp_path: Path) -> None:
    channel = FileControlChannel("run-1", tmp_path)
    assert channel.pending(0) is None
    first = channel.request("rescale", [0, 1])
    second = channel.request("rescale", [2])
    assert (first.seq, second.seq) == (1, 2)
    assert channel.pending(0).gpus == [2]  # the newest command wins
    assert channel.pending(2) is None
    channel.acknowledge(ControlAck(seq=2, iteration=10, gpus=[2]))
    assert channel.acknowledged().seq == 2
    assert FileControlChannel("run-2", tmp_path).pending(0) is None  # keyed by run


def test_rescale_needs_gpus(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        FileControlChannel("run", tmp_path).request("rescale")
