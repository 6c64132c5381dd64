import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# One real Prefect server (and stack) per test process, for every folder: tests/stack.py.
from tests.stack import prefect_api, stack  # noqa: F401

DATA = Path(__file__).resolve().parents[1] / "data"
# The tests' own model factories (tests/runtime/user_models.py) are allowed as
# an operator allows a team's package; every process the tests start inherits it.
os.environ.setdefault("ELASTICFLOW_MODEL_MODULES", "tests.runtime")


@pytest.fixture
def data_dir() -> Path:
    return DATA


@pytest.fixture(autouse=True)
def _events_follow_the_current_server() -> Iterator[None]:
    """Prefect keeps one events worker per process, bound to the server it
    first talked to. Tests start and stop servers (the UI test's own, a test
    harness per module), and a worker bound to a stopped one drops every event,
    task-run states included: each test starts with none, so the next emit
    binds to the current server."""
    events = sys.modules.get("prefect.events.worker")
    if events is not None:
        events.EventsWorker.drain_all()
    yield
