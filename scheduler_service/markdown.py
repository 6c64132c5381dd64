"""The one way the project writes a Markdown table (Prefect artifacts,
reports). Text a user wrote is shown through `scheduler_service.text`.

Cells are written as given: callers escape what needs escaping (`|`, new
lines), because only they know which cells hold user text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub-flavoured table: header row, `|---|` rule, one line a row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
