"""The one way the project writes a Markdown table (Prefect artifacts,
reports), and the one way it shows text a user wrote (a run's name, a
state's message) on a terminal or a page: `printable`.

Cells are written as given: callers escape what needs escaping (`|`, new
lines), because only they know which cells hold user text.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

# C0 and C1 control characters and DEL: a name holding "\n\x1b[31mFAKE" must
# not start a line of its own, nor colour one, in `elasticflow status`.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text: object) -> str:
    """`text` with every control character written as its escape (`\\n`,
    `\\x1b`): one line, no terminal sequence, nothing lost to the reader."""
    value = str(text)
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), value)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A GitHub-flavoured table: header row, `|---|` rule, one line a row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)
