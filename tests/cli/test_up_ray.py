"""`up --ray` refuses what could only fail later, at once and in one line:
a loopback cluster whose nodes no placement could use, a head nobody runs."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from typer.testing import CliRunner

from scheduler_service.cli import _register, app

_register()


def _up(home: Path, ray: str) -> tuple[int, str, float]:
    started = time.monotonic()
    result = CliRunner().invoke(app, ["up", "--home", str(home), "--ray", ray])
    return result.exit_code, result.output, time.monotonic() - started


def test_a_head_that_does_not_answer_is_named_in_seconds_and_nothing_starts(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]  # bound, never listening: a connection is refused
        code, output, took = _up(tmp_path, f"127.0.0.1:{closed}")
    assert code == 2 and f"127.0.0.1:{closed}: no Ray head answers there" in output, output
    assert took < 10 and "starting Prefect server" not in output
    assert not (tmp_path / "logs").exists()


def test_a_local_cluster_of_three_slots_a_node_is_refused_when_parsed(tmp_path: Path) -> None:
    code, output, _ = _up(tmp_path, "local:2x3")
    assert code == 2 and "G=3 worker slots per node is not a power of two" in output, output
    assert not (tmp_path / "logs").exists()
