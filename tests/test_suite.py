"""The suite's own assumptions about how it is run."""

from __future__ import annotations

import pytest


@pytest.mark.xdist_group("guard")
def test_xdist_groups_reach_the_scheduler(request: pytest.FixtureRequest) -> None:
    """The Ray and browser tests share one stack per group, which holds only
    if xdist sends a group to one worker: pytest 9.2 silently dropped the
    marks (pytest-dev/pytest-xdist#1386) and each worker started its own."""
    if not getattr(request.config.option, "loadgroup", False):
        # Run alone or without xdist there are no groups to check; `make test` runs it with them.
        pytest.skip("not run under `-n N --dist loadgroup`")
    assert request.node.nodeid.endswith("@guard"), request.node.nodeid
