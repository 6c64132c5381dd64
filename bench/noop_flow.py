"""The reference flow of bench/service.py: does nothing but record when its
body starts, so that deployment run -> body measures what Prefect itself costs."""

from __future__ import annotations

import time

from prefect import flow


@flow(name="noop", persist_result=False)
def noop(out: str) -> None:
    with open(out, "w") as fh:
        fh.write(repr(time.time()))
