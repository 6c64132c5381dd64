"""The demo's outcome table (issue 46): a rejected run shows no finish, the
room a run had left is said in words, and piped, no cell is cut."""

from __future__ import annotations

import io
from datetime import datetime, timedelta, timezone

from rich.console import Console
from scheduler_service.cli.demo import RunEnd, outcome_table

T0 = datetime(2026, 12, 6, 19, 40, tzinfo=timezone.utc)


def _end(role: str, **fields: object) -> RunEnd:
    values: dict = dict(role=role, admitted=True, reason="", share=1, gpu_sets=["0,1", "1"], state="Completed",
                        end=T0 + timedelta(minutes=6), deadline=T0 + timedelta(minutes=10), submitted=T0)
    values.update(fields)
    return RunEnd(**values)


def test_a_rejected_run_shows_no_finish_and_the_room_left_is_said_in_words() -> None:
    rejected = _end("infeasible", admitted=False, reason="infeasible_even_on_an_idle_cluster", share=None,
                    gpu_sets=[], state="Rejected", end=T0 + timedelta(seconds=2))
    assert rejected.cells()[4:] == ("-", "19:50:00", "-", "-")  # it was cancelled at 19:40:02, never finished
    assert _end("long").cells()[6:] == ("yes", "40% of its window")
    late = _end("urgent", end=T0 + timedelta(minutes=16))
    assert late.cells()[6:] == ("no, late by 360 s", "none") and late.late and not late.failed
    assert _end("crashed", state="Crashed").failed


def test_piped_at_160_columns_no_cell_is_cut() -> None:
    table = outcome_table([_end("first-use"), _end("long", gpu_sets=["0,1", "1", "0,1"]), _end("urgent"),
                           _end("infeasible", admitted=False, reason="infeasible_even_on_an_idle_cluster",
                                share=None, gpu_sets=[], state="Rejected")])
    out = io.StringIO()
    Console(file=out, width=160).print(table)
    assert "…" not in out.getvalue() and "infeasible_even_on_an_idle_cluster" in out.getvalue()
