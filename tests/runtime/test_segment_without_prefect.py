"""A training segment does not depend on Prefect being there (issue 43: an
admitted run crashed on an HTTP error while its server restarted). Its task
run is Prefect's window onto it: when Prefect cannot be reached to open that
window, the segment runs all the same, once."""

from __future__ import annotations

import socket

import pytest

from flows.train import _as_task


def test_a_segment_runs_once_when_prefect_cannot_be_reached() -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with socket.socket() as probe:  # a port nothing listens on: the server is down
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launched: list[int] = []

    def launch() -> str:
        launched.append(1)
        return "the segment's result"

    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}):
        result = _as_task(launch, "segment-0-it0-gpus0")  # type: ignore[arg-type]
    assert result == "the segment's result"  # type: ignore[comparison-overlap]
    assert launched == [1]


def test_a_launch_that_fails_is_not_run_again() -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    launched: list[int] = []

    def launch() -> str:
        launched.append(1)
        raise OSError("no rank started")

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}):
        with pytest.raises(OSError, match="no rank started"):
            _as_task(launch, "segment-0-it0-gpus0")  # type: ignore[arg-type]
    assert launched == [1]
