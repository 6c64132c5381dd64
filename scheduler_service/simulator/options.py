"""Inputs some policies need beyond the trace, read at the simulator's edge so
the policies themselves stay pure (no file I/O)."""

from __future__ import annotations

from pathlib import Path

from scheduler_service.simulator.pollux_data import goodput_for


def policy_options(name: str, throughputs: Path) -> dict[str, object]:
    """Extra constructor arguments for policy `name`; none for most policies.

    Pollux gets the goodput model of the Pollux artifact when the throughput
    curves are the T4 ones it matches; otherwise it runs throughput-only.
    """
    if name == "pollux":
        model = goodput_for(throughputs)
        return {"goodput": model} if model is not None else {}
    return {}
