"""Inputs some policies need beyond the trace, read at the simulator's edge so
the policies themselves stay pure (no file I/O)."""

from __future__ import annotations

from pathlib import Path


def policy_options(name: str, throughputs: Path) -> dict[str, object]:
    """Extra constructor arguments for policy `name`; none for most policies."""
    return {}
