"""The worker's settings: read once, a bad value is one line naming the
variable, and the docs' table is the model's."""

from __future__ import annotations

from pathlib import Path

import pytest

from scheduler_service.worker.settings import SettingsError, load_settings, settings_table

DOCS = Path(__file__).parents[2] / "docs" / "service.md"


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start from no ELASTICFLOW_* setting (a stack in this process may have set some)."""
    import os

    for name in [n for n in os.environ if n.startswith("ELASTICFLOW_")]:
        monkeypatch.delenv(name)


def test_defaults_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICFLOW_INTERVAL_S", "2")
    monkeypatch.setenv("ELASTICFLOW_POLL_S", "5")
    monkeypatch.setenv("ELASTICFLOW_WARM_START", "0")
    settings = load_settings()
    assert settings.interval_s == 2.0 and settings.effective_poll_s == 2.0  # at most a slot
    assert settings.warm_start is False and settings.launch_s is None and settings.policy == "elasticflow-overload"


@pytest.mark.parametrize(("name", "value", "says"), [
    ("ELASTICFLOW_INTERVAL_S", "soon", "a number"),
    ("ELASTICFLOW_POLL_S", "0", "greater than 0"),
    ("ELASTICFLOW_CPU_SLOTS", "0", "at least 1"),
    ("ELASTICFLOW_WARM_START", "maybe", "1 or 0"),
    ("ELASTICFLOW_POLICY", "fastest", "one of"),
    ("ELASTICFLOW_RANK_USER", "no-such-user-here", "no such user on this machine"),
    ("ELASTICFLOW_RANK_USER", "root", "name an unprivileged user"),
    ("ELASTICFLOW_RANK_GIDS", "9-1", "FIRST-LAST"),
])
def test_a_bad_value_stops_the_worker_with_one_line_naming_it(monkeypatch: pytest.MonkeyPatch, name: str,
                                                               value: str, says: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as caught:
        load_settings()
    text = str(caught.value)
    assert "\n" not in text and f"{name}={value}" in text and says in text


def test_the_docs_table_is_the_settings_model() -> None:
    assert settings_table() in DOCS.read_text(), "docs/service.md: paste settings_table()'s output"


def test_ranks_as_root_are_warned_of_and_an_unreadable_python_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import sys
    from pathlib import Path

    from flows.training.launch.identity import unreachable

    if os.geteuid() != 0:
        pytest.skip("the warning and the check are about a stack that runs as root")
    assert any("ELASTICFLOW_RANK_USER" in w for w in load_settings().warnings(restart_s=0.0))
    if unreachable(Path(sys.base_prefix) / "lib") is None:
        assert not any("RANK_USER" in w for w in load_settings(rank_user="nobody").warnings(restart_s=0.0))
    else:  # this machine's Python is out of reach of other users: the worker would not start its ranks
        monkeypatch.setenv("ELASTICFLOW_RANK_USER", "nobody")
        with pytest.raises(SettingsError, match="install Python and the project where it can read them"):
            load_settings()


def test_each_loop_default_has_one_home_that_the_worker_and_the_simulator_read() -> None:
    """The simulator planned with a safety margin read from the worker's
    settings, the loop's own default was 0.0 (issue 42): LoopSettings holds
    the service's defaults now."""
    from scheduler_service.loop import LoopSettings
    from scheduler_service.simulator.service import ServiceOptions

    worker, home = load_settings().loop(), LoopSettings()
    for name in ("policy", "interval_s", "poll_s", "launch_s", "safety_margin", "at_risk_s"):
        assert getattr(worker, name) == getattr(home, name), name
    assert ServiceOptions().safety_margin == home.safety_margin == 0.05
