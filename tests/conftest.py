import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# One real Prefect server (and stack) per test process, for every folder: tests/stack.py.
from tests.stack import SHARED, USERS, prefect_api, stack  # noqa: F401
# One real Ray cluster per test process, for the tests of either transport: tests/ray_cluster.py.
from tests.ray_cluster import ray_address, ray_cluster  # noqa: F401

DATA = Path(__file__).resolve().parents[1] / "data"
# The tests' own model factories (tests/runtime/user_models.py) are allowed as
# an operator allows a team's package; every process the tests start inherits it.
os.environ.setdefault("ELASTICFLOW_MODEL_MODULES", "tests.runtime")


@pytest.hookimpl(trylast=True)  # after the folders' hooks have marked their tests slow
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules with slow tests first, each module's order kept: xdist hands
    out work in this order, and a long test handed out last is a suite that
    ends with one worker busy and the other idle."""
    slow_modules = {getattr(item, "module", None) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: getattr(item, "module", None) not in slow_modules)


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


# The session's server and stack run during the tests that use them and are
# stopped between (tests/stack.py, `Shared`): woken before any fixture of the
# test is set up (a session fixture built on them talks to the server as it is
# made), stopped once its teardown is done.
@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if USERS & set(getattr(item, "fixturenames", ())):
        SHARED.wake()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        if USERS & set(getattr(item, "fixturenames", ())):
            SHARED.sleep()
